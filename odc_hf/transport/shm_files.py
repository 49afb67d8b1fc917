"""Shared-memory files: create, map, sweep.

Every file is named ``odc-<job>-<pid>-<tag>``. Files are unlinked as soon as every rank has mapped them (the
mappings stay valid), so a crash leaves nothing behind except in the short window between creating a file and
the end of registration; :func:`sweep_stale` removes such leftovers when the next job starts.

Liveness proof: the creator holds an advisory lock (``flock``) on its file from creation until it unlinks it
(:class:`SharedFile`); a file whose lock can be taken has no living creator. A pid is no such proof: jobs in
different pid namespaces (containers sharing /dev/shm) cannot see each other's pids, and a pid can be reused.
The lock is taken under a temporary name that the sweep ignores and the file is then renamed into place, so no
sweep can find a live file before its lock is held.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path

import torch

_NAME = re.compile(r"^odc-[0-9a-f]+-(\d+)-")
_ALIGN = 256


def align(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def new_job_id() -> str:
    return uuid.uuid4().hex[:12]


def pick_dir(nbytes: int, preferred: str | None = None) -> Path:
    """``preferred`` if given, else /dev/shm when it has room for ``nbytes`` (+25%), else the temp directory."""
    if preferred:
        return Path(preferred)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= nbytes * 1.25:
        return shm
    return Path(tempfile.gettempdir())


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A process that exited but was not reaped yet (its launcher is busy) is a zombie: dead for us.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def _lock_is_free(path: Path) -> bool:
    """Whether nobody holds the creator's lock on ``path`` (then its creator is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False  # vanished or unreadable: not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return False  # a filesystem without flock: keep the file rather than guess
    else:
        return True
    finally:
        os.close(fd)  # also releases the lock we may have taken


def sweep_stale(directory: Path) -> list[Path]:
    """Remove ``odc-*`` files that no living process holds (see the module docstring). Returns what was removed."""
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for path in entries:
        if _NAME.match(path.name) and _lock_is_free(path):
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed


class SharedFile:
    """A zero-filled file of ``nbytes`` that this process created and holds locked until :meth:`release`.

    ``os.fspath(shared_file)`` is its path; map it with :func:`map_file`. Call :meth:`release` once every rank has
    mapped it: that unlinks the file (the mappings stay valid) and drops the lock.
    """

    def __init__(self, directory: Path, job: str, tag: str, nbytes: int):
        directory = Path(directory)
        name = f"odc-{job}-{os.getpid()}-{tag}"
        staging = directory / f".creating-{name}"  # not matched by the sweep until renamed, lock held
        self._fd = os.open(staging, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH)  # shared: several of our own descriptors may hold it
            os.ftruncate(self._fd, nbytes)
            self.path = directory / name
            os.rename(staging, self.path)
        except BaseException:
            os.close(self._fd)
            unlink_quietly(staging)
            raise

    def __fspath__(self) -> str:
        return str(self.path)

    def release(self) -> None:
        """Unlink the file and drop the lock. Safe to call twice."""
        if self._fd is None:
            return
        unlink_quietly(self.path)
        os.close(self._fd)
        self._fd = None


def create(directory: Path, job: str, tag: str, nbytes: int) -> SharedFile:
    """Create a zero-filled, locked file of ``nbytes`` for this process (see :class:`SharedFile`)."""
    return SharedFile(directory, job, tag, nbytes)


def map_file(path: str | os.PathLike, nbytes: int) -> torch.Tensor:
    """Map a file shared (MAP_SHARED) as a uint8 tensor; writes are seen by every process mapping it."""
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def unlink_quietly(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
