"""The ODC trainers in ONE process (world size 1: a workstation with one GPU, or `--num_processes 1`): nothing to
communicate, but they still plan bundles and must train exactly as TRL's own trainer does.

ODCSFTTrainer in one process: tests/trainers/test_trainer_errors.py::test_single_process_trains_without_odc_with_a_notice.
"""

from __future__ import annotations

import pytest
from one_process_runs import grpo_run


@pytest.mark.slow
def test_odc_grpo_in_one_process_matches_trl(tmp_path):
    # It used to call all_gather_object without a process group ("Default process group has not been initialized").
    odc, trl = grpo_run(tmp_path / "odc", "odc"), grpo_run(tmp_path / "trl", "trl")
    assert [h["step"] for h in odc] == [h["step"] for h in trl] == [1, 2]
    for a, b in zip(odc, trl):
        # fp32, same rollouts, ODC's packed/padded microbatches vs TRL's: measured 3.3e-7 relative on the loss, equal
        # gradient norms; the tolerance of benchmarks/sft/trainer_checks.py (1e-5 relative, 1e-7 absolute near 0)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (a, b)
