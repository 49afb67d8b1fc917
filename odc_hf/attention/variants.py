"""Every argument transformers' attention interface hands an implementation, applied per document in packed rows.

A model's attention layer calls ``attention_interface(module, query, key, value, attention_mask, dropout=...,
scaling=..., **family_arguments)``. Besides ``scaling`` and ``dropout``, families pass:

- ``sliding_window`` (Mistral, Mixtral, Phi-3: every layer; Qwen2 / Qwen3 / Qwen3-MoE, Gemma 2 / 3, Cohere 2, GPT-OSS,
  SmolLM3: the layers whose ``layer_types`` entry is ``"sliding_attention"``): a query sees itself and the
  ``sliding_window - 1`` tokens before it, transformers' convention (``masking_utils.sliding_window_overlay``:
  ``kv_idx > q_idx - sliding_window``; its flash path passes ``window_size=(sliding_window - 1, ...)``);
- ``softcap`` (Gemma 2): ``tanh(scores / softcap) * softcap`` before the mask and softmax;
- ``s_aux`` (GPT-OSS): a learned per-head sink logit that joins every row's softmax and is then dropped.

:func:`take_variant` reads them off the keyword arguments and refuses any other argument it does not know (naming it),
so a family whose attention needs something odc_hf does not apply stops at its first forward instead of training a
different model. Per document, windows run as SDPA over blocks of queries with the band mask of their keys (a document
no longer than its window needs no mask); soft-capping and sinks run the family's own ``eager_attention_forward``
(the function transformers' ``eager`` implementation calls for that model, so the arithmetic is the model's own) over
the same blocks, with the causal (and band) mask as an additive float mask.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

HANDLED = ("scaling", "dropout", "is_causal", "sliding_window", "softcap", "s_aux")
"""Attention arguments applied per document."""
VARLEN_ARGUMENTS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
"""The packed row's document boundaries (read by the caller)."""
try:  # what every model's forward passes down through ``**kwargs`` (loss, outputs, varlen boundaries): not attention's
    from transformers.utils.generic import TransformersKwargs

    _FLOW_THROUGH = tuple(TransformersKwargs.__annotations__)
except ImportError:  # pragma: no cover - a transformers without it: the names of 5.17-5.25
    _FLOW_THROUGH = ("num_items_in_batch", "output_hidden_states", "output_attentions", "output_router_logits")
IGNORED = tuple(dict.fromkeys(("position_ids", "use_cache", "output_router_logits", "output_attentions",
                               "cache_position", "past_key_values", "past_key_value", "token_type_ids", "layer_idx",
                               *(k for k in _FLOW_THROUGH if k not in HANDLED))))  # fmt: skip
"""Arguments that flow down from the model's forward (transformers' ``TransformersKwargs``: the loss's
``num_items_in_batch``, output switches, the varlen boundaries) and change nothing in attention over given q / k / v."""
BLOCK = 512
"""Queries per block when a document is longer than its window (keys per block: the block plus the window)."""


class UnsupportedAttentionArgument(ValueError):
    """A family hands the attention an argument odc_hf's packed-row attention does not apply."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """What one attention call needs beyond causal SDPA: ``window`` (tokens a query sees, itself included),
    ``softcap`` and ``sinks`` (the ``s_aux`` tensor)."""

    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    family_eager: bool = False  # every document through the family's eager attention (VarlenAttention(eager=True))

    @property
    def plain(self) -> bool:
        return self.window is None and not self.eager

    @property
    def eager(self) -> bool:
        """Soft-capping and sinks are not SDPA's: the family's own eager attention computes them."""
        return self.family_eager or self.softcap is not None or self.sinks is not None


def take_variant(module: torch.nn.Module, kwargs: dict, *, family_eager: bool = False) -> Variant:
    """Read ``sliding_window`` / ``softcap`` / ``s_aux`` out of an attention call's ``kwargs`` (removing them) and
    refuse any argument that is neither handled nor known to be inert."""
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in HANDLED + VARLEN_ARGUMENTS + IGNORED)
    if unknown:
        raise UnsupportedAttentionArgument(
            f"odc_hf's packed-row attention (sdpa_varlen) got the attention argument(s) {unknown} from "
            f"{type(module).__name__} ({type(module).__module__}) and does not apply them per document; the model "
            "would train differently from its definition. Use ODCConfig(attention='model') with the model loaded "
            "with attn_implementation='sdpa' or 'eager' (transformers' own masks over packed rows)"
        )
    for name in VARLEN_ARGUMENTS + IGNORED:
        kwargs.pop(name, None)
    # a layer that keeps its window as an attribute and leaves it to the model's mask (Qwen2-MoE) gets it applied here
    window = kwargs.pop("sliding_window") if "sliding_window" in kwargs else _own_window(module)
    softcap = kwargs.pop("softcap", None)
    sinks = kwargs.pop("s_aux", None)
    if window is not None and (int(window) != window or window < 1):
        raise UnsupportedAttentionArgument(f"{type(module).__name__}: sliding_window={window!r} is not a window size")
    return Variant(window=None if window is None else int(window), softcap=softcap or None, sinks=sinks,
                   family_eager=family_eager)  # fmt: skip


def _own_window(module: torch.nn.Module) -> int | None:
    """The window a layer keeps as ``sliding_window`` but does not pass to the attention (None: none)."""
    window = getattr(module, "sliding_window", None)
    return window if isinstance(window, int) and not isinstance(window, bool) else None


def eager_function(module: torch.nn.Module):
    """The family's own ``eager_attention_forward`` (defined in the module's modeling file, where transformers'
    ``eager`` implementation takes it from)."""
    function = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if function is None:
        raise UnsupportedAttentionArgument(
            f"{type(module).__name__} needs soft-capping or attention sinks, and its modeling file "
            f"({type(module).__module__}) has no eager_attention_forward for odc_hf to apply them per document. Use "
            "ODCConfig(attention='model') with attn_implementation='eager'"
        )
    return function


def allowed(q_start: int, q_end: int, k_start: int, k_end: int, window: int | None, *, q_offset: int = 0,
            device=None) -> torch.Tensor:  # fmt: skip
    """Boolean ``(q_end - q_start, k_end - k_start)`` mask: query i sees key j iff ``j <= i`` and, with a window,
    ``j > i - window`` (positions in the document; queries shifted by ``q_offset`` when keys start earlier)."""
    i = torch.arange(q_start, q_end, device=device).unsqueeze(1) + q_offset
    j = torch.arange(k_start, k_end, device=device).unsqueeze(0)
    mask = j <= i
    if window is not None:
        mask &= j > i - window
    return mask


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive float mask transformers' eager attention takes (0 / dtype's minimum)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def document_attention(module, query, key, value, variant: Variant, kwargs: dict) -> torch.Tensor:
    """Causal attention of one document (q / k / v ``(batch, heads, n, dim)``) under ``variant``: ``(batch, n,
    heads, dim)``. ``kwargs``: the call's remaining arguments (``scaling``, ``dropout``, ...)."""
    n = query.shape[2]
    window = variant.window if variant.window is not None and variant.window < n else None
    if variant.eager:
        function = eager_function(module)
        arguments = dict(kwargs, softcap=variant.softcap, s_aux=variant.sinks, sliding_window=variant.window)
        arguments = {k: v for k, v in arguments.items() if v is not None}
    step = n if window is None else max(BLOCK, window)
    outputs = []
    for start in range(0, n, step):
        end = min(n, start + step)
        first = 0 if window is None else max(0, start - window + 1)
        q, k, v = query[:, :, start:end], key[:, :, first:end], value[:, :, first:end]
        mask = allowed(start, end, first, end, window, device=query.device)  # causal, and banded with a window
        if variant.eager:
            outputs.append(function(module, q, k, v, additive(mask, query.dtype)[None, None], **arguments)[0])
        else:  # SDPA runs here only with a window shorter than the document (the caller runs the rest unmasked)
            outputs.append(sdpa_attention_forward(module, q, k, v, mask[None, None], **kwargs)[0])
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


def masked_attention(module, query, key, value, attention_mask, variant: Variant, kwargs: dict):
    """Padded rows (``attention_mask``: transformers' boolean 4-D mask, the window already in it) or a cached decode
    step: SDPA with the mask, or, with soft-capping or sinks, the family's eager attention with it as an additive
    mask (without a mask, causal over the cache with queries at its end)."""
    if not variant.eager:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is None:
        q_len, k_len = query.shape[2], key.shape[2]
        attention_mask = allowed(0, q_len, 0, k_len, variant.window, q_offset=k_len - q_len,
                                 device=query.device)[None, None]  # fmt: skip
    if attention_mask.dtype == torch.bool:
        attention_mask = additive(attention_mask, query.dtype)
    arguments = dict(kwargs, softcap=variant.softcap, s_aux=variant.sinks, sliding_window=variant.window)
    return eager_function(module)(module, query, key, value, attention_mask,
                                  **{k: v for k, v in arguments.items() if v is not None})  # fmt: skip
