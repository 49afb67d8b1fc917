"""What ``python -m odc_hf.estimate`` predicts and concludes: every step of one epoch planned as the
trainers plan it and priced on a cluster (:mod:`.simulate`), ODC's speedup over the fastest other schedule with
its spread over steps (:func:`verdict`), and the report it prints. The command line is :mod:`.estimate_cli`, its
inputs :mod:`.estimate_inputs`.
"""

# The planners and transformers are imported where they are used, so that ``--help`` and bad arguments answer
# in well under a second (tests/prediction/test_estimate.py times it).
from __future__ import annotations

__all__ = ["MIN_VERDICT_STEPS", "THRESHOLD", "estimate", "format_report", "verdict"]

THRESHOLD = 1.05
"""ODC is called worth it when it is predicted at least 5 % faster than the best FSDP2 layout: on 2 x H200 the
measured speedups were 0.95-1.00 of the predicted ones, and ODC's fixed per-step costs on short, launch-bound
steps (1-4 % measured) are only partly in the model."""
MIN_VERDICT_STEPS = 10
"""No verdict from fewer simulated steps: a step's time depends on which samples it drew, and below ten steps the
spread over steps says little about the mean (at 1,024 GPUs x 4 samples one step is 4,096 samples)."""
UNCERTAINTY_SE = 2.0
"""A verdict holds when the speedup's interval of this many standard errors (over steps) is on one side of the
threshold; otherwise it is "too close to call"."""
LABELS = {
    "rebalance_full": "FSDP2 full + batch_rebalance (today)",
    "rebalance_hsdp": "FSDP2 HSDP + batch_rebalance (today)",
    "fsdp2_full": "FSDP2 full sharding + LB-Micro",
    "fsdp2_hsdp": "FSDP2 HSDP + LB-Micro",
    "odc_hsdp": "ODC HSDP + LB-Mini",
}
SINGLE_NODE_LABELS = {
    "rebalance_hsdp": "FSDP2 + batch_rebalance (today)",
    "fsdp2_hsdp": "FSDP2 + LB-Micro",
    "odc_hsdp": "ODC + LB-Mini",
}
REBALANCE_MAX_STEPS = 32
"""Steps planned with transformers' sampler by default: its search is pure Python (6.6-45 s per step of 4,096
samples over 1,024 ranks on one core), so its rows cover the first steps only; each row states its step count."""
REBALANCE_TIME_S = 30.0
"""... and it stops after the step that takes its planning past this many seconds (per cluster layout)."""


def estimate(
    lengths,
    shape,
    cost_model,
    *,
    gpus_per_node: int,
    num_nodes: int,
    network_gb_per_s: float,
    per_rank: int,
    max_tokens: int,
    seed: int = 0,
    max_steps: int | None = None,
    progress=None,
    grad_accum: int | None = None,
    rebalance_max_steps: int | None = REBALANCE_MAX_STEPS,
    rebalance_time_s: float = REBALANCE_TIME_S,
) -> dict:
    """Summaries (:func:`~odc_hf.prediction.simulate.summarize`) on one node and, for ``num_nodes > 1``, on all.

    With ``grad_accum`` (per-device batch = ``per_rank / grad_accum``), transformers' ``batch_rebalance`` plans the
    first ``rebalance_max_steps`` steps too (rows ``rebalance_*``), when the installed transformers has it.
    """
    from .cluster import Cluster
    from .cost_models import h200_overheads
    from .simulate import plan_steps, step_times, summarize

    overheads = h200_overheads()
    out = {}
    lockstep_for = None
    if grad_accum is not None:
        from .batch_rebalance import available, rebalance_plan

        ok, why = available()
        if ok:
            def lockstep_for(world):
                import time

                spent = [0.0]

                def plan(batch):
                    if spent[0] > rebalance_time_s:
                        return None  # its rows keep the steps planned so far (each row states its count)
                    start = time.perf_counter()
                    out = rebalance_plan(batch, world, grad_accum)
                    spent[0] += time.perf_counter() - start
                    return out

                return plan
        else:
            out["rebalance_unavailable"] = why
    layouts = [("single_node", 1)] + ([("multi_node", num_nodes)] if num_nodes > 1 else [])
    for key, nodes in layouts:
        cluster = Cluster(gpus_per_node=gpus_per_node, num_nodes=nodes, network_gb_per_s=network_gb_per_s)
        steps = plan_steps(
            lengths, cluster.world_size, per_rank, max_tokens, cost_model,
            seed=seed, max_steps=max_steps, progress=progress,
            lockstep=None if lockstep_for is None else lockstep_for(cluster.world_size),
            lockstep_max_steps=rebalance_max_steps,
        )  # fmt: skip
        out[key] = {"cluster": cluster.describe(), **summarize(step_times(steps, shape, cluster, overheads))}
    return out


def verdict(result: dict) -> dict:
    """ODC against the fastest other schedule on the target cluster, with its step count and spread over steps.

    ``answer``: ``"worth it"`` when the speedup minus ``UNCERTAINTY_SE`` standard errors is >= THRESHOLD, ``"NOT
    worth it"`` when the speedup plus them is below it, ``"too close to call"`` in between, and ``"no verdict"``
    below MIN_VERDICT_STEPS simulated steps.
    """
    from .simulate import BASELINES

    key = "multi_node" if "multi_node" in result else "single_node"
    s = result[key]
    present = [b for b in BASELINES if f"speedup_vs_{b}" in s and (key == "multi_node" or not b.endswith("_full"))]
    baseline = min(present, key=lambda b: s[f"speedup_vs_{b}"])  # the strongest competitor
    speedup, se = s[f"speedup_vs_{baseline}"], s[f"speedup_vs_{baseline}_se"]
    steps = s[f"speedup_vs_{baseline}_steps"]
    low, high = speedup - UNCERTAINTY_SE * se, speedup + UNCERTAINTY_SE * se
    if steps < MIN_VERDICT_STEPS:
        answer = "no verdict"
    elif low >= THRESHOLD:
        answer = "worth it"
    elif high < THRESHOLD:
        answer = "NOT worth it"
    else:
        answer = "too close to call"
    return {
        "layout": key,
        "baseline": baseline,
        "speedup": speedup,
        "interval": [low, high],
        "per_step_p10_p90": [s[f"speedup_vs_{baseline}_p10"], s[f"speedup_vs_{baseline}_p90"]],
        "steps": steps,
        "min_steps": MIN_VERDICT_STEPS,
        "threshold": THRESHOLD,
        "answer": answer,
        "worth_it": answer == "worth it",
    }


def format_report(result: dict, header: list[str], *, step_samples: dict | None = None) -> str:
    lines = ["odc_hf.estimate: predicted step times, ODC + LB-Mini vs FSDP2 + LB-Micro and batch_rebalance", "",
             *header]  # fmt: skip
    columns = (f"  {'':40}{'step s':>9}{'ODC speedup':>13}{'bubble':>9}{'comm s':>9}{'optim. s':>10}"
               f"{'steps':>7}  {'step s p10-p90':>15}")  # fmt: skip
    for key in ("single_node", "multi_node"):
        if key not in result:
            continue
        s = result[key]
        lines += ["", f"{s['cluster']}: {s['steps']} steps", columns]
        names = SINGLE_NODE_LABELS if key == "single_node" else LABELS
        for name, label in names.items():
            if name not in s:
                continue
            row = s[name]
            speedup = "" if name == "odc_hsdp" else f"{s[f'speedup_vs_{name}']:.3f}x"
            lines.append(
                f"  {label:40}{row['total_s']:9.3f}{speedup:>13}{row['bubble']:9.1%}{row['comm_s']:9.3f}"
                f"{row['overhead_s']:10.3f}{row['steps']:7d}  {row['total_p10_s']:7.3f}-{row['total_p90_s']:.3f}"
            )
        lines.append(f"  {'balance bound':40}{s['bound_s']:9.3f}")
    if "rebalance_unavailable" in result:
        lines += ["", f"batch_rebalance rows left out: {result['rebalance_unavailable']}"]
    v = verdict(result)
    where = result[v["layout"]]["cluster"]
    names = SINGLE_NODE_LABELS if v["layout"] == "single_node" else LABELS
    base, odc = names[v["baseline"]], names["odc_hsdp"]
    p10, p90 = v["per_step_p10_p90"]
    low, high = v["interval"]
    numbers = (f"{odc} is predicted {v['speedup']:.3f}x as fast as {base}, the fastest other schedule, over "
               f"{v['steps']} simulated steps (per step {p10:.3f}-{p90:.3f}x, p10-p90; mean within "
               f"{low:.3f}-{high:.3f}x at {UNCERTAINTY_SE:g} standard errors)")  # fmt: skip
    if v["answer"] == "no verdict":
        need = "" if step_samples is None else (
            f" One step takes {step_samples['per_step']:,} samples ({step_samples['world']:,} GPUs x "
            f"{step_samples['per_rank']} per GPU): {MIN_VERDICT_STEPS} steps need {MIN_VERDICT_STEPS * step_samples['per_step']:,}."
        )  # fmt: skip
        verdict_line = (
            f"verdict: none. On {where}, {numbers}; a verdict needs at least {MIN_VERDICT_STEPS} steps.{need} Give "
            "more samples (--dataset with more rows, no --max-samples / --max-steps), or estimate fewer GPUs or "
            "fewer samples per GPU."
        )
    elif v["answer"] == "too close to call":
        verdict_line = (f"verdict: too close to call. On {where}, {numbers}: the interval spans the threshold "
                        f"{THRESHOLD:.2f}x; more samples narrow it.")  # fmt: skip
    else:
        verdict_line = (f"verdict: ODC is {v['answer']} for this data. On {where}, {numbers} (threshold "
                        f"{THRESHOLD:.2f}x: predictions were up to 5 % above measurements on 2 x H200).")  # fmt: skip
    lines += [
        "",
        verdict_line,
        "step s: mean predicted step time; ODC speedup: summed baseline time / summed ODC time over the steps both "
        "ran; bubble: median fraction of GPU time spent waiting for other GPUs; comm s: inter-node communication "
        "not hidden under compute; optim. s: optimizer step and ODC's minibatch sync; steps: steps simulated; "
        "p10-p90: spread of the step time over them; batch_rebalance (today): transformers' "
        "train_sampling_strategy='batch_rebalance' with padded microbatches; balance bound: perfect balance, free "
        "communication, the least per-step overhead of any row (no schedule can beat it).",
    ]
    return "\n".join(lines)
