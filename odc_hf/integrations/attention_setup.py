"""Attention for the ODC trainers: the ``sdpa_varlen`` setting ODCConfig names, its cuDNN plans made before training
on a GPU, and a warning when packed rows would run under a dense-mask attention."""

from __future__ import annotations

import logging
import time

import torch

import odc_hf.attention

logger = logging.getLogger(__name__)


def attention_dtype(mixed_precision: str | None, param_dtype: torch.dtype | None) -> torch.dtype | None:
    """The attention's compute dtype in training: autocast's under accelerate's ``mixed_precision`` ("bf16"/"fp16"),
    else the parameters' if half precision, else ``None`` (fp32 attention: cuDNN's attention, whose plans
    ``odc_hf.attention.warm_up`` builds, runs half precision only, so there is nothing to plan)."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(str(mixed_precision))
    if dtype is None and param_dtype in (torch.float16, torch.bfloat16):
        dtype = param_dtype
    return dtype


def prepare_attention(trainer, budget: int) -> None:
    """Packed rows under "sdpa"/"eager" attention are slow: say so once, with the fix. Under "sdpa_varlen", use
    the setting ODCConfig names (attention_shape_bucket, attention_varlen_kernel) and, on a GPU, plan the
    attention shapes of every length up to the token budget now (odc_hf.attention.warm_up).

    ``trainer``: an ODC trainer (its ``accelerator``, ``model`` and ``odc_config``); the warm-up's result lands in
    ``trainer.odc_attention_warm_up``."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    varlen = odc_hf.attention.attention_of(model)
    wanted = odc_hf.attention.VarlenAttention(shape_bucket=trainer.odc_config.attention_shape_bucket,
                                              varlen_kernel=trainer.odc_config.attention_varlen_kernel)  # fmt: skip
    if varlen is not None and varlen != wanted:
        model.set_attn_implementation(odc_hf.attention.register(wanted))
        logger.info("odc_hf: attention %s (from ODCConfig)", wanted)
    param = next(model.parameters(), None)
    dtype = attention_dtype(trainer.accelerator.mixed_precision, param.dtype if param is not None else None)
    if varlen is not None and trainer.accelerator.device.type == "cuda" and dtype is not None:
        start = time.perf_counter()
        shapes = odc_hf.attention.warm_up(model, budget, dtype=dtype, device=trainer.accelerator.device)
        seconds = time.perf_counter() - start
        trainer.odc_attention_warm_up = {"shapes": shapes, "seconds": seconds, "dtype": str(dtype)}
        logger.info("odc_hf: planned %d attention shapes in %.1f s", shapes, seconds)
    if implementation in ("sdpa", "eager") and trainer.accelerator.is_main_process:  # once, not once per rank
        logger.warning(
            "odc_hf packs several documents per microbatch; with attn_implementation=%r transformers isolates "
            "them with a dense block-diagonal mask, which costs full-row attention (measured 2.6x slower for a "
            '2-document 28k-token row on an H200). Load the model with attn_implementation="sdpa_varlen" '
            '(registered by `import odc_hf.attention`, which the odc_hf trainers import; per-document SDPA, same results) or "flash_attention_2".',
            implementation,
        )
