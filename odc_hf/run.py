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


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    target, rest = argv[0], argv[1:]
    from odc_hf.integrations.trl import patch_trl

    patch_trl()
    sys.argv = [target, *rest]
    if target.endswith(".py") or os.path.isfile(target):
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
