"""Run an unmodified training script or module with ODC: ``python -m odc_hf.run <module | script.py> [args]``.

    accelerate launch --config_file accelerate_configs/odc.yaml -m odc_hf.run trl.scripts.sft \\
        --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name trl-lib/Capybara --output_dir out

It calls :func:`odc_hf.patch_trl` (so ``from trl import SFTTrainer`` / ``GRPOTrainer`` give the ODC trainers) and then runs the
target as ``__main__`` with the remaining arguments. ODC options come from ``ODC_*`` environment variables.

A target whose source names neither TRL's ``SFTTrainer`` / ``GRPOTrainer`` nor ``odc_hf`` is told before it starts
(``trl.scripts.dpo``, say: it would train as under plain ``accelerate launch``), and a target that ends without having
set up an accelerator for ODC (an ODC trainer, ``ODCAccelerator``, ``odc_hf.prepare``) is told so at the end, on the
main process.
"""

from __future__ import annotations

import os
import runpy
import sys

from odc_hf.integrations.launch.cuda_allocator import prefer_expandable_segments


def check_target(target: str) -> str | None:
    """The script or module to run exists, or a clear error (``SystemExit``) naming it, before any work starts.
    Returns the file it runs as ``__main__`` (a package: its ``__main__``), or ``None`` where there is none."""
    import importlib.util

    if target.endswith(".py") or os.path.sep in target:
        if not os.path.isfile(target):
            raise SystemExit(f"odc_hf.run: no script {target!r} (path relative to {os.getcwd()!r})")
        return target
    try:
        spec = importlib.util.find_spec(target)
        if spec is not None and spec.submodule_search_locations is not None:  # a package runs its __main__
            spec = importlib.util.find_spec(f"{target}.__main__") or spec
    except (ImportError, ValueError):  # a missing parent package, or a malformed name
        spec = None
    if spec is None:
        raise SystemExit(
            f"odc_hf.run: no module {target!r} to run (is it installed? a script needs its .py path); usage: "
            "python -m odc_hf.run <module | script.py> [args]"
        )
    return spec.origin


# What a script that trains with ODC names: TRL's trainers that patch_trl replaces, or odc_hf itself.
ODC_NAMES = ("SFTTrainer", "GRPOTrainer", "odc_hf")


def names_nothing_of_odc(source_file: str | None) -> bool:
    """Whether the target's source file (:func:`check_target`) names none of :data:`ODC_NAMES` (unreadable: False)."""
    try:
        with open(source_file or "", encoding="utf-8") as handle:
            source = handle.read()
    except (OSError, UnicodeDecodeError):
        return False
    return not any(name in source for name in ODC_NAMES)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    target, rest = argv[0], argv[1:]
    source_file = check_target(target)  # before the imports below (seconds) and before the target loads and tokenizes
    from odc_hf.version import is_rank_zero  # torch (a second): after the target is known to exist

    if names_nothing_of_odc(source_file) and is_rank_zero():
        print(f"odc_hf.run: {target} names neither TRL's SFTTrainer or GRPOTrainer (the trainers odc_hf.run replaces) "
              "nor odc_hf, so it will most likely train without ODC, as under plain accelerate launch; odc_hf.run "
              "says at the end whether it did", file=sys.stderr, flush=True)  # fmt: skip
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
    from odc_hf.integrations.accelerate.accelerator import accelerators_adopted
    from odc_hf.integrations.trl.patch import patch_trl
    from odc_hf.integrations.upstream.deprecations import ignore_upstream_deprecations

    patch_trl()
    ignore_upstream_deprecations()  # TRL's own defaults trigger them; nothing the user can change
    adopted_before = accelerators_adopted()
    sys.argv = [target, *rest]
    if target.endswith(".py") or os.path.isfile(target):
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    if accelerators_adopted() == adopted_before and is_rank_zero():
        print(f"odc_hf.run: {target} set up no accelerator for ODC (no ODC trainer: odc_hf.run replaces TRL's "
              "SFTTrainer and GRPOTrainer; no ODCAccelerator or odc_hf.prepare): it ran without ODC", file=sys.stderr,
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
