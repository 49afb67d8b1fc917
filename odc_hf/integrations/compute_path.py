"""The microbatch compute path: Liger kernels, a causal-LM loss that never builds the logits, activation checkpointing.

Measured on one H200 (DESIGN.md §6, ``benchmarks/results/compute_ceiling_*``): the ``tokens x vocab`` logits
dominate a long row's memory; once a fused loss never materialises them, activation checkpointing is no longer
needed at 32k tokens for a 1.5B model, and the step gets ~1.4x faster. So the ODC trainers

- apply Liger's layer kernels (RMSNorm, SwiGLU, RoPE) before sharding, when ``liger-kernel`` is installed and
  training runs on CUDA (``ODCConfig.kernels``; ``use_liger_kernel=True`` requires them);
- compute the loss without full logits: ``ODCSFTTrainer`` keeps TRL's fused LM head (SFTTrainer installs it);
  ``ODCTrainer`` uses Liger's fused linear cross-entropy with the kernels, else TRL's chunked fused LM head on the
  plain model (a kept library's implementation, torch on CPU, Triton on GPU);
- choose activation checkpointing per decoder layer (``ODCConfig.activation_checkpointing``): ``auto`` takes the
  fewest checkpointed layers whose predicted peak fits the device at the token budget
  (:mod:`odc_hf.balance.memory`, calibrated here on the GPU with the run's own kernels and loss path).

Checkpointing uses transformers' own per-layer switch: ``gradient_checkpointing_enable`` installs the checkpoint
function on every ``GradientCheckpointingLayer`` and each layer's ``gradient_checkpointing`` flag (read at call
time) says whether it recomputes. The checkpoint runs inside the FSDP2 unit's forward (transformers >= 5.24
checkpoints ``forward``, below FSDP2's hooks; 5.17 checkpoints ``__call__``, whose recompute FSDP2's pre-forward
hook skips during backward), so it composes with ``fully_shard`` per decoder layer and with ODC's gathers.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import logging
import os

import torch

from odc_hf.balance.memory import (
    GIB,
    MemoryModel,
    checkpointed_indices,
    choose_checkpointing,
    describe_checkpointing,
    layers_to_checkpoint,
)
from odc_hf.integrations import shared_gpu

logger = logging.getLogger(__name__)

TRL_FUSED_HEAD = "trl_fused_lm_head"
LIGER_FLCE = "liger_fused_linear_cross_entropy"
FULL_LOGITS = "full_logits"
DEVICE_HEADROOM = 0.9
"""Share of the device memory a predicted peak may fill (the caching allocator's fragmentation, CUDA context)."""
CALIBRATION_LAYERS = (2, 4)
"""Decoder layers of the two copies the memory calibration builds."""
CALIBRATION_TOKENS = 8192
"""Longest row of the memory calibration (and the token budget if smaller); the other is half of it."""


@dataclasses.dataclass
class ComputePath:
    """What the trainer runs per microbatch (logged, and recorded in the run's cost-model files)."""

    kernels: str = "none"  # "liger" | "none"
    loss: str = FULL_LOGITS
    checkpointing: str = "none"  # the ODCConfig value, or "user" (the Trainer's gradient_checkpointing=True)
    checkpointed_layers: int | None = None
    num_layers: int | None = None
    fused_by_odc: bool = False  # ODC installed TRL's fused head: compute_loss must ask for it
    tokens: int | None = None
    predicted_peak_bytes: float | None = None
    device_bytes: float | None = None
    memory_model: dict | None = None

    def describe(self) -> dict:
        ac = self.checkpointing
        if self.checkpointed_layers is not None and self.num_layers:
            ac = describe_checkpointing(self.checkpointed_layers, self.num_layers)
            ac = f"{ac} (auto)" if self.checkpointing == "auto" else ac
        out = {"kernels": self.kernels, "loss": self.loss, "activation_checkpointing": ac}
        if self.predicted_peak_bytes is not None:
            out.update(predicted_peak_gib=round(self.predicted_peak_bytes / GIB, 2), tokens=self.tokens,
                       device_gib=round(self.device_bytes / GIB, 2))  # fmt: skip
        return out

    def oom_message(self) -> str:
        d = self.describe()
        text = (
            f"out of memory in a microbatch under activation_checkpointing={d['activation_checkpointing']!r}"
        )
        if self.predicted_peak_bytes is not None:
            text += (f": predicted peak {d['predicted_peak_gib']} GiB at {self.tokens} tokens, device "
                     f"{d['device_gib']} GiB x {DEVICE_HEADROOM} usable")  # fmt: skip
        return text + (
            ". Set activation_checkpointing='full' (or a larger fraction such as '0.75'), lower "
            "max_tokens_per_microbatch, or lower device_memory_gib so that 'auto' plans with more headroom"
        )


# -- kernels ----------------------------------------------------------------------------------------------
def liger_problem(device: torch.device) -> str | None:
    """Why Liger's kernels cannot run here, or None."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install 'odc_hf[kernels]')"
    if torch.device(device).type != "cuda":
        return f"Liger's kernels are Triton GPU kernels and this run's device is {torch.device(device)}"
    return None


def resolve_kernels(choice: str, use_liger_kernel: bool, device: torch.device) -> str:
    """``"liger"`` or ``"none"`` from ``ODCConfig.kernels`` and the training arguments' ``use_liger_kernel``."""
    if use_liger_kernel and choice == "none":
        raise ValueError("use_liger_kernel=True contradicts ODCConfig(kernels='none'): drop one of them")
    problem = liger_problem(device)
    if use_liger_kernel or choice == "liger":
        if problem is not None:
            what = "use_liger_kernel=True" if use_liger_kernel else "ODCConfig(kernels='liger')"
            raise ValueError(f"{what} needs Liger's kernels, but {problem}. Set use_liger_kernel=False and "
                             "kernels='none' (or 'auto') to train without them")  # fmt: skip
        return "liger"
    return "liger" if choice == "auto" and problem is None else "none"


def liger_supports(model) -> bool:
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return getattr(getattr(model, "config", None), "model_type", None) in MODEL_TYPE_TO_APPLY_LIGER_FN


LIGER_ROPE_CHOICE_ENVS = ("LIGER_KERNEL_IMPL_ROPE", "LIGER_KERNEL_BACKEND_ROPE", "LIGER_KERNEL_IMPL", "LIGER_KERNEL_BACKEND")
"""Liger's own variables that choose its RoPE implementation (per op, then for every op; new and legacy names)."""


def pin_liger_rope(environ=None, impls=None) -> str:
    """Run Liger's RoPE on its Triton kernel, not its CuTe DSL one, unless the user chose (``LIGER_KERNEL_IMPL_ROPE``).

    liger-kernel 0.8.5 auto-selects a CuTe DSL RoPE on compute capability >= 9.0 when the CUTLASS DSL is importable
    (FlashAttention-4 installs it) for rows of >= 131,072 query head-rows. On one H200 (Qwen2.5-1.5B shape, 28 layers)
    each call of it cost ~10 ms of host time (forward) and ~14 ms (backward) whenever the row length was new, the
    GPU idling meanwhile: 0.67 s of a 1.6 s step of a 32k row (profile in benchmarks/results/single_gpu_h200x1_2026-12-02*).
    Rows of new lengths every step are what variable-length training is. Liger reads ``LIGER_KERNEL_IMPL_ROPE`` at
    every call (its public per-op choice); this sets it to ``nvidia-triton`` where Liger registers both. Returns what
    happened: ``"pinned"``, ``"user"`` (a Liger choice was set: kept), ``"no choice"`` (this Liger has one RoPE).
    ``impls``: the RoPE implementations to assume (tests); default: ``liger_kernel.backends.all_impls("rope")``.
    """
    environ = os.environ if environ is None else environ
    if any(environ.get(name) for name in LIGER_ROPE_CHOICE_ENVS):
        return "user"
    if impls is None:
        try:
            from liger_kernel.backends import all_impls
        except ImportError:  # liger-kernel without per-op implementations (< 0.8): Triton only
            return "no choice"
        impls = all_impls("rope")
    if "nvidia-cutedsl" not in impls or "nvidia-triton" not in impls:
        return "no choice"
    environ["LIGER_KERNEL_IMPL_ROPE"] = "nvidia-triton"
    return "pinned"


def apply_liger_kernels(
    model, *, fused_linear_cross_entropy: bool, kernel_config: dict | None = None
) -> None:
    """Liger's kernels on ``model`` (before sharding), through transformers' own integration (what the Trainer
    does for ``use_liger_kernel``); its fused linear cross-entropy only where asked; RoPE on Triton
    (:func:`pin_liger_rope`)."""
    from transformers.integrations.liger import apply_liger_kernel

    pin_liger_rope()
    config = {**(kernel_config or {}), "fused_linear_cross_entropy": fused_linear_cross_entropy}
    if fused_linear_cross_entropy:
        config["cross_entropy"] = False  # Liger refuses both at once
    apply_liger_kernel(model, config)


# -- the loss ---------------------------------------------------------------------------------------------
SFT_HEAD_OUTPUTS = ("log_probs", "entropy", "is_top1")
"""What TRL 1.16's SFTTrainer asks its fused head for (its entropy and token-accuracy metrics)."""


def install_fused_head(model, outputs: tuple[str, ...] = ("log_probs",)) -> bool:
    """TRL's chunked fused LM head on a plain causal LM (``model(..., fused_lm_head=True)``); False without it."""
    try:
        from trl.trainer.utils import add_fused_lm_head
    except ImportError:  # trl < 1.16
        return False
    add_fused_lm_head(model, outputs=outputs)
    return True


def fused_head_loss(model, inputs: dict, num_items_in_batch) -> torch.Tensor:
    """Summed token NLL / ``num_items_in_batch`` (the GLOBAL label-token count under ODC) via TRL's fused head."""
    return model(**inputs, fused_lm_head=True, num_items_in_batch=num_items_in_batch).loss


def guard_sharded_head(model) -> None:
    """Fail clearly (instead of deadlocking) if a fused loss would read a still-sharded ``lm_head`` weight.

    TRL's fused head and Liger's fused loss read ``lm_head.weight`` without calling the module; a weight that is
    still a sharded DTensor then gets ``full_tensor()``, a collective per microbatch, which deadlocks ranks that
    run different numbers of microbatches. The final norm and lm_head share an FSDP unit with
    ``reshard_after_forward=False`` in accelerate's FSDP2 layout and ``odc_hf.fsdp.shard_model``, so the weight is
    already gathered (by ODC's one-sided gather) when the backbone returns.
    """
    from torch.distributed.tensor import DTensor

    if hasattr(model, "get_base_model"):  # PEFT: the transformers model inside
        model = model.get_base_model()
    head = model.get_output_embeddings()

    def check(module, args, output):
        if isinstance(head.weight, DTensor):
            raise RuntimeError(
                "odc_hf: lm_head.weight is still sharded when the fused loss reads it; gathering it would be a "
                "collective per microbatch, which deadlocks ODC's uneven microbatch counts. Shard the final norm "
                "and lm_head into one FSDP unit with reshard_after_forward=False (accelerate's FSDP2 and "
                "odc_hf.fsdp.shard_model do)"
            )

    model.base_model.register_forward_hook(check)


FSDP_LOGGER = "torch.distributed.fsdp.fully_shard"
UNREAD_MODULE_WARNING = "did not run forward before backward"


class UnreadHeadFilter(logging.Filter):
    """Drops FSDP2's "did not run forward before backward" warning when the only module named is ``head``.

    torch 2.11's ``fully_shard`` warns (once per process) when a module of a multi-module unit never ran forward.
    The fused losses read ``lm_head.weight`` without calling ``lm_head``, so the tail unit ``[final norm, (embedding,)
    lm_head]`` triggers it on every correct run; the grouping is what makes the read correct (the norm's forward
    gathers the unit, :func:`guard_sharded_head` checks it). Any other module, or a second one, still warns.
    torch 2.13 no longer emits it.
    """

    def __init__(self, head: torch.nn.Module):
        super().__init__()
        self.head = head

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if UNREAD_MODULE_WARNING not in message:
            return True
        return not message.endswith(f"Modules that did not run forward: [{self.head!r}]")


def quiet_unread_head_warning(model) -> None:
    """Install :class:`UnreadHeadFilter` for ``model``'s output embedding (with a fused loss only)."""
    if hasattr(model, "get_base_model"):  # PEFT: the transformers model inside
        model = model.get_base_model()
    fsdp_logger = logging.getLogger(FSDP_LOGGER)
    fsdp_logger.filters = [f for f in fsdp_logger.filters if not isinstance(f, UnreadHeadFilter)]
    fsdp_logger.addFilter(UnreadHeadFilter(model.get_output_embeddings()))


# -- activation checkpointing ----------------------------------------------------------------------------
def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's ``GradientCheckpointingLayer`` blocks, in order (transformers' per-layer checkpointing unit)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def enable_checkpointing(model, checkpointed: int) -> None:
    """Checkpoint ``checkpointed`` decoder layers (spread evenly), no others. Callable again, also after sharding."""
    layers = decoder_layers(model)
    if not layers:
        if checkpointed:
            raise ValueError(f"{type(model).__name__} has no GradientCheckpointingLayer to checkpoint")
        return
    if checkpointed and not all(hasattr(layer, "_gradient_checkpointing_func") for layer in layers):
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


def _peak_bytes(model, tokens: int, loss: str, device: torch.device) -> float:
    """Peak allocated bytes above the resident ones during forward + backward of one random row."""
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    kwargs = {"fused_lm_head": True} if loss == TRL_FUSED_HEAD else {}
    model(input_ids=ids, labels=ids, **kwargs).loss.backward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    model.zero_grad(set_to_none=True)
    return float(peak)


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
        from peft import get_peft_model

        small = get_peft_model(small, copy.deepcopy(peft_config))
        small.train()
    return small


def calibrate_memory(model, *, device, dtype: torch.dtype, kernels: str, loss: str, tokens: int,
                     kernel_config: dict | None = None) -> MemoryModel:  # fmt: skip
    """Per-token memory terms of ``model``'s architecture on ``device`` (CUDA), with the run's kernels and loss.

    Builds 2- and 4-layer copies of the architecture (random weights, ``dtype``), runs forward + backward of rows
    of T and T/2 tokens (T = min(tokens, CALIBRATION_TOKENS)) without and with checkpointing, and reads the
    allocator's peaks: half the 4-layer minus the 2-layer slope is one layer's bytes per token. (With one layer
    the peak can fall in another phase of the step, e.g. inside Liger's fused loss, which computes its gradients
    in the forward; 1.5B on an H200: a 1- vs 2-layer fit overestimated the 32k no-AC peak by 54 %.) ``fixed_bytes`` is the
    library workspace (gradients of the copies removed); ``static_bytes`` is 0: the caller adds its own resident state.
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
        for checkpointed in (0, layers):
            enable_checkpointing(small, checkpointed)
            _peak_bytes(small, t1, loss, device)  # warm-up: kernels, workspaces, autotuning
            low, high = (_peak_bytes(small, t, loss, device) for t in (t1, t2))
            slopes[layers, checkpointed > 0] = slope = (high - low) / (t2 - t1)
            workspace = max(workspace, low - slope * t1 - grads)
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


def resident_bytes(model, *, world_size: int, compute_dtype: torch.dtype, odc: bool,
                   optimizer_states: int = 2) -> tuple[float, float]:  # fmt: skip
    """``(static, fixed)`` bytes of a rank's FSDP2 layout, from parameter counts (before sharding).

    static: sharded master parameters and gradients (the parameters' dtype), ``optimizer_states`` fp32 states per
    trainable element (AdamW: 2), and under ODC the bf16 staging shard and the fp32 accumulator. fixed: what is
    unsharded during a microbatch: the embedding/head unit (kept gathered from forward to backward), two decoder
    layers in flight (prefetch), each with its compute-dtype gradient and fp32 reduce copy. One process: no sharding,
    nothing in flight.
    """
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    master = params[0].element_size() if params else 4
    static = (total * master + trainable * (master + 4 * optimizer_states)) / world_size
    if world_size == 1:
        return float(static), 0.0
    if odc:
        static += (total * compute_dtype.itemsize + trainable * 4) / world_size
    layers = decoder_layers(model)
    layer = max((sum(p.numel() for p in m.parameters()) for m in layers), default=0)
    tail = total - sum(p.numel() for m in layers for p in m.parameters())
    fixed = tail * compute_dtype.itemsize * 2 + 2 * layer * (2 * compute_dtype.itemsize + 4)
    return float(static), float(fixed)


def plan_checkpointing(path: ComputePath, model, *, policy: str, tokens: int, device: torch.device,
                       compute_dtype: torch.dtype, world_size: int, odc: bool, device_memory_gib: float | None,
                       kernel_config: dict | None = None) -> ComputePath:  # fmt: skip
    """Decide and apply checkpointing for microbatches of up to ``tokens`` tokens; fill in ``path``."""
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
        memory = calibrate_memory(model, device=device, dtype=compute_dtype, kernels=path.kernels, loss=path.loss,
                                  tokens=tokens, kernel_config=kernel_config)  # fmt: skip
        static, fixed = resident_bytes(model, world_size=world_size, compute_dtype=compute_dtype, odc=odc)
        memory = dataclasses.replace(memory, static_bytes=static, fixed_bytes=memory.fixed_bytes + fixed,
                                     num_layers=len(layers))  # fmt: skip
        # ranks sharing a GPU (shared_gpu) plan against their share of its memory
        total = (device_memory_gib * GIB if device_memory_gib
                 else torch.cuda.get_device_properties(device).total_memory / shared_gpu.device_memory_share())  # fmt: skip
        memory, total = _agree(memory, float(total), device)
        n, fits = choose_checkpointing(memory, tokens, DEVICE_HEADROOM * total)
        path.memory_model, path.device_bytes = memory.to_dict(), total
        path.predicted_peak_bytes = memory.peak_bytes(tokens, n)
        if not fits:
            logger.warning("odc_hf: even full activation checkpointing is predicted to need %.1f GiB at %d tokens "
                           "(device %.1f GiB x %.2f): lower max_tokens_per_microbatch",
                           path.predicted_peak_bytes / GIB, tokens, total / GIB, DEVICE_HEADROOM)  # fmt: skip
    enable_checkpointing(model, n)
    path.checkpointed_layers = n
    return path


def _agree(memory: MemoryModel, total: float, device) -> tuple[MemoryModel, float]:
    """Every rank plans with the largest measured terms and the smallest device, so all choose the same."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return memory, total
    names = [f.name for f in dataclasses.fields(MemoryModel) if f.name != "num_layers"]
    values = torch.tensor([getattr(memory, n) for n in names] + [-total], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    merged = dict(zip(names, values.tolist()[:-1]))
    return dataclasses.replace(memory, **merged), -values[-1].item()


@contextlib.contextmanager
def oom_guard(path: ComputePath | None):
    """An out-of-memory error in a microbatch names the checkpointing policy, the prediction and what to set."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as err:
        if path is None:
            raise
        raise RuntimeError(f"odc_hf: {path.oom_message()}") from err


# -- the trainer's two hooks -----------------------------------------------------------------------------
def user_asked_for_checkpointing(args) -> bool:
    """``gradient_checkpointing=True`` set by the user, not by a class default (TRL's SFTConfig defaults to True)."""
    if not getattr(args, "gradient_checkpointing", False):
        return False
    field = {f.name: f for f in dataclasses.fields(type(args))}.get("gradient_checkpointing")
    class_default = field is not None and field.default is True
    return not class_default or bool(getattr(args, "gradient_checkpointing_kwargs", None))


def setup(trainer) -> ComputePath:
    """End of the ODC trainer's ``__init__`` (model not sharded yet): kernels, loss path, who owns checkpointing."""
    config, args = trainer.odc_config, trainer.args
    model = trainer.accelerator.unwrap_model(trainer.model)
    use_liger = bool(getattr(args, "use_liger_kernel", False))
    kernels = resolve_kernels(config.kernels, use_liger, trainer.accelerator.device)
    if kernels == "liger" and not liger_supports(model):
        if use_liger or config.kernels == "liger":
            raise ValueError(f"Liger has no kernels for model type {model.config.model_type!r}: set "
                             "use_liger_kernel=False and kernels='none' (or 'auto')")  # fmt: skip
        kernels = "none"
    path = ComputePath(kernels=kernels)
    # a custom compute_loss, compute_loss_func or label smoothing read the model's logits
    needs_logits = (not trainer.odc_base_loss_is_plain() or trainer.compute_loss_func is not None
                    or trainer.label_smoother is not None)  # fmt: skip
    if trainer.odc_base_fused_head():
        path.loss = TRL_FUSED_HEAD
    elif needs_logits or model.get_output_embeddings() is None:
        path.loss = FULL_LOGITS
    elif kernels == "liger":
        path.loss = LIGER_FLCE
    elif install_fused_head(model):
        path.loss, path.fused_by_odc = TRL_FUSED_HEAD, True
    if kernels == "liger":
        apply_liger_kernels(model, fused_linear_cross_entropy=path.loss == LIGER_FLCE,
                            kernel_config=getattr(args, "liger_kernel_config", None))  # fmt: skip
        args.use_liger_kernel = False  # applied here, before sharding: the Trainer must not apply them again
    if path.loss != FULL_LOGITS and config.enabled and trainer.accelerator.num_processes > 1:
        guard_sharded_head(model)
    if path.loss != FULL_LOGITS:
        quiet_unread_head_warning(model)
    if config.activation_checkpointing == "auto" and user_asked_for_checkpointing(args):
        path.checkpointing = "user"  # the Trainer enables full checkpointing itself, with the user's kwargs
    else:
        path.checkpointing = config.activation_checkpointing
        if getattr(args, "gradient_checkpointing", False) and trainer.accelerator.is_main_process:
            logger.info("odc_hf: activation_checkpointing=%r manages checkpointing; the training arguments' "
                        "gradient_checkpointing=True is not applied", path.checkpointing)  # fmt: skip
        for name in (
            "gradient_checkpointing",
            "activation_checkpointing",
        ):  # the second: transformers >= 5.24
            if hasattr(args, name):
                setattr(args, name, False)
    return path


def plan(trainer, tokens: int) -> None:
    """When the token budget is known (``get_train_dataloader``): choose and apply checkpointing, log the path."""
    from odc_hf.integrations.attention_setup import attention_dtype

    path: ComputePath = trainer.odc_compute
    accelerator = trainer.accelerator
    if path.checkpointing == "user":
        path.checkpointing, path.tokens = "full (gradient_checkpointing=True)", int(tokens)
    else:
        model = accelerator.unwrap_model(trainer.model)
        param = next(model.parameters())
        dtype = attention_dtype(accelerator.mixed_precision, param.dtype) or param.dtype
        plan_checkpointing(path, model, policy=path.checkpointing, tokens=tokens, device=accelerator.device,
                           compute_dtype=dtype, world_size=accelerator.num_processes,
                           odc=trainer.odc_config.enabled and accelerator.num_processes > 1,
                           device_memory_gib=trainer.odc_config.device_memory_gib,
                           kernel_config=getattr(trainer.args, "liger_kernel_config", None))  # fmt: skip
    if accelerator.is_main_process:
        logger.info("odc_hf: microbatch compute path %s", path.describe())


def check_recorded(data: dict, path: ComputePath | None, source: str) -> None:
    """Warn when a cost-model file was measured on another compute path (checkpointing changes the cost per token)."""
    recorded = data.get("compute_path")
    if path is None or not isinstance(recorded, dict):
        return
    current = path.describe()
    differs = {k: (recorded.get(k), current[k]) for k in ("kernels", "loss", "activation_checkpointing")
               if k in recorded and recorded.get(k) != current[k]}  # fmt: skip
    if differs:
        logger.warning("odc_hf: %s was measured with %s; this run uses %s: its costs per token may differ, "
                       "re-calibrate", source, {k: a for k, (a, _) in differs.items()},
                       {k: b for k, (_, b) in differs.items()})  # fmt: skip
