"""One GPU, end to end: the ODC trainers against TRL's own trainers, as users run them.

    python -m benchmarks.single_gpu.run --parts sft_longalign --out $OUT                      # ~6 min on one H200
    python -m benchmarks.single_gpu.run --parts sft_tulu,lora,grpo,resume --out $OUT          # ~8 min
    python -m benchmarks.single_gpu.run --smoke --out /tmp/single_gpu                         # CPU: tiny model, 2 steps
    python -m benchmarks.single_gpu.run --merge RUN1/single_gpu_*.json RUN2/single_gpu_*.json --out benchmarks/results
                                                          # CPU: one report from several device calls' JSON

Every variant trains the SAME samples in the SAME order, one step = one group of samples:

- the samples: seeded synthetic lengths (``odc_hf.prediction.workloads``: LongAlign-like up to 32k, Tulu-like), random tokens;
- TRL packs them with its default strategy (``pack_dataset(..., "bfd")``, what ``SFTConfig(packing=True)`` does);
  (T) trains those packed rows in a seeded order, ``gradient_accumulation_steps`` rows per step; the ODC trainer
  gets, per step, exactly the samples of those rows (``odc_sampler_class`` with fixed groups) and packs them into
  its own token-budget microbatches (budget = TRL's ``max_length``).

SFT variants (Qwen2.5-1.5B shape from a config, random init, bf16 autocast, fp32 master weights, AdamW, lr 1e-5):

- **T**: TRL ``SFTTrainer`` as its docs recommend for long variable-length data: packing (bfd), padding-free, its
  default gradient checkpointing, its fused LM head, the best attention transformers offers here
  (``flash_attention_4`` when installed, else ``sdpa``);
- **T+**: T plus ``use_liger_kernel=True`` and no gradient checkpointing (needs liger-kernel; else only no GC);
- **O**: ``ODCSFTTrainer`` with its defaults (compute path: fused head, Liger when installed, auto activation
  checkpointing; ``ODCConfig.attention="auto"``: ``flash_attention_4`` where it runs, else ``sdpa_varlen``; the
  report's attention column is what ``auto`` resolved to); **O_sdpa**: the same with ``attention="sdpa_varlen"``;
- **T2**: T again with the same seed: the bf16 run-to-run noise that per-step losses are compared against;
- diagnostics, one environment variable each: **O_noexp**: O with ``ODC_EXPANDABLE_SEGMENTS=0`` (torch's default CUDA
  allocator, as before odc_hf asked for expandable segments); **T+x**: T+ with
  ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (O's allocator setting); **T+t**: T+ with
  ``LIGER_KERNEL_IMPL_ROPE=nvidia-triton`` (O's Liger RoPE); **O_cute**: O with ``LIGER_KERNEL_IMPL_ROPE=nvidia-cutedsl``
  (liger-kernel's own choice on Hopper when the CUTLASS DSL is installed, as before odc_hf pinned Triton).

Each variant runs in its own process, forked from this one after the imports (no re-import; a clean CUDA context and
no Liger patches left by another variant), in the order T, O, T+, O_sdpa, T2 (interleaved: every other run is TRL's).
The CUDA allocator's setting is recorded per variant (T as users run TRL: torch's default; O: odc_hf's default,
expandable segments, odc_hf/integrations/launch/cuda_allocator.py), with its flush-and-retry count per step
(``num_alloc_retries``). Per step: seconds over the whole step (all microbatches, clipping, optimizer;
``cuda.synchronize`` at both ends; data loading excluded for all), tokens, loss, and the peak allocated memory. Tokens/s: the step group's tokens over
the step seconds, steps after ``--warmup`` (the first steps carry compilation: FA4's, cuDNN's plans); the
warm-up steps are reported on their own.

Other parts: ``lora`` (T vs O, the same ``peft_config``, Tulu-like), ``grpo`` (TRL ``GRPOTrainer`` vs
``ODCGRPOTrainer``: the same prompts, reward and seed; a training phase on fixed rollouts whose completion lengths
spread 32x (TRL's public ``rollout_func``), then steps with ``generate()``), ``resume`` (O saves at step k; a new
process resumes from the checkpoint and repeats steps k+1..; losses side by side).

``--device_memory_gib 80`` runs every variant as on an 80 GB card (each child's CUDA memory capped there, and the
ODC variants' activation-checkpointing plan made for it); the report's "predicted peak" column is the plan's
prediction and "peak" the allocator's measurement.

Results are written as each variant finishes (``OUT/single_gpu_runs/<part>/<variant>.json``) and the report is
rewritten after each: a killed run still leaves its data. Report: ``single_gpu_<hw>_<date>.{md,json}`` and
``single_gpu_<hw>_<date>.png`` (loss curves and step times) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

# This process imports everything once and forks one child per variant; it must not initialise CUDA (a forked child
# could not use it then). NVML-based availability checks (torch's fork-safe option) keep imports from doing so.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
ROOT = Path(__file__).resolve().parents[2]
from benchmarks.common import report  # noqa: E402
from benchmarks.single_gpu.grpo import run_grpo_variant  # noqa: E402
from benchmarks.single_gpu.report import analyse, plot, render  # noqa: E402
from benchmarks.single_gpu.runs import (  # noqa: E402
    SFT_PARTS,
    SFT_VARIANTS,
    fa4_available,
    liger_available,
    run_sft_variant,
    sft_data,
)
from odc_hf.transport.peer_memory import SAFE_GPU_ENV  # noqa: E402

for _k, _v in SAFE_GPU_ENV.items():
    os.environ.setdefault(_k, _v)

PARTS = ("sft_longalign", "sft_tulu", "lora", "grpo", "resume")
# what every variant trains and how it is timed, as the report states it
METHOD = "Every variant " + __doc__.split("Every variant", 1)[1].split("Results are written")[0].strip()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--steps", type=int, default=30, help="SFT steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of tokens/s")
    p.add_argument("--rows_per_step", type=int, default=2, help="TRL packed rows per step (gradient accumulation)")
    p.add_argument("--variants", default="T,O,T+,O_sdpa,T2",
                   help=f"SFT variants, in run order, from {', '.join(SFT_VARIANTS)}")
    p.add_argument("--profile", type=int, default=0,
                   help="profile this step of the --profile_variants (torch.profiler table under --out)")
    p.add_argument("--profile_variants", default="O", help="comma list of SFT variants to profile")
    p.add_argument("--lora_steps", type=int, default=10)
    p.add_argument("--grpo_steps", type=int, default=4, help="training-phase steps (fixed rollouts) per trainer")
    p.add_argument("--grpo_generate_steps", type=int, default=4, help="steps with generate() per trainer")
    p.add_argument("--resume_at", type=int, default=3, help="resume part: save at this step, train as many again")
    p.add_argument("--model", default=None, help="1.5B (GPU default) or tiny (CPU default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device_memory_gib", type=float, default=None,
                   help="run every variant as on a card of this many GiB: the CUDA memory of each child is capped "
                        "there (torch.cuda.set_per_process_memory_fraction) and the ODC variants plan with it "
                        "(ODCConfig.device_memory_gib); e.g. 80 on an H200 for an H100's memory")
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 steps per variant, fp32, sdpa (CPU test)")
    p.add_argument("--out", default=os.environ.get("OUT") or str(report.RESULTS / "single_gpu"))
    p.add_argument("--work", default=None,
                   help="the trainers' output directories (checkpoints); default: a temporary directory, removed at the end")
    p.add_argument("--tag", default="", help="extra part of the report's file names")
    p.add_argument("--merge", nargs="+", default=None, help="JSON reports of earlier runs: write one report of all")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        p.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    args.parts = parts
    if unknown := set(args.variants.split(",")) - set(SFT_VARIANTS):
        p.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(SFT_VARIANTS)}")
    if args.smoke:
        args.model = args.model or "tiny"
        args.steps, args.warmup, args.lora_steps, args.grpo_steps, args.grpo_generate_steps = 2, 0, 2, 1, 1
        args.resume_at = 1
    return args


# -- the runner: one forked child per variant -------------------------------------------------------------------------
def _child(fn, kwargs, path: str) -> None:
    try:
        result = fn(**kwargs)
        result["ok"] = True
    except BaseException as err:  # noqa: BLE001 - the parent records it; the other variants still run
        result = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-6000:]}
    report.write_json(path, result)
    os._exit(0)


def in_child(fn, path: Path, **kwargs) -> dict:
    """``fn(**kwargs)`` in a forked child (this process has imported everything and never touched CUDA); its result
    lands in ``path`` as soon as it finishes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    proc = ctx.Process(target=_child, args=(fn, kwargs, str(path)))
    start = time.perf_counter()
    proc.start()
    proc.join()
    result = json.loads(path.read_text()) if path.exists() else {"ok": False, "error": f"exit code {proc.exitcode}"}
    result["process_s"] = time.perf_counter() - start
    report.write_json(path, result)
    print(f"  {path.parent.name}/{path.stem}: {'ok' if result['ok'] else result['error']} "
          f"({result['process_s']:.0f} s)", flush=True)  # fmt: skip
    return result


def run_parts(args) -> dict:
    runs = Path(args.out) / "single_gpu_runs"
    # the trainers' output directories (checkpoints: ~18 GB per 1.5B checkpoint) stay out of the results
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="single_gpu_"))
    payload = {"env": args.env, "args": {k: v for k, v in vars(args).items()},
               "fa4": fa4_available(), "liger": liger_available(), "parts": {}}  # fmt: skip
    variants = args.variants.split(",")
    for part in args.parts:
        results = payload["parts"][part] = {}
        if part in SFT_PARTS:
            data = sft_data(args, part, args.steps)
            results["data"] = {"workload": data["workload"], "max_length": data["max_length"],
                               "step_tokens": data["step_tokens"], "samples_per_step": [len(g) for g in data["groups"]]}  # fmt: skip
            for v in variants:
                results[v] = in_child(run_sft_variant, runs / part / f"{v}.json", args=args, variant=v, data=data,
                                      out=work / part / f"{v}_trainer")  # fmt: skip
                finish(args, payload)
        elif part == "lora":
            data = sft_data(args, part, args.lora_steps)
            results["data"] = {"workload": data["workload"], "max_length": data["max_length"],
                               "step_tokens": data["step_tokens"]}  # fmt: skip
            for v in ("T", "O"):
                results[v] = in_child(run_sft_variant, runs / part / f"{v}.json", args=args, variant=v, data=data,
                                      out=work / part / f"{v}_trainer", peft=True)  # fmt: skip
                finish(args, payload)
        elif part == "grpo":
            for generate in (False, True):
                for v in ("T", "O"):
                    name = f"{v}_{'generate' if generate else 'fixed'}"
                    results[name] = in_child(run_grpo_variant, runs / part / f"{name}.json", args=args, variant=v,
                                             out=work / part / f"{name}_trainer", generate=generate)  # fmt: skip
                    finish(args, payload)
        elif part == "resume":
            k = args.resume_at
            data = sft_data(args, part, 2 * k)
            results["data"] = {"workload": data["workload"], "max_length": data["max_length"], "save_at": k}
            trainer_dir = work / part / "O_trainer"
            results["uninterrupted"] = in_child(run_sft_variant, runs / part / "uninterrupted.json", args=args,
                                                variant="O", data=data, out=trainer_dir, save_steps=k)  # fmt: skip
            results["resumed"] = in_child(run_sft_variant, runs / part / "resumed.json", args=args, variant="O",
                                          data=data, out=work / part / "O_resumed",
                                          resume=str(trainer_dir / f"checkpoint-{k}"))  # fmt: skip
            finish(args, payload)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return payload


# -- the report ------------------------------------------------------------------------------------------------------
def finish(args, payload: dict) -> None:
    """(Re)write the report, JSON and plot from what has finished so far."""
    env = payload["env"]
    stem = f"single_gpu_{report.hardware_tag(env)}_{env['date'][:10]}{args.tag}"
    analysis = analyse(payload, args.warmup)
    report.write(args.out, stem, {**payload, "analysis": analysis}, render(payload, analysis, METHOD))
    plot(payload, Path(args.out) / f"{stem}.png")


def merge(args) -> int:
    """One report from the JSON of several runs (e.g. one device call per part): their parts side by side; the
    first run's environment, the others' commands and dates listed."""
    payloads = [json.loads(Path(f).read_text()) for f in args.merge]
    merged = {**payloads[0], "parts": {}, "runs": [{"date": p["env"]["date"], "command": p["env"]["command"],
                                                    "commit": p["env"]["commit"]} for p in payloads]}  # fmt: skip
    for p in payloads:
        merged["parts"].update(p["parts"])
    args.warmup = payloads[0]["args"]["warmup"]
    finish(args, merged)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge:
        return merge(args)
    # versions and GPUs, read in a child: this process never touches CUDA
    args.env = in_child(report.environment, Path(args.out) / "single_gpu_runs" / "environment.json")
    if args.model is None:
        args.model = "1.5B" if args.env.get("gpus") else "tiny"
    # imported once here, before forking (the children inherit them; CUDA stays untouched in this process)
    import datasets  # noqa: F401
    import transformers  # noqa: F401
    import trl  # noqa: F401

    import odc_hf  # noqa: F401

    payload = run_parts(args)
    finish(args, payload)
    failed = [f"{p}/{n}" for p, r in payload["parts"].items() for n, v in r.items() if isinstance(v, dict)
              and v.get("ok") is False]  # fmt: skip
    print(f"single_gpu: report under {args.out}" + (f"; failed: {failed}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
