"""The trainer checks' comparison and report rows (odc_hf.testing.compare, shared with benchmarks/sft/trainer_checks.py;
the runs themselves are the CPU suite's end-to-end tests), and the dtype the trainer plans attention shapes for."""

from __future__ import annotations

import pytest
import torch

from odc_hf.integrations.compute.attention import attention_dtype
from odc_hf.testing import compare


def history(losses, grads):
    return [{"step": i + 1, "loss": a, "grad_norm": g} for i, (a, g) in enumerate(zip(losses, grads))]


def test_compare_relative_and_near_zero_losses():
    ref = history([3.7e-9, 9.4253e-05, 2.5], [1.0, 2.0, 3.0])
    close = history([1.5e-8, 9.4272e-05, 2.5 * (1 + 5e-6)], [1.0, 2.0 * (1 + 5e-5), 3.0])
    r = compare.compare("x", close, ref)
    assert r["ok"], r  # 1e-8 apart near 0 (the relative difference there is meaningless), 5e-6 relative elsewhere
    assert r["max_abs_loss"] == pytest.approx(2.5 * 5e-6)
    assert r["max_rel_grad_norm"] == pytest.approx(5e-5)
    far = history([3.7e-9, 9.4253e-05, 2.5 * (1 + 2e-5)], [1.0, 2.0, 3.0])
    assert not compare.compare("x", far, ref)["ok"]
    bad_grad = history([3.7e-9, 9.4253e-05, 2.5], [1.0, 2.0, 3.0 * (1 + 2e-4)])
    assert not compare.compare("x", bad_grad, ref)["ok"]
    nan = history([float("nan"), 9.4253e-05, 2.5], [1.0, 2.0, 3.0])
    assert not compare.compare("x", nan, ref)["ok"]
    assert not compare.compare("x", ref[:2], ref)["ok"]  # a missing step
    assert compare.compare("x", ref, ref, steps=range(2, 4))["steps"] == 2


def test_rows_list_every_check():
    ref = history([1.0, 2.0], [1.0, 1.0])
    results = [compare.compare("sft", ref, ref),
               {"name": "warm", "ok": False, "warm_up": None, "losses": [1.0], "why": "no warm-up recorded"}]  # fmt: skip
    rows = compare.check_rows(results)
    assert rows[0][:5] == ["sft", "yes", "0.0e+00", "0.0e+00", "0.0e+00"]
    assert rows[1][:5] == ["warm", "**no**", "—", "—", "—"] and "no warm-up recorded" in rows[1][5]
    assert len(rows) == 2


def test_attention_dtype_follows_mixed_precision():
    assert attention_dtype("bf16", torch.float32) is torch.bfloat16
    assert attention_dtype("fp16", torch.float32) is torch.float16
    assert attention_dtype("no", torch.bfloat16) is torch.bfloat16
    assert attention_dtype("no", torch.float32) is None  # fp32 attention: nothing for cuDNN to plan
    assert attention_dtype(None, None) is None
