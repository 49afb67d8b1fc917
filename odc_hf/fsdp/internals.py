"""The only place odc_hf reads FSDP2 internals (read-only), with explicit version checks.

FSDP2's public hooks (``set_custom_all_gather`` / ``set_custom_reduce_scatter``) hand us flat buffers; to know
what is in them we need each unit's layout: the ``FSDPParam`` list of the module's param group, in that order,
with each parameter's padded shard size. Those live on private objects. Everything we touch is listed here and
checked by ``tests/fsdp/test_fsdp_internals.py`` against the installed torch (2.11 on the GPU image, 2.13 on CPU).
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from odc_hf.version import require_torch

FSDP_PARAM_ATTRIBUTES = ("padded_sharded_param_size", "sharded_size", "contiguous_sharded_stride",
                         "sharded_param", "offload_to_cpu", "fsdp_placement", "mp_policy")  # fmt: skip


def param_groups(module: FSDPModule) -> list:
    """The FSDPParamGroups of an FSDPModule (torch 2.13 may have several; 2.11 has at most one)."""
    require_torch("2.9", "odc_hf's FSDP2 adapter (custom all-gather / reduce-scatter hooks)")
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:  # torch >= 2.12
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def group_modules(group) -> tuple:
    """The modules one ``fully_shard`` call grouped into ``group`` (FSDPParamGroup.modules, torch 2.11 and 2.13)."""
    return tuple(group.modules)


def fsdp_params(group) -> list:
    params = list(group.fsdp_params)
    for p in params:
        missing = [a for a in FSDP_PARAM_ATTRIBUTES if not hasattr(p, a)]
        if missing:
            raise RuntimeError(
                f"torch {torch.__version__}: FSDPParam lacks {missing}; odc_hf's adapter was checked on torch 2.11 and 2.13"
            )
    return params


def mesh_info(group):
    return group.mesh_info, group.post_forward_mesh_info


def mesh_dims(info) -> tuple[int, int | None]:
    """``(shard dim, replicate dim or None)`` of FSDP's data-parallel mesh: (0, None) FSDP, (1, 0) HSDP."""
    return info.shard_mesh_dim, info.replicate_mesh_dim


def uses_spmd_mesh(info) -> bool:
    """torch >= 2.13: ``fully_shard(dp_mesh_dims=...)`` shards over named dims of a larger (e.g. TP) mesh."""
    return bool(getattr(info, "is_spmd_mesh", False))


def all_reduce_enabled(group) -> bool:
    """Whether FSDP2 will all-reduce this group's gradients across replicas (HSDP) after each reduce-scatter;
    ``FSDPModule.set_requires_all_reduce`` / ``set_requires_gradient_sync`` set it."""
    return group.all_reduce_grads


def partial_reduce_output(group):
    """HSDP with ``set_requires_all_reduce(False)``: the reduce-scatter output FSDP2 keeps and adds later outputs
    into (``None`` until the group's first reduce-scatter). Under ODC it must stay the shared zero buffer; on a
    shard group of one rank (R x 1 mesh, no reduce-scatter hook runs) it *is* the gradient accumulator."""
    return group._partial_reduce_output


def all_gather_dtype(params: list) -> set:
    """The dtype(s) FSDP will all-gather in: each parameter's policy ``param_dtype`` if set, else its own dtype.

    The policy is ``FSDPParam.mp_policy`` (torch 2.11 to 2.14: the group's; torch >= 2.15 resolves one per parameter
    and its param group no longer holds one). ``FSDPParam.param_dtype`` is only set at FSDP's lazy init, after we
    install; the policy is there at once.
    """
    return {fp.mp_policy.param_dtype or fp.sharded_param.dtype for fp in params}
