"""The microbatch compute path: Liger kernels and a causal-LM loss that never builds the logits.

The ``tokens x vocab`` logits dominate a long row's memory; once a fused loss never materialises them, activation
checkpointing is no longer needed at 32k tokens for a 1.5B model, and the step gets faster (docs/performance.md has
the measurements). So the ODC trainers

- apply Liger's layer kernels (RMSNorm, SwiGLU, RoPE) before sharding, when ``liger-kernel`` is installed and
  training runs on CUDA (``ODCConfig.kernels``; ``use_liger_kernel=True`` requires them);
- compute the loss without full logits: ``ODCSFTTrainer`` keeps TRL's fused LM head (SFTTrainer installs it);
  ``ODCTrainer`` uses Liger's fused linear cross-entropy with the kernels, else TRL's chunked fused LM head on the
  plain model (a kept library's implementation, torch on CPU, Triton on GPU);
- choose activation checkpointing per decoder layer once the token budget is known
  (:mod:`odc_hf.integrations.compute.activation_checkpointing`); :func:`setup` decides who owns it.

:class:`ComputePath` records what was chosen (logged, and written with the run's cost-model files).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os

import torch
from torch.distributed.tensor import DTensor

from odc_hf.balance.memory import GIB, describe_checkpointing
from odc_hf.integrations.models import definition_check
from odc_hf.integrations.models.family import transformers_model
from odc_hf.integrations.upstream.transformers import apply_liger_kernel

logger = logging.getLogger(__name__)

TRL_FUSED_HEAD = "trl_fused_lm_head"
LIGER_FLCE = "liger_fused_linear_cross_entropy"
FULL_LOGITS = "full_logits"
DEVICE_HEADROOM = 0.9
"""Share of the device memory a predicted peak may fill (the caching allocator's fragmentation, CUDA context)."""


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
    kernel_config: dict | None = None  # what Liger was applied with (liger_kernel_config; fp32 experts kept)

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


def fp32_experts(model, mixed_precision: str) -> bool:
    """Whether ``model`` has Mixture-of-Experts expert weights that compute in float32: transformers' fused experts
    (a 3-D ``gate_up_proj``) in float32, with no mixed precision to cast them."""
    if mixed_precision not in (None, "no"):
        return False
    return any(name.rsplit(".", 1)[-1] == "gate_up_proj" and p.dim() == 3 and p.dtype == torch.float32
               for name, p in model.named_parameters())  # fmt: skip


def liger_kernel_config(model, requested: dict | None, *, explicit: bool, mixed_precision: str,
                        log: bool = True) -> dict:  # fmt: skip
    """The Liger kernel config to apply: the user's ``liger_kernel_config``, and float32 experts kept on the model's
    own implementation under ``kernels="auto"``.

    Liger's SwiGLU patch replaces a Mixture-of-Experts family's experts (transformers v5: Qwen3-MoE, Mixtral,
    DeepSeek, ...) with its fused MoE kernel, whose Triton matrix products take float32 inputs on TF32 (Triton's
    default precision: a 10-bit mantissa). In an fp32 run that is a precision the user did not choose (a MoE router
    loss then drifts from TRL's within a few steps: docs/performance.md), so ``auto`` leaves the experts alone
    there (``swiglu: False``; RMSNorm and RoPE stay on Liger). Asked for by name (``use_liger_kernel=True``,
    ``kernels="liger"`` or a ``swiglu`` entry of ``liger_kernel_config``), Liger is applied as asked, with a warning.
    Under mixed precision the model's own experts multiply in bf16/fp16 (autocast, or FSDP's parameter cast), less
    precisely than TF32: Liger applies as asked."""
    config = dict(requested or {})
    if not fp32_experts(model, mixed_precision) or config.get("swiglu") is False:
        return config
    if explicit or "swiglu" in config:
        if log:
            logger.warning("odc_hf: Liger's fused MoE kernel runs this model's float32 experts on TF32 (Triton's "
                           "default for float32 products); training then differs from the model's own float32 experts by "
                           "~1e-3. liger_kernel_config={'swiglu': False} keeps them exact")  # fmt: skip
        return config
    if log:
        logger.info("odc_hf: float32 experts stay on the model's own implementation (Liger's fused MoE kernel "
                    "would run them on TF32); Liger's other kernels apply")  # fmt: skip
    return {**config, "swiglu": False}


LIGER_ROPE_CHOICE_ENVS = ("LIGER_KERNEL_IMPL_ROPE", "LIGER_KERNEL_BACKEND_ROPE", "LIGER_KERNEL_IMPL", "LIGER_KERNEL_BACKEND")
"""Liger's own variables that choose its RoPE implementation (per op, then for every op; new and legacy names)."""


def pin_liger_rope(environ=None, impls=None) -> str:
    """Run Liger's RoPE on its Triton kernel, not its CuTe DSL one, unless the user chose (``LIGER_KERNEL_IMPL_ROPE``).

    liger-kernel 0.8.5 auto-selects a CuTe DSL RoPE on compute capability >= 9.0 when the CUTLASS DSL is importable
    (FlashAttention-4 installs it) for long rows, and that kernel spends host time on every call whenever the row
    length is new, the GPU idling meanwhile (a large part of a 32k step: docs/performance.md, "Liger's RoPE"). Rows
    of new lengths every step are what variable-length training is. Liger reads ``LIGER_KERNEL_IMPL_ROPE`` at
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
    pin_liger_rope()
    config = {**(kernel_config or {}), "fused_linear_cross_entropy": fused_linear_cross_entropy}
    if fused_linear_cross_entropy:
        config["cross_entropy"] = False  # Liger refuses both at once
    apply_liger_kernel(model, config)


# -- the loss ---------------------------------------------------------------------------------------------
SFT_HEAD_OUTPUTS = ("log_probs", "entropy", "is_top1")
"""What TRL 1.16's SFTTrainer asks its fused head for (its entropy and token-accuracy metrics)."""


def install_fused_head(model, outputs: tuple[str, ...] = ("log_probs",)) -> bool:
    """TRL's chunked fused LM head on a plain causal LM (``model(..., fused_lm_head=True)``); False without it. On a
    PEFT model it goes on the transformers model inside, as TRL requires (the adapter's forward passes the keyword on):
    on the ``PeftModel`` itself it would take the whole model's output for the backbone's."""
    try:
        from trl.trainer.utils import add_fused_lm_head
    except ImportError:  # trl < 1.16
        return False
    add_fused_lm_head(transformers_model(model), outputs=outputs)
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
    model = transformers_model(model)
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
    model = transformers_model(model)
    fsdp_logger = logging.getLogger(FSDP_LOGGER)
    fsdp_logger.filters = [f for f in fsdp_logger.filters if not isinstance(f, UnreadHeadFilter)]
    fsdp_logger.addFilter(UnreadHeadFilter(model.get_output_embeddings()))


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
    elif (problem := definition_check.fused_head_problem(model)) is not None:
        path.loss = FULL_LOGITS  # the model's own loss: TRL's fused head does not give it for this family
        if trainer.accelerator.is_main_process:
            logger.info("odc_hf: the model's own loss (full logits), because %s", problem)
    elif install_fused_head(model):
        path.loss, path.fused_by_odc = TRL_FUSED_HEAD, True
    if kernels == "liger":
        path.kernel_config = liger_kernel_config(model, getattr(args, "liger_kernel_config", None),
                                                 explicit=use_liger or config.kernels == "liger",
                                                 mixed_precision=trainer.accelerator.mixed_precision,
                                                 log=trainer.accelerator.is_main_process)  # fmt: skip
        apply_liger_kernels(model, fused_linear_cross_entropy=path.loss == LIGER_FLCE,
                            kernel_config=path.kernel_config)  # fmt: skip
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
