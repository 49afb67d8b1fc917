"""GRPO in benchmarks/single_gpu/run.py: TRL's GRPOTrainer and ODCGRPOTrainer on the same prompts, reward and seed, in a
forked child each: a training phase on fixed rollouts (TRL's public ``rollout_func``) whose completion lengths spread
32x, then steps with ``generate()``."""

from __future__ import annotations

import math
import time
from pathlib import Path

from benchmarks.single_gpu.runs import Clock, model, tokenizer


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
