"""Why do some ODC microbatches run slower than their cost? Time fixed microbatch layouts on 2 GPUs.

The 2×H200 end-to-end run (``sft_e2e_h200x2_2026-11-29``) measured LB-Mini's packed multi-document rows at
~1.25x their predicted time while LB-Micro's rows and single-document rows ran at ~1.05x. This probe runs the
ODC model of ``sft_e2e.py`` on hand-picked per-rank layouts, alone (peer idle), aligned (both ranks the same
row) and misaligned (the exact C and D plans of that run's steps 1 and 7), each ``--repeats`` times after a
warm-up, and reports every microbatch's time (CUDA events) against the cost model. Optional knobs run the same
cases again: ``--max-ctas`` (cap on the ODC accumulate kernel's grid) and ``--profile`` (torch.profiler
summaries of two cases: top kernels, host syncs).

    python -m benchmarks.sft.microbatch_probe --out $OUT                 # all GPUs of the host (2)
    python -m benchmarks.sft.microbatch_probe --model tiny --world-size 2 --scale 0.01 --repeats 1   # CPU check
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks.common import report

# per case: rank 0's microbatches, rank 1's microbatches (document lengths)
CASES = {
    "solo_single": ([[28672]], []),
    "solo_multi": ([[17355, 11957]], []),
    "solo_separate": ([[17355], [11957]], []),
    "aligned_single": ([[28672]], [[28672]]),
    "aligned_multi": ([[17355, 11957]], [[17355, 11957]]),
    "aligned_multi_reversed": ([[11957, 17355]], [[11957, 17355]]),
    "multi_vs_single": ([[17355, 11957]], [[29312]]),
    "step1_C": ([[9030, 17355], [11957, 12448]], [[15238, 9118], [11788, 12950]]),
    "step1_D": ([[17355, 11957], [11788, 9030]], [[15238, 12950], [12448, 9118]]),
    "step7_C": ([[32768], [9404, 13267], [13667]], [[24076], [20039], [12211, 9472]]),
    "step7_D": ([[32768], [13267, 9472, 9404]], [[20039, 12211], [24076], [13667]]),
}
PROFILED = ("aligned_multi", "step1_D")


def _run(rank, world_size, args):
    import torch
    import torch.distributed as dist

    from benchmarks.common.sft_setup import (
        build_model,
        calibrate_cost_model,
        model_config,
        run_step,
        sample_ids,
    )
    from odc_hf import attention
    from odc_hf.integrations.trainer.bundle import BundleCollator
    from odc_hf.integrations.trainer.stats import DeviceClock

    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    clock = DeviceClock(device)
    config = model_config(args)
    cost_model, points = calibrate_cost_model(rank, world_size, args, device, config)
    model, optimizer, odc, _ = build_model("odc", config, device, args)
    collator = BundleCollator(max_tokens_per_microbatch=args.max_tokens, truncate=True, pad_token_id=0)
    results = {"calibration": {"points": points, **cost_model.to_dict(), "describe": cost_model.describe()},
               "cases": []}  # fmt: skip

    if cuda:  # the capped accumulate kernel must add exactly what the uncapped one does
        import os

        from odc_hf.transport.cuda import atomic_accumulate

        src = torch.randn(3_000_001, device=device, dtype=torch.bfloat16)
        ref = torch.zeros(src.numel(), device=device)
        atomic_accumulate(ref, src)
        for cap in args.max_ctas:
            os.environ["ODC_ACCUMULATE_MAX_CTAS"] = str(cap)
            out = torch.zeros_like(ref)
            atomic_accumulate(out, src)
            torch.cuda.synchronize(device)
            if not torch.equal(out, ref):
                raise RuntimeError(f"capped accumulate kernel ({cap} CTAs) differs from the uncapped one")
        os.environ.pop("ODC_ACCUMULATE_MAX_CTAS", None)

    def scaled(mbs):
        return [[max(2, int(s * args.scale)) for s in mb] for mb in mbs]

    def run_case(name, layout, tag):
        mine = scaled(layout[rank]) if rank < 2 else []
        examples = [[{"input_ids": sample_ids(0, 0, 100 * j + i, s, config.vocab_size)} for i, s in enumerate(mb)]
                    for j, mb in enumerate(mine)]  # fmt: skip
        batches = collator(examples)
        labels = sum(s - 1 for lay in layout for mb in scaled(lay) for s in mb)
        reps = []
        for rep in range(args.repeats + 1):
            syncs = attention.CALLS["bounds_sync"]
            rec = run_step(model, optimizer, odc, batches, labels, device, clock)
            rec["bounds_sync"] = attention.CALLS["bounds_sync"] - syncs
            if rep:
                reps.append(rec)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, reps)
        if rank == 0:
            per_rank = []
            for r, recs in enumerate(gathered):
                lay = scaled(layout[r]) if r < 2 else []
                ends = [[0.0] + rec["mb_end_s"] for rec in recs]
                mb = []
                for j, docs in enumerate(lay):
                    times = [e[j + 1] - e[j] for e in ends]
                    pred = cost_model.microbatch_cost(docs)
                    mb.append({"docs": docs, "seconds": times, "median_s": statistics.median(times),
                               "predicted_s": pred, "ratio": statistics.median(times) / pred})  # fmt: skip
                per_rank.append({"microbatches": mb, "bounds_sync": [rec["bounds_sync"] for rec in recs],
                                 "wall_s": [rec["wall_s"] for rec in recs]})  # fmt: skip
            row = {"case": name, "tag": tag, "ranks": per_rank}
            results["cases"].append(row)
            text = "; ".join(
                f"r{r}: " + ", ".join(f"{m['docs']} {m['median_s']:.3f}/{m['predicted_s']:.3f}" for m in pr["microbatches"])
                for r, pr in enumerate(per_rank)
            )
            print(f"[{tag}] {name}: {text}", flush=True)

    import os

    settings = [("default", None)] + [(f"max_ctas={c}", c) for c in args.max_ctas]
    for name, layout in CASES.items():
        for tag, cap in settings:
            if cap is None:
                os.environ.pop("ODC_ACCUMULATE_MAX_CTAS", None)
            else:
                os.environ["ODC_ACCUMULATE_MAX_CTAS"] = str(cap)
            run_case(name, layout, tag)
    os.environ.pop("ODC_ACCUMULATE_MAX_CTAS", None)

    if args.profile and cuda:
        from torch.profiler import ProfilerActivity, profile

        for name in PROFILED:
            layout = CASES[name]
            mine = scaled(layout[rank]) if rank < 2 else []
            examples = [[{"input_ids": sample_ids(0, 0, 100 * j + i, s, config.vocab_size)} for i, s in enumerate(mb)]
                        for j, mb in enumerate(mine)]  # fmt: skip
            batches = collator(examples)
            labels = sum(s - 1 for lay in layout for mb in scaled(lay) for s in mb)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run_step(model, optimizer, odc, batches, labels, device, clock)
            table_gpu = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70)
            table_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"microbatch_probe_profile_{name}_rank{rank}.txt").write_text(
                f"# {name}, rank {rank}: by self CUDA time\n{table_gpu}\n\n# by self CPU time\n{table_cpu}\n"
            )
    odc.close()
    return results if rank == 0 else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="1.5B", choices=("1.5B", "tiny"))
    parser.add_argument("--max-tokens", type=int, default=32768)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every document length (CPU checks)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-ctas", default="", help="comma-separated grid caps for the accumulate kernel")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--calibration-lengths", default="512,2048,4096,8192,16384,24576,32768")
    parser.add_argument("--calibration-repeats", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("--out", default=str(report.RESULTS / "sft"))
    args = parser.parse_args(argv)
    args.max_ctas = [int(x) for x in args.max_ctas.split(",") if x.strip()]
    args.calibration_lengths = [max(2, int(int(x) * args.scale)) for x in args.calibration_lengths.split(",")]
    args.max_tokens = max(2, int(args.max_tokens * args.scale))

    import torch

    from benchmarks.common.report import environment, hardware_tag, today, write_json
    from odc_hf.testing import run_ranks

    cuda = torch.cuda.device_count() >= 2
    world_size = args.world_size or (torch.cuda.device_count() if cuda else 2)
    began = time.time()
    results = run_ranks(_run, world_size, args, backend="nccl" if cuda else "gloo", timeout_s=1200)
    env = environment()
    payload = {"env": env, "args": vars(args), **results[0], "elapsed_s": time.time() - began}
    path = write_json(Path(args.out) / f"microbatch_probe_{hardware_tag(env)}_{today()}.json", payload)
    print(f"wrote {path.name} ({payload['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
