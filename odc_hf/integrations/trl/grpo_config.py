"""``ODCGRPOConfig``: TRL's ``GRPOConfig`` with the ``odc_*`` fields of
:class:`~odc_hf.integrations.trainer.arguments.ODCArguments`, for ``ODCGRPOTrainer`` (``TrlParser`` shows its ``--odc_*``
options); and what ``ODCGRPOTrainer`` refuses of a ``GRPOConfig`` (:func:`refusals`), checked before TRL builds
anything (a vLLM engine takes tens of seconds).
"""

from __future__ import annotations

import dataclasses

from trl import GRPOConfig

from odc_hf.integrations.launch.cuda_allocator import prefer_expandable_segments
from odc_hf.integrations.trainer.arguments import ODCArguments
from odc_hf.integrations.trl.grpo_batch import SUPPORTED_LOSS_TYPES
from odc_hf.integrations.upstream.deprecations import quiet_upstream_deprecations
from odc_hf.integrations.upstream.vllm import check_vllm, prefer_vllm_environment
from odc_hf.integrations.vllm.weights import LoraMerge


@dataclasses.dataclass
class ODCGRPOConfig(ODCArguments, GRPOConfig):
    """``trl.GRPOConfig`` plus the ``odc_*`` fields of :class:`ODCArguments`."""

    def __post_init__(self):
        prefer_expandable_segments()  # before the arguments start CUDA (``self.device``): see cuda_allocator
        if self.use_vllm:  # before anything imports and starts vLLM: see vllm_version
            prefer_vllm_environment()
        with quiet_upstream_deprecations():
            super().__post_init__()


def refusals(args, grad_accum: int) -> list[str]:
    """What ODCGRPOTrainer refuses, from the training arguments alone (checked before TRL builds anything)."""
    refuse = []
    if args.loss_type not in SUPPORTED_LOSS_TYPES:
        refuse.append(f"loss_type={args.loss_type!r} (supported: {', '.join(SUPPORTED_LOSS_TYPES)})")
    if args.loss_type == "vespo" and args.use_vllm and args.vllm_importance_sampling_correction and (
        args.vllm_importance_sampling_mode.startswith("token")
        and not _admits_one(args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max)
    ):
        refuse.append(
            "loss_type='vespo' with a token-level vLLM importance ratio whose bounds exclude 1 "
            f"(vllm_importance_sampling_clip_min={args.vllm_importance_sampling_clip_min}, clip_max="
            f"{args.vllm_importance_sampling_clip_max}): TRL's vespo weights then depend on how many padding columns "
            "its microbatch has, which ODC's microbatches do not reproduce; use bounds around 1 or a sequence-level mode"
        )
    if args.steps_per_generation % grad_accum:
        refuse.append(
            f"steps_per_generation={args.steps_per_generation}, not a multiple of gradient_accumulation_steps="
            f"{grad_accum} (an optimizer step of TRL's would then span two generation batches; ODC trains a "
            "generation batch in whole optimizer steps)"
        )
    if args.use_vllm and args.vllm_mode != "colocate":
        refuse.append(
            f"vllm_mode={args.vllm_mode!r}: a vLLM server generates every rank's prompts from rank 0 and "
            "broadcasts the completions (all ranks wait for all), and takes its weights from rank 0 after a "
            "full_tensor() collective per parameter: nothing of ODC's one-sided path remains. Use "
            "vllm_mode='colocate': each rank generates on its own engine, its weights read from ODC's "
            "published shards (vllm_gpu_memory_utilization sets the engine's share of the GPU)"
        )
    if args.use_vllm and args.vllm_tensor_parallel_size != 1:
        refuse.append(
            f"vllm_tensor_parallel_size={args.vllm_tensor_parallel_size} (a tensor-parallel engine group "
            "generates its ranks' prompts together, in lockstep; untested with ODC): use "
            "vllm_tensor_parallel_size=1"
        )
    return refuse


def _admits_one(low: float | None, high: float | None) -> bool:
    """Whether a ratio of 1 (TRL's importance ratio in its padding columns) lies within the bounds."""
    return (low is None or low <= 1.0) and (high is None or high >= 1.0)


def check_arguments(args, grad_accum: int, peft_config=None) -> None:
    """Before TRL builds the trainer (a vLLM engine takes tens of seconds): the refusals, vLLM's version, the
    environment vLLM needs (odc_hf/integrations/upstream/vllm.py)."""
    refuse = refusals(args, grad_accum)
    if refuse:
        raise ValueError("ODCGRPOTrainer does not support " + "; ".join(refuse))
    if args.use_vllm:
        check_vllm()
        prefer_vllm_environment()
        if peft_config is not None:
            LoraMerge.from_config(peft_config)  # refuses adapters the weight sync cannot merge


__all__ = ["ODCGRPOConfig", "check_arguments", "refusals"]
