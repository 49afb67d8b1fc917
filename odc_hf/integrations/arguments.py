"""ODC options as trainer arguments: ``odc_*`` fields on ``ODCTrainingArguments`` (here), ``ODCSFTConfig`` and
``ODCGRPOConfig`` (``odc_hf.integrations.sft_config``, ``odc_hf.integrations.grpo_config``).

They are the knobs of :class:`odc_hf.ODCConfig`, one ``odc_<field>`` per field, written out in :class:`ODCArguments`
so that argument parsers (``HfArgumentParser`` / ``TrlParser``: ``--odc_balance`` ...), ``--help`` and IDEs show them;
``tests/test_trainer_arguments.py`` keeps the two in step. A field left at ``None`` (not set) falls back to the
``ODC_*`` environment variable, then to ODCConfig's default; an explicit ``odc_config=`` passed to the trainer wins
over all of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field

from transformers import TrainingArguments

from odc_hf.config import ODCConfig
from odc_hf.integrations import shared_gpu

PREFIX = "odc_"


@dataclasses.dataclass
class ODCArguments:
    """The ``odc_*`` fields, mixed into an arguments dataclass; each ``None`` = not set (see the module docstring)."""

    odc_enabled: bool | None = field(default=None, metadata={"help": (
        "ODC: use On-Demand Communication (one-sided gathers / scatter-accumulates, one synchronisation per "
        "minibatch); false runs plain FSDP2 collectives on the same data path (default true)")})  # fmt: skip
    odc_balance: str | None = field(default=None, metadata={"help": (
        "ODC: how each global minibatch is split over ranks: lb_mini (equal estimated compute, any number of "
        "microbatches per rank; needs ODC), lb_micro (equal microbatch counts) or none (default lb_mini)")})  # fmt: skip
    odc_cost_model: str | None = field(default=None, metadata={"help": (
        "ODC: how a sample's compute is estimated from its length: flop, tokens, or a calibration .json "
        "(default flop)")})  # fmt: skip
    odc_max_tokens_per_microbatch: int | None = field(default=None, metadata={"help": (
        "ODC: token budget of one microbatch (the memory bound); unset: the smallest budget that holds the "
        "worst-case microbatch of the trainer's layout (docs/configuration.md)")})  # fmt: skip
    odc_truncate: bool | None = field(default=None, metadata={"help": (
        "ODC: cut samples longer than the budget instead of raising (default false)")})  # fmt: skip
    odc_timeout_s: float | None = field(default=None, metadata={"help": (
        "ODC: seconds a rank waits for its peers at the minibatch barrier before an error naming them "
        "(default 600)")})  # fmt: skip
    odc_shm_dir: str | None = field(default=None, metadata={"help": (
        "ODC: directory of the shared-memory files (default /dev/shm, or the temp directory when it is too small)")})  # fmt: skip
    odc_log_timeline: bool | None = field(default=None, metadata={"help": (
        "ODC: write odc_timeline.png (per-rank busy/idle per step) to the output directory (default true)")})  # fmt: skip
    odc_attention_shape_bucket: int | None = field(default=None, metadata={"help": (
        "ODC: for attn_implementation=sdpa_varlen, pad each document's attention inputs to a multiple of this many "
        "tokens so cuDNN plans few shapes; 0: exact shapes (default 1024)")})  # fmt: skip
    odc_attention_varlen_kernel: bool | None = field(default=None, metadata={"help": (
        "ODC: for attn_implementation=sdpa_varlen on CUDA, one flash-varlen call per layer instead of one SDPA "
        "call per document (default false)")})  # fmt: skip
    odc_activation_checkpointing: str | None = field(default=None, metadata={"help": (
        "ODC: which decoder layers recompute activations in backward: auto (the least recomputation whose predicted "
        "peak memory fits the GPU at the token budget; none on CPU), full, none, or a fraction such as 0.5 "
        "(default auto)")})  # fmt: skip
    odc_device_memory_gib: float | None = field(default=None, metadata={"help": (
        "ODC: the device memory activation_checkpointing=auto plans against, in GiB (default: the GPU's total)")})  # fmt: skip
    odc_kernels: str | None = field(default=None, metadata={"help": (
        "ODC: Liger's Triton layer kernels: auto (when liger-kernel is installed and training runs on CUDA), "
        "liger (required), none (default auto)")})  # fmt: skip
    odc_attention: str | None = field(default=None, metadata={"help": (
        "ODC: the model's attention: auto (flash_attention_4 where it runs: installed, CUDA capability >= 9.0, "
        "bf16/fp16; else sdpa_varlen; a model on an implementation its user chose keeps it), flash_attention_4, "
        "sdpa_varlen, or model (leave the model's own) (default auto)")})  # fmt: skip
    odc_grpo_layout: str | None = field(default=None, metadata={"help": (
        "ODC: GRPO training microbatches: packed (sequences back to back, no padding), padded (TRL's layout) or "
        "auto (packed under flash attention, and under sdpa_varlen off CUDA) (default auto)")})  # fmt: skip
    odc_global_batch_size: int | None = field(default=None, metadata={"help": (
        "ODC: samples per optimizer step, all ranks together; unset: per_device_train_batch_size x "
        "gradient_accumulation_steps x processes. Set it to resume on a different number of GPUs with the same "
        "batch (SFT / Trainer only)")})  # fmt: skip
    odc_plan_ahead: int | None = field(default=None, metadata={"help": (
        "ODC: optimizer steps planned ahead in a background thread of the data loader, so planning overlaps "
        "training (0: plan when asked; default 0)")})  # fmt: skip
    odc_cuda_peer_memory: str | None = field(default=None, metadata={"help": (
        "ODC: how the CUDA transport maps peers' buffers: auto (torch symmetric memory with one GPU per rank, CUDA "
        "IPC when ranks share a GPU), symmetric_memory or ipc (default auto)")})  # fmt: skip
    odc_deterministic: bool | None = field(default=None, metadata={"help": (
        "ODC: bit-identical gradient accumulation on CUDA (one fp32 slot per sender, summed in rank order; "
        "world_size times the accumulator memory) instead of atomics (default false)")})  # fmt: skip

    def __post_init__(self):
        # Ranks sharing a GPU (odc_hf.integrations.shared_gpu): gloo, before the base arguments start torch.distributed
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


__all__ = ["ODCArguments", "ODCTrainingArguments", "make_odc_arguments", "odc_config_from_args"]
