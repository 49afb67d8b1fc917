"""The ODC trainers in ONE process (world size 1: a workstation with one GPU, or `--num_processes 1`): nothing to
communicate, but they still plan bundles and must train exactly as TRL's own trainer does.

ODCSFTTrainer in one process: tests/test_trainer_errors.py::test_single_process_trains_without_odc_with_a_notice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _grpo(tmp_path: Path, trainer: str) -> list[dict]:
    out = tmp_path / trainer
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
           "ODC_NO_RELAUNCH": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    cmd = [sys.executable, str(ROOT / "examples/grpo.py"), "--trainer", trainer, "--fixed_rollouts", "--max_steps", "2",
           "--loss_type", "dapo", "--output_dir", str(out), "--losses_json", str(out / "losses.json")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((out / "losses.json").read_text())["dapo"]["history"]


@pytest.mark.slow
def test_odc_grpo_in_one_process_matches_trl(tmp_path):
    # It used to call all_gather_object without a process group ("Default process group has not been initialized").
    odc, trl = _grpo(tmp_path, "odc"), _grpo(tmp_path, "trl")
    assert [h["step"] for h in odc] == [h["step"] for h in trl] == [1, 2]
    for a, b in zip(odc, trl):
        # fp32, same rollouts, ODC's packed/padded microbatches vs TRL's: measured 3.3e-7 relative on the loss, equal
        # gradient norms; the tolerance of benchmarks/trainer_checks.py (1e-5 relative, 1e-7 absolute near 0)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (a, b)
