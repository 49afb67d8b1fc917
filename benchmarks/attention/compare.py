"""Attention implementations side by side on odc_hf's default compute path, one model, one process, interleaved.

``benchmarks/single_gpu/compute_ceiling.py --attn flash_attention_4,sdpa_varlen`` (or ``auto``) runs this: a Qwen2.5-shaped model
(random init, bf16, TRL's fused LM head + Liger's layer kernels where installed, activation checkpointing as
``--ac`` says, default none: what ``auto`` picks for 1.5B at 32k on an H200), forward + backward of

- LongAlign-like rows: single documents of 16k and 32k tokens, and a packed 32k row 16k + 8k + 4k + 4k;
- Tulu-like rows: 16k and 32k rows of 40+ documents of 50-1,500 tokens (log-uniform, seeded);
- a GRPO-like group: 64 sequences of a 256-token prompt + a completion log-uniform over 64-4,096 tokens, in four
  layouts of the same tokens, each microbatch within the same token budget (rows x width, or packed tokens):

  - ``padded``: ODCGRPOTrainer's padded layout (``grpo_layout="padded"``) as it runs on this device under
    ``sdpa``/``sdpa_varlen``: the samples binned by length (``odc_hf.balance.padded.pack_padded``, ``GRPO_ROWS`` rows
    at most), prompts left-padded, completions right-padded, rows rounded up to ``CUDA_PAD_TO_MULTIPLE_OF`` columns
    on CUDA (the guard against cuDNN's NaN, ``odc_hf.integrations.trl.grpo_batch.padded_columns_multiple``);
  - ``padded unrounded`` (CUDA only): the same bins without the rounding: the trainer's padded layout under
    FlashAttention, and the least padding a padded layout has;
  - ``trl``: TRL's own layout: microbatches of consecutive samples of the generation batch, every row padded to the
    longest completion of the whole batch (TRL pads once per generation), as many rows as the budget holds;
  - ``packed``: the same sequences back to back (``grpo_batch.pack_rows``), rows within the budget (the trainer's
    ``grpo_layout="packed"``, what ``auto`` picks on a varlen attention),

  TRL's loss input: the completion tokens' log-probs.

Each (row, attention) pair is warmed up once (its first call, FA4's kernel compilation included, is recorded as
``first_s``), then timed ``--repeats`` times, the attentions interleaved repeat by repeat; seconds are medians of CUDA
event timings. Losses are compared with the fp32 reference of the same weights on ``sdpa_varlen`` (FA4 takes no fp32).
"""

from __future__ import annotations

import math
import random
import statistics
import time

GRPO_PROMPT, GRPO_COMPLETIONS, GRPO_RANGE, GRPO_ROWS = 256, 64, (64, 4096), 16


def tulu_row(total: int, seed: int, low: int = 50, high: int = 1500, minimum: int = 40) -> list[int]:
    """Document lengths log-uniform over [low, high] filling ``total`` tokens (the last one cut to fit, kept >= low
    by borrowing from the one before); the first seed from ``seed`` on that gives ``minimum`` documents or more."""
    for s in range(seed, seed + 1000):
        rng = random.Random(s)
        docs: list[int] = []
        while sum(docs) < total:
            docs.append(int(math.exp(rng.uniform(math.log(low), math.log(high)))))
        docs[-1] -= sum(docs) - total
        if docs[-1] < low:
            docs[-2] -= low - docs[-1]
            docs[-1] = low
        if len(docs) >= minimum and min(docs) >= low:
            return docs
    raise ValueError(f"no seed from {seed} gives {minimum} documents of {low}-{high} tokens in {total}")


def grpo_group(seed: int = 0) -> list[int]:
    """Completion lengths of a GRPO-like group: log-uniform over ``GRPO_RANGE``."""
    rng = random.Random(seed)
    low, high = GRPO_RANGE
    return [int(math.exp(rng.uniform(math.log(low), math.log(high)))) for _ in range(GRPO_COMPLETIONS)]


def rows(tiny: bool) -> list[tuple[str, list[int]]]:
    """(name, document lengths) of the SFT rows."""
    if tiny:
        return [("single 128", [128]), ("packed 128", [64, 32, 16, 16]), ("tulu 128", tulu_row(128, 0, 4, 16, 12))]
    return [("single 16384", [16384]), ("single 32768", [32768]), ("longalign packed 32768", [16384, 8192, 4096, 4096]),
            ("tulu 16384", tulu_row(16384, 0)), ("tulu 32768", tulu_row(32768, 1))]  # fmt: skip


def _sft_batch(docs, vocab, device, seed):
    import torch

    from odc_hf.integrations.trainer.bundle import BundleCollator

    g = torch.Generator().manual_seed(seed)
    examples = [{"input_ids": torch.randint(1, vocab, (n,), generator=g).tolist()} for n in docs]
    batch = BundleCollator(pad_token_id=0).collate_microbatch(examples)
    batch.pop("num_label_tokens")
    return [{k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}]


GRPO_LAYOUTS = ("padded", "padded unrounded", "trl", "packed")


def grpo_groups(completions, prompt, budget, layout: str, multiple: int) -> tuple[list[list[int]], list[int]]:
    """Which samples each microbatch of ``layout`` holds, and its completion width (columns after the prompt)."""
    import numpy as np

    from odc_hf.balance.padded import pack_padded, padded_width
    from odc_hf.balance.planner import pack_first_fit_decreasing

    lengths = [prompt + c for c in completions]
    order = list(range(len(completions)))
    if layout == "packed":
        groups = pack_first_fit_decreasing(order, np.asarray(lengths), budget)
        return groups, [max(completions[i] for i in g) for g in groups]
    if layout == "trl":  # one width for the whole generation batch; consecutive samples, as many rows as fit
        width = max(completions)
        rows = max(1, budget // (prompt + width))
        groups = [order[i : i + rows] for i in range(0, len(order), rows)]
        return groups, [width] * len(groups)
    multiple = multiple if layout == "padded" else 1
    groups = [mb[i : i + GRPO_ROWS]
              for mb in pack_padded(order, lengths, budget, prompts=[prompt] * len(lengths), multiple=multiple)
              for i in range(0, len(mb), GRPO_ROWS)]  # fmt: skip
    return groups, [padded_width(prompt, max(completions[i] for i in g), multiple) for g in groups]


def grpo_microbatches(completions, prompt, vocab, device, budget, *, layout: str, multiple: int = 1,
                      seed: int = 0) -> list[dict]:  # fmt: skip
    """The group as model inputs in ``layout`` (:data:`GRPO_LAYOUTS`), each microbatch with ``labels`` that score the
    completion tokens (TRL's ``_get_per_token_logps_and_entropies``); the same tokens in every layout."""
    import torch

    from odc_hf.integrations.trl.grpo_batch import pack_rows

    g = torch.Generator().manual_seed(seed)
    lengths = [prompt + c for c in completions]
    sequences = [torch.randint(1, vocab, (n,), generator=g) for n in lengths]
    out = []
    for group, width in zip(*grpo_groups(completions, prompt, budget, layout, multiple)):
        ids = torch.zeros((len(group), prompt + width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(group):
            ids[r, : lengths[i]] = sequences[i]
            mask[r, : lengths[i]] = 1
        if layout == "packed":
            batch = pack_rows(ids, mask, width)
            batch.pop("index")
        else:
            labels = ids.masked_fill(mask == 0, -100)
            labels[:, :prompt] = -100
            batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        out.append({k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()})
    return out


def _step(model, microbatches, fused: bool):
    """Forward + backward of every microbatch; the summed token NLL over the scored tokens."""
    import torch

    total, tokens = 0.0, 0
    for batch in microbatches:
        out = model(**batch, fused_lm_head=True) if fused else model(**batch)
        n = int((batch["labels"][:, 1:] != -100).sum())
        (out.loss * n).backward()
        total, tokens = total + out.loss.detach().float() * n, tokens + n
    return (total / max(tokens, 1)) if torch.is_tensor(total) else torch.tensor(0.0)


def run(size: str, attns: list[str], args: dict) -> dict:
    """Every row under every attention, interleaved; runs in a fresh process (Liger's patches are process-wide)."""
    import torch
    from transformers import Qwen2ForCausalLM

    from odc_hf import attention
    from odc_hf.balance.cost import FlopCostModel
    from odc_hf.integrations.compute import activation_checkpointing as ac
    from odc_hf.integrations.compute import fused_head as cp
    from odc_hf.integrations.compute.attention import fa4_problem, resolve_attention

    tiny = args["tiny"]
    device = torch.device("cpu" if tiny else "cuda")
    if tiny:
        from odc_hf.testing.data import tiny_qwen2_config

        torch.set_num_threads(1)  # a dry run of the code paths, not a measurement
        config = tiny_qwen2_config(512, num_layers=2)
    else:
        from odc_hf.prediction.workloads import qwen2_5_config

        config = qwen2_5_config(size)
        config.tie_word_embeddings = size in ("0.5B", "1.5B", "3B")
        config.use_cache = False
    config.max_position_embeddings = 32768 + 4096
    config._attn_implementation = attention.VARLEN_ATTENTION
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model.train()
    budget = 512 if tiny else 16384
    prompt = 8 if tiny else GRPO_PROMPT
    completions = [max(2, c // 64) for c in grpo_group()[:16]] if tiny else grpo_group()
    longest = args.get("max_tokens") or 10**9  # SIZE:TOKENS in --models: rows up to that many tokens (7B: 16384)
    work = {name: (docs, _sft_batch(docs, config.vocab_size, device, i))
            for i, (name, docs) in enumerate(rows(tiny)) if sum(docs) <= longest}  # fmt: skip
    from odc_hf.integrations.trl.grpo_batch import padded_columns_multiple

    # ODCGRPOTrainer's rule: its padded rows under sdpa_varlen here ("padded unrounded": under FlashAttention)
    multiple = padded_columns_multiple(device.type, attention.VARLEN_ATTENTION)
    for layout in GRPO_LAYOUTS:
        if layout == "padded unrounded" and multiple == 1:
            continue  # the same as "padded" here
        mbs = grpo_microbatches(completions, prompt, config.vocab_size, device, budget, layout=layout,
                                multiple=multiple)  # fmt: skip
        work[f"grpo {layout}"] = ([prompt + c for c in completions], mbs)
    only = args.get("rows")
    if only:  # --rows: names starting with one of these prefixes
        work = {k: v for k, v in work.items() if any(k.startswith(p) for p in only)}
    reference = {}
    with torch.no_grad():  # fp32, sdpa_varlen (packed rows) / sdpa with the mask (padded: the mask function)
        for name, (_, mbs) in work.items():
            reference[name] = _step_no_grad(model, mbs)
    dtype = torch.float32 if tiny else torch.bfloat16
    model.to(dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    liger = cp.liger_problem(device) is None
    if liger:
        cp.apply_liger_kernels(model, fused_linear_cross_entropy=False)
    cp.install_fused_head(model, outputs=cp.SFT_HEAD_OUTPUTS)
    ac.enable_checkpointing(model, ac.checkpointed_count(args["ac"], config.num_hidden_layers))
    problem = fa4_problem(device, dtype, model)
    names = {a: resolve_attention(a, "sdpa", problem, attention.VARLEN_ATTENTION)[0] for a in attns}
    if device.type == "cuda" and attention.VARLEN_ATTENTION in names.values():
        attention.warm_up(model, 32768 + 4096, dtype=dtype, device=device)  # sdpa_varlen's cuDNN plans
    flops = FlopCostModel.from_config(config)
    results = []
    for name, (docs, mbs) in work.items():
        timings = {a: [] for a in attns}
        entry = {a: {} for a in attns}
        try:
            for a in attns:  # first call: FA4 compiles its kernels here (per configuration, not per length)
                model.set_attn_implementation(names[a])
                seconds, value = _timed(model, mbs, device)
                entry[a].update(first_s=seconds, loss=value)
            for _ in range(args["repeats"]):
                for a in attns:
                    model.set_attn_implementation(names[a])
                    seconds, value = _timed(model, mbs, device)
                    timings[a].append(seconds)
                    entry[a]["loss"] = value
        except torch.cuda.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            print(f"{size} {name}: out of memory", flush=True)
            results.append({"row": name, "oom": True})
            continue
        for a in attns:
            r = entry[a]
            r.update(row=name, attention=a, implementation=names[a], seconds=statistics.median(timings[a]),
                     times=timings[a], docs=len(docs), tokens=sum(docs), microbatches=len(mbs),
                     padded_tokens=sum(int(b["input_ids"].numel()) for b in mbs), reference_loss=reference[name])  # fmt: skip
            r["loss_rel_err"] = abs(r["loss"] - reference[name]) / abs(reference[name])
            if not name.startswith("grpo"):
                r["mfu"] = float(flops.doc_costs(docs).sum()) / (r["seconds"] * args["peak_tflops"] * 1e12)
            results.append(r)
            print(f"{size} {name:24s} {a:18s} {r['seconds']:.3f} s (first {r['first_s']:.2f} s) loss err "
                  f"{r['loss_rel_err']:.1e}", flush=True)  # fmt: skip
    return {"size": size, "attns": attns, "implementations": names, "fa4_problem": problem, "liger": liger,
            "ac": args["ac"], "results": results, "config": config.to_dict()}  # fmt: skip


def _step_no_grad(model, microbatches) -> float:
    total, tokens = 0.0, 0
    for batch in microbatches:
        n = int((batch["labels"][:, 1:] != -100).sum())
        total += model(**batch).loss.item() * n
        tokens += n
    return total / max(tokens, 1)


def _timed(model, microbatches, device) -> tuple[float, float]:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    value = _step(model, microbatches, fused=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds, float(value)


def render(payload: dict) -> str:
    """The markdown report: per model, one line per row, the attentions side by side and their ratio."""
    from benchmarks.common import report

    lines = [f"# Attention side by side ({report.today()})", "", report.env_markdown(payload["env"]), ""]
    for m in payload["models"]:
        attns, names = m["attns"], m["implementations"]
        chosen = ", ".join(f"{a} = {names[a]}" for a in attns)
        lines += [f"## {m['size']}: {chosen}", "",
                  f"Liger layer kernels: {m['liger']}; activation checkpointing: {m['ac']}; FA4 here: "
                  f"{m['fa4_problem'] or 'yes'}. Seconds: median of whole fwd+bwd of the row (all its microbatches), "
                  "attentions interleaved; first: the first call (compilation).", "",
                  "| row | docs | microbatches | " + " | ".join(f"{a} s (first) | MFU | loss err" for a in attns)
                  + (f" | {attns[0]} speedup over {attns[1]} |" if len(attns) > 1 else " |"),
                  "|---|---:|---:|" + "---:|---:|---:|" * len(attns) + ("---:|" if len(attns) > 1 else "")]  # fmt: skip
        by_row: dict[str, dict] = {}
        for r in m["results"]:
            if r.get("oom"):
                lines.append(f"| {r['row']} | out of memory | |")
                continue
            by_row.setdefault(r["row"], {})[r["attention"]] = r
        for row, per in by_row.items():
            first = per[attns[0]]
            cells = [f"{per[a]['seconds']:.3f} ({per[a]['first_s']:.2f}) | "
                     + (f"{per[a]['mfu']:.1%}" if "mfu" in per[a] else "-") + f" | {per[a]['loss_rel_err']:.1e}"
                     for a in attns]  # fmt: skip
            ratio = f" | {per[attns[1]]['seconds'] / first['seconds']:.2f}x" if len(attns) > 1 else ""
            lines.append(f"| {row} | {first['docs']} | {first['microbatches']} | " + " | ".join(cells) + ratio + " |")
        packed = by_row.get("grpo packed")
        others = [k for k in GRPO_LAYOUTS[:-1] if by_row.get(f"grpo {k}")]
        if packed and others:
            lines += ["", "GRPO-like group, speedup of the packed layout over each padded one (fwd+bwd of the whole "
                      f"group, {packed[attns[0]]['tokens']:,} tokens; fp32 reference loss "
                      f"{packed[attns[0]]['reference_loss']:.6f} packed), per attention:", ""]  # fmt: skip
            for k in others:
                row = by_row[f"grpo {k}"]
                lines.append(f"- over `{k}` ({row[attns[0]].get('padded_tokens', 0):,} tokens with padding; reference loss "
                             f"{row[attns[0]]['reference_loss']:.6f}): "
                             + "; ".join(f"{a}: {row[a]['seconds'] / packed[a]['seconds']:.2f}x" for a in attns))
        lines.append("")
    return "\n".join(lines)
