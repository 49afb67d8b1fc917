"""The analysis and report of benchmarks/sft/e2e.py: per config and variant, step-time statistics, tokens/s/GPU,
efficiency, MFU, bubbles and memory; measured ratios beside the calibrated prediction; the cost model's error on the
sharded run's microbatches; the simulator's D-vs-B ratio by world size; plots; one payload from several runs.

A module, not a script: ``python -m benchmarks.sft.e2e --report-only RUN.raw.json`` re-renders through it.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.common import report
from benchmarks.common.sft_setup import plans_for_step

VARIANTS = ("A", "B", "C", "D", "H")
DESCRIPTIONS = {
    "A": "FSDP2 + TRL packing (bfd) + round-robin rows",
    "B": "FSDP2 + LB-Micro",
    "C": "ODC + LB-Micro",
    "D": "ODC + LB-Mini",
    "H": "A_hf: TRL SFTTrainer + FSDP2 + batch_rebalance (transformers' sampler, padded rows)",
}
LOCKSTEP_VARIANTS = ("A", "B", "H")  # FSDP2: every rank runs the same number of microbatches
H200_PEAK_TFLOPS = 989.0
SIM_WORLD_SIZES = (2, 8, 16, 32, 64)


def predicted(plan_entry: dict, variant: str) -> tuple[float, float]:
    """(predicted step compute seconds, predicted bubble) of one variant's plan: FSDP semantics for A, B and H."""
    plan = plan_entry[variant][1]
    semantics = "fsdp" if variant in LOCKSTEP_VARIANTS else "odc"
    return plan.predicted_time(semantics), plan.predicted_bubble(semantics)


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def analyse(payload: dict) -> list[dict]:
    """Per config and variant: step-time statistics, tokens/s/GPU, efficiency, MFU, bubbles, memory, ratios."""
    W = payload["world_size"]
    static = payload.get("static_bytes", {})
    out = []
    for cfg in payload["configs"]:
        warm, n = cfg["warmup"], len(cfg["lengths"])
        measured = list(range(warm, n))
        by = {}
        for r in cfg["records"]:
            by.setdefault((r["variant"], r["step"]), []).append(r)
        step = {v: {s: max(r["wall_s"] for r in by[v, s]) for s in measured} for v in cfg["variants"]}
        busy = {v: {s: [r["busy_s"] for r in sorted(by[v, s], key=lambda r: r["rank"])] for s in measured}
                for v in cfg["variants"]}  # fmt: skip
        opt = {v: _median(max(r["opt_s"] for r in by[v, s]) for s in measured) for v in cfg["variants"]}
        opt_ref = opt.get("D", next(iter(opt.values())))
        if "bound_compute_s" in cfg:
            bound = {s: cfg["bound_compute_s"][s] + opt_ref for s in measured}
        else:  # runs before the floor model: Σ per-sample single-GPU time (overhead a per sample) / W
            bound = {s: cfg["single_gpu_s"][s] / W + opt_ref for s in measured}
        rows = {}
        for v in cfg["variants"]:
            times = [step[v][s] for s in measured]
            pred = [cfg["predicted"][v][s][0] + opt_ref for s in measured]
            own_busy = busy["C"] if v == "B" and "C" in busy else (busy[v] if v in ("C", "D") else None)
            bubble = None
            if own_busy is not None:
                bubble = _median(1 - statistics.mean(own_busy[s]) / step[v][s] for s in measured)
            kind = payload.get("model_of", {}).get(v, "fsdp" if v in LOCKSTEP_VARIANTS else "odc")
            transient = max(
                r["transient_bytes"] for r in cfg["records"] if r["variant"] == v and r["step"] >= warm
            )
            rows[v] = {
                "step_s_median": statistics.median(times),
                "step_s_min": min(times),
                "step_s_max": max(times),
                "step_s_iqr": _iqr(times),
                "tokens_per_s_per_gpu": statistics.median(cfg["tokens"][s] / step[v][s] for s in measured)
                / W,
                "efficiency": statistics.median(bound[s] / step[v][s] for s in measured),
                "mfu": statistics.median(
                    cfg["flops"][s] / (step[v][s] * W * H200_PEAK_TFLOPS * 1e12) for s in measured
                ),  # fmt: skip
                "bubble_measured": bubble,
                "bubble_predicted": statistics.median(cfg["predicted"][v][s][1] for s in measured),
                "predicted_step_s": statistics.median(pred),
                "optimizer_s": opt[v],
                "peak_memory_GiB": (static.get(kind, 0.0) + transient) / 2**30,
                "microbatches": [
                    [len(r["mb_end_s"]) for r in sorted(by[v, s], key=lambda r: r["rank"])] for s in measured
                ],  # fmt: skip
            }
        ratios = {}
        for base, cand in (("B", "D"), ("B", "C"), ("C", "D"), ("A", "B"), ("A", "D"), ("H", "B"), ("H", "D")):
            if base in rows and cand in rows:
                measured_ratio = statistics.median(step[base][s] / step[cand][s] for s in measured)
                predicted = sum(cfg["predicted"][base][s][0] + opt_ref for s in measured) / sum(
                    cfg["predicted"][cand][s][0] + opt_ref for s in measured
                )
                ratios[f"{cand}_vs_{base}"] = {"measured": measured_ratio, "predicted": predicted}
        out.append({"workload": cfg["workload"], "per_rank": cfg["per_rank"], "steps": len(measured),
                    "mean_tokens": statistics.mean(t / len(ls) for t, ls in zip(cfg["tokens"], cfg["lengths"])),
                    "bound_s_median": statistics.median(bound.values()), "variants": rows, "ratios": ratios})  # fmt: skip
    return out


def microbatch_timings(payload: dict, variants=("C", "D")) -> tuple[list[list[int]], list[float], list[str]]:
    """Measured (document lengths, seconds, variant) of every microbatch ODC ranks ran after warm-up.

    ODC ranks never wait inside a minibatch, so the gap between consecutive microbatch-end events is the
    microbatch's own forward + backward. Runs that did not record ``mb_docs`` get them by re-planning the
    step (the planners are deterministic given the lengths and the run's calibrated model).
    """
    import numpy as np

    from odc_hf.balance.cost import QuadraticCostModel

    W, budget = payload["world_size"], payload["args"]["max_tokens"]
    docs_out, seconds, names = [], [], []
    for cfg in payload["configs"]:
        cal = cfg.get("calibration", payload["calibration"])
        model = QuadraticCostModel.from_dict(cal)
        wanted = [v for v in variants if v in cfg["variants"]]
        for step, lengths in enumerate(cfg["lengths"]):
            if step < cfg["warmup"] or not wanted:
                continue
            plans = None
            for v in wanted:
                for r in (r for r in cfg["records"] if r["variant"] == v and r["step"] == step):
                    if "mb_docs" in r:
                        docs = r["mb_docs"]
                    else:
                        if plans is None:
                            plans = plans_for_step(np.asarray(lengths), W, budget, model, wanted)
                        docs = [[min(int(lengths[i]), budget) for i in mb] for mb in plans[v][0][r["rank"]]]
                    ends = [0.0] + r["mb_end_s"]
                    for j, d in enumerate(docs):
                        if d:
                            docs_out.append(d)
                            seconds.append(ends[j + 1] - ends[j])
                            names.append(v)
    return docs_out, seconds, names


def insitu_cost_check(payload: dict) -> dict | None:
    """How well the single-GPU calibration predicts microbatches in the sharded run, and an in-situ refit."""
    import numpy as np

    from odc_hf.balance.cost import QuadraticCostModel

    same_path = payload.get("calibration_d", {}).get("compute_path") == payload["calibration"].get("compute_path")
    docs, seconds, _ = microbatch_timings(payload, ("C", "D") if same_path else ("C",))  # C: the calibrated path
    if len(docs) < 6:
        return None
    t = np.asarray(seconds)
    multi = np.array([len(d) > 1 for d in docs])
    cal = payload["calibration"]
    calibrated = QuadraticCostModel.from_dict(cal)
    try:
        refit = QuadraticCostModel.fit_microbatches(docs, seconds)
    except ValueError:
        return None
    floor_refit = None
    if not cal.get("floor") and cal.get("points"):  # a run planned with the additive model: what the floor adds
        floor_refit = QuadraticCostModel.fit([p[0] for p in cal["points"]], [p[1] for p in cal["points"]])

    def errors(model):
        pred = np.array([model.microbatch_cost(d) for d in docs])
        rel = (pred - t) / t
        out = {"median_abs": float(np.median(np.abs(rel)))}
        for name, mask in (("single_doc", ~multi), ("multi_doc", multi)):
            if mask.any():
                out[f"{name}_median_signed"] = float(np.median(rel[mask]))
        return out

    out = {
        "microbatches": len(docs),
        "multi_doc": int(multi.sum()),
        "calibrated": {**calibrated.to_dict(), **errors(calibrated)},
        "in_situ": {**refit.to_dict(), **errors(refit)},
    }
    if floor_refit is not None:
        out["calibrated_floor"] = {**floor_refit.to_dict(), **errors(floor_refit)}
    return out


def _acceptance(results: list[dict]) -> list[str]:
    """The headline numbers (LongAlign-like and balanced, 4 per rank), where this run has them."""
    find = {(c["workload"], c["per_rank"]): c for c in results}
    out = []
    la, bal = find.get(("longalign", 4)), find.get(("balanced", 4))
    if la and {"B", "D"} <= set(la["variants"]):
        r = la["ratios"]["D_vs_B"]
        out.append(f"- LongAlign-like, 4 per rank: D vs B **{r['measured']:.3f}x** (calibrated prediction "
                   f"{r['predicted']:.3f}x, measured/predicted {r['measured'] / r['predicted']:.3f}); D efficiency "
                   f"**{la['variants']['D']['efficiency']:.3f}** of the bound; peak memory D/B "
                   f"**{la['variants']['D']['peak_memory_GiB'] / la['variants']['B']['peak_memory_GiB']:.3f}**")  # fmt: skip
    if bal and {"B", "D"} <= set(bal["variants"]):
        out.append(
            f"- balanced (all {bal['mean_tokens']:.0f} tokens): D vs B **{bal['ratios']['D_vs_B']['measured']:.3f}x**"
        )
    return out + [""] if out else []


def _iqr(values):
    q = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3
    return [q[0], q[2]]


def simulate_scaling(
    payload: dict,
    workload: str,
    per_rank: int,
    *,
    optimizer_s: float = 0.0,
    num_minibatches: int = 16,
    coefficients: dict | None = None,
) -> dict:
    """Simulated D-vs-B ratio (compute + optimizer time) at the SIM_WORLD_SIZES, for one config.

    The cost model is the run's calibration, or ``coefficients`` ({"a", "b", "c"}, e.g. the in-situ refit).
    """
    from odc_hf.balance.cost import QuadraticCostModel
    from odc_hf.balance.planner import plan_lb_micro, plan_lb_mini
    from odc_hf.prediction.workloads import generate_lengths

    cal = coefficients or payload["calibration"]
    cost_model = QuadraticCostModel.from_dict(cal)
    args = payload["args"]
    budget = args["max_tokens"]
    out = {}
    for W in SIM_WORLD_SIZES:
        size = W * per_rank
        lengths = generate_lengths(workload, size * num_minibatches, args["seed"] + 1, max_length=budget)
        fsdp = odc = 0.0
        for m in range(num_minibatches):
            batch = lengths[m * size : (m + 1) * size]
            fsdp += (
                plan_lb_micro(batch, W, budget, cost_model, truncate=True).predicted_fsdp_time + optimizer_s
            )
            odc += plan_lb_mini(batch, W, budget, cost_model, truncate=True).predicted_odc_time + optimizer_s
        out[W] = fsdp / odc
    return out


def _fmt(value, spec=".3f"):
    return "—" if value is None else format(value, spec)


def render(payload: dict, out_dir) -> str:
    """The report (markdown, JSON with the analysis, plots) of a run's payload, written under ``out_dir``."""
    env, W = payload["env"], payload["world_size"]
    results = analyse(payload)
    cal = payload["calibration"]
    lines = [
        f"# End-to-end SFT steps: {payload['args']['model']} Qwen2.5 shape on {W} ranks\n",
        report.env_markdown(env),
        f"- model: Qwen2.5-{payload['args']['model']} shape from a config (random init), tied embeddings, bf16 compute, "
        "fp32 master weights and gradient reduction, AdamW, clip 1.0, "
        '`attn_implementation="sdpa_varlen"` (per-document causal SDPA on packed rows)',
        *([("- compute paths (loss, kernels, activation checkpointing): "
            + "; ".join(f"{v}: {p['loss']}, kernels {p['kernels']}, AC {p['activation_checkpointing']}"
                        for v, p in paths.items()))] if (paths := payload.get("compute_paths")) else []),
        *([f"- D's cost model (its compute path, also the bound's): {payload['calibration_d']['describe']}"]
          if payload.get("calibration_d") else []),
        f"- token budget per microbatch {payload['args']['max_tokens']}; lengths clipped to it; workload seed "
        f"{payload['args']['seed']}; warm-up steps excluded; variants interleaved (order rotates each step)",
        f"- cost model (single-GPU fwd+bwd of an unsharded bf16 copy, fitted): {cal['describe']}; points "
        + ", ".join(f"{s}: {t * 1e3:.1f} ms" for s, t in cal["points"]),
        *([f"- attention shapes: documents padded to multiples of {w['bucket']} tokens; {w['attention_shapes']} "
           f"shapes planned before the first step ({w['seconds']:.1f} s, `odc_hf.attention.warm_up`)"]
          if (w := payload.get("attention_warm_up")) else
          ["- attention shapes: exact (no bucket), cuDNN plans built when a length first appears"]),
        "- bound = the step time with perfect balance and free communication under D's single-GPU cost model: "
        "max((Σ document costs + overhead·⌈tokens / budget⌉) / ranks, costliest document alone) + the optimizer time "
        "of D (the planner's `makespan_lower_bound`; the floor is left out, so it never exceeds packed rows' cost); "
        "efficiency = bound / step time. MFU: causal-halved FLOPs 6·N·s + 6·L·d·s² per sample / "
        f"(step time × ranks × {H200_PEAK_TFLOPS:.0f} TFLOP/s dense bf16 peak), recomputation not counted.",
        "- bubble measured: 1 − mean busy / step, busy = step start to the rank's last backward (CUDA events); "
        "B's busy is C's (same microbatches; FSDP2 hides waits inside its collectives). Predicted: the plan under the "
        "calibrated model.",
        "- peak memory: the model's static state (sharded fp32 params, AdamW state, ODC buffers) + the largest "
        "transient allocation during the variant's steps, worst rank.\n",
        "Variants: " + "; ".join(f"**{k}** {d}" for k, d in DESCRIPTIONS.items()) + "\n",
    ]
    lines += _acceptance(results)
    for run in payload.get("runs", []):
        c = run["calibration"]
        lines.append(f"- run at commit `{run['env']['commit']}` ({run['env']['date']}): {', '.join(run['configs'])}; "
                     f"calibration a={c['a']:.4g}, b={c['b']:.4g}, c={c['c']:.4g}, floor={c.get('floor', 0.0):.4g}; "
                     f"`{run['env'].get('command', '?')}`")  # fmt: skip
    if payload.get("runs"):
        lines.append("")
    for cfg in results:
        lines.append(f"## {cfg['workload']}, {cfg['per_rank']} samples per rank "
                     f"(mean {cfg['mean_tokens']:.0f} tokens/sample, {cfg['steps']} measured steps, "
                     f"bound {cfg['bound_s_median']:.3f} s)\n")  # fmt: skip
        lines += report.table(
            ["variant", "step s median [min, max]", "tokens/s/GPU", "efficiency", "MFU", "bubble meas.", "bubble pred.",
             "pred. step s", "optimizer s", "peak GiB", "microbatches/rank (first steps)"],
            [[v, f"{row['step_s_median']:.3f} [{row['step_s_min']:.3f}, {row['step_s_max']:.3f}]",
              f"{row['tokens_per_s_per_gpu']:.0f}", f"{row['efficiency']:.3f}", f"{row['mfu']:.3f}",
              _fmt(row["bubble_measured"]), f"{row['bubble_predicted']:.3f}", f"{row['predicted_step_s']:.3f}",
              _fmt(row["optimizer_s"]), f"{row['peak_memory_GiB']:.2f}", row["microbatches"][:3]]
             for v, row in cfg["variants"].items()],
            "llrrrrrrrrl",
        )  # fmt: skip
        if cfg["ratios"]:
            lines += ["", *report.table(["speedup (median of per-step ratios)", "measured", "calibrated prediction"],
                                        [[name.replace("_vs_", " vs "), f"{r['measured']:.3f}", f"{r['predicted']:.3f}"]
                                         for name, r in cfg["ratios"].items()], "lrr")]  # fmt: skip
        lines.append("")
    if payload.get("skipped"):
        lines.append(
            "Not run (time budget): "
            + ", ".join(f"{s['workload']}:{s['per_rank']}" for s in payload["skipped"])
            + "\n"
        )
    check = insitu_cost_check(payload)
    if check is not None:
        models = [("single-GPU calibration (used for planning)", check["calibrated"])]
        if "calibrated_floor" in check:
            models.append(("same single-GPU points fitted with a floor (not used here)", check["calibrated_floor"]))
        models.append(("in-situ refit", check["in_situ"]))
        lines.append("## Cost model in the sharded run (ODC microbatches, C and D, after warm-up)\n")
        lines.append(f"{check['microbatches']} microbatches ({check['multi_doc']} with several documents). Relative error "
                     "of the predicted microbatch time, (predicted − measured) / measured:\n")  # fmt: skip
        lines += report.table(
            ["model", "a", "b", "c", "floor", "median abs. error", "single-document median", "multi-document median"],
            [[name, f"{m['a']:.4g}", f"{m['b']:.4g}", f"{m['c']:.4g}", f"{m.get('floor', 0.0):.4g}",
              f"{m['median_abs']:.3f}", _fmt(m.get("single_doc_median_signed"), "+.3f"),
              _fmt(m.get("multi_doc_median_signed"), "+.3f")] for name, m in models],
            "lrrrrrrr",
        )  # fmt: skip
        lines.append("")
    lines.append("## Simulator: D vs B (compute + measured optimizer time) by world size\n")
    sims, sim_rows = {}, []
    for cfg in results:
        if cfg["workload"] == "balanced" or "D_vs_B" not in cfg["ratios"]:
            continue
        models = [("calibration", None)]
        if check is not None:
            models.append(("in-situ refit", check["in_situ"]))
        for model_name, coefficients in models:
            sim = simulate_scaling(payload, cfg["workload"], cfg["per_rank"], coefficients=coefficients,
                                   optimizer_s=cfg["variants"]["D"]["optimizer_s"] or 0.0)  # fmt: skip
            sims[f"{cfg['workload']}:{cfg['per_rank']}:{model_name}"] = sim
            sim_rows.append([cfg["workload"], cfg["per_rank"], model_name, *(f"{sim[w]:.3f}" for w in SIM_WORLD_SIZES),
                             f"{cfg['ratios']['D_vs_B']['measured']:.3f} ({W} GPUs)"])  # fmt: skip
    lines += report.table(["workload", "per rank", "cost model", *(f"{w} GPUs" for w in SIM_WORLD_SIZES), "measured here"],
                          sim_rows, "lrl" + "r" * (len(SIM_WORLD_SIZES) + 1))  # fmt: skip
    lines.append("\nThe 2-GPU column uses fresh samples from the same generator; the per-config tables above give the "
                 "prediction for the exact measured samples.\n")  # fmt: skip
    name = stem(payload)
    images = []
    try:
        images = _plots(payload, results, Path(out_dir), name)
    except Exception as err:  # noqa: BLE001 - never lose the numbers to a plotting problem
        lines.append(f"(plots failed: {type(err).__name__}: {err})")
    for image in images:
        lines.append(f"![{image.stem}]({image.name})")
    md = "\n".join(lines) + "\n"
    payload_out = {**payload, "analysis": results, "simulator": sims, "insitu_cost_check": check}
    report.write(out_dir, name, payload_out, md)
    return md


def _plots(payload, results, out: Path, stem: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(results)) + 3, 4))
    width = 0.8 / len(VARIANTS)
    for k, v in enumerate(VARIANTS):
        xs = [i + (k - 1.5) * width for i, cfg in enumerate(results) if v in cfg["variants"]]
        ys = [cfg["variants"][v]["tokens_per_s_per_gpu"] for cfg in results if v in cfg["variants"]]
        ax.bar(xs, ys, width, label=f"{v}: {DESCRIPTIONS[v]}")
    for i, cfg in enumerate(results):
        cfg_payload = payload["configs"][i]
        warm = cfg_payload["warmup"]
        tok = statistics.median(cfg_payload["tokens"][warm:]) / cfg["bound_s_median"] / payload["world_size"]
        ax.plot([i - 0.45, i + 0.45], [tok, tok], "k--", lw=1, label="bound" if i == 0 else None)
    ax.set_xticks(range(len(results)), [f"{c['workload']}\n{c['per_rank']}/rank" for c in results])
    ax.set_ylabel("tokens / s / GPU")
    ax.set_title(f"SFT step throughput, {payload['world_size']} ranks")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = out / f"{stem}_throughput.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(path)
    timeline = _timeline(payload, out, stem, plt)
    if timeline is not None:
        paths.append(timeline)
    return paths


def _timeline(payload, out: Path, stem: str, plt):
    """Per-rank busy/idle of B and D in one representative step (the step with D's median time)."""
    cfg = next(
        (c for c in payload["configs"] if {"B", "D"} <= set(c["variants"]) and c["workload"] != "balanced"),
        None,
    )
    if cfg is None:
        return None
    W, warm = payload["world_size"], cfg["warmup"]
    by = {(r["variant"], r["step"], r["rank"]): r for r in cfg["records"]}
    measured = list(range(warm, len(cfg["lengths"])))
    d_times = sorted(measured, key=lambda s: max(by["D", s, r]["wall_s"] for r in range(W)))
    s = d_times[len(d_times) // 2]
    fig, axes = plt.subplots(2, 1, figsize=(10, 1.2 + 0.9 * W), sharex=True)
    for ax, v in zip(axes, ("B", "D")):
        step_time = max(by[v, s, r]["wall_s"] for r in range(W))
        for r in range(W):
            rec = by[v, s, r]
            ends = [0.0] + rec["mb_end_s"]
            comp = None
            if v == "B" and ("C", s, r) in by:  # B runs C's microbatches: C's durations are the compute
                c_ends = [0.0] + by["C", s, r]["mb_end_s"]
                comp = [b - a for a, b in zip(c_ends, c_ends[1:])]
            for j, (a, b) in enumerate(zip(ends, ends[1:])):
                busy = min(b - a, comp[j]) if comp is not None else b - a
                ax.barh(r, busy, left=a, color=f"C{j % 10}", edgecolor="k", lw=0.5)
                if b - a > busy:
                    ax.barh(
                        r,
                        b - a - busy,
                        left=a + busy,
                        color="lightgrey",
                        hatch="//",
                        edgecolor="grey",
                        lw=0.5,
                    )
                ax.text(
                    a + busy / 2, r, _tokens_label(rec["mb_tokens"][j]), ha="center", va="center", fontsize=7
                )
            if step_time > ends[-1]:
                ax.barh(
                    r,
                    step_time - ends[-1],
                    left=ends[-1],
                    color="white",
                    hatch="..",
                    edgecolor="grey",
                    lw=0.5,
                )
        ax.set_yticks(range(W), [f"rank {r}" for r in range(W)])
        ax.set_title(f"{v}: {DESCRIPTIONS[v]} — step {step_time:.2f} s", fontsize=9)
    axes[-1].set_xlabel(
        "seconds since step start (coloured: microbatch compute, hatched: waiting, incl. optimizer)"
    )
    fig.suptitle(f"{cfg['workload']}, {cfg['per_rank']} samples/rank, step {s}", fontsize=10)
    fig.tight_layout()
    path = out / f"{stem}_timeline.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _tokens_label(tokens: int) -> str:
    return f"{tokens / 1000:.1f}k" if tokens >= 1000 else str(tokens)


def merge(payloads: list[dict]) -> dict:
    """One payload from several runs of the same setup (configs appended; the first run's calibration and env)."""
    merged = {**payloads[0], "configs": [], "skipped": []}
    done = set()
    for p in payloads:
        if p["world_size"] != merged["world_size"] or p["args"]["model"] != merged["args"]["model"]:
            raise ValueError("can only merge runs with the same model and world size")
        merged["configs"] += [
            {**c, "calibration": c.get("calibration", p["calibration"])} for c in p["configs"]
        ]
        done |= {(c["workload"], c["per_rank"]) for c in p["configs"]}
        merged["skipped"] += p.get("skipped", [])
    merged["skipped"] = [s for s in merged["skipped"] if (s["workload"], s["per_rank"]) not in done]
    merged["runs"] = [{"env": p["env"], "calibration": p["calibration"], "configs": [
        f"{c['workload']}:{c['per_rank']}" for c in p["configs"]]} for p in payloads]  # fmt: skip
    return merged


def stem(payload: dict) -> str:

    env = payload["env"]
    return f"sft_e2e_{report.hardware_tag(env)}_{env['date'][:10]}{payload['args'].get('tag', '')}"
