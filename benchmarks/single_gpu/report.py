"""The analysis and report of benchmarks/single_gpu/run.py: per part and variant tokens/s, step times, peak memory and the
CUDA allocator's retries, ratios against TRL's variants, per-step loss differences, the resumed run beside the
uninterrupted one; a markdown report and a plot of losses and step times."""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.common import report
from odc_hf.integrations.compute.fused_head import DEVICE_HEADROOM


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarise_variant(result: dict, warmup: int) -> dict:
    if not result.get("ok"):
        return {"ok": False, "error": result.get("error")}
    steps = result["steps"]
    warmup = min(warmup, max(0, len(steps) - 1))  # a short run keeps one timed step
    timed = [s for s in steps[warmup:] if s.get("tokens")]
    tokens, seconds = sum(s["tokens"] for s in timed), sum(s["seconds"] for s in timed)
    return {"ok": True, "tokens_per_s": tokens / seconds if seconds else None,
            "median_step_s": _median([s["seconds"] for s in steps[warmup:]]),
            "warmup_step_s": [round(s["seconds"], 3) for s in steps[:warmup]],
            "peak_gib": result.get("peak_gib"), "steps": len(steps), "compute_path": result.get("compute_path"),
            "attention": result.get("attention"),
            "reserved_peak_gib": max((s.get("reserved_peak_gib") or 0 for s in steps), default=None),
            "alloc_retries": sum(s.get("retries") or 0 for s in steps[warmup:]),
            "steps_with_retries": sum(1 for s in steps[warmup:] if s.get("retries"))}  # fmt: skip


def _predicted(path: dict) -> str:
    """The activation-checkpointing plan's predicted peak and the memory it planned against (``auto`` on CUDA)."""
    if path.get("predicted_peak_gib") is None:
        return "-"
    usable = path.get("device_gib")
    return f"{path['predicted_peak_gib']:.1f}" + (f" ({usable * DEVICE_HEADROOM:.1f})" if usable else "")


def loss_diffs(a: dict, b: dict) -> dict | None:
    if not (a.get("ok") and b.get("ok")):
        return None
    la = {s["step"]: s.get("loss") for s in a["steps"]}
    lb = {s["step"]: s.get("loss") for s in b["steps"]}
    rel = [abs(la[k] - lb[k]) / abs(lb[k]) for k in la if k in lb and la[k] is not None and lb[k]]
    return {"max_rel": max(rel) if rel else None, "median_rel": _median(rel), "steps": len(rel)}


def analyse(payload: dict, warmup: int) -> dict:
    out = {}
    for part, results in payload["parts"].items():
        variants = {k: v for k, v in results.items() if isinstance(v, dict) and "ok" in v}
        if part == "resume":
            u, r = variants.get("uninterrupted", {}), variants.get("resumed", {})
            k = results["data"]["save_at"]
            after = {s["step"]: s.get("loss") for s in u.get("steps", []) if s["step"] > k}
            # the resumed trainer's callback sees only the steps after the checkpoint
            pairs = [(s["step"], s.get("loss"), after.get(s["step"])) for s in r.get("steps", [])]
            rel = [abs(a - b) / abs(b) for _, a, b in pairs if a is not None and b]
            out[part] = {"pairs": pairs, "max_rel": max(rel) if rel else None, "ok": bool(u.get("ok") and r.get("ok"))}
            continue
        summary = {name: summarise_variant(v, warmup if part != "grpo" else 1) for name, v in variants.items()}
        if part == "grpo":  # sampled completions differ between the trainers: only the fixed rollouts compare losses
            summary = {k: {**v, "note": "whole steps (generation + training)" if "generate" in k else
                           "training phase (fixed rollouts)"} for k, v in summary.items()}  # fmt: skip
        ratios, losses = {}, {}
        base = summary.get("T", {}).get("tokens_per_s")
        plus = summary.get("T+", {}).get("tokens_per_s")
        for name, s in summary.items():
            if base and s.get("tokens_per_s"):
                ratios[f"{name}/T"] = s["tokens_per_s"] / base
        for name, s in summary.items():  # the acceptance's second baseline: TRL with Liger and no checkpointing
            if plus and name.startswith("O") and s.get("tokens_per_s"):
                ratios[f"{name}/T+"] = s["tokens_per_s"] / plus
            if name != "T" and "T" in variants:
                losses[f"{name} vs T"] = loss_diffs(variants[name], variants["T"])
        if part == "grpo":
            for mode in ("fixed", "generate"):
                t, o = summary.get(f"T_{mode}", {}), summary.get(f"O_{mode}", {})
                if t.get("median_step_s") and o.get("median_step_s"):
                    ratios[f"O/T {mode} (step time)"] = t["median_step_s"] / o["median_step_s"]
                if mode == "fixed" and f"T_{mode}" in variants and f"O_{mode}" in variants:
                    losses[f"O vs T ({mode})"] = loss_diffs(variants[f"O_{mode}"], variants[f"T_{mode}"])
        out[part] = {"summary": summary, "ratios": ratios, "losses": losses}
    return out


def _f(value, spec=".3f"):
    return "-" if value is None else format(value, spec)


def render(payload: dict, analysis: dict, method: str) -> str:
    """The markdown report; ``method``: what every variant trains and how it is timed (single_gpu.py's docstring)."""
    runs = payload.get("runs", [])
    lines = ["# One GPU, end to end: ODC trainers vs TRL's trainers", "", report.env_markdown(payload["env"]),
             *[f"- run {i + 1}: {r['date']}, `{r['commit']}`, `{r['command']}`" for i, r in enumerate(runs)],
             f"- FlashAttention-4 installed: {payload['fa4']}; liger-kernel installed: {payload['liger']}",
             f"- steps left out of tokens/s (warm-up): {payload['args']['warmup']}", "",
             method, ""]  # fmt: skip
    for part, a in analysis.items():
        lines += [f"## {part}", ""]
        data = payload["parts"][part].get("data", {})
        if data:
            lines += [f"workload {data.get('workload')}, max_length / token budget {data.get('max_length')}"
                      + (f", tokens per step median {_median(data['step_tokens']):.0f}" if data.get("step_tokens") else ""), ""]  # fmt: skip
        if part == "resume":
            lines += report.table(["step", "resumed loss", "uninterrupted loss"],
                                  [[s, _f(x, ".6f"), _f(y, ".6f")] for s, x, y in a["pairs"]], "rrr")
            lines += ["", f"max relative difference: {_f(a['max_rel'], '.2e')}", ""]
            continue
        rows = []
        for name, s in a["summary"].items():
            if not s.get("ok"):
                rows.append([name, f"failed: {s.get('error')}", *[""] * 8])
                continue
            path = s.get("compute_path") or {}
            alloc = path.get("cuda_allocator") or {}
            kind = {True: "expandable segments", False: "default"}.get(alloc.get("expandable_segments"), "-")
            rows.append([name, s.get("attention") or "-",
                         f"{path.get('kernels', '-')}, {path.get('activation_checkpointing', '-')}", kind,
                         _f(s["tokens_per_s"], ".0f"), _f(s["median_step_s"]), s["warmup_step_s"],
                         f"{_f(s['peak_gib'], '.1f')} ({_f(s.get('reserved_peak_gib'), '.1f')})",
                         _predicted(path),
                         f"{s.get('alloc_retries', '-')} ({s.get('steps_with_retries', '-')})"])  # fmt: skip
        lines += report.table(["variant", "attention", "compute path", "CUDA allocator", "tokens/s", "median step s",
                               "warm-up steps s", "peak GiB (reserved)", "predicted peak GiB (usable)",
                               "allocator retries (steps with any)"], rows, "llllrrlrrr")  # fmt: skip
        lines += ["", "Ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in a["ratios"].items()), "",
                  "Per-step losses (max / median relative difference over steps): "
                  + ", ".join(f"{k}: {_f((v or {}).get('max_rel'), '.2e')} / {_f((v or {}).get('median_rel'), '.2e')}"
                              for k, v in a["losses"].items()), ""]  # fmt: skip
        names = [n for n, v in payload["parts"][part].items() if isinstance(v, dict) and v.get("ok")]
        steps = max((len(payload["parts"][part][n]["steps"]) for n in names), default=0)
        if names and steps:
            rows = []
            for i in range(steps):
                row = [i + 1]
                for n in names:
                    st = payload["parts"][part][n]["steps"]
                    s = st[i] if i < len(st) else {}
                    retries = f" ({s['retries']})" if s.get("retries") else ""  # the allocator's retries, if any
                    row += [_f(s.get("loss"), ".5f"), _f(s.get("seconds")) + retries]
                rows.append(row)
            lines += ["Per step: loss, seconds (and the CUDA allocator's flush-and-retry count where not 0).", "",
                      *report.table(["step", *(f"{n} {c}" for n in names for c in ("loss", "s"))], rows,
                                    "r" * (1 + 2 * len(names))), ""]  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    parts = [p for p in payload["parts"] if p != "resume"]
    if not parts:
        return None
    fig, axes = plt.subplots(2, len(parts), figsize=(5 * len(parts), 7), squeeze=False)
    for j, part in enumerate(parts):
        for name, v in payload["parts"][part].items():
            if isinstance(v, dict) and v.get("ok"):
                steps = v["steps"]
                axes[0][j].plot([s["step"] for s in steps], [s.get("loss") for s in steps], label=name)
                axes[1][j].plot([s["step"] for s in steps], [s["seconds"] for s in steps], label=name)
        axes[0][j].set_title(f"{part}: loss")
        axes[1][j].set_title(f"{part}: step seconds")
        axes[1][j].set_xlabel("step")
        axes[0][j].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
