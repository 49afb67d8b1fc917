"""FSDP2 comm hooks that turn a unit's all-gather and reduce-scatter into one-sided ODC operations.

FSDP2 calls ``allocate`` for its buffers and ``__call__`` with keyword arguments, on its own all-gather /
reduce-scatter stream; both hooks enqueue their work on that (current) stream and return ``None`` (no
``Work`` to wait on: FSDP then orders later work after the stream's event). The abstract classes live in a
private torch module, so we duck-type them, as ``set_custom_all_gather`` allows.

Under HSDP, FSDP2 calls both hooks with the *shard* process group (the ODC group); its cross-replica
all-reduce is switched off (``set_requires_all_reduce(False)``) and done once per minibatch instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from odc_hf.fsdp import internals
from odc_hf.transport import ODCError

if TYPE_CHECKING:
    from odc_hf.fsdp.units import ODCUnit


class _Allocating:
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


def _numel(size) -> int:
    numel = 1
    for n in size:
        numel *= int(n)
    return numel


def _check_group(unit: ODCUnit, group: dist.ProcessGroup, what: str) -> None:
    if group.size() != unit.world_size:
        raise ODCError(
            f"{what} of unit {unit.name!r} was called on a group of {group.size()} ranks, but ODC was installed "
            f"for a shard group of {unit.world_size}: integer reshard_after_forward is not supported with ODC"
        )


def _check_no_replica_all_reduce(unit: ODCUnit) -> None:
    if unit.owner.replicated and internals.all_reduce_enabled(unit.param_group):
        raise ODCError(
            f"unit {unit.name!r}: FSDP2's per-microbatch cross-replica all-reduce was switched back on "
            "(set_requires_all_reduce(True) or set_requires_gradient_sync(True) on an ODC model); with uneven "
            "microbatch counts it would deadlock. ODC all-reduces once per minibatch in finish_minibatch()."
        )


def _layout_error(unit: ODCUnit, got: int, expected: int) -> ODCError:
    old_torch = not unit.owner.reduces_unused_params
    return ODCError(
        f"reduce-scatter of unit {unit.name!r}: FSDP passed {got} elements, expected {expected} (the unit's "
        "trainable parameters). Either a trainable parameter of this unit got no gradient in this microbatch"
        + (" (unused in forward: this torch leaves it out of the reduce-scatter; keep every trainable parameter "
           "of a unit in use, or freeze it; torch >= 2.12 pads it with zeros for ODC)" if old_torch else "")
        + " or requires_grad changed after install_odc() (set it before installing)"
    )  # fmt: skip


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
        unit.owner.transport.gather(unit.id, output_tensor)
        return None


class ODCReduceScatter(_Allocating):
    """Push every row, this rank's own included, into its owner's fp32 accumulator.

    The accumulator *is* the gradient: ``finish_minibatch`` makes ``param.grad`` a view of it. So FSDP's own
    sharded gradient must not take memory: ``allocate`` hands FSDP a shared, all-zero output buffer that we
    never write. FSDP makes ``param.grad`` views of it and adds zeros into it (a no-op) until
    ``finish_minibatch`` replaces those views (under HSDP it keeps the buffer as its "partial reduce output"
    and adds zeros into it instead). That saves the fp32 gradient shard FSDP would otherwise keep next to our
    accumulator. Only trainable parameters are in the reduce-scatter (FSDP2 leaves frozen ones out).
    """

    def __init__(self, unit: ODCUnit):
        self.unit = unit

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = _numel(size)
        if numel == self.unit.spec.accum_numel:  # the reduce-scatter output (the input is world_size x that)
            return self.unit.owner.zero_output(numel, dtype, device).view(*size)
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        unit = self.unit
        _check_group(unit, group, "reduce-scatter")
        _check_no_replica_all_reduce(unit)
        if op != dist.ReduceOp.SUM:
            raise ODCError(
                f"reduce-scatter of unit {unit.name!r}: ODC needs a SUM reduction, FSDP asked for {op}"
            )
        expected = unit.world_size * unit.spec.accum_numel
        if input_tensor.numel() != expected:
            raise _layout_error(unit, input_tensor.numel(), expected)
        unit.owner.transport.scatter_accumulate(unit.id, input_tensor, include_self=True)
        return None


class ReplicaOnlyReduceScatter(_Allocating):
    """Shard group of one rank (an R x 1 mesh): FSDP2 runs no reduce-scatter (it copies its input into the
    output) and, with the cross-replica all-reduce off, keeps accumulating into its partial reduce output,
    which ``finish_minibatch`` then all-reduces. This hook only checks, at each ``allocate``, that the layout
    is the one ODC planned and that the per-microbatch all-reduce stays off."""

    def __init__(self, unit: ODCUnit):
        self.unit = unit

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        unit = self.unit
        _check_no_replica_all_reduce(unit)
        if _numel(size) != unit.spec.accum_numel:
            raise _layout_error(unit, _numel(size), unit.spec.accum_numel)
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # pragma: no cover
        raise ODCError(
            f"unit {self.unit.name!r}: a reduce-scatter over a shard group of {group.size()} ranks"
        )
