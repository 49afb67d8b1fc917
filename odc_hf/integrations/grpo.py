"""TRL GRPO with ODC: ``ODCGRPOTrainer``.

One optimizer step of TRL's ``GRPOTrainer`` (``steps_per_generation == gradient_accumulation_steps``, TRL's
default) trains on one generation batch, split on every rank into ``gradient_accumulation_steps`` padded
microbatches of ``per_device_train_batch_size`` completions; under FSDP collectives the rank holding the longest
completions sets the pace of every layer of every microbatch. Here, per generation:

1. each rank generates its own prompts (``generate()`` under FSDP2 gathers peers' shards one-sidedly, so ranks
   finish at different times without waiting for each other) and TRL scores them (advantages are final);
2. every sample gets the loss weight TRL's normalisation gives it (see :func:`sample_weights`): the collective
   trainer's loss is a fixed weighted sum of per-token terms, and only the weights depend on which rank and
   microbatch TRL put a sample in;
3. one exchange (``all_gather_object`` of the unpadded samples), then every rank plans the same split of the
   generation batch by cost (``ODCConfig.balance`` / ``cost_model``, balanced as padded) and packs its share into
   the fewest padded microbatches within the budget (:func:`plan_padded`); ranks run different numbers of them;
4. TRL's own ``compute_loss`` runs per microbatch with the weights folded into the loss mask, so its per-token
   loss (clipping, ``delta``, KL, masks) is used as is; its per-microbatch metric collectives stay local and are
   aggregated once per step.

TRL private surfaces used, all checked at construction against ``TESTED_TRL`` (``tests/test_grpo_trl_surface.py``):
``_generate_and_score_completions`` (generation + scoring), ``_get_train_sampler`` (overridden: one dataloader
batch per optimizer step), ``_metrics`` (per-step aggregation), and the key names of the batch dict that
``_compute_loss`` reads (``tool_mask`` multiplies the loss mask, ``num_items_in_batch`` normalises ``dapo``).
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import torch
import torch.distributed as dist
from packaging.version import Version

from odc_hf.balance.partition import karmarkar_karp_labels, labels_to_parts, refine_labels
from odc_hf.balance.plan import Plan
from odc_hf.balance.planner import PLANNERS
from odc_hf.integrations.trainer import Bundle, ODCMixin

logger = logging.getLogger(__name__)

TESTED_TRL = ("1.16",)
SUPPORTED_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")
TRL_PRIVATE_METHODS = ("_generate_and_score_completions", "_get_train_sampler", "compute_loss")
TRL_PRIVATE_ATTRIBUTES = ("_metrics", "loss_type", "beta", "ref_model", "max_completion_length", "num_iterations")
# Keys of TRL's generation batch that this module knows how to split into samples and re-pad.
_PER_TOKEN = ("completion_ids", "completion_mask", "old_per_token_logps", "ref_per_token_logps",
              "sampling_per_token_logps", "tool_mask", "importance_sampling_ratio")  # fmt: skip
_KNOWN_KEYS = {"prompt_ids", "prompt_mask", "advantages", "num_items_in_batch", *_PER_TOKEN}
# Padding of per-token values in masked columns. TRL evaluates exp(ref - logp) - (ref - logp) - 1 on every column
# before masking: a reference log-prob of 0 overflows to inf (inf x 0 = NaN) where logp < -88; a very negative one
# gives exp(...) = 0 and a finite term. (TRL's own batches hold real reference log-probs there.)
_RIGHT_PAD = {"ref_per_token_logps": -1e4}
# Metrics TRL's _compute_loss appends once per microbatch; aggregated over the step's microbatches of all ranks.
_LOSS_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                 "clip_ratio/low_min", "clip_ratio/high_max")  # fmt: skip


def check_trl_grpo(trainer) -> None:
    """Refuse TRL versions and settings this integration was not written for, with a message saying why."""
    import trl

    version = Version(trl.__version__)
    if f"{version.major}.{version.minor}" not in TESTED_TRL:
        raise RuntimeError(
            f"ODCGRPOTrainer reads private parts of TRL's GRPOTrainer and was written for trl {TESTED_TRL}; "
            f"found trl {trl.__version__}. Install trl=={TESTED_TRL[-1]}.* or update odc_hf/integrations/grpo.py"
        )
    missing = [n for n in TRL_PRIVATE_METHODS if not callable(getattr(trainer, n, None))]
    missing += [n for n in TRL_PRIVATE_ATTRIBUTES if not hasattr(trainer, n)]
    if missing:
        raise RuntimeError(f"trl {trl.__version__}: GRPOTrainer lacks {missing}; odc_hf was tested on {TESTED_TRL}")


def _check_settings(trainer, grad_accum: int) -> None:
    args = trainer.args
    refuse = []
    if trainer.loss_type not in SUPPORTED_LOSS_TYPES:
        refuse.append(f"loss_type={trainer.loss_type!r} (supported: {', '.join(SUPPORTED_LOSS_TYPES)})")
    if args.steps_per_generation != grad_accum:
        refuse.append(
            f"steps_per_generation={args.steps_per_generation} != gradient_accumulation_steps={grad_accum} "
            "(ODC trains one generation batch per optimizer step)"
        )
    if args.use_vllm:
        refuse.append("use_vllm=True (ODC's point here is generate() without lockstep)")
    if args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        refuse.append("an entropy bonus (entropy_coef / use_adaptive_entropy): it is normalised per microbatch")
    if args.top_entropy_quantile < 1.0:
        refuse.append("top_entropy_quantile < 1 (its quantile is gathered across ranks per microbatch)")
    if args.sync_ref_model:
        refuse.append("sync_ref_model=True (the ODC reference model is published once)")
    if not trainer.odc_config.enabled:
        refuse.append("ODCConfig(enabled=False): for the collective baseline use trl.GRPOTrainer itself")
    if refuse:
        raise ValueError("ODCGRPOTrainer does not support " + "; ".join(refuse))


# -- the loss weights ------------------------------------------------------------------------------
def sample_weights(
    loss_mask: torch.Tensor,
    slice_of: torch.Tensor,
    *,
    loss_type: str,
    num_slices: int,
    world_size: int,
    max_completion_length: int,
    num_items_in_batch: float,
) -> torch.Tensor:
    """Per-sample weight w such that TRL's loss equals sum over samples of w * sum_t(per_token_loss * mask).

    TRL (collectives) on every rank splits its generation batch into ``num_slices`` (= G, the accumulation steps)
    microbatches of P samples, divides each microbatch's loss as below and by G, and the gradient is averaged over
    the W ranks:

    - ``grpo``: mean over the microbatch of each sequence's token mean -> 1 / (len_i * P * G * W)
    - ``bnpo``: token sum / the microbatch's tokens                     -> 1 / (T_slice * G * W)
    - ``dr_grpo``: token sum / (P * max_completion_length)              -> 1 / (P * max_completion_length * G * W)
    - ``dapo``: token sum / (global tokens / W * G / steps_per_generation) -> 1 / global tokens (G == S)

    ``loss_mask`` is this rank's (B, T) loss mask, ``slice_of`` the (B,) microbatch index TRL gave each sample.
    """
    tokens = loss_mask.sum(-1).double()
    per_slice = torch.bincount(slice_of, minlength=num_slices)
    size = per_slice[slice_of].double()  # P of each sample's microbatch
    scale = float(num_slices * world_size)
    if loss_type == "grpo":
        return 1.0 / (tokens.clamp(min=1.0) * size * scale)
    if loss_type == "bnpo":
        slice_tokens = torch.zeros(num_slices, dtype=torch.float64).index_add_(0, slice_of, tokens)
        return 1.0 / (slice_tokens[slice_of].clamp(min=1.0) * scale)
    if loss_type == "dr_grpo":
        return 1.0 / (size * max_completion_length * scale)
    if loss_type == "dapo":
        return torch.full_like(tokens, 1.0 / max(float(num_items_in_batch), 1.0))
    raise ValueError(f"loss_type {loss_type!r} is not supported (supported: {SUPPORTED_LOSS_TYPES})")


# -- samples: unpad, exchange, plan, re-pad --------------------------------------------------------
def unbatch(batch: dict, weights: torch.Tensor) -> list[dict]:
    """TRL's padded generation batch -> one dict of unpadded CPU tensors per sample (plus its weight)."""
    unknown = sorted(k for k, v in batch.items() if k not in _KNOWN_KEYS and v is not None)
    if unknown:
        raise NotImplementedError(f"ODCGRPOTrainer cannot rebalance batches with {unknown} (multimodal inputs?)")
    width = batch["completion_ids"].size(1)
    prompt_len = batch["prompt_mask"].sum(-1).tolist()
    mask = batch["completion_mask"]
    # Completion i ends after its last attended token; keep one (masked) token when none is (a truncated
    # completion under mask_truncated_completions), so that every sample has a completion position.
    ends = torch.where(mask.any(-1), width - mask.flip(-1).int().argmax(-1), torch.ones_like(mask[:, 0])).tolist()
    samples = []
    for i, (p, c) in enumerate(zip(prompt_len, ends)):
        sample = {"prompt_ids": batch["prompt_ids"][i, batch["prompt_ids"].size(1) - p :].cpu(),
                  "advantages": batch["advantages"][i].cpu(), "weight": float(weights[i])}  # fmt: skip
        for key in _PER_TOKEN:
            value = batch.get(key)
            if value is not None:
                sample[key] = value[i, :c].cpu() if value.size(1) == width else value[i].cpu()
        samples.append(sample)
    return samples


def sample_length(sample: dict) -> int:
    return int(sample["prompt_ids"].numel() + sample["completion_ids"].numel())


# -- the padded layout: which samples each rank trains, in which padded microbatches ---------------------------------
def pack_padded(share, lengths, budget: int, cost_model=None, *, prompts=None, multiple: int = 1) -> list[list[int]]:
    """Pack one rank's samples into padded microbatches (TRL's layout) of rows x longest <= ``budget`` tokens.

    Fewest microbatches first (each one costs at least a launch-bound floor on a GPU), then, among the layouts with
    that count, the least predicted cost of the padded microbatches (``cost_model.microbatch_cost([longest] *
    rows)``; padded tokens when ``cost_model`` is None). Exact: with the samples sorted by length (descending, ties
    by index) some best layout cuts the sorted order into consecutive runs (giving each microbatch of a layout the
    next-longest samples never raises its longest), and a dynamic programme over the cut points finds it. So it
    never has more microbatches than any other padded layout of the same samples within the budget (e.g. first-fit
    decreasing by tokens, then splitting). A pure function of the lengths; a sample longer than the budget gets a
    microbatch of its own. Returns index lists, longest microbatch first.

    ``prompts`` (prompt length per sample, so completion = length - prompt) makes the budget exact for TRL's
    layout, where rows are padded to the longest prompt *plus* the longest completion (more than the longest
    sample when they come from different samples), rounded up to ``multiple`` columns (see
    :data:`CUDA_PAD_TO_MULTIPLE_OF`): the cut points are then chosen by :func:`_padded_runs_wide` on those widths
    (still the fewest microbatches, then the cheapest, among cuts of the sorted order).
    """
    return [mb for mb, _ in _pack(share, lengths, _PaddedPrices(cost_model, budget), prompts, multiple)]


def _pack(share, lengths, prices, prompts=None, multiple: int = 1) -> list[tuple[list[int], int]]:
    """:func:`pack_padded` with the caller's price cache: (microbatch, padded width) pairs."""
    order = sorted(share, key=lambda i: (-lengths[i], i))
    if prompts is None:
        runs = _padded_runs([lengths[i] for i in order], prices)[2]
        return [(order[a:b], lengths[order[a]]) for a, b in runs]
    pairs = [(int(prompts[i]), int(lengths[i]) - int(prompts[i])) for i in order]
    return [(order[a:b], width) for a, b, width in _padded_runs_wide(pairs, prices, multiple)[2]]


def _padded_runs_wide(pairs, prices, multiple: int = 1) -> tuple[int, float, list[tuple[int, int, int]]]:
    """(count, cost, [(start, end, width), ...]) of the best cut of (prompt, completion) pairs into padded microbatches.

    Width of a run = longest prompt + longest completion, rounded up to ``multiple``. It only grows as a run takes
    more samples, so the runs from i that fit end at the first sample that breaks the budget (a sample always fits
    alone). Same dynamic programme as :func:`_padded_runs` (:func:`_cut_at`), with a width per run length.
    """
    n, budget, multiple = len(pairs), prices.budget, max(1, multiple)
    count, cost, cut = [0] * (n + 1), [0.0] * (n + 1), [n] * (n + 1)
    widths_at = [()] * n
    for i in range(n - 1, -1, -1):
        widths, prompt, completion = [], 0, 0
        for p, c in pairs[i:]:
            prompt, completion = max(prompt, p), max(completion, c)
            width = prompt + completion
            width += -width % multiple  # padded_width, inlined: this loop is the planner's hot path
            if widths and (len(widths) + 1) * width > budget:
                break
            widths.append(width)
        _cut_at(i, len(widths), lambda rows, w=widths: prices(w[rows - 1], rows)[rows], count, cost, cut)
        widths_at[i] = widths
    return count[0], cost[0], [(a, b, widths_at[a][b - a - 1]) for a, b in _runs(cut)]


def _cut_at(i: int, rows: int, price, count: list, cost: list, cut: list) -> None:
    """One step of the cut DP: the best first run from sample i, of at most ``rows`` samples (``price(r)``: r rows).

    ``count[j]`` (fewest microbatches for the samples from j on) never grows with j, so the runs that reach the
    fewest count from i are the longest ones: scan down from the longest run while it holds, keep the cheapest
    (ties: fewer rows).
    """
    fewest, best, best_j = count[i + rows], float("inf"), i + rows
    for r in range(rows, 0, -1):
        j = i + r
        if count[j] != fewest:
            break
        c = cost[j] + price(r)
        if c <= best:
            best, best_j = c, j
    count[i], cost[i], cut[i] = fewest + 1, best, best_j


def _runs(cut: list[int]) -> list[tuple[int, int]]:
    """The (start, end) runs of a filled cut table, from sample 0."""
    runs, i = [], 0
    while i < len(cut) - 1:
        runs.append((i, cut[i]))
        i = cut[i]
    return runs


def padded_microbatch_width(prompts, completions, multiple: int = 1) -> int:
    """Columns of TRL's padded layout for samples with these prompt / completion lengths (rounded to ``multiple``)."""
    prompt = max(prompts)
    return prompt + padded_width(prompt, max(completions), multiple)


class _PaddedPrices:
    """``prices(longest, rows)[r]``: the cost of r rows padded to ``longest`` (r = 0..rows), cached per length."""

    def __init__(self, cost_model, budget: int):
        self.cost_model, self.budget, self.table = cost_model, int(budget), {}

    def max_rows(self, longest: int) -> int:
        return max(1, self.budget // max(longest, 1))

    def __call__(self, longest: int, rows: int) -> list[float]:
        prices = self.table.get(longest)
        if prices is None or len(prices) <= rows:
            if self.cost_model is None:
                unit, price = float(longest), float
            else:  # microbatch_cost([longest] * r) = price(r * doc cost)
                unit, price = float(self.cost_model.doc_costs([longest])[0]), self.cost_model.price
            prices = [0.0] + [price(r * unit) for r in range(1, max(rows, 2 * len(prices or ())) + 1)]
            self.table[longest] = prices
        return prices


def _padded_runs(descending: list[int], prices: _PaddedPrices) -> tuple[int, float, list[tuple[int, int]]]:
    """(count, cost, [(start, end), ...]) of the best cut of ``descending`` lengths into padded microbatches.

    Dynamic programme over the cut points (:func:`_cut_at`, inlined); a run is as wide as its first sample. Same
    result as :func:`_padded_runs_wide` with no prompt part (checked on random inputs), kept because the rank
    balancing's local search calls it thousands of times and the width bookkeeping there doubles planning time.
    """
    n = len(descending)
    count, cost, cut = [0] * (n + 1), [0.0] * (n + 1), [n] * (n + 1)
    for i in range(n - 1, -1, -1):
        longest = descending[i]
        rows = min(n - i, prices.max_rows(longest))
        row_price = prices(longest, rows)
        # _cut_at, inlined: the call per sample costs 10-15 % of plan_padded's time (256 samples, 8 ranks)
        fewest, best, best_j = count[i + rows], float("inf"), i + rows
        for r in range(rows, 0, -1):
            j = i + r
            if count[j] != fewest:
                break
            c = cost[j] + row_price[r]
            if c <= best:
                best, best_j = c, j
        count[i], cost[i], cut[i] = fewest + 1, best, best_j
    return count[0], cost[0], _runs(cut)


# The rebalancing's local search stops after this many samples' worth of layout evaluations (each evaluation of a
# rank's layout counts its samples): a deterministic bound on its work (under a second), not a quality knob.
_SEARCH_WORK = 200_000


def _balance_padded(shares: list[list[int]], lengths: list[int], prices: _PaddedPrices) -> list[list[int]]:
    """Rank shares balanced by their *padded* cost (the cost of their :func:`pack_padded` layouts).

    Two starts: the planner's shares, and the padded microbatches of all samples (one :func:`_padded_runs` over the
    whole generation batch: least padding) dealt to ranks by Karmarkar-Karp + refinement on their costs. The one
    whose busiest rank is cheaper (then: lower total) is polished by a local search: moves and swaps of samples
    (distinct lengths; equal lengths are interchangeable) between the busiest rank and the others; the change that
    leaves the pair least busy (then with the lowest pair total) is applied while both end below the busiest rank's
    cost. Deterministic (ties: lower rank, first candidate), bounded by ``_SEARCH_WORK``.
    """
    world = len(shares)
    memo: dict[tuple[int, ...], float] = {}
    work = 0

    def rank_cost(lens) -> float:
        nonlocal work
        key = tuple(sorted(lens, reverse=True))
        if key not in memo:
            work += len(key)
            memo[key] = _padded_runs(list(key), prices)[1]
        return memo[key]

    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    runs = [order[a:b] for a, b in _padded_runs([lengths[i] for i in order], prices)[2]]
    run_costs = np.array([prices(lengths[run[0]], len(run))[len(run)] for run in runs])
    labels = refine_labels(karmarkar_karp_labels(run_costs, world), run_costs, world)
    dealt = [[i for k in part for i in runs[k]] for part in labels_to_parts(labels, world)]

    def score(candidate):
        loads = [rank_cost([lengths[i] for i in s]) for s in candidate]
        return max(loads), sum(loads)

    shares = [sorted(s) for s in min(([list(s) for s in shares], dealt), key=score)]
    lens = [[lengths[i] for i in s] for s in shares]
    loads = [rank_cost(x) for x in lens]

    def without(values, x):
        out = list(values)
        out.remove(x)
        return out

    while work < _SEARCH_WORK:
        hi = min(range(world), key=lambda r: (-loads[r], r))
        best = None  # ((pair max, pair total), partner, length x from hi, length y from the partner or None)
        for lo in sorted((r for r in range(world) if r != hi), key=lambda r: (loads[r], r)):
            hi_lengths, lo_lengths = sorted(set(lens[hi]), reverse=True), sorted(set(lens[lo]), reverse=True)
            swaps = [(x, y) for x in hi_lengths for y in lo_lengths if x != y]
            changes = [(x, None) for x in hi_lengths] + swaps
            for x, y in changes:
                a = rank_cost(without(lens[hi], x) + ([] if y is None else [y]))
                b = rank_cost((lens[lo] if y is None else without(lens[lo], y)) + [x])
                key = (max(a, b), a + b)
                if key[0] < loads[hi] * (1 - 1e-9) and (best is None or key < best[0]):
                    best = (key, lo, x, y)
                if work >= _SEARCH_WORK:
                    break
            if work >= _SEARCH_WORK:
                break
        if best is None:
            break
        _, lo, x, y = best
        i = max(k for k in shares[hi] if lengths[k] == x)  # which of equal lengths changes rank: the last
        shares[hi].remove(i)
        if y is not None:
            j = max(k for k in shares[lo] if lengths[k] == y)
            shares[lo].remove(j)
            shares[hi].append(j)
        shares[lo].append(i)
        for r in (hi, lo):
            shares[r].sort()
            lens[r] = [lengths[k] for k in shares[r]]
            loads[r] = rank_cost(lens[r])
    return shares


def plan_padded(
    lengths, world_size: int, budget: int, cost_model, balance: str = "lb_mini", *, prompts=None, multiple: int = 1
) -> Plan:
    """ODC's GRPO layout, one function for the trainer and the benchmark: each rank's padded microbatches.

    ``PLANNERS[balance]`` (over prompt + completion lengths) decides which samples each rank gets; with ``lb_mini``
    the shares are then balanced by their cost as padded (:func:`_balance_padded`; the planner prices packed rows,
    but GRPO microbatches are padded). Each rank's whole share is packed by :func:`pack_padded`: fewest
    microbatches of rows x longest <= ``budget``, then the least padded cost. The :class:`Plan` holds those
    microbatches (costliest first) and their padded costs; its ``lower_bound`` is the planner's. A pure function of
    its arguments: every rank computes the same plan alone, and every sample is in exactly one microbatch.

    Pass ``prompts`` (and the column ``multiple`` the collator pads to) to hold the budget for the real padded width
    (longest prompt + longest completion, rounded): the final packing and the plan's costs then use it; the rank
    balancing still prices rows by the longest sample, an approximation.
    """
    lengths = [int(x) for x in lengths]
    plan = PLANNERS[balance](lengths, world_size, budget, cost_model)
    shares = [sorted(i for mb in mbs for i in mb) for mbs in plan.microbatches]
    prices = _PaddedPrices(cost_model, budget)
    if balance == "lb_mini" and world_size > 1:
        shares = _balance_padded(shares, lengths, prices)
    microbatches, costs = [], []
    for share in shares:
        packed = _pack(share, lengths, prices, prompts, multiple)
        mbs = [mb for mb, _ in packed]
        priced = [prices(width, len(mb))[len(mb)] for mb, width in packed]
        ranked = sorted(range(len(mbs)), key=lambda k: (-priced[k], k))
        microbatches.append([mbs[k] for k in ranked])
        costs.append([priced[k] for k in ranked])
    return Plan(mode=plan.mode, microbatches=microbatches, microbatch_costs=costs, lower_bound=plan.lower_bound,
                cost_model=plan.cost_model)  # fmt: skip


CUDA_PAD_TO_MULTIPLE_OF = 128
"""On CUDA, padded microbatches are ``prompt + completion`` columns wide rounded up to this multiple (extra
completion columns, masked). torch 2.11's cuDNN attention backward returns NaN in grad_q when an attention mask
is passed, the sequence length is 64 mod 128 and a query row is fully masked (a left-padded prompt's padding):
pytorch/pytorch#196678. Seen here as NaN weights after one such ODC microbatch (width 3776) on 2×H200. Multiples
of 128 are clean, and fewer distinct widths also mean fewer cuDNN plans to build."""


def padded_width(prompt: int, completion: int, multiple: int = 1) -> int:
    """Completion columns of a padded microbatch whose longest prompt/completion are ``prompt``/``completion``."""
    return completion + (-(prompt + completion)) % max(1, multiple)


def collate(samples: list[dict], pad_token_id: int, device, *, pad_to_multiple_of: int = 1) -> dict:
    """Samples -> one padded microbatch in TRL's layout (prompts left-padded, completions right-padded).

    ``pad_to_multiple_of`` widens the completion side (masked columns) so that the whole row is a multiple of it.
    """
    prompt_width = max(s["prompt_ids"].numel() for s in samples)
    completion_width = padded_width(prompt_width, max(s["completion_ids"].numel() for s in samples),
                                    pad_to_multiple_of)  # fmt: skip

    def stack(key, value, side):
        rows = [s[key] for s in samples]
        width = max(r.numel() for r in rows) if side == "left" else completion_width
        out = torch.full((len(rows), width), value, dtype=rows[0].dtype)
        for i, r in enumerate(rows):
            if side == "left":
                out[i, width - r.numel() :] = r
            else:
                out[i, : r.numel()] = r
        return out

    batch = {"prompt_ids": stack("prompt_ids", pad_token_id, "left")}
    batch["prompt_mask"] = stack("prompt_ids", -1, "left").ne(-1).long()
    for key in _PER_TOKEN:
        if key in samples[0]:
            first = samples[0][key]
            if key == "importance_sampling_ratio" and first.numel() == 1:  # sequence-level ratio: (B, 1)
                batch[key] = torch.stack([s[key].reshape(1) for s in samples])
            else:
                batch[key] = stack(key, _RIGHT_PAD.get(key, 0) if key != "completion_ids" else pad_token_id, "right")
    batch["advantages"] = torch.stack([s["advantages"] for s in samples])
    batch["odc_weight"] = torch.tensor([s["weight"] for s in samples], dtype=torch.float64)
    loss_mask = batch["completion_mask"] * batch.get("tool_mask", 1)
    batch["num_label_tokens"] = int(loss_mask.sum())
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class GRPOBundle(Bundle):
    """A rank's microbatches of one step, in TRL's padded prompt/completion layout."""

    @property
    def input_tokens(self) -> int:  # tokens the forward passes process, padding included
        return sum(int(mb["prompt_ids"].numel() + mb["completion_ids"].numel()) for mb in self.microbatches)


class _GRPOPart:
    """The GRPO specifics on top of :class:`ODCMixin`; see the module docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_trl_grpo(self)
        _check_settings(self, self.odc_grad_accum)
        self.odc_generation_steps = 0  # optimizer steps trained since the last generation
        self.odc_bundle: GRPOBundle | None = None
        self.odc_plan_summary: dict = {}
        self.odc_ref = self._odc_install_ref() if self.ref_model is not None else None

    def create_accelerator_and_postprocess(self):
        self.odc_grad_accum = self.args.gradient_accumulation_steps  # TRL's G, before ODCMixin folds it to 1
        super().create_accelerator_and_postprocess()

    def _odc_install_ref(self):
        """Put the (frozen, never updated) reference model on ODC too: its no-grad forwards gather one-sidedly."""
        from odc_hf.fsdp import install_odc, shard_model
        from odc_hf.integrations.accelerator import _is_sharded

        if self.accelerator.num_processes < 2:
            return None
        ref = self.ref_model
        if not _is_sharded(ref):  # CPU path: TRL kept a full replica; shard it like the policy
            ref.to(self.accelerator.device)
            shard_model(ref)
        config = self.odc_config
        return install_odc(ref, timeout_s=config.timeout_s, shm_dir=config.shm_dir)  # published once, for good

    # -- data: one dataloader batch (this rank's part of a generation batch) per optimizer step --------------
    def get_train_dataloader(self):
        return super(ODCMixin, self).get_train_dataloader()  # TRL's loader, with the sampler below

    def _get_train_sampler(self, dataset=None):
        from trl.trainer.utils import RepeatSampler

        return RepeatSampler(
            data_source=self.train_dataset if dataset is None else dataset,
            mini_repeat_count=self.num_generations,
            batch_size=self.args.generation_batch_size // self.num_generations,
            repeat_count=self.num_iterations,  # TRL: num_iterations * steps_per_generation microsteps
            shuffle=self.shuffle_dataset,
            seed=self.args.seed,
        )

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        try:
            return [next(epoch_iterator)], None
        except StopIteration:
            return [], None

    # -- one optimizer step ---------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()  # as Trainer.training_step does before TRL's _prepare_inputs: TRL reads the mode from it
        if self.odc_bundle is None or self.odc_generation_steps % self.num_iterations == 0:
            self.odc_bundle = self.odc_generate_and_plan(inputs)
            self.odc_generation_steps = 0
        self.odc_generation_steps += 1
        return super().training_step(model, self.odc_bundle, num_items_in_batch)

    @contextlib.contextmanager
    def _trl_accumulation_view(self):
        """TRL decides whether to compute old log-probs from ``args.gradient_accumulation_steps``; show it the
        user's value (ODCMixin runs the Trainer with 1) so it decides as it would without ODC."""
        folded = self.args.gradient_accumulation_steps
        self.args.gradient_accumulation_steps = self.odc_grad_accum
        try:
            yield
        finally:
            self.args.gradient_accumulation_steps = folded

    def odc_generate_and_plan(self, inputs) -> GRPOBundle:
        """Generate and score this rank's prompts, exchange the samples once, return this rank's bundle."""
        from trl.trainer.utils import shuffle_sequence_dict

        with self._trl_accumulation_view():
            batch = self._generate_and_score_completions(inputs)
        # The microbatches TRL would train on: its shuffle (same RNG draw, so runs stay comparable) and split.
        batch = shuffle_sequence_dict(batch)
        num_slices, size = self.odc_grad_accum, batch["completion_ids"].size(0)
        slice_of = torch.arange(size) // max(1, size // num_slices)
        loss_mask = batch["completion_mask"] * batch.get("tool_mask", 1)
        weights = sample_weights(loss_mask.cpu(), slice_of, loss_type=self.loss_type, num_slices=num_slices,
                                 world_size=self.accelerator.num_processes,
                                 max_completion_length=self.max_completion_length,
                                 num_items_in_batch=float(batch["num_items_in_batch"]))  # fmt: skip
        local = unbatch(batch, weights)
        gathered: list = [None] * self.accelerator.num_processes
        dist.all_gather_object(gathered, local)  # the one exchange per generation
        samples = [s for part in gathered for s in part]
        lengths = [sample_length(s) for s in samples]
        multiple = CUDA_PAD_TO_MULTIPLE_OF if self.accelerator.device.type == "cuda" else 1
        prompts = [int(s["prompt_ids"].numel()) for s in samples]
        # default: TRL's worst case for this batch, per_device rows of the widest padded row it could form
        budget = self.odc_config.max_tokens_per_microbatch or self.args.per_device_train_batch_size * padded_microbatch_width(
            prompts, [n - p for n, p in zip(lengths, prompts)], multiple
        )
        if max(lengths) > budget:
            raise ValueError(f"a sample has {max(lengths)} tokens, more than max_tokens_per_microbatch={budget}")
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        plan = plan_padded(lengths, world, budget, self._odc_cost_model(), self.odc_config.balance,
                           prompts=prompts, multiple=multiple)  # fmt: skip
        mine = plan.for_rank(rank)
        self.odc_plan_summary = plan.summary()
        self.odc_weight_scale = min(s["weight"] for s in samples)  # relative weights >= 1 (see compute_loss)
        pad = getattr(self.processing_class, "tokenizer", self.processing_class).pad_token_id
        return GRPOBundle([collate([samples[i] for i in mb], pad, "cpu", pad_to_multiple_of=multiple) for mb in mine])

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss on one ODC microbatch, each sample weighted as the collective trainer weighs it.

        TRL's ``dapo`` branch computes ``sum(per_token_loss * mask) / normaliser`` with ``mask = completion_mask *
        tool_mask``. Passing ``tool_mask`` = the sample's weight relative to the smallest one (>= 1, so TRL's
        ``mask.sum().clamp(min=1)`` guards never bite) and a ``num_items_in_batch`` that makes the normaliser the
        inverse of that smallest weight gives ``sum_i w_i * sum_t(per_token_loss * mask)``: every supported loss
        type (same per-token loss in TRL, different normalisers) becomes this one weighted sum.
        """
        if "odc_weight" not in inputs:  # evaluation: TRL's own path
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs = dict(inputs)
        relative = (inputs.pop("odc_weight") / self.odc_weight_scale).float().unsqueeze(1)
        tool = inputs.get("tool_mask")
        inputs["tool_mask"] = relative if tool is None else tool * relative
        world = self.accelerator.num_processes
        # TRL: normaliser = num_items / W * current_gradient_accumulation_steps (1 here) / steps_per_generation
        inputs["num_items_in_batch"] = torch.tensor(world * self.args.steps_per_generation / self.odc_weight_scale,
                                                    dtype=torch.float32, device=relative.device)  # fmt: skip
        loss_type, self.loss_type = self.loss_type, "dapo"
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self.loss_type = loss_type

    # -- once-per-step metrics ------------------------------------------------------------------------
    def odc_before_bundle(self):
        metrics = self._metrics["train"]
        return {k: len(metrics[k]) for k in _LOSS_METRICS}

    def odc_after_bundle(self, snapshot) -> None:
        metrics = self._metrics["train"]
        rows = []
        for key in _LOSS_METRICS:
            new = [v for v in metrics[key][snapshot[key] :] if v == v]  # TRL's nanmin/nanmax skip NaN
            rows.append([sum(new), len(new), min(new, default=float("inf")), max(new, default=float("-inf"))])
        local = torch.tensor(rows, dtype=torch.float64, device=self.accelerator.device)
        every = self.accelerator.gather(local.unsqueeze(0)).reshape(-1, len(_LOSS_METRICS), 4)
        for k, key in enumerate(_LOSS_METRICS):
            del metrics[key][snapshot[key] :]
            total, count = every[:, k, 0].sum().item(), every[:, k, 1].sum().item()
            if count == 0:
                if not metrics[key]:
                    del metrics[key]
                continue
            if key.endswith("_min"):
                metrics[key].append(every[:, k, 2].min().item())
            elif key.endswith("_max"):
                metrics[key].append(every[:, k, 3].max().item())
            else:  # mean over every microbatch of every rank
                metrics[key].append(total / count)

    def log(self, logs, *args, **kwargs):
        if "loss" in logs and self.odc_plan_summary:
            logs = {**logs, "odc/predicted_bubble": round(self.odc_plan_summary["predicted_bubble_odc"], 4)}
        return super().log(logs, *args, **kwargs)


def make_odc_grpo_trainer(grpo_cls):
    """``ODCX = make_odc_grpo_trainer(X)`` for ``trl.GRPOTrainer`` or a subclass of it."""
    cls = type(f"ODC{grpo_cls.__name__}", (_GRPOPart, ODCMixin, grpo_cls), {"__module__": __name__})
    return cls


def __getattr__(name):
    if name == "ODCGRPOTrainer":
        from trl import GRPOTrainer

        cls = make_odc_grpo_trainer(GRPOTrainer)
        globals()[name] = cls
        return cls
    raise AttributeError(name)


__all__ = [
    "SUPPORTED_LOSS_TYPES",
    "check_trl_grpo",
    "make_odc_grpo_trainer",
    "pack_padded",
    "plan_padded",
    "sample_weights",
]
