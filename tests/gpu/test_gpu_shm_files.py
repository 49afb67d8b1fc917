"""/dev/shm after a job equals /dev/shm before it, with ranks sharing the GPU (CUDA IPC between them), however the job
ends: a clean end (``python examples/sft.py``, as README command 1), a rank's exception, Ctrl-C, ``kill -9`` of one
rank (then also after the next start). And where the files come from, checked on the GPU: torch's reference-counter
file (``torch_<pid>_<random>_<n>``, made by the first ``reduce_tensor`` of a CUDA tensor) and the CUDA driver's
interprocess-event file (``cuda.shm.<n>.<pid hex>.<m>``).

    python -m pytest -m gpu -rP tests/gpu/test_gpu_shm_files.py

The cleanup rules themselves (ledgers, dead peers, SIGTERM, the next start) are tested on CPU with planted files:
tests/transport/test_ipc_files.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from one_process_runs import ROOT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (ranks share it)"),
    pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm"),
]
SHM = Path("/dev/shm")
EXIT_GRACE_S = 3.0  # after the launcher returns, for exiting processes' last unlinks


def _processes() -> int:
    return torch.cuda.device_count() + 1  # more ranks than GPUs: they share, over CUDA IPC


def _listing() -> set[str]:
    return set(os.listdir(SHM))


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "ACCELERATE_USE_CPU",
                                                             "ODC_NO_RELAUNCH")}  # fmt: skip
    return {**env, "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip


PROBE = textwrap.dedent(
    """
    import json, os, torch
    from torch.multiprocessing.reductions import reduce_tensor
    from odc_hf.transport import ipc_files

    def listing():
        return set(os.listdir("/dev/shm"))

    steps, seen = {}, listing()
    def step(name):
        global seen
        now = listing()
        steps[name] = sorted(now - seen)
        seen = now

    torch.zeros(1, device="cuda"); torch.cuda.synchronize(); step("context")
    event = torch.cuda.Event(interprocess=True); step("interprocess event")
    event.ipc_handle(); step("event handle")
    rebuild, args = reduce_tensor(torch.zeros(1024, device="cuda")); step("reduce_tensor")
    sizes = {n: os.stat("/dev/shm/" + n).st_size for names in steps.values() for n in names}
    print(json.dumps({"pid": os.getpid(), "steps": steps, "sizes": sizes,
                      "counter": ipc_files.counter_file(rebuild, args)}))
    """
)


def test_cuda_ipc_makes_a_counter_file_and_a_driver_event_file():
    before = _listing()
    proc = subprocess.run([sys.executable, "-c", PROBE], env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    pid, steps = probe["pid"], probe["steps"]
    print(f"files by step: {steps}; sizes {probe['sizes']}; counter file named by reduce_tensor: {probe['counter']}")
    from odc_hf.transport import ipc_files

    made = [name for names in steps.values() for name in names]
    driver = [n for n in made if n.startswith("cuda.shm.")]
    assert steps["context"] == [], steps  # a CUDA context alone makes nothing
    assert driver and all(ipc_files.file_pid(n) == pid for n in driver), steps  # named with the pid, in hex
    assert set(steps["interprocess event"] + steps["event handle"]) >= set(driver), steps  # an interprocess event
    assert probe["counter"] in steps["reduce_tensor"], steps  # torch's counter file, made by _share_cuda_
    time.sleep(1.0)
    left = _listing() - before
    print(f"left after the probe exited: {sorted(left)}")
    assert probe["counter"] not in left  # torch unlinked its counter file (the count went to zero)
    assert set(driver) <= left  # the driver did not remove its file: odc_hf's ledger must
    for name in driver:
        (SHM / name).unlink()


def _launch(script_args: list, *, new_session: bool = True) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs/odc.yaml"),
           "--num_processes", str(_processes()), "--main_process_port", "0", "--mixed_precision", "no",
           str(ROOT / "tests/support/shm_job.py"), *map(str, script_args)]  # fmt: skip
    return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=new_session)  # fmt: skip


def _read_until(proc: subprocess.Popen, predicate, timeout_s: float, lines: list[str]) -> str | None:
    """Read the launcher's output into ``lines`` until a line satisfies ``predicate`` (returned) or it ends."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            return None
        lines.append(line)
        if predicate(line):
            return line
    return None


def _finish(proc: subprocess.Popen, lines: list[str], timeout_s: float = 300) -> int:
    try:
        rest, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate()
        lines.append(rest)
        pytest.fail("the job did not end in time:\n" + "".join(lines)[-5000:])
    lines.append(rest)
    time.sleep(EXIT_GRACE_S)
    return proc.returncode


def _assert_as_before(before: set[str], what: str, log: str) -> None:
    after = _listing()
    print(f"{what}: new in /dev/shm {sorted(after - before)}; gone (swept leftovers of dead jobs) "
          f"{sorted(before - after)}")  # fmt: skip
    assert after - before == set(), (what, sorted(after - before), log[-3000:])


def test_a_clean_run_of_readme_command_1_leaves_dev_shm_as_it_was(tmp_path):
    before = _listing()
    env = _env()
    proc = subprocess.run([sys.executable, str(ROOT / "examples/sft.py"), "--output_dir", str(tmp_path / "out"),
                           "--max_steps", "3", "--num_processes", str(_processes())],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ranks share" in log, log[-5000:]
    time.sleep(EXIT_GRACE_S)
    _assert_as_before(before, "clean run", log)


def test_a_ranks_exception_leaves_dev_shm_as_it_was(tmp_path):
    before = _listing()
    proc, lines = _launch([tmp_path / "out", "--steps", "6", "--raise_at", "2", "--raise_rank", "1"]), []
    status = _finish(proc, lines)
    log = "".join(lines)
    assert status != 0 and "fails at step 2 on purpose" in log, log[-5000:]
    _assert_as_before(before, "exception", log)


def test_ctrl_c_leaves_dev_shm_as_it_was(tmp_path):
    before = _listing()
    proc, lines = _launch([tmp_path / "out", "--steps", "40", "--step_sleep", "0.5"]), []
    assert _read_until(proc, lambda line: "STEP 2 " in line, 300, lines), "".join(lines)[-5000:]
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal sends: the launcher and its ranks
    status = _finish(proc, lines)
    log = "".join(lines)
    assert status != 0 and "DONE" not in log, log[-5000:]
    _assert_as_before(before, "Ctrl-C", log)


def test_kill_9_of_one_rank_leaves_dev_shm_as_it_was_after_its_peer_and_after_the_next_start(tmp_path):
    before = _listing()
    proc, lines = _launch([tmp_path / "out", "--steps", "40", "--step_sleep", "0.5"]), []
    line = _read_until(proc, lambda text: "STEP 2 1 " in text, 300, lines)
    assert line, "".join(lines)[-5000:]
    victim = int(re.search(r"STEP 2 1 (\d+)", line).group(1))
    os.kill(victim, signal.SIGKILL)
    status = _finish(proc, lines)
    log = "".join(lines)
    # the survivor names the dead rank and its pid, unless the launcher stopped it (SIGTERM) first; either way
    # the launcher reports the pid it lost
    assert status != 0 and str(victim) in log, log[-5000:]
    after_kill = _listing() - before
    print(f"after kill -9 of rank 1 (pid {victim}): new in /dev/shm {sorted(after_kill)}")
    # the next start sweeps what no survivor could remove; it must leave nothing of its own either
    proc, lines = _launch([tmp_path / "next", "--steps", "2"]), []
    assert _finish(proc, lines) == 0, "".join(lines)[-5000:]
    _assert_as_before(before, "kill -9, then the next start", "".join(lines))
    assert after_kill == set(), sorted(after_kill)  # and the survivor had already cleaned up by itself
