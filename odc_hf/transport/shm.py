"""CPU transport: every unit's buffers live in POSIX shared memory that all ranks of the node map.

Each rank owns one file per unit holding its staging buffer and ``world_size`` fp32 accumulator *slots*, one
per sender. A sender only ever adds into its own slot of the owner's file, so no two processes write the same
bytes (no locks, no atomics), and the owner sums the slots in rank order: accumulation is race-free and
deterministic. The price is ``world_size`` fp32 copies of the (trainable) shard per unit, i.e. the size of the
unsharded trainable model in fp32 — fine for the tests and laptops this backend is for. Gather-only units
(``accum_numel=0``) have no slots.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from odc_hf.transport import shm_files
from odc_hf.transport.base import (
    DEFAULT_TIMEOUT_S,
    Transport,
    UnitBytes,
    UnitSpec,
    check_rows,
    fold_slots,
    require_accumulator,
)
from odc_hf.transport.control import HostControl


class _Unit:
    def __init__(self, spec: UnitSpec, world_size: int, mappings: list[torch.Tensor]):
        self.spec = spec
        numel, accum = spec.shard_numel, spec.accum_numel
        staging_bytes = shm_files.align(numel * spec.param_dtype.itemsize)
        self.staging = [m[:staging_bytes].view(spec.param_dtype)[:numel] for m in mappings]
        # slots[owner][sender]: the fp32 accumulator that `sender` adds into for `owner`.
        self.slots = [
            m[staging_bytes : staging_bytes + world_size * accum * 4].view(torch.float32).view(world_size, accum)
            for m in mappings
        ]
        self.summed = False  # whether the owner has folded its slots since the last reset

    @staticmethod
    def nbytes(spec: UnitSpec, world_size: int) -> int:
        staging_bytes = shm_files.align(spec.shard_numel * spec.param_dtype.itemsize)
        return staging_bytes + world_size * spec.accum_numel * 4


class ShmTransport(Transport):
    """ODC transport for CPU processes of one node (gloo or any other process group for setup only)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        shm_dir: str | None = None,
    ):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout_s = float(timeout_s)
        self.shm_dir = shm_dir
        self.control = HostControl(group, timeout_s=timeout_s, shm_dir=shm_dir)
        self.minibatch = 0
        self._units: list[_Unit] = []
        self._closed = False

    def describe(self) -> str:
        return "CPU shared-memory transport, deterministic slots"

    def register(self, spec: UnitSpec) -> int:
        specs: list = [None] * self.world_size
        nbytes = _Unit.nbytes(spec, self.world_size)
        directory = shm_files.pick_dir(nbytes, self.shm_dir)
        own = shm_files.create(directory, self.control.job, f"unit{len(self._units)}", nbytes)
        try:
            dist.all_gather_object(specs, (spec, str(own.path)), group=self.group)
            mismatched = [r for r, (s, _) in enumerate(specs) if s != spec]
            if mismatched:
                raise ValueError(
                    f"unit {spec.name!r} registered with different specs on ranks {mismatched}: "
                    f"{specs[mismatched[0]][0]} vs {spec} on rank {self.rank}"
                )
            mappings = [shm_files.map_file(p, nbytes) for _, p in specs]
            dist.barrier(group=self.group)  # everyone has mapped every file
        finally:
            own.release()
        self._units.append(_Unit(spec, self.world_size, mappings))
        return len(self._units) - 1

    def nbytes(self, unit: int) -> UnitBytes:
        u = self._units[unit]
        staging = u.staging[self.rank]
        slots = u.slots[self.rank]
        return UnitBytes(staging=staging.numel() * staging.element_size(), accumulator=slots.numel() * 4)

    def gather(self, unit: int, output: torch.Tensor) -> None:
        u = self._units[unit]
        rows = check_rows(u.spec, self.world_size, output, "gather output")
        for peer in range(self.world_size):
            if peer != self.rank:
                rows[peer].copy_(u.staging[peer])

    def scatter_accumulate(self, unit: int, input: torch.Tensor, *, include_self: bool = False) -> None:
        u = self._units[unit]
        rows = check_rows(u.spec, self.world_size, input, "scatter-accumulate input", accumulate=True)
        for peer in range(self.world_size):
            if peer != self.rank or include_self:
                u.slots[peer][self.rank].add_(rows[peer])

    def barrier(self, count: float = 0.0, *, what: str = "minibatch barrier") -> float:
        return self.control.barrier(count, what=what, minibatch=self.minibatch)

    def accumulated(self, unit: int) -> torch.Tensor:
        # Fold the other senders' slots into our own one, in rank order (bit-identical on every run). Between
        # the barrier and the reset nobody writes these slots, so doing it in place is race-free; the result
        # is a view into the shared file, like the CUDA transport's (which catches offset mistakes in tests).
        u = self._units[unit]
        require_accumulator(u.spec, "accumulated()")
        slots = u.slots[self.rank]
        if not u.summed:
            fold_slots(slots, self.rank)
            u.summed = True
        return slots[self.rank]

    def reset_accumulator(self, unit: int) -> None:
        self._units[unit].slots[self.rank].zero_()
        self._units[unit].summed = False
