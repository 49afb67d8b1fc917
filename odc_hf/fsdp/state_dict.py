"""A full state dict of a ``fully_shard``-ed model gathered through CPU tensors.

``get_model_state_dict(..., full_state_dict=True)`` (and accelerate's ``get_state_dict``) calls
``DTensor.full_tensor()`` on every sharded parameter: a functional all-gather on the parameter's device, which
crashes on a gloo process group with CUDA tensors (ranks sharing a GPU). Here each shard is copied to the CPU and
gathered there, over a CPU copy of the parameter's device mesh (same ranks, same layout), so torch's own DTensor
logic (uneven dim-0 chunks included) assembles the full tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

_CPU_MESHES: dict[tuple, DeviceMesh] = {}


def cpu_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """A CPU (gloo) device mesh over the same ranks and dims as ``mesh`` (collective the first time: every rank of
    the default group must ask for the same meshes in the same order)."""
    key = (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), mesh.mesh_dim_names)
    found = _CPU_MESHES.get(key)
    if found is None:
        found = DeviceMesh("cpu", mesh.mesh.clone(), mesh_dim_names=mesh.mesh_dim_names)
        _CPU_MESHES[key] = found
    return found


@torch.no_grad()
def full_tensor_on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole, on the CPU; a DTensor is gathered over a CPU copy of its mesh (a collective)."""
    if not isinstance(tensor, DTensor):
        return tensor.detach().cpu()
    local = tensor.to_local().detach().cpu()
    on_cpu = DTensor.from_local(local, cpu_mesh(tensor.device_mesh), tensor.placements, run_check=False,
                                shape=tensor.shape, stride=tensor.stride())  # fmt: skip
    return on_cpu.full_tensor()


def full_state_dict(model: torch.nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Collective: ``model.state_dict()`` with every tensor whole and on the CPU; with ``rank0_only`` the other ranks
    take part in the gathers and get an empty dict (accelerate's FSDP2 ``get_state_dict`` convention)."""
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    result: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        full = full_tensor_on_cpu(tensor)
        if keep:
            result[name] = full
    return result
