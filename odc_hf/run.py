"""Run an unmodified training script or module with ODC: ``python -m odc_hf.run <module | script.py> [args]``.

    accelerate launch --config_file accelerate_configs/odc.yaml -m odc_hf.run trl.scripts.sft \\
        --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name trl-lib/Capybara --output_dir out

It calls :func:`odc_hf.patch_trl` (so ``from trl import SFTTrainer`` / ``GRPOTrainer`` give the ODC trainers) and then runs the
target as ``__main__`` with the remaining arguments. ODC options come from ``ODC_*`` environment variables.
"""

from __future__ import annotations

import dataclasses
import os
import runpy
import subprocess
import sys
from pathlib import Path

from odc_hf.integrations.cuda_allocator import prefer_expandable_segments

SAFE_GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


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
    shared-GPU mode, ``odc_hf.integrations.shared_gpu``: gloo process group, CUDA IPC peer memory; for development
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
    here; otherwise exits with the launch's status.
    """
    if "RANK" in os.environ or "LOCAL_RANK" in os.environ or os.environ.get("ODC_NO_RELAUNCH"):
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
    sys.exit(subprocess.call(cmd, env=launch_env(plan)))


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


def check_target(target: str) -> None:
    """The script or module to run exists, or a clear error (``SystemExit``) naming it, before any work starts."""
    import importlib.util

    if target.endswith(".py") or os.path.sep in target:
        if not os.path.isfile(target):
            raise SystemExit(f"odc_hf.run: no script {target!r} (path relative to {os.getcwd()!r})")
        return
    try:
        spec = importlib.util.find_spec(target)
    except (ImportError, ValueError):  # a missing parent package, or a malformed name
        spec = None
    if spec is None:
        raise SystemExit(
            f"odc_hf.run: no module {target!r} to run (is it installed? a script needs its .py path); usage: "
            "python -m odc_hf.run <module | script.py> [args]"
        )


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    target, rest = argv[0], argv[1:]
    check_target(target)  # before the imports below (seconds) and before the target loads and tokenizes
    try:
        prefer_expandable_segments()  # before anything starts CUDA in this process (odc_hf/integrations/cuda_allocator.py)
    except ValueError as err:
        raise SystemExit(f"odc_hf.run: {err}") from None
    if "LOCAL_RANK" in os.environ:  # a launched rank: ranks sharing a GPU need gloo before the target starts NCCL
        from odc_hf.integrations import shared_gpu

        shared_gpu.init_process_group()
    from odc_hf.config import ODCConfig

    try:
        ODCConfig.from_env()  # the ODC_* variables' errors now, not after every rank loaded the model and the data
    except ValueError as err:
        raise SystemExit(f"odc_hf.run: {err}") from None
    from odc_hf.integrations.trl import patch_trl
    from odc_hf.integrations.upstream_warnings import ignore_upstream_deprecations

    patch_trl()
    ignore_upstream_deprecations()  # TRL's own defaults trigger them; nothing the user can change
    sys.argv = [target, *rest]
    if target.endswith(".py") or os.path.isfile(target):
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
