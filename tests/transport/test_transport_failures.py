"""A dead, hung or failing peer makes the other ranks raise promptly, naming the peer; no files are left."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from odc_hf.testing import rank_device, run_ranks
from odc_hf.transport import UnitSpec, make_transport, shm_files
from odc_hf.transport.base import PeerFailedError, PeerTimeoutError

BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # GPU runs: tests/README.md


def _skip_unless(backend: str, world_size: int) -> None:
    if backend == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (ranks share it when there are fewer GPUs than ranks)")


def _setup(rank, backend, timeout_s, shm_dir=None):
    device = rank_device()
    transport = make_transport(device=device, timeout_s=timeout_s, shm_dir=shm_dir)
    unit = transport.register(UnitSpec(name="layer0", shard_numel=1024, param_dtype=torch.bfloat16))
    transport.barrier(what="publish barrier")
    return transport, unit, device


# The configured timeout per failure: a dead or raising peer must be reported as such (PeerFailedError) long before
# a generous timeout; a hung one can only be reported by the timeout, kept short so that the test is quick.
TIMEOUT_S = {"dies": 60.0, "killed": 60.0, "raises": 60.0, "hangs": 3.0}


def _victim_ranks(rank, world_size, backend, how, timeout_s, release_dir, shm_dir):
    import signal

    transport, unit, device = _setup(rank, backend, timeout_s, shm_dir)
    transport.minibatch = 3
    if rank == world_size - 1:
        if how == "dies":
            os._exit(7)
        if how == "killed":  # no Python exit path at all: the kernel ends it
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "hangs":  # until every survivor has given up on it (an event, not a guess at their timing)
            deadline = time.monotonic() + 120
            while len(os.listdir(release_dir)) < world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            return "released"
        if how == "raises":
            with transport:
                raise ValueError("bad batch on the last rank")
    start = time.monotonic()
    try:
        transport.scatter_accumulate(unit, torch.ones(world_size * 1024, device=device))
        transport.barrier(what="minibatch barrier")
    except (PeerFailedError, PeerTimeoutError) as err:
        return type(err).__name__, str(err), time.monotonic() - start
    finally:
        Path(release_dir, str(rank)).touch()
    return "no error", "", time.monotonic() - start


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["dies", "killed", "hangs", "raises"])
def test_failed_peer_is_named_within_the_timeout(backend, how, tmp_path):
    world_size = 2 if backend == "cuda" else 3
    _skip_unless(backend, world_size)
    timeout_s = TIMEOUT_S[how]
    shm_dir, release_dir = tmp_path / "shm", tmp_path / "release"
    shm_dir.mkdir()
    release_dir.mkdir()
    outcomes = run_ranks(
        _victim_ranks, world_size, backend, how, timeout_s, str(release_dir), str(shm_dir),
        cuda=backend == "cuda", raise_on_failure=False, timeout_s=180,
    )  # fmt: skip
    assert not list(shm_dir.iterdir()), "a failed job left shared-memory files behind"
    victim = world_size - 1
    for o in outcomes[:victim]:
        assert o.ok, o.error
        kind, message, waited = o.value
        assert f"rank(s) [{victim}]" in message or f"rank {victim}" in message, message
        assert "minibatch barrier of minibatch 3" in message, message
        if how == "hangs":
            # It waited out the timeout and no more: the wait loop sleeps <= 2 ms between checks, so anything past
            # the timeout is scheduling delay (well under a second even on a loaded 2-core machine; bound: 5x the timeout).
            assert kind == "PeerTimeoutError" and timeout_s <= waited < 5 * timeout_s, (kind, waited)
        else:
            # Reported as a failure, not a timeout: detected from the peer's abort flag / its pid (checked every
            # 50 ms), which a quarter of the timeout leaves ample room for under any load.
            assert kind == "PeerFailedError" and waited < timeout_s / 4, (kind, waited)
        if how == "raises":
            assert "bad batch on the last rank" in message
        if how in ("dies", "killed"):
            assert "died" in message
    if how == "hangs":
        assert outcomes[victim].value == "released"


def _count_files(rank, world_size, directory):
    before = {p.name for p in Path(directory).iterdir()}
    transport = make_transport(timeout_s=30, shm_dir=directory)
    for i in range(3):
        transport.register(UnitSpec(name=f"u{i}", shard_numel=4096, param_dtype=torch.float32))
    torch.distributed.barrier()  # every rank is past its unlink (each unlinks its own file after registering)
    during = {p.name for p in Path(directory).iterdir()} - before
    transport.close()
    transport.close()  # idempotent
    return sorted(during)


def test_buffers_leave_no_files_and_stale_files_are_swept(tmp_path):
    during = run_ranks(_count_files, 2, str(tmp_path))
    assert during == [[], []]  # unlinked as soon as every rank has mapped them
    # Nobody holds these: swept, whatever pid the name carries (ours is alive, yet the file is an orphan).
    dead = tmp_path / "odc-0123abcd-999999999-unit0"
    orphan = tmp_path / f"odc-0123abcd-{os.getpid()}-unit1"
    other = tmp_path / "unrelated"
    for p in (dead, orphan, other):
        p.write_bytes(b"x")
    held = shm_files.create(tmp_path, "4567cdef", "control", 64)  # a live job of this process
    assert sorted(shm_files.sweep_stale(tmp_path)) == sorted([dead, orphan])
    assert other.exists() and held.path.exists()
    held.release()
    assert not held.path.exists()
    held.release()  # idempotent


_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
fcntl.flock(fd, fcntl.LOCK_SH)
print("locked", flush=True)
sys.stdin.readline()
"""


def test_sweep_keeps_a_live_job_whose_pid_it_cannot_see(tmp_path):
    """A job in another pid namespace (containers sharing /dev/shm) names its files with a pid this process cannot
    see; while that job holds its file's lock, the sweep must leave the file alone; once it is gone, sweep it."""
    import subprocess
    import sys

    invisible_pid = 2**22 + 12345  # above any pid_max: no process here has it
    assert not shm_files.pid_alive(invisible_pid)
    path = tmp_path / f"odc-89abcdef-{invisible_pid}-unit0"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert shm_files.sweep_stale(tmp_path) == []
        assert path.exists()
    finally:
        holder.communicate("done\n", timeout=30)
    assert shm_files.sweep_stale(tmp_path) == [path]


def _mismatch(rank, world_size):
    transport = make_transport(timeout_s=30)
    try:
        transport.register(UnitSpec(name="u", shard_numel=100 + rank, param_dtype=torch.float32))
    except ValueError as err:
        return str(err)
    return "registered"


def test_mismatched_registration_is_refused():
    messages = run_ranks(_mismatch, 2)
    assert all("different specs" in m for m in messages), messages


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="shard_numel must be positive"):
        UnitSpec(name="x", shard_numel=0, param_dtype=torch.float32)
