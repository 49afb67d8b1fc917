"""GRPO's loss metrics as TRL defines them, whatever microbatches ODC trains.

TRL 1.16's ``GRPOTrainer._compute_loss`` logs, once per microbatch (a *slice* ``g`` of ``per_device_train_batch_size``
completions of every rank's generation batch, ``g = 0 .. gradient_accumulation_steps - 1``):

- ``kl`` (when ``beta != 0``), ``entropy``, ``clip_ratio/{low,high,region}_mean``: a masked token mean over slice
  ``g`` of *every* rank (one all-reduce of the sum and the token count: ``sum / max(count, 1)``, 0 when nothing is
  unmasked; the mask is ``completion_mask * tool_mask``); ``cispo`` logs ``cispo_clip_ratio`` instead of the clip
  ratios, ``vespo`` ``vespo/phi_seq_mean`` (a mean over sequences), ``sapo`` neither;
- ``clip_ratio/low_min`` / ``clip_ratio/high_max`` (the clipped loss types): the NaN-skipping min / max, over slice
  ``g``'s sequences of every rank, of each sequence's masked mean (NaN when no sequence has an unmasked token);

and ``log()`` averages the values appended since the last log. So the logged ``kl`` is the mean over slices of
per-slice token means, not a mean over the generation batch's tokens; a different split gives a different number.

ODC trains other microbatches (planned by cost; a slice's samples spread over several, ranks run different counts),
and its loss pass folds each sample's weight into TRL's mask. So each ODC microbatch's metrics are recomputed by TRL's
own ``_compute_loss`` once per slice present in it, on just those rows with TRL's mask, reusing the log-probs and
entropies of the training forward (no second forward); a :class:`MetricRecorder` in place of the accelerator
records the sum/count pairs and per-sequence values TRL would have reduced and gathered. :class:`SliceMetrics`
adds them up per slice, and once per step one gather across ranks gives TRL's per-slice values, appended in slice
order as TRL appends them. ``tests/grpo/test_grpo_parity.py`` compares every logged metric with TRL's own run.
"""

from __future__ import annotations

import math

import torch

CLIP_MEANS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
CLIP_EXTREMES = ("clip_ratio/low_min", "clip_ratio/high_max")


_LOSS_MEANS = {"dapo": CLIP_MEANS, "cispo": ("cispo_clip_ratio",), "vespo": ("vespo/phi_seq_mean",), "sapo": ()}


def mean_keys(beta: float, loss_code: str = "dapo") -> tuple[str, ...]:
    """The reduced (mean) metrics, in the order ``_compute_loss`` reduces them, for the branch ``loss_code`` of its
    loss (:data:`~odc_hf.integrations.trl.grpo_batch.LOSS_CODE`)."""
    return (("kl",) if beta != 0.0 else ()) + ("entropy", *_LOSS_MEANS[loss_code])


def extreme_keys(loss_code: str = "dapo") -> tuple[str, ...]:
    """The gathered min / max metrics of the branch ``loss_code`` (the clipped loss types' only)."""
    return CLIP_EXTREMES if loss_code == "dapo" else ()


class MetricRecorder:
    """Stands in for the Accelerator while TRL's ``_compute_loss`` recomputes a slice's metrics: keeps what it would
    reduce (``[sum, count]`` pairs) and gather (per-sequence values), and returns them unchanged (local)."""

    def __init__(self, accelerator):
        self._accelerator = accelerator
        self.reduced: list[torch.Tensor] = []
        self.gathered: list[torch.Tensor] = []

    def reduce(self, tensor, reduction="sum", scale=1.0):
        self.reduced.append(tensor.detach().double().reshape(-1))
        return tensor

    def gather(self, tensor):
        self.gathered.append(tensor.detach().double().reshape(-1))
        return tensor

    def gather_for_metrics(self, tensor, use_gather_object=False):  # the MoE aux loss: not a recomputed metric
        return tensor

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


class SliceMetrics:
    """Per-slice sums for one optimizer step on one rank; :meth:`combine` merges every rank's."""

    def __init__(self, num_slices: int, beta: float, loss_code: str = "dapo", *, entropy_bonus: bool = False):
        self.num_slices = num_slices
        self.means = mean_keys(beta, loss_code)
        self.extreme_keys = extreme_keys(loss_code)
        self.sums = torch.zeros(num_slices, len(self.means), 2, dtype=torch.float64)  # [sum, count]
        # [low_min, -high_max]
        self.extremes = torch.full((num_slices, len(self.extreme_keys)), math.inf, dtype=torch.float64)
        # With an entropy bonus, TRL logs ``policy_loss``: per slice, the mean over ranks of each rank's policy loss,
        # a sum of per-sample shares here (:meth:`add_policy_loss`); and its adaptive coefficient follows the step's
        # token mean of the entropy over every rank (:meth:`add_entropy`: [entropy sum, tokens]).
        self.policy = torch.zeros(num_slices if entropy_bonus else 0, dtype=torch.float64)
        self.window = torch.zeros(2 if entropy_bonus else 0, dtype=torch.float64)
        self.world_window: tuple[float, float] | None = None  # every rank's window, after combine()

    def add(self, slice_index: int, recorder: MetricRecorder) -> None:
        if len(recorder.reduced) != len(self.means) or len(recorder.gathered) != len(self.extreme_keys):
            raise RuntimeError(
                f"TRL's GRPO _compute_loss reduced {len(recorder.reduced)} and gathered {len(recorder.gathered)} "
                f"metrics, odc_hf expects {len(self.means)} ({', '.join(self.means)}) and {len(self.extreme_keys)}: "
                "its metric code changed (see TESTED_TRL in odc_hf/integrations/upstream/trl.py)"
            )
        for k, pair in enumerate(recorder.reduced):
            self.sums[slice_index, k] += pair.cpu()
        for k, (values, sign) in enumerate(zip(recorder.gathered, (1.0, -1.0))):
            values = values[~values.isnan()].cpu() * sign
            if values.numel():
                self.extremes[slice_index, k] = min(float(self.extremes[slice_index, k]), float(values.min()))

    def add_policy_loss(self, slice_index: int, share: float) -> None:
        self.policy[slice_index] += share

    def add_entropy(self, total: float, tokens: float) -> None:
        self.window += torch.tensor([total, tokens], dtype=torch.float64)

    def vector(self) -> torch.Tensor:
        return torch.cat([self.sums.reshape(-1), self.extremes.reshape(-1), self.policy, self.window])

    def combine(self, gathered: torch.Tensor) -> dict[str, list[float]]:
        """Every rank's :meth:`vector` (rows) -> TRL's per-slice values of each metric, slices in order."""
        split, ends = self.sums.numel(), self.sums.numel() + self.extremes.numel()
        sums = gathered[:, :split].reshape(-1, *self.sums.shape).sum(0)
        extremes = gathered[:, split:ends].reshape(gathered.size(0), *self.extremes.shape).amin(0)
        policy = gathered[:, ends : ends + self.policy.numel()].sum(0)
        if self.window.numel():
            self.world_window = tuple(gathered[:, ends + self.policy.numel() :].sum(0).tolist())
        out: dict[str, list[float]] = {}
        for k, key in enumerate(self.means):
            out[key] = [float(s / max(float(c), 1.0)) for s, c in sums[:, k].tolist()]  # TRL: clamp(min=1.0)
        for k, (key, sign) in enumerate(zip(self.extreme_keys, (1.0, -1.0))):
            out[key] = [sign * v if math.isfinite(v) else math.nan for v in extremes[:, k].tolist()]
        if policy.numel():
            out["policy_loss"] = policy.tolist()
        return out


def rows(inputs: dict, index: torch.Tensor, size: int) -> dict:
    """The rows ``index`` of every per-sample tensor of a microbatch (first dimension ``size``); others as they are."""
    return {k: v[index] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.size(0) == size else v
            for k, v in inputs.items()}  # fmt: skip
