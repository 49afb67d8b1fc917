"""ODC primitives vs NCCL collectives on one node, same bytes, interleaved; plus owner non-intrusiveness.

* gather: ODC ``gather`` (copy-engine reads of each peer's bf16 staging buffer) vs NCCL
  ``all_gather_into_tensor``; size = bytes of one rank's shard.
* scatter-accumulate: ODC ``scatter_accumulate`` (Triton fp32 system-scope atomics into each owner's
  accumulator) vs NCCL ``reduce_scatter_tensor`` in fp32 (what FSDP2 runs with ``reduce_dtype=float32``);
  size = bytes of one rank's fp32 output shard; ODC with fp32 and with bf16 sources.
* non-intrusiveness: rank 0 (the owner) runs a bf16 matmul loop, alone and while every peer gathers from it
  and pushes into it; reported as the owner's slowdown.

Each measurement is the max over ranks of a CUDA-event time (a collective is only done when every rank is),
repeated; candidates alternate within each repetition; medians and ratios are reported.

    python -m benchmarks.transport.primitives --out benchmarks/results            # all visible GPUs
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.common import report

MB = 2**20


def _time(fn, stream) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        fn()
        end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _sync_all():
    import torch
    import torch.distributed as dist

    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()


def _bench_size(transport, size, reps, world_size, device, side, main, record):
    import torch
    import torch.distributed as dist

    from odc_hf.transport import UnitSpec

    g_numel, r_numel = size * MB // 2, size * MB // 4
    g_unit = transport.register(
        UnitSpec(name=f"gather{size}", shard_numel=g_numel, param_dtype=torch.bfloat16)
    )
    r_unit = transport.register(UnitSpec(name=f"rs{size}", shard_numel=r_numel, param_dtype=torch.bfloat16))
    transport.staging(g_unit).normal_()
    shard = torch.randn(g_numel, device=device).to(torch.bfloat16)
    gathered = torch.empty(world_size * g_numel, dtype=torch.bfloat16, device=device)
    rs_in32 = torch.randn(world_size * r_numel, device=device)
    rs_in16 = rs_in32.to(torch.bfloat16)
    rs_out = torch.empty(r_numel, device=device)
    candidates = {
        "nccl_all_gather": (lambda: dist.all_gather_into_tensor(gathered, shard), main),
        "odc_gather": (lambda: transport.gather(g_unit, gathered), side),
        "nccl_reduce_scatter_fp32": (lambda: dist.reduce_scatter_tensor(rs_out, rs_in32), main),
        "odc_scatter_accumulate_fp32": (lambda: transport.scatter_accumulate(r_unit, rs_in32), side),
        "odc_scatter_accumulate_bf16": (lambda: transport.scatter_accumulate(r_unit, rs_in16), side),
    }
    names = list(candidates)
    for rep in range(reps + 2):  # two warm-up repetitions
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            fn, stream = candidates[name]
            _sync_all()
            ms = _time(fn, stream)
            if rep >= 2:
                record(f"{name}@{size}", ms)
    _sync_all()
    transport.barrier(what="benchmark barrier")
    transport.take_accumulated(r_unit)


def _bench_rank(rank, world_size, sizes_mb, reps, matmul_reps):
    import torch

    from odc_hf.transport import UnitSpec
    from odc_hf.transport.cuda import CudaTransport

    device = torch.device("cuda", rank)
    transport = CudaTransport(device=device, timeout_s=300)
    side = torch.cuda.Stream(device)
    main = torch.cuda.current_stream(device)
    times: dict[str, list[float]] = {}

    def record(key, ms):
        times.setdefault(key, []).append(ms)

    for size in sizes_mb:
        _bench_size(transport, size, reps, world_size, device, side, main, record)
        torch.cuda.empty_cache()

    # Owner non-intrusiveness: rank 0 computes, the peers read from it and push into it.
    size = 256
    g_unit = transport.register(
        UnitSpec(name="intrusion", shard_numel=size * MB // 4, param_dtype=torch.float32)
    )
    gathered = torch.empty(world_size * size * MB // 4, device=device)
    pushed = torch.randn(world_size * size * MB // 4, device=device)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    c = torch.empty_like(a)

    def matmuls():
        for _ in range(matmul_reps):
            torch.mm(a, b, out=c)

    matmuls()
    _sync_all()
    alone_ms = _time(matmuls, main)
    peer_iter_ms = _time(
        lambda: (transport.gather(g_unit, gathered), transport.scatter_accumulate(g_unit, pushed)), side
    )
    peer_iters = int(2.0 * alone_ms / max(peer_iter_ms, 1e-3)) + 1
    for rep in range(reps):
        for busy in (False, True) if rep % 2 == 0 else (True, False):
            _sync_all()
            if rank == 0:
                record("owner_matmul_busy" if busy else "owner_matmul_alone", _time(matmuls, main))
            elif busy:
                with torch.cuda.stream(side):
                    for _ in range(peer_iters):
                        transport.gather(g_unit, gathered)
                        transport.scatter_accumulate(g_unit, pushed)
            torch.cuda.synchronize()
    _sync_all()
    transport.barrier(what="benchmark barrier")
    transport.close()
    flops = 2 * 8192**3 * matmul_reps
    return {"times": times, "peer_iters": peer_iters, "matmul_flops": flops}


def summarise(per_rank: list[dict], sizes_mb: list[int], world_size: int) -> dict:
    keys = per_rank[0]["times"].keys()
    # A repetition is done when the slowest rank is done.
    worst = {k: [max(r["times"][k][i] for r in per_rank if k in r["times"]) for i in range(len(per_rank[0]["times"][k]))]
             for k in keys}  # fmt: skip
    med = {k: statistics.median(v) for k, v in worst.items()}
    spread = {k: (min(v), max(v)) for k, v in worst.items()}
    rows = []
    for size in sizes_mb:
        ag, og = med[f"nccl_all_gather@{size}"], med[f"odc_gather@{size}"]
        rs = med[f"nccl_reduce_scatter_fp32@{size}"]
        o32, o16 = med[f"odc_scatter_accumulate_fp32@{size}"], med[f"odc_scatter_accumulate_bf16@{size}"]
        moved = (world_size - 1) * size * MB / 1e9  # GB each rank receives (gather) / sends (scatter)
        rows.append({
            "size_mb_per_rank": size,
            "nccl_all_gather_ms": ag, "odc_gather_ms": og, "gather_speedup": ag / og,
            "odc_gather_GBps": moved / (og / 1e3), "nccl_all_gather_busbw_GBps": moved / (ag / 1e3),
            "nccl_reduce_scatter_ms": rs, "odc_scatter_fp32_ms": o32, "odc_scatter_bf16_ms": o16,
            "scatter_fp32_ratio": rs / o32, "scatter_bf16_ratio": rs / o16,
        })  # fmt: skip
    alone, busy = med["owner_matmul_alone"], med["owner_matmul_busy"]
    flops = per_rank[0]["matmul_flops"]
    return {
        "rows": rows,
        "owner": {
            "matmul_alone_ms": alone, "matmul_busy_ms": busy, "slowdown": busy / alone - 1,
            "alone_TFLOPs": flops / alone / 1e9, "peer_iterations": per_rank[1]["peer_iters"] if world_size > 1 else 0,
        },
        "spread": spread,
    }  # fmt: skip


def markdown(summary: dict, env: dict, reps: int, world_size: int) -> str:
    from benchmarks.common.report import env_markdown, table

    lines = [
        f"# ODC primitives vs NCCL, {world_size} GPUs\n",
        env_markdown(env),
        f"Medians over {reps} interleaved repetitions of the max-over-ranks CUDA-event time. Ratios > 1 mean ODC is faster.\n",
        *table(
            ["MB/rank", "NCCL all-gather ms", "ODC gather ms", "gather x", "ODC gather GB/s", "NCCL RS fp32 ms",
             "ODC scatter fp32 ms", "x", "ODC scatter bf16 ms", "x"],
            [[r["size_mb_per_rank"], f"{r['nccl_all_gather_ms']:.3f}", f"{r['odc_gather_ms']:.3f}",
              f"{r['gather_speedup']:.2f}", f"{r['odc_gather_GBps']:.0f}", f"{r['nccl_reduce_scatter_ms']:.3f}",
              f"{r['odc_scatter_fp32_ms']:.3f}", f"{r['scatter_fp32_ratio']:.2f}", f"{r['odc_scatter_bf16_ms']:.3f}",
              f"{r['scatter_bf16_ratio']:.2f}"] for r in summary["rows"]],
            "r" * 10,
        ),
    ]  # fmt: skip
    o = summary["owner"]
    lines += [
        "",
        "## Owner non-intrusiveness",
        f"Rank 0 runs bf16 8192^3 matmuls ({o['alone_TFLOPs']:.0f} TFLOP/s alone): {o['matmul_alone_ms']:.2f} ms alone, "
        f"{o['matmul_busy_ms']:.2f} ms while the peers gather 256 MB from it and push 256 MB into it "
        f"({o['peer_iterations']} iterations each): slowdown **{100 * o['slowdown']:.1f}%**.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--matmul-reps", type=int, default=50)
    parser.add_argument("--world-size", type=int, default=None, help="default: all visible GPUs")
    parser.add_argument("--out", default=str(report.RESULTS / "transport"))
    args = parser.parse_args(argv)
    import torch

    from odc_hf.testing import run_ranks

    world_size = args.world_size or torch.cuda.device_count()
    if world_size < 2:
        raise SystemExit("the primitives benchmark needs at least 2 CUDA GPUs")
    env = report.environment()
    per_rank = run_ranks(_bench_rank, world_size, args.sizes_mb, args.reps, args.matmul_reps,
                         backend="nccl", timeout_s=1800)  # fmt: skip
    summary = summarise(per_rank, args.sizes_mb, world_size)
    md = markdown(summary, env, args.reps, world_size)
    stem = f"primitives_{report.hardware_tag(env)}_{report.today()}"
    report.write(args.out, stem, {"env": env, "args": vars(args), "summary": summary, "raw": per_rank}, md)
    print(md)


if __name__ == "__main__":
    main()
