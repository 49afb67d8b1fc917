"""End-to-end SFT steps on the same samples: TRL-default packing, FSDP2 + LB-Micro, ODC + LB-Micro, ODC + LB-Mini.

Variants (docs/design.md definitions; every variant trains the same samples in the same order):

- **A** what users run today: TRL SFTTrainer's compute path (its fused LM head, full activation checkpointing as
  SFTConfig defaults), TRL's own packing (``trl.pack_dataset``, best-fit decreasing into rows of the token
  budget), rows dealt round-robin over ranks like ``DistributedSampler``, one row per microbatch, FSDP2 collectives
  (ranks with fewer rows run an empty dummy microbatch, as gradient accumulation needs equal counts);
- **B** FSDP2 collectives + LB-Micro (equal microbatch counts, cost-balanced per microbatch index), A's compute path;
- **C** ODC + LB-Micro (same plan and compute path as B: isolates the communication change);
- **D** ODC + LB-Mini with odc_hf's defaults (the product): TRL's fused head, Liger's layer kernels when installed on
  CUDA, activation checkpointing chosen by ``auto`` for the token budget (``odc_hf.integrations.compute.activation_checkpointing``),
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

    python -m benchmarks.sft.e2e --out benchmarks/results                  # all GPUs of the host
    python -m benchmarks.sft.e2e --model tiny --world-size 2 --steps 2 --warmup 1 --workloads longalign \
        --minibatch 2 --max-tokens 256                                      # CPU smoke run (gloo + shared memory)
    python -m benchmarks.sft.e2e --report-only results.json                # re-render report and plots
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.common import report
from benchmarks.common.sft_setup import (  # noqa: E402
    build_model,
    calibrate_cost_model,
    model_config,
    padded_rows,
    plans_for_step,
    run_step,
    sample_ids,
    step_lengths,
)
from benchmarks.sft.e2e_report import VARIANTS, merge, predicted, render, stem  # noqa: E402


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

    from odc_hf import attention
    from odc_hf.balance.cost import FlopCostModel
    from odc_hf.balance.planner import makespan_lower_bound
    from odc_hf.integrations.trainer.bundle import BundleCollator
    from odc_hf.integrations.trainer.stats import DeviceClock

    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    clock = DeviceClock(device)
    config = model_config(args)
    began = time.monotonic()
    env = report.environment() if rank == 0 else None
    from odc_hf.balance.memory import describe_checkpointing
    from odc_hf.integrations.compute import activation_checkpointing as ac
    from odc_hf.integrations.compute import fused_head as cp

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
        estimate = sum(predicted(p, v)[0] for p in plans for v in variants)
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
                "predicted": {v: [predicted(p, v) for p in plans]
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


# -- the command line -------------------------------------------------------------------------------------
def _write(payload: dict, out_dir, *, final: bool) -> None:
    """The raw JSON of what has run so far, then the report (sft_e2e_report.py) from it."""

    report.write_json(Path(out_dir) / f"{stem(payload)}.raw.json", payload, indent=None)
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="1.5B",
                        help="tiny, or a Qwen2.5 size from odc_hf.prediction.workloads (1.5B, 7B, ...)")  # fmt: skip
    parser.add_argument("--workloads", default="longalign,balanced,swe_smith,tulu")
    parser.add_argument("--minibatch", type=_ints, default=[4, 2, 8],
                        help="samples per rank per step (comma list)")  # fmt: skip
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
    parser.add_argument("--all-variants-at", type=_ints, default=[4],
                        help="samples per rank at which A, C and H run too (B and D always run)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=10, help="measured steps per config")
    parser.add_argument("--warmup", type=int, default=1,
                        help="unmeasured steps per config (after a global warm-up)")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=32768,
                        help="token budget per microbatch (= max length)")  # fmt: skip
    parser.add_argument("--balanced-length", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument(
        "--calibration-lengths",
        type=_ints,
        default=[512, 2048, 4096, 8192, 16384, 24576, 32768],
    )
    parser.add_argument("--calibration-repeats", type=int, default=2)
    parser.add_argument("--time-budget", type=float, default=540.0,
                        help="seconds; a config is skipped when its calibrated estimate would overrun")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=300.0, help="ODC peer-wait timeout (s)")
    parser.add_argument("--expandable-segments", action="store_true",
                        help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the ranks")  # fmt: skip
    parser.add_argument("--tag", default="", help="suffix of the output file names")
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("--out", default=str(report.RESULTS / "sft"))
    parser.add_argument("--report-only", default=None,
                        help="re-render the report from one or more .raw.json (comma list; merged)")  # fmt: skip
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
