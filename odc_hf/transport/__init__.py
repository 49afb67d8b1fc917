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
    group=None, *, device=None, timeout_s: float = DEFAULT_TIMEOUT_S, shm_dir=None
) -> Transport:
    """The transport for ``device``: CUDA symmetric memory on GPUs, shared memory on CPU."""
    import torch

    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        from odc_hf.transport.cuda import CudaTransport

        return CudaTransport(group, timeout_s=timeout_s, device=device, shm_dir=shm_dir)
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
