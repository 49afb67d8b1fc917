"""Per-document causal attention for packed rows, on torch's SDPA kernels (no flash-attn package needed).

Packed microbatches (several documents in one row, ``position_ids`` restarting at 0, as TRL's padding-free
collator and :class:`~odc_hf.balance.BundleCollator` build them) need attention that stays inside each
document. transformers' ``"sdpa"`` does that with an explicit block-diagonal mask (``masking_utils``), and
SDPA with a materialised mask runs a kernel that skips nothing: a row of documents s1, s2, ... then costs
``(s1 + s2 + ...)^2`` attention, not the ``s1^2 + s2^2 + ...`` the balancer's cost model (and flash-attn's
varlen kernel) assume. On a 2×H200 LongAlign-like run that made packed rows far more expensive than
planned (see ``benchmarks/results/sft_main_job_*``).

``attn_implementation="sdpa_varlen"`` runs SDPA once per document with ``is_causal=True`` (the flash
kernel on GPUs), splitting at the ``cu_seq_lens_q`` boundaries the padding-free collators provide. No mask
is built. It is registered through transformers' public ``AttentionInterface``::

    import odc_hf.attention  # registers "sdpa_varlen"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa_varlen")

It is meant for training on packed rows. Anything else (a padding mask, a KV cache, batch > 1) falls back to
plain ``"sdpa"`` semantics without a mask, so use ``"sdpa"`` for padded batched generation: no padding mask
is built for this implementation. One host sync per forward reads the boundaries (cached across layers).
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

__all__ = ["VARLEN_ATTENTION", "document_bounds", "register", "sdpa_varlen_attention_forward"]

VARLEN_ATTENTION = "sdpa_varlen"
"""The ``attn_implementation`` name this module registers."""

CALLS: Counter = Counter()
"""How often each path ran: ``documents`` (per-document SDPA calls), ``single`` (one-document rows), ``fallback``."""

_cache: tuple[weakref.ref, list[tuple[int, int]]] | None = None


def document_bounds(cu_seq_lens: torch.Tensor | None, length: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of the documents in a packed row of ``length`` tokens.

    ``cu_seq_lens`` is the cumulative-length vector of the varlen kernels (``[0, s1, s1+s2, ...]``). The
    result is cached for the tensor object, which the model passes unchanged to every layer, so the
    device-to-host copy happens once per forward.
    """
    global _cache
    if cu_seq_lens is None:
        return [(0, length)]
    if _cache is not None and _cache[0]() is cu_seq_lens:
        return _cache[1]
    offsets = [int(x) for x in cu_seq_lens.tolist()]
    if offsets[0] != 0 or offsets[-1] != length or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(
            f"cu_seq_lens_q {offsets[:8]}{'...' if len(offsets) > 8 else ''} does not describe a packed row of "
            f"{length} tokens"
        )
    bounds = [(a, b) for a, b in zip(offsets, offsets[1:]) if b > a]
    _cache = (weakref.ref(cu_seq_lens), bounds)
    return bounds


def sdpa_varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function for ``AttentionInterface``: (batch, heads, seq, dim) in, (batch, seq, heads, dim) out."""
    cu_seq_lens = kwargs.pop("cu_seq_lens_q", None)
    for key_name in ("cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"):
        kwargs.pop(key_name, None)
    length = query.shape[2]
    if attention_mask is not None or query.shape[0] != 1 or key.shape[2] != length or cu_seq_lens is None:
        CALLS["fallback"] += 1
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    bounds = document_bounds(cu_seq_lens, length)
    if len(bounds) == 1:
        CALLS["single"] += 1
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    CALLS["documents"] += len(bounds)
    outputs = [
        sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, **kwargs)[0]
        for a, b in bounds
    ]
    return torch.cat(outputs, dim=1), None


def register() -> str:
    """Register ``"sdpa_varlen"`` with transformers (idempotent) and return the name."""
    AttentionInterface.register(VARLEN_ATTENTION, sdpa_varlen_attention_forward)
    return VARLEN_ATTENTION


register()
