"""The files CUDA IPC leaves in /dev/shm, and who removes them (odc_hf/transport/ipc_files.py), on CPU.

CUDA IPC itself needs a GPU (tests/gpu/test_gpu_shm_files.py runs the real thing: /dev/shm before and after a job that
ends cleanly, raises, is interrupted, or loses a rank to ``kill -9``). Here real processes play the ranks of a job in
a directory standing in for /dev/shm: each keeps a ledger, plants the files torch and the CUDA driver would make
(named as they name them: ``torch_<pid>_<random>_<n>``, ``cuda.shm.<n>.<pid hex>.<m>``), records which of its peers'
counter files it mapped, and then ends in one of the ways a rank ends. What must hold:

- a clean end, an exception, Ctrl-C: each process removes its driver file and its ledger; the counter files are
  torch's to remove (it unlinks them when their count reaches zero: removing one before would make torch's own unlink
  fail, an assertion in a destructor), so they stay here, where no torch holds them;
- a rank killed with ``kill -9``: its peer removes, at its own end, everything the dead one made and every counter
  file it had mapped (their counts can no longer reach zero), its own included;
- SIGTERM (a launcher stopping the ranks): each removes what only it holds, and the last one everything;
- what no process removed is swept at the next start, and only that: files of jobs with a live process, files no
  ledger lists, and files whose pid lives are never touched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from odc_hf.transport import ipc_files

RANK = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from odc_hf.transport import ipc_files

    # Ctrl-C as at a terminal: a job a shell started in the background (CI, nohup ... &) inherits SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)

    directory, job = Path(sys.argv[1]), sys.argv[2]
    ledger = ipc_files.IpcLedger(job, directory)
    pid = os.getpid()
    counter = f"torch_{pid}_4242_0"   # what torch's first _share_cuda_ makes
    for name in (counter, f"cuda.shm.0.{pid:x}.1"):   # and the driver's interprocess-event file
        (directory / name).write_bytes(b"x")
    ledger.record_own([counter])
    ledger.record_driver_files()
    print(pid, flush=True)
    ledger.record_mapped(sys.stdin.readline().split())   # the peers' counter files, once they exist
    print("mapped", flush=True)
    for command in iter(sys.stdin.readline, ""):
        command = command.strip()
        if command == "release":
            ledger.released()
        elif command == "fork-and-term":   # a forked child (a data loader worker) dying of SIGTERM
            child = os.fork()
            if child == 0:
                os.kill(os.getpid(), 15)
                os._exit(0)
            os.waitpid(child, 0)
        elif command == "raise":
            raise RuntimeError("a rank failed")
        elif command == "exit":
            sys.exit(0)
        print("done", flush=True)
    """
)


class Rank:
    """A process playing one rank of ``job``, with its ledger and planted files in ``directory``."""

    def __init__(self, directory: Path, job: str):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                            os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        self.proc = subprocess.Popen([sys.executable, "-c", RANK, str(directory), job], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
        line = self.proc.stdout.readline()
        assert line.strip().isdigit(), line + self.proc.stderr.read()
        self.pid = int(line)
        self.counter = f"torch_{self.pid}_4242_0"
        self.driver = f"cuda.shm.0.{self.pid:x}.1"
        self.ledger = f"odc-ipc-{job}-{self.pid}"

    def send(self, line: str, expect: str | None = None) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        if expect is not None:
            got = self.proc.stdout.readline().strip()
            assert got == expect, (got, self.proc.stderr.read() if self.proc.poll() is not None else "")

    def map_peers(self, *peers: Rank) -> None:
        self.send(" ".join(p.counter for p in peers), expect="mapped")

    def end(self, how: str) -> int:
        """End this rank: ``exit``, ``raise`` (through stdin), or a signal's name; returns its exit status."""
        if how in ("exit", "raise"):
            self.send(how)
        else:
            self.proc.send_signal(getattr(signal, how))
        return self.proc.wait(timeout=60)


def _job(directory: Path, job: str, size: int = 2) -> list[Rank]:
    ranks = [Rank(directory, job) for _ in range(size)]
    for rank in ranks:
        rank.map_peers(*[r for r in ranks if r is not rank])
    return ranks


def _listing(directory: Path) -> set[str]:
    return set(os.listdir(directory))


@pytest.fixture
def shm(tmp_path):
    """A stand-in for /dev/shm holding an unrelated program's files (a dead pid's torch and driver files that no
    ledger lists): they must survive everything below."""
    directory = tmp_path / "shm"
    directory.mkdir()
    dead = _dead_pid()
    for name in (f"torch_{dead}_1_0", f"cuda.shm.0.{dead:x}.1", "sem.loky-1"):
        (directory / name).write_bytes(b"other program")
    return directory


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("how", ["exit", "raise", "SIGINT"])
def test_a_clean_end_an_exception_or_ctrl_c_leave_only_the_counter_files_to_torch(shm, how):
    before = _listing(shm)
    a, b = _job(shm, "ab12cd34")
    for rank in (a, b):
        rank.send("release", expect="done")  # the transport closed (the trainer's end, or interpreter exit)
    statuses = [a.end(how), b.end(how)]
    assert statuses == [0, 0] if how == "exit" else all(s != 0 for s in statuses), statuses
    # the driver files and the ledgers are gone; the counter files wait for torch (the last holder unlinks it)
    assert _listing(shm) == before | {a.counter, b.counter}


def test_a_rank_killed_with_sigkill_is_cleaned_by_its_peer_at_its_end(shm):
    before = _listing(shm)
    a, b = _job(shm, "ab12cd35")
    assert b.end("SIGKILL") == -signal.SIGKILL
    assert b.ledger in _listing(shm)  # nobody has cleaned yet: the survivor does at its end
    a.send("release", expect="done")
    assert a.end("raise") != 0  # the survivor stops with the peer's failure, as ODC makes it
    # b's files, and a's counter file (b's references to it are never given back), are gone: /dev/shm as before
    assert _listing(shm) == before


def test_a_rank_killed_after_letting_go_of_its_mappings_leaves_its_peers_counter_file_to_torch(shm):
    before = _listing(shm)
    a, b = _job(shm, "ab12cd3b")
    b.send("release", expect="done")  # b's transport closed: its references to a's counter file were given back
    assert b.end("SIGKILL") == -signal.SIGKILL
    a.send("release", expect="done")
    assert a.end("exit") == 0
    # b's own files go (its own reference never does); a's counter file is torch's to unlink, as after a clean end
    assert _listing(shm) == before | {a.counter}


def test_ranks_stopped_with_sigterm_clean_up_among_themselves(shm):
    before = _listing(shm)
    a, b, c = _job(shm, "ab12cd36", size=3)
    assert b.end("SIGKILL") == -signal.SIGKILL  # one rank fails; the launcher then stops the others
    assert a.end("SIGTERM") == -signal.SIGTERM  # still dies of SIGTERM, after its cleanup
    left = _listing(shm) - before
    assert a.counter not in left and a.driver not in left and a.ledger in left  # kept for c: a held c's counter
    assert c.end("SIGTERM") == -signal.SIGTERM  # the last one: everything
    assert _listing(shm) == before


def test_a_forked_child_dying_of_sigterm_leaves_its_parents_files(shm):
    a, b = _job(shm, "ab12cd37")
    a.send("fork-and-term", expect="done")
    assert {a.counter, a.driver, a.ledger} <= _listing(shm)
    for rank in (a, b):
        rank.send("release", expect="done")
        rank.end("exit")


def test_the_next_start_sweeps_dead_jobs_only(shm):
    before = _listing(shm)
    live = _job(shm, "ab12cd39")  # another job, running: its files are its own
    dead_job = _job(shm, "ab12cd38")
    for rank in dead_job:
        rank.end("SIGKILL")  # the whole job killed: nobody cleaned
    live_files = {f for r in live for f in (r.counter, r.driver, r.ledger)}
    left_by_dead = {f for r in dead_job for f in (r.counter, r.driver, r.ledger)}
    reused = f"torch_{os.getpid()}_5_0"  # listed by a dead ledger, but its pid lives (pid reuse): kept
    (shm / reused).write_bytes(b"x")
    with open(shm / dead_job[0].ledger, "a") as f:
        f.write(f"mapped {reused}\n")
    assert left_by_dead | live_files <= _listing(shm)
    new = Rank(shm, "ab12cd3a")  # the next job's first ledger sweeps
    assert _listing(shm) == before | live_files | {reused} | {new.counter, new.driver, new.ledger}
    new.map_peers()
    for rank in (*live, new):
        rank.send("release", expect="done")
        rank.end("exit")
    assert _listing(shm) == before | {r.counter for r in (*live, new)} | {reused}
    assert ipc_files.sweep_stale(shm) == []  # nothing of a dead job is left


# -- the names torch and the driver use --------------------------------------------------------------------------------
def test_the_counter_file_is_read_from_torchs_rebuild_arguments_by_name():
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    names = list(inspect.signature(rebuild_cuda_tensor).parameters)
    args = [None] * len(names)
    args[names.index("ref_counter_handle")] = b"/torch_1234_987654_0"  # as _share_cuda_ returns it
    assert ipc_files.counter_file(rebuild_cuda_tensor, tuple(args)) == "torch_1234_987654_0"
    args[names.index("ref_counter_handle")] = None  # a zero-size storage: no counter file
    assert ipc_files.counter_file(rebuild_cuda_tensor, tuple(args)) is None


def test_file_names_give_their_creators_pid(tmp_path):
    assert ipc_files.file_pid("torch_1234_987654_0") == 1234
    assert ipc_files.file_pid("cuda.shm.0.4d2.1") == 0x4D2
    assert ipc_files.file_pid("odc-ab12-1234-control") is None and ipc_files.file_pid("sem.loky-1") is None
    for name in ("cuda.shm.0.4d2.1", "cuda.shm.0.4d3.1", "torch_1234_1_0"):
        (tmp_path / name).write_bytes(b"")
    assert ipc_files.driver_files(0x4D2, tmp_path) == ["cuda.shm.0.4d2.1"]


def test_a_sweep_waits_while_any_process_of_the_job_lives(tmp_path, monkeypatch):
    monkeypatch.setattr(ipc_files, "_register", lambda ledger: None)  # no exit hooks in the test process
    ledger = ipc_files.IpcLedger("ab12cd40", tmp_path)  # this process: alive
    (tmp_path / "torch_999999_1_0").write_bytes(b"")
    dead_peer = tmp_path / "odc-ipc-ab12cd40-999999"  # a peer of the same job, dead (its lock is free)
    dead_peer.write_text("own torch_999999_1_0\n")
    assert ipc_files.sweep_stale(tmp_path) == []  # the live rank cleans after its peer, not a stranger
    removed = ledger.exit_cleanup()
    assert set(removed) == {"torch_999999_1_0", dead_peer.name} and os.listdir(tmp_path) == []
