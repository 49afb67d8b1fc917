"""What a model family's definition asks of packed-row training, checked before the first step.

odc_hf trains several documents per row (``position_ids`` restarting at 0, ``cu_seq_lens_*``), so every layer must
keep each document to itself, with the family's own attention arguments:

- the attention arguments (sliding windows per layer, Gemma 2's soft-capping, GPT-OSS's sinks, scaling, dropout) are
  applied per document by ``sdpa_varlen`` / ``eager_varlen`` (:mod:`odc_hf.attention.variants`), and by
  FlashAttention-4 through transformers where its kernel takes them (:func:`flash_attention_4_gap` says which it does
  not take; such a run is refused or falls back, :mod:`odc_hf.integrations.compute.attention`);
- what lives only in a family's masks, or outside attention, cannot be applied to packed rows, and is refused here,
  by name, before training: multimodal models (image tokens, their positions and masks), chunked attention
  (``attention_chunk_size``), bidirectional attention, and decoder layers that are not attention layers (state-space
  and linear-attention layers read the whole row);
- a Mixture-of-Experts router loss (TRL's ``router_aux_loss_coef``) is weighed as the base trainer weighs it in one
  process on the same microbatches (:meth:`odc_hf.integrations.trainer.mixin.ODCMixin.training_step`).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
from pathlib import Path

import torch
import transformers

from odc_hf.integrations.upstream.transformers import supports_sdpa

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
"""``layer_types`` entries whose layers are attention layers odc_hf applies per document."""
MODALITY_CONFIGS = ("vision_config", "audio_config", "vision_tower_config", "speech_config", "video_config")
"""Sub-configs that make a model multimodal."""
FLASH_ATTENTION_4_ARGUMENTS = {"window": "window_size", "softcap": "softcap", "sinks": "learnable_sink"}
"""What each attention variant needs from FlashAttention-4's ``flash_attn_varlen_func`` (transformers maps
``sliding_window``, ``softcap`` and ``s_aux`` onto these, and leaves out an argument the kernel does not take)."""


@dataclasses.dataclass(frozen=True)
class FamilyNeeds:
    """What a model's attention and loss use beyond plain causal attention (read off its config and modules)."""

    family: str
    window: bool = False
    softcap: bool = False
    sinks: bool = False
    sdpa: bool = True  # SDPA computes the family's attention: transformers allows it and no soft-capping or sinks

    def variants(self) -> list[str]:
        return [name for name in ("window", "softcap", "sinks") if getattr(self, name)]


def is_attention_layer(module) -> bool:
    """A model's attention layer, as odc_hf reads it: a module named ``*Attention`` with an int ``head_dim``."""
    return type(module).__name__.endswith("Attention") and isinstance(getattr(module, "head_dim", None), int)


def transformers_model(model):
    """The transformers model a trainer was given: inside a PEFT ``PeftModel`` (``get_base_model()``), else ``model``."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def needs_of(model) -> FamilyNeeds:
    model = transformers_model(model)
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None)
    windows = getattr(config, "sliding_window", None) is not None and (
        layer_types is None or "sliding_attention" in layer_types)  # fmt: skip
    softcap = getattr(config, "attn_logit_softcapping", None) is not None
    sinks = any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules())
    return FamilyNeeds(
        family=str(getattr(config, "model_type", type(model).__name__)),
        window=bool(windows),
        softcap=softcap,
        sinks=sinks,
        # SDPA has no soft-capping or sinks: such a family's definition is its eager attention, whatever the release
        # says (transformers 5.17 lets Gemma 2 run SDPA, which drops its soft-capping; later releases do not)
        sdpa=supports_sdpa(model) and not (softcap or sinks),
    )


def multimodal_refusal(config, name: str) -> str | None:
    """Why odc_hf cannot train the model of ``config`` (called ``name``): it is multimodal; or None. Needs the config
    alone, so the trainers ask it before any data work (:func:`check_text_only`)."""
    text = config.get_text_config()
    modalities = [c for c in MODALITY_CONFIGS if getattr(config, c, None) is not None]
    if modalities or text is not config:
        return (f"{name} ({config.model_type}) is a multimodal model ({', '.join(modalities) or 'a composite config'}): "
                "odc_hf packs text-only rows and does not handle image / audio tokens, their positions or their "
                "masks. Train it with TRL's own trainer, or train its text model alone (for instance "
                "AutoModelForCausalLM.from_config(config.get_text_config()))")  # fmt: skip
    return None


def check_text_only(model) -> None:
    """Refuse a multimodal model (:func:`multimodal_refusal`) as the trainer receives it: a model, a PEFT model, or a
    model id or folder (its config is read; one that cannot be read is left for the base trainer to report). Runs
    before the base trainer prepares any data (TRL tokenizes the whole dataset in its ``__init__``)."""
    if model is None:
        return
    if isinstance(model, (str, os.PathLike)):
        try:
            config = transformers.AutoConfig.from_pretrained(model)
        except Exception:  # noqa: BLE001 - a bad id or folder: the base trainer says so in its own words
            return
        name = (getattr(config, "architectures", None) or [config.model_type])[0]
    else:
        model = transformers_model(model)
        config, name = getattr(model, "config", None), type(model).__name__
        if config is None or not hasattr(config, "get_text_config"):
            return
    reason = multimodal_refusal(config, name)
    if reason:
        raise ValueError(f"odc_hf cannot train this model on packed rows exactly as it is defined: {reason}")


def refusal(model, masked: bool = False) -> str | None:
    """Why packed rows cannot train ``model`` as its definition says (naming the family and what it uses), or None.
    ``masked``: the model keeps an attention of transformers' that builds its masks (``sdpa``, ``eager``), which apply
    mask-only features (chunked attention) over packed rows too."""
    model = transformers_model(model)
    config, name = model.config, type(model).__name__
    text = config.get_text_config()
    family = getattr(text, "model_type", name)
    multimodal = multimodal_refusal(config, name)
    if multimodal:
        return multimodal
    chunk = getattr(text, "attention_chunk_size", None)
    if (chunk or "chunked_attention" in (getattr(text, "layer_types", None) or ())) and not masked:
        what = f"attention_chunk_size={chunk}" if chunk else "layers of type 'chunked_attention'"
        return (f"{family} uses chunked attention ({what}), which lives in its masks only: odc_hf's per-document "
                "attention does not apply it. Use ODCConfig(attention='model') with attn_implementation='sdpa' "
                "(transformers' own masks over packed rows)")  # fmt: skip
    if getattr(text, "use_bidirectional_attention", False) or getattr(text, "is_causal", True) is False:
        return f"{family} is configured for bidirectional attention; odc_hf trains causal language models"
    # chunked-attention layers are attention layers whose chunks live in transformers' masks (checked above)
    attention_types = ATTENTION_LAYER_TYPES + (("chunked_attention",) if masked else ())
    other = sorted({t for t in getattr(text, "layer_types", None) or () if t not in attention_types})
    if other:
        return (f"{family} has layers of type {other}: they are not attention layers, so nothing keeps the documents "
                "of a packed row apart in them. odc_hf trains families whose layers are all attention layers "
                f"({', '.join(ATTENTION_LAYER_TYPES)})")  # fmt: skip
    # anything else a layer does to a packed row (a layer that reads the whole row, boundaries or windows that never
    # reach the attention) is seen by the behavioural check (odc_hf.integrations.models.definition_check)
    return None


def check_packable(model, masked: bool = False) -> None:
    """Raise ValueError with :func:`refusal`'s reason."""
    reason = refusal(model, masked)
    if reason is not None:
        raise ValueError(f"odc_hf cannot train this model on packed rows exactly as it is defined: {reason}")


def flash_attention_4_arguments() -> frozenset[str] | None:
    """The parameter names of the installed FlashAttention-4's ``flash_attn_varlen_func``, read from its source
    (importing FA4 compiles kernels and needs a GPU); None when it is not installed or not readable."""
    spec = importlib.util.find_spec("flash_attn")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "cute" / "interface.py"
        if path.is_file():
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef) and node.name == "flash_attn_varlen_func":
                    return frozenset(a.arg for a in node.args.args + node.args.kwonlyargs)
    return None


def flash_attention_4_gap(needs: FamilyNeeds, arguments: frozenset[str] | None) -> list[str]:
    """The variants ``needs`` asks for that FlashAttention-4 (its varlen function's ``arguments``) does not take;
    every variant when the arguments are unknown."""
    return [v for v in needs.variants() if arguments is None or FLASH_ATTENTION_4_ARGUMENTS[v] not in arguments]


