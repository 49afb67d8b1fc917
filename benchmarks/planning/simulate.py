"""Predict FSDP vs ODC step times from the planners' cost model, over world size, sequence length,
minibatch size and token budget; write JSON, a markdown report and a PNG under benchmarks/results/.

Only forward+backward compute is modelled (no communication, no optimizer step), so the numbers are
the gain that balancing and barrier removal can give, not end-to-end measurements. Step time:
FSDP = Σ over microbatch index of the slowest rank, ODC = the busiest rank's total (see Plan).

    python -m benchmarks.planning.simulate --workload longalign --model 1.5B
    python -m benchmarks.planning.simulate --workload longalign --calibration calib.json   # {"a","b","c"} or timings

Several nodes (ODC-HSDP vs FSDP2-HSDP vs FSDP2 full sharding, with an inter-node communication model):
``python -m benchmarks.planning.simulate multinode [...]``, see simulate_multinode.py; ``python -m benchmarks.planning.simulate
rebalance [...]``: odc_hf vs transformers' batch_rebalance, see simulate_rebalance.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.common.report import RESULTS, env_markdown, environment, today, write
from benchmarks.common.report import table as md_table
from odc_hf.balance.cost import FlopCostModel, QuadraticCostModel
from odc_hf.balance.planner import plan_lb_micro, plan_lb_mini, plan_none
from odc_hf.prediction.workloads import (
    DEFAULT_MAX_LENGTH,
    QWEN2_5_SHAPES,
    WORKLOADS,
    generate_lengths,
    qwen2_5_config,
)

SPEEDUPS = {  # name: (baseline, candidate) as (planner, semantics)
    "lb_mini_odc_vs_lb_micro_fsdp": (("lb_micro", "fsdp"), ("lb_mini", "odc")),
    "lb_mini_odc_vs_none_fsdp": (("none", "fsdp"), ("lb_mini", "odc")),
    "lb_micro_odc_vs_lb_micro_fsdp": (("lb_micro", "fsdp"), ("lb_micro", "odc")),
}
CONFIGS = (("none", "fsdp"), ("lb_micro", "fsdp"), ("lb_micro", "odc"), ("lb_mini", "odc"))
PLANNERS = (("none", plan_none), ("lb_micro", plan_lb_micro), ("lb_mini", plan_lb_mini))


def load_cost_model(args):
    if args.calibration is None:
        return FlopCostModel.from_config(qwen2_5_config(args.model)), f"flop_{args.model}"
    spec = json.loads(Path(args.calibration).read_text())
    if "a" in spec:
        model = QuadraticCostModel.from_dict(spec)
    else:
        model = QuadraticCostModel.fit(spec["lengths"], spec["seconds"])
    return model, "calibrated_" + Path(args.calibration).stem.removeprefix("calibration_")


def simulate(args, cost_model, *, world_size, per_rank, budget, max_length) -> dict:
    """Plan ``args.num_minibatches`` minibatches with each planner; per-config times and speedups."""
    size = world_size * per_rank
    lengths = generate_lengths(args.workload, size * args.num_minibatches, args.seed, max_length=max_length)
    times = {config: [] for config in CONFIGS}
    bubbles = {config: [] for config in CONFIGS}
    bounds = []
    for m in range(args.num_minibatches):
        batch = lengths[m * size : (m + 1) * size]
        plans = {
            name: planner(batch, world_size, budget, cost_model, truncate=True) for name, planner in PLANNERS
        }
        for name, semantics in CONFIGS:
            times[name, semantics].append(plans[name].predicted_time(semantics))
            bubbles[name, semantics].append(plans[name].predicted_bubble(semantics))
        bounds.append(plans["lb_mini"].lower_bound)
    times = {config: np.array(values) for config, values in times.items()}
    row = {
        "world_size": world_size,
        "per_rank": per_rank,
        "minibatch_size": size,
        "max_tokens": budget,
        "max_length": max_length,
        "mean_tokens": float(lengths.mean()),
    }
    for name, (base, cand) in SPEEDUPS.items():
        row[name] = {
            "median": float(np.median(times[base] / times[cand])),
            "mean": float(times[base].sum() / times[cand].sum()),
        }
    for name, semantics in CONFIGS:
        row[f"bubble_{name}_{semantics}"] = float(np.median(bubbles[name, semantics]))
        row[f"efficiency_{name}_{semantics}"] = float(np.sum(bounds) / times[name, semantics].sum())
    return row


def parse_ints(text: str) -> list[int]:
    """Comma-separated integers; a ``k`` suffix multiplies by 1024 (``32k`` = 32768)."""
    return [int(float(v[:-1]) * 1024) if v.endswith("k") else int(v) for v in text.split(",") if v]


def parse_int(text: str) -> int:
    (value,) = parse_ints(text)
    return value


def monotone_verdict(values, direction: int) -> str:
    """'holds' if every step moves in ``direction`` (+1 up, -1 down), 'partly' if only end to end."""
    steps = np.sign(np.diff(values)) * direction
    if np.all(steps >= 0) and steps.any():
        return "holds"
    return (
        "partly (end to end, not monotone)" if (values[-1] - values[0]) * direction > 0 else "does NOT hold"
    )


def check_trends(results) -> list[str]:
    """The paper's qualitative claims, checked on the headline speedup (median over minibatches)."""
    lines, key = [], "lb_mini_odc_vs_lb_micro_fsdp"

    def series(rows, x_key, unit=""):
        return " -> ".join(
            f"{r[x_key] // (1024 if unit == 'k' else 1)}{unit}: {r[key]['median']:.3f}" for r in rows
        )

    for w, rows in sorted(group(results["sequence_length"]).items()):
        verdict = monotone_verdict([r[key]["median"] for r in rows], +1)
        lines.append(
            f"- gain grows with sequence length ({w} ranks): {verdict} ({series(rows, 'max_length', 'k')})"
        )
    for w, rows in sorted(group(results["minibatch_size"]).items()):
        peak = int(np.argmax([r[key]["median"] for r in rows]))
        verdict = "holds" if 0 < peak < len(rows) - 1 else "does NOT hold (peak at an end of the sweep)"
        lines.append(
            f"- gain peaks at moderate minibatch sizes ({w} ranks): {verdict}, peak at {rows[peak]['per_rank']}"
            f"/rank ({series(rows, 'per_rank', '/rank')})"
        )
    for w, rows in sorted(group(results["token_budget"]).items()):
        verdict = monotone_verdict([r[key]["median"] for r in rows], -1)
        lines.append(
            f"- gain shrinks with packing / bigger budgets ({w} ranks, {rows[0]['per_rank']}/rank): {verdict} "
            f"({series(rows, 'max_tokens', 'k')})"
        )
    return lines


def group(rows) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for row in rows:
        out.setdefault(row["world_size"], []).append(row)
    return out


def table(rows) -> list[str]:
    mini = "lb_mini_odc_vs_lb_micro_fsdp"
    return md_table(
        ["ranks", "per rank", "budget", "max len", "ODC+LB-Mini vs FSDP+LB-Micro (median / mean)", "vs FSDP+none",
         "ODC+LB-Micro vs FSDP+LB-Micro", "bubble FSDP+LB-Micro", "bubble ODC+LB-Mini", "bubble FSDP+none"],
        [[r["world_size"], r["per_rank"], f"{r['max_tokens'] // 1024}k", f"{r['max_length'] // 1024}k",
          f"{r[mini]['median']:.3f} / {r[mini]['mean']:.3f}", f"{r['lb_mini_odc_vs_none_fsdp']['median']:.3f}",
          f"{r['lb_micro_odc_vs_lb_micro_fsdp']['median']:.3f}", f"{r['bubble_lb_micro_fsdp']:.1%}",
          f"{r['bubble_lb_mini_odc']:.1%}", f"{r['bubble_none_fsdp']:.1%}"] for r in rows],
    )  # fmt: skip


def plot(results, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    panels = (
        ("world_size", "world_size", "ranks"),
        ("sequence_length", "max_length", "max sequence length"),
        ("minibatch_size", "per_rank", "samples per rank per step"),
        ("token_budget", "max_tokens", "max tokens per microbatch"),
    )
    for ax, (sweep, x_key, label) in zip(axes.flat, panels):
        by_world = {0: results[sweep]} if sweep == "world_size" else group(results[sweep])
        for w, rows in sorted(by_world.items()):
            x = [r[x_key] for r in rows]
            suffix = "" if sweep == "world_size" else f", {w} ranks"
            ax.plot(
                x,
                [r["lb_mini_odc_vs_lb_micro_fsdp"]["median"] for r in rows],
                "o-",
                label=f"ODC+LB-Mini vs FSDP+LB-Micro{suffix}",
            )
            ax.plot(
                x,
                [r["lb_micro_odc_vs_lb_micro_fsdp"]["median"] for r in rows],
                "s--",
                label=f"ODC+LB-Micro vs FSDP+LB-Micro{suffix}",
            )
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.set_ylabel("predicted speedup (median)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["multinode"]:
        from benchmarks.planning.simulate_multinode import main as multinode_main

        return multinode_main(argv[1:])
    if argv[:1] == ["rebalance"]:
        from benchmarks.planning.simulate_rebalance import main as rebalance_main

        return rebalance_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=WORKLOADS, default="longalign")
    parser.add_argument("--model", choices=sorted(QWEN2_5_SHAPES), default="1.5B",
                        help="Qwen2.5 shape (FLOP model)")  # fmt: skip
    parser.add_argument("--calibration", help="JSON with a, b, c (seconds) or lengths + seconds to fit")
    parser.add_argument("--world-sizes", type=parse_ints, default=parse_ints("2,4,8,16,32,64,128,256"),
                        help="world-size sweep (comma list)")  # fmt: skip
    parser.add_argument("--per-rank", type=int, default=4,
                        help="samples per rank per step (world-size sweep)")  # fmt: skip
    parser.add_argument(
        "--max-tokens",
        type=parse_int,
        default=None,
        help="token budget per microbatch, e.g. 32k; default: the workload's cap (lengths are clipped to it)",
    )
    parser.add_argument("--sweep-world-sizes", type=parse_ints, default=parse_ints("8,32"),
                        help="world sizes of the length / minibatch / budget sweeps")  # fmt: skip
    parser.add_argument("--max-lengths", type=parse_ints, default=None, help="default: 1/4, 1/2, 1 x the cap")
    parser.add_argument("--per-rank-sweep", type=parse_ints, default=parse_ints("1,2,4,8,16,32"),
                        help="samples per rank in the minibatch-size sweep")  # fmt: skip
    parser.add_argument("--budget-multiples", type=parse_ints, default=parse_ints("1,2,4,8"),
                        help="token budgets of the packing sweep, as multiples of --max-tokens")  # fmt: skip
    parser.add_argument(
        "--budget-sweep-per-rank",
        type=int,
        default=16,
        help="samples per rank in the budget sweep: enough tokens that every budget needs packing",
    )
    parser.add_argument("--num-minibatches", type=int, default=64, help="minibatches simulated per point")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "planning")
    parser.add_argument("--tag", default="", help="extra name part for the output files")
    args = parser.parse_args(argv)

    cost_model, cost_name = load_cost_model(args)
    cap = DEFAULT_MAX_LENGTH[args.workload]
    budget = args.max_tokens or cap
    max_lengths = args.max_lengths or [cap // 4, cap // 2, cap]

    base_max_length = min(cap, budget)  # lengths are clipped to the budget unless a sweep varies them

    def run(world_size, per_rank, budget, max_length=None):
        max_length = base_max_length if max_length is None else max_length
        return simulate(
            args, cost_model, world_size=world_size, per_rank=per_rank, budget=budget, max_length=max_length
        )

    ws = args.sweep_world_sizes
    results = {
        "world_size": [run(w, args.per_rank, budget) for w in args.world_sizes],
        "sequence_length": [run(w, args.per_rank, m, m) for w in ws for m in max_lengths],
        "minibatch_size": [run(w, p, budget) for w in ws for p in args.per_rank_sweep],
        "token_budget": [
            run(w, args.budget_sweep_per_rank, budget * f) for w in ws for f in args.budget_multiples
        ],
    }
    env = environment()
    setup = {
        "workload": args.workload,
        "seed": args.seed,
        "num_minibatches": args.num_minibatches,
        "generator": f"odc_hf.prediction.workloads.generate_lengths({args.workload!r}, n, seed={args.seed})",
        "cost_model": cost_model.describe(),
    }
    stem = f"simulate_{args.workload}_{cost_name}{args.tag}_{today()}"
    title = f"{args.workload}-like, {cost_model.describe()}"
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, args.out / f"{stem}.png", title)
    lines = [
        f"# Simulated step time: {title}",
        "",
        env_markdown(env).rstrip(),
        *(f"- {k}: `{v}`" for k, v in setup.items()),
        "",
        "Predicted forward+backward compute only (no communication, no optimizer). Speedups are the "
        "median over minibatches of baseline/candidate step time on the same samples (mean = ratio of "
        "summed times). Over-long samples are truncated to the budget.",
        "",
        f"![plot]({stem}.png)",
        "",
        "## Paper trends",
        "",
        *check_trends(results),
    ]
    for sweep, rows in results.items():
        lines += ["", f"## Sweep: {sweep.replace('_', ' ')}", "", *table(rows)]
    write(args.out, stem, {"env": env, "setup": setup, "results": results}, "\n".join(lines) + "\n")
    print("\n".join(table(results["world_size"]) + check_trends(results)))
    print(f"wrote {args.out / stem}.{{json,md,png}}")


if __name__ == "__main__":
    main()
