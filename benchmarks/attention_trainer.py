"""ODCSFTTrainer on one GPU, attention implementations side by side: whole steps, new lengths every step.

For each workload (LongAlign-like: 4 samples per step, 32k-token rows; Tulu-like: 64 samples per step, 16k-token rows
of many documents), one ODCSFTTrainer per ``ODCConfig.attention`` value (default ``auto`` and ``sdpa_varlen``), same
seed and weights, same samples: the steps run in chunks of ``--chunk`` steps, the variants taking turns chunk by chunk
(one process, no re-imports; each chunk trains the next unseen slice of the data set, so every step meets new
lengths and both variants meet the same ones). Whole-step times come from the Trainer's callbacks (CUDA-synchronised
``on_step_end`` to ``on_step_end``: data, microbatches, optimizer, logging; a chunk's first step is timed from
``on_train_begin``). The attention's warm-up (cuDNN plans of sdpa_varlen, FlashAttention-4's kernel compilation) runs
before step 1 of each chunk (``prepare_attention``) and is reported, as is which implementation ``auto`` chose.

    python benchmarks/attention_trainer.py --out $OUT                      # one H200: ~5 min
    python benchmarks/attention_trainer.py --tiny --out /tmp/at             # CPU dry run
    python benchmarks/attention_trainer.py --profile 3 --out $OUT          # + a profile of one warm step each
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

WORKLOADS = {  # name: (samples per step, token budget = rows' length, longest sample)
    "longalign": (4, 32768, 32768),
    "tulu": (64, 16384, 4096),
}
TINY_WORKLOADS = {"longalign": (4, 512, 512), "tulu": (16, 256, 128)}


def _step_timer(device):
    """A TrainerCallback recording whole-step seconds (CUDA-synchronised)."""
    import torch
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []
            self.last = None

        def _now(self):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter()

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = self._now()

        def on_step_end(self, args, state, control, **kwargs):
            now = self._now()
            self.seconds.append(now - self.last)
            self.last = now

    return StepTimer()


def _profiler(path: Path, step: int):
    """A TrainerCallback that profiles one step (the ``step``-th of a ``train()`` call, when armed) and writes the
    operators' table (CUDA time first) to ``path``: where the time goes when one attention loses."""
    import torch
    from transformers import TrainerCallback

    class ProfileStep(TrainerCallback):
        armed, seen, profile = False, 0, None

        def on_train_begin(self, args, state, control, **kwargs):
            self.seen = 0

        def on_step_begin(self, args, state, control, **kwargs):
            self.seen += 1
            if self.armed and self.seen == step:
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
                sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
                path.write_text(self.profile.key_averages().table(sort_by=sort, row_limit=40))
                self.profile, self.armed = None, False

    return ProfileStep()


def _dataset(workload: str, samples: int, longest: int, vocab: int, seed: int):
    import numpy as np
    from datasets import Dataset

    from odc_hf.workloads import generate_lengths

    name = "tulu" if workload == "tulu" else "longalign"
    lengths = generate_lengths(name, samples, seed, max_length=longest)
    rng = np.random.default_rng(seed)
    return Dataset.from_dict({"input_ids": [rng.integers(10, vocab, int(n)).tolist() for n in lengths]})


def _model(shape: str, device, seed: int):
    import torch
    from transformers import Qwen2ForCausalLM

    if shape == "tiny":
        from odc_hf.data import tiny_qwen2_config

        config = tiny_qwen2_config(512)
    else:
        from odc_hf.workloads import qwen2_5_config

        config = qwen2_5_config(shape)
        config.tie_word_embeddings = shape == "1.5B"
        config.use_cache = False
    config.max_position_embeddings = max(config.max_position_embeddings, 32768)
    config._attn_implementation = "sdpa"  # transformers' default: ODCConfig.attention decides
    torch.manual_seed(seed)
    with torch.device(device):
        return Qwen2ForCausalLM(config)


def run_workload(workload: str, attns: list[str], args) -> dict:
    import torch

    from odc_hf import ODCConfig, ODCSFTConfig, ODCSFTTrainer
    from odc_hf.data import default_tokenizer

    tiny = args.tiny
    per_step, budget, longest = (TINY_WORKLOADS if tiny else WORKLOADS)[workload]
    device = torch.device("cpu" if tiny else "cuda")
    chunks = -(-args.steps // args.chunk)
    tokenizer = default_tokenizer()
    data = _dataset(workload, per_step * args.chunk * chunks, longest, 512 if tiny else 151_000, args.seed)
    trainers, timers, profilers = {}, {}, {}
    for a in attns:
        sft = ODCSFTConfig(output_dir=str(Path(args.out) / f"run_{workload}_{a}"), max_steps=args.chunk,
                           per_device_train_batch_size=per_step, learning_rate=1e-5, lr_scheduler_type="constant",
                           warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, seed=args.seed, logging_steps=1,
                           save_strategy="no", report_to="none", bf16=not tiny, max_length=longest, packing=False,
                           gradient_checkpointing=False, dataloader_drop_last=True, disable_tqdm=True,
                           use_liger_kernel=False, dataset_num_proc=None, use_cpu=tiny)  # fmt: skip
        odc = ODCConfig(attention=a, max_tokens_per_microbatch=budget, activation_checkpointing=args.ac,
                        log_timeline=False)  # fmt: skip
        trainer = ODCSFTTrainer(model=_model(args.model_shape, device, args.seed), args=sft,
                                train_dataset=data.select(range(per_step * args.chunk)), processing_class=tokenizer,
                                odc_config=odc)  # fmt: skip
        timers[a] = _step_timer(device)
        trainer.add_callback(timers[a])
        if args.profile:
            profilers[a] = _profiler(Path(args.out) / f"profile_{workload}_{a}.txt", min(args.profile, args.chunk))
            trainer.add_callback(profilers[a])
        trainers[a] = trainer
    warm_ups = {a: [] for a in attns}
    losses = {a: [] for a in attns}
    for c in range(chunks):  # the variants take turns, chunk by chunk, on the same unseen slice
        part = data.select(range(c * per_step * args.chunk, (c + 1) * per_step * args.chunk))
        for a in attns:
            trainer = trainers[a]
            trainer.train_dataset = part
            if a in profilers and c == chunks - 1:  # one step of the last chunk, warm
                profilers[a].armed = True
            trainer.train()
            warm_ups[a].append(trainer.odc_attention_warm_up)
            losses[a] += [h["loss"] for h in trainer.state.log_history if "loss" in h]
            print(f"{workload} chunk {c} {a}: steps {[round(s, 3) for s in timers[a].seconds[-args.chunk:]]}",
                  flush=True)  # fmt: skip
    out = {"workload": workload, "per_step": per_step, "budget": budget, "chunk": args.chunk, "variants": {}}
    for a in attns:
        trainer, seconds = trainers[a], timers[a].seconds
        tokens = [sum(s.tokens) for s in trainer.odc_stats.steps]
        out["variants"][a] = {
            "attention": trainer.odc_attention, "compute_path": trainer.odc_compute and trainer.odc_compute.describe(),
            "warm_ups": warm_ups[a], "step_s": seconds, "tokens": tokens, "losses": losses[a],
            "microbatches": [s.microbatches[0] for s in trainer.odc_stats.steps],
            "median_step_s": statistics.median(seconds), "tokens_per_s": sum(tokens) / sum(seconds),
            "tokens_per_s_after_chunk_starts": sum(t for i, t in enumerate(tokens) if i % args.chunk)
            / sum(s for i, s in enumerate(seconds) if i % args.chunk),
        }  # fmt: skip
    del trainers
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def render(payload: dict) -> str:
    import report

    attns = payload["attns"]
    lines = [f"# ODCSFTTrainer on one GPU, attention side by side ({report.today()})", "",
             report.env_markdown(payload["env"]), "",
             f"Model {payload['args']['model_shape']} (random init, bf16 autocast), activation checkpointing "
             f"{payload['args']['ac']}, {payload['args']['steps']} steps per variant in chunks of "
             f"{payload['args']['chunk']}, the variants taking turns; whole steps (data, microbatches, optimizer).", "",
             "| workload | attention (implementation) | warm-up s (first chunk) | median step s | tokens/s | "
             "tokens/s without chunk starts | speedup over the last column's variant |",
             "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for w in payload["workloads"]:
        base = w["variants"][attns[-1]]
        for a in attns:
            v = w["variants"][a]
            warm = (v["warm_ups"][0] or {}).get("seconds")
            lines.append(f"| {w['workload']} | {a} ({v['attention']['implementation']}) | "
                         + (f"{warm:.1f}" if warm is not None else "-")
                         + f" | {v['median_step_s']:.3f} | {v['tokens_per_s']:.0f} | "
                         f"{v['tokens_per_s_after_chunk_starts']:.0f} | {v['tokens_per_s'] / base['tokens_per_s']:.3f}x |")  # fmt: skip
        first = w["variants"][attns[0]]["losses"]
        gap = max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(first, base["losses"])), default=float("nan"))
        lines.append(f"| {w['workload']} | largest relative loss difference between the variants, any step | "
                     f"{gap:.1e} | | | | |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attn", default="auto,sdpa_varlen", help="ODCConfig.attention values, comma-separated")
    p.add_argument("--workloads", default="longalign,tulu")
    p.add_argument("--model_shape", default="1.5B")
    p.add_argument("--steps", type=int, default=20, help="steps per variant and workload")
    p.add_argument("--chunk", type=int, default=5, help="steps a variant runs before the next takes its turn")
    p.add_argument("--ac", default="none", help="ODCConfig.activation_checkpointing (none: 1.5B at 32k fits an H200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=int, default=0,
                   help="profile the N-th step of each variant's last chunk (torch.profiler table under --out)")
    p.add_argument("--tiny", action="store_true", help="CPU dry run: tiny model, short rows")
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    if args.tiny:
        args.model_shape = "tiny"
    import report

    attns = [a.strip() for a in args.attn.split(",") if a.strip()]
    env = report.environment()
    payload = {"env": env, "args": vars(args), "attns": attns, "workloads": []}
    stem = f"attention_trainer_{report.hardware_tag(env)}_{report.today()}{args.tag}"
    markdown = ""
    for workload in args.workloads.split(","):
        payload["workloads"].append(run_workload(workload, attns, args))
        markdown = render(payload)
        report.write(args.out, stem, payload, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
