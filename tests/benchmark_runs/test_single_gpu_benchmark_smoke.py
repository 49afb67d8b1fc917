"""benchmarks/single_gpu/run.py on CPU (tiny model, fp32, sdpa, 2 steps per variant): TRL's SFTTrainer and
ODCSFTTrainer train the same samples step by step, and a run resumed in a new process repeats the uninterrupted one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_single_gpu_benchmark_smoke(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    cmd = [sys.executable, "-m", "benchmarks.single_gpu.run", "--smoke", "--parts", "sft_tulu,resume",
           "--variants", "T,O,O_noexp", "--profile", "2", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (payload,) = [json.loads(p.read_text()) for p in tmp_path.glob("single_gpu_cpu_*.json")]
    assert list(tmp_path.glob("single_gpu_cpu_*.md")) and list(tmp_path.glob("single_gpu_cpu_*.png"))
    sft = payload["analysis"]["sft_tulu"]
    assert sft["summary"]["T"]["ok"] and sft["summary"]["O"]["ok"] and sft["summary"]["O"]["tokens_per_s"] > 0
    # fp32, the same samples per step (TRL's bfd rows vs ODC's own microbatches of them): measured equal losses
    # (0 difference); 1e-5 relative leaves room for the kernels' summation order.
    assert sft["losses"]["O vs T"]["steps"] == 2 and sft["losses"]["O vs T"]["max_rel"] < 1e-5, sft["losses"]
    resume = payload["analysis"]["resume"]
    assert resume["ok"] and len(resume["pairs"]) == 1 and resume["max_rel"] < 1e-6, resume
    # each variant's record was written as soon as it finished
    assert (tmp_path / "single_gpu_runs" / "sft_tulu" / "O.json").is_file()
    # the allocator diagnostics: the variant's own setting recorded, retries counted (none off CUDA), O profiled
    assert sft["summary"]["O_noexp"]["ok"] and sft["summary"]["O_noexp"]["alloc_retries"] == 0
    assert "ChunkedLogProbFunction" in (tmp_path / "profile_sft_tulu_O.txt").read_text()
