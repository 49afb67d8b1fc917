"""The main job through `accelerate launch` on CPU (2 processes): ODCSFTTrainer with LB-Mini, where ranks run
uneven microbatch counts, gives the same per-step losses as FSDP2 collectives with LB-Micro on the same
global minibatches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from odc_hf.testing import accelerate_cpu

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--workload", "tulu", "--max_steps", "10", "--max_length", "2048", "--max_tokens_per_microbatch", "2048",
          "--per_device_train_batch_size", "8", "--learning_rate", "1e-3"]  # fmt: skip


def launch(tmp_path: Path, name: str, *extra: str) -> dict:
    out = tmp_path / name
    proc = accelerate_cpu(ROOT / "examples/sft.py", "--output_dir", out, "--losses_json", out / "losses.json",
                          *COMMON, *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "odc_hf summary" in proc.stdout
    return json.loads((out / "losses.json").read_text())


@pytest.mark.slow
def test_odc_lb_mini_matches_fsdp_collectives_step_by_step(tmp_path):
    odc = launch(tmp_path, "odc", "--odc", "on", "--balance", "lb_mini")
    fsdp = launch(tmp_path, "fsdp", "--odc", "off", "--balance", "lb_micro")
    assert len(odc["history"]) == len(fsdp["history"]) == 10
    uneven = [s["microbatches"] for s in odc["steps"] if len(set(s["microbatches"])) > 1]
    assert uneven, "LB-Mini should give the ranks different microbatch counts on some step"
    for a, b in zip(odc["history"], fsdp["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (a, b)
    assert odc["summary"]["odc/bubble_rate"] >= 0.0
    assert (tmp_path / "odc" / "odc_timeline.png").stat().st_size > 0
    # the run's own microbatch costs, fitted, usable as the next run's cost_model
    timings = json.loads((tmp_path / "odc" / "odc_microbatch_timings.json").read_text())
    assert len(timings["microbatches"]) == len(timings["seconds"]) > 0
    assert all(t > 0 for t in timings["seconds"]) and all(
        all(n > 0 for n in mb) for mb in timings["microbatches"]
    )
    assert {"a", "b", "c"} <= timings.keys() or "fit_error" in timings
    assert not (
        tmp_path / "fsdp" / "odc_microbatch_timings.json"
    ).exists()  # collectives: waits would pollute it
