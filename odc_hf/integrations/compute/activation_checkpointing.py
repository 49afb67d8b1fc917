"""Activation checkpointing of the ODC trainers: which decoder layers recompute, for the run's token budget.

``ODCConfig.activation_checkpointing``: ``auto`` takes the fewest checkpointed layers whose predicted peak fits the
device at the token budget (:mod:`odc_hf.balance.memory`, calibrated here on the GPU with the run's own kernels and
loss path, :func:`calibrate_memory`); ``full``, ``none`` or a fraction of the layers are taken as they are.

Checkpointing uses transformers' own per-layer switch: ``gradient_checkpointing_enable`` installs the checkpoint
function on every ``GradientCheckpointingLayer`` and each layer's ``gradient_checkpointing`` flag (read at call
time) says whether it recomputes. The checkpoint runs inside the FSDP2 unit's forward (transformers >= 5.24
checkpoints ``forward``, below FSDP2's hooks; 5.17 checkpoints ``__call__``, whose recompute FSDP2's pre-forward
hook skips during backward), so it composes with ``fully_shard`` per decoder layer and with ODC's gathers.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import torch
import torch.distributed as dist
from transformers import GradientCheckpointingLayer

from odc_hf.balance.memory import (
    GIB,
    MemoryModel,
    checkpointed_indices,
    choose_checkpointing,
    layers_to_checkpoint,
    shortfall,
)
from odc_hf.integrations.compute.attention import attention_dtype
from odc_hf.integrations.compute.fused_head import (
    DEVICE_HEADROOM,
    LIGER_FLCE,
    TRL_FUSED_HEAD,
    ComputePath,
    apply_liger_kernels,
    install_fused_head,
)
from odc_hf.integrations.launch import shared_gpu
from odc_hf.integrations.upstream.transformers import checkpointing_installed

logger = logging.getLogger(__name__)

CALIBRATION_LAYERS = (2, 4)
"""Decoder layers of the two copies the memory calibration builds."""
CALIBRATION_TOKENS = 8192
"""Longest row of the memory calibration (and the token budget if smaller); the other is half of it."""


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's ``GradientCheckpointingLayer`` blocks, in order (transformers' per-layer checkpointing unit)."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def enable_checkpointing(model, checkpointed: int) -> None:
    """Checkpoint ``checkpointed`` decoder layers (spread evenly), no others. Callable again, also after sharding."""
    layers = decoder_layers(model)
    if not layers:
        if checkpointed:
            raise ValueError(f"{type(model).__name__} has no GradientCheckpointingLayer to checkpoint")
        return
    if checkpointed and not all(checkpointing_installed(layer) for layer in layers):
        kwargs = {"use_reentrant": False}  # non-reentrant: works with FSDP2 and keyword arguments
        if hasattr(
            model, "activation_checkpointing_enable"
        ):  # transformers >= 5.24 (the old name warns there)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    chosen = set(checkpointed_indices(checkpointed, len(layers)))
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index in chosen


def checkpointed_count(policy: str, num_layers: int) -> int:
    """Layers a fixed policy ("full", "none" or a fraction) checkpoints."""
    if policy == "full":
        return num_layers
    if policy == "none":
        return 0
    return layers_to_checkpoint(float(policy), num_layers)


def autocast_over_full_precision(mixed_precision: str | None, param_dtype: torch.dtype, sharded: bool) -> torch.dtype | None:
    """The autocast dtype when training computes in half precision over float32 parameters that no FSDP
    ``param_dtype`` casts first (one process: accelerate's plain autocast), else None.

    That regime keeps more than a half-precision model would: the residual stream stays float32 (the embedding's
    output is float32 and every layer adds onto it), and autocast's half-precision copies of the weights live from
    their first use in forward until backward has used them (measured on CPU autocast, a Qwen2 of hidden size 256:
    31.7 KB of saved activations per token against 25.8 KB for the same model in bf16, plus a copy of the weights).
    Under FSDP2 with mixed precision the gathered parameters are half precision already: neither applies."""
    dtype = attention_dtype(mixed_precision, None)  # autocast's dtype under accelerate's mixed precision, or None
    if dtype is None or sharded or param_dtype in (torch.float16, torch.bfloat16):
        return None
    return dtype


def calibration_step(model, tokens: int, loss: str, device: torch.device, autocast: torch.dtype | None = None):
    """Forward + backward of one random row of ``tokens`` tokens, as training runs it (under ``autocast`` when set)."""
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    kwargs = {"fused_lm_head": True} if loss == TRL_FUSED_HEAD else {}
    with torch.autocast(torch.device(device).type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = model(input_ids=ids, labels=ids, **kwargs)
    out.loss.backward()
    model.zero_grad(set_to_none=True)


def _peak_bytes(model, tokens: int, loss: str, device: torch.device, autocast: torch.dtype | None = None) -> float:
    """Peak allocated bytes above the resident ones during forward + backward of one random row."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    calibration_step(model, tokens, loss, device, autocast)
    torch.cuda.synchronize(device)
    return float(torch.cuda.max_memory_allocated(device) - base)


def config_with_layers(config, layers: int):
    """A copy of ``config`` with ``layers`` decoder layers. Per-layer lists that transformers derives from the layer
    count at construction (``layer_types``: full / sliding attention) are cut or repeated to match; a 2-layer model's
    config asked for 4 layers would otherwise fail in the model's constructor (IndexError, transformers 5.17)."""
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    kinds = getattr(config, "layer_types", None)
    if kinds:
        config.layer_types = [kinds[i % len(kinds)] for i in range(layers)]
    return config


def small_copy(model, layers: int, *, device, dtype: torch.dtype, kernels: str, loss: str,
               kernel_config: dict | None = None):  # fmt: skip
    """A ``layers``-layer copy of ``model``'s architecture (random weights, ``dtype``, training mode) with the run's
    kernels and loss; a PEFT model's copy is its base architecture wrapped with the same adapter config, so that
    what is trainable (and so which gradients exist) matches. (Calling a PeftModel's class with a config fails:
    every LoRA run on a GPU did, seen on one H200.)"""
    base, peft_config = model, None
    if callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config"):
        name = model.active_adapter
        name = name[0] if isinstance(name, (list, tuple)) else name  # PEFT gives a list with several active
        base, peft_config = model.get_base_model(), model.peft_config[name]
    config = config_with_layers(base.config, layers)
    with torch.random.fork_rng(devices=[device] if torch.device(device).type == "cuda" else []), torch.device(device):
        torch.manual_seed(0)
        small = type(base)(config).to(dtype)
    small.train()
    if kernels == "liger":
        apply_liger_kernels(small, fused_linear_cross_entropy=loss == LIGER_FLCE, kernel_config=kernel_config)
    if loss == TRL_FUSED_HEAD:
        install_fused_head(small)  # before PEFT wraps it, as TRL adds it
    if peft_config is not None:
        from peft import get_peft_model  # an optional dependency

        small = get_peft_model(small, copy.deepcopy(peft_config))
        small.train()
    return small


def calibrate_memory(model, *, device, dtype: torch.dtype, kernels: str, loss: str, tokens: int,
                     kernel_config: dict | None = None, autocast: torch.dtype | None = None) -> MemoryModel:  # fmt: skip
    """Per-token memory terms of ``model``'s architecture on ``device`` (CUDA), with the run's kernels and loss.

    Builds 2- and 4-layer copies of the architecture (random weights, ``dtype``), runs forward + backward of rows
    of T and T/2 tokens (T = min(tokens, CALIBRATION_TOKENS)) without and with checkpointing, and reads the
    allocator's peaks: half the 4-layer minus the 2-layer slope is one layer's bytes per token. (With one layer
    the peak can fall in another phase of the step, e.g. inside Liger's fused loss, which computes its gradients
    in the forward, and a 1- vs 2-layer fit overestimated the peak: docs/benchmarks.md.) ``fixed_bytes`` is the
    library workspace (gradients of the copies removed); ``static_bytes`` is 0: the caller adds its own resident state.
    ``autocast``: the run computes under autocast over parameters of ``dtype`` (:func:`autocast_over_full_precision`);
    the copies then run so too, and the weight copies autocast makes are left out of the workspace
    (:func:`resident_bytes` adds the whole model's).
    """
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    t2 = max(64, min(int(tokens), CALIBRATION_TOKENS))
    t1 = t2 // 2
    slopes, workspace = {}, 0.0
    for layers in CALIBRATION_LAYERS:
        small = small_copy(model, layers, device=device, dtype=dtype, kernels=kernels, loss=loss,
                           kernel_config=kernel_config)  # fmt: skip
        grads = sum(p.numel() * p.element_size() for p in small.parameters() if p.requires_grad)
        copies = weight_copy_bytes(small, autocast)
        for checkpointed in (0, layers):
            enable_checkpointing(small, checkpointed)
            _peak_bytes(small, t1, loss, device, autocast)  # warm-up: kernels, workspaces, autotuning
            low, high = (_peak_bytes(small, t, loss, device, autocast) for t in (t1, t2))
            slopes[layers, checkpointed > 0] = slope = (high - low) / (t2 - t1)
            workspace = max(workspace, low - slope * t1 - grads - copies)
        del small
        torch.cuda.empty_cache()
    low, high = CALIBRATION_LAYERS
    layer = max(0.0, (slopes[high, False] - slopes[low, False]) / (high - low))
    other = max(0.0, slopes[low, False] - low * layer)
    checkpoint = min(layer, max(0.0, (slopes[high, True] - slopes[low, True]) / (high - low)))
    recompute = max(0.0, slopes[low, True] - other - low * checkpoint)
    return MemoryModel(num_layers=model.config.num_hidden_layers, layer_bytes_per_token=layer,
                       checkpoint_bytes_per_token=checkpoint, recompute_bytes_per_token=recompute,
                       other_bytes_per_token=other, fixed_bytes=max(0.0, workspace))  # fmt: skip


def weight_copy_bytes(model, autocast: torch.dtype | None) -> float:
    """Bytes of the half-precision weight copies autocast makes of ``model``'s parameters in one forward (all of
    them counted: the embedding too, whose tied head is cast for the logits), 0 without autocast."""
    if autocast is None:
        return 0.0
    return float(sum(p.numel() for p in model.parameters() if p.is_floating_point()) * autocast.itemsize)


def resident_bytes(model, *, world_size: int, compute_dtype: torch.dtype, odc: bool,
                   optimizer_states: int = 2, autocast: torch.dtype | None = None) -> tuple[float, float]:  # fmt: skip
    """``(static, fixed)`` bytes of a rank's FSDP2 layout, from parameter counts (before sharding).

    static: sharded master parameters and gradients (the parameters' dtype), ``optimizer_states`` fp32 states per
    trainable element (AdamW: 2), and under ODC the bf16 staging shard and the fp32 accumulator. fixed: what is
    unsharded during a microbatch: the embedding/head unit (kept gathered from forward to backward), two decoder
    layers in flight (prefetch), each with its compute-dtype gradient and fp32 reduce copy. One process: no sharding,
    nothing in flight, but under ``autocast`` over full-precision parameters the weight copies autocast keeps from
    forward to backward (:func:`weight_copy_bytes`).
    """
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    master = params[0].element_size() if params else 4
    static = (total * master + trainable * (master + 4 * optimizer_states)) / world_size
    if world_size == 1:
        return float(static), weight_copy_bytes(model, autocast)
    if odc:
        static += (total * compute_dtype.itemsize + trainable * 4) / world_size
    layers = decoder_layers(model)
    layer = max((sum(p.numel() for p in m.parameters()) for m in layers), default=0)
    tail = total - sum(p.numel() for m in layers for p in m.parameters())
    fixed = tail * compute_dtype.itemsize * 2 + 2 * layer * (2 * compute_dtype.itemsize + 4)
    return float(static), float(fixed)


def plan_checkpointing(path: ComputePath, model, *, policy: str, tokens: int, device: torch.device,
                       compute_dtype: torch.dtype, world_size: int, odc: bool, device_memory_gib: float | None,
                       kernel_config: dict | None = None, autocast: torch.dtype | None = None) -> ComputePath:  # fmt: skip
    """Decide and apply checkpointing for microbatches of up to ``tokens`` tokens; fill in ``path``. ``autocast``:
    see :func:`autocast_over_full_precision` (the calibration then runs float32 copies under it)."""
    layers = decoder_layers(model)
    path.num_layers, path.tokens = len(layers), int(tokens)
    if not layers:
        path.checkpointed_layers = 0
        return path
    if policy != "auto":
        n = checkpointed_count(policy, len(layers))
    elif (
        torch.device(device).type != "cuda"
    ):  # no allocator statistics to calibrate against: see performance.md
        n = 0
    else:
        copy_dtype = next(model.parameters()).dtype if autocast is not None else compute_dtype
        memory = calibrate_memory(model, device=device, dtype=copy_dtype, kernels=path.kernels, loss=path.loss,
                                  tokens=tokens, kernel_config=kernel_config, autocast=autocast)  # fmt: skip
        static, fixed = resident_bytes(model, world_size=world_size, compute_dtype=compute_dtype, odc=odc,
                                       autocast=autocast)  # fmt: skip
        memory = dataclasses.replace(memory, static_bytes=static, fixed_bytes=memory.fixed_bytes + fixed,
                                     num_layers=len(layers))  # fmt: skip
        # ranks sharing a GPU (shared_gpu) plan against their share of its memory
        total = (device_memory_gib * GIB if device_memory_gib
                 else torch.cuda.get_device_properties(device).total_memory / shared_gpu.ranks_per_gpu())  # fmt: skip
        memory, total = _agree(memory, float(total), device)
        n, fits = choose_checkpointing(memory, tokens, DEVICE_HEADROOM * total)
        path.memory_model, path.device_bytes = memory.to_dict(), total
        path.predicted_peak_bytes = memory.peak_bytes(tokens, n)
        if not fits:
            logger.warning("odc_hf: %s (device %.1f GiB x %.2f)", shortfall(memory, tokens, DEVICE_HEADROOM * total),
                           total / GIB, DEVICE_HEADROOM)  # fmt: skip
    enable_checkpointing(model, n)
    path.checkpointed_layers = n
    return path


def _agree(memory: MemoryModel, total: float, device) -> tuple[MemoryModel, float]:
    """Every rank plans with the largest measured terms and the smallest device, so all choose the same."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return memory, total
    names = [f.name for f in dataclasses.fields(MemoryModel) if f.name != "num_layers"]
    values = torch.tensor([getattr(memory, n) for n in names] + [-total], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    merged = dict(zip(names, values.tolist()[:-1]))
    return dataclasses.replace(memory, **merged), -values[-1].item()


def plan(trainer, max_tokens_per_microbatch: int) -> None:
    """When the token budget is known (``get_train_dataloader``, before ``prepare()``): choose and apply
    checkpointing for microbatches of up to ``max_tokens_per_microbatch`` tokens, log the compute path."""
    path: ComputePath = trainer.odc_compute
    accelerator = trainer.accelerator
    if path.checkpointing == "user":
        path.checkpointing, path.tokens = "full (gradient_checkpointing=True)", int(max_tokens_per_microbatch)
    else:
        model = accelerator.unwrap_model(trainer.model)
        param = next(model.parameters())
        dtype = attention_dtype(accelerator.mixed_precision, param.dtype) or param.dtype
        # several processes: FSDP2 gathers the parameters in the compute dtype (accelerate's MixedPrecisionPolicy)
        autocast = autocast_over_full_precision(accelerator.mixed_precision, param.dtype,
                                                sharded=accelerator.num_processes > 1)  # fmt: skip
        plan_checkpointing(path, model, policy=path.checkpointing, tokens=max_tokens_per_microbatch,
                           device=accelerator.device, compute_dtype=dtype, world_size=accelerator.num_processes,
                           odc=trainer.odc_config.enabled and accelerator.num_processes > 1,
                           device_memory_gib=trainer.odc_config.device_memory_gib,
                           kernel_config=path.kernel_config, autocast=autocast)  # fmt: skip
    if accelerator.is_main_process:
        logger.info("odc_hf: microbatch compute path %s", path.describe())
