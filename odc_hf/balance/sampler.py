"""``ODCBatchSampler``: one bundle of microbatches per optimizer step, planned identically on every rank.

Use it as the *batch sampler* of a DataLoader over a ``odc_hf.integrations.trainer.bundle.BundleDataset``: each
"batch" it yields is this rank's bundle for one step, ``list[list[int]]`` (microbatches of dataset indices);
the dataset turns each microbatch into examples and the collator packs them.

Every rank builds its own sampler from the same arguments (only ``rank`` differs) and gets the same
plans without communicating: the epoch's order comes from a generator seeded by ``(seed, epoch)`` and
each minibatch's plan is a pure function of its samples' lengths.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from torch.utils.data import Sampler

from .cost import CostModel, TokenCostModel
from .plan import Plan
from .planner import PLANNERS_ON_VALID_INPUT, effective_lengths

__all__ = ["ODCBatchSampler"]


class ODCBatchSampler(Sampler[list[list[int]]]):
    """Cut each epoch into global minibatches, plan each over ranks, yield this rank's share.

    Args:
        lengths: token count of every dataset sample (e.g. ``[len(x) for x in ds["input_ids"]]``).
        world_size, rank: the data-parallel group and this process's place in it.
        minibatch_size: GLOBAL number of samples per optimizer step (all ranks together).
        max_tokens_per_microbatch: token budget of one packed microbatch (memory bound).
        mode: ``"lb_mini"`` (ODC: balanced compute, unequal microbatch counts), ``"lb_micro"``
            (FSDP-compatible: equal counts, balanced per microbatch index) or ``"none"`` (round-robin).
        cost_model: how a document's length maps to compute. Defaults to :class:`TokenCostModel`
            because it needs no model config, but it ignores attention's quadratic cost: pass
            ``FlopCostModel.from_config(model.config)`` or a calibrated model for long sequences.
        seed: seeds the per-epoch shuffle together with the epoch.
        shuffle: permute the dataset each epoch; otherwise minibatches follow dataset order.
        drop_last: drop the last minibatch if it has fewer than ``minibatch_size`` samples; if False it
            is planned too (ranks may get empty bundles when it has fewer samples than ranks).
        truncate: plan over-budget samples as budget-long (the collator must truncate them, see
            ``odc_hf.integrations.trainer.bundle.BundleCollator(truncate=True)``); otherwise they raise a ValueError here.
        plan_ahead: plan this many steps ahead in a background thread, so a step's plan is ready when training asks
            for it (planning 65,536 samples over 1,024 ranks takes 0.1-0.4 s on one core). The plans are the same:
            each is a pure function of its step's samples. While step s is handed out, steps up to s + plan_ahead
            are planned or queued, one at a time, in one thread named ``odc-plan-ahead_0`` (the name stack dumps of
            a stuck rank show); an iteration stopped early drops the queued plans and does not wait for the one in
            progress. 0: plan each step when it is asked for.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        *,
        world_size: int,
        rank: int,
        minibatch_size: int,
        max_tokens_per_microbatch: int,
        mode: str = "lb_mini",
        cost_model: CostModel | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        truncate: bool = False,
        plan_ahead: int = 0,
    ):
        super().__init__()
        if int(plan_ahead) != plan_ahead or plan_ahead < 0:
            raise ValueError(f"plan_ahead must be an integer >= 0 (steps planned ahead), got {plan_ahead}")
        self.plan_ahead = int(plan_ahead)
        for name, value in (("world_size", world_size), ("minibatch_size", minibatch_size)):
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if mode not in PLANNERS_ON_VALID_INPUT:
            raise ValueError(f"mode must be one of {sorted(PLANNERS_ON_VALID_INPUT)}, got {mode!r}")
        # Checked once for the whole dataset here (lengths, budget, over-budget samples); every step's plan then
        # takes them as valid. The lengths are kept as given; the budget clips them per step when truncate is on.
        effective_lengths(lengths, max_tokens_per_microbatch, truncate, what="dataset sample")
        self.lengths = np.asarray(lengths).astype(np.int64)
        self.world_size, self.rank = int(world_size), int(rank)
        self.minibatch_size = int(minibatch_size)
        self.max_tokens_per_microbatch = int(max_tokens_per_microbatch)
        self.mode = mode
        self.cost_model = cost_model if cost_model is not None else TokenCostModel()
        self.seed, self.shuffle, self.drop_last, self.truncate = int(seed), shuffle, drop_last, truncate
        self.epoch = 0
        self._start_step = 0  # where the next __iter__ starts (set by load_state_dict)
        self._next_step = 0  # steps handed out so far in this epoch
        self._order_cache: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        """Optimizer steps per epoch."""
        n = self.lengths.size
        return n // self.minibatch_size if self.drop_last else math.ceil(n / self.minibatch_size)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's shuffle; a new epoch starts from its first step."""
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self._start_step = self._next_step = 0

    def _epoch_order(self) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != self.epoch:
            n = self.lengths.size
            if self.shuffle:
                order = np.random.default_rng([self.seed, self.epoch]).permutation(n)
            else:
                order = np.arange(n)
            self._order_cache = (self.epoch, order)
        return self._order_cache[1]

    def minibatch_indices(self, step: int) -> np.ndarray:
        """Dataset indices of this epoch's ``step``-th global minibatch."""
        if not 0 <= step < len(self):
            raise ValueError(f"step must be in [0, {len(self)}), got {step}")
        return self._epoch_order()[step * self.minibatch_size : (step + 1) * self.minibatch_size]

    def plan(self, step: int) -> Plan:
        """The full plan (all ranks, dataset indices) of this epoch's ``step``; same on every rank."""
        indices = self.minibatch_indices(step)
        lengths = np.minimum(self.lengths[indices], self.max_tokens_per_microbatch)  # validated in __init__
        planner = PLANNERS_ON_VALID_INPUT[self.mode]
        plan = planner(lengths, self.world_size, self.max_tokens_per_microbatch, self.cost_model)
        return plan.remap(indices)

    def __iter__(self) -> Iterator[list[list[int]]]:
        start, self._start_step = self._start_step, 0
        if self.plan_ahead == 0:
            for step in range(start, len(self)):
                self._next_step = step + 1
                yield self.plan(step).for_rank(self.rank)
            return
        # One worker thread plans steps in order, up to plan_ahead beyond the one handed out; numpy releases the GIL
        # in its array work, so planning overlaps the training step that runs meanwhile.
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="odc-plan-ahead")
        pending: deque = deque()
        upcoming = iter(range(start, len(self)))
        try:
            for step in upcoming:  # the first step and plan_ahead - 1 more; each handout queues one further
                pending.append((step, pool.submit(self._plan_for_rank, step)))
                if len(pending) >= self.plan_ahead:
                    break
            while pending:
                step, future = pending.popleft()
                plan = future.result()
                following = next(upcoming, None)
                if following is not None:
                    pending.append((following, pool.submit(self._plan_for_rank, following)))
                self._next_step = step + 1
                yield plan
        finally:  # queued plans are dropped; the one in progress ends on its own
            pool.shutdown(wait=False, cancel_futures=True)

    def _plan_for_rank(self, step: int) -> list[list[int]]:
        return self.plan(step).for_rank(self.rank)

    def state_dict(self) -> dict:
        """Epoch and the number of steps already handed out in it (for resuming mid-epoch).

        With a prefetching DataLoader the sampler runs ahead of training; prefer saving the step the
        trainer completed and restoring ``{"epoch": e, "step": completed}``.
        """
        return {"epoch": self.epoch, "step": self._next_step}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next iteration yields from ``state["step"]`` of ``state["epoch"]``."""
        epoch, step = int(state["epoch"]), int(state["step"])
        if epoch < 0 or not 0 <= step <= len(self):
            raise ValueError(f"invalid sampler state {state!r} for {len(self)} steps per epoch")
        self.epoch, self._start_step, self._next_step = epoch, step, step
