"""GPU transport: torch symmetric memory within a node, copy-engine gathers and Triton atomic accumulation.

* Each unit gets one symmetric-memory buffer per rank (staging in the parameter dtype, then an fp32
  accumulator); after the collective ``rendezvous`` every rank holds views of every peer's buffer.
* **gather**: ``copy_`` from a peer's staging view is a device-to-device ``cudaMemcpyAsync`` that the copy
  engine executes over NVLink, leaving the SMs to compute (docs/design.md, measurements: 379 GB/s, faster than NCCL's
  all-gather at the same size). It is enqueued on the caller's current stream; FSDP calls us on its own
  all-gather stream, so the reads overlap compute.
* **scatter-accumulate**: a Triton kernel loads this rank's row for a peer, casts it to fp32 and adds it with
  ``atomic_add(sem="relaxed", scope="sys")`` straight into the peer's accumulator. Atomics make concurrent
  pushes from several senders correct without a daemon or a lock; measured at ~0.95x NCCL reduce-scatter.
* **barrier**: the device is synchronised (our copies and atomics have completed, so they are visible to
  the peers) and then the ranks meet in the host control block (see ``control.py``).

``torch.distributed._symmetric_memory`` is a private module; every use of it is in this file, behind
:func:`_symmetric_memory`, which checks the torch version and the functions we need.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

from odc_hf.transport import shm_files
from odc_hf.transport.base import (
    DEFAULT_TIMEOUT_S,
    Transport,
    UnitBytes,
    UnitSpec,
    check_rows,
    require_accumulator,
)
from odc_hf.transport.control import HostControl
from odc_hf.version import require_torch

_ACCUMULATE_BLOCK = 4096


def _symmetric_memory():
    """Import torch's symmetric memory module (private API, isolated here) after checking it fits."""
    require_torch("2.9", "the CUDA ODC transport (torch symmetric memory)")
    import torch.distributed._symmetric_memory as symm_mem

    missing = [n for n in ("empty", "rendezvous", "set_backend", "get_backend") if not hasattr(symm_mem, n)]
    if missing:
        raise RuntimeError(
            f"torch {torch.__version__} lacks torch.distributed._symmetric_memory.{missing}; "
            "odc_hf's CUDA transport was checked against torch 2.11 and 2.13"
        )
    return symm_mem


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
    ``ODCConfig``), read at each launch so a probe can compare caps in one process (benchmarks/microbatch_probe.py).
    Measured there on 2xH200: a 32-CTA cap gave no gain, so the default is uncapped; see docs/configuration.md."""
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
    def __init__(self, spec: UnitSpec, handle, rank: int, world_size: int, staging_bytes: int, nbytes: int):
        numel, accum = spec.shard_numel, spec.accum_numel
        views = [handle.get_buffer(p, (nbytes,), torch.uint8) for p in range(world_size)]
        self.spec = spec
        self.handle = handle  # keeps the mappings alive
        self.staging = [v[:staging_bytes].view(spec.param_dtype)[:numel] for v in views]
        # Gather-only units (accum == 0): empty accumulators, no bytes allocated for them.
        self.accumulators = [v[staging_bytes : staging_bytes + accum * 4].view(torch.float32) for v in views]
        self.local = views[rank]


class CudaTransport(Transport):
    """ODC transport for the GPUs of one node. One process per GPU; ``torch.cuda.set_device`` first."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        device: torch.device | None = None,
        shm_dir: str | None = None,
    ):
        self._symm = _symmetric_memory()
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout_s = float(timeout_s)
        self.device = (
            torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        )
        if self._symm.get_backend(self.device) is None:
            self._symm.set_backend("CUDA")
        self.control = HostControl(group, timeout_s=timeout_s, shm_dir=shm_dir)
        self.minibatch = 0
        self._units: list[_Unit] = []
        self._closed = False

    def register(self, spec: UnitSpec) -> int:
        staging_bytes = shm_files.align(spec.shard_numel * spec.param_dtype.itemsize)
        nbytes = staging_bytes + spec.accum_numel * 4
        buffer = self._symm.empty(nbytes, dtype=torch.uint8, device=self.device)
        buffer.zero_()
        handle = self._symm.rendezvous(buffer, self.group)
        unit = _Unit(spec, handle, self.rank, self.world_size, staging_bytes, nbytes)
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
            atomic_accumulate(u.accumulators[peer], rows[peer])

    def barrier(self, count: float = 0.0, *, what: str = "minibatch barrier") -> float:
        torch.cuda.synchronize(self.device)
        return self.control.barrier(count, what=what, minibatch=self.minibatch)

    def accumulated(self, unit: int) -> torch.Tensor:
        require_accumulator(self._units[unit].spec, "accumulated()")
        return self._units[unit].accumulators[self.rank]

    def reset_accumulator(self, unit: int) -> None:
        self._units[unit].accumulators[self.rank].zero_()

    def _drain(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize(self.device)
