"""Predict step times of ODC + LB-Mini and FSDP2 + LB-Micro on a cluster, from sample lengths (pure numpy).

:func:`plan_steps` cuts the lengths into global minibatches (``per_rank`` samples per GPU, shuffled as
:class:`~odc_hf.balance.sampler.ODCBatchSampler` does), plans each with LB-Mini and LB-Micro over ALL ranks
(balancing is global), and keeps what the step-time model needs. :func:`step_times` then prices them on a
:class:`~odc_hf.prediction.cluster.Cluster`; planning is the slow part, so a bandwidth sweep plans once.

Per step (``k`` = LB-Micro's microbatch index, ``c_k`` = its slowest rank's cost, see :mod:`.cluster`):

- ``odc_hsdp``   = max over ranks of LB-Mini busy time + ONE all-reduce of the gradient shard + ODC's step overhead
- ``fsdp2_hsdp`` = Σ_k (c_k + cross-replica all-reduces exposed) + FSDP2's step overhead (shards over S)
- ``fsdp2_full`` = Σ_k (c_k + all-gathers / reduce-scatters exposed) + FSDP2's step overhead (shards over R·S)
- ``rebalance_hsdp`` / ``rebalance_full``: the same two FSDP2 layouts running a lockstep plan built elsewhere
  (``lockstep=``: transformers' ``batch_rebalance`` through :mod:`.batch_rebalance`), its microbatches priced
  padded or packed (:mod:`.lockstep`)
- ``bound`` = the planner's makespan lower bound + the smallest step overhead of any schedule: perfect balance,
  free communication. It never exceeds any schedule's step (``tests/prediction/test_prediction_bound_property.py``)

On one node the three reduce to ODC vs FSDP2 of the single-node simulator plus the step overheads. Cost
models are in seconds: :func:`~odc_hf.prediction.cost_models.load_cost_model` reads the H200 calibration shipped
in ``odc_hf/assets`` (scaled to other shapes by FLOPs) or a user's calibration JSON.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..balance.planner import plan_lb_micro, plan_lb_mini
from .cluster import (
    Cluster,
    ModelShape,
    StepOverheads,
    fsdp_full_exposed,
    fsdp_hsdp_exposed,
    odc_all_reduce_seconds,
)
from .lockstep import lockstep_cost_matrix

__all__ = [
    "BASELINES",
    "CANDIDATES",
    "LOCKSTEP_CANDIDATES",
    "PlannedStep",
    "makespan_bound",
    "plan_steps",
    "step_times",
    "summarize",
]

CANDIDATES = ("fsdp2_full", "fsdp2_hsdp", "odc_hsdp")
LOCKSTEP_CANDIDATES = ("rebalance_full", "rebalance_hsdp")
BASELINES = ("fsdp2_full", "fsdp2_hsdp", *LOCKSTEP_CANDIDATES)


@dataclass(frozen=True)
class PlannedStep:
    """One global minibatch, planned both ways (costs in the cost model's seconds)."""

    odc_busy: np.ndarray  # LB-Mini: predicted compute per rank
    fsdp_index_max: np.ndarray  # LB-Micro: per microbatch index, the slowest rank's cost
    fsdp_busy: np.ndarray  # LB-Micro: predicted compute per rank
    lower_bound: float  # no plan of these samples computes faster (planner's makespan bound)
    tokens: int
    lockstep_index_max: np.ndarray | None = None  # a lockstep plan built elsewhere: per slot, the slowest rank
    lockstep_busy: np.ndarray | None = None  # ... and its compute per rank


def plan_steps(
    lengths,
    world_size: int,
    per_rank: int,
    max_tokens: int,
    cost_model,
    *,
    seed: int = 0,
    shuffle: bool = True,
    max_steps: int | None = None,
    progress: Callable | None = None,
    lockstep: Callable[[np.ndarray], list] | None = None,
    lockstep_layout: str = "padded",
    lockstep_max_steps: int | None = None,
) -> list[PlannedStep]:
    """Plan every full global minibatch of ``lengths`` (``world_size · per_rank`` samples, last partial one dropped).

    Over-budget samples are clipped to ``max_tokens`` (the trainer needs ``truncate=True`` for them).
    ``max_steps`` keeps the first steps only; ``progress`` wraps the step iterator (e.g. ``tqdm``).
    ``lockstep(batch_lengths) -> plan[rank][slot]`` (positions in the batch) adds a third plan of each of the first
    ``lockstep_max_steps`` steps (all by default), priced in ``lockstep_layout`` (:mod:`.lockstep`); returning
    ``None`` instead of a plan ends the lockstep plans there.
    """
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or (lengths.size and not np.issubdtype(lengths.dtype, np.integer)):
        raise ValueError("lengths must be a 1-D sequence of integer token counts")
    for name, value in (("world_size", world_size), ("per_rank", per_rank), ("max_tokens", max_tokens)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    size = world_size * per_rank
    num_steps = lengths.size // size
    if num_steps == 0:
        raise ValueError(
            f"{lengths.size} samples do not fill one step of {world_size} GPUs x {per_rank} samples per GPU "
            f"= {size}: use more samples, fewer GPUs or fewer samples per GPU"
        )
    if max_steps is not None:
        num_steps = min(num_steps, int(max_steps))
    order = np.random.default_rng([seed, 0]).permutation(lengths.size) if shuffle else np.arange(lengths.size)
    clipped = np.minimum(lengths.astype(np.int64), max_tokens)
    steps = []
    indices = range(num_steps) if progress is None else progress(range(num_steps))
    for step in indices:
        batch = clipped[order[step * size : (step + 1) * size]]
        mini = plan_lb_mini(batch, world_size, max_tokens, cost_model)
        micro = plan_lb_micro(batch, world_size, max_tokens, cost_model)
        width = max(len(c) for c in micro.microbatch_costs)
        matrix = np.zeros((world_size, width))
        for rank, costs in enumerate(micro.microbatch_costs):
            matrix[rank, : len(costs)] = costs
        bound, lock_max, lock_busy = mini.lower_bound, None, None
        plan = None
        if lockstep is not None and (lockstep_max_steps is None or step < lockstep_max_steps):
            plan = lockstep(batch)
            if plan is None:  # the planner stops (e.g. out of time): the lockstep steps stay a prefix
                lockstep = None
        if plan is not None:
            lock = lockstep_cost_matrix(plan, batch, cost_model, layout=lockstep_layout)
            lock_max, lock_busy = lock.max(axis=0), lock.sum(axis=1)
            # the planner's bound assumes the fewest microbatches the token budget allows; a lockstep plan without a
            # budget may run fewer (larger) ones, so the bound takes the fewer of the two counts
            count = sum(1 for mbs in plan for mb in mbs if len(mb))
            bound = min(bound, makespan_bound(batch, world_size, count, cost_model))
        steps.append(
            PlannedStep(
                odc_busy=mini.rank_busy,
                fsdp_index_max=matrix.max(axis=0),
                fsdp_busy=micro.rank_busy,
                lower_bound=bound,
                tokens=int(batch.sum()),
                lockstep_index_max=lock_max,
                lockstep_busy=lock_busy,
            )
        )
    return steps


def makespan_bound(lengths, world_size: int, num_microbatches: int, cost_model) -> float:
    """No plan of ``lengths`` into ``num_microbatches`` or more microbatches over ``world_size`` ranks computes
    faster: max(Σ document costs + overhead · microbatches) / W, price of the costliest document alone). Padding
    only adds work (document costs grow with length), so it bounds padded plans too."""
    costs = cost_model.doc_costs(np.asarray(lengths))
    if costs.size == 0:
        return 0.0
    total = float(costs.sum()) + cost_model.overhead * max(1, num_microbatches)
    return max(total / world_size, cost_model.price(float(costs.max())))


def step_times(
    steps: list[PlannedStep],
    shape: ModelShape,
    cluster: Cluster,
    overheads: StepOverheads,
    *,
    forward_fraction: float = 0.25,
) -> dict[str, dict[str, np.ndarray]]:
    """Per candidate, per step: ``total``, ``compute`` (balance-bound part), ``comm`` (exposed), ``overhead``,
    ``bubble`` (1 - mean busy / compute time); plus ``bound`` (lower bound + the least overhead of any candidate).

    The steps must have been planned for ``cluster.world_size`` ranks. The lockstep candidates (steps planned with
    ``lockstep=``) cover the first steps that have a lockstep plan.
    """
    if not steps:
        raise ValueError("no planned steps")
    if steps[0].odc_busy.size != cluster.world_size:
        raise ValueError(
            f"steps were planned for {steps[0].odc_busy.size} ranks, the cluster has {cluster.world_size}"
        )
    S, N = cluster.gpus_per_node, cluster.world_size
    odc_compute = np.array([s.odc_busy.max() for s in steps])
    fsdp_compute = np.array([s.fsdp_index_max.sum() for s in steps])
    comm_of = {"fsdp2_full": fsdp_full_exposed, "fsdp2_hsdp": fsdp_hsdp_exposed}
    # every distinct microbatch time once: exposure is a pure function of it
    flat = np.concatenate([s.fsdp_index_max for s in steps])
    bounds = np.cumsum([0] + [s.fsdp_index_max.size for s in steps])
    out: dict[str, dict[str, np.ndarray]] = {}
    for name, exposed in comm_of.items():
        per_mb = exposed(flat, shape, cluster, forward_fraction=forward_fraction)
        comm = np.array([per_mb[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:])])
        overhead = overheads.fsdp(shape, S if name == "fsdp2_hsdp" else N)
        out[name] = _times(fsdp_compute, comm, overhead, [s.fsdp_busy.mean() for s in steps])
    odc_comm = np.full(len(steps), odc_all_reduce_seconds(shape, cluster))
    out["odc_hsdp"] = _times(
        odc_compute, odc_comm, overheads.odc(shape, S), [s.odc_busy.mean() for s in steps]
    )
    locked = [s for s in steps if s.lockstep_index_max is not None]
    if locked:
        if any(s.lockstep_index_max is None for s in steps[: len(locked)]):
            raise ValueError("lockstep plans must cover the first steps (plan_steps(lockstep_max_steps=...))")
        flat = np.concatenate([s.lockstep_index_max for s in locked])
        bounds = np.cumsum([0] + [s.lockstep_index_max.size for s in locked])
        compute = np.array([s.lockstep_index_max.sum() for s in locked])
        for name, layout in (("rebalance_full", "fsdp2_full"), ("rebalance_hsdp", "fsdp2_hsdp")):
            per_mb = comm_of[layout](flat, shape, cluster, forward_fraction=forward_fraction)
            comm = np.array([per_mb[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:])])
            overhead = overheads.fsdp(shape, S if layout == "fsdp2_hsdp" else N)
            out[name] = _times(compute, comm, overhead, [s.lockstep_busy.mean() for s in locked])
    # perfect balance and free communication, with the least per-step overhead of any schedule: a bound of all
    least = min(float(parts["overhead"][0]) for parts in out.values())
    out["bound"] = {"total": np.array([s.lower_bound for s in steps]) + least}
    return out


def _times(compute, comm, overhead, busy_mean) -> dict[str, np.ndarray]:
    compute = np.asarray(compute, dtype=np.float64)
    bubble = np.where(compute > 0, 1.0 - np.asarray(busy_mean) / np.where(compute > 0, compute, 1.0), 0.0)
    over = np.full_like(compute, overhead)
    return {
        "total": compute + comm + over,
        "compute": compute,
        "comm": comm,
        "overhead": over,
        "bubble": bubble,
    }


def summarize(times: dict[str, dict[str, np.ndarray]]) -> dict:
    """Mean step seconds per candidate and part, median bubble, the spread over steps, and ODC-HSDP's speedups over
    every baseline present (both FSDP2 layouts, and the lockstep ones when planned).

    ``speedup_vs_*`` = ratio of summed step times (throughput over the steps both ran); ``*_median``, ``*_p10``,
    ``*_p90`` = percentiles of the per-step ratios; ``*_se`` = standard error of ``speedup_vs_*`` over the steps
    (ratio estimator; 0 with one step: the spread of one step is unknown, see ``*_steps``).
    """
    summary: dict = {
        "steps": int(times["odc_hsdp"]["total"].size),
        "bound_s": float(times["bound"]["total"].mean()),
    }
    for name in (*CANDIDATES, *LOCKSTEP_CANDIDATES):
        if name not in times:
            continue
        parts = times[name]
        summary[name] = {f"{k}_s": float(parts[k].mean()) for k in ("total", "compute", "comm", "overhead")}
        summary[name]["bubble"] = float(np.median(parts["bubble"]))
        summary[name]["steps"] = int(parts["total"].size)
        summary[name]["total_p10_s"], summary[name]["total_p90_s"] = (
            float(x) for x in np.percentile(parts["total"], [10, 90])
        )
    for base in BASELINES:
        if base not in times:
            continue
        b = times[base]["total"]
        odc = times["odc_hsdp"]["total"][: b.size]
        ratio = float(b.sum() / odc.sum())
        per_step = b / odc
        summary[f"speedup_vs_{base}"] = ratio
        summary[f"speedup_vs_{base}_median"] = float(np.median(per_step))
        summary[f"speedup_vs_{base}_p10"], summary[f"speedup_vs_{base}_p90"] = (
            float(x) for x in np.percentile(per_step, [10, 90])
        )
        summary[f"speedup_vs_{base}_steps"] = int(b.size)
        summary[f"speedup_vs_{base}_se"] = _ratio_standard_error(b, odc)
    return summary


def _ratio_standard_error(num: np.ndarray, den: np.ndarray) -> float:
    """Standard error of Σnum / Σden over steps drawn independently (the delta method); 0 below two steps."""
    n = num.size
    if n < 2:
        return 0.0
    ratio = num.sum() / den.sum()
    residual = num - ratio * den
    return float(np.sqrt(residual.var(ddof=1) / n) / den.mean())
