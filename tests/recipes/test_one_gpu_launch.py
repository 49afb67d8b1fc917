"""README command 1 (``python examples/sft.py``) on a machine with fewer GPUs than processes: its ranks share the
GPU (gloo process group, CUDA IPC peer memory; ``odc_hf.integrations.launch.shared_gpu``), and the printed message says so.
The run itself is a GPU test (``tests/gpu/test_gpu_shared.py``); here the plan, the children's environment and the CPU
ranks' guard (``accelerate launch cpu.yaml`` by hand on a machine with a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from odc_hf.integrations.launch import relaunch as odc_run
from odc_hf.integrations.launch.relaunch import launch_env, plan_launch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("processes", "gpus", "config", "device", "hide_cuda"),
    [
        (2, 0, "cpu.yaml", "cpu", False),  # CPU-only host
        (2, 1, "odc.yaml", "cuda", False),  # the one-GPU workstation: both ranks share cuda:0
        (2, 2, "odc.yaml", "cuda", False),
        (2, 8, "odc.yaml", "cuda", False),
        (4, 2, "odc.yaml", "cuda", False),  # two ranks per GPU
        (1, 1, None, "cuda", False),  # --num_processes 1: runs here, on the GPU
        (1, 0, None, "cpu", False),
    ],
)
def test_plan_launch(processes, gpus, config, device, hide_cuda):
    plan = plan_launch(processes, gpus)
    assert (plan.processes, plan.config, plan.device, plan.hide_cuda) == (processes, config, device, hide_cuda)


def test_one_gpu_message_says_the_ranks_share_it():
    message = plan_launch(2, 1).message
    for part in ("2 ranks share cuda:0: for development and tests, not speed", "gloo", "CUDA IPC"):
        assert part in message, message
    assert "share 2 GPUs" in plan_launch(4, 2).message
    assert "cuda:0" in plan_launch(1, 1).message


def test_plan_launch_asks_torch(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert (plan_launch(2).config, plan_launch(2).device) == ("odc.yaml", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)  # a driver without a usable device: count no GPU
    assert (plan_launch(2).config, plan_launch(2).device) == ("cpu.yaml", "cpu")


def test_relaunch_on_one_gpu_puts_both_ranks_on_it(monkeypatch, capsys):
    import torch

    for name in ("RANK", "LOCAL_RANK", "ODC_NO_RELAUNCH", "CUDA_VISIBLE_DEVICES", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    calls = []
    monkeypatch.setattr(odc_run.rank_errors, "run_launcher", lambda cmd, env: calls.append((cmd, env)) or 0)
    with pytest.raises(SystemExit) as exit_info:
        odc_run.relaunch_if_needed("examples/sft.py", ["--max_steps", "1"], config_dir=ROOT / "accelerate_configs")
    assert exit_info.value.code == 0
    (cmd, env), = calls
    assert cmd[cmd.index("--config_file") + 1].endswith("odc.yaml") and cmd[cmd.index("--num_processes") + 1] == "2"
    assert "CUDA_VISIBLE_DEVICES" not in env and "ACCELERATE_USE_CPU" not in env and env["ODC_NO_RELAUNCH"] == "1"
    assert "2 ranks share cuda:0" in capsys.readouterr().out


def test_one_process_runs_here(monkeypatch, capsys):
    for name in ("RANK", "LOCAL_RANK", "ODC_NO_RELAUNCH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(odc_run.rank_errors, "run_launcher", lambda *a, **k: pytest.fail("one process must not relaunch"))
    odc_run.relaunch_if_needed("examples/sft.py", [], config_dir=ROOT / "accelerate_configs", processes=1)
    assert "1 process on" in capsys.readouterr().out


def test_launch_env_of_a_gpu_plan_keeps_cuda():
    env = launch_env(plan_launch(2, 2), {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and "ACCELERATE_USE_CPU" not in env


def test_cpu_rank_with_one_gpu_visible_says_what_to_do(monkeypatch):
    # `accelerate launch cpu.yaml` by hand on a one-GPU machine: accelerate's own barrier would ask rank 1 for cuda:1;
    # the ODC trainer and ODCAccelerator stop first, saying how to hide CUDA or use the GPU
    import torch

    from odc_hf.integrations.accelerate.refusals import check_cpu_ranks_have_no_gpu_to_pick as check

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
