"""How long planning one global minibatch takes on ONE CPU core (targets: LB-Mini 4,096 samples / 64 ranks < 10 ms,
65,536 / 1,024 < 200 ms median).

Every rank plans every step itself, on the data loader's path, so this must stay small. The process is
pinned to one core (where the OS allows), each planner is warmed up, then timed on ``--instances``
different minibatches of every workload, with the garbage collector paused during each call as
``timeit`` does (a gen-2 collection, ~100 ms on a small VM, belongs to whoever happens to trigger it).

    python -m benchmarks.planning.plan_speed --num-samples 4096 --world-size 64
    python -m benchmarks.planning.plan_speed --num-samples 65536 --world-size 1024 --instances 3 --note "shared machine"
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.common.report import RESULTS, env_markdown, environment, table, today, write  # noqa: E402
from odc_hf.balance.cost import FlopCostModel  # noqa: E402
from odc_hf.balance.planner import plan_lb_micro, plan_lb_mini, plan_none  # noqa: E402
from odc_hf.prediction.workloads import DEFAULT_MAX_LENGTH, WORKLOADS, generate_lengths, qwen2_5_config  # noqa: E402

PLANNERS = {"lb_mini": plan_lb_mini, "lb_micro": plan_lb_micro, "none": plan_none}


def time_planner(planner, batches, world_size, budget, cost_model) -> list[float]:
    planner(batches[0], world_size, budget, cost_model)  # warm-up
    ms = []
    for batch in batches[1:]:
        gc.collect()
        gc.disable()
        start = time.perf_counter()
        planner(batch, world_size, budget, cost_model)
        ms.append((time.perf_counter() - start) * 1e3)
        gc.enable()
    return ms


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-samples", type=int, default=4096)
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--instances", type=int, default=20, help="minibatches timed per workload and budget")
    parser.add_argument("--model", default="7B", help="Qwen2.5 shape of the FLOP cost model")
    parser.add_argument("--out", type=Path, default=RESULTS / "planning")
    parser.add_argument("--note", default="", help="a line for the report, e.g. what else ran on the machine")
    args = parser.parse_args(argv)

    pinned = hasattr(os, "sched_setaffinity")
    if pinned:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    cost_model = FlopCostModel.from_config(qwen2_5_config(args.model))
    rows = []
    for workload in WORKLOADS:
        batches = [generate_lengths(workload, args.num_samples, seed) for seed in range(args.instances + 1)]
        for budget in (DEFAULT_MAX_LENGTH[workload], 2 * DEFAULT_MAX_LENGTH[workload]):
            for name, planner in PLANNERS.items():
                ms = time_planner(planner, batches, args.world_size, budget, cost_model)
                row = {
                    "workload": workload,
                    "planner": name,
                    "max_tokens": budget,
                    "median_ms": float(np.median(ms)),
                    "p90_ms": float(np.percentile(ms, 90)),
                    "max_ms": float(np.max(ms)),
                }
                rows.append(row)
                print(
                    f"{workload:10s} {budget // 1024:4d}k {name:9s} median {row['median_ms']:6.1f} ms  "
                    f"p90 {row['p90_ms']:6.1f}  max {row['max_ms']:6.1f}"
                )
    env = environment() | {"cpu_model": cpu_name(), "cores_used": 1 if pinned else "all"}
    setup = {
        "num_samples": args.num_samples,
        "world_size": args.world_size,
        "instances": args.instances,
        "cost_model": cost_model.describe(),
    }
    lines = [
        f"# Planning time: {args.num_samples} samples over {args.world_size} ranks, one CPU core",
        "",
        env_markdown(env).rstrip(),
        f"- CPU: {env['cpu_model']}, cores used: {env['cores_used']}",
        *(f"- {k}: `{v}`" for k, v in setup.items()),
        "",
        "Targets: lb_mini median < 10 ms at 4,096 samples / 64 ranks, < 200 ms at 65,536 / 1,024. Budgets: "
        "the workload's cap and twice it. lb_mini includes computing the lb_micro plan it keeps as a fallback "
        "candidate, unless its own plan is within 1e-4 of the makespan bound. GC paused during each timed call (as "
        "`timeit`).",
        *([f"Note: {args.note}"] if args.note else []),
        "",
        *table(["workload", "budget", "planner", "median ms", "p90 ms", "max ms"],
               [[r["workload"], f"{r['max_tokens'] // 1024}k", r["planner"], f"{r['median_ms']:.1f}",
                 f"{r['p90_ms']:.1f}", f"{r['max_ms']:.1f}"] for r in rows]),
    ]  # fmt: skip
    stem = f"plan_speed_{today()}" + ("" if (args.num_samples, args.world_size) == (4096, 64)
                                       else f"_{args.num_samples}x{args.world_size}")
    write(args.out, stem, {"env": env, "setup": setup, "results": rows}, "\n".join(lines) + "\n")
    print(f"wrote {args.out / stem}.{{json,md}}")


if __name__ == "__main__":
    main()
