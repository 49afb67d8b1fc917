"""Attention for the ODC trainers: which implementation the model runs (``ODCConfig.attention``), the setting of
``sdpa_varlen``, the warm-ups before step 1, and a warning when packed rows would run under a dense-mask attention.

``attention="auto"`` (the default) picks transformers' ``"flash_attention_4"`` (FlashAttention-4's CuTe DSL varlen
kernel: one launch per layer for a whole packed row, from the ``cu_seq_lens_*`` / ``max_length_*`` the collators
pass) where it runs, else odc_hf's ``"sdpa_varlen"`` (per-document SDPA). FA4 is faster on packed rows, most of all
on rows of many short documents (docs/attention.md has the measurements), and it takes no fp32 inputs. The model's implementation is set through transformers' public
``PreTrainedModel.set_attn_implementation`` (5.17 and 5.24). transformers keeps no record of whether a user asked
for an implementation, so "auto" replaces only the two it owns the choice between: transformers' default
``"sdpa"`` (what ``from_pretrained`` / ``from_config`` pick when asked for nothing) and odc_hf's ``sdpa_varlen``; any
other (``eager``, ``flash_attention_2``, a hub kernel, ``flash_attention_4`` itself) was chosen by someone and is
kept. ``attention="model"`` keeps whatever the model has (then packed rows on ``"sdpa"`` get the warning below).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping

import torch
from transformers import AttentionInterface

import odc_hf.attention
from odc_hf.integrations.models.definition_check import dropout_settings, verify_definition
from odc_hf.integrations.models.family import (
    FLASH_ATTENTION_4_ARGUMENTS,
    FamilyNeeds,
    check_packable,
    flash_attention_4_arguments,
    flash_attention_4_gap,
    is_attention_layer,
    needs_of,
)
from odc_hf.integrations.upstream.transformers import (
    attn_implementation,
    is_flash_attn_4_available,
    supports_flash_attention,
    supports_sdpa,
)

logger = logging.getLogger(__name__)

FLASH_ATTENTION_4 = "flash_attention_4"
"""transformers' ``attn_implementation`` name of FlashAttention-4 (5.17+)."""
FA4_MIN_CAPABILITY = (9, 0)
"""FA4's kernels are written for Hopper (sm_90) and Blackwell (sm_100+)."""
TRANSFORMERS_DEFAULT = "sdpa"
"""What transformers gives a model whose user asked for no implementation."""


def attention_dtype(mixed_precision: str | None, param_dtype: torch.dtype | None) -> torch.dtype | None:
    """The attention's compute dtype in training: autocast's under accelerate's ``mixed_precision`` ("bf16"/"fp16"),
    else the parameters' if half precision, else ``None`` (fp32 attention: cuDNN's attention, whose plans
    ``odc_hf.attention.warm_up`` builds, runs half precision only, so there is nothing to plan; FA4 refuses fp32)."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(str(mixed_precision))
    if dtype is None and param_dtype in (torch.float16, torch.bfloat16):
        dtype = param_dtype
    return dtype


def fa4_installed() -> bool:
    """transformers' own check: the ``flash-attn-4`` distribution is installed and torch sees CUDA.

    Imports nothing of FA4 (its first import takes ~8 s and needs a GPU); transformers imports it lazily at the
    first attention call."""
    return bool(is_flash_attn_4_available())


def fa4_problem(device: torch.device | str, compute_dtype: torch.dtype | None, model=None) -> str | None:
    """Why FlashAttention-4 cannot run this training, or None."""
    if not fa4_installed():
        return "flash-attn-4 is not installed (pip install 'odc_hf[kernels]')"
    device = torch.device(device)
    if device.type != "cuda":
        return f"training runs on {device} and FA4 runs on CUDA only"
    capability = tuple(torch.cuda.get_device_capability(device))
    if capability < FA4_MIN_CAPABILITY:
        return f"the GPU's compute capability is {capability[0]}.{capability[1]} and FA4 needs 9.0 (Hopper) or newer"
    if compute_dtype not in (torch.float16, torch.bfloat16):
        return "the attention computes in float32 (no bf16/fp16 parameters or mixed precision) and FA4 takes bf16/fp16"
    if model is not None and not supports_flash_attention(model):
        return f"{type(model).__name__} does not support transformers' flash attention"
    unmeasured = sorted(set(head_dims(model)) - set(FA4_EXACT_HEAD_DIMS)) if model is not None else []
    if unmeasured:
        return (f"the model's attention head dimension {unmeasured} is not one FlashAttention-4 was measured exact at "
                f"({', '.join(map(str, FA4_EXACT_HEAD_DIMS))}; at head dimension 16 its gradients came out 8-29% low "
                "on an H100)")  # fmt: skip
    return None


FA4_EXACT_HEAD_DIMS = (64, 128, 256)
"""Head dimensions at which FlashAttention-4 (4.0.0b) matched TRL's bf16 training on one H100 / H200 (head dimension
64: 5e-4; Gemma 3 at 256, GPT-OSS at 64, Qwen3-MoE at 128 within bf16 noise); at 16 its gradient norms came out 8-29%
low for every family. ``attention="auto"`` picks FA4 only at these."""


def head_dims(model) -> list[int]:
    """The head dimensions of ``model``'s attention layers (modules named ``*Attention`` with an int ``head_dim``)."""
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    return [m.head_dim for m in modules if is_attention_layer(m)]


def is_varlen(name: str | None) -> bool:
    """Whether ``name`` is one of odc_hf's registered ``sdpa_varlen`` settings."""
    try:
        return isinstance(AttentionInterface()[name], odc_hf.attention.VarlenAttention)
    except KeyError:
        return False


def is_flash(name: str | None) -> bool:
    """Whether ``name`` is one of transformers' FlashAttention implementations (``flash_attention_2``, ``_3``, ``_4``):
    varlen kernels that unpad padded rows and run no masked attention."""
    return str(name).startswith("flash_attention")


@dataclasses.dataclass(frozen=True)
class AttentionChoice(Mapping):
    """``ODCConfig.attention`` resolved for a run (``trainer.odc_attention_choice``): what was asked, the
    implementation the model (and a GRPO reference model) runs, and why. Read by attribute; also the mapping
    ``{"choice", "implementation", "reason"}`` it is written as (:meth:`to_dict`: ``trainer.odc_attention``, the
    run's ``odc_microbatch_timings.json``)."""

    choice: str
    implementation: str | None
    reason: str

    @property
    def is_flash(self) -> bool:
        """One of transformers' FlashAttention implementations (:func:`is_flash`)."""
        return is_flash(self.implementation)

    @property
    def is_flash_attention_4(self) -> bool:
        return self.implementation == FLASH_ATTENTION_4

    @property
    def is_varlen(self) -> bool:
        """One of odc_hf's ``sdpa_varlen`` settings (per-document SDPA on packed rows)."""
        return is_varlen(self.implementation)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __getitem__(self, key: str):
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.__dataclass_fields__)

    def __len__(self) -> int:
        return len(self.__dataclass_fields__)


def resolve_attention(choice: str, current: str | None, problem: str | None, varlen_name: str,
                      default: str | tuple[str, ...] = TRANSFORMERS_DEFAULT) -> tuple[str, str]:  # fmt: skip
    """``(attn_implementation, why)`` for ``ODCConfig.attention`` = ``choice`` on a model now on ``current``.

    ``problem``: :func:`fa4_problem`'s answer for this run; ``varlen_name``: the ``sdpa_varlen`` setting ODCConfig
    names (``eager_varlen`` for a family without SDPA support); ``default``: what transformers gives this model when
    asked for nothing (``"eager"`` for a family without SDPA support), or several such names. Raises ValueError when
    ``flash_attention_4`` is forced where it cannot run."""
    if choice == "model":
        return current, "attention='model': the model's own"
    if choice == FLASH_ATTENTION_4:
        if problem is not None:
            raise ValueError(f"ODCConfig(attention='flash_attention_4'), but {problem}. Set attention='auto' (FA4 "
                             "where it runs, else sdpa_varlen) or 'sdpa_varlen'")  # fmt: skip
        return FLASH_ATTENTION_4, "attention='flash_attention_4'"
    if choice == "sdpa_varlen":
        return varlen_name, "attention='sdpa_varlen'"
    defaults = (default,) if isinstance(default, str) else tuple(default)
    if current not in (None, *defaults) and not is_varlen(current):
        shown = repr(defaults[0]) if len(defaults) == 1 else " / ".join(map(repr, defaults))
        return current, (f"attention='auto' keeps {current!r}: the model was given it (auto replaces only "
                         f"transformers' default {shown} and odc_hf's per-document attention)")  # fmt: skip
    if problem is None:
        return FLASH_ATTENTION_4, "attention='auto': FlashAttention-4 runs here"
    return varlen_name, f"attention='auto': {varlen_name} because {problem}"


def fa4_variant_problem(needs: FamilyNeeds) -> str | None:
    """Why FlashAttention-4 cannot apply this family's attention variants (windows, soft-capping, sinks), or None."""
    gap = flash_attention_4_gap(needs, flash_attention_4_arguments())
    if not gap:
        return None
    names = [FLASH_ATTENTION_4_ARGUMENTS[v] for v in gap]
    return f"{needs.family} uses {gap} and the installed FlashAttention-4's varlen kernel takes no {names}"


def check_kernel_variants(name: str | None, needs: FamilyNeeds) -> None:
    """Refuse a kernel of transformers' that does not apply an attention variant the family uses: FlashAttention-2
    with attention sinks (transformers passes ``s_aux`` only to kernels that take it, and FA2's do not), and SDPA with
    soft-capping or sinks (torch's SDPA has neither: some transformers releases raise, 5.17 runs Gemma 2 on SDPA
    without its soft-capping). Either would silently train a different model."""
    if name == "flash_attention_2" and needs.sinks:
        raise ValueError(f"{needs.family} uses attention sinks, which FlashAttention-2 does not apply (transformers "
                         "drops them): use ODCConfig(attention='auto') (FlashAttention-4 or eager_varlen) or load the "
                         "model with attn_implementation='eager'")  # fmt: skip
    lacking = [what for what, used in (("soft-capping", needs.softcap), ("attention sinks", needs.sinks)) if used]
    if name == "sdpa" and lacking:
        raise ValueError(f"{needs.family} uses {' and '.join(lacking)}, which SDPA does not apply (the model is loaded "
                         "with attn_implementation='sdpa'): use ODCConfig(attention='auto') (eager_varlen or "
                         "FlashAttention-4) or load the model with attn_implementation='eager'")  # fmt: skip


def choose_attention(trainer) -> AttentionChoice:
    """Set the model's (and a GRPO reference model's) attention from ``ODCConfig.attention``; log it once.

    Runs at the end of the ODC trainer's ``__init__``. Returns the record the trainer keeps
    (``trainer.odc_attention_choice``), the one source of the run's attention from then on."""
    config, accelerator = trainer.odc_config, trainer.accelerator
    model = accelerator.unwrap_model(trainer.model)
    needs = needs_of(model)
    current = attn_implementation(model)
    param = next(model.parameters(), None)
    dtype = attention_dtype(accelerator.mixed_precision, param.dtype if param is not None else None)
    varlen = odc_hf.attention.VarlenAttention(shape_bucket=config.attention_shape_bucket,
                                              varlen_kernel=config.attention_varlen_kernel, eager=not needs.sdpa)  # fmt: skip
    varlen_name = odc_hf.attention.register(varlen)
    problem = None
    if config.attention in ("auto", FLASH_ATTENTION_4):
        problem = fa4_problem(accelerator.device, dtype, model) or fa4_variant_problem(needs)
    # what transformers picks when asked for nothing: SDPA where the class allows it, else eager. A family whose
    # soft-capping or sinks SDPA cannot compute has eager as its only exact choice in transformers, so auto replaces
    # both (transformers 5.17 allows SDPA for Gemma 2 and picks it by default, dropping the soft-capping)
    default = ((TRANSFORMERS_DEFAULT,) if supports_sdpa(model) else ()) + (() if needs.sdpa else ("eager",))
    name, reason = resolve_attention(config.attention, current, problem, varlen_name, default)
    # multimodal models, non-attention layers, chunked attention outside transformers' masks: refused by name
    check_packable(model, masked=not (is_varlen(name) or is_flash(name)))
    check_kernel_variants(name, needs)
    # the model's own code on a packed row against each document alone: refused by name when they differ
    verdict = verify_definition(model, name, sdpa=needs.sdpa)
    for target in (model, getattr(trainer, "ref_model", None)):
        target = accelerator.unwrap_model(target) if target is not None else None
        if target is not None and name is not None and attn_implementation(target) != name:
            target.set_attn_implementation(name)
        if target is not None:
            odc_hf.attention.guard_boundaries(target)
    if accelerator.is_main_process:  # once, not once per rank
        logger.info("odc_hf: attention %s (%s); packed rows train %s as defined (checked in %.2f s)", name, reason,
                    verdict.family, verdict.seconds)  # fmt: skip
        dropout = dropout_settings(model)
        if dropout:
            logger.warning("odc_hf: %s trains with dropout %s (its config): each step is random, so a run agrees with "
                           "another (TRL's, or odc_hf's on other ranks) in distribution, not bit for bit; set them to "
                           "0.0 to compare runs exactly", verdict.family, dropout)  # fmt: skip
        if name in ("sdpa", "eager"):
            logger.warning(
                "odc_hf packs several documents per microbatch; with attn_implementation=%r transformers isolates "
                "them with a dense block-diagonal mask, which costs full-row attention (measured 2.6x slower for a "
                "2-document 28k-token row on an H200). Let ODCConfig(attention='auto') choose (flash_attention_4 "
                "where it runs, else sdpa_varlen / eager_varlen: per-document attention, same results), or load the "
                'model with attn_implementation="sdpa_varlen" ("eager_varlen" for families without SDPA).',
                name,
            )
    return AttentionChoice(choice=config.attention, implementation=name, reason=reason)


def prepare_attention(trainer, max_tokens_per_microbatch: int | None) -> None:
    """Before the first step, on a GPU: plan cuDNN's attention shapes of every length up to the token budget
    ``max_tokens_per_microbatch`` (``sdpa_varlen``, :func:`odc_hf.attention.warm_up`; skipped when it is None, as
    for GRPO, whose budget comes with each generation) or compile FlashAttention-4's kernels (:func:`warm_up_flash`).

    ``trainer``: an ODC trainer (its ``accelerator``, ``model`` and ``odc_attention_choice``); what ran lands in
    ``trainer.odc_attention_warm_up`` (``{"kind", "shapes", "seconds", "dtype"}``)."""
    accelerator, attention = trainer.accelerator, trainer.odc_attention_choice
    model = accelerator.unwrap_model(trainer.model)
    param = next(model.parameters(), None)
    dtype = attention_dtype(accelerator.mixed_precision, param.dtype if param is not None else None)
    if accelerator.device.type != "cuda" or dtype is None:
        return
    start = time.perf_counter()
    if attention.is_varlen:
        if max_tokens_per_microbatch is None:
            return
        shapes = odc_hf.attention.warm_up(model, max_tokens_per_microbatch, dtype=dtype, device=accelerator.device)
        kind = "sdpa_varlen"
    elif attention.is_flash_attention_4:
        kind, shapes = FLASH_ATTENTION_4, warm_up_flash(model, dtype=dtype, device=accelerator.device)
    else:
        return
    seconds = time.perf_counter() - start
    trainer.odc_attention_warm_up = {"kind": kind, "shapes": shapes, "seconds": seconds, "dtype": str(dtype)}
    logger.info("odc_hf: %s attention warmed up (%d shapes) in %.1f s", kind, shapes, seconds)


WARM_UP_DOCUMENTS = (700, 300, 24)
"""Document lengths of :func:`warm_up_flash`'s packed row (several, so the varlen kernels are the ones compiled)."""


def warm_up_flash(model: torch.nn.Module, *, dtype: torch.dtype, device: torch.device | str) -> int:
    """Forward + backward of one attention layer through transformers' ``flash_attention_4`` on a packed row.

    FlashAttention-4 compiles its CuTe DSL kernels at the first call of each kernel configuration (head dims, GQA,
    dtype, causal, varlen), not per sequence length; this makes that first call before step 1, so the step times
    do not carry it. Returns the number of calls (1), 0 without an attention layer. Parameters and the random
    number generators are not touched."""
    module = next((m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "head_dim")), None)
    if module is None:
        return 0
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    config = getattr(module, "config", None) or model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    total = sum(WARM_UP_DOCUMENTS)
    cu = torch.tensor([0, *torch.tensor(WARM_UP_DOCUMENTS).cumsum(0).tolist()], dtype=torch.int32, device=device)
    longest = max(WARM_UP_DOCUMENTS)
    with torch.random.fork_rng(devices=[device]):
        q, k, v = (torch.randn((1, total, n, module.head_dim), device=device, dtype=dtype, requires_grad=True)
                   .transpose(1, 2) for n in (heads, kv_heads, kv_heads))  # fmt: skip
        out, _ = AttentionInterface()[FLASH_ATTENTION_4](
            module, q, k, v, None, dropout=0.0, scaling=getattr(module, "scaling", None), cu_seq_lens_q=cu,
            cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)  # fmt: skip
        out.backward(torch.randn_like(out))
    torch.cuda.synchronize(device)
    return 1
