"""Per-document causal attention for packed rows, on torch's SDPA kernels (no flash-attn package needed): the
implementation behind :mod:`odc_hf.attention`'s public names.

Packed microbatches (several documents in one row, ``position_ids`` restarting at 0, as TRL's padding-free
collator and :class:`~odc_hf.integrations.trainer.bundle.BundleCollator` build them) need attention that stays inside each
document. transformers' ``"sdpa"`` does that with an explicit block-diagonal mask (``masking_utils``), and
SDPA with a materialised mask runs a kernel that skips nothing: a row of documents s1, s2, ... then costs
``(s1 + s2 + ...)^2`` attention, not the ``s1^2 + s2^2 + ...`` the balancer's cost model (and flash-attn's
varlen kernel) assume, and packed rows cost far more than planned (docs/attention.md).

``attn_implementation="sdpa_varlen"`` keeps attention inside each document at the ``cu_seq_lens_q``
boundaries the padding-free collators provide, without building a mask: one causal SDPA call per document
(the flash kernel on GPUs). ``VarlenAttention(varlen_kernel=True)`` switches CUDA to torch's
``torch.nn.attention.varlen.varlen_attn`` (one flash-varlen launch per layer for the whole row). Per-document SDPA
is the default: on packed rows of several documents it was the fastest of the three, and the masked ``sdpa`` the
slowest (docs/attention.md has the measurements, ``benchmarks/attention/check.py`` makes them). It is registered
through transformers' public ``AttentionInterface``::

    import odc_hf.attention  # registers "sdpa_varlen"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa_varlen")

Every argument the model's attention layer hands an attention implementation is applied per document: ``scaling``,
``dropout``, sliding windows (per layer, transformers' convention), Gemma 2's soft-capping and GPT-OSS's sinks (the
last two through the family's own eager attention); anything else is refused by name
(:mod:`odc_hf.attention.variants`).

It is meant for training on packed rows; rows without a mask (a batch of whole documents) are one document each.
Padded rows and cached decoding fall back to SDPA with transformers' own ``sdpa`` mask (:func:`padding_mask`,
registered with ``AttentionMaskInterface`` under the same name; the family's eager attention with soft-capping or
sinks): padded batched generation and TRL's padded GRPO rows stay correct. One host sync per forward reads the
boundaries (cached across layers).

**Shape buckets.** On Hopper, torch's SDPA runs cuDNN's attention, which builds (and may compile) an execution
plan for every new shape and stride it meets, for forward and again for backward. Variable-length training meets
new document lengths every step, so without care a packed row of new lengths pays that on top of its compute
(docs/attention.md, its "Shape buckets" item, has the measured cost). Each document's q/k/v are therefore
copied into a zero-padded buffer of a multiple of ``shape_bucket`` tokens (padding at the end changes no
causal output or gradient of the real tokens), laid out (batch, seq, heads, dim) in memory whatever layout the
model's q/k/v have: at most ``max_length / shape_bucket`` shapes, all planned once (:func:`warm_up` does it up front).
A one-document row whose length is a bucket multiple goes to SDPA without copies of the tensors already in that
layout (v always; q and k under Liger's rotary embedding). The copies and the padded
attention cost ~1% at the default bucket.

**Settings.** Each setting is an explicit :class:`VarlenAttention` (``shape_bucket``, ``varlen_kernel``),
registered under its own ``attn_implementation`` name (:func:`register`; ``"sdpa_varlen"`` is the default one), so
the model's ``attn_implementation`` says which attention it runs and nothing is switched globally. Under the odc_hf
trainers, ``ODCConfig.attention_shape_bucket`` / ``attention_varlen_kernel`` choose it for a model on
``"sdpa_varlen"``.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections import Counter

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from odc_hf.attention.variants import Variant, document_attention, masked_attention, take_variant

__all__ = ["CALLS", "DEFAULT_SHAPE_BUCKET", "EAGER_VARLEN_ATTENTION", "PackedRowWithoutBoundaries", "VARLEN_ATTENTION",
           "VarlenAttention", "attention_of", "document_bounds", "guard_boundaries", "padding_mask", "register",
           "sdpa_varlen_attention_forward", "setting_named", "warm_up"]  # fmt: skip

VARLEN_ATTENTION = "sdpa_varlen"
"""The ``attn_implementation`` name this module registers."""
EAGER_VARLEN_ATTENTION = "eager_varlen"
"""The name of the setting that runs the family's own eager attention per document (``VarlenAttention(eager=True)``)."""

CALLS: Counter = Counter()
"""How often each path ran: ``documents`` (per-document SDPA calls), ``single`` (one-document rows), ``fallback``;
``bounds_sync`` counts the host reads of the document boundaries (cache misses)."""

DEFAULT_SHAPE_BUCKET = 1024
"""The shape bucket of ``"sdpa_varlen"`` (and ``ODCConfig.attention_shape_bucket``'s default). See above."""

try:  # torch >= 2.10; its signature changed between releases, so arguments are chosen by name below
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn

    _VARLEN_PARAMS = frozenset(inspect.signature(_varlen_attn).parameters)
except ImportError:  # pragma: no cover - older torch
    _varlen_attn, _VARLEN_PARAMS = None, frozenset()

_cache: tuple[weakref.ref, list[tuple[int, int]]] | None = None
PLAIN = Variant()


class PackedRowWithoutBoundaries(RuntimeError):
    """A packed row's attention call arrived without the row's document boundaries."""


_in_flight = [0]
"""Tokens of the packed row (several documents) the guarded model is running now, 0 when none."""


def _row_starts(module, args, kwargs) -> None:
    cu = kwargs.get("cu_seq_lens_q")
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    _in_flight[0] = int(ids.shape[1]) if cu is not None and cu.numel() > 2 and ids is not None and ids.shape[0] == 1 else 0


def _row_ends(module, args, kwargs, output) -> None:
    _in_flight[0] = 0


def guard_boundaries(model: torch.nn.Module) -> list:
    """Make a packed row whose attention call arrives without its document boundaries an error.

    Hooks on ``model``'s forward note when it runs a row of several documents (``cu_seq_lens_q`` with more than one
    document); an ``sdpa_varlen`` / ``eager_varlen`` call of that row's length without ``cu_seq_lens_q`` then raises
    :class:`PackedRowWithoutBoundaries` instead of treating the row as one long document. Returns the hook handles."""
    return [model.register_forward_pre_hook(_row_starts, with_kwargs=True),
            model.register_forward_hook(_row_ends, with_kwargs=True, always_call=True)]  # fmt: skip


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
    CALLS["bounds_sync"] += 1  # a device-to-host copy: expected once per forward
    offsets = [int(x) for x in cu_seq_lens.tolist()]
    if offsets[0] != 0 or offsets[-1] != length or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(
            f"cu_seq_lens_q {offsets[:8]}{'...' if len(offsets) > 8 else ''} does not describe a packed row of "
            f"{length} tokens"
        )
    bounds = [(a, b) for a, b in zip(offsets, offsets[1:]) if b > a]
    _cache = (weakref.ref(cu_seq_lens), bounds)
    return bounds


@dataclasses.dataclass(frozen=True)
class VarlenAttention:
    """One setting of per-document attention, callable as an ``AttentionInterface`` function.

    Args:
        shape_bucket: pad each document's attention inputs to a multiple of this many tokens (0: exact shapes).
        varlen_kernel: on CUDA, run torch's flash varlen kernel once per layer instead of per-document SDPA
            (slower on an H200, see the module docstring).
        eager: run the family's own eager attention per document instead of SDPA, for families whose attention
            SDPA cannot compute (soft-capping, sinks: Gemma 2, GPT-OSS; transformers marks most of them
            ``_supports_sdpa = False``); named ``"eager_varlen"`` (transformers checks SDPA support for every
            implementation whose name contains ``"sdpa"``).
    """

    shape_bucket: int = DEFAULT_SHAPE_BUCKET
    varlen_kernel: bool = False
    eager: bool = False

    def __post_init__(self):
        if int(self.shape_bucket) != self.shape_bucket or self.shape_bucket < 0:
            raise ValueError(f"shape_bucket must be an integer >= 0, got {self.shape_bucket}")

    @property
    def name(self) -> str:
        """The ``attn_implementation`` name :func:`register` gives it: ``"sdpa_varlen"`` for the default setting,
        ``"eager_varlen"`` for the eager one (shape buckets and the varlen kernel are SDPA's: not used there)."""
        if self.eager:
            return EAGER_VARLEN_ATTENTION
        if self == VarlenAttention():
            return VARLEN_ATTENTION
        return f"{VARLEN_ATTENTION}_bucket{self.shape_bucket}" + ("_kernel" if self.varlen_kernel else "")

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        return sdpa_varlen_attention_forward(module, query, key, value, attention_mask,
                                             shape_bucket=self.shape_bucket, varlen_kernel=self.varlen_kernel,
                                             eager=self.eager, **kwargs)  # fmt: skip


def sdpa_varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    shape_bucket: int = DEFAULT_SHAPE_BUCKET,
    varlen_kernel: bool = False,
    eager: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function for ``AttentionInterface``: (batch, heads, seq, dim) in, (batch, seq, heads, dim) out.

    ``shape_bucket``, ``varlen_kernel`` and ``eager`` as in :class:`VarlenAttention` (which passes its own). The family's
    ``sliding_window``, ``softcap`` and ``s_aux`` are applied per document; any other argument is refused
    (:mod:`odc_hf.attention.variants`)."""
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    variant = take_variant(module, kwargs, family_eager=eager)
    length = query.shape[2]
    if attention_mask is not None or key.shape[2] != length:  # padded rows, a cached decode step
        CALLS["fallback"] += 1
        return masked_attention(module, query, key, value, attention_mask, variant, kwargs)
    if cu_seq_lens is None and query.shape[0] == 1 and _in_flight[0] == length:
        raise PackedRowWithoutBoundaries(
            f"{type(module).__name__} ({type(module).__module__}) received a packed row of {length} tokens without "
            "its document boundaries (cu_seq_lens_q): its decoder layer does not pass its keyword arguments on, and "
            "the row's documents would attend to each other. Use ODCConfig(attention='model') with the model loaded "
            "with attn_implementation='sdpa' (transformers' own masks over packed rows)"
        )
    # a packed row (its documents at cu_seq_lens_q), or rows that are each one document
    bounds = document_bounds(cu_seq_lens if query.shape[0] == 1 else None, length)
    if len(bounds) == 1:
        CALLS["single"] += 1
        return _document(module, query, key, value, 0, length, kwargs, shape_bucket, variant), None
    if (varlen_kernel and variant.plain and query.is_cuda and _varlen_attn is not None
            and kwargs.get("dropout", 0.0) == 0.0):  # fmt: skip
        CALLS["varlen"] += 1
        return _flash_varlen(module, query, key, value, cu_seq_lens, bounds, kwargs.get("scaling")), None
    CALLS["documents"] += len(bounds)
    outputs = [_document(module, query, key, value, a, b, kwargs, shape_bucket, variant) for a, b in bounds]
    return torch.cat(outputs, dim=1), None


def _document(module, query, key, value, start: int, end: int, kwargs, shape_bucket: int,
              variant: Variant = PLAIN) -> torch.Tensor:  # fmt: skip
    """Attention of tokens ``start:end`` alone: (batch, n, H, D). Causal SDPA padded to a multiple of
    ``shape_bucket``, or, for a window shorter than the document, soft-capping or sinks,
    :func:`~odc_hf.attention.variants.document_attention`."""
    n = end - start
    if variant.eager or (variant.window is not None and variant.window < n):
        q, k, v = (t[:, :, start:end] for t in (query, key, value))
        return document_attention(module, q, k, v, variant, kwargs)
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    bucket = shape_bucket if causal else 0  # zero keys after the tokens are invisible only to causal queries
    pad = (-n) % bucket if bucket > 0 else 0
    q, k, v = (t[:, :, start:end] for t in (query, key, value))
    if bucket > 0:  # zeros after the last token: causal attention of the real tokens never sees them
        q, k, v = (_bucketed(t, n + pad) for t in (q, k, v))
    out = sdpa_attention_forward(module, q, k, v, None, **kwargs)[0]
    return out[:, :n] if pad else out


def _bucketed(t: torch.Tensor, length: int) -> torch.Tensor:
    """``t`` (batch, heads, n, dim) as a tensor of ``length`` >= n tokens (zeros after the n) laid out
    (batch, seq, heads, dim) in memory, with that layout's canonical strides: every SDPA call of one length then
    has the same strides whatever the model's q/k/v layouts are (one cuDNN plan, the one :func:`warm_up` builds).

    That is the layout of the projections' ``view(...).transpose(1, 2)`` in transformers' attention layers (v always;
    q and k when the rotary embedding keeps it, as Liger's does): a one-document row of a bucket multiple in that
    layout goes through as is, without a copy."""
    b, h, n, d = t.shape
    if length == n and t.stride() == (n * h * d, d, h * d, 1):
        return t
    buffer = t.new_empty((b, length, h, d)).transpose(1, 2)
    if length > n:
        buffer[:, :, n:].zero_()
    buffer[:, :, :n] = t
    return buffer


def implementation_name(model: torch.nn.Module) -> str | None:
    """The attention implementation a transformers model runs, or None for a module without a config.

    transformers has no public getter for it (5.17 to 5.25): this is odc_hf's one read of the config's private
    ``_attn_implementation`` (listed in ``odc_hf.integrations.upstream.transformers.PRIVATE_ATTRIBUTES``, whose
    surface test checks it on the installed release; the integration reads it through that module)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def attention_of(model: torch.nn.Module) -> VarlenAttention | None:
    """The :class:`VarlenAttention` a model's ``attn_implementation`` names, or None when it uses another attention."""
    return setting_named(implementation_name(model))


def setting_named(name: str | None) -> VarlenAttention | None:
    """The :class:`VarlenAttention` registered under ``name``, or None when ``name`` is another attention."""
    try:
        function = AttentionInterface()[name]
    except KeyError:
        return None
    return function if isinstance(function, VarlenAttention) else None


def warm_up(
    model: torch.nn.Module,
    max_length: int | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> int:
    """Run forward+backward of one attention layer at every bucket length up to ``max_length``; return the count.

    Plans cuDNN's attention for every shape training can meet (the shape bucket of the model's
    :class:`VarlenAttention`), so the first steps of a run are not slower than the rest. ``max_length`` defaults to
    the attention config's ``max_position_embeddings``; ``dtype`` is the attention's compute dtype (default: the parameters' if half
    precision, else bfloat16); ``device`` is where training will run (default: the parameters' device; pass it when
    the model is still on the CPU, as the Trainer's is before ``accelerator.prepare``). No-op (returns 0) off CUDA, for
    a model not on a ``"sdpa_varlen"`` attention, or with shape bucket 0. Parameters, their gradients and the random
    number generators are not touched.
    """
    settings = attention_of(model)
    bucket = settings.shape_bucket if settings is not None and not settings.eager else 0
    module = next((m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "head_dim")), None)
    param = next(model.parameters(), None)
    device = torch.device(device) if device is not None else (param.device if param is not None else None)
    if bucket <= 0 or module is None or device is None or device.type != "cuda":
        return 0
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if dtype is None:
        dtype = param.dtype if param is not None and param.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    config = getattr(module, "config", None) or model.config  # the text config of composite models
    with torch.random.fork_rng(devices=[device]):  # leave the seeded generators as the Trainer set them
        count = _plan_shapes(module, config, int(max_length or config.max_position_embeddings), device, dtype, bucket)
    torch.cuda.synchronize(device)
    return count


def _plan_shapes(module, config, limit: int, device, dtype, shape_bucket: int) -> int:
    """Forward+backward of ``module``'s attention at every multiple of ``shape_bucket`` up to ``limit`` (rounded up)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    kwargs = {"dropout": 0.0, "scaling": getattr(module, "scaling", None)}
    count = 0
    for length in range(shape_bucket, limit + shape_bucket, shape_bucket):
        # laid out as the projections' views are: (1, seq, heads, dim) in memory, seen as (1, heads, seq, dim)
        q, k, v = (torch.randn((1, length, n, module.head_dim), device=device, dtype=dtype, requires_grad=True)
                   .transpose(1, 2) for n in (heads, kv_heads, kv_heads))  # fmt: skip
        out = _document(module, q, k, v, 0, length, kwargs, shape_bucket)
        out.backward(torch.randn_like(out))  # a dense gradient, laid out like the model's (not sum()'s expand)
        count += 1
    return count


def _flash_varlen(module, query, key, value, cu_seq_lens, bounds, scaling):
    """One flash varlen call for the whole row: (1, H, T, D) in, (1, T, H, D) out."""
    q, k, v = (
        t[0].transpose(0, 1) for t in (query, key, value)
    )  # (T, H, D) views of the (1, T, H, D) storage
    longest = max(b - a for a, b in bounds)
    cu = cu_seq_lens.to(device=query.device, dtype=torch.int32)
    kwargs = {}
    if "window_size" in _VARLEN_PARAMS:  # torch >= 2.12: causality is a (-1, 0) window
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in _VARLEN_PARAMS:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    if scaling is not None:
        if "scale" in _VARLEN_PARAMS:
            kwargs["scale"] = scaling
        elif abs(scaling - q.shape[-1] ** -0.5) > 1e-12:
            raise ValueError(
                f"this torch's varlen_attn has no scale argument; the model needs scale {scaling}"
            )
    out = _varlen_attn(q, k, v, cu, cu, longest, longest, **kwargs)
    return out.unsqueeze(0)


def padding_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """The mask function of the ``sdpa_varlen`` names (``AttentionMaskInterface``): transformers' ``sdpa`` mask when
    the inputs carry a 2-D padding mask (padded batches, generation: the attention then falls back to ``sdpa`` with
    it), else None (packed rows: the attention keeps to the ``cu_seq_lens_q`` boundaries, no mask is built)."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register(attention: VarlenAttention | None = None) -> str:
    """Register ``attention`` (default: ``VarlenAttention()``, named ``"sdpa_varlen"``) with transformers under
    ``attention.name`` (idempotent), with :func:`padding_mask` as its mask function, and return the name, to pass as
    ``attn_implementation``."""
    attention = attention if attention is not None else VarlenAttention()
    AttentionInterface.register(attention.name, attention)
    AttentionMaskInterface.register(attention.name, padding_mask)
    return attention.name

