"""Accelerate integration: an Accelerator whose ``prepare()`` puts ODC on the model it prepares.

    accelerator = ODCAccelerator(odc_config=ODCConfig(), mixed_precision="bf16")   # launched with odc.yaml
    model, optimizer = accelerator.prepare(model, optimizer)    # FSDP2 (GPU) / fully_shard (CPU), then ODC
    for bundle in loader:                                       # this rank's microbatches of one minibatch
        for micro in bundle:
            accelerator.backward(loss(model, micro) / global_tokens)
        accelerator.odc.finish_minibatch(local_tokens)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()            # ODC publishes the new shards after every step (optimizer hook)
        optimizer.zero_grad()

On GPUs accelerate's FSDP2 path shards the model (its unit grouping, tail unit included) and ODC is installed
on the result. On a CPU-only host accelerate ignores FSDP and would wrap the model in DDP, so ODCAccelerator
shards it itself with :func:`odc_hf.fsdp.shard_model` (the same grouping) and skips the DDP wrap: the real
ODC path runs on laptops and in CI.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from odc_hf.config import ODCConfig
from odc_hf.fsdp import ODCHandle, install_odc, is_sharded, shard_model, sum_reduction

logger = logging.getLogger(__name__)


def _remap_optimizer(
    optimizer: torch.optim.Optimizer, before: dict[int, str], model: torch.nn.Module
) -> None:
    """After ``fully_shard`` replaced the parameters, point the (still empty) optimizer at the new ones."""
    if optimizer.state:
        raise ValueError("the optimizer already has state; prepare() it before its first step")
    after = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [after[before[id(p)]] for p in group["params"]]


def check_supported(accelerator: Accelerator) -> None:
    """Refuse setups ODC cannot serve, with a message that says what to change."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if accelerator.distributed_type == DistributedType.FSDP and getattr(plugin, "fsdp_version", 1) != 2:
        raise ValueError(
            "odc_hf needs FSDP2: set `fsdp_version: 2` in the accelerate config (FSDP1 is not supported)"
        )
    if accelerator.distributed_type in (
        DistributedType.DEEPSPEED,
        DistributedType.MEGATRON_LM,
        DistributedType.XLA,
    ):
        raise ValueError(
            f"odc_hf does not support {accelerator.distributed_type}; use FSDP2 (accelerate_configs/odc.yaml)"
        )
    if accelerator.distributed_type == DistributedType.MULTI_GPU:
        raise ValueError(
            "this accelerate config runs DDP on GPUs; ODC replaces FSDP2's collectives, so launch with an FSDP2 "
            "config (accelerate_configs/odc.yaml)"
        )
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is not None and any(
        getattr(pc, f"{dim}_size", 1) > 1 for dim in ("tp", "cp", "sp", "dp_replicate")
    ):
        raise ValueError(f"odc_hf supports 1-D data-parallel sharding only; got {pc}")


def check_launch_before_accelerate(environ=None) -> None:
    """Refuse, before accelerate builds its Accelerator, what accelerate would reject with a message that does not
    mention ODC: an FSDP1 accelerate config (on a CPU-only host accelerate's FSDP1 plugin raises "There are currently
    no available devices found" before odc_hf's own FSDP2 check could run)."""
    environ = os.environ if environ is None else environ
    if environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true", "yes") and environ.get("FSDP_VERSION") == "1":
        raise ValueError(
            "odc_hf needs FSDP2: set `fsdp_version: 2` in the accelerate config's fsdp_config (found fsdp_version: 1; "
            "FSDP1 is not supported). accelerate_configs/odc.yaml is a working GPU config; on a CPU-only host use "
            "accelerate_configs/cpu.yaml with ACCELERATE_USE_CPU=true"
        )


def check_world_matches_launch(accelerator: Accelerator, environ=None) -> None:
    """Refuse a launch that started several processes which each see a single-process run (e.g. ``accelerate launch
    --config_file accelerate_configs/cpu.yaml`` on a CPU host without ``ACCELERATE_USE_CPU=true``): they would train
    independent copies of the model into the same output directory."""
    environ = os.environ if environ is None else environ
    launched = environ.get("WORLD_SIZE", "")
    if launched.isdigit() and int(launched) > 1 and accelerator.num_processes == 1:
        raise RuntimeError(
            f"{launched} processes were launched (WORLD_SIZE={launched}) but accelerate set up each one as a single "
            "process, so they would train independently. On a CPU-only host set ACCELERATE_USE_CPU=true, e.g. "
            "`ACCELERATE_USE_CPU=true accelerate launch --config_file accelerate_configs/cpu.yaml ...` (that config "
            "takes torchrun's launcher and the variable makes every process a CPU rank); on GPUs launch with an "
            "FSDP2 config (accelerate_configs/odc.yaml)"
        )


def _reduce_in_fp32(accelerator: Accelerator) -> None:
    """Under ODC the reduce-scatter output is a shared zero buffer and gradients live in the fp32 accumulator.

    With ``mixed_precision: bf16`` accelerate sets ``reduce_dtype=bf16``; FSDP then casts our zero output to
    fp32 per unit and microbatch, allocating the fp32 gradient shard ODC exists to avoid. fp32 reduction costs
    no precision (the gradients are bf16 values either way) and no NVLink bytes (atomics add fp32 anyway).
    """
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    policy = getattr(plugin, "mixed_precision_policy", None)
    if policy is not None and getattr(policy, "reduce_dtype", None) not in (None, torch.float32):
        plugin.mixed_precision_policy = dataclasses.replace(policy, reduce_dtype=torch.float32)


class ODCAccelerator(Accelerator):
    """``accelerate.Accelerator`` that installs ODC in :meth:`prepare`; ``self.odc`` is the handle afterwards."""

    def __init__(self, *args, odc_config: ODCConfig | None = None, **kwargs):
        check_launch_before_accelerate()
        super().__init__(*args, **kwargs)
        adopt(self, odc_config)

    def prepare(self, *args, device_placement=None):
        models = [a for a in args if isinstance(a, torch.nn.Module)]
        config: ODCConfig = self.odc_config
        if not models or self.num_processes < 2:
            return super().prepare(*args, device_placement=device_placement)
        if len(models) > 1:
            raise ValueError("ODCAccelerator.prepare takes one model at a time")
        check_supported(self)
        model = models[0]
        if config.enabled:
            _reduce_in_fp32(self)
        if self.distributed_type != DistributedType.FSDP and not is_sharded(model):
            # CPU: accelerate would use DDP; shard it ourselves, with accelerate's unit grouping.
            names = {id(p): n for n, p in model.named_parameters()}
            model.to(self.device)
            shard_model(model)
            for opt in args:
                if isinstance(opt, torch.optim.Optimizer):
                    _remap_optimizer(opt, names, model)
        prepared = super().prepare(*args, device_placement=device_placement)
        result = tuple(prepared) if isinstance(prepared, (tuple, list)) else (prepared,)
        prepared_model = next(r for r in result if isinstance(r, torch.nn.Module))
        if not config.enabled:
            # The collective baseline: plain FSDP2, but with ODC's SUM semantics (the loss carries the global
            # normaliser), so that both modes train identically.
            sum_reduction(prepared_model)
            return prepared
        if self.odc is not None:
            raise ValueError("ODCAccelerator already prepared a model with ODC")
        self.odc = install_odc(prepared_model, timeout_s=config.timeout_s, shm_dir=config.shm_dir)
        for r in result:
            inner = getattr(r, "optimizer", r)
            if isinstance(inner, torch.optim.Optimizer):
                self.odc.attach_optimizer(inner)
        logger.info(
            "odc_hf: ODC installed on %d units across %d ranks", len(self.odc.units), self.num_processes
        )
        return prepared

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if self.distributed_type != DistributedType.FSDP and is_sharded(model):
            # Already sharded by us (CPU path): no DDP on top of FSDP2.
            return super().prepare_model(model, device_placement=False, evaluation_mode=True)
        return super().prepare_model(
            model, device_placement=device_placement, evaluation_mode=evaluation_mode
        )


def adopt(accelerator: Accelerator, config: ODCConfig | None = None) -> ODCAccelerator:
    """Turn an existing Accelerator (e.g. the one a ``Trainer`` built) into an :class:`ODCAccelerator`.

    Only the class changes (ODCAccelerator adds no state beyond ``odc_config`` and ``odc``), so every setting
    the owner gave it stays. Call it before ``prepare``.
    """
    if not isinstance(accelerator, ODCAccelerator):
        accelerator.__class__ = ODCAccelerator
    accelerator.odc_config = config if config is not None else ODCConfig.from_env()
    accelerator.odc: ODCHandle | None = None
    check_world_matches_launch(accelerator)
    if accelerator.num_processes < 2 and accelerator.odc_config.enabled and accelerator.is_main_process:
        logger.warning("odc_hf: a single process has nothing to communicate; training runs without ODC")
    return accelerator


def prepare(accelerator: Accelerator, *args, odc_config: ODCConfig | None = None):
    """``odc_hf.prepare(accelerator, model, optimizer, ...)``: for loops that already own an Accelerator."""
    return adopt(accelerator, odc_config).prepare(*args)
