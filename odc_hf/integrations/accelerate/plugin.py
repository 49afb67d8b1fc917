"""``ODCFSDPPlugin``: accelerate's FSDP plugin with ODC's options next to FSDP's own.

    from odc_hf import ODCAccelerator, ODCConfig, ODCFSDPPlugin

    plugin = ODCFSDPPlugin(odc_config=ODCConfig(timeout_s=120), reshard_after_forward=True)
    accelerator = ODCAccelerator(fsdp_plugin=plugin, mixed_precision="bf16")
    model, optimizer = accelerator.prepare(model, optimizer)       # FSDP2 with the plugin's settings, then ODC

The plugin is how every odc_hf accelerator gets its ODC settings: ``ODCAccelerator`` reads them from it, and the ODC
trainers build their accelerator with one (from ``TrainingArguments.fsdp_config`` and the ``odc_*`` fields / ``ODC_*``
variables). It enforces FSDP2 (``fsdp_version=2``) and, when you name no wrap policy, one FSDP unit per transformer
block (``transformer_based_wrap``, what ``accelerate_configs/odc.yaml`` sets and what odc_hf does on CPU).

Why ``ODCAccelerator`` and not a plain ``accelerate.Accelerator(fsdp_plugin=ODCFSDPPlugin(...))``: accelerate has no
hook after its ``fully_shard``, so only an accelerator that knows ODC can install it in ``prepare()``; and on a CPU-only
host accelerate keeps no FSDP plugin at all (it runs DDP there; odc_hf shards the model itself), so the plugin has to be
held by the accelerator that uses it. A plain ``Accelerator`` given this plugin raises a clear error in ``prepare()``
(on GPUs, where accelerate consults the plugin) instead of silently running FSDP2's collectives without ODC.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import field

import torch
from accelerate.utils import FullyShardedDataParallelPlugin

from odc_hf.config import ODCConfig

_FSDP2_ONLY = (
    "odc_hf needs FSDP2 (its public per-unit communication hooks); got fsdp_version={}: set `fsdp_version: 2` in the "
    "accelerate config (or ODCFSDPPlugin(fsdp_version=2)). FSDP1 is not supported"
)


@dataclasses.dataclass
class ODCFSDPPlugin(FullyShardedDataParallelPlugin):
    """``accelerate.utils.FullyShardedDataParallelPlugin`` (every FSDP field as accelerate documents it) plus
    ``odc_config``. ``fsdp_version`` must be 2 (it is the default here); ``auto_wrap_policy`` defaults to
    ``transformer_based_wrap`` unless ``FSDP_AUTO_WRAP_POLICY`` (set by ``accelerate launch``) names one."""

    odc_config: ODCConfig | None = field(default=None, metadata={"help": (
        "ODC's options (odc_hf.ODCConfig). None: ODCConfig.from_env(), the defaults overridden by ODC_* variables")})  # fmt: skip

    def __post_init__(self):
        requested = self.fsdp_version if self.fsdp_version is not None else os.environ.get("FSDP_VERSION")
        if requested is not None and str(requested) != "2":
            raise ValueError(_FSDP2_ONLY.format(requested))
        self.fsdp_version = 2
        if self.auto_wrap_policy is None and not os.environ.get("FSDP_AUTO_WRAP_POLICY"):
            self.auto_wrap_policy = "transformer_based_wrap"
        if self.odc_config is None:
            self.odc_config = ODCConfig.from_env()
        elif not isinstance(self.odc_config, ODCConfig):
            raise TypeError(f"odc_config must be an odc_hf.ODCConfig, got {type(self.odc_config).__name__}")
        super().__post_init__()
        # set by the accelerator that installs ODC (odc_hf.integrations.accelerate.accelerator.adopt)
        self.installs_odc = False

    def set_auto_wrap_policy(self, model):
        # accelerate calls this in prepare(), right before fully_shard: the last moment to catch an accelerator that
        # would shard with this plugin but never install ODC.
        if not self.installs_odc:
            raise RuntimeError(
                "ODCFSDPPlugin was given to a plain accelerate.Accelerator, which cannot install ODC (accelerate has no "
                "hook after fully_shard): use odc_hf.ODCAccelerator(fsdp_plugin=...) or "
                "odc_hf.prepare(accelerator, model, optimizer)"
            )
        super().set_auto_wrap_policy(model)

    def reduce_in_fp32(self) -> None:
        """Under ODC the reduce-scatter output is a shared zero buffer and gradients live in the fp32 accumulator.

        With ``mixed_precision: bf16`` accelerate sets ``reduce_dtype=bf16``; FSDP then casts our zero output to fp32
        per unit and microbatch, allocating the fp32 gradient shard ODC exists to avoid. fp32 reduction costs no
        precision (the gradients are bf16 values either way) and no NVLink bytes (atomics add fp32 anyway).
        """
        policy = self.mixed_precision_policy
        if policy is not None and getattr(policy, "reduce_dtype", None) not in (None, torch.float32):
            self.mixed_precision_policy = dataclasses.replace(policy, reduce_dtype=torch.float32)


def as_odc_plugin(
    fsdp_plugin: FullyShardedDataParallelPlugin | None = None, odc_config: ODCConfig | None = None
) -> ODCFSDPPlugin:
    """The :class:`ODCFSDPPlugin` for ``fsdp_plugin`` (``None``: a new one; accelerate's own plugin, e.g. the one the
    Trainer builds from ``fsdp_config``: a copy with ODC's options added) and ``odc_config`` (``None``: the plugin's,
    else ``ODCConfig.from_env()``)."""
    if isinstance(fsdp_plugin, ODCFSDPPlugin):
        if odc_config is not None and odc_config != fsdp_plugin.odc_config:
            raise ValueError("give ODC's options once: in ODCFSDPPlugin(odc_config=...) or as odc_config=")
        return fsdp_plugin
    if fsdp_plugin is None:
        return ODCFSDPPlugin(odc_config=odc_config)
    if not isinstance(fsdp_plugin, FullyShardedDataParallelPlugin):
        raise TypeError(f"fsdp_plugin must be accelerate's FSDP plugin, got {type(fsdp_plugin).__name__}")
    if fsdp_plugin.fsdp_version != 2:
        raise ValueError(_FSDP2_ONLY.format(fsdp_plugin.fsdp_version))
    plugin = copy.copy(fsdp_plugin)  # already validated by its own __post_init__: add ODC's fields only
    plugin.__class__ = ODCFSDPPlugin
    plugin.odc_config = odc_config if odc_config is not None else ODCConfig.from_env()
    plugin.installs_odc = False
    return plugin


__all__ = ["ODCFSDPPlugin", "as_odc_plugin"]
