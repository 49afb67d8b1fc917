"""The GRPO batch as ODC trains it: TRL's generation batch -> weighted samples -> padded microbatches.

:func:`sample_weights` gives every sample the weight TRL's loss normalisation gives it, :func:`unbatch` splits TRL's
padded generation batch into unpadded samples (what ranks exchange), and :func:`collate` pads the samples of one
planned microbatch back into TRL's layout (prompts left-padded, completions right-padded). Which samples go in
which microbatch is planned by :func:`odc_hf.balance.padded.plan_padded`; the trainer is ``odc_hf.integrations.grpo``.
"""

from __future__ import annotations

import torch

from odc_hf.balance.padded import padded_width
from odc_hf.integrations.bundle import Bundle

__all__ = ["CUDA_PAD_TO_MULTIPLE_OF", "GRPOBundle", "SUPPORTED_LOSS_TYPES", "collate", "sample_length", "sample_weights",
           "unbatch"]  # fmt: skip

SUPPORTED_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")

# Keys of TRL's generation batch that this module knows how to split into samples and re-pad.
_PER_TOKEN = ("completion_ids", "completion_mask", "old_per_token_logps", "ref_per_token_logps",
              "sampling_per_token_logps", "tool_mask", "importance_sampling_ratio")  # fmt: skip
_KNOWN_KEYS = {"prompt_ids", "prompt_mask", "advantages", "num_items_in_batch", *_PER_TOKEN}
# Padding of per-token values in masked columns. TRL evaluates exp(ref - logp) - (ref - logp) - 1 on every column
# before masking: a reference log-prob of 0 overflows to inf (inf x 0 = NaN) where logp < -88; a very negative one
# gives exp(...) = 0 and a finite term. (TRL's own batches hold real reference log-probs there.)
_RIGHT_PAD = {"ref_per_token_logps": -1e4}


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
                sample[key] = value[i, :c].cpu() if value.size(1) == width else value[i].cpu()
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
    if "odc_slice" in samples[0]:  # the TRL microbatch (slice) of each sample, for TRL's per-slice metrics
        batch["odc_slice"] = torch.tensor([s["odc_slice"] for s in samples], dtype=torch.long)
    loss_mask = batch["completion_mask"] * batch.get("tool_mask", 1)
    batch["num_label_tokens"] = int(loss_mask.sum())
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class GRPOBundle(Bundle):
    """A rank's microbatches of one step, in TRL's padded prompt/completion layout."""

    @property
    def input_tokens(self) -> int:  # tokens the forward passes process, padding included
        return sum(int(mb["prompt_ids"].numel() + mb["completion_ids"].numel()) for mb in self.microbatches)
