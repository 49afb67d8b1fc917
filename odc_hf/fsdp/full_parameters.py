"""Whole (unsharded) parameters from ODC's published shards, without any collective.

After each optimizer step every rank publishes its shard of every unit (``ODCHandle.publish``); any rank can then read
every peer's shard one-sidedly (``Transport.gather``), as the forward's all-gathers do. Cutting each parameter out of
the gathered rows gives the whole model on every rank, unit by unit, without the peers taking part: what an inference
engine beside the trainer needs after each step (``DTensor.full_tensor()`` would be a collective per parameter).

Layout (``units.py``): a unit's gathered rows are ``world_size`` rows of ``shard_numel`` elements, row ``r`` rank
``r``'s published shard; within a row, each parameter's padded shard sits at its ``gather_offset``. FSDP2 shards dim 0
as ``torch.chunk`` does (every rank's chunk ``ceil(dim0 / world_size)`` rows, the last ones shorter or empty) and pads
each chunk to ``padded_sharded_param_size``; so the parameter is the concatenation of its padded chunks over the ranks,
cut to its first ``dim0`` rows, exactly how FSDP2 itself unpacks an all-gather output. Every size is read from FSDP2's
parameter (``internals.py``) and the unit's slots, never recomputed.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from odc_hf.fsdp.units import ODCUnit
from odc_hf.transport import ODCError, Transport


def check_layout(unit: ODCUnit) -> None:
    """The unit's slots tile its shard exactly (each parameter's padded shard right after the previous one): a slot
    moved by even one element, or a size that disagrees with FSDP2's, is an error, not a silently shifted weight."""
    offset = 0
    for slot in unit.slots:
        fp = slot.fsdp_param
        numel = fp.padded_sharded_param_size.numel()
        width = numel * fp.sharded_param.dtype.itemsize if unit.spec.param_dtype == torch.uint8 else numel
        if slot.gather_offset != offset or slot.gather_numel != width:
            raise ODCError(
                f"unit {unit.name!r}: a parameter's shard is laid out at [{slot.gather_offset}, +{slot.gather_numel}), "
                f"FSDP2's layout puts it at [{offset}, +{width}): the unit's layout is corrupt"
            )
        offset += width
    if offset != unit.spec.shard_numel:
        raise ODCError(f"unit {unit.name!r}: its parameters fill {offset} of the {unit.spec.shard_numel} elements "
                       "ODC registered")  # fmt: skip


def gather_rows(unit: ODCUnit, transport: Transport, rank: int, device: torch.device) -> torch.Tensor:
    """``(world_size, shard_numel)``: every rank's published shard of ``unit``, this rank's own from its staging."""
    spec = unit.spec
    rows = torch.empty(unit.world_size * spec.shard_numel, dtype=spec.param_dtype, device=device)
    transport.gather(unit.id, rows)  # every peer's row, read one-sidedly
    rows = rows.view(unit.world_size, spec.shard_numel)
    rows[rank].copy_(transport.staging(unit.id))  # what the peers read of this rank
    return rows


def cut_parameter(rows: torch.Tensor, unit: ODCUnit, index: int) -> torch.Tensor:
    """Parameter ``index`` of ``unit`` whole, from the unit's gathered ``rows`` (a new tensor; ``rows`` may go)."""
    slot = unit.slots[index]
    fp = slot.fsdp_param
    shape = tuple(fp.sharded_param.shape)  # a DTensor's shape is the whole parameter's
    padded = tuple(fp.padded_sharded_param_size)
    world = rows.size(0)
    if padded[1:] != shape[1:] or world * padded[0] < shape[0]:
        raise ODCError(f"unit {unit.name!r}: padded shards {padded} x {world} ranks cannot hold a parameter of shape "
                       f"{shape}")  # fmt: skip
    block = rows[:, slot.gather_offset : slot.gather_offset + slot.gather_numel]
    if rows.dtype == torch.uint8:  # the unit gathers mixed dtypes as raw bytes: this parameter's bytes
        block = block.contiguous().view(fp.sharded_param.dtype)
    return block.reshape(world * padded[0], *padded[1:])[: shape[0]]


def unit_parameters(unit: ODCUnit, transport: Transport | None, rank: int, device: torch.device
                    ) -> Iterator[tuple[int, torch.Tensor]]:  # fmt: skip
    """``(slot index, whole parameter)`` for every parameter of ``unit``, one unit's rows in memory at a time.

    Without a transport (a shard group of one rank: HSDP's R x 1 mesh) the local shard is the whole parameter.
    """
    if transport is None:
        for index, slot in enumerate(unit.slots):
            yield index, slot.param.to_local().detach()
        return
    check_layout(unit)
    rows = gather_rows(unit, transport, rank, device)
    for index in range(len(unit.slots)):
        yield index, cut_parameter(rows, unit, index)


def full_parameters(model: torch.nn.Module, units: list[ODCUnit], transport: Transport | None, rank: int
                    ) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """``(name, whole parameter)`` for every parameter of ``model``, named as ``model.named_parameters()`` names them:
    a parameter shared by several modules (a tied output embedding) comes once, under its first name.

    Unit by unit: the peak extra memory is one unit's gathered rows plus the parameter being cut (a consumer that keeps
    the tensors keeps their memory). Parameters under FSDP come in the unit's all-gather dtype (what the forward
    computes with: ``MixedPrecisionPolicy.param_dtype`` when set); parameters outside every unit as they are.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    seen: set[int] = set()
    device = next(model.parameters()).device
    for unit in units:
        for index, tensor in unit_parameters(unit, transport, rank, device):
            param = unit.slots[index].param
            if id(param) not in names:
                raise ODCError(f"unit {unit.name!r} holds a parameter of shape {tuple(param.shape)} that "
                               "model.named_parameters() does not list")  # fmt: skip
            seen.add(id(param))
            yield names[id(param)], tensor
    for name, param in model.named_parameters():  # parameters FSDP does not manage (ignored): whole already
        if id(param) not in seen:
            if isinstance(param, DTensor):
                raise ODCError(f"parameter {name!r} is sharded outside every ODC unit")
            yield name, param.detach()
