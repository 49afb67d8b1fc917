"""The examples' relaunch: ``python examples/sft.py`` on a fresh machine re-runs itself under ``accelerate launch``.

:func:`plan_launch` decides where the processes run (one GPU each, ranks sharing a GPU, or CPU ranks),
:func:`launch_env` gives the children their environment, and :func:`relaunch_if_needed` does both and launches. Not
to be confused with ``python -m odc_hf.run`` (odc_hf/run.py), which runs an unmodified script inside a launched rank.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from odc_hf.integrations.launch import rank_errors
from odc_hf.integrations.launch.cuda_allocator import prefer_expandable_segments
from odc_hf.transport.peer_memory import SAFE_GPU_ENV

__all__ = ["LaunchPlan", "launch_env", "plan_launch", "relaunch_if_needed"]


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Where ``python examples/sft.py`` (or another relaunching script) runs: see :func:`plan_launch`."""

    processes: int
    config: str | None  # accelerate config file name under config_dir; None: no relaunch, run in this process
    device: str  # "cuda" or "cpu": what the training processes compute on
    hide_cuda: bool  # CPU processes on a machine with GPUs: CUDA_VISIBLE_DEVICES="" so no rank touches a GPU
    message: str  # printed before training: where it runs, why, and how to run on the GPU(s)


def plan_launch(processes: int, gpus: int | None = None) -> LaunchPlan:
    """Decide how ``processes`` processes run on a machine with ``gpus`` visible CUDA devices (``None``: ask torch).

    Two or more processes run ODC on the GPUs: one GPU each where there are enough, else ranks share them (the
    shared-GPU mode, ``odc_hf.integrations.launch.shared_gpu``: gloo process group, CUDA IPC peer memory; for development
    and tests, not speed). Without a GPU they run on CPU (gloo, shared memory; the real ODC path). One process
    needs no launcher: it runs here, on the GPU if there is one.
    """
    if processes < 1:
        raise ValueError(f"processes must be at least 1, got {processes}")
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if processes == 1:
        where = "cuda:0" if gpus else "CPU"
        note = (" ODC has nothing to communicate with one process; odc_hf still packs token-budget microbatches and "
                "picks the compute path (fused LM head, Liger kernels when installed, activation checkpointing from "
                "the GPU's memory).")  # fmt: skip
        return LaunchPlan(1, None, "cuda" if gpus else "cpu", False, f"odc_hf: 1 process on {where}.{note}")
    if gpus >= processes:
        return LaunchPlan(processes, "odc.yaml", "cuda", False,
                          f"odc_hf: launching {processes} processes on {processes} of {gpus} GPUs with "
                          "accelerate_configs/odc.yaml (FSDP2 + ODC)")  # fmt: skip
    if gpus == 0:
        return LaunchPlan(processes, "cpu.yaml", "cpu", False,
                          f"odc_hf: launching {processes} processes with accelerate_configs/cpu.yaml (no GPU "
                          "found: CPU ranks, gloo, shared-memory ODC transport)")  # fmt: skip
    where = "cuda:0" if gpus == 1 else f"{gpus} GPUs"
    return LaunchPlan(
        processes, "odc.yaml", "cuda", False,
        f"odc_hf: launching {processes} processes with accelerate_configs/odc.yaml (FSDP2 + ODC): {processes} ranks "
        f"share {where}: for development and tests, not speed (process group gloo, CUDA IPC peer memory; "
        "docs/quickstart.md, \"One GPU\")",
    )  # fmt: skip


def relaunch_if_needed(
    script: str, argv: list[str], *, config_dir: str | os.PathLike, processes: int = 2
) -> None:
    """Re-run ``script`` under ``accelerate launch`` with ``processes`` processes, unless already launched.

    What ``python examples/sft.py`` does on a fresh machine (:func:`plan_launch`): ``odc.yaml`` from ``config_dir``
    when there are enough GPUs, else ``cpu.yaml`` (which needs ``ACCELERATE_USE_CPU=true``, set here) with CUDA
    hidden from the processes when the machine has GPUs; one process runs here without a launcher. NVLink
    multicast stays off in the children. Returns when already inside a launched process or when one process runs
    here; otherwise exits with the launch's status. A rank's failure ends the output with that rank's own message,
    the launcher's report kept in a file (:mod:`odc_hf.integrations.launch.rank_errors`).
    """
    if "RANK" in os.environ or "LOCAL_RANK" in os.environ or os.environ.get("ODC_NO_RELAUNCH"):
        rank_errors.install()  # a launched rank: an uncaught exception becomes one line and a file
        return
    plan = plan_launch(processes)
    print(plan.message, flush=True)
    if plan.config is None:
        for key, value in SAFE_GPU_ENV.items():
            os.environ.setdefault(key, value)
        prefer_expandable_segments()
        return
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(Path(config_dir) / plan.config),
           "--num_processes", str(processes), script, *argv]  # fmt: skip
    sys.exit(rank_errors.run_launcher(cmd, launch_env(plan)))


def launch_env(plan: LaunchPlan, environ=None) -> dict[str, str]:
    """The children's environment for ``plan``: NVLink multicast off; CPU plans set ``ACCELERATE_USE_CPU=true``
    (see accelerate_configs/cpu.yaml) and, on a machine with GPUs, hide them."""
    environ = os.environ if environ is None else environ
    env = {**environ, **SAFE_GPU_ENV, "OMP_NUM_THREADS": environ.get("OMP_NUM_THREADS", "1"), "ODC_NO_RELAUNCH": "1"}
    if plan.device == "cpu":
        env["ACCELERATE_USE_CPU"] = "true"
    if plan.hide_cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if plan.device == "cuda":
        prefer_expandable_segments(env, cuda_started=False)
    return env
