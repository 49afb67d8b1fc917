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
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from odc_hf.config import ODCConfig
from odc_hf.fsdp import ODCHandle, install_odc, is_sharded, shard_model, sum_reduction
from odc_hf.fsdp.sharding import gather_head_with_final_norm
from odc_hf.integrations.accelerate import parallelism
from odc_hf.integrations.accelerate.launch_config import check_launch_config
from odc_hf.integrations.accelerate.plugin import ODCFSDPPlugin, as_odc_plugin, refuse_other_engines
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
            "config (accelerate_configs/odc.yaml), or build the accelerator as odc_hf.ODCAccelerator (its "
            "ODCFSDPPlugin switches accelerate to FSDP2)"
        )
    # The mesh (data parallel only, 1-D or HSDP's 2-D, shard groups within a node) was checked by adopt().


def check_launch_before_accelerate(environ=None) -> None:
    """Refuse, before accelerate builds its Accelerator, what accelerate would reject with a message that does not
    mention ODC: an FSDP1 accelerate config (on a CPU-only host accelerate's FSDP1 plugin raises "There are currently
    no available devices found" before odc_hf's own FSDP2 check could run)."""
    environ = os.environ if environ is None else environ
    check_launch_config(environ)  # odc_* keys in the launch YAML's fsdp_config, which accelerate drops silently
    if environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true", "yes") and environ.get("FSDP_VERSION") == "1":
        raise ValueError(
            "odc_hf needs FSDP2: set `fsdp_version: 2` in the accelerate config's fsdp_config (found fsdp_version: 1; "
            "FSDP1 is not supported). accelerate_configs/odc.yaml is a working GPU config; on a CPU-only host use "
            "accelerate_configs/cpu.yaml with ACCELERATE_USE_CPU=true"
        )


def check_cpu_ranks_have_no_gpu_to_pick(use_cpu: bool = False, environ=None) -> None:
    """Refuse CPU ranks that would pick a CUDA device that does not exist, before anything synchronises.

    accelerate's ``wait_for_everyone`` calls ``torch.distributed.barrier(device_ids=[local_rank])`` on CPU ranks too,
    and torch then places the barrier's tensor on ``cuda:<local_rank>`` whenever CUDA is visible: on a machine with
    one GPU, rank 1 of a 2-process CPU run fails there with "CUDA error: invalid device ordinal" (inside TRL's dataset
    preparation). ``python examples/sft.py`` hides CUDA from CPU ranks
    (``odc_hf.integrations.launch.relaunch.plan_launch``); a launch of ``accelerate_configs/cpu.yaml`` by hand must do the
    same."""
    environ = os.environ if environ is None else environ
    cpu = use_cpu or environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes")
    local_rank = environ.get("LOCAL_RANK", "")
    if not cpu or not local_rank.isdigit() or not torch.cuda.is_available():
        return
    gpus = torch.cuda.device_count()
    if int(local_rank) >= gpus:
        raise RuntimeError(
            f"CPU rank {local_rank} sees {gpus} CUDA device(s): accelerate's barrier would place a tensor on "
            f"cuda:{local_rank}, which does not exist ('invalid device ordinal'). Hide the GPUs from CPU ranks: "
            "`CUDA_VISIBLE_DEVICES= ACCELERATE_USE_CPU=true accelerate launch --config_file accelerate_configs/cpu.yaml "
            "...` (python examples/sft.py does this itself), or train on your GPU with one process "
            "(python examples/sft.py --num_processes 1; docs/quickstart.md, \"One GPU\")"
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


def check_not_quantized(model: torch.nn.Module) -> None:
    """Refuse a quantized base model (QLoRA: bitsandbytes 4/8-bit, or any transformers quantizer) under ODC.

    ODC publishes each unit's shards and gathers them by bytes; quantized weights carry their scales and layout in
    tensor subclasses and quantizer state that the FSDP2 adapter does not know, and no test covers them. LoRA on an
    unquantized (bf16) base is supported.
    """
    quantizer = getattr(model, "hf_quantizer", None)  # a PeftModel forwards the lookup to its base model
    integer = sorted({str(p.dtype) for p in model.parameters() if not p.dtype.is_floating_point})
    if quantizer is not None or integer:
        found = type(quantizer).__name__ if quantizer is not None else f"{', '.join(integer)} parameters"
        raise NotImplementedError(
            f"odc_hf does not support quantized base models under ODC (QLoRA; found {found}): load the base model "
            "unquantized (e.g. dtype=torch.bfloat16) and train LoRA on it, or set ODCConfig(enabled=False) to run "
            "plain FSDP2 collectives"
        )


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
        if self.odc is not None:
            raise ValueError("ODCAccelerator already prepared a model with ODC")
        self.odc = install_odc(prepared_model, timeout_s=config.timeout_s, shm_dir=config.shm_dir,
                               peer_memory=config.cuda_peer_memory, deterministic=config.deterministic)  # fmt: skip
        for r in result:
            inner = getattr(r, "optimizer", r)
            if isinstance(inner, torch.optim.Optimizer):
                self.odc.attach_optimizer(inner)
        logger.info(
            "odc_hf: ODC installed on %d units across %d ranks (mesh %s)", len(self.odc.units), self.num_processes,
            self.odc.topology.describe(),
        )  # fmt: skip
        return prepared

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


def _belongs_to(model: torch.nn.Module, parameters: list) -> bool:
    ids = getattr(model, "_odc_param_ids", None)
    if ids is None:
        ids = frozenset(id(p) for p in model.parameters())
        model._odc_param_ids = ids
    return all(id(p) in ids for p in parameters)


def fsdp_state_dict_type(accelerator: Accelerator) -> str:
    """How accelerate's FSDP plugin saves state dicts (``"StateDictType.SHARDED_STATE_DICT"``, ...), "" without one."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return str(getattr(plugin, "state_dict_type", "") or "")


def check_shared_gpu_state_dict(accelerator: Accelerator) -> None:
    """Ranks sharing a GPU cannot write FULL_STATE_DICT checkpoints (accelerate gathers them with
    ``full_tensor()``, a functional collective that crashes on gloo with CUDA tensors): refuse before training."""
    if shared_gpu.active() and "FULL_STATE_DICT" in fsdp_state_dict_type(accelerator):
        raise ValueError(
            f"odc_hf: {shared_gpu.describe()}; FULL_STATE_DICT checkpoints are not supported there (accelerate "
            "gathers them with DTensor.full_tensor(), which crashes on gloo with CUDA tensors): set "
            "fsdp_state_dict_type: SHARDED_STATE_DICT (accelerate_configs/odc.yaml does)"
        )


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
    warn_if_untested("torch", "accelerate")
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
