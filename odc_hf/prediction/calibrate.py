"""Calibrate a cost model on the target device: time forward+backward of the model, fit ``max(floor, a+b·s+c·s²)``.

It runs the model, so it lives above ``odc_hf.balance`` (pure planning: numbers in, plans out), beside the
estimate that reads its result (``--cost-model``); the result is a :class:`~odc_hf.balance.QuadraticCostModel`,
whose ``to_dict()`` is the JSON ``ODCConfig.cost_model`` reads.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from odc_hf.balance.cost import QuadraticCostModel

__all__ = ["calibrate", "time_lengths"]


def time_lengths(
    model, lengths: Sequence[int], *, repeats: int = 3, device=None, forward_kwargs: dict | None = None
) -> list[float]:
    """Median seconds of forward+backward of ``model`` on one random sequence per length.

    Each length is run once to warm up, then ``repeats`` times; the median is kept (robust to the
    occasional allocator or clock hiccup). Gradients are cleared after each run. ``device`` defaults to
    the model's own device. The model must accept ``input_ids`` and ``labels`` (any HF causal LM).
    Time the path training runs: apply its kernels and activation checkpointing to ``model`` first, and pass what
    its loss needs in ``forward_kwargs`` (``{"fused_lm_head": True}`` for TRL's fused LM head).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    lengths = [int(s) for s in lengths]
    if any(s < 2 for s in lengths):
        raise ValueError("calibration lengths must be >= 2 tokens")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run_once(ids):
        sync()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids, **(forward_kwargs or {})).loss.backward()
        sync()
        elapsed = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        return elapsed

    was_training = model.training
    model.train()
    medians = []
    try:
        for s in lengths:
            ids = torch.randint(0, vocab, (1, s), generator=generator).to(device)
            run_once(ids)  # warm-up: kernels, allocator, autotuning
            medians.append(statistics.median(run_once(ids) for _ in range(repeats)))
    finally:
        model.train(was_training)
    return medians


def calibrate(
    model, lengths: Sequence[int], *, repeats: int = 3, device=None, forward_kwargs: dict | None = None
) -> QuadraticCostModel:
    """Time forward+backward of ``model`` at each length (:func:`time_lengths`); fit ``max(floor, a + b·s + c·s²)``.

    Include a few short lengths (launch-bound, they set the floor) and at least three long ones. Kernels and
    activation checkpointing change the cost per token: calibrate the path training runs, and record it beside the
    coefficients (``{**model.to_dict(), "compute_path": {...}}``; :meth:`QuadraticCostModel.from_dict` ignores it).
    """
    seconds = time_lengths(model, lengths, repeats=repeats, device=device, forward_kwargs=forward_kwargs)
    return QuadraticCostModel.fit([int(s) for s in lengths], seconds)
