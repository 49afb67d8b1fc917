"""Accelerate integration: an Accelerator whose ``prepare()`` puts ODC on the model it prepares.

    plugin = ODCFSDPPlugin(odc_config=ODCConfig(timeout_s=120))   # FSDP2 options + ODC's (odc_hf.integrations.accelerate.plugin)
    accelerator = ODCAccelerator(fsdp_plugin=plugin, mixed_precision="bf16")
    model, optimizer = accelerator.prepare(model, optimizer)    # FSDP2 (GPU) / fully_shard (CPU), then ODC
    for bundle in loader:                                       # this rank's microbatches of one minibatch
        for micro in bundle:
            accelerator.backward(loss(model, micro) / global_tokens)
        accelerator.odc.finish_minibatch(local_tokens)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()            # ODC publishes the new shards after every step (optimizer hook)
        optimizer.zero_grad()

Every accelerator odc_hf uses holds an :class:`~odc_hf.integrations.accelerate.plugin.ODCFSDPPlugin` (``accelerator.odc_plugin``)
and reads ODC's options from it: ``ODCAccelerator(fsdp_plugin=...)``, the ODC trainers (which build their accelerator
with one) and ``odc_hf.prepare(accelerator, ...)`` alike. Passing the plugin switches accelerate to FSDP2 on GPUs, as
any ``fsdp_plugin`` does; on GPUs accelerate's FSDP2 path shards the model (its unit grouping, tail unit included) and
ODC is installed on the result. On a CPU-only host accelerate ignores FSDP and would wrap the model in DDP, so
ODCAccelerator shards it itself with :func:`odc_hf.fsdp.shard_model` (the same grouping) and skips the DDP wrap: the
real ODC path runs on laptops and in CI. HSDP (``ParallelismConfig(dp_replicate_size=R, dp_shard_size=S)``, or
``parallelism_config`` in the accelerate YAML) shards over the same ``(replicate, shard)`` mesh on both paths
(:mod:`odc_hf.integrations.accelerate.parallelism`).
"""

from __future__ import annotations

import logging

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from odc_hf.config import ODCConfig
from odc_hf.fsdp import ODCHandle, install_odc, is_sharded, shard_model, sum_reduction
from odc_hf.fsdp.sharding import gather_head_with_final_norm
from odc_hf.integrations.accelerate import parallelism
from odc_hf.integrations.accelerate.plugin import ODCFSDPPlugin, as_odc_plugin
from odc_hf.integrations.accelerate.refusals import (
    check_cpu_ranks_have_no_gpu_to_pick,
    check_launch_before_accelerate,
    check_not_quantized,
    check_optimizer,
    check_shared_gpu_state_dict,
    check_supported,
    check_world_matches_launch,
    refuse_other_engines,
)
from odc_hf.integrations.launch import shared_gpu
from odc_hf.version import warn_if_untested

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


    # The mesh (data parallel only, 1-D or HSDP's 2-D, shard groups within a node) was checked by adopt().


class ODCAccelerator(Accelerator):
    """``accelerate.Accelerator`` that installs ODC in :meth:`prepare`; ``self.odc`` is the handle afterwards.

    ``fsdp_plugin``: an :class:`~odc_hf.integrations.accelerate.plugin.ODCFSDPPlugin` (FSDP2's options and ``odc_config``), or
    accelerate's own plugin (ODC's options are then added from ``odc_config``), or ``None`` (a new ODCFSDPPlugin).
    ``odc_config`` is a shorthand for ``fsdp_plugin=ODCFSDPPlugin(odc_config=...)``; ``None``: the plugin's, else
    ``ODCConfig.from_env()``. Every other argument is accelerate's.
    """

    def __init__(self, *args, fsdp_plugin=None, odc_config: ODCConfig | None = None, **kwargs):
        check_launch_before_accelerate()
        check_cpu_ranks_have_no_gpu_to_pick(use_cpu=bool(kwargs.get("cpu", False)))
        if not kwargs.get("cpu", False):
            shared_gpu.init_process_group()  # ranks sharing a GPU: gloo, before accelerate would start NCCL
        refuse_other_engines(kwargs.get("deepspeed_plugin"), kwargs.get("megatron_lm_plugin"))
        plugin = as_odc_plugin(fsdp_plugin, odc_config)
        held = parallelism.take(kwargs.get("parallelism_config"), cpu=kwargs.get("cpu", False))
        if held is not None:  # accelerate refuses it on CPU: odc_hf holds it (parallelism.py)
            kwargs["parallelism_config"] = None
        with parallelism.hidden_from_accelerate(held is not None):
            super().__init__(*args, fsdp_plugin=plugin, **kwargs)
        adopt(self, plugin, parallelism_config=held)

    @property
    def odc_config(self) -> ODCConfig:
        """ODC's options: the ones the accelerator's :class:`ODCFSDPPlugin` carries."""
        return self.odc_plugin.odc_config

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
            for optimizer in _optimizers(args):
                check_optimizer(optimizer)
        if getattr(self, "odc", None) is not None:
            if model is not self.odc.model:
                raise ValueError("ODCAccelerator already prepared a model with ODC; it takes one model per process")
            # Prepared again (a second train() of the same trainer): the model stays as ODC holds it, as accelerate
            # returns an FSDP2 module as it is; a new optimizer publishes after its steps too.
            prepared = super().prepare(*args, device_placement=device_placement)
            self._odc_attach_optimizers(prepared if isinstance(prepared, (tuple, list)) else (prepared,))
            return prepared
        if config.enabled:
            check_not_quantized(model)
            self.odc_plugin.reduce_in_fp32()
        if self.distributed_type != DistributedType.FSDP and not is_sharded(model):
            # CPU: accelerate would use DDP; shard it ourselves, with accelerate's unit grouping.
            names = {id(p): n for n, p in model.named_parameters()}
            model.to(self.device)
            shard_model(model, mesh=parallelism.fsdp_mesh(self))  # HSDP: the (replicate, shard) mesh
            for opt in args:
                if isinstance(opt, torch.optim.Optimizer):
                    _remap_optimizer(opt, names, model)
        prepared = super().prepare(*args, device_placement=device_placement)
        result = tuple(prepared) if isinstance(prepared, (tuple, list)) else (prepared,)
        prepared_model = next(r for r in result if isinstance(r, torch.nn.Module))
        # accelerate's FSDP2 path misses the final norm of a PeftModel: an untied lm_head sits alone in its unit
        gather_head_with_final_norm(prepared_model)
        if not config.enabled:
            # The collective baseline: plain FSDP2, but with ODC's SUM semantics (the loss carries the global
            # normaliser), so that both modes train identically.
            sum_reduction(prepared_model)
            return prepared
        self.odc = install_odc(prepared_model, timeout_s=config.timeout_s, shm_dir=config.shm_dir,
                               peer_memory=config.cuda_peer_memory, deterministic=config.deterministic)  # fmt: skip
        self._odc_attach_optimizers(result)
        logger.info(
            "odc_hf: ODC installed on %d units across %d ranks (mesh %s)", len(self.odc.units), self.num_processes,
            self.odc.topology.describe(),
        )  # fmt: skip
        return prepared

    def _odc_attach_optimizers(self, prepared) -> None:
        """ODC publishes the shards after every step of each optimizer among ``prepared``: the torch optimizer inside
        accelerate's wrappers (a second prepare wraps its own wrapper again)."""
        for optimizer in _optimizers(prepared):
            self.odc.attach_optimizer(optimizer)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """Under ODC: the norm from the local gradient shards, summed at ODC's barrier, and the shards scaled in place
        (:func:`odc_hf.fsdp.gradients.clip_grad_norm_`), instead of accelerate's reduction through
        ``DTensor.full_tensor()`` (a functional collective; it crashes on gloo with CUDA tensors). Other
        parameters than the ODC model's: accelerate's own."""
        parameters = list(parameters)
        odc = getattr(self, "odc", None)
        if odc is None or not parameters or not _belongs_to(odc.model, parameters):
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        self.unscale_gradients()
        return odc.clip_grad_norm_(parameters, max_norm, norm_type)

    def get_state_dict(self, model, unwrap=True):
        """With ranks sharing a GPU: the full state dict gathered through CPU tensors on the main process (empty
        elsewhere), as accelerate's FSDP2 path returns it, without ``full_tensor()`` on CUDA tensors over gloo."""
        if shared_gpu.active() and is_sharded(model):
            from odc_hf.fsdp.state_dict import full_state_dict

            return full_state_dict(model, rank0_only=True)
        return super().get_state_dict(model, unwrap=unwrap)

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if self.distributed_type != DistributedType.FSDP and is_sharded(model):
            # Already sharded by us (CPU path): no DDP on top of FSDP2.
            return super().prepare_model(model, device_placement=False, evaluation_mode=True)
        return super().prepare_model(
            model, device_placement=device_placement, evaluation_mode=evaluation_mode
        )


def _optimizers(objects) -> list[torch.optim.Optimizer]:
    """The torch optimizers among ``objects``, each taken out of accelerate's wrappers."""
    found = []
    for inner in objects:
        while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
            inner = inner.optimizer
        if isinstance(inner, torch.optim.Optimizer):
            found.append(inner)
    return found


def _belongs_to(model: torch.nn.Module, parameters: list) -> bool:
    # read anew each time: FSDP2 registers other parameter objects on a module while it is gathered
    ids = {id(p) for p in model.parameters()}
    return all(id(p) in ids for p in parameters)


_adopted = 0


def accelerators_adopted() -> int:
    """How many accelerators this process set up for ODC (:func:`adopt`: the ODC trainers, :class:`ODCAccelerator`,
    :func:`prepare`); ``python -m odc_hf.run`` says when its target set up none."""
    return _adopted


def adopt(
    accelerator: Accelerator,
    plugin: ODCFSDPPlugin | None = None,
    *,
    odc_config: ODCConfig | None = None,
    parallelism_config: parallelism.ParallelismConfig | None = None,
) -> ODCAccelerator:
    """Turn an existing Accelerator (e.g. the one a ``Trainer`` built) into an :class:`ODCAccelerator` holding ``plugin``.

    ``plugin`` ``None``: the accelerator's own FSDP plugin (accelerate keeps one on FSDP launches) with ODC's options
    added, else a new :class:`ODCFSDPPlugin`; ``odc_config`` as in :func:`as_odc_plugin`. Only the class changes
    (ODCAccelerator adds no state beyond ``odc_plugin`` and ``odc``), so every setting the owner gave it stays. Call it
    before ``prepare``. ``parallelism_config``: on a CPU host, the ``ParallelismConfig`` odc_hf kept away from
    accelerate's constructor (:mod:`odc_hf.integrations.accelerate.parallelism`); its mesh is built here (a collective).
    """
    global _adopted
    warn_if_untested("torch", "accelerate")
    _adopted += 1
    if parallelism_config is not None:
        parallelism.hold_on_cpu(accelerator, parallelism_config)
    parallelism.check_topology(accelerator.parallelism_config, accelerator.num_processes)
    state_plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None:
        plugin = as_odc_plugin(getattr(accelerator, "odc_plugin", None) or state_plugin, odc_config)
        if state_plugin is not None and plugin is not state_plugin:
            accelerator.state.fsdp_plugin = plugin  # accelerate's FSDP path reads the plugin from its state
    elif state_plugin is not None and state_plugin is not plugin:
        raise ValueError(
            "accelerate's state already holds another FSDP plugin (an Accelerator was created earlier in this "
            "process): create the ODC accelerator first, or pass that plugin"
        )
    if not isinstance(accelerator, ODCAccelerator):
        accelerator.__class__ = ODCAccelerator
    plugin.installs_odc = True
    accelerator.odc_plugin = plugin
    accelerator.odc: ODCHandle | None = None
    check_world_matches_launch(accelerator)
    shared_gpu.settle_process_group()  # gloo where ranks share a GPU; accelerate's state names the group's backend
    check_shared_gpu_state_dict(accelerator)
    if accelerator.num_processes < 2 and plugin.odc_config.enabled and accelerator.is_main_process:
        logger.warning("odc_hf: a single process has nothing to communicate; training runs without ODC")
    return accelerator


def prepare(accelerator: Accelerator, *args, odc_config: ODCConfig | None = None):
    """``odc_hf.prepare(accelerator, model, optimizer, ...)``: for loops that already own an Accelerator.

    ODC's options: ``odc_config``, else the :class:`ODCFSDPPlugin` accelerate holds (FSDP launches on GPUs), else
    ``ODC_*`` variables. On a CPU-only host accelerate drops any ``fsdp_plugin``: there, build the accelerator as
    ``ODCAccelerator(fsdp_plugin=...)`` to use a plugin's options.
    """
    return adopt(accelerator, odc_config=odc_config).prepare(*args)
