"""What ODC needs to know about a ``fully_shard``-ed model: its units, their two layouts, and the mesh.

A *unit* is one FSDP param group (one ``fully_shard`` call). Each unit has two flat layouts, both read from
FSDP2 (``internals.py``), never recomputed from the model:

* the **gather layout**: every parameter's padded shard, in ``fsdp_params`` order, in the unit's all-gather
  dtype (the policy's ``param_dtype``, else the parameters' own; when those differ FSDP2 all-gathers bytes,
  and so do we);
* the **accumulator layout**: the same, but only the trainable parameters (``requires_grad``), in fp32 —
  that is FSDP2's reduce-scatter layout, which leaves frozen parameters out. A unit without trainable
  parameters is *gather-only* and gets no accumulator.

The mesh is FSDP's data-parallel mesh: 1-D ``(shard,)``, or 2-D ``(replicate, shard)`` for HSDP. ODC runs
over the shard group; the replicate group gets one all-reduce per minibatch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Replicate, Shard

from odc_hf.fsdp import internals
from odc_hf.transport import ODCError, Transport, UnitSpec


class UnitOwner(Protocol):
    """What a unit's comm hooks (``hooks.py``) ask of the ODC state that owns it (``adapter.ODCHandle``). Named here,
    as an interface, so that this module does not import the adapter that imports it."""

    transport: Transport | None
    reduces_unused_params: bool

    @property
    def replicated(self) -> bool: ...

    def check_can_gather(self, unit: ODCUnit) -> None: ...

    def zero_output(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...


@dataclasses.dataclass
class ParamSlot:
    """One parameter of a unit and where its shard sits in the unit's two layouts."""

    fsdp_param: Any
    gather_offset: int
    """In elements of the unit's gather dtype (bytes when the unit gathers mixed dtypes as uint8)."""
    gather_numel: int
    accum_offset: int | None
    """In fp32 elements of the accumulator; ``None`` for a frozen parameter (not in FSDP2's reduce-scatter)."""

    @property
    def param(self):
        return self.fsdp_param.sharded_param

    @property
    def trainable(self) -> bool:
        return self.accum_offset is not None


@dataclasses.dataclass
class ODCUnit:
    """One FSDP unit under ODC."""

    name: str
    module: FSDPModule
    param_group: Any
    slots: list[ParamSlot]
    spec: UnitSpec
    world_size: int
    """Ranks in the shard group: the ODC group."""
    owner: UnitOwner | None = None
    """The :class:`~odc_hf.fsdp.adapter.ODCHandle` that installed the unit."""
    id: int | None = None
    """The transport's unit id (``None`` on a shard group of one rank, which has no transport)."""
    fallback: torch.Tensor | None = None
    """Shard group of one rank only: zeros standing in for FSDP2's accumulated output before it exists."""

    @property
    def trainable(self) -> list[ParamSlot]:
        return [s for s in self.slots if s.trainable]

    @property
    def fsdp_params(self) -> list:
        return [s.fsdp_param for s in self.slots]


@dataclasses.dataclass(frozen=True)
class Topology:
    """FSDP's data-parallel mesh as ODC uses it."""

    mesh: Any
    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None
    """``None`` on a 1-D mesh."""

    @property
    def shard_size(self) -> int:
        return self.shard_group.size()

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate_group is None else self.replicate_group.size()

    def describe(self) -> str:
        return f"{self.replicate_size} x {self.shard_size} (replicate x shard)"


def _check_mesh(name: str, info, post_forward) -> None:
    mesh = info.mesh
    if internals.uses_spmd_mesh(info) or mesh.ndim not in (1, 2):
        raise NotImplementedError(
            f"unit {name!r} is sharded over a {mesh.ndim}-D mesh {mesh.mesh_dim_names} from a larger mesh; "
            "ODC supports a 1-D (shard) or 2-D (replicate, shard) data-parallel mesh only, without tensor / "
            "context parallel dims"
        )
    if post_forward is not None and post_forward.shard_mesh_size != info.shard_mesh_size:
        raise NotImplementedError(
            f"unit {name!r} uses an integer reshard_after_forward; ODC supports True/False only"
        )


def _check_param(name: str, fp, mesh, shard_dim: int, replicate_dim: int | None) -> None:
    p = fp.sharded_param
    if len(p.placements) != mesh.ndim or p.device_mesh.ndim != mesh.ndim:
        raise NotImplementedError(
            f"unit {name!r}: a parameter is placed {p.placements} on a {p.device_mesh.ndim}-D mesh, more than "
            f"FSDP's {mesh.ndim}-D data-parallel mesh (tensor / context parallel?); ODC supports data "
            "parallelism only: shard (FSDP) or replicate x shard (HSDP)"
        )
    if fp.fsdp_placement.dim != 0 or p.placements[shard_dim] != Shard(0):
        raise NotImplementedError(
            f"unit {name!r}: ODC supports Shard(0) parameters only, got {fp.fsdp_placement}"
        )
    if replicate_dim is not None and p.placements[replicate_dim] != Replicate():
        raise NotImplementedError(
            f"unit {name!r}: expected Replicate() on the replicate dim, got {p.placements}"
        )
    if fp.offload_to_cpu:
        raise NotImplementedError(f"unit {name!r}: CPU offload is not supported with ODC")


def _gather_dtype(params: list) -> tuple[torch.dtype, bool]:
    """The dtype FSDP2 all-gathers this unit in, and whether it gathers mixed dtypes as bytes."""
    dtypes = internals.all_gather_dtype(params)
    if len(dtypes) == 1:
        return dtypes.pop(), False
    # No policy param_dtype and mixed parameter dtypes (e.g. a bf16 frozen base next to fp32 LoRA weights):
    # FSDP2 all-gathers the raw bytes of each padded shard (uint8); ODC stages and reads the same bytes.
    return torch.uint8, True


def plan_unit(label: str, module: FSDPModule, group) -> tuple[ODCUnit, Any]:
    """Validate one unit and lay out its two layouts; returns the unit (unregistered) and FSDP's mesh info."""
    info, post_forward = internals.mesh_info(group)
    _check_mesh(label, info, post_forward)
    shard_dim, replicate_dim = internals.mesh_dims(info)
    params = internals.fsdp_params(group)
    for fp in params:
        _check_param(label, fp, info.mesh, shard_dim, replicate_dim)
    dtype, as_bytes = _gather_dtype(params)
    slots, gather_total, accum_total = [], 0, 0
    for fp in params:
        numel = fp.padded_sharded_param_size.numel()
        gather_numel = numel * fp.sharded_param.dtype.itemsize if as_bytes else numel
        trainable = fp.sharded_param.requires_grad
        slots.append(ParamSlot(fp, gather_total, gather_numel, accum_total if trainable else None))
        gather_total += gather_numel
        accum_total += numel if trainable else 0
    spec = UnitSpec(name=label, shard_numel=gather_total, param_dtype=dtype, accum_numel=accum_total)
    unit = ODCUnit(label, module, group, slots, spec, world_size=info.shard_mesh_size)
    return unit, info


def find_units(model: torch.nn.Module) -> tuple[list[ODCUnit], Topology]:
    """Every FSDPModule of ``model`` that owns parameters, validated, and the one mesh they all share."""
    units, meshes = [], []
    seen: set[int] = set()  # fully_shard([a, b, c]) makes three FSDPModules that share one param group
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        if getattr(module, "_odc_installed", False):
            raise ODCError(f"ODC is already installed on {name or 'the root module'!r}")
        groups = internals.param_groups(module)
        if len(groups) > 1:
            raise NotImplementedError(
                f"unit {name or '<root>'!r} has {len(groups)} FSDP param groups; ODC supports one per module"
            )
        if not groups or id(groups[0]) in seen:
            continue  # owns no parameters (FSDP never calls its comms), or its group is already done
        seen.add(id(groups[0]))
        unit, info = plan_unit(name or "<root>", module, groups[0])
        units.append(unit)
        meshes.append(info)
    if not units:
        raise ValueError("install_odc: the model has no FSDPModule with parameters; apply fully_shard first")
    first = meshes[0]
    for unit, info in zip(units, meshes):
        if info.mesh != first.mesh:
            raise NotImplementedError(
                f"units {units[0].name!r} and {unit.name!r} are sharded over different meshes ({first.mesh} vs "
                f"{info.mesh}); ODC needs one data-parallel mesh for the whole model"
            )
    shard_dim, replicate_dim = internals.mesh_dims(first)
    mesh = first.mesh
    replicate = None if replicate_dim is None else mesh.get_group(replicate_dim)
    return units, Topology(mesh, mesh.get_group(shard_dim), replicate)
