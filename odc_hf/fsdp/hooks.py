"""FSDP2 comm hooks that turn a unit's all-gather and reduce-scatter into one-sided ODC operations.

FSDP2 calls ``allocate`` for its buffers and ``__call__`` with keyword arguments, on its own all-gather /
reduce-scatter stream; both hooks enqueue their work on that (current) stream and return ``None`` (no
``Work`` to wait on: FSDP then orders later work after the stream's event). The abstract classes live in a
private torch module, so we duck-type them, as ``set_custom_all_gather`` allows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from odc_hf.transport import ODCError

if TYPE_CHECKING:
    from odc_hf.fsdp.adapter import ODCUnit


class _Allocating:
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


def _check_group(unit: ODCUnit, group: dist.ProcessGroup, what: str) -> None:
    if group.size() != unit.world_size:
        raise ODCError(
            f"{what} of unit {unit.name!r} was called on a group of {group.size()} ranks, but ODC was installed "
            f"for {unit.world_size}: integer reshard_after_forward and HSDP are not supported with ODC"
        )


class ODCAllGather(_Allocating):
    """Fill every peer's slot of FSDP's all-gather output from that peer's published shard."""

    def __init__(self, unit: ODCUnit):
        self.unit = unit

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        unit = self.unit
        _check_group(unit, group, "all-gather")
        unit.owner.check_can_gather(unit)
        if input_tensor.numel() != unit.spec.shard_numel or input_tensor.dtype != unit.spec.param_dtype:
            raise ODCError(
                f"all-gather of unit {unit.name!r}: FSDP passed {input_tensor.numel()} x {input_tensor.dtype}, "
                f"ODC registered {unit.spec.shard_numel} x {unit.spec.param_dtype}"
            )
        # FSDP has already copied this rank's own shard into its slot of the output.
        unit.transport.gather(unit.id, output_tensor)
        return None


class ODCReduceScatter(_Allocating):
    """Push every row, this rank's own included, into its owner's fp32 accumulator.

    The accumulator *is* the gradient: ``finish_minibatch`` makes ``param.grad`` a view of it. So FSDP's own
    sharded gradient must not take memory: ``allocate`` hands FSDP a shared, all-zero output buffer that we
    never write. FSDP makes ``param.grad`` views of it and adds zeros into it (a no-op) until
    ``finish_minibatch`` replaces those views. That saves the fp32 gradient shard FSDP would otherwise keep
    next to our accumulator.
    """

    def __init__(self, unit: ODCUnit):
        self.unit = unit

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for n in size:
            numel *= int(n)
        if numel == self.unit.spec.shard_numel:  # the reduce-scatter output
            return self.unit.owner.zero_output(numel, dtype, device).view(*size)
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        unit = self.unit
        _check_group(unit, group, "reduce-scatter")
        if op != dist.ReduceOp.SUM:
            raise ODCError(
                f"reduce-scatter of unit {unit.name!r}: ODC needs a SUM reduction, FSDP asked for {op}"
            )
        expected = unit.world_size * unit.spec.shard_numel
        if input_tensor.numel() != expected:
            raise ODCError(
                f"reduce-scatter of unit {unit.name!r}: FSDP passed {input_tensor.numel()} elements, expected "
                f"{expected}. Some parameters of this unit got no gradient (unused in forward, or frozen); "
                "ODC needs every parameter of a unit to receive one"
                + ("" if unit.owner.reduces_unused_params else " (torch >= 2.12 pads them with zeros for us)")
            )
        unit.transport.scatter_accumulate(unit.id, input_tensor, include_self=True)
        return None
