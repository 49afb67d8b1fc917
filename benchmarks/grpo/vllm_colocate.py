"""One GPU, GRPO with vLLM colocate: TRL's GRPOTrainer (T) vs ODCGRPOTrainer (O) on the same prompts, whole steps
split into generation, weight sync, scoring and training.

    python -m benchmarks.grpo.vllm_colocate --variants T --commit HASH --out $OUT/a         # one run per call (see below)
    python -m benchmarks.grpo.vllm_colocate --variants O --commit HASH --out $OUT/b
    python -m benchmarks.grpo.vllm_colocate --variants T,O --commit HASH --out $OUT         # both in one call
    python -m benchmarks.grpo.vllm_colocate --merge A/grpo_vllm_*.json B/grpo_vllm_*.json --out benchmarks/results
    python -m benchmarks.grpo.vllm_colocate --smoke --out /tmp/grpo_vllm                   # CPU: tiny model, stand-in engine

Both trainers get the same arguments (TRL's defaults plus those below), model, prompts, reward and seed; only the
trainer class differs (O also takes odc_hf's own defaults: ``ODCGRPOConfig``, ``ODCConfig()``). The model has
Qwen2.5-1.5B's shape (``odc_hf.prediction.workloads.qwen2_5_config``), random weights saved once to a work folder (bf16; vLLM
builds its engine from it, the trainers load fp32 master weights and train under bf16 autocast). A random model
almost never samples EOS (1 in 151,936), so vLLM's sampling gets a logit bias on EOS (``--eos_bias``, through TRL's
``generation_kwargs``): per-token EOS odds of about 1 in 1,000, so completion lengths spread from a few tokens to the
``--max_completion_length`` cap (4,096), every step. (The trainers' log-probabilities do not include that bias, so
TRL's importance-sampling ratio on EOS tokens is off from 1, in both variants alike; it does not change the timing.)

Each run is a fresh process (its own CUDA context and vLLM engine), one after another in ``--variants`` order; run
the other order in the next call and ``--merge`` the JSONs (interleaved runs, pooled medians). Not yet measured: a
run is vLLM's start (weights, compilation, CUDA graphs: about a minute expected) plus steps of tens of seconds (a
completion near the 4,096-token cap sets each generation's length), so one or two runs fit a 10-minute call. Per optimizer step,
with ``cuda.synchronize`` at every boundary: the whole step (the Trainer's ``on_step_begin`` to ``on_step_end``), vLLM's
``generate`` and the weight sync (timed on the engine object, TRL's ``VLLMGeneration``), TRL's
``_generate_and_score_completions`` (scoring = it minus generation and sync), training = the rest. The report
(``benchmarks/grpo/vllm_report.py``: markdown, JSON, plot) is rewritten after every run: a killed call keeps its data.
``--profile N`` writes torch.profiler's table of step N of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
from benchmarks.common import report  # noqa: E402
from benchmarks.grpo import vllm_report as grpo_vllm_report  # noqa: E402
from odc_hf.transport.peer_memory import SAFE_GPU_ENV  # noqa: E402

for _k, _v in SAFE_GPU_ENV.items():
    os.environ.setdefault(_k, _v)

GIB = 1024**3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="T,O", help="run order, comma list of T (TRL) and O (ODC)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    p.add_argument("--model", default="1.5B", help="Qwen2.5 shape (1.5B) or tiny")
    p.add_argument("--per_device_train_batch_size", type=int, default=4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=8)
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--max_completion_length", type=int, default=4096)
    p.add_argument(
        "--eos_bias",
        type=float,
        default=5.0,
        help="logit bias on EOS in vLLM's sampling (5.0: ~1/1000 per token for a random 151,936-vocab model)",
    )
    p.add_argument(
        "--gpu_memory_utilization", type=float, default=0.3, help="vLLM's share of the GPU (TRL's default)"
    )
    p.add_argument(
        "--prompt_tokens", default="100,300", help="prompt lengths drawn uniformly from this range"
    )
    p.add_argument("--num_prompts", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile", type=int, default=0, help="write torch.profiler's table of this step of each run"
    )
    p.add_argument(
        "--commit", default=None, help="the commit measured (recorded in the report; git may be stale)"
    )
    p.add_argument("--out", default=os.environ.get("OUT") or str(report.RESULTS / "grpo"))
    p.add_argument("--work", default=None, help="where the model is saved (default: a temporary folder)")
    p.add_argument("--tag", default="", help="extra part of the report's file names")
    p.add_argument(
        "--smoke", action="store_true", help="CPU: tiny model, 2 steps, odc_hf/testing/vllm_fake.py's engine"
    )
    p.add_argument(
        "--merge", nargs="+", default=None, help="JSON reports of earlier calls: one report of all runs"
    )
    p.add_argument(
        "--child", default=None, help=argparse.SUPPRESS
    )  # internal: run one variant in this process
    p.add_argument("--model_dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--run_json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if unknown := set(args.variants.split(",")) - set(grpo_vllm_report.VARIANTS):
        p.error(f"unknown variants {sorted(unknown)}; choose from T, O")
    if args.smoke:
        args.model, args.steps, args.warmup, args.max_completion_length = "tiny", 2, 0, 16
        args.per_device_train_batch_size, args.gradient_accumulation_steps, args.num_generations = 4, 2, 4
        args.prompt_tokens, args.num_prompts = "8,24", 32
    args.prompt_range = tuple(int(n) for n in args.prompt_tokens.split(","))
    if args.commit:
        os.environ["ODC_COMMIT"] = args.commit  # report.commit() records it
    return args


# -- the model, prompts and reward ----------------------------------------------------------------------------------
def make_model(args, work: Path) -> Path:
    """Random weights of the benchmark's shape and the offline tokenizer, saved for vLLM and the trainers (CPU)."""
    import torch
    from transformers import Qwen2ForCausalLM

    from odc_hf.prediction.workloads import qwen2_5_config
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    path = work / f"model_{args.model}"
    tokenizer = default_tokenizer()
    if args.model == "tiny":
        model = tiny_qwen2_model(tokenizer, seed=args.seed, max_position_embeddings=1024)
    else:
        config = qwen2_5_config(args.model)
        config.tie_word_embeddings, config.max_position_embeddings = True, 32768
        for name in ("pad", "eos", "bos"):
            setattr(config, f"{name}_token_id", getattr(tokenizer, f"{name}_token_id"))
        torch.manual_seed(args.seed)
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def prompts(tokenizer, num: int, seed: int, low: int, high: int):
    """``num`` text prompts of ``low``-``high`` tokens cut from the standard library's sources (no download)."""
    import random

    from datasets import Dataset

    from odc_hf.testing.data import default_documents

    rng = random.Random(seed)
    rows = []
    for doc in default_documents(4 * num, seed=seed):
        ids = tokenizer(doc[: 8 * high], add_special_tokens=False)["input_ids"]
        if len(ids) >= high:
            rows.append({"prompt": tokenizer.decode(ids[: rng.randint(low, high)])})
        if len(rows) == num:
            break
    return Dataset.from_list(rows)


def digit_reward(completions, **kwargs) -> list[float]:
    return [sum(ch.isdigit() for ch in text) / max(1, len(text)) for text in completions]


# -- one run ----------------------------------------------------------------------------------------------------------
def _sync():
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def run_variant(args, variant: str, model_dir: Path) -> dict:
    """One trainer run in this process; per step the phase seconds, completion lengths, loss and peak memory."""
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from odc_hf import ODCConfig, ODCGRPOConfig, ODCGRPOTrainer
    from odc_hf.integrations.upstream.vllm import prefer_vllm_environment

    prefer_vllm_environment()  # T too: both engines in the same environment (VLLM_ENABLE_V1_MULTIPROCESSING=0, ...)
    if args.smoke:  # the CPU stand-in for vLLM's LLM (TRL builds it where it would build vLLM's)
        torch.set_num_threads(1)  # a tiny model: threads only add hand-off cost
        from transformers import AutoConfig

        from odc_hf.testing import vllm_fake

        vllm_fake.install(AutoConfig.from_pretrained(model_dir))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    data = prompts(tokenizer, args.num_prompts, args.seed, *args.prompt_range)
    config_class = ODCGRPOConfig if variant == "O" else GRPOConfig
    config = config_class(
        output_dir=str(Path(args.work_dir) / f"trainer_{variant}"), max_steps=args.steps,
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, learning_rate=1e-6, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, loss_type="dapo", seed=args.seed,
        logging_steps=1, save_strategy="no", report_to="none", bf16=not args.smoke, use_cpu=args.smoke,
        disable_tqdm=True, temperature=1.0, model_init_kwargs={"dtype": torch.float32}, use_vllm=True,
        vllm_mode="colocate", vllm_gpu_memory_utilization=args.gpu_memory_utilization,
        vllm_max_model_length=args.prompt_range[1] + 16 + args.max_completion_length,
        generation_kwargs={"logit_bias": {tokenizer.eos_token_id: args.eos_bias}, "detokenize": False},
    )  # fmt: skip
    step: dict = {}

    def add(key, seconds):
        step[key] = step.get(key, 0.0) + seconds

    base = ODCGRPOTrainer if variant == "O" else GRPOTrainer

    class Timed(base):
        def _generate_and_score_completions(self, inputs):
            _sync()
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            _sync()
            add("generation_phase_s", time.perf_counter() - start)
            return out

    class StepClock(TrainerCallback):
        profile = None

        def on_step_begin(self, args_, state, control, **kwargs):
            _sync()
            step.clear()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            if args.profile and state.global_step + 1 == args.profile:
                self.profile = torch.profiler.profile()
                self.profile.__enter__()
            step["t0"] = time.perf_counter()

        def on_step_end(self, args_, state, control, **kwargs):
            _sync()
            seconds = time.perf_counter() - step.pop("t0")
            if self.profile is not None:
                self.profile.__exit__(None, None, None)
                table = self.profile.key_averages().table(sort_by="self_cuda_time_total" if torch.cuda.is_available()
                                                          else "self_cpu_time_total", row_limit=40)  # fmt: skip
                (Path(args.out) / f"profile_grpo_vllm_{variant}_step{state.global_step}.txt").write_text(
                    table
                )
                self.profile = None
            generation = step.get("generation_phase_s", 0.0)
            record["steps"].append({
                "step": state.global_step, "seconds": seconds, "generate_s": step.get("generate_s", 0.0),
                "sync_s": step.get("sync_s", 0.0),
                "score_s": generation - step.get("generate_s", 0.0) - step.get("sync_s", 0.0),
                "train_s": seconds - generation, "lengths": step.get("lengths", []),
                "peak_gib": torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else None,
            })  # fmt: skip

        def on_log(self, args_, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and record["steps"]:
                record["steps"][-1].update(loss=logs["loss"], grad_norm=logs.get("grad_norm"))

    record = {
        "variant": variant,
        "steps": [],
        "date": report.environment()["date"],
        "command": " ".join(sys.argv),
    }
    start = time.perf_counter()
    extra = {"odc_config": ODCConfig(log_timeline=False)} if variant == "O" else {}
    trainer = Timed(model=str(model_dir), reward_funcs=digit_reward, args=config, train_dataset=data,
                    processing_class=tokenizer, **extra)  # fmt: skip
    record["init_s"] = time.perf_counter() - start  # the trainer, with its vLLM engine
    generation = trainer.vllm_generation
    engine_class = type(generation)

    class TimedEngine(engine_class):  # TRL's generation object (ODC's weight sync mixed in for O)
        def sync_weights(self):
            _sync()
            t = time.perf_counter()
            super().sync_weights()
            _sync()
            add("sync_s", time.perf_counter() - t)

        def generate(self, prompts, images, num_generations, profiler=None):
            _sync()
            t = time.perf_counter()
            out = super().generate(prompts, images, num_generations, profiler)
            _sync()
            add("generate_s", time.perf_counter() - t)
            step.setdefault("lengths", []).extend(len(ids) for ids in out[1])
            return out

    generation.__class__ = TimedEngine
    trainer.add_callback(StepClock())
    trainer.train()
    record["attention"] = (getattr(trainer, "odc_attention", None) or {}).get(
        "implementation", trainer.model.config._attn_implementation)  # fmt: skip
    record["ok"] = True
    return record


def _child(args) -> int:
    try:
        result = run_variant(args, args.child, Path(args.model_dir))
    except BaseException as err:  # noqa: BLE001 - the parent records it; the other variants still run
        result = {"variant": args.child, "ok": False, "error": f"{type(err).__name__}: {err}",
                  "traceback": traceback.format_exc()[-6000:]}  # fmt: skip
    report.write_json(args.run_json, result)
    return 0


def _in_child(args, variant: str, model_dir: Path, runs: Path, index: int) -> dict:
    path = runs / f"{index}_{variant}.json"
    forwarded = [a for a in sys.argv[1:] if a != "--smoke"]
    cmd = [sys.executable, __file__, *forwarded, "--child", variant, "--model_dir", str(model_dir),
           "--run_json", str(path), "--work", str(args.work_dir)]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (runs / f"{index}_{variant}.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    result = json.loads(path.read_text()) if path.exists() else {
        "variant": variant, "ok": False, "error": f"exit code {proc.returncode}: {proc.stderr[-2000:]}"}  # fmt: skip
    print(f"  run {index} {variant}: {'ok' if result['ok'] else result['error'][:300]} "
          f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    return result


def _extra_versions() -> dict:
    import importlib.metadata

    out = {}
    for name in ("vllm", "flash-attn-4", "peft"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge:
        payloads = [json.loads(Path(f).read_text()) for f in args.merge]
        merged = {**payloads[0], "runs": [r for p in payloads for r in p["runs"]]}
        merged["args"] = {**merged["args"], "tag": args.tag}
        paths = grpo_vllm_report.write(args.out, merged, report)
        print(f"grpo_vllm: merged report {paths[1]}", flush=True)
        return 0
    args.work_dir = args.work or tempfile.mkdtemp(prefix="grpo_vllm_")
    if args.child:
        return _child(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model_dir) if args.model_dir else make_model(args, Path(args.work_dir))
    payload = {"env": report.environment(), "extra_versions": _extra_versions(),
               "args": {k: v for k, v in vars(args).items() if k not in ("merge", "child", "run_json")}, "runs": []}  # fmt: skip
    runs = Path(args.out) / "grpo_vllm_runs"
    runs.mkdir(parents=True, exist_ok=True)
    for index, variant in enumerate(args.variants.split(",")):
        if args.smoke:  # one CPU process: the stand-in engine needs no CUDA context of its own
            try:
                result = run_variant(args, variant, model_dir)
            except Exception as err:  # noqa: BLE001
                result = {"variant": variant, "ok": False, "error": f"{type(err).__name__}: {err}",
                          "traceback": traceback.format_exc()[-6000:]}  # fmt: skip
        else:
            result = _in_child(args, variant, model_dir, runs, index)
        payload["runs"].append(result)
        paths = grpo_vllm_report.write(args.out, payload, report)
    if not args.work and not args.model_dir:  # the saved model (3 GB at 1.5B) stays out of the results
        shutil.rmtree(args.work_dir, ignore_errors=True)
    print(f"grpo_vllm: report {paths[1]}", flush=True)
    return 0 if all(r.get("ok") for r in payload["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
