"""The shared-memory files that CUDA IPC leaves in /dev/shm, and who removes them.

Ranks that map each other's CUDA buffers through CUDA IPC (``torch.multiprocessing.reductions.reduce_tensor``,
:class:`odc_hf.transport.peer_memory.IpcBuffers`) make two kinds of file per exporting process:

* ``torch_<pid>_<random>_<n>`` (80,064 bytes): torch's reference counters of the exported blocks. The first
  ``storage._share_cuda_()`` of a process creates it (``GetNewRefCountedSentData`` in torch/csrc/CudaIPCTypes.cpp:
  ``at::NewProcessWideShmHandle()``, a ``RefcountedMapAllocator`` with ``ALLOCATOR_MAPPED_SHAREDMEM |
  ALLOCATOR_MAPPED_EXCLUSIVE``: 10,000 int64 counters after a 64-byte header holding a process count); every block
  a peer rebuilds opens it again (``_new_shared_cuda`` -> ``StorageNewSharedDevice``, ``ALLOCATOR_MAPPED_NOCREATE``,
  count + 1). ``RefcountedMapAllocator::close`` unlinks it when the count drops to zero, which it does when every
  process has freed its blocks (the creator at its static destruction, ``~CudaIPCGlobalEntities``). A process that
  dies holding references (``kill -9``, a crash, SIGTERM's default action) never gives them back: the file stays,
  and torch's close must then never find it gone while the count can still reach zero (it asserts, in a
  destructor: the process aborts).
* ``cuda.shm.<n>.<pid in hex>.<m>``: the CUDA driver's backing of interprocess events. torch records one per exported
  block (``CudaIPCSentData``: ``cudaEventCreateWithFlags(cudaEventInterprocess)``; ``cudaIpcGetEventHandle`` in
  ``_share_cuda_``) and peers open it by name (``cudaIpcOpenEventHandle``). Nothing in torch's sources names it;
  the driver does not remove it when the process exits, cleanly or not.

Each process that exports keeps a **ledger** here, ``odc-ipc-<job>-<pid>``, locked (``flock``) for its whole life:
the files it created (``own``), the reference-counter files of the peers it mapped (``mapped``), and ``released``
once it let go of its mappings. A ledger whose lock can be taken belongs to a dead process (:mod:`shm_files`'s
liveness proof: pids are no proof across pid namespaces or after reuse). Who removes what:

* **exit** (a clean end, an exception, Ctrl-C; :func:`exit_cleanup` at interpreter exit): the process removes its
  driver file and its ledger; torch removes the counter files as every process lets go.
* **a process that died before its exit cleanup** (its ledger still there, unlocked): a peer, at its own exit,
  removes the dead one's files (its own reference to its counter file never goes) and, unless it had ``released``
  them, every counter file it had mapped (the peer's own included): the dead process's references keep each count
  above zero, so no live process's torch ever goes to unlink them. Then its ledger.
* **SIGTERM** (what torchrun and ``accelerate launch`` send the other ranks when one fails): the default action
  would kill without any cleanup; the handler installed here (only where none was) does the exit cleanup of a dying
  process, then dies of SIGTERM as before: it removes its driver file and its own counter file (its own reference
  never goes), keeps its ledger for the peers while any lives, and removes the files it mapped when it is the last.
* **the next start** (:func:`sweep_stale`, when a job creates its first ledger): ledgers of jobs none of whose
  processes lives (every ledger of the job unlocked): their listed files, where the pid in the name is not alive,
  then the ledgers. Files of other programs, and of jobs with a live process, are never touched.
"""

from __future__ import annotations

import atexit
import fcntl
import inspect
import logging
import os
import re
import signal
import threading
import weakref
from pathlib import Path

from odc_hf.transport import shm_files

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
"""Where POSIX shared memory (``shm_open``) lives on Linux: torch's and the CUDA driver's files are made there."""
LEDGER_PREFIX = "odc-ipc-"  # not matched by shm_files' sweep ("ipc" is not hex)
_LEDGER = re.compile(rf"^{LEDGER_PREFIX}([0-9a-f]+)-(\d+)$")
_TORCH_COUNTERS = re.compile(r"^torch_(\d+)_\d+_\d+$")
_DRIVER_EVENTS = re.compile(r"^cuda\.shm\.\d+\.([0-9a-fA-F]+)\.\d+$")


def file_pid(name: str) -> int | None:
    """The pid of the process that created the file ``name`` (a torch counter file or a driver event file)."""
    if match := _TORCH_COUNTERS.match(name):
        return int(match.group(1))
    if match := _DRIVER_EVENTS.match(name):
        return int(match.group(1), 16)
    return None


def driver_files(pid: int, directory: Path = SHM_DIR) -> list[str]:
    """The CUDA driver's interprocess-event files of process ``pid`` in ``directory``."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(n for n in names if _DRIVER_EVENTS.match(n) and file_pid(n) == pid)


def counter_file(rebuild, args) -> str | None:
    """The name (in /dev/shm) of the reference-counter file of a CUDA tensor shared by ``reduce_tensor``: its rebuild
    function's ``ref_counter_handle`` argument (``b"/torch_<pid>_<random>_<n>"``), found by the parameter's name."""
    try:
        index = list(inspect.signature(rebuild).parameters).index("ref_counter_handle")
    except (TypeError, ValueError):
        return None
    handle = args[index] if index < len(args) else None
    if isinstance(handle, bytes):
        handle = handle.decode("utf-8", "replace")
    if not isinstance(handle, str) or not handle:
        return None
    name = handle.lstrip("/")
    return name if _TORCH_COUNTERS.match(name) else None


def _read(path: Path) -> tuple[set[str], set[str], bool]:
    """A ledger's ``own`` and ``mapped`` names and whether it says ``released``."""
    own, mapped, released = set(), set(), False
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return own, mapped, released
    for line in lines:
        kind, _, name = line.partition(" ")
        if kind == "own" and name:
            own.add(name)
        elif kind == "mapped" and name:
            mapped.add(name)
        elif kind == "released":
            released = True
    return own, mapped, released


def _held(path: Path) -> bool:
    """Whether a living process holds ``path``'s lock (``shm_files``' proof; an unreadable file counts as held)."""
    return path.exists() and not shm_files._lock_is_free(path)


def _remove(directory: Path, names, *, only_dead_pids: bool = False) -> list[str]:
    removed = []
    for name in sorted(names):
        pid = file_pid(name)
        if pid is None or (only_dead_pids and shm_files.pid_alive(pid)):
            continue
        try:
            (directory / name).unlink()
            removed.append(name)
        except FileNotFoundError:
            pass
        except OSError as err:
            logger.debug("odc_hf: could not remove %s: %s", directory / name, err)
    return removed


def _ledger_pid(path: Path) -> int:
    return int(_LEDGER.match(path.name).group(2))


def _job_ledgers(directory: Path, job: str) -> list[Path]:
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return [directory / n for n in names if (m := _LEDGER.match(n)) and m.group(1) == job]


def sweep_stale(directory: Path = SHM_DIR) -> list[str]:
    """Remove what dead jobs left (see the module docstring, "the next start"). Returns the names removed."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    jobs: dict[str, list[Path]] = {}
    for name in names:
        if match := _LEDGER.match(name):
            jobs.setdefault(match.group(1), []).append(directory / name)
    removed = []
    for ledgers in jobs.values():
        if any(_held(path) for path in ledgers):
            continue  # a process of that job lives: it, not this one, cleans up after its peers
        for path in ledgers:
            own, mapped, _ = _read(path)
            found = set(driver_files(_ledger_pid(path), directory))  # also those made after its last record
            removed += _remove(directory, own | mapped | found, only_dead_pids=True)
            shm_files.unlink_quietly(path)
            removed.append(path.name)
    return removed


class IpcLedger:
    """This process's ledger for one job (one transport's ranks), in ``directory``; see the module docstring.

    ``record_own`` / ``record_mapped`` after each export / mapping, ``released`` once the mappings are let go;
    :func:`exit_cleanup` runs at interpreter exit (and on SIGTERM) for every ledger still open."""

    def __init__(self, job: str, directory: Path = SHM_DIR):
        self.job, self.directory, self.pid = job, Path(directory), os.getpid()
        sweep_stale(self.directory)
        self.path = self.directory / f"{LEDGER_PREFIX}{job}-{self.pid}"
        staging = self.directory / f".creating-{self.path.name}"  # no sweep sees it before its lock is held
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_APPEND | os.O_CLOEXEC
        self._fd: int | None = os.open(staging, flags, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH)  # held until this process ends (or the ledger is closed)
            os.rename(staging, self.path)
        except BaseException:
            os.close(self._fd)
            shm_files.unlink_quietly(staging)
            raise
        self.own: set[str] = set()
        self.mapped: set[str] = set()
        self.is_released = False
        _register(self)

    def _append(self, line: str) -> None:
        if self._fd is not None and os.getpid() == self.pid:  # not from a forked child's copy
            os.write(self._fd, (line + "\n").encode())

    def record_own(self, names) -> None:
        for name in names:
            if name and name not in self.own:
                self.own.add(name)
                self._append(f"own {name}")

    def record_mapped(self, names) -> None:
        for name in names:
            if name and name not in self.mapped and name not in self.own:
                self.mapped.add(name)
                self._append(f"mapped {name}")

    def record_driver_files(self) -> None:
        """After an export: the driver's event files of this process (made at its first interprocess event)."""
        self.record_own(driver_files(self.pid, self.directory))

    def released(self) -> None:
        """This process no longer maps the peers' blocks (its transport closed): peers must not count on its
        references keeping the counter files alive."""
        if not self.is_released:
            self.is_released = True
            self._append("released")

    def _dead_peers(self) -> list[Path]:
        return [p for p in _job_ledgers(self.directory, self.job) if p != self.path and not _held(p)]

    def _others_alive(self) -> bool:
        return any(_held(p) for p in _job_ledgers(self.directory, self.job) if p != self.path)

    def exit_cleanup(self, *, dying: bool = False) -> list[str]:
        """What this process removes when it ends (see the module docstring). ``dying``: it will not let go of its
        references (a SIGTERM handler). Returns the names removed. Idempotent; a no-op in a forked child (a data
        loader worker inherits the ledger, not the files)."""
        if self._fd is None or os.getpid() != self.pid:
            return []
        drivers = {n for n in self.own if n.startswith("cuda.shm.")} | set(driver_files(self.pid, self.directory))
        removed = _remove(self.directory, drivers)
        for peer in self._dead_peers():  # died before its exit cleanup: its own reference to its files never goes
            own, mapped, released = _read(peer)
            gone = own | set(driver_files(_ledger_pid(peer), self.directory))
            if not released:  # it held its mappings too: the counter files it mapped stay above zero as well
                gone |= mapped
            removed += _remove(self.directory, gone)
            shm_files.unlink_quietly(peer)
            removed.append(peer.name)
        if dying:
            removed += _remove(self.directory, self.own)  # our own references never go: nobody reaches zero
            if self._others_alive():
                self._close(unlink=False)  # the ledger stays (unlocked once we are gone) for the peers
                return removed
            if not self.is_released:
                removed += _remove(self.directory, self.mapped)  # the last: our references keep them for ever
        self._close(unlink=True)
        return removed

    def _close(self, *, unlink: bool) -> None:
        if unlink:
            shm_files.unlink_quietly(self.path)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# -- the process's ledgers, cleaned at exit and on SIGTERM -------------------------------------------------------------
_LEDGERS: list[weakref.ref] = []
_RELEASERS: list = []  # callables letting go of the mappings before the exit cleanup (IpcBuffers.close)
_HOOKED: list[bool] = []


def _register(ledger: IpcLedger) -> None:
    _LEDGERS.append(weakref.ref(ledger))
    if _HOOKED:
        return
    _HOOKED.append(True)
    atexit.register(_at_exit)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def add_releaser(release) -> None:
    """``release()`` lets go of this process's peer mappings; called at interpreter exit before the cleanup."""
    _RELEASERS.append(release)


def _open_ledgers() -> list[IpcLedger]:
    """This process's open ledgers (none in a forked child: they belong to the parent)."""
    pid = os.getpid()
    return [ledger for ref in _LEDGERS if (ledger := ref()) is not None and ledger._fd is not None and ledger.pid == pid]


def _at_exit() -> None:
    if not _open_ledgers():
        return  # nothing of this process (or a forked child's exit)
    for release in reversed(_RELEASERS):
        try:
            release()
        except Exception as err:  # noqa: BLE001 - cleanup at exit must not stop the other steps
            logger.debug("odc_hf: releasing CUDA IPC mappings at exit: %s", err)
    for ledger in _open_ledgers():
        try:
            ledger.exit_cleanup()
        except Exception as err:  # noqa: BLE001
            logger.debug("odc_hf: CUDA IPC files at exit: %s", err)


def _on_sigterm(signum, frame) -> None:
    for ledger in _open_ledgers():
        try:
            ledger.exit_cleanup(dying=True)
        except Exception:  # noqa: BLE001 - the process dies next whatever happens here
            pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)  # die of SIGTERM, as without the handler


__all__ = ["IpcLedger", "SHM_DIR", "add_releaser", "counter_file", "driver_files", "file_pid", "sweep_stale"]
