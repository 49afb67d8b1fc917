"""transformers' ``batch_rebalance`` sampler as a plain planner: the one odc_hf module that imports it.

``TrainingArguments(train_sampling_strategy="batch_rebalance")`` makes the Trainer build
``transformers.trainer_pt_utils.BatchRebalanceSampler``: per optimizer step it splits ``W·per_device·grad_accum``
samples into ``W·grad_accum`` groups of consecutive lengths (longest first) whose padded cost
``bs·max_len + 0.001·bs·max_len²`` it evens out by moving group boundaries, then deals the groups by cost, slot by
slot, so every rank runs ``grad_accum`` microbatches (lockstep, as FSDP2 needs). This module runs that code (it
does not re-implement it) on one global batch and returns ``plan[rank][slot]`` = sample positions, which
:mod:`.lockstep` prices with odc_hf's cost models. The balancing core stays free of transformers
(``tests/project/test_layering.py``); the estimate, the simulators and the benchmarks import this module lazily.

The sampler yields one rank's microbatches; all ranks' come from its ``_assign`` (one call, where iterating the
public sampler once per rank would repeat the whole search ``W`` times). ``_assign`` is private: it is used here
only, checked to exist, and ``tests/prediction/test_batch_rebalance.py`` checks it against the public iteration of every rank.
"""

from __future__ import annotations

__all__ = ["RebalanceUnavailable", "available", "quadratic_coefficient", "rebalance_plan", "sampler_class"]


class RebalanceUnavailable(RuntimeError):
    """The installed transformers has no ``BatchRebalanceSampler`` (added in 5.x: 5.17 and 5.24 ship it)."""


def sampler_class():
    """``transformers.trainer_pt_utils.BatchRebalanceSampler``, or :class:`RebalanceUnavailable` saying why."""
    try:
        import transformers
        from transformers.trainer_pt_utils import BatchRebalanceSampler
    except ImportError as err:
        raise RebalanceUnavailable(
            f"transformers' BatchRebalanceSampler is not importable ({err}); the batch_rebalance baseline needs a "
            "transformers that has TrainingArguments(train_sampling_strategy='batch_rebalance') (5.17 and 5.24 do)"
        ) from None
    if not callable(getattr(BatchRebalanceSampler, "_assign", None)):
        raise RebalanceUnavailable(
            f"transformers {transformers.__version__}: BatchRebalanceSampler has no _assign(indices, lengths); "
            "odc_hf reads all ranks' plans through it (checked on 5.17 and 5.24)"
        )
    return BatchRebalanceSampler


def available() -> tuple[bool, str]:
    """(whether the baseline can run, why not)."""
    try:
        sampler_class()
    except RebalanceUnavailable as err:
        return False, str(err)
    return True, ""


def quadratic_coefficient() -> float:
    """The sampler's fixed weight of ``max_len²`` per row (0.001 in 5.17 and 5.24: quadratic wins past 1,000 tokens)."""
    return float(sampler_class().QUADRATIC_COST_COEF)


def rebalance_plan(lengths, world_size: int, grad_accum: int) -> list[list[list[int]]]:
    """``plan[rank][slot]``: positions in ``lengths`` (one global batch) the sampler gives each rank's microbatches.

    ``len(lengths)`` must be at least ``world_size · grad_accum`` (one sample per microbatch), as the sampler needs.
    """
    cls = sampler_class()
    lengths = [int(x) for x in lengths]
    if world_size < 1 or grad_accum < 1:
        raise ValueError(f"world_size and grad_accum must be >= 1, got {world_size} and {grad_accum}")
    if len(lengths) < world_size * grad_accum:
        raise ValueError(f"batch_rebalance needs one sample per microbatch: {len(lengths)} samples for {world_size} "
                         f"ranks x {grad_accum} microbatches")  # fmt: skip
    sampler = cls(lengths=lengths, effective_batch_size=len(lengths), dp_size=world_size, grad_accum=grad_accum,
                  shuffle=False, rank=0, drop_last=True)  # fmt: skip
    plan = sampler._assign(list(range(len(lengths))), lengths)
    return [[list(mb) for mb in mbs] for mbs in plan]
