"""Shared pieces of the FSDP adapter tests: a tiny Qwen2, seeded microbatches, and one training loop that runs
as a single process (reference), as FSDP2 with collectives, or as FSDP2 with ODC."""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB = 256


def tiny_qwen2(seed: int = 0, *, tie: bool = True, layers: int = 2):
    from transformers import Qwen2ForCausalLM

    from odc_hf.testing.data import tiny_qwen2_config

    config = tiny_qwen2_config(VOCAB, num_layers=layers, tie_word_embeddings=tie, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def schedule(counts: tuple[int, ...], minibatch: int) -> tuple[int, ...]:
    """Per-rank microbatch counts of a minibatch: ``counts`` rotated, so every rank sometimes runs zero."""
    k = minibatch % len(counts)
    return counts[k:] + counts[:k]


def microbatch(minibatch: int, index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * minibatch + index)
    length = int(torch.randint(8, 33, (1,), generator=g))
    return torch.randint(0, VOCAB, (1, length), generator=g)


def rank_microbatches(counts, minibatch: int, rank: int) -> list[torch.Tensor]:
    per_rank = schedule(counts, minibatch)
    start = sum(per_rank[:rank])
    return [microbatch(minibatch, start + i) for i in range(per_rank[rank])]


def all_microbatches(counts, minibatch: int) -> list[torch.Tensor]:
    return [microbatch(minibatch, i) for i in range(sum(schedule(counts, minibatch)))]


def loss_sum(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids.to(next(model.parameters()).device)).logits.float()
    return F.cross_entropy(logits[0, :-1], ids[0, 1:].to(logits.device), reduction="sum")


def tokens(batch: list[torch.Tensor]) -> int:
    return sum(ids.numel() - 1 for ids in batch)


def full(t) -> torch.Tensor:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from odc_hf.fsdp.state_dict import full_tensor_on_cpu

    if isinstance(t, DTensor) and t.device.type == "cuda" and "gloo" in str(dist.get_backend()):
        return full_tensor_on_cpu(t).float().clone()  # ranks sharing a GPU: no functional collectives on CUDA
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu().clone()


def snapshot(model, grads: bool) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters or gradients; collective under FSDP, so every rank calls it."""
    out = {}
    for name, p in model.named_parameters():
        if grads:
            out[name] = full(p.grad) if p.grad is not None else torch.zeros(p.shape)
        else:
            out[name] = full(p)
    return out


def make_optimizer(model):
    # SGD with momentum, not Adam: Adam's first steps are ~lr * sign(grad), so a 1e-7 summation-order
    # difference in a near-zero gradient element flips a whole lr-sized update and the parameter comparison
    # would measure that chaos instead of ODC's correctness. Momentum still exercises optimizer state.
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.01)


def reference_run(counts, minibatches: int, max_norm: float = 1.0, *, tie: bool = True):
    """Single process, every microbatch of every rank, loss normalised by the minibatch's token count."""
    model = tiny_qwen2(tie=tie)
    opt = make_optimizer(model)
    record = []
    for m in range(minibatches):
        batch = all_microbatches(counts, m)
        total = tokens(batch)
        for ids in batch:
            (loss_sum(model, ids) / total).backward()
        grads = snapshot(model, grads=True)
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        opt.step()
        opt.zero_grad()
        record.append({"grads": grads, "norm": norm, "params": snapshot(model, grads=False), "tokens": total})
    return record


def save_checkpoint(model, opt, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def load_checkpoint(model, opt, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


STARTED: dict[int, float] = {}
"""``time.monotonic()`` at the start of each minibatch of the last ``distributed_run`` in this process."""


def distributed_run(rank, world_size, counts, minibatches, mode, policy="fp32", *, start=0, save_after=None,
                    load_from=None, checkpoint_dir=None, max_norm=1.0, fail_rank=None, fail_mode="raise",
                    mesh_shape=None, timeout_s=30, tie=True, deterministic=False, delays=None,
                    evaluate=False):  # fmt: skip
    """FSDP2 on the tiny Qwen2 with ``mode`` "odc" (uneven microbatch counts) or "fsdp" (collectives; counts
    padded to the max with zero-weighted microbatches). Returns rank 0's record of grads/norms/params (and, under
    ODC, ``odc``: the handle's one-line description, transport and accumulation mode included).

    ``mesh_shape=(R, S)``: HSDP on a ``(replicate, shard)`` mesh (FSDP2's own all-reduce per microbatch in
    "fsdp" mode). ``fail_rank`` raises (``fail_mode="raise"``) or dies (``"die"``) in minibatch 1. ``delays``: seconds
    each rank waits before its microbatches of every minibatch (ranks' pushes forced into an order). ``evaluate``: every
    rank runs one forward without gradients (an evaluation) before each minibatch."""
    import os
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from odc_hf.fsdp import install_odc, shard_model, sum_reduction
    from odc_hf.testing import rank_device

    device = rank_device()  # cuda:<rank % GPUs> under run_ranks(cuda=True): ranks may share a GPU (gloo)
    model = tiny_qwen2(tie=tie).to(device)
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if policy == "bf16"
        else None
    )
    mesh = None
    if mesh_shape is not None:
        mesh = init_device_mesh(device.type, mesh_shape, mesh_dim_names=("replicate", "shard"))
    shard_model(model, mp_policy=mp, mesh=mesh)
    opt = make_optimizer(model)
    odc = None
    if mode == "odc":
        odc = install_odc(model, timeout_s=timeout_s, deterministic=deterministic)
        odc.attach_optimizer(opt)
    else:
        sum_reduction(model)  # SUM, like ODC and the reference (gloo has no PREMUL_SUM)
    if load_from is not None:
        load_checkpoint(model, opt, load_from)
        if odc is not None:
            odc.publish()  # peers must read the loaded shards, not the freshly initialised ones
    record = []
    for m in range(start, minibatches):
        mine = rank_microbatches(counts, m, rank)
        total = tokens(all_microbatches(counts, m))
        weights = [1.0] * len(mine)
        if mode == "fsdp":
            pad = max(schedule(counts, m)) - len(mine)
            mine, weights = mine + [microbatch(m, 0)] * pad, weights + [0.0] * pad
        guard = odc.failure_guard() if odc is not None else _nullcontext()
        if fail_rank is not None and m == 1:
            # The failure below must hit ODC's waits, not this harness's collectives (snapshots, the clip) that
            # slower ranks may still be in: a rank dying inside one of those fails its peers through that
            # collective's own error. So everyone leaves minibatch 0 first.
            dist.barrier()
        if evaluate:  # FSDP2 leaves the units that do not reshard after forward (the root) gathered afterwards
            with torch.no_grad():
                model.eval()
                loss_sum(model, microbatch(m, 0))
                model.train()
        STARTED[m] = time.monotonic()
        if delays is not None:
            time.sleep(delays[rank])
        first_pushed = None  # wall-clock time this rank's first microbatch had pushed its gradients (CPU: in backward)
        with guard:
            for i, (ids, w) in enumerate(zip(mine, weights)):
                if fail_rank == rank and m == 1 and i == 0:
                    time.sleep(1.0)  # mid-minibatch: the others are computing or already waiting in ODC
                    if fail_mode == "die":
                        os._exit(3)
                    raise RuntimeError("data loader exploded")
                (loss_sum(model, ids) * w / total).backward()
                first_pushed = time.time() if first_pushed is None else first_pushed
        pushed_at = None
        if delays is not None:  # the order the ranks' first pushes happened in, so a test can show it was forced
            pushed_at = [None] * world_size
            dist.all_gather_object(pushed_at, first_pushed)
        if odc is not None:
            if mesh_shape is not None:
                check_partial_reduce_outputs(odc)
            got = odc.finish_minibatch(tokens(mine))
            assert got == total, (got, total)
        grads = snapshot(model, grads=True)
        norm = clip(model, max_norm, odc)
        opt.step()
        opt.zero_grad()
        record.append({"grads": grads, "norm": norm, "params": snapshot(model, grads=False), "tokens": total,
                       "counts": schedule(counts, m), "odc": odc.describe() if odc is not None else None,
                       "pushed_at": pushed_at})  # fmt: skip
        if save_after == m:
            save_checkpoint(model, opt, checkpoint_dir)
    if odc is not None:
        odc.close()
    return record if rank == 0 else None


def clip(model, max_norm: float, odc) -> float:
    """Clip the gradients; the norm before clipping. ODC: odc_hf's clipping (``ODCHandle.clip_grad_norm_``, the code
    under test: fp64 sums of the local shards at ODC's barrier). FSDP2 collectives, the reference: torch's own
    ``torch.nn.utils.clip_grad_norm_`` on the DTensor gradients (fp32 norms reduced by a functional all-reduce), or,
    where functional collectives cannot run (gloo with CUDA tensors: ranks sharing a GPU; they crash there), torch's
    ``get_total_norm`` of the DTensor gradients reduced through CPU tensors, then torch's ``clip_grads_with_norm_``.

    The two norms differ by rounding (fp64 vs fp32 sums), so the clipped updates may differ in the last bit; under bf16
    compute such a bit can flip a parameter's bf16 rounding. Comparisons that must stay bitwise (ODC vs FSDP2 in bf16)
    run without clipping (``max_norm`` above every norm: the coefficient is exactly 1 in both modes)."""
    import torch.distributed as dist
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    from odc_hf.fsdp.state_dict import full_tensor_on_cpu

    if odc is not None:
        return float(odc.clip_grad_norm_(model.parameters(), max_norm))
    params = [p for p in model.parameters() if p.grad is not None]
    if params[0].device.type == "cuda" and "gloo" in str(dist.get_backend()):
        total = full_tensor_on_cpu(get_total_norm([p.grad for p in params])).to(params[0].device)
        clip_grads_with_norm_(params, max_norm, total)
        return float(total)
    return float(full(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))


def check_partial_reduce_outputs(odc) -> None:
    """HSDP: what FSDP2 keeps as its partial reduce-scatter output must be ODC's shared zero buffer, still zero
    (no gradient memory of its own); on a shard group of one rank it is the accumulator itself (not checked)."""
    from odc_hf.fsdp import internals

    if odc.world_size == 1:
        return
    buffers = [b for b in odc._zero_outputs.values()]
    for unit in odc.units:
        kept = internals.partial_reduce_output(unit.param_group)
        if kept is None:
            continue  # no microbatch yet on this rank
        assert any(kept.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in buffers), unit.name
        assert not kept.any(), f"{unit.name}: the zero buffer was written"


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


def max_rel_error(a: dict, b: dict) -> float:
    worst = 0.0
    for k in a:
        denom = b[k].norm().item() or 1.0
        worst = max(worst, (a[k] - b[k]).norm().item() / denom)
    return worst
