"""The Transport interface: the two one-sided ODC primitives plus one synchronisation per minibatch.

A *unit* is what FSDP2 gathers and reduces in one collective: the concatenation of the padded parameter
shards of one ``FSDPModule``. Every rank owns a shard of ``shard_numel`` elements of every unit. For each
registered unit a transport keeps, on every rank,

* a **staging** buffer (``shard_numel`` elements of the parameter dtype): the owner *publishes* its shard
  there after each optimizer step, and peers read it with :meth:`Transport.gather` without the owner
  taking part;
* an **accumulator** (fp32, ``accum_numel`` elements): peers add their gradient rows for this owner into it
  with :meth:`Transport.scatter_accumulate`, again without the owner taking part; the owner collects it with
  :meth:`Transport.take_accumulated` after the minibatch barrier. A unit registered with ``accum_numel=0``
  is *gather-only* (frozen parameters): it has no accumulator at all.

The two layouts may differ: a unit mixing frozen and trainable parameters gathers all of them but
accumulates only the trainable ones (FSDP2 leaves frozen parameters out of its reduce-scatter).

Layouts follow FSDP2's collectives: the input of a gather-like operation is a flat tensor of
``world_size * shard_numel`` elements, that of a reduce-scatter-like one ``world_size * accum_numel``
elements, row ``r`` belonging to rank ``r``. Gather skips the caller's
own row (FSDP has already placed its own shard in the output); scatter-accumulate skips it unless
``include_self=True`` (the FSDP adapter passes that: its gradients live entirely in the accumulator).

The only waits on peers are in :meth:`Transport.barrier`; each carries a timeout and raises
:class:`PeerTimeoutError` / :class:`PeerFailedError` naming the operation, the peer and the minibatch.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

DEFAULT_TIMEOUT_S = 600.0
"""Generous by default: a slow rank may legitimately run many more microbatches than its peers."""


class ODCError(RuntimeError):
    """Base class of errors raised by odc_hf's communication layer."""


class PeerFailedError(ODCError):
    """A peer died or reported a failure while this rank was waiting on it."""


class PeerTimeoutError(ODCError):
    """A peer did not arrive at a synchronisation point within the timeout."""


@dataclass(frozen=True, kw_only=True)
class UnitSpec:
    """What a transport needs to know about a unit: its name (for errors), shard sizes and dtypes.

    ``shard_numel`` elements of ``param_dtype`` are gathered (staging); ``accum_numel`` fp32 elements are
    accumulated (default: ``shard_numel``; ``0``: a gather-only unit, which allocates no accumulator).
    """

    name: str
    shard_numel: int
    param_dtype: torch.dtype
    accum_numel: int | None = None
    accum_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.shard_numel <= 0:
            raise ValueError(f"unit {self.name!r}: shard_numel must be positive, got {self.shard_numel}")
        if self.accum_numel is None:
            object.__setattr__(self, "accum_numel", self.shard_numel)  # frozen dataclass: set once, here
        if self.accum_numel < 0:
            raise ValueError(f"unit {self.name!r}: accum_numel must be >= 0, got {self.accum_numel}")
        if self.accum_dtype != torch.float32:
            raise ValueError(f"unit {self.name!r}: only float32 accumulators are supported")

    @property
    def gather_only(self) -> bool:
        return self.accum_numel == 0

    @property
    def device_bytes(self) -> int:
        """Bytes one rank holds for this unit on the GPU transport: its staging shard (``param_dtype``) plus its
        fp32 accumulator shard, none for a gather-only (frozen) unit, only the trainable part for a mixed one.
        What the benchmarks report as ODC's buffers (before alignment: at most 511 bytes more per unit)."""
        return self.shard_numel * self.param_dtype.itemsize + self.accum_numel * self.accum_dtype.itemsize


@dataclass(frozen=True)
class UnitBytes:
    """Bytes a transport allocated for one unit on this rank (what the memory tests and reports read)."""

    staging: int
    accumulator: int
    """Every fp32 byte kept for accumulation on this rank: one shard on CUDA, one slot per sender on CPU."""


class Transport(abc.ABC):
    """One-sided gather and scatter-accumulate between the ranks of one node.

    Subclasses: :class:`odc_hf.transport.shm.ShmTransport` (CPU, POSIX shared memory) and
    :class:`odc_hf.transport.cuda.CudaTransport` (GPU, torch symmetric memory). Both have the same semantics;
    the tests run one suite over both. Both keep ``_units`` (objects with ``spec`` and per-rank ``staging``),
    a ``control`` (:class:`~odc_hf.transport.control.HostControl`) and ``_closed``; the bookkeeping below
    is shared.
    """

    rank: int
    world_size: int
    timeout_s: float
    minibatch: int
    """Index of the current minibatch, kept by the caller; only used in error messages."""

    @abc.abstractmethod
    def register(self, spec: UnitSpec) -> int:
        """Collective: allocate staging and accumulator buffers for a unit; returns its id."""

    def spec(self, unit: int) -> UnitSpec:
        """The spec a unit was registered with."""
        return self._units[unit].spec

    def staging(self, unit: int) -> torch.Tensor:
        """This rank's staging buffer (the shard peers will read). Write it only between barriers."""
        return self._units[unit].staging[self.rank]

    @abc.abstractmethod
    def nbytes(self, unit: int) -> UnitBytes:
        """The bytes of the buffers this rank allocated for ``unit`` (read from the buffers themselves)."""

    @abc.abstractmethod
    def gather(self, unit: int, output: torch.Tensor) -> None:
        """Fill every peer's row of ``output`` (``world_size * shard_numel``) from that peer's staging buffer.

        The caller's own row is left untouched. On CUDA the copies are enqueued on the current stream.
        """

    @abc.abstractmethod
    def scatter_accumulate(self, unit: int, input: torch.Tensor, *, include_self: bool = False) -> None:
        """Add row ``p`` of ``input`` (``world_size * accum_numel``, any float dtype) into rank ``p``'s accumulator.

        The caller's own row is skipped unless ``include_self``. On CUDA the work is enqueued on the current
        stream, so the caller may reuse ``input`` after it on that stream. The owner sees the sums after the
        next :meth:`barrier`.
        """

    @abc.abstractmethod
    def barrier(self, count: float = 0.0, *, what: str = "minibatch barrier") -> float:
        """Wait until every rank arrives and all of this rank's pushes are visible; return the sum of ``count``.

        The sum is computed in rank order, so it is bit-identical on every rank.
        """

    @abc.abstractmethod
    def accumulated(self, unit: int) -> torch.Tensor:
        """This rank's accumulated fp32 shard, valid until :meth:`reset_accumulator` (on CUDA: the buffer itself).

        Call it after the :meth:`barrier` that ends a minibatch and before any peer pushes again. Gather-only
        units have none (:class:`ODCError`).
        """

    @abc.abstractmethod
    def reset_accumulator(self, unit: int) -> None:
        """Zero this rank's accumulator (nothing for gather-only units); a :meth:`barrier` must follow before any
        peer pushes again."""

    def take_accumulated(self, unit: int) -> torch.Tensor:
        """A copy of :meth:`accumulated`, then :meth:`reset_accumulator`."""
        total = self.accumulated(unit).clone()
        self.reset_accumulator(unit)
        return total

    def describe(self) -> str:
        """One line for logs and summaries: which transport, and how it maps and accumulates."""
        return type(self).__name__

    def abort(self, reason: str) -> None:
        """Tell the peers that this rank failed, so their waits raise at once instead of timing out."""
        if not self._closed:
            self.control.abort(reason)

    def close(self) -> None:
        """Release every buffer. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._drain()
        self._units.clear()
        self.control.close()

    def _drain(self) -> None:  # noqa: B027 - an optional hook, not an abstract one
        """Finish pending device work before buffers go (CUDA); nothing to do on CPU."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            self.abort(f"{exc_type.__name__}: {exc}")
        self.close()


def check_rows(spec: UnitSpec, world_size: int, tensor: torch.Tensor, what: str, *, accumulate: bool = False
               ) -> torch.Tensor:  # fmt: skip
    """Validate a flat ``world_size * shard_numel`` tensor (``accum_numel`` with ``accumulate``) and view it as rows."""
    if accumulate and spec.gather_only:
        raise ODCError(f"{what} of unit {spec.name!r}: the unit is gather-only (registered with accum_numel=0)")
    numel = spec.accum_numel if accumulate else spec.shard_numel
    expected = world_size * numel
    if tensor.numel() != expected:
        raise ValueError(
            f"{what} of unit {spec.name!r}: expected {world_size} x {numel} = {expected} elements, "
            f"got {tensor.numel()}"
        )
    if not tensor.is_contiguous():
        raise ValueError(f"{what} of unit {spec.name!r}: tensor must be contiguous")
    return tensor.view(world_size, numel)


def fold_slots(slots: torch.Tensor, rank: int) -> torch.Tensor:
    """Sum every sender's accumulator slot (``slots[sender]``) into this owner's own one, ``slots[rank]``, in rank
    order, in place: bit-identical from run to run. Call it between the barrier and the reset, when nobody writes
    these slots; returns the owner's slot."""
    own = slots[rank].clone()
    slots[rank].zero_()
    for sender in range(slots.shape[0]):
        slots[rank] += own if sender == rank else slots[sender]
    return slots[rank]


def require_accumulator(spec: UnitSpec, what: str) -> None:
    if spec.gather_only:
        raise ODCError(f"{what} of unit {spec.name!r}: the unit is gather-only (registered with accum_numel=0)")
