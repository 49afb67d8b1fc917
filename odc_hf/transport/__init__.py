"""One-sided ODC primitives: gather of published parameter shards, scatter-accumulate of gradients."""

from odc_hf.transport.base import (
    DEFAULT_TIMEOUT_S,
    ODCError,
    PeerFailedError,
    PeerTimeoutError,
    Transport,
    UnitSpec,
)
from odc_hf.transport.shm import ShmTransport


def make_transport(
    group=None, *, device=None, timeout_s: float = DEFAULT_TIMEOUT_S, shm_dir=None, peer_memory: str = "auto",
    deterministic: bool = False,
) -> Transport:
    """The transport for ``device``: CUDA peer memory on GPUs (``peer_memory``: ``auto``, ``symmetric_memory`` or
    ``ipc``, see :mod:`odc_hf.transport.peer_memory`), shared memory on CPU (always deterministic).
    ``deterministic``: bit-reproducible accumulation on CUDA (one slot per sender) instead of atomics."""
    import torch

    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        from odc_hf.transport.cuda import CudaTransport

        return CudaTransport(group, timeout_s=timeout_s, device=device, shm_dir=shm_dir, peer_memory=peer_memory,
                             deterministic=deterministic)  # fmt: skip
    if device.type == "cpu":
        return ShmTransport(group, timeout_s=timeout_s, shm_dir=shm_dir)
    raise NotImplementedError(f"no ODC transport for device type {device.type!r} (supported: cuda, cpu)")


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ODCError",
    "PeerFailedError",
    "PeerTimeoutError",
    "ShmTransport",
    "Transport",
    "UnitSpec",
    "make_transport",
]
