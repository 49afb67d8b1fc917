"""One GPU, end to end: the ODC trainers against TRL's own trainers, as users run them (issue 28).

    python benchmarks/single_gpu.py --parts sft_longalign --out $OUT                      # ~6 min on one H200
    python benchmarks/single_gpu.py --parts sft_tulu,lora,grpo,resume --out $OUT          # ~8 min
    python benchmarks/single_gpu.py --smoke --out /tmp/single_gpu                         # CPU: tiny model, 2 steps
    python benchmarks/single_gpu.py --merge RUN1/single_gpu_*.json RUN2/single_gpu_*.json --out benchmarks/results
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
expandable segments, odc_hf/integrations/cuda_allocator.py), with its flush-and-retry count per step
(``num_alloc_retries``). Per step: seconds over the whole step (all microbatches, clipping, optimizer;
``cuda.synchronize`` at both ends; data loading excluded for all), tokens, loss, and the peak allocated memory. Tokens/s: the step group's tokens over
the step seconds, steps after ``--warmup`` (the first steps carry compilation: FA4's, cuDNN's plans); the
warm-up steps are reported on their own.

Other parts: ``lora`` (T vs O, the same ``peft_config``, Tulu-like), ``grpo`` (TRL ``GRPOTrainer`` vs
``ODCGRPOTrainer``: the same prompts, reward and seed; a training phase on fixed rollouts whose completion lengths
spread 32x (TRL's public ``rollout_func``), then steps with ``generate()``), ``resume`` (O saves at step k; a new
process resumes from the checkpoint and repeats steps k+1..; losses side by side).

Results are written as each variant finishes (``OUT/single_gpu_runs/<part>/<variant>.json``) and the report is
rewritten after each: a killed run still leaves its data. Report: ``single_gpu_<hw>_<date>.{md,json}`` and
``single_gpu_<hw>_<date>.png`` (loss curves and step times) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

# This process imports everything once and forks one child per variant; it must not initialise CUDA (a forked child
# could not use it then). NVML-based availability checks (torch's fork-safe option) keep imports from doing so.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import report  # noqa: E402
from odc_hf.integrations import cuda_allocator  # noqa: E402
from odc_hf.transport.peer_memory import SAFE_GPU_ENV  # noqa: E402

for _k, _v in SAFE_GPU_ENV.items():
    os.environ.setdefault(_k, _v)

PARTS = ("sft_longalign", "sft_tulu", "lora", "grpo", "resume")
GIB = 1024**3
# per part: workload, TRL max_length (= ODC's token budget), packed rows per step, samples drawn
SFT_PARTS = {"sft_longalign": ("longalign", 32768), "sft_tulu": ("tulu", 16384)}
SFT_VARIANTS = ("T", "O", "T+", "O_sdpa", "T2", "O_noexp", "T+x", "T+t", "O_cute")
# variants that differ from T+ / O only in environment variables (set in their child before CUDA starts)
ENV_VARIANTS = {
    "O_noexp": {cuda_allocator.OPT_OUT_ENV: "0"},  # torch's default CUDA allocator
    "T+x": {cuda_allocator.SETTING_ENV: cuda_allocator.VALUE},  # TRL with O's allocator setting
    "T+t": {"LIGER_KERNEL_IMPL_ROPE": "nvidia-triton"},  # TRL with O's Liger RoPE (Triton)
    "O_cute": {"LIGER_KERNEL_IMPL_ROPE": "nvidia-cutedsl"},  # O with liger-kernel's own RoPE choice on Hopper
}


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
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 steps per variant, fp32, sdpa (CPU test)")
    p.add_argument("--out", default=os.environ.get("OUT") or str(report.RESULTS))
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


# -- what every variant shares ------------------------------------------------------------------------------------
def fa4_available() -> bool:
    import transformers.utils

    check = getattr(transformers.utils, "is_flash_attn_4_available", None)
    return bool(check is not None and check())


def liger_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def tokenizer():
    from odc_hf.testing.data import default_tokenizer

    return default_tokenizer()


def model(args, attention: str):
    """Qwen2.5-1.5B shape (random init, fp32 master weights; the children run on the GPU) or the tiny model."""
    import torch
    from transformers import Qwen2ForCausalLM

    import odc_hf.attention  # noqa: F401 - registers "sdpa_varlen"
    from odc_hf.prediction.workloads import qwen2_5_config
    from odc_hf.testing.data import tiny_qwen2_model

    if args.model == "tiny":
        m = tiny_qwen2_model(tokenizer(), seed=args.seed, max_position_embeddings=65536)
    else:
        config = qwen2_5_config(args.model or "1.5B")
        config.tie_word_embeddings, config.use_cache = True, False
        torch.manual_seed(args.seed)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            m = Qwen2ForCausalLM(config)
    m.set_attn_implementation(attention)
    return m


def samples(workload: str, max_length: int, num: int, seed: int, vocab: int) -> list[list[int]]:
    import numpy as np

    from odc_hf.prediction.workloads import generate_lengths

    lengths = generate_lengths(workload, num, seed, max_length=max_length)
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab, int(n)).tolist() for n in lengths]


def trl_groups(ids: list[list[int]], max_length: int, rows_per_step: int, steps: int, seed: int):
    """TRL's own packing of ``ids`` (bfd, as SFTConfig(packing=True) does), its rows in a seeded order, cut into
    steps of ``rows_per_step`` rows: (row order, per step the sample indices, each row's sample lengths). Samples are found again in the rows
    by their first tokens (random tokens: unique)."""
    import numpy as np
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    packed = pack_dataset(Dataset.from_dict({"input_ids": ids}), max_length, "bfd")
    row_lengths = [list(x) for x in packed["seq_lengths"]]
    by_key: dict[tuple, list[int]] = {}
    for i, x in enumerate(ids):  # (length, first tokens): equal keys are equal samples (<= 16 random tokens)
        by_key.setdefault((len(x), tuple(x[:16])), []).append(i)
    rows = []
    for row, lengths in zip(packed["input_ids"], packed["seq_lengths"]):
        starts = np.cumsum([0, *lengths[:-1]])
        rows.append([by_key[(n, tuple(row[s : s + 16]))].pop() for s, n in zip(starts, lengths)])
    order = np.random.default_rng(seed).permutation(len(rows)).tolist()
    need = rows_per_step * steps
    if len(order) < need:
        raise ValueError(f"{len(order)} packed rows, fewer than {need} for {steps} steps: draw more samples")
    groups = [[i for r in order[s * rows_per_step : (s + 1) * rows_per_step] for i in rows[r]] for s in range(steps)]
    return order[:need], groups, row_lengths


def allocator_setting() -> dict:
    """The CUDA caching allocator's setting this child ran with (``PYTORCH_CUDA_ALLOC_CONF``) and whether its memory
    sits in expandable segments (``torch.cuda.memory_snapshot()``)."""
    import torch

    setting = cuda_allocator.user_setting()
    if not torch.cuda.is_available():
        return {"setting": setting}
    segments = torch.cuda.memory_snapshot()
    return {"setting": setting, "expandable_segments": any(seg.get("is_expandable") for seg in segments)}


def fa4_compiled() -> int | None:
    """How many kernel configurations FlashAttention-4 has compiled in this process (its in-memory JIT caches; a
    diagnostic read of flash_attn.cute.interface's module state, None when FA4 is not loaded)."""
    module = sys.modules.get("flash_attn.cute.interface")
    if module is None:
        return None
    total = 0
    for name in ("_flash_attn_fwd", "_flash_attn_bwd", "_bwd_preprocess", "_bwd_postprocess_convert"):
        cache = getattr(getattr(module, name, None), "compile_cache", None)
        total += len(getattr(cache, "cache", ()) or ())
    return total


class Profile:
    """A TrainerCallback profiling one step: CUDA and CPU operators, sorted by CUDA time, written as a table."""

    @staticmethod
    def make(path: Path, step: int):
        import torch
        from transformers import TrainerCallback

        class ProfileStep(TrainerCallback):
            profile = None

            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step + 1 == step:
                    activities = [torch.profiler.ProfilerActivity.CPU]
                    if torch.cuda.is_available():
                        activities.append(torch.profiler.ProfilerActivity.CUDA)
                    self.profile = torch.profiler.profile(activities=activities)
                    self.profile.__enter__()

            def on_step_end(self, args, state, control, **kwargs):
                if self.profile is not None:
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    self.profile.__exit__(None, None, None)
                    key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(self.profile.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70)
                                    + "\n\nby CPU time\n" + self.profile.key_averages().table(
                                        sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))  # fmt: skip
                    self.profile = None

        return ProfileStep()


class Clock:
    """A TrainerCallback (built in the child, where transformers is imported): seconds, peak memory and loss per step."""

    @staticmethod
    def make(step_tokens: list[int]):
        import torch
        from transformers import TrainerCallback

        class StepClock(TrainerCallback):
            def __init__(self):
                self.steps: list[dict] = []
                self.logged: dict[int, dict] = {}
                self.cuda = torch.cuda.is_available()

            def _sync(self):
                if self.cuda:
                    torch.cuda.synchronize()

            def _allocator(self) -> dict:
                if not self.cuda:
                    return {}
                stats = torch.cuda.memory_stats()
                return {"retries": stats.get("num_alloc_retries", 0), "mallocs": stats.get("num_device_alloc", 0),
                        "fa4_compiles": fa4_compiled() or 0}  # fmt: skip

            def on_train_begin(self, args, state, control, **kwargs):
                if self.cuda:
                    torch.cuda.reset_peak_memory_stats()

            def on_step_begin(self, args, state, control, **kwargs):
                self._sync()
                self.before = self._allocator()
                self.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                self._sync()
                seconds = time.perf_counter() - self.t0
                n, after = state.global_step, self._allocator()
                self.steps.append({"step": n, "seconds": seconds,
                                   "tokens": step_tokens[n - 1] if 0 < n <= len(step_tokens) else None,
                                   "peak_gib": torch.cuda.max_memory_allocated() / GIB if self.cuda else None,
                                   "reserved_peak_gib": torch.cuda.max_memory_reserved() / GIB if self.cuda else None,
                                   # the caching allocator's flush-and-retry count and cudaMalloc calls in this step
                                   **{k: after[k] - self.before.get(k, 0) for k in after}})  # fmt: skip

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    self.logged[state.global_step] = {"loss": float(logs["loss"]),
                                                      "grad_norm": float(logs.get("grad_norm", float("nan")))}  # fmt: skip

            def rows(self) -> list[dict]:
                return [{**s, **self.logged.get(s["step"], {})} for s in self.steps]

        return StepClock()


def sft_args(args, out: Path, *, trl: bool, max_length: int, steps: int, **changes):
    from trl import SFTConfig

    from odc_hf import ODCSFTConfig

    cls = SFTConfig if trl else ODCSFTConfig
    half = args.model != "tiny"
    fields = dict(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=1, learning_rate=1e-5,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, seed=args.seed,
        logging_steps=1, save_strategy="no", report_to="none", bf16=half, max_length=max_length,
        dataset_num_proc=None, disable_tqdm=True,
    )  # fmt: skip
    if trl:  # TRL's recommendation for long variable-length data; gradient checkpointing left at its default (on)
        fields.update(packing=True, gradient_accumulation_steps=args.rows_per_step,
                      train_sampling_strategy="sequential")  # fmt: skip
    else:  # odc_hf packs itself and owns activation checkpointing
        fields.update(packing=False, gradient_checkpointing=False, dataloader_drop_last=False)
    return cls(**{**fields, **changes})


def fixed_groups_sampler(groups):
    from odc_hf.balance import ODCBatchSampler

    class FixedGroups(ODCBatchSampler):
        """Per step exactly TRL's step samples (``trl_groups``), planned by LB-Mini as usual."""

        def __len__(self):
            return len(groups)

        def minibatch_indices(self, step):
            import numpy as np

            return np.asarray(groups[step])

    return FixedGroups


def odc_sft_trainer(groups):
    from odc_hf import ODCSFTTrainer

    return type("BenchODCSFTTrainer", (ODCSFTTrainer,), {"odc_sampler_class": fixed_groups_sampler(groups)})


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])  # fmt: skip


def run_sft_variant(args, variant: str, data: dict, out: Path, *, peft: bool = False, resume: str | None = None,
                    save_steps: int = 0, steps: int | None = None) -> dict:  # fmt: skip
    """One SFT variant in this (child) process."""
    import torch
    from datasets import Dataset

    steps = steps or len(data["groups"])
    if variant in ENV_VARIANTS:  # this child only (forked): before anything starts CUDA here
        os.environ.update(ENV_VARIANTS[variant])
    best = "flash_attention_4" if fa4_available() else "sdpa"
    liger = liger_available() and torch.cuda.is_available()
    extra = {"peft_config": lora_config()} if peft else {}
    saving = {"save_strategy": "steps", "save_steps": save_steps} if save_steps else {}
    clock = Clock.make(data["step_tokens"])
    torch.manual_seed(args.seed)  # TRL draws LoRA weights in __init__
    if variant.startswith("T"):
        plus = variant.startswith("T+")  # T+, T+x, T+t
        changes = {"use_liger_kernel": liger, "gradient_checkpointing": False} if plus else {}
        attention = best
        m = model(args, attention)
        from trl import SFTTrainer

        trainer = SFTTrainer(model=m, args=sft_args(args, out, trl=True, max_length=data["max_length"], steps=steps,
                                                    **changes, **saving),
                             train_dataset=Dataset.from_dict({"input_ids": data["ids"]}), processing_class=tokenizer(),
                             **extra)  # fmt: skip
        rows = trainer.train_dataset
        got = [list(x) for x in rows["seq_lengths"]]
        if got != data["row_lengths"]:
            raise RuntimeError("TRL packed the samples differently from trl_groups(): the step groups would differ")
        trainer.train_dataset = rows.select(data["row_order"])  # the seeded row order; sequential sampler
        path = {"kernels": "liger" if plus and liger else "none", "loss": "trl_fused_lm_head",
                "activation_checkpointing": "none" if plus else "full (TRL default)"}  # fmt: skip
    else:
        from odc_hf import ODCConfig

        # O: the ODC trainer's defaults (ODCConfig.attention="auto": FlashAttention-4 where it runs, else
        # sdpa_varlen); O_sdpa: sdpa_varlen forced. The model is built on sdpa_varlen either way; "auto" replaces it.
        choice = "sdpa_varlen" if variant == "O_sdpa" else "auto"
        # the arguments first, as docs/quickstart.md builds them: ODCSFTConfig asks for the CUDA allocator's
        # expandable segments before anything starts CUDA (odc_hf/integrations/cuda_allocator.py)
        odc_args = sft_args(args, out, trl=False, max_length=data["max_length"], steps=steps, **saving)
        m = model(args, "sdpa_varlen")
        cls = odc_sft_trainer(data["groups"])
        trainer = cls(model=m, args=odc_args,
                      train_dataset=Dataset.from_dict({"input_ids": data["ids"]}), processing_class=tokenizer(),
                      odc_config=ODCConfig(max_tokens_per_microbatch=data["max_length"], attention=choice),
                      **extra)  # fmt: skip
        attention = (trainer.odc_attention or {}).get("implementation", choice)
        path = None
    trainer.add_callback(clock)
    profiling = args.profile and variant in args.profile_variants.split(",")
    if profiling:
        trainer.add_callback(Profile.make(Path(args.out) / f"profile_{out.parent.name}_{variant}.txt", args.profile))
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    wall = time.perf_counter() - start
    if path is None:
        path = trainer.odc_compute.describe() if trainer.odc_compute is not None else {}
    path = {**path, "cuda_allocator": allocator_setting()}
    return {"variant": variant, "attention": attention, "compute_path": path, "train_wall_s": wall,
            "steps": clock.rows(), "peak_gib": max((s["peak_gib"] or 0 for s in clock.steps), default=None),
            "microbatches": [s.microbatches for s in getattr(trainer, "odc_stats", None).steps]
            if hasattr(trainer, "odc_stats") else None}  # fmt: skip


# -- GRPO ------------------------------------------------------------------------------------------------------------
def grpo_prompts(num: int, seed: int):
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_list([{"prompt": f"Compute {rng.randint(0, 99)} + {rng.randint(0, 99)} = "} for _ in range(num)])


def digit_reward(completions, **kwargs) -> list[float]:
    """The share of digits in the completion: varied rewards from a random model, so advantages are not all 0."""
    return [sum(ch.isdigit() for ch in text) / max(1, len(text)) for text in completions]


def fixed_rollouts(tok, low: int, high: int):
    """TRL ``rollout_func``: completions that depend only on (prompt, repeat), lengths log-uniform in [low, high]."""
    import random
    import zlib

    def rollout(prompts, trainer):
        seen: dict[str, int] = {}
        prompt_ids, completion_ids = [], []
        for prompt in prompts:
            k = seen[prompt] = seen.get(prompt, -1) + 1
            rng = random.Random(zlib.crc32(f"{prompt}|{k}".encode()))
            length = int(math.exp(rng.uniform(math.log(low), math.log(high))))
            ids = [rng.randrange(3, len(tok)) for _ in range(length)]
            if length < high:
                ids[-1] = tok.eos_token_id
            prompt_ids.append(tok(prompt, add_special_tokens=False)["input_ids"])
            completion_ids.append(ids)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return rollout


def run_grpo_variant(args, variant: str, out: Path, *, generate: bool) -> dict:
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from odc_hf import ODCConfig, ODCGRPOTrainer

    tiny = args.model == "tiny"
    # fixed rollouts: completion lengths log-uniform up to 2048 (32x spread); generate(): a random model rarely
    # samples EOS, so every completion runs to the cap: 256 keeps those steps to seconds
    high = 64 if tiny else (256 if generate else 2048)
    tok = tokenizer()
    tok.padding_side = "left"
    attention = "sdpa"  # TRL's padded GRPO rows carry an attention mask
    m = model(args, attention)
    steps = args.grpo_generate_steps if generate else args.grpo_steps
    # generate(): one prompt x 8 completions per step (HF generate() of a 1.5B model: ~25 ms per token)
    config = GRPOConfig(output_dir=str(out), max_steps=steps, per_device_train_batch_size=4 if tiny else 8,
                        gradient_accumulation_steps=2 if tiny else (1 if generate else 4),
                        num_generations=4 if tiny else 8,
                        max_completion_length=high, learning_rate=1e-6, lr_scheduler_type="constant", warmup_steps=0,
                        weight_decay=0.0, max_grad_norm=1.0, beta=0.0, loss_type="dapo", seed=args.seed,
                        logging_steps=1, save_strategy="no", report_to="none", bf16=not tiny, disable_tqdm=True,
                        temperature=1.0, gradient_checkpointing=not tiny)  # fmt: skip
    kwargs = dict(model=m, reward_funcs=digit_reward, args=config, train_dataset=grpo_prompts(256, args.seed),
                  processing_class=tok)  # fmt: skip
    if not generate:
        kwargs["rollout_func"] = fixed_rollouts(tok, max(2, high // 32), high)
    clock = Clock.make([])
    torch.manual_seed(args.seed)
    trainer = ODCGRPOTrainer(**kwargs, odc_config=ODCConfig()) if variant == "O" else GRPOTrainer(**kwargs)
    trainer.add_callback(clock)
    start = time.perf_counter()
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    return {"variant": variant, "generate": generate, "train_wall_s": time.perf_counter() - start,
            "steps": clock.rows(), "peak_gib": max((s["peak_gib"] or 0 for s in clock.steps), default=None),
            "completion_lengths": [h.get("completions/mean_length") for h in history],
            "completion_min_max": [(h.get("completions/min_length"), h.get("completions/max_length")) for h in history]}  # fmt: skip


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


def sft_data(args, part: str, steps: int) -> dict:
    workload, max_length = SFT_PARTS[part] if part in SFT_PARTS else SFT_PARTS["sft_tulu"]
    if args.model == "tiny":
        max_length = 512 if workload == "longalign" else 256
    vocab = 151_936 if args.model != "tiny" else len(tokenizer())
    per_row = 2 if workload == "longalign" else max(1, max_length // 700)
    num = int(args.rows_per_step * steps * per_row * 1.6) + 16
    ids = samples(workload, max_length, num, args.seed, vocab)
    order, groups, row_lengths = trl_groups(ids, max_length, args.rows_per_step, steps, args.seed)
    return {"workload": workload, "max_length": max_length, "ids": ids, "groups": groups, "row_order": order,
            "row_lengths": row_lengths,
            "step_tokens": [sum(len(ids[i]) for i in g) for g in groups]}  # fmt: skip


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


# -- analysis and report ----------------------------------------------------------------------------------------------
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


def render(payload: dict, analysis: dict) -> str:
    runs = payload.get("runs", [])
    lines = ["# One GPU, end to end: ODC trainers vs TRL's trainers", "", report.env_markdown(payload["env"]),
             *[f"- run {i + 1}: {r['date']}, `{r['commit']}`, `{r['command']}`" for i, r in enumerate(runs)],
             f"- FlashAttention-4 installed: {payload['fa4']}; liger-kernel installed: {payload['liger']}",
             f"- steps left out of tokens/s (warm-up): {payload['args']['warmup']}", "",
             "Every variant " + __doc__.split("Every variant", 1)[1].split("Results are written")[0].strip(), ""]  # fmt: skip
    for part, a in analysis.items():
        lines += [f"## {part}", ""]
        data = payload["parts"][part].get("data", {})
        if data:
            lines += [f"workload {data.get('workload')}, max_length / token budget {data.get('max_length')}"
                      + (f", tokens per step median {_median(data['step_tokens']):.0f}" if data.get("step_tokens") else ""), ""]  # fmt: skip
        if part == "resume":
            lines += ["| step | resumed loss | uninterrupted loss |", "|---:|---:|---:|"]
            lines += [f"| {s} | {_f(x, '.6f')} | {_f(y, '.6f')} |" for s, x, y in a["pairs"]]
            lines += ["", f"max relative difference: {_f(a['max_rel'], '.2e')}", ""]
            continue
        lines += ["| variant | attention | compute path | CUDA allocator | tokens/s | median step s | warm-up steps s | "
                  "peak GiB (reserved) | allocator retries (steps with any) |",
                  "|---|---|---|---|---:|---:|---|---:|---:|"]  # fmt: skip
        for name, s in a["summary"].items():
            if not s.get("ok"):
                lines.append(f"| {name} | failed: {s.get('error')} | | | | | | | |")
                continue
            path = s.get("compute_path") or {}
            alloc = path.get("cuda_allocator") or {}
            kind = {True: "expandable segments", False: "default"}.get(alloc.get("expandable_segments"), "-")
            lines.append(f"| {name} | {s.get('attention') or '-'} | {path.get('kernels', '-')}, "
                         f"{path.get('activation_checkpointing', '-')} | {kind} | {_f(s['tokens_per_s'], '.0f')} | "
                         f"{_f(s['median_step_s'])} | {s['warmup_step_s']} | {_f(s['peak_gib'], '.1f')} "
                         f"({_f(s.get('reserved_peak_gib'), '.1f')}) | {s.get('alloc_retries', '-')} "
                         f"({s.get('steps_with_retries', '-')}) |")  # fmt: skip
        lines += ["", "Ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in a["ratios"].items()), "",
                  "Per-step losses (max / median relative difference over steps): "
                  + ", ".join(f"{k}: {_f((v or {}).get('max_rel'), '.2e')} / {_f((v or {}).get('median_rel'), '.2e')}"
                              for k, v in a["losses"].items()), ""]  # fmt: skip
        names = [n for n, v in payload["parts"][part].items() if isinstance(v, dict) and v.get("ok")]
        steps = max((len(payload["parts"][part][n]["steps"]) for n in names), default=0)
        if names and steps:
            lines += ["Per step: loss, seconds (and the CUDA allocator's flush-and-retry count where not 0).", "",
                      "| step | " + " | ".join(f"{n} loss | {n} s" for n in names) + " |",
                      "|---:|" + "---:|---:|" * len(names)]  # fmt: skip
            for i in range(steps):
                row = []
                for n in names:
                    st = payload["parts"][part][n]["steps"]
                    s = st[i] if i < len(st) else {}
                    retries = f" ({s['retries']})" if s.get("retries") else ""  # the allocator's retries, if any
                    row += [_f(s.get("loss"), ".5f"), _f(s.get("seconds")) + retries]
                lines.append(f"| {i + 1} | " + " | ".join(row) + " |")
            lines.append("")
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


def finish(args, payload: dict) -> None:
    """(Re)write the report, JSON and plot from what has finished so far."""
    env = payload["env"]
    stem = f"single_gpu_{report.hardware_tag(env)}_{env['date'][:10]}{args.tag}"
    analysis = analyse(payload, args.warmup)
    report.write(args.out, stem, {**payload, "analysis": analysis}, render(payload, analysis))
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
