"""Two ways for the ranks of one node to map each other's CUDA buffers: torch symmetric memory and CUDA IPC.

* **symmetric memory** (``torch.distributed._symmetric_memory``, CUDA backend): one allocation per rank, a
  collective rendezvous, then every rank holds a view of every peer's buffer. It needs one GPU per rank: its
  rendezvous refuses ranks whose allocations live on the same device ("overlapping devices").
* **CUDA IPC** (``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle`` through
  :func:`torch.multiprocessing.reductions.reduce_tensor`): each rank allocates an ordinary tensor, sends its
  picklable handle to the others (``all_gather_object``), and each peer's call of the handle's rebuild function maps
  the owner's allocation. It works between processes on the same GPU (and between GPUs with peer access); it is
  the paper's own intra-node transport.

:func:`choose` decides between them: ``auto`` takes symmetric memory where every rank has a GPU of its own and CUDA
IPC where ranks share one (or symmetric memory is missing). Both give the CUDA transport the same thing: for each
allocation, a list of ``world_size`` byte views, the caller's own at its rank. Copy-engine reads and system-scope
Triton atomics work on either.

Expandable segments (odc_hf turns them on, ``odc_hf/integrations/launch/cuda_allocator.py``): torch exports such
allocations as POSIX file descriptors rather than ``cudaIpcMemHandle`` s, which peers open through ``pidfd_getfd``;
:func:`check_peer_mappings` reads back what a peer wrote into a mapped buffer at registration, so a mapping that
does not work stops the job with a clear error instead of training on garbage.

CUDA IPC leaves files in /dev/shm (torch's reference counters, the driver's interprocess events): which, and how
they are removed whatever way the job ends, :mod:`odc_hf.transport.ipc_files`.

``torch.distributed._symmetric_memory`` is a private module: every use of it is in this file, behind
:func:`symmetric_memory_module`, which checks the torch version and the functions used.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.distributed as dist

from odc_hf.transport import ipc_files
from odc_hf.transport.base import ODCError
from odc_hf.version import require_torch

logger = logging.getLogger(__name__)

PEER_MEMORY_CHOICES = ("auto", "symmetric_memory", "ipc")
"""``auto``: symmetric memory when every rank has its own GPU, else CUDA IPC; or one of the two by name."""
SAFE_GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast off in NCCL, torch symmetric memory and NVSHMEM: the processes odc_hf starts (the
examples' relaunch, ``odc_hf.testing.run_ranks``) get these. ODC maps peers' buffers without multicast; the
variables keep the libraries from using it on hosts where it must stay off."""


def symmetric_memory_module():
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


def symmetric_memory_available() -> tuple[bool, str]:
    """Whether torch's symmetric memory can be used here, and why not."""
    try:
        symmetric_memory_module()
    except (ImportError, RuntimeError) as err:
        return False, str(err)
    return True, ""


def device_identity(device: torch.device) -> str:
    """The physical GPU behind ``device``: its UUID (processes with different ``CUDA_VISIBLE_DEVICES`` can number
    the same GPU differently)."""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid is not None else f"{props.name}#{props.pci_bus_id}:{props.pci_device_id}"


@dataclasses.dataclass(frozen=True)
class PeerMemoryChoice:
    """What :func:`choose` decided: ``backend`` (``symmetric_memory`` or ``ipc``) and a one-line ``reason``."""

    backend: str
    reason: str
    ranks_per_device: int


def choose(requested: str, identities: list[str], symmetric_available: tuple[bool, str] = (True, "")
           ) -> PeerMemoryChoice:  # fmt: skip
    """Pick the peer-memory backend for ranks whose GPUs are ``identities`` (one per rank, see
    :func:`device_identity`). Pure: the CUDA transport gathers the identities and passes them in."""
    if requested not in PEER_MEMORY_CHOICES:
        raise ValueError(f"peer memory must be one of {PEER_MEMORY_CHOICES}, got {requested!r}")
    counts: dict[str, int] = {}
    for identity in identities:
        counts[identity] = counts.get(identity, 0) + 1
    sharing = max(counts.values(), default=1)
    shared = sharing > 1
    available, why_not = symmetric_available
    if requested == "symmetric_memory":
        if shared:
            raise ODCError(
                f"peer memory 'symmetric_memory' needs one GPU per rank, but {sharing} ranks share a GPU here "
                "(torch symmetric memory refuses overlapping devices): use 'ipc' or 'auto' (ODCConfig.cuda_peer_memory, "
                "ODC_CUDA_PEER_MEMORY)"
            )
        if not available:
            raise ODCError(f"peer memory 'symmetric_memory' is not available: {why_not}; use 'ipc' or 'auto'")
        return PeerMemoryChoice("symmetric_memory", "asked for", sharing)
    if requested == "ipc":
        return PeerMemoryChoice("ipc", "asked for", sharing)
    if shared:
        return PeerMemoryChoice("ipc", f"{sharing} ranks share a GPU", sharing)
    if not available:
        return PeerMemoryChoice("ipc", f"torch symmetric memory is unavailable ({why_not})", sharing)
    return PeerMemoryChoice("symmetric_memory", "one GPU per rank", sharing)


class SymmetricMemoryBuffers:
    """Allocations in torch symmetric memory (CUDA backend), one rendezvous each."""

    name = "torch symmetric memory"

    def __init__(self, group: dist.ProcessGroup, rank: int, world_size: int, device: torch.device):
        self._symm = symmetric_memory_module()
        self.group, self.rank, self.world_size, self.device = group, rank, world_size, device
        if self._symm.get_backend(device) is None:
            self._symm.set_backend("CUDA")
        self._handles: list = []

    def allocate(self, nbytes: int) -> list[torch.Tensor]:
        buffer = self._symm.empty(nbytes, dtype=torch.uint8, device=self.device)
        buffer.zero_()
        handle = self._symm.rendezvous(buffer, self.group)
        self._handles.append(handle)  # keeps the mappings alive
        return [handle.get_buffer(p, (nbytes,), torch.uint8) for p in range(self.world_size)]

    def close(self) -> None:
        self._handles.clear()


class IpcBuffers:
    """Ordinary CUDA allocations, mapped by the peers through CUDA IPC handles (works on a shared GPU).

    The owner keeps its tensor and the peers keep their mapped tensors until :meth:`close`; torch's IPC reference
    counting lets the owner's allocator reuse the memory only once every peer has let go of it. The files torch and
    the CUDA driver make in /dev/shm for it are recorded in this process's ledger (``job``: the transport's job id),
    so that they are removed however the job ends (:mod:`odc_hf.transport.ipc_files`)."""

    name = "CUDA IPC"

    def __init__(self, group: dist.ProcessGroup, rank: int, world_size: int, device: torch.device,
                 job: str | None = None):  # fmt: skip
        from torch.multiprocessing.reductions import reduce_tensor

        self._reduce = reduce_tensor
        self.group, self.rank, self.world_size, self.device = group, rank, world_size, device
        self._views: list[list[torch.Tensor]] = []
        self.ledger = _open_ledger(job)

    def __del__(self):
        ledger = getattr(self, "ledger", None)
        if ledger is not None:  # the mappings go with this object: peers must not count on them any more
            try:
                ledger.released()
            except Exception:  # noqa: BLE001 - at interpreter shutdown the modules it needs may be gone
                pass

    def allocate(self, nbytes: int) -> list[torch.Tensor]:
        buffer = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        torch.cuda.synchronize(self.device)  # zeroed before any peer maps it
        rebuild, args = self._reduce(buffer)
        if self.ledger is not None:  # torch's counter file and the driver's event file, now that both exist
            self.ledger.record_own([ipc_files.counter_file(rebuild, args)])
            self.ledger.record_driver_files()
        handles: list = [None] * self.world_size
        dist.all_gather_object(handles, (rebuild, args), group=self.group)
        views = [buffer if peer == self.rank else fn(*fn_args) for peer, (fn, fn_args) in enumerate(handles)]
        if self.ledger is not None:  # after mapping, never before: a listed file must really be held
            self.ledger.record_mapped(ipc_files.counter_file(fn, fn_args) for fn, fn_args in handles)
            self.ledger.record_driver_files()  # should opening the peers' events make one too
        for peer, view in enumerate(views):
            if view.numel() != nbytes or view.device.type != "cuda":
                raise ODCError(
                    f"CUDA IPC: rank {peer}'s buffer mapped as {view.numel()} bytes on {view.device} "
                    f"(expected {nbytes} on CUDA)"
                )
        self._views.append(views)
        return views

    def close(self) -> None:
        self._views.clear()
        if self.ledger is not None:
            self.ledger.released()


def _open_ledger(job: str | None):
    """This process's ledger of CUDA IPC files for ``job`` in /dev/shm, or ``None`` where there is no /dev/shm to
    write (the files then land nowhere odc_hf could clean)."""
    directory = ipc_files.SHM_DIR
    if job is None or not (directory.is_dir() and os.access(directory, os.W_OK)):
        return None
    try:
        return ipc_files.IpcLedger(job, directory)
    except OSError as err:
        logger.warning("odc_hf: no ledger of CUDA IPC files in %s (%s): a killed rank's files stay there", directory, err)
        return None


def make_buffers(backend: str, group: dist.ProcessGroup, rank: int, world_size: int, device: torch.device,
                 job: str | None = None):  # fmt: skip
    """The allocator of peer-mapped buffers for ``backend`` (``symmetric_memory`` or ``ipc``); ``job``: the
    transport's job id, for the ledger of CUDA IPC's files."""
    if backend == "ipc":
        return IpcBuffers(group, rank, world_size, device, job=job)
    return SymmetricMemoryBuffers(group, rank, world_size, device)


def check_peer_mappings(views: list[torch.Tensor], rank: int, world_size: int, barrier) -> None:
    """Registration-time proof that peer mappings work: every rank writes its rank into the first byte of its own
    buffer, then reads every peer's byte through the mapping (and zeroes its own again).

    ``barrier(what)`` synchronises the ranks (the transport's host control block)."""
    views[rank][:1].fill_(rank + 1)
    torch.cuda.synchronize(views[rank].device)
    barrier("peer-memory check (write)")
    seen = [int(v[:1].item()) for v in views]
    barrier("peer-memory check (read)")
    views[rank][:1].zero_()
    torch.cuda.synchronize(views[rank].device)
    barrier("peer-memory check (reset)")
    wrong = [peer for peer in range(world_size) if seen[peer] != peer + 1]
    if wrong:
        raise ODCError(
            f"rank {rank}: peer memory does not work here: the buffers of ranks {wrong} read back "
            f"{[seen[p] for p in wrong]} instead of {[p + 1 for p in wrong]}. Try the other backend "
            "(ODC_CUDA_PEER_MEMORY=ipc or symmetric_memory), or set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False "
            "(docs/transports.md)"
        )
