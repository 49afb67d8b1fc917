"""GRPO end to end: ODC + rebalancing vs GRPOTrainer-style FSDP2 collectives, training phase and generation phase.

    python -m benchmarks.grpo.e2e                          # 2 GPUs (nccl) if present, else 2 CPU processes (gloo)
    python -m benchmarks.grpo.e2e --model tiny --steps 2   # CPU smoke run (shared-memory transport)

Training phase (one process group, two model instances with the same random init, interleaved step by step, the
order alternating): every step draws one GRPO generation batch of synthetic rollouts with AIME-like lengths
(``odc_hf.prediction.workloads.generate_lengths("grpo_aime")``: prompts 100-300 tokens, responses capped at 8k), random
tokens and advantages, and trains it twice on the same samples:

- **fsdp**: FSDP2 collectives as TRL's GRPOTrainer runs them: each rank takes its ``per_device x grad_accum``
  completions, ``grad_accum`` microbatches of ``per_device`` completions each, padded (prompts left, completions
  right) with an attention mask;
- **odc**: ODC, the trainer's layout (``odc_hf.balance.plan_padded``): the generation batch split over
  ranks by cost (LB-Mini, then balanced by padded cost; calibrated 1.5B/H200 cost model) and each rank's share
  packed into the fewest padded microbatches of rows x longest <= ``per_device x cap`` tokens: counts differ.

Both compute what GRPOTrainer computes per token (TRL's fused LM head for the completion log-probs, the clipped
policy-gradient objective with old log-probs = detached current ones, loss normalised by the global number of
completion tokens as for ``loss_type="dapo"``), bf16 with fp32 master weights, activation checkpointing, AdamW.
The per-step losses of the two variants are reported side by side (they must agree: same samples, same weights).

Generation phase: ``model.generate()`` (greedy, KV cache) on a few prompts of varied lengths per rank, each rank
to its own ``max_new_tokens``: FSDP2 collectives need ``synced_gpus=True`` (a finished rank keeps running dummy
forwards, or the other would hang in the next all-gather); ODC runs ``synced_gpus=False``.
Writes ``grpo_e2e_<model>_<hardware>_<date>.{json,md}`` under ``--out`` (default ``$OUT`` or benchmarks/results).
Each step also records the cost model's prediction of both layouts (fwd+bwd only); ``--predict`` prints those
predictions for the run's rollouts without training (CPU, seconds):

    python -m benchmarks.grpo.e2e --predict --steps 20    # 1.5B/H200 calibration, the 2-GPU run's layouts

Runtime on 2xH200 (measured 2026-11-29, ``--warmup 1 --steps 8``): model setup plus 9 training steps per variant
took most of 230 s (steps of 7-9 s per variant, the first 18 s); the generation phase did not finish inside that
limit, so give the default run (2 + 10 steps, then generation) about 6-7 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from odc_hf.transport.peer_memory import SAFE_GPU_ENV

ROOT = Path(__file__).resolve().parents[2]

for _k, _v in SAFE_GPU_ENV.items():
    os.environ.setdefault(_k, _v)

# Measured by sft_e2e on one H200 (the older calibration_qwen2.5-1.5B_h200_design.json holds unmeasured design notes).
CALIBRATION = ROOT / "benchmarks" / "results" / "planning" / "calibration_qwen2.5-1.5B_h200_2026-11-29.json"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", choices=["tiny", "1.5B"], default=None, help="default: 1.5B on GPUs, tiny on CPU"
    )
    p.add_argument("--steps", type=int, default=10, help="measured steps per variant (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--per_device", type=int, default=2, help="TRL per_device_train_batch_size")
    p.add_argument(
        "--grad_accum", type=int, default=8, help="TRL gradient_accumulation_steps (= steps_per_generation)"
    )
    p.add_argument("--max_length", type=int, default=None, help="sequence cap (default 8192; tiny: 512)")
    p.add_argument(
        "--cost_model", default=None, help="flop | calibration .json (default: 1.5B/H200 calibration on GPU)"
    )
    p.add_argument(
        "--gen_new_tokens", default=None, help="per-rank max_new_tokens, comma-separated (default 64,256)"
    )
    p.add_argument("--gen_prompts", type=int, default=4, help="prompts per rank in the generation phase")
    p.add_argument(
        "--gen_repeats", type=int, default=2, help="measured generate() calls per variant (after one warm-up)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results" / "grpo"))
    p.add_argument("--timeout_s", type=float, default=900)
    p.add_argument(
        "--predict", action="store_true", help="print both layouts' predicted step times; no training"
    )
    return p.parse_args(argv)


# -- rollouts -------------------------------------------------------------------------------------------------------
def rollouts(step: int, num: int, cap: int, vocab: int, seed: int):
    """``num`` synthetic GRPO samples: (prompt_len, completion_len, token ids, advantage), seeded by step."""
    import numpy as np

    from odc_hf.prediction.workloads import generate_lengths

    total = generate_lengths("grpo_aime", num, seed * 1000 + step, max_length=cap)
    rng = np.random.default_rng([seed, step])
    prompt = np.minimum(rng.integers(100, 301, size=num), np.maximum(total - 1, 1)) if cap >= 1024 else \
        np.minimum(rng.integers(cap // 16, cap // 5, size=num), total - 1)  # fmt: skip
    out = []
    for i in range(num):
        p, c = int(prompt[i]), int(total[i] - prompt[i])
        ids = rng.integers(10, vocab, size=p + c)
        out.append(
            {
                "prompt": ids[:p],
                "completion": ids[p:],
                "advantage": float(rng.choice([-1.0, 1.0]) * rng.random()),
            }
        )
    return out


def padded_microbatch(samples, device, multiple: int = 1):
    """TRL's layout: prompts left-padded, completions right-padded; labels only on completion tokens.

    ``multiple``: round the row width up to it with masked completion columns (CUDA: see
    ``odc_hf.integrations.trl.grpo_batch.CUDA_PAD_TO_MULTIPLE_OF``, a torch 2.11 cuDNN NaN at widths 64 mod 128).
    """
    import torch

    from odc_hf.balance import padded_width

    pw = max(len(s["prompt"]) for s in samples)
    cw = padded_width(pw, max(len(s["completion"]) for s in samples), multiple)
    ids = torch.zeros((len(samples), pw + cw), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        p, c = len(s["prompt"]), len(s["completion"])
        ids[i, pw - p : pw] = torch.as_tensor(s["prompt"])
        ids[i, pw : pw + c] = torch.as_tensor(s["completion"])
        attn[i, pw - p : pw + c] = 1
    adv = torch.tensor([s["advantage"] for s in samples])
    return ids.to(device), attn.to(device), adv.to(device), cw


def layouts(samples, world: int, per_device: int, grad_accum: int, budget, cost_model, multiple: int = 1) -> dict:
    """Per variant, per rank, the microbatches (sample indices) of one step.

    fsdp: TRL's layout, rank r takes its ``per_device x grad_accum`` contiguous completions in ``grad_accum``
    microbatches of ``per_device``; odc: the trainer's :func:`~odc_hf.balance.plan_padded`.
    """
    from odc_hf.balance import padded_microbatch_width, plan_padded

    per_rank = per_device * grad_accum
    fsdp = [[list(range(start, start + per_device)) for start in range(r * per_rank, (r + 1) * per_rank, per_device)]
            for r in range(world)]  # fmt: skip
    lengths = [len(s["prompt"]) + len(s["completion"]) for s in samples]
    prompts = [len(s["prompt"]) for s in samples]  # the budget holds for the real padded width (rounded)
    if budget is None:  # TRL's worst case for these samples: per_device rows of the widest padded row
        budget = per_device * padded_microbatch_width(prompts, [len(s["completion"]) for s in samples], multiple)
    plan = plan_padded(lengths, world, budget, cost_model, prompts=prompts, multiple=multiple)
    return {"fsdp": fsdp, "odc": plan.microbatches, "budget": budget}


def predicted_step(samples, layout: dict, cost_model) -> dict:
    """The cost model's fwd+bwd time of a step: fsdp Σ_j max_r (collectives per microbatch), odc max_r Σ_j.

    A microbatch is priced as its padded rows: ``microbatch_cost([width] * rows)`` with width = longest prompt +
    longest completion (TRL pads prompts left and completions right), rounded up to the CUDA multiple as the GPU run
    pads it; optimizer, clipping and exchanges not included.
    """

    from odc_hf.balance import padded_width
    from odc_hf.integrations.trl.grpo_batch import CUDA_PAD_TO_MULTIPLE_OF

    def cost(mb):
        prompt = max(len(samples[i]["prompt"]) for i in mb)
        width = prompt + padded_width(prompt, max(len(samples[i]["completion"]) for i in mb), CUDA_PAD_TO_MULTIPLE_OF)
        return cost_model.microbatch_cost([width] * len(mb))

    fsdp = [[cost(mb) for mb in mbs] for mbs in layout["fsdp"]]
    odc = [[cost(mb) for mb in mbs] for mbs in layout["odc"]]
    width = max(len(c) for c in fsdp)
    return {"fsdp_s": sum(max(c[j] if j < len(c) else 0.0 for c in fsdp) for j in range(width)),
            "odc_s": max(sum(c) for c in odc), "odc_microbatches": [len(c) for c in odc]}  # fmt: skip


def grpo_loss(model, ids, attn, adv, logits_to_keep, normaliser, eps=0.2):
    """GRPOTrainer's per-token work: fused log-probs of the completion tokens, clipped objective, dapo normaliser."""
    import torch

    labels = ids.masked_fill(attn == 0, -100)
    labels[:, :-logits_to_keep] = -100
    out = model(input_ids=ids, attention_mask=attn, labels=labels, fused_lm_head=True)
    logps = out.log_probs[:, -logits_to_keep:]
    mask = attn[:, -logits_to_keep:].float()
    ratio = torch.exp(logps - logps.detach())
    a = adv.unsqueeze(1)
    per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - eps, 1 + eps) * a)
    return (per_token * mask).sum() / normaliser


# -- one rank -------------------------------------------------------------------------------------------------------
def _build(config, device, mp, checkpointing):
    import torch
    from transformers import Qwen2ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from odc_hf.fsdp import shard_model

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))  # as GRPOTrainer does
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    shard_model(model, mp_policy=mp)
    return model


def _config(args):
    """The model config and the sequence cap of ``args.model``."""
    from odc_hf.prediction.workloads import qwen2_5_config
    from odc_hf.testing.data import tiny_qwen2_config

    if args.model == "1.5B":
        config = qwen2_5_config("1.5B")
        config.tie_word_embeddings = True
    else:
        config = tiny_qwen2_config(512, hidden_size=64, num_layers=2)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    return config, args.max_length or (8192 if args.model == "1.5B" else 512)


def _cost_model(args, config):
    from odc_hf.balance import FlopCostModel, QuadraticCostModel

    choice = args.cost_model or ("calibration" if args.model == "1.5B" and CALIBRATION.exists() else "flop")
    if choice == "flop":
        return FlopCostModel.from_config(config), "flop"
    path = CALIBRATION if choice == "calibration" else Path(choice)
    data = json.loads(path.read_text())
    model = QuadraticCostModel.from_dict(data) if "a" in data else \
        QuadraticCostModel.fit(data["lengths"], data["seconds"])  # fmt: skip
    return model, f"calibrated ({path.name})"


def _rank(rank: int, world: int, args):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from odc_hf.fsdp import install_odc, sum_reduction
    from odc_hf.integrations.trl.grpo_batch import CUDA_PAD_TO_MULTIPLE_OF

    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    config, cap = _config(args)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else None
    models = {"fsdp": _build(config, device, mp, args.model == "1.5B"),
              "odc": _build(config, device, mp, args.model == "1.5B")}  # fmt: skip
    sum_reduction(models["fsdp"])  # SUM semantics, the loss carries the global normaliser (as ODC)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-6, weight_decay=0.0) for k, m in models.items()}
    odc = install_odc(models["odc"], timeout_s=300)
    odc.attach_optimizer(opts["odc"])
    cost_model, cost_name = _cost_model(args, config)
    per_rank = args.per_device * args.grad_accum

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def train_step(kind, samples, total_tokens, layout):
        model, opt = models[kind], opts[kind]
        bundles = [[samples[i] for i in mb] for mb in layout[kind][rank]]
        sync()
        dist.barrier()
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for mb in bundles:
            ids, attn, adv, keep = padded_microbatch(mb, device, CUDA_PAD_TO_MULTIPLE_OF if cuda else 1)
            loss = grpo_loss(model, ids, attn, adv, keep, total_tokens)
            loss.backward()
            loss_sum += loss.detach()
        sync()
        busy = time.perf_counter() - start
        if kind == "odc":
            odc.finish_minibatch(0.0)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        elapsed = torch.tensor([time.perf_counter() - start, busy], dtype=torch.float64, device=device)
        both = [torch.zeros_like(elapsed) for _ in range(world)]
        dist.all_gather(both, elapsed)
        dist.all_reduce(loss_sum)
        counts = [torch.zeros(1, device=device) for _ in range(world)]
        dist.all_gather(counts, torch.tensor([float(len(bundles))], device=device))
        return {"step_s": max(float(t[0]) for t in both), "busy_s": [float(t[1]) for t in both],
                "loss": float(loss_sum), "microbatches": [int(c.item()) for c in counts]}  # fmt: skip

    # -- training phase ---------------------------------------------------------------------------------------------
    steps = []
    for step in range(args.warmup + args.steps):
        samples = rollouts(step, world * per_rank, cap, config.vocab_size, args.seed)
        total_tokens = float(sum(len(s["completion"]) for s in samples))
        tokens = sum(len(s["prompt"]) + len(s["completion"]) for s in samples)
        order = ("fsdp", "odc") if step % 2 == 0 else ("odc", "fsdp")
        layout = layouts(samples, world, args.per_device, args.grad_accum, None, cost_model,
                         CUDA_PAD_TO_MULTIPLE_OF if cuda else 1)
        row = {"step": step, "warmup": step < args.warmup, "tokens": tokens, "order": order, "budget": layout["budget"],
               "predicted": predicted_step(samples, layout, cost_model)}  # fmt: skip
        for kind in order:
            row[kind] = train_step(kind, samples, total_tokens, layout)
        steps.append(row)
        if rank == 0:
            print(f"step {step}: fsdp {row['fsdp']['step_s']:.3f} s, odc {row['odc']['step_s']:.3f} s "
                  f"(microbatches {row['odc']['microbatches']}), loss {row['fsdp']['loss']:.6f} / {row['odc']['loss']:.6f}",
                  flush=True)  # fmt: skip

    if rank == 0:  # keep the training phase even if the generation phase does not finish
        from benchmarks.common.report import write_json

        write_json(Path(args.out) / f"grpo_e2e_{args.model}.training_phase.json",
                   {"args": vars(args), "steps": steps, "cost_model": cost_name})  # fmt: skip

    # -- generation phase -------------------------------------------------------------------------------------------
    new_tokens = [
        int(x) for x in (args.gen_new_tokens or ("64,256" if args.model == "1.5B" else "8,32")).split(",")
    ]
    new = new_tokens[rank % len(new_tokens)]
    gen = torch.Generator().manual_seed(1000 + rank)
    lo, hi = (100, 300) if args.model == "1.5B" else (8, 40)
    lengths = torch.randint(lo, hi + 1, (args.gen_prompts,), generator=gen).tolist()
    width = max(lengths)
    prompt = torch.zeros((args.gen_prompts, width), dtype=torch.long)
    attn = torch.zeros_like(prompt)
    for i, n in enumerate(lengths):  # left-padded, as TRL generates
        prompt[i, width - n :] = torch.randint(10, config.vocab_size, (n,), generator=gen)
        attn[i, width - n :] = 1
    prompt, attn = prompt.to(device), attn.to(device)
    generation = {}
    for kind in ("fsdp", "odc"):
        model = models[kind]
        model.eval()
        runs = []
        for repeat in range(args.gen_repeats + 1):  # the first is a warm-up
            sync()
            dist.barrier()
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(prompt, attention_mask=attn, max_new_tokens=new, min_new_tokens=new,
                                     do_sample=False, use_cache=True, pad_token_id=0,
                                     synced_gpus=(kind == "fsdp"))  # fmt: skip
            sync()
            mine = time.perf_counter() - start
            made = float((out.shape[1] - width) * out.shape[0])
            row = torch.tensor([mine, made], dtype=torch.float64, device=device)
            rows = [torch.zeros_like(row) for _ in range(world)]
            dist.all_gather(rows, row)
            if rank == 0:  # printed as it goes: a run cut short still leaves these numbers in the log
                print(f"generate {kind} call {repeat}{' (warm-up)' if not repeat else ''}: per-rank s "
                      f"{[round(float(r[0]), 3) for r in rows]}, new tokens {sum(float(r[1]) for r in rows):.0f}",
                      flush=True)  # fmt: skip
            if repeat:
                runs.append({"rank_s": [float(r[0]) for r in rows], "tokens": sum(float(r[1]) for r in rows)})
        generation[kind] = runs
        model.train()
    odc.close()
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    budget = statistics.median(row["budget"] for row in steps)
    return {"steps": steps, "generation": generation, "cost_model": cost_name, "budget": budget, "cap": cap,
            "new_tokens": new_tokens, "prompt_lengths": lengths, "max_allocated_GiB": mem}  # fmt: skip


# -- report ---------------------------------------------------------------------------------------------------------
def summarise(result: dict, args) -> dict:
    measured = [s for s in result["steps"] if not s["warmup"]]
    out = {}
    for kind in ("fsdp", "odc"):
        times = [s[kind]["step_s"] for s in measured]
        tps = [s["tokens"] / s[kind]["step_s"] for s in measured]
        busy = [statistics.mean(s[kind]["busy_s"]) / s[kind]["step_s"] for s in measured]
        out[kind] = {"step_s_median": statistics.median(times), "step_s_min": min(times), "step_s_max": max(times),
                     "tokens_per_s_median": statistics.median(tps), "busy_fraction_mean": statistics.mean(busy)}  # fmt: skip
    out["speedup_tokens_per_s"] = out["odc"]["tokens_per_s_median"] / out["fsdp"]["tokens_per_s_median"]
    per_step = [s["fsdp"]["step_s"] / s["odc"]["step_s"] for s in measured]
    out["speedup_per_step"] = {
        "median": statistics.median(per_step),
        "min": min(per_step),
        "max": max(per_step),
    }
    predicted = [s["predicted"] for s in measured]
    out["predicted_fwd_bwd_ratio"] = sum(p["fsdp_s"] for p in predicted) / sum(p["odc_s"] for p in predicted)
    out["max_rel_loss_diff"] = max(abs(s["odc"]["loss"] - s["fsdp"]["loss"]) / max(abs(s["fsdp"]["loss"]), 1e-12)
                                   for s in result["steps"])  # fmt: skip
    gen = {}
    for kind, runs in result["generation"].items():
        wall = [max(r["rank_s"]) for r in runs]
        gen[kind] = {"wall_s_median": statistics.median(wall), "tokens": runs[0]["tokens"],
                     "tokens_per_s_median": statistics.median(r["tokens"] / max(r["rank_s"]) for r in runs),
                     "rank_s_median": [statistics.median(r["rank_s"][i] for r in runs) for i in range(len(runs[0]["rank_s"]))],
                     "rank_seconds_median": statistics.median(sum(r["rank_s"]) for r in runs)}  # fmt: skip
    gen["ratio_tokens_per_s"] = gen["odc"]["tokens_per_s_median"] / gen["fsdp"]["tokens_per_s_median"]
    out["generation"] = gen
    return out


def markdown(env: dict, result: dict, summary: dict, args) -> str:
    from benchmarks.common.report import env_markdown, table

    t, g = summary, summary["generation"]
    lines = [f"# GRPO end to end: ODC + rebalancing vs FSDP2 collectives ({args.model})", "", env_markdown(env),
             f"- workload: grpo_aime lengths (prompts 100-300, cap {result['cap']}), seed {args.seed}; "
             f"{args.per_device} x {args.grad_accum} completions per rank per step (TRL per_device x grad_accum); "
             f"ODC budget per step: {args.per_device} x the widest padded row TRL's layout could form from the step's "
             f"samples (median {result['budget']:.0f} tokens; ODC microbatches never exceed it); cost model "
             f"{result['cost_model']}",
             f"- {args.warmup} warm-up + {args.steps} measured steps per variant, interleaved (order alternating)", "",
             "## Training phase", "",
             *table(["variant", "step s (median)", "min", "max", "tokens/s (median)", "mean busy / step"],
                    [[kind, f"{s['step_s_median']:.3f}", f"{s['step_s_min']:.3f}", f"{s['step_s_max']:.3f}",
                      f"{s['tokens_per_s_median']:.0f}", f"{s['busy_fraction_mean']:.1%}"]
                     for kind, s in ((k, t[k]) for k in ("fsdp", "odc"))])]  # fmt: skip
    sp = t["speedup_per_step"]
    lines += ["", f"ODC / FSDP tokens/s (medians): **{t['speedup_tokens_per_s']:.3f}x**; per-step speedup median "
              f"{sp['median']:.3f} (min {sp['min']:.3f}, max {sp['max']:.3f}); max relative loss difference "
              f"{t['max_rel_loss_diff']:.2e}. The cost model predicts {t['predicted_fwd_bwd_ratio']:.3f}x for the "
              "forward + backward passes alone (sum over the measured steps; optimizer and exchanges not modelled).", "",
              *table(["step", "tokens", "fsdp s", "odc s", "odc microbatches per rank", "predicted fwd+bwd fsdp / odc"],
                     [[f"{s['step']}{' (warm-up)' if s['warmup'] else ''}", s["tokens"], f"{s['fsdp']['step_s']:.3f}",
                       f"{s['odc']['step_s']:.3f}", s["odc"]["microbatches"],
                       f"{s['predicted']['fsdp_s']:.4g} / {s['predicted']['odc_s']:.4g}"] for s in result["steps"]])]  # fmt: skip
    lines += ["", "## Generation phase", "",
              f"`generate()` greedy with KV cache, {args.gen_prompts} prompts per rank, per-rank max_new_tokens "
              f"{result['new_tokens']}; FSDP2 with `synced_gpus=True` (required: ranks stop at different lengths), "
              "ODC with `synced_gpus=False`.", "",
              *table(["variant", "wall s (median, slowest rank)", "per-rank s", "rank-seconds", "tokens/s"],
                     [[kind, f"{s['wall_s_median']:.3f}", ", ".join(f"{x:.3f}" for x in s["rank_s_median"]),
                       f"{s['rank_seconds_median']:.3f}", f"{s['tokens_per_s_median']:.0f}"]
                      for kind, s in ((k, g[k]) for k in ("fsdp", "odc"))])]  # fmt: skip
    lines += ["", f"ODC / FSDP generation tokens/s: **{g['ratio_tokens_per_s']:.3f}x**. The wall time is set by the "
              "rank with the most new tokens in both variants; what ODC frees is the early rank's time (it stops "
              "instead of running dummy forwards), visible in the per-rank seconds.", ""]  # fmt: skip
    return "\n".join(lines)


def predict(args) -> list[dict]:
    """``--predict``: the cost model's fwd+bwd step times of both layouts on the run's rollouts (no training, CPU)."""
    from odc_hf.integrations.trl.grpo_batch import CUDA_PAD_TO_MULTIPLE_OF

    config, cap = _config(args)
    cost_model, cost_name = _cost_model(args, config)
    world = 2
    unit = "FLOPs" if cost_name == "flop" else "s"
    rows = []
    for step in range(args.warmup + args.steps):
        samples = rollouts(step, world * args.per_device * args.grad_accum, cap, config.vocab_size, args.seed)
        layout = layouts(samples, world, args.per_device, args.grad_accum, None, cost_model, CUDA_PAD_TO_MULTIPLE_OF)
        rows.append({"step": step, **predicted_step(samples, layout, cost_model)})
        r = rows[-1]
        print(f"step {step}: predicted fwd+bwd fsdp {r['fsdp_s']:.4g}, odc {r['odc_s']:.4g} ({unit}) "
              f"(microbatches {r['odc_microbatches']} vs {args.grad_accum} per rank)")  # fmt: skip
    fsdp, odc = sum(r["fsdp_s"] for r in rows), sum(r["odc_s"] for r in rows)
    print(f"{args.model}, cap {cap}, budget per step {args.per_device} x widest padded row, {cost_name}: predicted ODC / FSDP {fsdp / odc:.3f}x over "
          f"{len(rows)} steps; microbatches {sum(sum(r['odc_microbatches']) for r in rows)} (odc) vs "
          f"{len(rows) * world * args.grad_accum} (fsdp)")  # fmt: skip
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.predict:
        args.model = args.model or "1.5B"
        predict(args)
        return
    import torch

    from odc_hf.testing import run_ranks

    gpus = torch.cuda.device_count()
    if args.model is None:
        args.model = "1.5B" if gpus >= 2 else "tiny"
    backend = "nccl" if gpus >= 2 else "gloo"
    started = time.perf_counter()
    results = run_ranks(_rank, 2, args, backend=backend, timeout_s=args.timeout_s)
    from benchmarks.common.report import environment, hardware_tag, today, write

    env = environment()
    summary = summarise(results[0], args)
    payload = {"environment": env, "args": vars(args), "summary": summary, "rank0": results[0],
               "wall_s": time.perf_counter() - started}  # fmt: skip
    stem = f"grpo_e2e_{args.model}_{hardware_tag(env)}_{today()}"
    json_path, md_path = write(args.out, stem, payload, markdown(env, results[0], summary, args))
    print(f"training ODC/FSDP tokens/s {summary['speedup_tokens_per_s']:.3f}x, generation "
          f"{summary['generation']['ratio_tokens_per_s']:.3f}x; wrote {json_path} and {md_path} "
          f"in {payload['wall_s']:.0f} s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
