"""benchmarks/grpo/vllm_colocate.py on CPU (``--smoke``: tiny model, 2 steps per trainer, odc_hf/testing/vllm_fake.py's engine in place of
vLLM): TRL's GRPOTrainer and ODCGRPOTrainer each run, every step is split into its phases, and the report (markdown,
JSON, plot) is written. The GPU run itself (vLLM, the 1.5B shape) is the lead's (tests/README.md).

The phase split is checked against the engine's own clock: the stand-in engine sleeps a known time in every
``generate`` and at the start of every weight sync and logs how long each of its calls took, measured inside it. The
benchmark's ``generate_s`` and ``sync_s`` must enclose those times and add little to them (so a timer around the wrong
call, or one phase counted in another, fails), and the generation phase must hold both (``score_s`` >= 0). The old
check, generation + sync + scoring + training == the step, held by the benchmark's own definitions (scoring and
training are the leftovers) and could not fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATE_DELAY, SYNC_DELAY = 0.5, 0.4  # seconds the stand-in engine sleeps per generate / per sync


def _engine_steps(events: list[dict]) -> list[dict]:
    """One run's engine log -> per step: seconds in weight loads (the sync before the step's generation) and in
    generate."""
    steps, loads = [], 0.0
    for e in events:
        if e["event"] == "load":
            loads += e["seconds"]
        else:
            steps.append({"sync": loads, "generate": e["seconds"]})
            loads = 0.0
    return steps


def test_grpo_vllm_benchmark_smoke(tmp_path):
    log = tmp_path / "engine.jsonl"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "VLLM_STAND_IN_DELAYS": f"generate={GENERATE_DELAY},sync={SYNC_DELAY}", "VLLM_STAND_IN_LOG": str(log)}  # fmt: skip
    env.pop("ODC_COMMIT", None)
    cmd = [sys.executable, "-m", "benchmarks.grpo.vllm_colocate", "--smoke", "--commit", "abc1234", "--out",
           str(tmp_path), "--work", str(tmp_path / "work")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (payload,) = [json.loads(p.read_text()) for p in tmp_path.glob("grpo_vllm_tiny_cpu_*.json")]
    assert list(tmp_path.glob("grpo_vllm_tiny_cpu_*.md")) and list(tmp_path.glob("grpo_vllm_tiny_cpu_*.png"))
    assert payload["env"]["commit"] == "abc1234"
    assert [r["variant"] for r in payload["runs"]] == ["T", "O"] and all(r["ok"] for r in payload["runs"])
    events = [json.loads(line) for line in log.read_text().splitlines()]
    engines = list(dict.fromkeys(e["engine"] for e in events))  # one engine per run, in run order
    assert len(engines) == 2, engines
    for run, name in zip(payload["runs"], engines, strict=True):
        engine = _engine_steps([e for e in events if e["engine"] == name])
        assert [s["step"] for s in run["steps"]] == [1, 2] and len(engine) == 2, (run["steps"], engine)
        for s, inside in zip(run["steps"], engine):
            assert len(s["lengths"]) == 8  # 4 x 2 completions per step on the one rank
            # the benchmark's timers enclose the engine's own time of its calls (which holds the sleeps)...
            assert s["generate_s"] >= inside["generate"] >= GENERATE_DELAY, (run["variant"], s, inside)
            assert s["sync_s"] >= inside["sync"] >= SYNC_DELAY, (run["variant"], s, inside)
            # ...and add little to it: TRL's generate wrapper and the sync's walk over the parameters outside the
            # engine (measured <= 4 ms); half the smaller sleep (0.2 s) would be exceeded were one phase counted
            # in the other
            assert s["generate_s"] - inside["generate"] < SYNC_DELAY / 2, (run["variant"], s, inside)
            assert s["sync_s"] - inside["sync"] < SYNC_DELAY / 2, (run["variant"], s, inside)
            # the generation phase holds generation and sync (TRL syncs inside _generate_and_score_completions)
            assert s["score_s"] >= 0 and s["train_s"] > 0, s
    summary = payload["analysis"]["summary"]
    assert set(summary) == {"T", "O"} and set(payload["analysis"]["ratios"]) >= {
        "seconds",
        "sync_s",
        "train_s",
    }


def test_grpo_vllm_benchmark_help_runs_without_vllm():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.grpo.vllm_colocate", "--help"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.returncode == 0 and "--eos_bias" in proc.stdout, proc.stderr[-2000:]
