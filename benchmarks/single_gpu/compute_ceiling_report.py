"""Markdown of a ``compute_ceiling.py`` payload: per-row tables, the acceptance figures, packing, memory model."""

from __future__ import annotations

from benchmarks.common import report

GIB = 2**30
HYPOTHETICAL_GIB = (80.0, 40.0, 24.0)  # "where memory is short": auto's choice for smaller devices


def _key(r: dict) -> str:
    return f"{r['variant']} / AC {r['ac']}"


def _cell(r: dict | None) -> str:
    if r is None:
        return "—"
    if r.get("oom"):
        return "OOM"
    peak = f", {r['peak_gib']:.1f} GiB" if r.get("peak_gib") is not None else ""
    return f"{r['seconds']:.3f} s, {100 * r['mfu']:.0f}%{peak}"


def default_rows(model: dict, variant: str = "liger") -> dict[str, dict]:
    """Row name -> the measurement of odc_hf's default path (``variant`` with the AC auto chose for the row's tokens)."""
    auto = {int(t): n for t, n in model["auto"].items()}
    out = {}
    for r in model["results"]:
        if r["variant"] == variant and "seconds" in r:
            length = min(
                (t for t in auto if t >= r["tokens"]), default=max(auto)
            )  # the budget that covers the row
            if r["checkpointed"] == auto[length]:
                out[r["row"]] = r
    return out


def _find(model, variant, row, checkpointed=None):
    for r in model["results"]:
        if (
            r["variant"] == variant
            and r["row"] == row
            and (checkpointed is None or r["checkpointed"] == checkpointed)
        ):
            return r
    return None


def acceptance(payload: dict) -> list[str]:
    lines = ["## Acceptance figures\n"]
    for model in payload["models"]:
        size, lengths = model["size"], model["lengths"]
        default = default_rows(model)
        for t in lengths:
            row = f"single {t}"
            today, d = _find(model, "today", row), default.get(row)
            if today is None or d is None or "seconds" not in today:
                continue
            lines.append(f"- {size}, {row}: odc_hf default (TRL fused head + Liger layers, AC auto = "
                         f"{d['ac']}) **{d['seconds']:.3f} s, {100 * d['mfu']:.1f}% MFU, {d['peak_gib'] or 0:.1f} GiB** "
                         f"vs today's path (full logits, full AC) {today['seconds']:.3f} s, {100 * today['mfu']:.1f}% "
                         f"MFU: **{today['seconds'] / d['seconds']:.2f}x**")  # fmt: skip
    errors = [r["loss_rel_err"] for m in payload["models"] for r in m["results"] if "loss_rel_err" in r]
    if errors:
        worst = max(errors)
        lines.append(f"- losses vs the fp32 full-logits reference: max relative difference {worst:.2e} over "
                     f"{len(errors)} measurements (tolerance {payload['loss_rtol']:g}: "
                     f"{'pass' if worst <= payload['loss_rtol'] else 'FAIL'})")  # fmt: skip
    return lines + [""]


def packing(model: dict) -> list[str]:
    """Packed rows vs the sum of their documents alone, and vs the cost model fitted to the single rows."""
    from odc_hf.balance.cost import QuadraticCostModel

    table = []
    default = default_rows(model)
    paths = [
        ("today", lambda r: r["variant"] == "today"),
        ("odc_hf default", lambda r: default.get(r["row"]) is r),
    ]
    for name, pick in paths:
        rows = [r for r in model["results"] if "seconds" in r and pick(r)]
        for r in (
            r for r in rows if len(r["docs"]) > 1
        ):  # against single documents on the same variant and AC
            singles = {s["docs"][0]: s["seconds"] for s in model["results"] if "seconds" in s and len(s["docs"]) == 1
                       and s["variant"] == r["variant"] and s["checkpointed"] == r["checkpointed"]}  # fmt: skip
            alone = sum(singles.get(d, float("nan")) for d in r["docs"])
            fitted = float("nan")
            if len(singles) >= 3:
                cost = QuadraticCostModel.fit(list(singles), list(singles.values()))
                fitted = cost.microbatch_cost(r["docs"])
            table.append([f"{name} ({r['ac']})", f"{r['tokens']} ({'+'.join(map(str, r['docs']))})", f"{r['seconds']:.3f}",
                          f"{alone:.3f}", f"{r['seconds'] / alone:.3f}", f"{fitted:.3f}", f"{r['seconds'] / fitted:.3f}"])  # fmt: skip
    return [f"### {model['size']}: packed rows vs their documents\n",
            *report.table(["path", "row (documents)", "packed s", "Σ documents alone s", "packed / Σ",
                           "fitted a + Σ(b·s + c·s²) s", "packed / fitted"], table, "llrrrrr"), ""]  # fmt: skip


def memory(model: dict, gpu_gib: float | None) -> list[str]:
    from odc_hf.balance.memory import MemoryModel, choose_checkpointing, describe_checkpointing

    if not model["memory_models"]:
        return []
    L = model["num_layers"]
    peaks, choices = [], []
    variant_of = {"none/trl_fused_lm_head": "trl", "liger/trl_fused_lm_head": "liger",
                  "liger/liger_fused_linear_cross_entropy": "flce"}  # fmt: skip
    for key, entry in model["memory_models"].items():
        mm = MemoryModel.from_dict(entry["model"])
        for r in model["results"]:
            if (
                r["variant"] == variant_of.get(key)
                and len(r["docs"]) == 1
                and r["tokens"] in model["lengths"]
            ):
                measured = "OOM" if r.get("oom") else f"{r['peak_gib']:.1f}"
                peaks.append([key, r["row"], r["ac"], f"{mm.peak_bytes(r['tokens'], r['checkpointed']) / GIB:.1f}", measured])
    sizes = ((gpu_gib,) if gpu_gib else ()) + HYPOTHETICAL_GIB
    for key, entry in model["memory_models"].items():
        mm = MemoryModel.from_dict(entry["model"])
        for t in sorted(set(model["lengths"]) | {2 * max(model["lengths"])}):
            cells = []
            for g in sizes:
                n, fits = choose_checkpointing(mm, t, 0.9 * g * GIB)
                cells.append(describe_checkpointing(n, L) + ("" if fits else " (does not fit)"))
            choices.append([key, t, *cells])
    return [f"### {model['size']}: memory model (calibrated on this GPU) vs measured peaks\n",
            *report.table(["path", "row", "AC", "predicted GiB", "measured GiB"], peaks, "lllrr"),
            "", "`auto`'s choice (the fewest checkpointed layers whose predicted peak fits 0.9 x device memory):\n",
            *report.table(["path", "tokens", *(f"{g:.0f} GiB" for g in sizes)], choices, "lr"), ""]  # fmt: skip


def render(payload: dict) -> str:
    env = payload["env"]
    gpu_gib = None
    for model in payload["models"]:
        for entry in model["memory_models"].values():
            gpu_gib = entry["usable_bytes"] / 0.9 / GIB
    lines = [
        "# Microbatch compute paths on one GPU: fused loss, Liger kernels, activation checkpointing\n",
        report.env_markdown(env),
        "- models: Qwen2.5 shapes from a config (random init; 1.5B with tied embeddings, 7B untied, as released), "
        'bf16 parameters and compute, `attn_implementation="sdpa_varlen"` (per-document SDPA), one unsharded '
        "model, no optimizer; packed rows built by odc_hf's `BundleCollator` (per-document positions and attention)",
        f"- seconds: forward + backward of one row, median of {payload['args']['repeats']} CUDA-event timings after a "
        f"warm-up run; MFU: causal-halved FLOPs 6·N·s + 6·L·d·s² per document / (seconds x {payload['peak_tflops']:.0f} "
        "TFLOP/s dense bf16 peak), recomputation not counted; peak: `torch.cuda.max_memory_allocated` (parameters "
        "and gradients included)",
        f"- losses compared with the fp32 full-logits loss of the same weights (relative tolerance "
        f"{payload['loss_rtol']:g}: bf16's unit roundoff is 3.9e-3)",
        "- variants: **today** full logits + HF loss; **trl** TRL's fused LM head as SFTTrainer installs it (log-probs, entropy and top-1 per token); **liger** "
        "TRL's fused head + Liger RMSNorm/SwiGLU/RoPE (ODCSFTTrainer's default path with `odc_hf[kernels]`); **flce** "
        "Liger's fused linear cross-entropy + layer kernels (ODCTrainer's default path); AC: none, full, selective n/L "
        "(every second layer for 14/28). odc_hf's default = liger with the AC `auto` chose for the row's length.\n",
    ]
    lines += [f"- **not measured**: {f['size']} ({f['error']})" for f in payload.get("failed", [])]
    lines += acceptance(payload)
    for model in payload["models"]:
        keys = list(dict.fromkeys(_key(r) for r in model["results"]))
        by = {(_key(r), r["row"]): r for r in model["results"]}
        rows = list(dict.fromkeys(r["row"] for r in model["results"]))
        lines += [f"## {model['size']} (auto on this GPU: " + ", ".join(
            f"{t} tokens -> {n} of {model['num_layers']} layers checkpointed" for t, n in model["auto"].items()) + ")\n",
                  *report.table(["row", *keys], [[row, *(_cell(by.get((k, row))) for k in keys)] for row in rows],
                                "l" + "r" * len(keys)), ""]  # fmt: skip
        lines += packing(model)
        lines += memory(model, gpu_gib)
    return "\n".join(lines) + "\n"
