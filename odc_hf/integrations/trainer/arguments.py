"""ODC options as trainer arguments: ``odc_*`` fields on ``ODCTrainingArguments`` (here), ``ODCSFTConfig`` and
``ODCGRPOConfig`` (``odc_hf.integrations.trl.sft_config``, ``odc_hf.integrations.trl.grpo_config``).

They are the knobs of :class:`odc_hf.ODCConfig`, one ``odc_<field>`` per field, written out in :class:`ODCArguments`
so that argument parsers (``HfArgumentParser`` / ``TrlParser``: ``--odc_balance`` ...), ``--help`` and IDEs show them;
each takes its help from ODCConfig's field (:func:`odc_field`), and ``tests/trainers/test_trainer_arguments.py`` keeps the two
in step. A field left at ``None`` (not set) falls back to the
``ODC_*`` environment variable, then to ODCConfig's default; an explicit ``odc_config=`` passed to the trainer wins
over all of them.
"""

from __future__ import annotations

import dataclasses

from transformers import TrainingArguments

from odc_hf.config import ODCConfig
from odc_hf.integrations.launch import shared_gpu

PREFIX = "odc_"


def odc_field(name: str):
    """The ``odc_<name>`` argument of ODCConfig's field ``name``: ``None`` (not set) by default, its help ODCConfig's
    (the field's ``help`` metadata, written once there) with ODCConfig's default."""
    option = ODCConfig.__dataclass_fields__[name]
    text = f"ODC: {option.metadata['help']}"
    if option.default is not None:
        text += f" (ODCConfig's default: {option.default})"
    return dataclasses.field(default=None, metadata={"help": text.replace("%", "%%")})  # argparse expands % in help


@dataclasses.dataclass
class ODCArguments:
    """The ``odc_*`` fields, mixed into an arguments dataclass; each ``None`` = not set (see the module docstring)."""

    # how ODC runs and balances
    odc_enabled: bool | None = odc_field("enabled")
    odc_balance: str | None = odc_field("balance")
    odc_cost_model: str | None = odc_field("cost_model")
    odc_max_tokens_per_microbatch: int | None = odc_field("max_tokens_per_microbatch")
    odc_truncate: bool | None = odc_field("truncate")
    # ranks and their shared memory
    odc_timeout_s: float | None = odc_field("timeout_s")
    odc_shm_dir: str | None = odc_field("shm_dir")
    odc_log_timeline: bool | None = odc_field("log_timeline")
    # attention
    odc_attention_shape_bucket: int | None = odc_field("attention_shape_bucket")
    odc_attention_varlen_kernel: bool | None = odc_field("attention_varlen_kernel")
    # the microbatch compute path
    odc_activation_checkpointing: str | None = odc_field("activation_checkpointing")
    odc_device_memory_gib: float | None = odc_field("device_memory_gib")
    odc_kernels: str | None = odc_field("kernels")
    odc_attention: str | None = odc_field("attention")
    odc_grpo_layout: str | None = odc_field("grpo_layout")
    # batch and planning
    odc_global_batch_size: int | None = odc_field("global_batch_size")
    odc_plan_ahead: int | None = odc_field("plan_ahead")
    # the CUDA transport
    odc_cuda_peer_memory: str | None = odc_field("cuda_peer_memory")
    odc_deterministic: bool | None = odc_field("deterministic")

    def __post_init__(self):
        # Ranks sharing a GPU (odc_hf.integrations.launch.shared_gpu): gloo, before the base arguments start torch.distributed
        if hasattr(self, "ddp_backend"):
            self.ddp_backend = shared_gpu.default_ddp_backend(self.ddp_backend)
        post_init = getattr(super(), "__post_init__", None)
        if post_init is not None:
            post_init()


@dataclasses.dataclass
class ODCTrainingArguments(ODCArguments, TrainingArguments):
    """``transformers.TrainingArguments`` plus the ``odc_*`` fields of :class:`ODCArguments`."""


def make_odc_arguments(args_cls: type) -> type:
    """``args_cls`` (any arguments dataclass) plus the ``odc_*`` fields of :class:`ODCArguments`."""
    cls = dataclasses.dataclass(type(f"ODC{args_cls.__name__}", (ODCArguments, args_cls), {"__module__": __name__}))
    cls.__doc__ = f"``{args_cls.__name__}`` plus the ``odc_*`` fields of ``ODCArguments``."
    return cls


def odc_config_from_args(args, environ=None) -> ODCConfig:
    """ODCConfig from ``odc_*`` argument fields (None: not set), the environment and the defaults."""
    overrides = {f.name: getattr(args, PREFIX + f.name, None) for f in dataclasses.fields(ODCConfig)}
    return ODCConfig.from_env(environ, **overrides)


__all__ = ["ODCArguments", "ODCTrainingArguments", "make_odc_arguments", "odc_config_from_args", "odc_field"]
