"""The GRPO batch as ODC trains it: TRL's generation batch -> weighted samples -> microbatches.

:func:`sample_weights` gives every sample the weight TRL's loss normalisation gives it, :func:`unbatch` splits TRL's
padded generation batch into unpadded samples (what ranks exchange), and :func:`collate` puts the samples of one
planned microbatch back into TRL's layout (prompts left-padded, completions right-padded): the tensors TRL's loss
reads. With ``packed=True`` it adds the row the model really runs on (:func:`pack_rows`): the same sequences back to
back, no padding, and the index that puts the row's per-token log-probs back into TRL's (rows, completion columns)
layout, where TRL's loss code then runs unchanged. Which samples go in which microbatch is planned by
:func:`odc_hf.balance.padded.plan_padded` (padded) or the packed planners (``odc_hf.balance.planner``); the trainer is
``odc_hf.integrations.trl.grpo_trainer``.
"""

from __future__ import annotations

import torch

from odc_hf.balance.padded import padded_width
from odc_hf.integrations.compute.attention import is_flash
from odc_hf.integrations.trainer.bundle import Bundle

__all__ = ["CUDA_PAD_TO_MULTIPLE_OF", "GRPOBundle", "LOSS_CODE", "PACKED_KEY", "SUPPORTED_LOSS_TYPES",
           "TOKEN_COUNT_NORMALISED", "collate", "loss_mask", "pack_rows",
           "padded_columns_multiple",
           "sample_length", "sample_weights", "scatter_packed", "unbatch"]  # fmt: skip

SUPPORTED_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "luspo", "cispo", "vespo", "sapo")

LOSS_CODE = {"dapo": "dapo", "grpo": "dapo", "bnpo": "dapo", "dr_grpo": "dapo", "luspo": "dapo",
             "cispo": "cispo", "vespo": "vespo", "sapo": "sapo"}  # fmt: skip
"""The loss type whose branch of TRL's ``_compute_loss`` computes an ODC microbatch's loss. The first five share
TRL's per-token loss (the clipped importance ratio times the advantage) and differ only in their normalisers, which
the sample weights carry: they run through the ``dapo`` branch, a weighted token sum. ``cispo`` and ``vespo`` have
per-token losses of their own and already normalise as ``dapo`` (equal weights); ``sapo`` has its own per-token loss
and ``grpo``'s per-sequence means (the trainer scales its branch's result: ``ODCGRPOTrainer.compute_loss``)."""

TOKEN_COUNT_NORMALISED = ("dapo", "cispo", "vespo")
"""The loss types TRL divides by the generation batch's token count (rescaled to a step), the accumulation steps
included; the others divide by the accumulation steps after their own normaliser."""


def loss_mask(batch: dict) -> torch.Tensor:
    """TRL's loss mask of a (rows, completion columns) batch: ``completion_mask * tool_mask``."""
    return batch["completion_mask"] * batch.get("tool_mask", 1)

# Keys of TRL's generation batch that this module knows how to split into samples and re-pad.
_PER_TOKEN = ("completion_ids", "completion_mask", "old_per_token_logps", "ref_per_token_logps",
              "sampling_per_token_logps", "tool_mask", "importance_sampling_ratio")  # fmt: skip
_KNOWN_KEYS = {"prompt_ids", "prompt_mask", "advantages", "num_items_in_batch", *_PER_TOKEN}
# Padding of per-token values in masked columns. TRL evaluates exp(ref - logp) - (ref - logp) - 1 on every column
# before masking: a reference log-prob of 0 overflows to inf (inf x 0 = NaN) where logp < -88; a very negative one
# gives exp(...) = 0 and a finite term. (TRL's own batches hold real reference log-probs there.) TRL's vLLM importance
# ratio is exp(0) = 1 in its padding columns (the log-prob difference is masked to 0 first), and ``vespo`` sums its
# log over every column, padding included: padded with 1 here, it adds nothing, as in TRL (bounds that exclude 1 are
# refused with vespo: grpo_config.refusals).
_RIGHT_PAD = {"ref_per_token_logps": -1e4, "importance_sampling_ratio": 1.0}


# -- the loss weights ------------------------------------------------------------------------------
def sample_weights(
    loss_mask: torch.Tensor,
    slice_of: torch.Tensor,
    *,
    loss_type: str,
    num_slices: int,
    accumulation: int | None = None,
    world_size: int,
    max_completion_length: int,
    num_items_in_batch: float,
) -> torch.Tensor:
    """Per-sample weight w such that TRL's loss equals sum over samples of w * sum_t(per_token_loss * mask).

    TRL (collectives) on every rank splits its generation batch into ``num_slices`` (S, ``steps_per_generation``)
    microbatches of P samples, of which each optimizer step trains ``accumulation`` (G, the accumulation steps;
    default S), divides each microbatch's loss as below and by G, and the gradient is averaged over the W ranks:

    - ``grpo``: mean over the microbatch of each sequence's token mean -> 1 / (len_i * P * G * W)
    - ``bnpo``: token sum / the microbatch's tokens                     -> 1 / (T_slice * G * W)
    - ``dr_grpo``: token sum / (P * max_completion_length)              -> 1 / (P * max_completion_length * G * W)
    - ``dapo``: token sum / (global tokens / W * G / S)                  -> S / (global tokens * G)
    - ``luspo``: mean over the microbatch of each sequence's token sum  -> 1 / (P * G * W)
    - ``cispo``, ``vespo``: as ``dapo``; ``sapo``: as ``grpo`` (their per-token losses differ: :data:`LOSS_CODE`)

    ``loss_mask`` is this rank's (B, T) loss mask, ``slice_of`` the (B,) microbatch index TRL gave each sample.
    """
    tokens = loss_mask.sum(-1).double()
    per_slice = torch.bincount(slice_of, minlength=num_slices)
    size = per_slice[slice_of].double()  # P of each sample's microbatch
    accumulation = num_slices if accumulation is None else accumulation
    scale = float(accumulation * world_size)
    if loss_type in ("grpo", "sapo"):
        return 1.0 / (tokens.clamp(min=1.0) * size * scale)
    if loss_type == "luspo":
        return 1.0 / (size * scale)
    if loss_type == "bnpo":
        slice_tokens = torch.zeros(num_slices, dtype=torch.float64).index_add_(0, slice_of, tokens)
        return 1.0 / (slice_tokens[slice_of].clamp(min=1.0) * scale)
    if loss_type == "dr_grpo":
        return 1.0 / (size * max_completion_length * scale)
    if loss_type in TOKEN_COUNT_NORMALISED:
        return torch.full_like(tokens, num_slices / (max(float(num_items_in_batch), 1.0) * accumulation))
    raise ValueError(f"loss_type {loss_type!r} is not supported (supported: {SUPPORTED_LOSS_TYPES})")


# -- samples: unpad (for the exchange), re-pad (per planned microbatch) ------------------------------
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
                # a per-sequence value ((B, 1): the sequence-level importance ratio) becomes a 0-d tensor, so that
                # collate never mistakes it for the token values of a one-token completion
                sample[key] = value[i, :c].cpu() if value.size(1) == width else value[i].reshape(()).cpu()
        samples.append(sample)
    return samples


def sample_length(sample: dict) -> int:
    return int(sample["prompt_ids"].numel() + sample["completion_ids"].numel())



CUDA_PAD_TO_MULTIPLE_OF = 128
"""On CUDA, padded microbatches are ``prompt + completion`` columns wide rounded up to this multiple (extra
completion columns, masked). torch 2.11's cuDNN attention backward returns NaN in grad_q when an attention mask
is passed, the sequence length is 64 mod 128 and a query row is fully masked (a left-padded prompt's padding):
pytorch/pytorch#196678. Seen here as NaN weights after one such ODC microbatch (width 3776) on 2×H200. Multiples
of 128 are clean, and fewer distinct widths also mean fewer cuDNN plans to build."""


def padded_columns_multiple(device_type: str, implementation: str | None) -> int:
    """The column multiple padded microbatches are rounded up to (:data:`CUDA_PAD_TO_MULTIPLE_OF` or 1).

    The rounding guards cuDNN's masked attention, so it applies on CUDA where padded rows reach it: ``sdpa``, and
    ``sdpa_varlen``, which runs padded rows as ``sdpa`` with the padding mask. FlashAttention (``flash_attention_*``)
    unpads the rows and runs no masked kernel, so its padded rows keep their exact width (fewer padded tokens, a
    slightly faster step: docs/benchmarks.md).
    """
    if device_type != "cuda" or is_flash(implementation):
        return 1
    return CUDA_PAD_TO_MULTIPLE_OF


def collate(samples: list[dict], pad_token_id: int, device, *, pad_to_multiple_of: int = 1, packed: bool = False) -> dict:
    """Samples -> one microbatch in TRL's layout (prompts left-padded, completions right-padded).

    ``pad_to_multiple_of`` widens the completion side (masked columns) so that the whole row is a multiple of it.
    ``packed``: also the packed row the model runs on, under :data:`PACKED_KEY` (:func:`pack_rows`).
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
            if key == "importance_sampling_ratio" and first.dim() == 0:  # sequence-level ratio: (B, 1)
                batch[key] = torch.stack([s[key].reshape(1) for s in samples])
            else:
                batch[key] = stack(key, _RIGHT_PAD.get(key, 0) if key != "completion_ids" else pad_token_id, "right")
    batch["advantages"] = torch.stack([s["advantages"] for s in samples])
    batch["odc_weight"] = torch.tensor([s["weight"] for s in samples], dtype=torch.float64)
    if "entropy_weight" in samples[0]:  # the entropy bonus's weight of each sample (ODCGRPOTrainer)
        batch["odc_entropy_weight"] = torch.tensor([s["entropy_weight"] for s in samples], dtype=torch.float64)
    for key in ("odc_slice", "odc_origin"):  # each sample's TRL microbatch: its slice (per-slice metrics), its rank
        if key in samples[0]:
            batch[key] = torch.tensor([s[key] for s in samples], dtype=torch.long)
    batch["num_label_tokens"] = int(loss_mask(batch).sum())
    if packed:
        batch[PACKED_KEY] = pack_rows(torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1),
                                      torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1),
                                      batch["completion_ids"].size(1))  # fmt: skip
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


PACKED_KEY = "odc_packed"
"""The microbatch key of the packed row (a dict, see :func:`pack_rows`); the trainer pops it before TRL's loss."""


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> dict:
    """TRL's padded (rows, columns) model inputs -> one packed row of the attended tokens, for a varlen forward.

    Each row's attended tokens (``attention_mask`` 1: the prompt, then the completion up to its end) go back to back;
    ``position_ids`` count columns from the row's first attended token (0, 1, ... for contiguous tokens; a masked
    column inside a row keeps its distance, as in the padded forward); ``labels`` are TRL's (the token where it is
    scored, -100 elsewhere and at every sequence start, so nothing is predicted across a boundary). The boundaries
    come as ``cu_seq_lens_q/k`` (int32) and ``max_length_q/k`` (Python ints), the form transformers' flash path
    passes straight to the varlen kernel (no host sync per layer, unlike boundaries derived from ``position_ids``;
    docs/attention.md) and ``sdpa_varlen`` reads once per forward. ``index`` (rows, ``logits_to_keep``) points each
    scored column at its token's entry in the fused head's shifted log-probs, or at a zero past their end
    (:func:`scatter_packed`). Built on the CPU: one read of the mask, never per layer.
    """
    input_ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
    rows, width = mask.shape
    kept = mask.flatten().nonzero().flatten()  # flat (row * width + column) of every attended token, row by row
    row_of, column = kept // width, kept % width
    lengths = mask.sum(1)
    starts = torch.cumsum(lengths, 0) - lengths  # packed offset of each row's first token
    first_column = torch.full((rows,), width, dtype=torch.long).scatter_reduce(0, row_of, column, "amin")
    total = int(kept.numel())
    position = torch.arange(total) - starts[row_of]  # index within the row's attended tokens
    labels = torch.where(column >= width - logits_to_keep, input_ids.flatten()[kept], -100)
    labels[position == 0] = -100
    packed_at = torch.full((rows * width,), -1, dtype=torch.long)
    packed_at[kept] = torch.arange(total)
    scored = packed_at.view(rows, width)[:, width - logits_to_keep :]
    # the fused head's log-probs are shifted (entry t scores token t + 1); entry total - 1 is the appended zero
    index = torch.where(scored > 0, scored - 1, total - 1)
    sizes = lengths[lengths > 0]
    cu = torch.zeros(len(sizes) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(sizes, 0)
    longest = int(sizes.max()) if len(sizes) else 0
    return {"input_ids": input_ids.flatten()[kept].unsqueeze(0), "position_ids": (column - first_column[row_of]).unsqueeze(0),
            "labels": labels.unsqueeze(0), "cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone(), "max_length_q": longest,
            "max_length_k": longest, "index": index}  # fmt: skip


def scatter_packed(per_token: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    """The packed row's (1, T - 1) shifted per-token values -> TRL's (rows, completion columns) layout, 0 where TRL
    has 0 (unscored columns). Differentiable (a gather)."""
    if per_token is None:
        return None
    flat = torch.cat([per_token.reshape(-1), per_token.new_zeros(1)])
    return flat[index]


class GRPOBundle(Bundle):
    """A rank's microbatches of one step, in TRL's padded prompt/completion layout."""

    @property
    def input_tokens(self) -> int:  # tokens the forward passes process, padding included
        return sum(int(mb[PACKED_KEY]["input_ids"].numel()) if PACKED_KEY in mb
                   else int(mb["prompt_ids"].numel() + mb["completion_ids"].numel()) for mb in self.microbatches)  # fmt: skip
