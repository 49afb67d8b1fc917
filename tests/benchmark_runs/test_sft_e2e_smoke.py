"""benchmarks/sft/e2e.py runs on CPU (tiny model, gloo + shared memory), writes its report, and re-renders merged runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sft_e2e_benchmark_smoke(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    script = ("-m", "benchmarks.sft.e2e")
    common = ["--model", "tiny", "--world-size", "2", "--steps", "1", "--warmup", "1", "--max-tokens", "256",
              "--calibration-lengths", "16,32,64,128,256", "--all-variants-at", "2"]  # fmt: skip
    for tag, config in (("_a", "longalign:2"), ("_b", "balanced:2")):
        cmd = [sys.executable, *script, *common, "--configs", config, "--balanced-length", "100", "--tag", tag,
               "--out", str(tmp_path)]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (first,) = tmp_path.glob("sft_e2e_cpu_*_a.json")
    payload = json.loads(first.read_text())
    (config,) = payload["analysis"]
    assert set(config["variants"]) == {"A", "B", "C", "D", "H"}
    records = payload["configs"][0]["records"]
    assert {r["rank"] for r in records} == {0, 1} and {r["step"] for r in records} == {0, 1}
    by = {(r["variant"], r["step"], r["rank"]): r for r in records}
    for rank in (0, 1):  # B and C run the same LB-Micro plan: same documents in the same microbatches
        assert by["B", 1, rank]["mb_docs"] == by["C", 1, rank]["mb_docs"]
        for v in "AH":  # FSDP2: equal counts
            assert len(by[v, 1, rank]["mb_docs"]) == len(by[v, 1, 1 - rank]["mb_docs"])
    step_docs = sorted(d for v in "ABCDH" for r in (0, 1) for mb in by[v, 1, r]["mb_docs"] for d in mb)
    assert step_docs == sorted(
        payload["configs"][0]["lengths"][1] * 5
    )  # every variant trains every sample once
    # H (A_hf) runs the microbatches transformers' BatchRebalanceSampler gives (2 samples per rank, per-device 2:
    # one microbatch each), read from transformers itself
    from odc_hf.prediction import batch_rebalance as hf

    if hf.available()[0]:
        import numpy as np

        step1 = np.minimum(payload["configs"][0]["lengths"][1], 256)
        plan = hf.rebalance_plan(step1, 2, 1)
        for rank in (0, 1):
            assert by["H", 1, rank]["mb_docs"] == [[int(step1[i]) for i in mb] for mb in plan[rank]]
    raws = sorted(str(p) for p in tmp_path.glob("sft_e2e_cpu_*.raw.json"))
    merged_dir = tmp_path / "merged"
    proc = subprocess.run([sys.executable, *script, "--report-only", ",".join(raws), "--out", str(merged_dir)],
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (merged,) = merged_dir.glob("*.json")
    assert [(c["workload"], c["per_rank"]) for c in json.loads(merged.read_text())["analysis"]] == [
        ("longalign", 2),
        ("balanced", 2),
    ]
    assert (merged_dir / merged.name.replace(".json", "_throughput.png")).exists()
