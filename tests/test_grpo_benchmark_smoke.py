"""benchmarks/grpo_e2e.py runs on CPU (tiny model, gloo + the shared-memory transport) and writes its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_grpo_e2e_benchmark_smoke(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    cmd = [sys.executable, str(ROOT / "benchmarks/grpo_e2e.py"), "--model", "tiny", "--steps", "1", "--warmup", "1",
           "--gen_repeats", "1", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (result,) = tmp_path.glob("grpo_e2e_tiny_*.json")
    summary = json.loads(result.read_text())["summary"]
    assert summary["max_rel_loss_diff"] < 1e-4  # both variants train the same samples with the same weights
    assert summary["speedup_tokens_per_s"] > 0 and summary["generation"]["ratio_tokens_per_s"] > 0
    assert (tmp_path / result.name.replace(".json", ".md")).read_text().startswith("# GRPO end to end")
