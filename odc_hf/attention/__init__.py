"""Per-document attention for packed rows, registered with transformers as ``attn_implementation="sdpa_varlen"``
(and ``"eager_varlen"``, the family's own eager attention per document) on import::

    import odc_hf.attention  # registers "sdpa_varlen" and "eager_varlen"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa_varlen")

The public names; the implementation: :mod:`odc_hf.attention.varlen` (the attention function, its settings, shape
buckets and warm-up, the guard of document boundaries) and :mod:`odc_hf.attention.variants` (windows, soft-capping,
sinks and scaling applied per document; anything else refused by name). docs/attention.md describes both.
"""

from __future__ import annotations

from odc_hf.attention.varlen import (
    CALLS,
    DEFAULT_SHAPE_BUCKET,
    EAGER_VARLEN_ATTENTION,
    VARLEN_ATTENTION,
    PackedRowWithoutBoundaries,
    VarlenAttention,
    attention_of,
    document_bounds,
    guard_boundaries,
    padding_mask,
    register,
    sdpa_varlen_attention_forward,
    setting_named,
    warm_up,
)

__all__ = ["CALLS", "DEFAULT_SHAPE_BUCKET", "EAGER_VARLEN_ATTENTION", "PackedRowWithoutBoundaries", "VARLEN_ATTENTION",
           "VarlenAttention", "attention_of", "document_bounds", "guard_boundaries", "padding_mask", "register",
           "sdpa_varlen_attention_forward", "setting_named", "warm_up"]  # fmt: skip

register()
register(VarlenAttention(eager=True))
