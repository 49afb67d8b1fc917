"""README command 1 (``python examples/sft.py``) on a machine with exactly one GPU.

It used to launch 2 CPU processes with the GPU still visible; rank 1 then asked for CUDA device 1 ("invalid device
ordinal"): ``fully_shard`` without a mesh builds one on torch's current accelerator, which sets the CUDA device from
LOCAL_RANK. Now the launcher hides CUDA from CPU processes and the CPU path shards on a CPU mesh, and the printed
message says where the job runs, why, and how to run on the GPU (``--num_processes 1``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from odc_hf import run as odc_run
from odc_hf.run import launch_env, plan_launch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("processes", "gpus", "config", "device", "hide_cuda"),
    [
        (2, 0, "cpu.yaml", "cpu", False),  # CPU-only host
        (2, 1, "cpu.yaml", "cpu", True),  # the one-GPU workstation: CPU ranks, CUDA hidden from them
        (2, 2, "odc.yaml", "cuda", False),
        (2, 8, "odc.yaml", "cuda", False),
        (4, 2, "cpu.yaml", "cpu", True),
        (1, 1, None, "cuda", False),  # --num_processes 1: runs here, on the GPU
        (1, 0, None, "cpu", False),
    ],
)
def test_plan_launch(processes, gpus, config, device, hide_cuda):
    plan = plan_launch(processes, gpus)
    assert (plan.processes, plan.config, plan.device, plan.hide_cuda) == (processes, config, device, hide_cuda)


def test_one_gpu_message_says_where_why_and_how_to_use_the_gpu():
    message = plan_launch(2, 1).message
    for part in ("on CPU", "CUDA hidden", "Found 1 GPU", "one GPU per process", "--num_processes 1"):
        assert part in message, message
    assert "cuda:0" in plan_launch(1, 1).message


def test_plan_launch_asks_torch(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert (plan_launch(2).config, plan_launch(2).hide_cuda) == ("cpu.yaml", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)  # a driver without a usable device: count no GPU
    assert (plan_launch(2).config, plan_launch(2).hide_cuda) == ("cpu.yaml", False)


def test_relaunch_on_one_gpu_hides_cuda_from_the_cpu_ranks(monkeypatch, capsys):
    import torch

    for name in ("RANK", "LOCAL_RANK", "ODC_NO_RELAUNCH", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    calls = []
    monkeypatch.setattr(odc_run.subprocess, "call", lambda cmd, env: calls.append((cmd, env)) or 0)
    with pytest.raises(SystemExit) as exit_info:
        odc_run.relaunch_if_needed("examples/sft.py", ["--max_steps", "1"], config_dir=ROOT / "accelerate_configs")
    assert exit_info.value.code == 0
    (cmd, env), = calls
    assert cmd[cmd.index("--config_file") + 1].endswith("cpu.yaml") and cmd[cmd.index("--num_processes") + 1] == "2"
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["ACCELERATE_USE_CPU"] == "true" and env["ODC_NO_RELAUNCH"] == "1"
    assert "--num_processes 1" in capsys.readouterr().out


def test_one_process_runs_here(monkeypatch, capsys):
    for name in ("RANK", "LOCAL_RANK", "ODC_NO_RELAUNCH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(odc_run.subprocess, "call", lambda *a, **k: pytest.fail("one process must not relaunch"))
    odc_run.relaunch_if_needed("examples/sft.py", [], config_dir=ROOT / "accelerate_configs", processes=1)
    assert "1 process on" in capsys.readouterr().out


def test_launch_env_of_a_gpu_plan_keeps_cuda():
    env = launch_env(plan_launch(2, 2), {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and "ACCELERATE_USE_CPU" not in env


# A machine with one GPU, simulated on this CPU build of torch: CUDA looks visible (one device, torch's current
# accelerator "cuda") unless CUDA_VISIBLE_DEVICES is empty, and every device touch is an error naming the call.
FAKE_ONE_GPU = textwrap.dedent(
    """
    import os

    if os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        import torch

        def _touched(name):
            def fail(*args, **kwargs):
                raise RuntimeError(f"a CPU rank touched CUDA: torch.cuda.{name}{args}")
            return fail

        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: 1
        torch._C._get_accelerator = lambda: torch.device("cuda")
        for _name in ("set_device", "current_device", "_lazy_init", "synchronize", "get_device_properties",
                      "mem_get_info", "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats"):
            setattr(torch.cuda, _name, _touched(_name))
    """
)


def _fake_one_gpu_env(tmp_path) -> dict[str, str]:
    fake = tmp_path / "fake_one_gpu"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text(FAKE_ONE_GPU)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "ODC_NO_RELAUNCH", "CUDA_VISIBLE_DEVICES")}
    return {**env, "PYTHONPATH": os.pathsep.join([str(fake), str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


SMALL_RUN = ["--max_steps", "1", "--num_samples", "16", "--max_length", "128"]


@pytest.mark.slow
def test_readme_command_1_on_one_gpu_runs_two_cpu_ranks(tmp_path):
    cmd = [sys.executable, str(ROOT / "examples/sft.py"), *SMALL_RUN, "--output_dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, env=_fake_one_gpu_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Found 1 GPU" in proc.stdout and "--num_processes 1" in proc.stdout, proc.stdout[:2000]
    assert "odc_hf summary (ODC, lb_mini, 2 processes, 1 steps)" in proc.stdout, proc.stdout[-2000:]


def test_cpu_rank_with_one_gpu_visible_says_what_to_do(monkeypatch):
    # `accelerate launch cpu.yaml` by hand on a one-GPU machine: accelerate's own barrier would ask rank 1 for cuda:1;
    # the ODC trainer and ODCAccelerator stop first, saying how to hide CUDA or use the GPU
    import torch

    from odc_hf.integrations.accelerator import check_cpu_ranks_have_no_gpu_to_pick as check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match=r"CPU rank 1 sees 1 CUDA device.*CUDA_VISIBLE_DEVICES=.*--num_processes 1"):
        check(environ={"ACCELERATE_USE_CPU": "true", "LOCAL_RANK": "1"})
    with pytest.raises(RuntimeError, match="CPU rank 1"):
        check(use_cpu=True, environ={"LOCAL_RANK": "1"})  # TrainingArguments(use_cpu=True)
    check(environ={"ACCELERATE_USE_CPU": "true", "LOCAL_RANK": "0"})  # cuda:0 exists
    check(environ={"LOCAL_RANK": "1"})  # a GPU rank: accelerate picks its device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check(environ={"ACCELERATE_USE_CPU": "true", "LOCAL_RANK": "1"})
