"""Gradient-norm clipping from the local shards, with ODC's barrier as the only reduction.

Under ODC every trainable ``param.grad`` is a DTensor over FSDP's mesh whose local part is a view of this rank's
accumulator (``adapter.finish_minibatch``). torch's ``clip_grad_norm_`` (and accelerate's DTensor-aware version)
reduces the partial norms with a functional all-reduce (``DTensor.full_tensor()``): one more collective, and one
that crashes on gloo with CUDA tensors (ranks sharing a GPU). Here each rank sums ``|g|^p`` over its own shards,
the ranks of the shard group add those sums at the transport's host barrier (rank order: bit-identical on every
rank; replicas of an HSDP mesh hold equal shards after the minibatch's replica sum, so the shard group's sum is the
whole model's), and every rank scales its shards by the same coefficient, as ``clip_grads_with_norm_`` does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def clip_grad_norm_(handle, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
                    ) -> torch.Tensor:  # fmt: skip
    """Clip the gradients of ``parameters`` (sharded by ``handle``'s model) to ``max_norm`` in the ``norm_type`` norm
    over the whole model; return the norm before clipping (a 0-d fp32 tensor on the gradients' device).

    ``norm_type`` may be any finite p >= 1 or ``inf``; ``max_norm=inf`` only computes the norm.
    """
    norm_type = float(norm_type)
    if not (norm_type >= 1.0):  # NaN fails too
        raise ValueError(f"norm_type must be >= 1 or inf, got {norm_type}")
    with torch.no_grad():  # (a block, not a decorator: mutation testing mutates undecorated functions only)
        grads = [_local(p.grad) for p in parameters if p.grad is not None]
        grads = [g for g in grads if g.numel()]
        device = grads[0].device if grads else handle._device()
        if math.isinf(norm_type):
            local = float(torch.stack([g.detach().abs().max().float() for g in grads]).max()) if grads else 0.0
            total = handle.reduce_max(local)
        else:
            # fp64 partial sums, one host sync for all of them
            powers = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float64) ** norm_type for g in grads]
            local = float(torch.stack([p.to(device) for p in powers]).sum()) if powers else 0.0
            total = handle.reduce_sum(local, what="gradient-norm barrier") ** (1.0 / norm_type)
        total_norm = torch.tensor(total, dtype=torch.float32, device=device)
        if max_norm != float("inf"):
            coefficient = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)  # as torch's clip_grads_with_norm_
            for g in grads:
                g.mul_(coefficient)
        return total_norm
