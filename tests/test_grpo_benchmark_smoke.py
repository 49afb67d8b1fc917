"""benchmarks/grpo_e2e.py runs on CPU (tiny model, gloo + the shared-memory transport) and writes its report."""

from __future__ import annotations

import json
import math
import os
import statistics
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
    payload = json.loads(result.read_text())
    summary, steps = payload["summary"], payload["rank0"]["steps"]
    assert summary["max_rel_loss_diff"] < 1e-4  # both variants train the same samples with the same weights
    assert all(math.isfinite(s[kind]["loss"]) and s[kind]["step_s"] > 0 for s in steps for kind in ("odc", "fsdp"))
    # The reported speedups are what the recorded steps and generation runs say.
    measured = [s for s in steps if not s["warmup"]]
    assert measured, steps

    def tokens_per_s(kind):
        return statistics.median(s["tokens"] / s[kind]["step_s"] for s in measured)

    assert summary["speedup_tokens_per_s"] == pytest.approx(tokens_per_s("odc") / tokens_per_s("fsdp"), rel=1e-12)
    gen = summary["generation"]
    assert gen["odc"]["tokens"] == gen["fsdp"]["tokens"] > 0  # both variants generate the same tokens
    runs = payload["rank0"]["generation"]
    generated = {k: statistics.median(r["tokens"] / max(r["rank_s"]) for r in runs[k]) for k in ("odc", "fsdp")}
    assert gen["ratio_tokens_per_s"] == pytest.approx(generated["odc"] / generated["fsdp"], rel=1e-12)
    report = (tmp_path / result.name.replace(".json", ".md")).read_text()
    assert report.startswith("# GRPO end to end") and f"**{summary['speedup_tokens_per_s']:.3f}x**" in report
