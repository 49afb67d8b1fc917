"""Run an unmodified training script or module with ODC: ``python -m odc_hf.run <module | script.py> [args]``.

    accelerate launch --config_file accelerate_configs/odc.yaml -m odc_hf.run trl.scripts.sft \\
        --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name trl-lib/Capybara --output_dir out

It calls :func:`odc_hf.patch_trl` (so ``from trl import SFTTrainer`` / ``GRPOTrainer`` give the ODC trainers) and then runs the
target as ``__main__`` with the remaining arguments. ODC options come from ``ODC_*`` environment variables.
"""

from __future__ import annotations

import os
import runpy
import sys

from odc_hf.integrations.launch.cuda_allocator import prefer_expandable_segments


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
        prefer_expandable_segments()  # before anything starts CUDA in this process (odc_hf/integrations/launch/cuda_allocator.py)
    except ValueError as err:
        raise SystemExit(f"odc_hf.run: {err}") from None
    if "LOCAL_RANK" in os.environ:  # a launched rank: ranks sharing a GPU need gloo before the target starts NCCL
        from odc_hf.integrations.launch import rank_errors, shared_gpu

        rank_errors.install()  # an uncaught exception: one line on the screen, the traceback in a file

        shared_gpu.init_process_group()
    from odc_hf.config import ODCConfig

    try:
        ODCConfig.from_env()  # the ODC_* variables' errors now, not after every rank loaded the model and the data
    except ValueError as err:
        raise SystemExit(f"odc_hf.run: {err}") from None
    from odc_hf.integrations.trl.patch import patch_trl
    from odc_hf.integrations.upstream.deprecations import ignore_upstream_deprecations

    patch_trl()
    ignore_upstream_deprecations()  # TRL's own defaults trigger them; nothing the user can change
    sys.argv = [target, *rest]
    if target.endswith(".py") or os.path.isfile(target):
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
