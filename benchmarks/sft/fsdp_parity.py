"""ODC vs FSDP2 collectives on the same data: per-step losses, gradient norms and peak memory.

A Qwen2-shaped model (random init, bf16 compute, fp32 master weights, AdamW) trains N steps twice on the same
per-step samples: once with FSDP2's collectives (ranks must run equal microbatch counts, so the shorter
ranks are padded with zero-weighted microbatches: same gradients, extra compute), once with ODC where ranks
run their own uneven counts, including zero. Losses are normalised by the global token count.

    python -m benchmarks.sft.fsdp_parity --model 1.5b --steps 20 --out benchmarks/results   # 2 GPUs
    python -m benchmarks.sft.fsdp_parity --model tiny --steps 3 --world-size 2               # CPU smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import report


def _shapes() -> dict:
    """ "tiny" for CPU smoke runs; "1.5b" is Qwen2.5-1.5B from odc_hf.prediction.workloads (docs/design.md)."""
    from odc_hf.prediction.workloads import QWEN2_5_SHAPES

    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512)  # fmt: skip
    return {"tiny": tiny, "1.5b": QWEN2_5_SHAPES["1.5B"]}


SCHEDULE = [(3, 1), (1, 3), (2, 0), (0, 2), (4, 1)]  # per-rank microbatch counts, cycled


def counts_for(step: int, world_size: int) -> list[int]:
    base = SCHEDULE[step % len(SCHEDULE)]
    return [base[r % 2] for r in range(world_size)]


def sample(step: int, index: int, vocab: int, min_len: int, max_len: int):
    import torch

    g = torch.Generator().manual_seed(1_000 * step + index)
    length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
    return torch.randint(0, vocab, (1, length), generator=g)


def _run(rank, world_size, mode, args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from odc_hf.fsdp import install_odc, shard_model, sum_reduction

    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    config = Qwen2Config(**_shapes()[args.model], tie_word_embeddings=True, attn_implementation="sdpa",
                         use_cache=False, max_position_embeddings=32768)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else None
    shard_model(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    odc = None
    if mode == "odc":
        odc = install_odc(model, timeout_s=300)
        odc.attach_optimizer(opt)
    else:
        sum_reduction(model)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    steps = []
    for step in range(args.steps):
        counts = counts_for(step, world_size)
        start = sum(counts[:rank])
        mine = [
            sample(step, start + i, config.vocab_size, args.min_len, args.max_len)
            for i in range(counts[rank])
        ]
        every = [sample(step, i, config.vocab_size, args.min_len, args.max_len) for i in range(sum(counts))]
        total = sum(s.numel() - 1 for s in every)
        weights = [1.0] * len(mine)
        if mode == "fsdp":
            pad = max(counts) - len(mine)
            mine, weights = mine + [every[0]] * pad, weights + [0.0] * pad
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for ids, w in zip(mine, weights):
            ids = ids.to(device)
            logits = model(input_ids=ids).logits
            loss = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum")
            (loss * w / total).backward()
            loss_sum += loss.detach() * w
            del logits, loss
        if odc is not None:
            odc.finish_minibatch(sum(s.numel() - 1 for s, w in zip(mine, weights) if w))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        dist.all_reduce(loss_sum)
        steps.append({"step": step, "loss": float(loss_sum) / total, "grad_norm": norm, "seconds": elapsed,
                      "counts": counts})  # fmt: skip
    memory = {}
    if cuda:
        free, total_mem = torch.cuda.mem_get_info(device)
        memory = {
            "max_allocated_GiB": torch.cuda.max_memory_allocated(device) / 2**30,
            "max_reserved_GiB": torch.cuda.max_memory_reserved(device) / 2**30,
            "device_used_end_GiB": (total_mem - free) / 2**30,
        }
    if odc is not None:
        memory["odc_buffers_GiB"] = sum(
            u.spec.device_bytes for u in odc.units
        ) / 2**30  # fmt: skip
        odc.close()
    if cuda:  # symmetric-memory buffers are not in the caching allocator's statistics: add them
        memory["peak_allocated_plus_odc_GiB"] = memory["max_allocated_GiB"] + memory.get(
            "odc_buffers_GiB", 0.0
        )
    return {"steps": steps, "memory": memory}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["1.5b", "tiny"], default="1.5b")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--min-len", type=int, default=512)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("--out", default=str(report.RESULTS / "sft"))
    args = parser.parse_args(argv)
    import torch

    from odc_hf.testing import run_ranks

    cuda = torch.cuda.device_count() >= 2
    world_size = args.world_size or (torch.cuda.device_count() if cuda else 2)
    backend = "nccl" if cuda else "gloo"
    env = report.environment()
    results = {}
    for mode in ("fsdp", "odc"):
        results[mode] = run_ranks(_run, world_size, mode, args, backend=backend, timeout_s=3000)
    fsdp, odc = results["fsdp"][0]["steps"], results["odc"][0]["steps"]
    rel = [abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(odc, fsdp)]
    lines = [
        f"# ODC vs FSDP2 collectives: {args.model} Qwen2 shape, {world_size} ranks, {args.steps} steps\n",
        report.env_markdown(env),
        "Same samples per step; ODC ranks run uneven microbatch counts (zeros included); FSDP2 pads to the max.\n",
        *report.table(["step", "counts", "FSDP2 loss", "ODC loss", "rel. diff", "FSDP2 grad norm", "ODC grad norm",
                       "FSDP2 s", "ODC s"],
                      [[a["step"], a["counts"], f"{b['loss']:.5f}", f"{a['loss']:.5f}", f"{r:.1e}", f"{b['grad_norm']:.4f}",
                        f"{a['grad_norm']:.4f}", f"{b['seconds']:.3f}", f"{a['seconds']:.3f}"]
                       for a, b, r in zip(odc, fsdp, rel)], "rlrrrrrrr"),
    ]  # fmt: skip
    lines.append(f"\nmax relative loss difference: **{max(rel):.2e}**; median step time FSDP2 "
                 f"{statistics.median(s['seconds'] for s in fsdp):.3f} s, ODC {statistics.median(s['seconds'] for s in odc):.3f} s "
                 "(not a speed benchmark: FSDP2 also computes the padding microbatches).\n")  # fmt: skip
    keys = list(results["odc"][0]["memory"])
    lines += ["## Peak memory per rank (GiB)\n",
              *report.table(["rank", "mode", *keys],
                            [[rank, mode, *(f"{r['memory'].get(k, 0.0):.2f}" for k in keys)]
                             for mode in ("fsdp", "odc") for rank, r in enumerate(results[mode])],
                            "ll" + "r" * len(keys))]  # fmt: skip
    if "peak_allocated_plus_odc_GiB" in keys:
        ratio = max(r["memory"]["peak_allocated_plus_odc_GiB"] for r in results["odc"]) / max(
            r["memory"]["peak_allocated_plus_odc_GiB"] for r in results["fsdp"]
        )
        lines.append(f"\nODC / FSDP2 peak memory (allocated + ODC buffers, worst rank): **{ratio:.3f}**")
    md = "\n".join(lines) + "\n"
    stem = f"fsdp_parity_{args.model}_{report.hardware_tag(env)}_{report.today()}"
    report.write(
        args.out,
        stem,
        {"env": env, "args": vars(args), "results": results, "max_rel_loss_diff": max(rel)},
        md,
    )
    print(md)


if __name__ == "__main__":
    main()
