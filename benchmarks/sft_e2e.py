"""End-to-end SFT steps on the same samples: TRL-default packing, FSDP2 + LB-Micro, ODC + LB-Micro, ODC + LB-Mini.

Variants (docs/design.md definitions; every variant trains the same samples in the same order):

- **A** what users run today: TRL SFTTrainer's compute path (its fused LM head, full activation checkpointing as
  SFTConfig defaults), TRL's own packing (``trl.pack_dataset``, best-fit decreasing into rows of the token
  budget), rows dealt round-robin over ranks like ``DistributedSampler``, one row per microbatch, FSDP2 collectives
  (ranks with fewer rows run an empty dummy microbatch, as gradient accumulation needs equal counts);
- **B** FSDP2 collectives + LB-Micro (equal microbatch counts, cost-balanced per microbatch index), A's compute path;
- **C** ODC + LB-Micro (same plan and compute path as B: isolates the communication change);
- **D** ODC + LB-Mini with odc_hf's defaults (the product): TRL's fused head, Liger's layer kernels when installed on
  CUDA, activation checkpointing chosen by ``auto`` for the token budget (``odc_hf.integrations.compute_path``),
  planned with a cost model calibrated on that path. Liger's RoPE patch is process-wide, so with Liger installed A-C
  use its RoPE too (their RMSNorm and MLP stay transformers');
- **bound**: Σ single-GPU fwd+bwd time of the minibatch's samples / ranks + optimizer time, from a cost model
  ``a + b·s + c·s²`` fitted to single-GPU timings of an unsharded copy on D's compute path (measured at the start).

One process group holds two models: one with FSDP2 collectives (A, B) and one with ODC (C, D); steps are
interleaved (the variant order rotates every step); D gets a third model when its compute path differs (Liger).
Qwen2.5-shaped model from a config (random init), bf16 compute with fp32 master weights and fp32 gradient reduction,
AdamW, gradient clipping at 1.0, ``attn_implementation="sdpa_varlen"`` (per-document causal SDPA on packed rows,
:mod:`odc_hf.attention`). The loss is TRL's fused LM head's token NLL summed and divided by the global label-token
count (as ``ODCSFTTrainer`` computes it).

Busy time of a rank is measured with CUDA events from the step start to the end of its last backward. ODC ranks
never wait inside a minibatch, so that is their compute; under FSDP2 waits hide inside the collectives, so B's
per-rank busy time is taken from C, which runs exactly B's microbatches. Peak memory of a variant is its model's
static state (parameters, optimizer state, ODC buffers) plus the largest transient allocation during its steps.

    python benchmarks/sft_e2e.py --out benchmarks/results                  # all GPUs of the host
    python benchmarks/sft_e2e.py --model tiny --world-size 2 --steps 2 --warmup 1 --workloads longalign \
        --minibatch 2 --max-tokens 256                                      # CPU smoke run (gloo + shared memory)
    python benchmarks/sft_e2e.py --report-only results.json                # re-render report and plots
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks.sft_setup import build_model, calibrate_cost_model, model_config, run_step, sample_ids  # noqa: E402

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


# -- the workload ---------------------------------------------------------------------------------------
def step_lengths(args, workload: str, per_rank: int, world_size: int, num_steps: int):
    """Per step, the lengths of the global minibatch (same for every variant)."""
    import numpy as np

    from odc_hf.prediction.workloads import generate_lengths

    size = world_size * per_rank
    if workload == "balanced":
        flat = np.full(size * num_steps, args.balanced_length, dtype=np.int64)
    else:
        flat = generate_lengths(workload, size * num_steps, args.seed, max_length=args.max_tokens)
    return [flat[i * size : (i + 1) * size].astype(np.int64) for i in range(num_steps)]


def trl_rows(lengths, budget: int) -> list[list[int]]:
    """Which samples TRL's best-fit-decreasing packing puts in each row (``trl.pack_dataset``)."""
    from datasets import Dataset
    from trl import pack_dataset

    ds = Dataset.from_dict({"input_ids": [[i] * int(n) for i, n in enumerate(lengths)]})
    packed = pack_dataset(ds, seq_length=budget, strategy="bfd")
    rows = []
    for row in packed["input_ids"]:
        members = list(dict.fromkeys(row))  # the samples in order of appearance
        rows.append(members)
    if sorted(i for r in rows for i in r) != list(range(len(lengths))):
        raise RuntimeError("TRL packing dropped or split samples; lengths must fit the budget")
    return rows


def plans_for_step(lengths, world_size: int, budget: int, cost_model, variants, cost_model_d=None,
                   hf_grad_accum: int = 1) -> dict:  # fmt: skip
    """Per variant, each rank's microbatches (lists of positions in ``lengths``) and the Plan when there is one.

    ``cost_model_d``: D's own (its compute path's) cost model; default ``cost_model``. H (A_hf) is transformers'
    ``BatchRebalanceSampler`` with ``hf_grad_accum`` microbatches per rank, as ``SFTTrainer`` with
    ``train_sampling_strategy="batch_rebalance"`` builds it; its microbatches are priced padded."""
    from odc_hf.balance.plan import Plan
    from odc_hf.balance.planner import plan_lb_micro, plan_lb_mini

    out = {}
    micro = plan_lb_micro(lengths, world_size, budget, cost_model, truncate=True)
    mini = plan_lb_mini(lengths, world_size, budget, cost_model_d or cost_model, truncate=True)
    for v in variants:
        if v in ("B", "C"):
            out[v] = (micro.microbatches, micro)
        elif v == "D":
            out[v] = (mini.microbatches, mini)
        elif v == "A":
            rows = trl_rows(lengths, budget)
            dealt = [rows[r::world_size] for r in range(world_size)]
            width = max(len(d) for d in dealt)
            dealt = [d + [[] for _ in range(width - len(d))] for d in dealt]
            costs = [[cost_model.microbatch_cost(lengths[mb]) for mb in mbs] for mbs in dealt]
            plan = Plan(mode="trl_packing", microbatches=dealt, microbatch_costs=costs,
                        lower_bound=micro.lower_bound, cost_model=cost_model.describe())  # fmt: skip
            out[v] = (dealt, plan)
        elif v == "H":
            import numpy as np

            from odc_hf.prediction.batch_rebalance import rebalance_plan
            from odc_hf.prediction.lockstep import lockstep_cost_matrix

            clipped = np.minimum(np.asarray(lengths), budget)
            rows = rebalance_plan(clipped, world_size, hf_grad_accum)
            costs = lockstep_cost_matrix(rows, clipped, cost_model, layout="padded").tolist()
            plan = Plan(mode="batch_rebalance", microbatches=rows, microbatch_costs=costs,
                        lower_bound=micro.lower_bound, cost_model=cost_model.describe())  # fmt: skip
            out[v] = (rows, plan)
    return out


def padded_rows(examples: list[dict], pad_token_id: int = 0) -> list[dict]:
    """A padded microbatch as packed documents: every row right-padded to the widest, pads labelled -100.

    Each padded row is one document of the packed row (position_ids restart per document), so the compute is the
    padded batch's (rows x widest, attention over the widest per row) and, with causal attention and right padding,
    the loss is the padded batch's too: real tokens never attend to the pads after them.
    """
    widest = max((len(e["input_ids"]) for e in examples), default=0)
    out = []
    for e in examples:
        ids = list(e["input_ids"])
        pad = widest - len(ids)
        out.append({"input_ids": ids + [pad_token_id] * pad, "labels": ids + [-100] * pad})
    return out


# -- one rank ---------------------------------------------------------------------------------------------
def _static_bytes(model, optimizer, odc) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    for state in optimizer.state.values():
        for value in state.values():
            if hasattr(value, "to_local"):
                value = value.to_local()
            if hasattr(value, "numel"):
                total += value.numel() * value.element_size()
    if odc is not None:
        total += sum(u.spec.device_bytes for u in odc.units)
    return total


def _configs(args) -> list[tuple[str, int, str | None]]:
    """(workload, samples per rank, variants or None for the default rule) in run order."""
    if args.configs:
        out = []
        for item in args.configs.split(","):
            parts = item.split(":")
            if len(parts) not in (2, 3) or not parts[1].isdigit():
                raise SystemExit(f"--configs item {item!r}: expected workload:per_rank[:VARIANTS], e.g. longalign:4:ABCD")
            variants = parts[2] if len(parts) == 3 else None
            if variants is not None and (not variants or set(variants) - set(VARIANTS)):
                raise SystemExit(f"--configs item {item!r}: variants must be letters of {''.join(VARIANTS)}")
            out.append((parts[0], int(parts[1]), variants))
        return out
    return [(w, m, None) for w in args.workloads.split(",") for m in args.minibatch]


def _variants_for(args, workload: str, per_rank: int, explicit: str | None = None) -> list[str]:
    if explicit is not None:
        return [v for v in VARIANTS if v in explicit]
    full = per_rank in args.all_variants_at
    return [v for v in args.variants.split(",") if v in ("B", "D") or full]


def _run(rank, world_size, args):
    import numpy as np
    import torch
    import torch.distributed as dist

    from benchmarks import report
    from odc_hf import attention
    from odc_hf.balance.cost import FlopCostModel
    from odc_hf.balance.planner import makespan_lower_bound
    from odc_hf.integrations.bundle import BundleCollator
    from odc_hf.integrations.stats import DeviceClock

    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    clock = DeviceClock(device)
    config = model_config(args)
    began = time.monotonic()
    env = report.environment() if rank == 0 else None
    from odc_hf.balance.memory import describe_checkpointing
    from odc_hf.integrations import activation_checkpointing as ac
    from odc_hf.integrations import compute_path as cp

    # A-C: TRL SFTTrainer's defaults (fused head, full AC; calibrated first, before any Liger patch). D: odc_hf's.
    cost_model, points = calibrate_cost_model(rank, world_size, args, device, config)
    flops = FlopCostModel.from_config(config)
    budget = args.max_tokens
    collator = BundleCollator(max_tokens_per_microbatch=budget, truncate=True, pad_token_id=0)
    models = {kind: build_model(kind, config, device, args) for kind in ("fsdp", "odc")}
    d_kernels = "liger" if cp.liger_problem(device) is None else "none"
    d_kind = "odc_default" if d_kernels == "liger" else "odc"  # same weights; Liger patches need their own model
    built = build_model("odc", config, device, args, kernels=d_kernels, checkpointing="auto")
    checkpointed = {"A": config.num_hidden_layers, "B": config.num_hidden_layers, "C": config.num_hidden_layers,
                    "D": built[3], "H": config.num_hidden_layers}  # fmt: skip
    if d_kind == "odc_default":
        models[d_kind] = built
    else:  # D runs the "odc" model with its own checkpointing (set before each step); drop the spare copy
        built[2].close()
        del built
    cost_model_d, points_d = cost_model, points
    if (d_kernels, checkpointed["D"]) != ("none", config.num_hidden_layers):
        cost_model_d, points_d = calibrate_cost_model(rank, world_size, args, device, config, d_kernels, checkpointed["D"])
    planned = time.monotonic()
    shapes = attention.warm_up(models["odc"][0], budget, dtype=torch.bfloat16)  # per process: serves both models
    warm_up = {"attention_shapes": shapes, "seconds": time.monotonic() - planned, "bucket": attention.attention_of(models["odc"][0]).shape_bucket}
    model_of = {"A": "fsdp", "B": "fsdp", "C": "odc", "D": d_kind, "H": "fsdp"}
    # H's padded microbatches hold rows x widest row tokens: batch_rebalance has no token budget
    padded_collator = BundleCollator(max_tokens_per_microbatch=None, pad_token_id=0)
    paths = {v: {"kernels": d_kernels if v == "D" else "none", "loss": cp.TRL_FUSED_HEAD,
                 "activation_checkpointing": describe_checkpointing(checkpointed[v], config.num_hidden_layers)
                 + (" (auto)" if v == "D" else "")} for v in VARIANTS}  # fmt: skip
    payload = {
        "env": env,
        "args": vars(args),
        "world_size": world_size,
        "model_config": config.to_dict() if rank == 0 else None,
        "compute_paths": paths,
        "calibration": {"points": points, **cost_model.to_dict(), "describe": cost_model.describe(),
                        "compute_path": paths["B"]},
        "calibration_d": {"points": points_d, **cost_model_d.to_dict(), "describe": cost_model_d.describe(),
                          "compute_path": paths["D"]},
        "attention_warm_up": warm_up,
        "model_of": model_of,
        "configs": [],
        "skipped": [],
    }

    # one warm-up step per model on a short batch: NCCL communicators, Triton JIT of the ODC kernels
    warm = collator([[{"input_ids": list(range(1, 65))}]])
    for model, optimizer, odc, _ in models.values():
        run_step(model, optimizer, odc, warm, 63 * world_size, device, clock)

    for workload, per_rank, explicit in _configs(args):
        variants = _variants_for(args, workload, per_rank, explicit)
        num_steps = args.warmup + args.steps
        lengths = step_lengths(args, workload, per_rank, world_size, num_steps)
        hf_grad_accum = max(1, per_rank // args.hf_per_device)
        plans = [plans_for_step(ls, world_size, budget, cost_model, variants, cost_model_d, hf_grad_accum)
                 for ls in lengths]  # fmt: skip
        estimate = sum(_predicted(p, v)[0] for p in plans for v in variants)
        go = torch.tensor([1.0 if time.monotonic() - began + 1.3 * estimate + 20 < args.time_budget else 0.0],
                          device=device)  # fmt: skip
        dist.broadcast(go, 0)
        if go.item() == 0.0:
            payload["skipped"].append({"workload": workload, "per_rank": per_rank, "estimated_s": estimate})
            continue
        records = []
        for step, (ls, plan) in enumerate(zip(lengths, plans)):
            cache: dict[int, list[int]] = {}

            def example(i, step=step, ls=ls, cache=cache):
                if i not in cache:
                    cache[i] = sample_ids(args.seed, step, i, min(int(ls[i]), budget), config.vocab_size)
                return {"input_ids": cache[i]}

            global_labels = int(sum(min(int(n), budget) - 1 for n in ls))
            order = variants[step % len(variants) :] + variants[: step % len(variants)]
            for v in order:
                mine = plan[v][0][rank]
                if v == "H":
                    microbatches = padded_collator([padded_rows([example(i) for i in mb]) for mb in mine])
                else:
                    microbatches = collator([[example(i) for i in mb] for mb in mine])
                model, optimizer, odc, _ = models[model_of[v]]
                ac.enable_checkpointing(model, checkpointed[v])
                rec = run_step(model, optimizer, odc, microbatches, global_labels, device, clock)
                docs = [[min(int(ls[i]), budget) for i in mb] for mb in mine]
                rec.update(variant=v, step=step, rank=rank, mb_tokens=[sum(d) for d in docs], mb_docs=docs)
                records.append(rec)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, records)
        if rank == 0:
            summary = {
                "workload": workload, "per_rank": per_rank, "variants": variants, "warmup": args.warmup,
                "lengths": [ls.tolist() for ls in lengths],
                "tokens": [int(np.minimum(ls, budget).sum()) for ls in lengths],
                "flops": [float(flops.doc_costs(np.minimum(ls, budget)).sum()) for ls in lengths],
                "bound_compute_s": [makespan_lower_bound(ls, world_size, budget, cost_model_d, truncate=True)
                                    for ls in lengths],
                "predicted": {v: [_predicted(p, v) for p in plans]
                              for v in variants},
                "records": [r for part in gathered for r in part],
            }  # fmt: skip
            payload["configs"].append(summary)
        static = {}
        for kind, (model, optimizer, odc, _) in models.items():
            value = torch.tensor([float(_static_bytes(model, optimizer, odc))], device=device)
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
            static[kind] = float(value.item())
        payload["static_bytes"] = static
        payload["elapsed_s"] = time.monotonic() - began
        if rank == 0:
            _write(payload, args.out, final=False)
    for _, _, odc, _ in models.values():
        if odc is not None:
            odc.close()
    if rank == 0:
        _write(payload, args.out, final=True)
    return payload if rank == 0 else None


def _predicted(plan_entry: dict, variant: str) -> tuple[float, float]:
    """(predicted step compute seconds, predicted bubble) of one variant's plan: FSDP semantics for A and B."""
    plan = plan_entry[variant][1]
    semantics = "fsdp" if variant in LOCKSTEP_VARIANTS else "odc"
    return plan.predicted_time(semantics), plan.predicted_bubble(semantics)


# -- analysis and report ----------------------------------------------------------------------------------
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
    """The numbers the end-to-end issue's acceptance points are about, where this run has them."""
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
    from benchmarks import report

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
        lines.append("| variant | step s median [min, max] | tokens/s/GPU | efficiency | MFU | bubble meas. | "
                     "bubble pred. | pred. step s | optimizer s | peak GiB | microbatches/rank (first steps) |")  # fmt: skip
        lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for v, row in cfg["variants"].items():
            lines.append(
                f"| {v} | {row['step_s_median']:.3f} [{row['step_s_min']:.3f}, {row['step_s_max']:.3f}] | "
                f"{row['tokens_per_s_per_gpu']:.0f} | {row['efficiency']:.3f} | {row['mfu']:.3f} | "
                f"{_fmt(row['bubble_measured'])} | {row['bubble_predicted']:.3f} | {row['predicted_step_s']:.3f} | "
                f"{_fmt(row['optimizer_s'])} | {row['peak_memory_GiB']:.2f} | {row['microbatches'][:3]} |"
            )
        if cfg["ratios"]:
            lines.append(
                "\n| speedup (median of per-step ratios) | measured | calibrated prediction |\n|---|---:|---:|"
            )
            for name, r in cfg["ratios"].items():
                lines.append(
                    f"| {name.replace('_vs_', ' vs ')} | {r['measured']:.3f} | {r['predicted']:.3f} |"
                )
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
        lines.append(
            "| model | a | b | c | floor | median abs. error | single-document median | multi-document median |"
        )
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, m in models:
            lines.append(f"| {name} | {m['a']:.4g} | {m['b']:.4g} | {m['c']:.4g} | {m.get('floor', 0.0):.4g} | {m['median_abs']:.3f} | "
                         f"{_fmt(m.get('single_doc_median_signed'), '+.3f')} | {_fmt(m.get('multi_doc_median_signed'), '+.3f')} |")  # fmt: skip
        lines.append("")
    lines.append("## Simulator: D vs B (compute + measured optimizer time) by world size\n")
    lines.append(
        "| workload | per rank | cost model | "
        + " | ".join(f"{w} GPUs" for w in SIM_WORLD_SIZES)
        + " | measured here |"
    )
    lines.append("|---|---:|---|" + "---:|" * (len(SIM_WORLD_SIZES) + 1))
    sims = {}
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
            lines.append(f"| {cfg['workload']} | {cfg['per_rank']} | {model_name} | "
                         + " | ".join(f"{sim[w]:.3f}" for w in SIM_WORLD_SIZES)
                         + f" | {cfg['ratios']['D_vs_B']['measured']:.3f} ({W} GPUs) |")  # fmt: skip
    lines.append("\nThe 2-GPU column uses fresh samples from the same generator; the per-config tables above give the "
                 "prediction for the exact measured samples.\n")  # fmt: skip
    stem = _stem(payload)
    images = []
    try:
        images = _plots(payload, results, Path(out_dir), stem)
    except Exception as err:  # noqa: BLE001 - never lose the numbers to a plotting problem
        lines.append(f"(plots failed: {type(err).__name__}: {err})")
    for image in images:
        lines.append(f"![{image.stem}]({image.name})")
    md = "\n".join(lines) + "\n"
    payload_out = {**payload, "analysis": results, "simulator": sims, "insitu_cost_check": check}
    report.write(out_dir, stem, payload_out, md)
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


def _stem(payload: dict) -> str:
    from benchmarks import report

    env = payload["env"]
    return f"sft_e2e_{report.hardware_tag(env)}_{env['date'][:10]}{payload['args'].get('tag', '')}"


def _write(payload: dict, out_dir, *, final: bool) -> None:
    from benchmarks import report

    stem = _stem(payload)
    report.write_json(Path(out_dir) / f"{stem}.raw.json", payload, indent=None)
    if payload["configs"]:
        try:
            render(payload, out_dir)
        except Exception as err:  # noqa: BLE001 - the raw JSON is already safe
            print(f"report rendering failed: {type(err).__name__}: {err}", file=sys.stderr)
            if final:
                raise


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="1.5B", help="tiny, or a Qwen2.5 size from odc_hf.prediction.workloads (1.5B, 7B, ...)"
    )
    parser.add_argument("--workloads", default="longalign,balanced,swe_smith,tulu")
    parser.add_argument(
        "--minibatch",
        type=_ints,
        default=[4, 2, 8],
        help="samples per rank per step (comma list)",
    )
    parser.add_argument(
        "--configs",
        default=None,
        help="explicit order, e.g. longalign:4:ABCD,balanced:4,longalign:2 (optional :VARIANTS overrides "
        "--variants/--all-variants-at for that config)",
    )
    parser.add_argument("--variants", default="A,B,C,D,H")
    parser.add_argument("--hf-per-device", type=int, default=2,
                        help="H (A_hf): per_device_train_batch_size of batch_rebalance; gradient accumulation = "
                             "samples per rank / this")  # fmt: skip
    parser.add_argument(
        "--all-variants-at",
        type=_ints,
        default=[4],
        help="samples per rank at which A, C and H run too (B and D always run)",
    )
    parser.add_argument("--steps", type=int, default=10, help="measured steps per config")
    parser.add_argument(
        "--warmup", type=int, default=1, help="unmeasured steps per config (after a global warm-up)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=32768, help="token budget per microbatch (= max length)"
    )
    parser.add_argument("--balanced-length", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument(
        "--calibration-lengths",
        type=_ints,
        default=[512, 2048, 4096, 8192, 16384, 24576, 32768],
    )
    parser.add_argument("--calibration-repeats", type=int, default=2)
    parser.add_argument(
        "--time-budget",
        type=float,
        default=540.0,
        help="seconds; a config is skipped when its calibrated estimate would overrun",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="ODC peer-wait timeout (s)")
    parser.add_argument(
        "--expandable-segments",
        action="store_true",
        help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the ranks",
    )
    parser.add_argument("--tag", default="", help="suffix of the output file names")
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument(
        "--report-only",
        default=None,
        help="re-render the report from one or more .raw.json (comma list; merged)",
    )
    args = parser.parse_args(argv)
    if args.report_only:
        payload = merge([json.loads(Path(p).read_text()) for p in args.report_only.split(",")])
        print(render(payload, args.out))
        return
    import torch

    from odc_hf.testing import run_ranks

    cuda = torch.cuda.device_count() >= 2
    world_size = args.world_size or (torch.cuda.device_count() if cuda else 2)
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if args.expandable_segments else None
    results = run_ranks(_run, world_size, args, backend="nccl" if cuda else "gloo",
                        timeout_s=args.time_budget + 900, env=env)  # fmt: skip
    if results[0]["configs"]:
        print(render(results[0], args.out))


if __name__ == "__main__":
    main()
