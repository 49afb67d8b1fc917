"""Multi-node predictions: ODC-HSDP vs FSDP2-HSDP vs FSDP2 full sharding on R nodes of 8 GPUs.

Run through ``benchmarks/planning/simulate.py multinode`` (a module of that script, not a script of its own; the single-node
sweeps of simulate.py are unchanged). The
step-time model is the library's (:mod:`odc_hf.prediction.cluster`, :mod:`odc_hf.prediction.simulate`): planned
compute under the calibrated H200 cost model, inter-node communication exposed past compute, per-step
overheads measured on 2 x H200. Writes one markdown report, one JSON and one PNG under benchmarks/results/.

    python -m benchmarks.planning.simulate multinode
    python -m benchmarks.planning.simulate multinode --models 7B --gpus 16,64 --network-gb-per-s 25
    python -m benchmarks.planning.simulate multinode --cost-model CAL.json   # a calibration of benchmarks/planning/calibration.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common.report import RESULTS, env_markdown, environment, today, write
from benchmarks.common.report import table as md_table
from odc_hf.prediction import cluster as cluster_model
from odc_hf.prediction.cluster import Cluster, ModelShape, sharded_state_bytes
from odc_hf.prediction.cost_models import h200_overheads, load_cost_model
from odc_hf.prediction.simulate import plan_steps, step_times, summarize
from odc_hf.prediction.workloads import generate_lengths, qwen2_5_config

TIED = {"1.5B"}  # Qwen2.5-1.5B ties its embeddings


def parse_list(kind):
    def parse(text: str) -> list:
        return [kind(float(v[:-1]) * 1024) if v.endswith("k") else kind(v) for v in text.split(",") if v]

    return parse


def shape_of(size: str) -> ModelShape:
    config = qwen2_5_config(size)
    config.tie_word_embeddings = size in TIED
    return ModelShape.from_config(config, name=f"Qwen2.5-{size}")


def rows_and_sweep(args):
    overheads = h200_overheads()
    rows, sweep, cost_models = [], [], {}
    for size in args.models:
        shape = shape_of(size)
        cost_model, cost_models[size] = load_cost_model(args.cost_model, shape)
        for workload in args.workloads:
            for per_rank in args.per_rank:
                for gpus in args.gpus:
                    num_nodes = max(1, gpus // args.gpus_per_node)
                    base = Cluster(gpus_per_node=min(gpus, args.gpus_per_node), num_nodes=num_nodes,
                                   network_gb_per_s=args.network_gb_per_s)  # fmt: skip
                    n = base.world_size * per_rank * args.num_minibatches
                    lengths = generate_lengths(workload, n, args.seed, max_length=args.max_tokens)
                    steps = plan_steps(
                        lengths, base.world_size, per_rank, args.max_tokens, cost_model, shuffle=False
                    )
                    key = dict(model=size, workload=workload, per_rank=per_rank, gpus=base.world_size)
                    summary = summarize(step_times(steps, shape, base, overheads))
                    rows.append({**key, "nodes": num_nodes, "mean_tokens": float(lengths.mean()), **summary})
                    print(f"{size} {workload} {per_rank}/rank {gpus} GPUs: ODC vs FSDP2-HSDP "
                          f"{summary['speedup_vs_fsdp2_hsdp']:.3f}, vs full {summary['speedup_vs_fsdp2_full']:.3f}",
                          flush=True)  # fmt: skip
                    if (workload, per_rank, base.world_size) == (
                        args.sweep_workload,
                        args.sweep_per_rank,
                        args.sweep_gpus,
                    ):
                        for bw in args.bandwidth_sweep:
                            cl = Cluster(
                                gpus_per_node=base.gpus_per_node, num_nodes=num_nodes, network_gb_per_s=bw
                            )
                            sweep.append(
                                {
                                    **key,
                                    "network_gb_per_s": bw,
                                    **summarize(step_times(steps, shape, cl, overheads)),
                                }
                            )
    return rows, sweep, cost_models


def memory_rows(args) -> list[dict]:
    out = []
    for size in args.models:
        shape = shape_of(size)
        row = {"model": size, "params": shape.num_params,
               "hsdp_fsdp2_GB": sharded_state_bytes(shape, args.gpus_per_node, odc=False) / 1e9,
               "hsdp_odc_GB": sharded_state_bytes(shape, args.gpus_per_node, odc=True) / 1e9}  # fmt: skip
        for gpus in args.gpus:
            if gpus > args.gpus_per_node:
                row[f"full_{gpus}_GB"] = sharded_state_bytes(shape, gpus, odc=False) / 1e9
        out.append(row)
    return out


def _comm_ms(r) -> str:
    """Exposed inter-node communication of FSDP2 full / FSDP2 HSDP / ODC HSDP, in ms."""
    return " / ".join(f"{r[c]['comm_s'] * 1e3:.0f}" for c in ("fsdp2_full", "fsdp2_hsdp", "odc_hsdp"))


def table(rows) -> list[str]:
    return md_table(
        ["GPUs", "per rank", "FSDP2 full s", "FSDP2 HSDP s", "ODC HSDP s", "ODC vs FSDP2 HSDP", "ODC vs FSDP2 full",
         "bound s", "exposed comm full / HSDP / ODC, ms", "bubble FSDP2 / ODC"],
        [[r["gpus"], r["per_rank"], f"{r['fsdp2_full']['total_s']:.3f}", f"{r['fsdp2_hsdp']['total_s']:.3f}",
          f"{r['odc_hsdp']['total_s']:.3f}", f"**{r['speedup_vs_fsdp2_hsdp']:.3f}**", f"{r['speedup_vs_fsdp2_full']:.3f}",
          f"{r['bound_s']:.3f}", _comm_ms(r), f"{r['fsdp2_hsdp']['bubble']:.1%} / {r['odc_hsdp']['bubble']:.1%}"]
         for r in rows],
        "r" * 10,
    )  # fmt: skip


def plot(rows, sweep, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    panels = [(m, w) for m in args.models for w in args.workloads][:4]
    colors = dict(zip(args.per_rank, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")))
    for ax, (model, workload) in zip([axes[0, 0], axes[0, 1], axes[1, 0], axes[1, 1]], panels):
        for per_rank in args.per_rank:
            rs = [
                r for r in rows if (r["model"], r["workload"], r["per_rank"]) == (model, workload, per_rank)
            ]
            x = [r["gpus"] for r in rs]
            ax.plot(x, [r["speedup_vs_fsdp2_hsdp"] for r in rs], "o-", color=colors[per_rank],
                    label=f"{per_rank}/GPU vs FSDP2-HSDP")  # fmt: skip
            ax.plot(x, [r["speedup_vs_fsdp2_full"] for r in rs], "s--", color=colors[per_rank], alpha=0.6,
                    label=f"{per_rank}/GPU vs FSDP2 full")  # fmt: skip
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xscale="log", xlabel="GPUs (8 per node)", ylabel="predicted ODC-HSDP speedup",
               title=f"Qwen2.5-{model}, {workload}-like")  # fmt: skip
        ax.set_xticks(args.gpus, [str(g) for g in args.gpus])
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    ax = axes[0, 2]
    for model in args.models:
        rs = [r for r in sweep if r["model"] == model]
        x = [r["network_gb_per_s"] for r in rs]
        ax.plot(x, [r["speedup_vs_fsdp2_hsdp"] for r in rs], "o-", label=f"{model}: vs FSDP2-HSDP")
        ax.plot(x, [r["speedup_vs_fsdp2_full"] for r in rs], "s--", label=f"{model}: vs FSDP2 full")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="network GB/s per GPU", ylabel="predicted ODC-HSDP speedup",
           title=f"bandwidth: {args.sweep_workload}-like, {args.sweep_per_rank}/GPU, {args.sweep_gpus} GPUs")  # fmt: skip
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    ax = axes[1, 2]
    for model in args.models:
        rs = [r for r in sweep if r["model"] == model]
        x = [r["network_gb_per_s"] for r in rs]
        for c, style in (("fsdp2_full", "s--"), ("fsdp2_hsdp", "o-"), ("odc_hsdp", "^-")):
            ax.plot(x, [r[c]["comm_s"] for r in rs], style, label=f"{model} {c}")
    ax.set(xscale="log", yscale="log", xlabel="network GB/s per GPU", ylabel="exposed inter-node comm per step, s",
           title="exposed communication (same points)")  # fmt: skip
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=parse_list(str), default=["1.5B", "7B"])
    p.add_argument("--workloads", type=parse_list(str), default=["longalign", "swe_smith"])
    p.add_argument("--per-rank", type=parse_list(int), default=[2, 4, 8])
    p.add_argument(
        "--gpus", type=parse_list(int), default=[8, 16, 32, 64, 128], help="8 = one node, for reference"
    )
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--network-gb-per-s", type=float, default=50.0)
    p.add_argument(
        "--max-tokens", type=parse_list(int), default=[32 * 1024], help="budget; lengths clipped to it"
    )
    p.add_argument("--num-minibatches", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bandwidth-sweep", type=parse_list(float), default=[1, 2, 3, 6.25, 12.5, 25, 50, 100, 200]
    )
    p.add_argument("--sweep-workload", default="longalign")
    p.add_argument("--sweep-per-rank", type=int, default=4)
    p.add_argument("--sweep-gpus", type=int, default=64)
    p.add_argument("--cost-model", default="h200",
                   help="h200 (the shipped calibration), flop, or a calibration .json (benchmarks/planning/calibration.py; "
                        "scaled by FLOPs to the other model shapes when it records its model_shape)")  # fmt: skip
    p.add_argument("--tag", default="", help="extra name part for the output files")
    p.add_argument("--out", type=Path, default=RESULTS / "planning")
    args = p.parse_args(argv)
    (args.max_tokens,) = args.max_tokens

    rows, sweep, cost_models = rows_and_sweep(args)
    memory = memory_rows(args)
    env = environment()
    setup = {
        "models": args.models, "workloads": args.workloads, "per_rank": args.per_rank, "gpus": args.gpus,
        "gpus_per_node": args.gpus_per_node, "network_gb_per_s": args.network_gb_per_s,
        "max_tokens": args.max_tokens, "num_minibatches": args.num_minibatches, "seed": args.seed,
        "generator": f"odc_hf.prediction.workloads.generate_lengths(workload, n, seed={args.seed}, max_length={args.max_tokens})",
        "cost_models": cost_models, "step_overheads": h200_overheads().source,
    }  # fmt: skip
    stem = f"simulate_multinode_h200_{today()}" + (f"_{args.tag}" if args.tag else "")
    args.out.mkdir(parents=True, exist_ok=True)
    plot(rows, sweep, args, args.out / f"{stem}.png")
    lines = [
        "# Multi-node predictions: ODC-HSDP vs FSDP2-HSDP vs FSDP2 full sharding (calibrated H200 model)",
        "", env_markdown(env).rstrip(), *(f"- {k}: `{v}`" for k, v in setup.items()), "",
        "Predicted, not measured (one node of 2 GPUs is the largest measured setup). Model "
        "(`odc_hf/prediction/cluster.py`, `odc_hf/prediction/simulate.py`): compute = the planners' cost of each "
        "global minibatch, balanced over all GPUs (LB-Mini for ODC, LB-Micro for FSDP2); plus inter-node "
        "communication left exposed; plus the per-step overheads measured on 2 x H200, per parameter held. "
        "Step times are means over the minibatches, speedups ratios of summed times. Assumptions:", "",
        *(f"- {line.strip()}" for line in _assumptions()), "",
        f"![plot]({stem}.png)", "",
    ]  # fmt: skip
    for model in args.models:
        for workload in args.workloads:
            rs = [r for r in rows if (r["model"], r["workload"]) == (model, workload)]
            rs.sort(key=lambda r: (r["per_rank"], r["gpus"]))
            lines += [
                f"## Qwen2.5-{model}, {workload}-like",
                "",
                f"Cost model: {cost_models[model]}",
                "",
                *table(rs),
                "",
            ]
    lines += [
        f"## Bandwidth ({args.sweep_workload}-like, {args.sweep_per_rank} per GPU, {args.sweep_gpus} GPUs)", "",
        *md_table(["model", "GB/s per GPU", "FSDP2 full s", "FSDP2 HSDP s", "ODC HSDP s", "ODC vs HSDP", "ODC vs full",
                   "exposed comm full / HSDP / ODC, ms"],
                  [[r["model"], f"{r['network_gb_per_s']:g}", f"{r['fsdp2_full']['total_s']:.3f}",
                    f"{r['fsdp2_hsdp']['total_s']:.3f}", f"{r['odc_hsdp']['total_s']:.3f}",
                    f"{r['speedup_vs_fsdp2_hsdp']:.3f}", f"{r['speedup_vs_fsdp2_full']:.3f}", _comm_ms(r)]
                   for r in sweep], "r" * 8),
    ]  # fmt: skip
    full = [g for g in args.gpus if g > args.gpus_per_node]
    lines += [
        "", "## Persistent training state per GPU (GB: fp32 params + grads + AdamW moments; ODC + bf16 staging)", "",
        *md_table(["model", "parameters", "HSDP, FSDP2 (8 per shard)", "HSDP, ODC", *(f"full, {g}" for g in full)],
                  [[m["model"], f"{m['params'] / 1e9:.2f}B", f"{m['hsdp_fsdp2_GB']:.2f}", f"{m['hsdp_odc_GB']:.2f}",
                    *(f"{m[f'full_{g}_GB']:.2f}" for g in full)] for m in memory], "r" * (4 + len(full))),
    ]  # fmt: skip
    payload = {"env": env, "setup": setup, "results": rows, "bandwidth_sweep": sweep, "memory": memory}
    write(args.out, stem, payload, "\n".join(lines) + "\n")
    print(f"wrote {args.out / stem}.{{json,md,png}}")


def _assumptions() -> list[str]:
    """The bullet list of the model's assumptions, from the library module's docstring."""
    doc = cluster_model.__doc__.split("Assumptions (stated in every report that uses this model):")[1]
    items, current = [], []
    for line in doc.strip().splitlines():
        if line.startswith("- ") and current:
            items.append(" ".join(current))
            current = []
        current.append(line.strip().removeprefix("- "))
    items.append(" ".join(current))
    return items

