"""benchmarks/grpo_vllm.py on CPU (``--smoke``: tiny model, 2 steps per trainer, tests/vllm_fake.py's engine in place of
vLLM): TRL's GRPOTrainer and ODCGRPOTrainer each run, every step is split into its phases, and the report (markdown,
JSON, plot) is written. The GPU run itself (vLLM, the 1.5B shape) is the lead's (tests/README.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_grpo_vllm_benchmark_smoke(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    env.pop("ODC_COMMIT", None)
    cmd = [sys.executable, str(ROOT / "benchmarks/grpo_vllm.py"), "--smoke", "--commit", "abc1234", "--out",
           str(tmp_path), "--work", str(tmp_path / "work")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (payload,) = [json.loads(p.read_text()) for p in tmp_path.glob("grpo_vllm_tiny_cpu_*.json")]
    assert list(tmp_path.glob("grpo_vllm_tiny_cpu_*.md")) and list(tmp_path.glob("grpo_vllm_tiny_cpu_*.png"))
    assert payload["env"]["commit"] == "abc1234"
    assert [r["variant"] for r in payload["runs"]] == ["T", "O"] and all(r["ok"] for r in payload["runs"])
    for run in payload["runs"]:
        assert [s["step"] for s in run["steps"]] == [1, 2]
        for s in run["steps"]:
            assert len(s["lengths"]) == 8  # 4 x 2 completions per step on the one rank
            assert s["generate_s"] > 0 and s["sync_s"] > 0 and s["score_s"] >= 0 and s["train_s"] > 0, s
            parts = s["generate_s"] + s["sync_s"] + s["score_s"] + s["train_s"]
            assert parts == pytest.approx(s["seconds"], rel=1e-6), s
    summary = payload["analysis"]["summary"]
    assert set(summary) == {"T", "O"} and set(payload["analysis"]["ratios"]) >= {
        "seconds",
        "sync_s",
        "train_s",
    }


def test_grpo_vllm_benchmark_help_runs_without_vllm():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/grpo_vllm.py"), "--help"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.returncode == 0 and "--eos_bias" in proc.stdout, proc.stderr[-2000:]
