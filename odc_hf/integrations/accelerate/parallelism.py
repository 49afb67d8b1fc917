"""Hybrid sharding (HSDP) under accelerate: the ``(replicate, shard)`` mesh from a ``ParallelismConfig``, and the
topology checks that refuse what ODC cannot run, before any model is sharded.

    # accelerate launch with `parallelism_config` in the YAML (accelerate_configs/odc_hsdp.yaml), or in Python:
    accelerator = ODCAccelerator(parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=8))

On GPUs accelerate builds the device mesh and hands ``mesh[("dp_replicate", "dp_shard_cp")]`` to ``fully_shard``
(``accelerate.utils.fsdp_utils.fsdp2_prepare_model``); ODC then runs over the shard dim. On a CPU-only host
accelerate 1.15 refuses any ``ParallelismConfig`` (``ParallelismConfig._validate_accelerator`` accepts FSDP2 and
multi-GPU-like types, not MULTI_CPU) and ignores FSDP: there odc_hf keeps the config away from accelerate's
constructor, then builds the same mesh (``ParallelismConfig.get_device_mesh("cpu")``) and puts config and mesh in
the accelerator's state, so that ``accelerator.parallelism_config`` / ``torch_device_mesh`` read as on GPUs and
:func:`fsdp_mesh` gives ``odc_hf.fsdp.shard_model`` the same 2-D mesh accelerate would give ``fully_shard``.

The data-parallel world is all ``dp_replicate x dp_shard`` ranks: every rank draws its own share of each global
minibatch (``ODCBatchSampler`` over ``num_processes`` ranks, rank = ``process_index``); only the gradient exchange
is hierarchical.
"""

from __future__ import annotations

import contextlib
import os

import torch
from accelerate import Accelerator
from accelerate.parallelism_config import ParallelismConfig

# set by `accelerate launch` when the YAML has a parallelism_config section
_USE_VARIABLE = "ACCELERATE_USE_PARALLELISM_CONFIG"
_HSDP_CONFIG = "accelerate_configs/odc_hsdp.yaml"


def requested(given: ParallelismConfig | None = None) -> ParallelismConfig | None:
    """The ``ParallelismConfig`` accelerate's constructor would use: ``given``, else one built from the launcher's
    ``PARALLELISM_CONFIG_*`` variables when ``accelerate launch`` read a ``parallelism_config`` section."""
    if given is not None:
        return given
    if os.environ.get(_USE_VARIABLE, "false").lower() == "true":
        return ParallelismConfig()
    return None


def cpu_host(cpu: bool = False) -> bool:
    """Whether accelerate will run this process as a CPU rank (``cpu=True``, ``ACCELERATE_USE_CPU``, or no GPU)."""
    return (
        cpu
        or os.environ.get("ACCELERATE_USE_CPU", "false").lower() == "true"
        or not torch.cuda.is_available()
    )


def take(given: ParallelismConfig | None = None, *, cpu: bool = False) -> ParallelismConfig | None:
    """Before an ``Accelerator`` is built: check the requested mesh (:func:`check_topology`, with the launcher's
    ``WORLD_SIZE``) and return the ``ParallelismConfig`` odc_hf must hold itself, on a CPU host; ``None`` on GPUs
    (accelerate builds the mesh) or without one. Pass it to ``adopt(..., parallelism_config=)``."""
    config = requested(given)
    check_topology(config, int(os.environ.get("WORLD_SIZE", "1")))
    return config if config is not None and cpu_host(cpu) else None


@contextlib.contextmanager
def hidden_from_accelerate(active: bool):
    """While an ``Accelerator`` is constructed on a CPU host: keep accelerate from building its own
    ``ParallelismConfig`` from the launcher's variables (it would refuse it on MULTI_CPU). odc_hf holds it instead
    (:func:`hold_on_cpu`). Restores the variable afterwards."""
    previous = os.environ.get(_USE_VARIABLE)
    if active and previous is not None:
        os.environ[_USE_VARIABLE] = "false"
    try:
        yield
    finally:
        if active and previous is not None:
            os.environ[_USE_VARIABLE] = previous


def hold_on_cpu(accelerator: Accelerator, config: ParallelismConfig) -> None:
    """Collective: build ``config``'s device mesh on CPU (gloo) and put both in ``accelerator``'s state, as
    accelerate does on GPUs (``Accelerator.__init__``: ``state.device_mesh = config.get_device_mesh(...)``)."""
    if config.total_size != accelerator.num_processes:
        raise ValueError(
            f"ParallelismConfig dp_replicate_size x dp_shard_size = {config.dp_replicate_size} x "
            f"{config.dp_shard_size} = {config.total_size}, but {accelerator.num_processes} processes were launched: "
            "make the product equal the number of processes"
        )
    accelerator.state.parallelism_config = config
    accelerator.state.device_mesh = config.get_device_mesh(accelerator.device.type)


def fsdp_mesh(accelerator: Accelerator):
    """The mesh accelerate gives ``fully_shard``: ``mesh[config.fsdp_dim_names]`` (2-D ``(dp_replicate,
    dp_shard_cp)`` for HSDP, 1-D ``(dp_shard_cp,)`` otherwise); ``None`` without a ``ParallelismConfig``."""
    config = getattr(accelerator, "parallelism_config", None)
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if config is None or mesh is None:
        return None
    return mesh[tuple(config.fsdp_dim_names)]


def _local_world_size() -> int | None:
    value = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def check_topology(
    config: ParallelismConfig | None, world_size: int, local_world_size: int | None = None
) -> None:
    """Refuse, with what to set instead, a layout ODC cannot run: tensor / context / sequence parallel dims (a 3-D
    or larger mesh), replication without sharding, or a shard group that spans nodes.

    Nodes: ``local_world_size`` processes each (default: ``LOCAL_WORLD_SIZE``, which torchrun / ``accelerate
    launch`` set); ranks are numbered node by node and the mesh is row-major, so shard group ``r`` holds ranks
    ``r*S .. r*S+S-1`` and lies within one node when ``S`` divides the node's process count. Without
    ``LOCAL_WORLD_SIZE`` this check is left to ``install_odc``, which compares the shard group's host names.
    """
    if config is not None:
        extra = {f"{dim}_size": getattr(config, f"{dim}_size") or 1 for dim in ("tp", "cp", "sp")}
        extra = {name: size for name, size in extra.items() if size > 1}
        if extra:
            dims = [d for d in ("dp_replicate", "dp_shard") if getattr(config, f"{d}_size") > 1]
            dims += [name[: -len("_size")] for name in extra]
            raise ValueError(
                f"odc_hf runs data parallelism only: a (dp_replicate, dp_shard) mesh, 2-D at most; this "
                f"ParallelismConfig asks for {', '.join(f'{k}={v}' for k, v in extra.items())}, a {len(dims)}-D mesh "
                f"{tuple(dims)}. Tensor / context / sequence parallelism are not supported with ODC: set "
                f"{', '.join(f'{k}: 1' for k in extra)} and use the ranks for dp_shard_size (within a node) and "
                "dp_replicate_size (across nodes)"
            )
        if config.dp_replicate_size > 1 and config.dp_shard_size == 1:
            raise ValueError(
                f"ParallelismConfig(dp_replicate_size={config.dp_replicate_size}, dp_shard_size=1) is pure replication, "
                "which accelerate's FSDP2 path does not build: set dp_shard_size to the processes per node and "
                "dp_replicate_size to the number of nodes (for R x 1 meshes, call odc_hf.fsdp.install_odc directly)"
            )
    local = local_world_size if local_world_size is not None else _local_world_size()
    if local is None or world_size <= local:
        return  # one node: every shard group lies on it
    shard = config.dp_shard_size if config is not None else world_size
    if shard <= local and local % shard == 0:
        return
    nodes = world_size // local
    raise ValueError(
        f"ODC's shard groups must each lie within one node (its one-sided transfers are intra-node), but this "
        f"launch has {world_size} processes on {nodes} nodes of {local} (LOCAL_WORLD_SIZE={local}) and shards over "
        f"groups of {shard}"
        + ("" if config is not None else " (no parallelism_config: one group over every process)")
        + f". Use hybrid sharding: parallelism_config with dp_replicate_size: {nodes} and dp_shard_size: {local} in "
        f"the accelerate config (see {_HSDP_CONFIG}), or ParallelismConfig(dp_replicate_size={nodes}, "
        f"dp_shard_size={local})"
    )


__all__ = [
    "check_topology",
    "cpu_host",
    "fsdp_mesh",
    "hidden_from_accelerate",
    "hold_on_cpu",
    "requested",
    "take",
]
