"""Analysis, markdown and plot of ``benchmarks/grpo/vllm_colocate.py`` runs (a shared module: no ``__main__``).

A payload holds ``env`` (benchmarks/common/report.py), ``extra_versions``, ``args`` and ``runs``: one record per trainer run
(``variant`` T or O, ``steps``: per optimizer step ``seconds``, ``sync_s``, ``generate_s``, ``score_s``, ``train_s``,
``lengths``, ``loss``, ``peak_gib``). Steps after ``args["warmup"]`` count; runs of the same variant (several device
calls, merged) are pooled.
"""

from __future__ import annotations

import statistics
from pathlib import Path

PHASES = ("seconds", "generate_s", "sync_s", "score_s", "train_s")
PHASE_NAMES = {"seconds": "whole step", "generate_s": "generation (vLLM)", "sync_s": "weight sync",
               "score_s": "scoring + log-prob forwards", "train_s": "training (microbatches + optimizer)"}  # fmt: skip
VARIANTS = {"T": "TRL GRPOTrainer + vLLM colocate", "O": "ODCGRPOTrainer + vLLM colocate"}
GOAL_WHOLE_STEP = 1.3


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def measured_steps(run: dict, warmup: int) -> list[dict]:
    steps = run.get("steps", [])
    return steps[min(warmup, max(0, len(steps) - 1)) :]  # a short run keeps one step


def analyse(payload: dict) -> dict:
    warmup = payload["args"]["warmup"]
    summary = {}
    for variant in VARIANTS:
        runs = [r for r in payload["runs"] if r["variant"] == variant and r.get("ok")]
        steps = [s for r in runs for s in measured_steps(r, warmup)]
        if not steps:
            continue
        lengths = sorted(n for s in steps for n in s.get("lengths", []))
        summary[variant] = {
            "runs": len(runs), "steps": len(steps), **{p: _median([s.get(p) for s in steps]) for p in PHASES},
            "lengths": {"min": lengths[0], "median": _median(lengths), "p90": lengths[int(0.9 * (len(lengths) - 1))],
                        "max": lengths[-1], "completions": len(lengths)} if lengths else None,
            "peak_gib": max((s.get("peak_gib") or 0.0 for s in steps), default=None),
            "attention": runs[0].get("attention"), "vllm_init_s": _median([r.get("init_s") for r in runs]),
        }  # fmt: skip
    ratios, goals = {}, {}
    t, o = summary.get("T"), summary.get("O")
    if t and o:
        for phase in PHASES:
            if t[phase] and o[phase]:
                ratios[phase] = t[phase] / o[phase]  # > 1: ODC faster
        goals = {"whole step >= 1.3x": (ratios.get("seconds") or 0) >= GOAL_WHOLE_STEP,
                 "weight sync no slower than TRL's": (o["sync_s"] or 0) <= (t["sync_s"] or 0)}  # fmt: skip
    failed = [f"{r['variant']}: {r.get('error')}" for r in payload["runs"] if not r.get("ok")]
    return {"summary": summary, "ratios": ratios, "goals": goals, "failed": failed}


def _f(value, spec=".3f"):
    return "-" if value is None else format(value, spec)


def render(payload: dict, analysis: dict, report_module) -> str:
    args = payload["args"]
    lines = ["# GRPO with vLLM (colocate) on one GPU: TRL's GRPOTrainer vs ODCGRPOTrainer", "",
             report_module.env_markdown(payload["env"]),
             f"- also: {', '.join(f'{k} {v}' for k, v in payload.get('extra_versions', {}).items() if v)}",
             *[f"- run {i + 1}: {r['variant']} ({'ok' if r.get('ok') else 'failed'}), {r.get('date', '')}, "
               f"`{r.get('command', '')}`" for i, r in enumerate(payload["runs"])],
             "", f"Model {args['model']} (random init, fp32 master weights"
             f"{', bf16 autocast' if not args.get('smoke') else ', fp32 on the CPU with the stand-in engine'}), "
             f"prompts of {args.get('prompt_tokens')} tokens, "
             f"{args['per_device_train_batch_size']} x {args['gradient_accumulation_steps']} completions per step "
             f"({args['num_generations']} per prompt), completions up to {args['max_completion_length']} tokens "
             f"(EOS logit bias {args['eos_bias']} in vLLM's sampling: long-tailed lengths from a random model), vLLM "
             f"taking {args['gpu_memory_utilization']} of the GPU; {args['steps']} steps per run, the first "
             f"{args['warmup']} left out; medians over the rest.", "",
             "Phases of one optimizer step: **generation** is vLLM's `generate` (TRL's `VLLMGeneration`), **weight "
             "sync** pushing the new weights into the engine (TRL: `full_tensor()` per parameter; ODC: its published "
             "shards, or the parameters themselves at world 1), **scoring** the rest of TRL's "
             "`_generate_and_score_completions` (rewards, advantages, the old-policy log-prob forward of the "
             "importance-sampling correction), **training** everything else (microbatches, optimizer).", ""]  # fmt: skip
    summary = analysis["summary"]
    if summary:
        lines += report_module.table(
            ["variant", *(PHASE_NAMES[p] + " s" for p in PHASES), "peak GiB", "attention"],
            [[f"{VARIANTS[variant]} ({s['steps']} steps)", *(_f(s[p]) for p in PHASES), _f(s["peak_gib"], ".1f"),
              s.get("attention") or "-"] for variant, s in summary.items()],
            "l" + "r" * (len(PHASES) + 1) + "l",
        )  # fmt: skip
        lines += ["", "Speed-up of ODC (TRL's median / ODC's): "
                  + ", ".join(f"{PHASE_NAMES[p]} {v:.3f}x" for p, v in analysis["ratios"].items()), ""]  # fmt: skip
        for variant, s in summary.items():
            if s["lengths"]:
                n = s["lengths"]
                lines.append(f"- {variant} completion lengths: min {n['min']}, median {_f(n['median'], '.0f')}, "
                             f"p90 {n['p90']}, max {n['max']} ({n['completions']} completions)")  # fmt: skip
        lines += ["", "Goals: " + ", ".join(f"{k}: {'met' if v else 'missed'}" for k, v in analysis["goals"].items()),
                  ""]  # fmt: skip
    if analysis["failed"]:
        lines += ["Failed runs: " + "; ".join(analysis["failed"]), ""]
    steps = []
    for i, r in enumerate(payload["runs"]):
        for s in r.get("steps", []):
            n = sorted(s.get("lengths", [])) or [0]
            steps.append([f"{i + 1} {r['variant']}", s["step"], _f(s["seconds"]), _f(s.get("generate_s")),
                          _f(s.get("sync_s")), _f(s.get("score_s")), _f(s.get("train_s")), _f(s.get("loss"), ".4g"),
                          f"{n[0]} / {n[len(n) // 2]} / {n[-1]}"])  # fmt: skip
    lines += ["## Per step", "",
              *report_module.table(["run", "step", "step s", "generation s", "sync s", "scoring s", "training s", "loss",
                                    "lengths (min / median / max)"], steps, "lrrrrrrrl")]  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(payload: dict, analysis: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    summary = analysis["summary"]
    if not summary:
        return None
    fig, (bars, lines) = plt.subplots(1, 2, figsize=(12, 4.5))
    parts = ("generate_s", "sync_s", "score_s", "train_s")
    for x, s in enumerate(summary.values()):
        bottom = 0.0
        for k, phase in enumerate(parts):
            value = s[phase] or 0.0
            bars.bar(x, value, bottom=bottom, color=f"C{k}", label=PHASE_NAMES[phase] if x == 0 else None)
            bottom += value
    bars.set_xticks(range(len(summary)), [VARIANTS[v] for v in summary], fontsize=8)
    bars.set_ylabel("median seconds per step")
    bars.legend(fontsize=7)
    for i, r in enumerate(payload["runs"]):
        steps = r.get("steps", [])
        lines.plot(
            [s["step"] for s in steps],
            [s["seconds"] for s in steps],
            marker="o",
            label=f"{i + 1} {r['variant']}",
        )
    lines.set_xlabel("step")
    lines.set_ylabel("step seconds")
    lines.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(out_dir, payload: dict, report_module) -> tuple[Path, Path, Path | None]:
    """``grpo_vllm_<model>_<hw>_<date><tag>.{json,md,png}`` under ``out_dir``; returns the three paths."""
    env = payload["env"]
    stem = (f"grpo_vllm_{payload['args']['model']}_{report_module.hardware_tag(env)}_{env['date'][:10]}"
            f"{payload['args'].get('tag', '')}")  # fmt: skip
    analysis = analyse(payload)
    json_path, md_path = report_module.write(out_dir, stem, {**payload, "analysis": analysis},
                                             render(payload, analysis, report_module))  # fmt: skip
    return json_path, md_path, plot(payload, analysis, Path(out_dir) / f"{stem}.png")
