"""GPU transport: peer-mapped buffers within a node, copy-engine gathers and Triton atomic accumulation.

* Each unit gets one peer-mapped buffer per rank (staging in the parameter dtype, then fp32 accumulation); every
  rank holds views of every peer's buffer. The buffers come from torch symmetric memory (one GPU per rank) or
  CUDA IPC (ranks sharing a GPU, or no symmetric memory): :mod:`odc_hf.transport.peer_memory`, ``peer_memory=``.
* **gather**: ``copy_`` from a peer's staging view is a device-to-device ``cudaMemcpyAsync`` that the copy
  engine executes over NVLink, leaving the SMs to compute (docs/design.md, measurements: 379 GB/s, faster than NCCL's
  all-gather at the same size). It is enqueued on the caller's current stream; FSDP calls us on its own
  all-gather stream, so the reads overlap compute.
* **scatter-accumulate**: a Triton kernel loads this rank's row for a peer, casts it to fp32 and adds it with
  ``atomic_add(sem="relaxed", scope="sys")`` straight into the peer's accumulator. Atomics make concurrent
  pushes from several senders correct without a daemon or a lock, at about NCCL reduce-scatter's speed
  (docs/benchmarks.md has the measurements).
  Float additions in arrival order are not bit-reproducible; ``deterministic=True`` gives every owner one fp32
  slot per sender instead (a sender adds only into its own slot: no atomics, no races) and the owner sums the
  slots in rank order, as the CPU transport does: bit-identical runs for ``world_size`` times the accumulator
  memory.
* **barrier**: the device is synchronised (our copies and atomics have completed, so they are visible to
  the peers) and then the ranks meet in the host control block (see ``control.py``).
"""

from __future__ import annotations

import functools
import logging
import os
import weakref

import torch
import torch.distributed as dist

from odc_hf.transport import ipc_files, shm_files
from odc_hf.transport import peer_memory as peer_memory_module
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

_ACCUMULATE_BLOCK = 4096
logger = logging.getLogger(__name__)
_LOGGED: set[tuple[str, str]] = set()


@functools.cache
def _accumulate_kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError as err:  # pragma: no cover - the CUDA builds of torch ship triton
        raise RuntimeError("odc_hf's CUDA transport needs triton (pip install triton)") from err

    @triton.jit
    def accumulate(dst, src, n, BLOCK: tl.constexpr):
        # Grid-stride: a capped grid (ODC_ACCUMULATE_MAX_CTAS) walks the whole buffer with fewer CTAs.
        stride = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in tl.range(tl.program_id(0).to(tl.int64) * BLOCK, n, stride):
            offsets = start + tl.arange(0, BLOCK)
            mask = offsets < n
            values = tl.load(src + offsets, mask=mask, eviction_policy="evict_first").to(tl.float32)
            # Result unused, so this lowers to a fire-and-forget `red` instruction; sys scope makes the add
            # coherent with the owner GPU and any other sender.
            tl.atomic_add(dst + offsets, values, mask=mask, sem="relaxed", scope="sys")

    return triton, accumulate


def _max_ctas() -> int | None:
    """``ODC_ACCUMULATE_MAX_CTAS``: cap on the accumulate kernel's grid (unset: one CTA per block of the buffer).

    Environment only, on purpose: a kernel-tuning knob of this transport (the transport layer knows nothing of
    ``ODCConfig``), read at each launch so a probe can compare caps in one process (benchmarks/sft/microbatch_probe.py).
    A cap gave no gain where it was measured, so the default is uncapped; see docs/configuration.md."""
    value = os.environ.get("ODC_ACCUMULATE_MAX_CTAS", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"ODC_ACCUMULATE_MAX_CTAS must be a positive integer, got {value!r}")
    return int(value)


def atomic_accumulate(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst += src`` with fp32 system-scope atomics (``dst`` may be a peer's symmetric-memory view)."""
    triton, kernel = _accumulate_kernel()
    n = src.numel()
    blocks = triton.cdiv(n, _ACCUMULATE_BLOCK)
    cap = _max_ctas()
    kernel[(blocks if cap is None else min(blocks, cap),)](dst, src, n, BLOCK=_ACCUMULATE_BLOCK, num_warps=8)



class _Unit:
    def __init__(self, spec: UnitSpec, views: list[torch.Tensor], rank: int, staging_bytes: int, slots: int):
        numel, accum = spec.shard_numel, spec.accum_numel
        self.spec = spec
        self.staging = [v[:staging_bytes].view(spec.param_dtype)[:numel] for v in views]
        # accumulators[owner]: (slots, accum) fp32; one row (atomics) or one per sender (deterministic).
        # Gather-only units (accum == 0): empty accumulators, no bytes allocated for them.
        self.accumulators = [
            v[staging_bytes : staging_bytes + slots * accum * 4].view(torch.float32).view(slots, accum) for v in views
        ]
        self.local = views[rank]
        self.summed = False  # deterministic mode: whether the owner has folded its slots since the last reset


def _closer(ref: weakref.ref):
    """``close()`` of the transport ``ref`` names, if it still lives (no reference kept: a transport that is dropped
    goes)."""

    def close() -> None:
        transport = ref()
        if transport is not None:
            transport.close()

    return close


class CudaTransport(Transport):
    """ODC transport for the GPUs of one node: ``torch.cuda.set_device`` first (ranks may share a GPU).

    ``peer_memory``: how peers map each other's buffers (:mod:`odc_hf.transport.peer_memory`): ``auto`` (symmetric
    memory when every rank has a GPU of its own, CUDA IPC when ranks share one), ``symmetric_memory`` or ``ipc``.
    ``deterministic``: one accumulator slot per sender, summed in rank order (bit-identical runs; ``world_size``
    times the accumulator memory) instead of atomics into one.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        device: torch.device | None = None,
        shm_dir: str | None = None,
        peer_memory: str = "auto",
        deterministic: bool = False,
    ):
        if peer_memory not in peer_memory_module.PEER_MEMORY_CHOICES:  # before any collective: same on every rank
            raise ValueError(f"peer_memory must be one of {peer_memory_module.PEER_MEMORY_CHOICES}, got {peer_memory!r}")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout_s = float(timeout_s)
        self.device = (
            torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        )
        self.deterministic = bool(deterministic)
        self.control = HostControl(group, timeout_s=timeout_s, shm_dir=shm_dir)
        identities: list = [None] * self.world_size
        dist.all_gather_object(identities, peer_memory_module.device_identity(self.device), group=group)
        available = (True, "") if peer_memory == "ipc" else peer_memory_module.symmetric_memory_available()
        self.peer_memory = peer_memory_module.choose(peer_memory, identities, available)
        self._buffers = peer_memory_module.make_buffers(
            self.peer_memory.backend, self.group, self.rank, self.world_size, self.device, job=self.control.job
        )
        if self.peer_memory.backend == "ipc":  # at interpreter exit, let go of the peers' blocks before the cleanup
            ipc_files.add_releaser(_closer(weakref.ref(self)))
        key = (self.peer_memory.backend, self.peer_memory.reason)
        if key not in _LOGGED:
            _LOGGED.add(key)
            logger.info("odc_hf: CUDA transport peer memory: %s (%s, ranks per GPU: %d)%s", self._buffers.name,
                        self.peer_memory.reason, self.peer_memory.ranks_per_device,
                        "; deterministic accumulation" if self.deterministic else "")  # fmt: skip
        self.minibatch = 0
        self._units: list[_Unit] = []
        self._checked = False
        self._closed = False

    def describe(self) -> str:
        """One line for logs and summaries: the backend and why, and the accumulation mode."""
        mode = "deterministic slots" if self.deterministic else "atomic accumulation"
        return f"CUDA transport, {self._buffers.name} ({self.peer_memory.reason}), {mode}"

    def register(self, spec: UnitSpec) -> int:
        staging_bytes = shm_files.align(spec.shard_numel * spec.param_dtype.itemsize)
        slots = self.world_size if self.deterministic else 1
        nbytes = staging_bytes + slots * spec.accum_numel * 4
        views = self._buffers.allocate(nbytes)
        if not self._checked:  # once: a mapping that does not work stops here, not as wrong gradients later
            peer_memory_module.check_peer_mappings(
                views, self.rank, self.world_size,
                lambda what: self.control.barrier(what=what, minibatch=self.minibatch),
            )  # fmt: skip
            self._checked = True
        unit = _Unit(spec, views, self.rank, staging_bytes, slots)
        torch.cuda.synchronize(self.device)
        self.control.barrier(what=f"registration of unit {spec.name!r}", minibatch=self.minibatch)
        self._units.append(unit)
        return len(self._units) - 1

    def nbytes(self, unit: int) -> UnitBytes:
        u = self._units[unit]
        staging = u.staging[self.rank]
        return UnitBytes(staging=staging.numel() * staging.element_size(),
                         accumulator=u.accumulators[self.rank].numel() * 4)  # fmt: skip

    def gather(self, unit: int, output: torch.Tensor) -> None:
        u = self._units[unit]
        rows = check_rows(u.spec, self.world_size, output, "gather output")
        for step in range(1, self.world_size):
            peer = (self.rank + step) % self.world_size  # stagger sources so peers are not all read at once
            rows[peer].copy_(u.staging[peer], non_blocking=True)

    def scatter_accumulate(self, unit: int, input: torch.Tensor, *, include_self: bool = False) -> None:
        u = self._units[unit]
        rows = check_rows(u.spec, self.world_size, input, "scatter-accumulate input", accumulate=True)
        for step in range(0 if include_self else 1, self.world_size):
            peer = (self.rank + step) % self.world_size
            if self.deterministic:  # our own slot of the peer's accumulator: we are its only writer
                u.accumulators[peer][self.rank].add_(rows[peer])
            else:
                atomic_accumulate(u.accumulators[peer][0], rows[peer])

    def barrier(self, count: float = 0.0, *, what: str = "minibatch barrier") -> float:
        torch.cuda.synchronize(self.device)
        return self.control.barrier(count, what=what, minibatch=self.minibatch)

    def accumulated(self, unit: int) -> torch.Tensor:
        u = self._units[unit]
        require_accumulator(u.spec, "accumulated()")
        slots = u.accumulators[self.rank]
        if not self.deterministic:
            return slots[0]
        if not u.summed:  # every sender's slot folded into our own, in rank order (as the CPU transport)
            fold_slots(slots, self.rank)
            u.summed = True
        return slots[self.rank]

    def reset_accumulator(self, unit: int) -> None:
        u = self._units[unit]
        u.accumulators[self.rank].zero_()
        u.summed = False

    def _drain(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._buffers.close()
