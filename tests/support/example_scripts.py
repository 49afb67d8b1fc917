"""The repository's example scripts (``examples/<name>.py``) as modules, for tests that call their functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str):
    """``examples/<name>.py`` imported as the module ``odc_examples.<name>`` (once per process)."""
    module_name = f"odc_examples.{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def grpo_run(out: Path, *args) -> dict:
    """``accelerate launch --config_file accelerate_configs/cpu.yaml examples/grpo.py --output_dir OUT --losses_json
    OUT/losses.json ARGS`` on 2 CPU ranks forked from the test process's fork server (tests/support/launched.py);
    returns the run's losses.json."""
    import json

    from launched import run_launched

    out = Path(out)
    run_launched(EXAMPLES / "grpo.py", "--output_dir", out, "--losses_json", out / "losses.json", *args)
    return json.loads((out / "losses.json").read_text())
