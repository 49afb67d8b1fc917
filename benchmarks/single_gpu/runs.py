"""The timed runs of benchmarks/single_gpu/run.py, each in its own forked child: the model, the samples and TRL's packing
of them, the per-step clock and profiler callbacks, and one SFT variant (TRL's SFTTrainer or ODCSFTTrainer; LoRA and
the resumed run are SFT variants too). GRPO's variants: single_gpu_grpo.py. What the variants are: single_gpu.py.

Nothing here starts CUDA at import: the parent imports this module before forking.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from odc_hf.integrations.launch import cuda_allocator

GIB = 1024**3
# per part: workload, TRL max_length (= ODC's token budget)
SFT_PARTS = {"sft_longalign": ("longalign", 32768), "sft_tulu": ("tulu", 16384)}
SFT_VARIANTS = ("T", "O", "T+", "O_sdpa", "T2", "O_noexp", "T+x", "T+t", "O_cute")
# variants that differ from T+ / O only in environment variables (set in their child before CUDA starts)
ENV_VARIANTS = {
    "O_noexp": {cuda_allocator.OPT_OUT_ENV: "0"},  # torch's default CUDA allocator
    "T+x": {cuda_allocator.SETTING_ENV: cuda_allocator.VALUE},  # TRL with O's allocator setting
    "T+t": {"LIGER_KERNEL_IMPL_ROPE": "nvidia-triton"},  # TRL with O's Liger RoPE (Triton)
    "O_cute": {"LIGER_KERNEL_IMPL_ROPE": "nvidia-cutedsl"},  # O with liger-kernel's own RoPE choice on Hopper
}


def cap_device_memory(args) -> None:
    """In this (child) process: cap CUDA memory at ``--device_memory_gib`` (a smaller card on a larger one)."""
    import torch

    gib = getattr(args, "device_memory_gib", None)
    if gib and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        if gib * GIB > total:
            raise ValueError(f"--device_memory_gib {gib} is more than this GPU's {total / GIB:.1f} GiB")
        torch.cuda.set_per_process_memory_fraction(gib * GIB / total)


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
    cap_device_memory(args)
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
        # expandable segments before anything starts CUDA (odc_hf/integrations/launch/cuda_allocator.py)
        odc_args = sft_args(args, out, trl=False, max_length=data["max_length"], steps=steps, **saving)
        m = model(args, "sdpa_varlen")
        cls = odc_sft_trainer(data["groups"])
        trainer = cls(model=m, args=odc_args,
                      train_dataset=Dataset.from_dict({"input_ids": data["ids"]}), processing_class=tokenizer(),
                      odc_config=ODCConfig(max_tokens_per_microbatch=data["max_length"], attention=choice,
                                           device_memory_gib=getattr(args, "device_memory_gib", None)),
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
