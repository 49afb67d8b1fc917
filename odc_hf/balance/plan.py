"""The :class:`Plan` of one global minibatch: which rank runs which microbatches, and its predicted cost.

Two step-time semantics, from the same per-microbatch costs:

- **FSDP**: every microbatch ends in per-layer collectives, so microbatch j starts on all ranks together
  and lasts as long as the slowest rank's j-th microbatch: ``Σ_j max_r cost[r][j]``. A rank with fewer
  microbatches contributes 0 at the missing indices (in practice FSDP needs equal counts; the FSDP
  planners pad with empty dummy microbatches).
- **ODC**: ranks meet once per minibatch, so the step lasts as long as the busiest rank: ``max_r Σ_j cost[r][j]``.

ODC time <= FSDP time for any plan (a max of sums is at most the sum of maxes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Plan", "SEMANTICS"]

SEMANTICS = ("fsdp", "odc")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Per rank, a list of microbatches, each a list of sample indices, plus each microbatch's cost.

    Indices are positions in the ``lengths`` the planner was given (0 .. n-1);
    :meth:`ODCBatchSampler.plan` returns plans already remapped to dataset indices (:meth:`remap`).
    An empty microbatch (``[]``) is a dummy step that FSDP needs to keep counts equal.
    ``lower_bound`` is the best step time any plan could reach for these samples (see
    :func:`odc_hf.balance.planner.makespan_lower_bound`).
    """

    mode: str
    microbatches: list[list[list[int]]]
    microbatch_costs: list[list[float]]
    lower_bound: float
    cost_model: str = field(default="")

    def __post_init__(self):
        if len(self.microbatches) != len(self.microbatch_costs):
            raise ValueError("microbatches and microbatch_costs must have one entry per rank")
        for rank, (mbs, costs) in enumerate(zip(self.microbatches, self.microbatch_costs)):
            if len(mbs) != len(costs):
                raise ValueError(f"rank {rank}: {len(mbs)} microbatches but {len(costs)} costs")

    @property
    def world_size(self) -> int:
        return len(self.microbatches)

    @property
    def num_microbatches(self) -> list[int]:
        """Microbatches per rank (dummies included)."""
        return [len(mbs) for mbs in self.microbatches]

    def for_rank(self, rank: int) -> list[list[int]]:
        """The bundle one rank runs in this step: its microbatches, each a list of indices."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return [list(mb) for mb in self.microbatches[rank]]

    def _cost_matrix(self) -> np.ndarray:
        """(world_size, max microbatch count) costs, 0 where a rank has no microbatch at that index."""
        width = max(self.num_microbatches, default=0)
        matrix = np.zeros((self.world_size, width))
        for rank, costs in enumerate(self.microbatch_costs):
            matrix[rank, : len(costs)] = costs
        return matrix

    @property
    def rank_busy(self) -> np.ndarray:
        """Predicted compute per rank: the sum of its microbatch costs."""
        return self._cost_matrix().sum(axis=1)

    @property
    def predicted_fsdp_time(self) -> float:
        """Σ over microbatch index of the max over ranks (per-layer barriers)."""
        return float(self._cost_matrix().max(axis=0, initial=0.0).sum())

    @property
    def predicted_odc_time(self) -> float:
        """Max over ranks of the rank's total (one barrier per minibatch)."""
        return float(self.rank_busy.max(initial=0.0))

    def predicted_time(self, semantics: str) -> float:
        if semantics not in SEMANTICS:
            raise ValueError(f"semantics must be one of {SEMANTICS}, got {semantics!r}")
        return self.predicted_fsdp_time if semantics == "fsdp" else self.predicted_odc_time

    def predicted_bubble(self, semantics: str) -> float:
        """1 - (mean busy time over ranks) / (step time): the fraction of rank-time spent waiting."""
        step = self.predicted_time(semantics)
        return 0.0 if step <= 0 else float(1.0 - self.rank_busy.mean() / step)

    def remap(self, indices: Sequence[int] | np.ndarray) -> Plan:
        """The same plan with every index i replaced by ``indices[i]`` (e.g. positions -> dataset indices)."""
        table = np.asarray(indices)
        return Plan(
            mode=self.mode,
            microbatches=[[table[mb].tolist() if mb else [] for mb in mbs] for mbs in self.microbatches],
            microbatch_costs=[list(costs) for costs in self.microbatch_costs],
            lower_bound=self.lower_bound,
            cost_model=self.cost_model,
        )

    def summary(self) -> dict:
        """Numbers worth logging once per step."""
        return {
            "mode": self.mode,
            "num_microbatches": self.num_microbatches,
            "predicted_fsdp_time": self.predicted_fsdp_time,
            "predicted_odc_time": self.predicted_odc_time,
            "predicted_bubble_fsdp": self.predicted_bubble("fsdp"),
            "predicted_bubble_odc": self.predicted_bubble("odc"),
            "lower_bound": self.lower_bound,
            "cost_model": self.cost_model,
        }
