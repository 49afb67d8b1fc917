r"""GRPO with ODC through TRL's GRPOTrainer: generation without lockstep, rollouts rebalanced by cost.

    python examples/grpo.py                      # 2 processes: GPUs if there are 2+, else CPU; tiny offline default
    python examples/grpo.py --num_processes 1    # one process, on your GPU if there is one
    accelerate launch --config_file accelerate_configs/odc.yaml examples/grpo.py \
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --bf16 --max_completion_length 1024   # where a hub is reachable
    python examples/grpo.py --trainer trl        # TRL's GRPOTrainer (collectives), for A/B runs

Defaults need no network: a tiny Qwen2-architecture model built from a config, a byte-level BPE trained on the
shipped snapshot of the Python standard library's sources, and arithmetic prompts ("17 + 25 =") scored by a programmatic reward (the
answer, with partial credit for digits, so that a random model's completions still differ in reward).
``--fixed_rollouts`` replaces generation by deterministic completions of long-tailed lengths (TRL's public
``rollout_func``): both trainers then train on the same rollouts, which the parity test compares step by step.
``--loss_type`` takes a comma-separated list and trains once per loss type (fresh model each time).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model_name_or_path", default=None, help="hub model or local directory (default: tiny model)"
    )
    p.add_argument(
        "--trainer", choices=["odc", "trl"], default="odc", help="trl: GRPOTrainer with collectives"
    )
    p.add_argument(
        "--loss_type", default="dapo", help="dapo | grpo | bnpo | dr_grpo, or a comma-separated list"
    )
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0 adds a reference model)")
    p.add_argument("--ref_model_sync_steps", type=int, default=0,
                   help="with --beta: mix the policy into the reference model every N steps (TRL's sync_ref_model); "
                        "0: never")  # fmt: skip
    p.add_argument("--ref_model_mixup_alpha", type=float, default=0.6, help="the policy's share in that mix")
    p.add_argument("--entropy_coef", type=float, default=0.0, help="TRL's entropy bonus coefficient (0: none)")
    p.add_argument("--use_adaptive_entropy", action="store_true",
                   help="TRL's adaptive entropy coefficient (raised while the entropy is below --entropy_target)")
    p.add_argument("--entropy_target", type=float, default=0.2, help="with --use_adaptive_entropy")
    p.add_argument("--top_entropy_quantile", type=float, default=1.0,
                   help="train only on the tokens of the highest entropy: this fraction of each microbatch's (1: all)")
    p.add_argument("--num_prompts", type=int, default=256)
    p.add_argument("--num_generations", type=int, default=4)
    p.add_argument("--max_completion_length", type=int, default=48)
    p.add_argument("--max_steps", type=int, default=5)
    p.add_argument("--per_device_train_batch_size", type=int, default=4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--num_iterations", type=int, default=1)
    p.add_argument("--steps_per_generation", type=int, default=None,
                   help="microbatches of gradient_accumulation_steps each generation batch spans (TRL's; default: one "
                        "optimizer step, gradient_accumulation_steps)")  # fmt: skip
    p.add_argument("--epsilon", type=float, default=0.2, help="PPO clipping range (TRL's epsilon)")
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--output_dir", default="output/grpo")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--use_peft", action="store_true", help="train LoRA adapters (peft) instead of the whole model")
    p.add_argument("--lora_r", type=int, default=8, help="LoRA rank (with --use_peft), on q_proj and v_proj")
    p.add_argument("--head_dim", type=int, choices=[16, 64], default=16,
                   help="the tiny model's head_dim: 64 is a wider tiny model FlashAttention-4 can run")
    p.add_argument("--initializer_range", type=float, default=0.02,
                   help="the tiny model's initial weights' standard deviation (larger: token entropies that differ)")
    p.add_argument("--untied_lm_head", action="store_true",
                   help="tiny model only: an lm_head of its own (Llama / Mistral style) instead of the tied embedding")
    p.add_argument("--report_to", default="none")
    p.add_argument("--save_steps", type=int, default=0, help="checkpoint every N steps (0: never)")
    p.add_argument("--resume_from_checkpoint", default=None,
                   help="true / last: the newest checkpoint in the loss type's output folder; or a checkpoint folder "
                        "(a name such as checkpoint-2 is looked up in that output folder)")  # fmt: skip
    p.add_argument("--eval_steps", type=int, default=0,
                   help="evaluate every N steps on 8 held-out prompts (TRL's evaluation: generation + loss); 0: never")
    p.add_argument("--eval_on_start", action="store_true", help="with --eval_steps: also evaluate before step 1")
    p.add_argument("--num_processes", type=int, default=2,
                   help="processes of `python examples/grpo.py` (ignored under accelerate launch): 2 run ODC on 2+ "
                        "GPUs, else on CPU; 1 runs here, on the GPU if there is one")  # fmt: skip
    p.add_argument(
        "--fixed_rollouts", action="store_true", help="deterministic completions instead of generate()"
    )
    p.add_argument("--tool_outputs", action="store_true",
                   help="with --fixed_rollouts: mark a span of each longer completion as a tool's output (TRL's "
                        "env_mask: not trained on, as in multi-turn rollouts)")  # fmt: skip
    # ODC options (also settable as ODC_* environment variables)
    p.add_argument("--balance", choices=["lb_mini", "lb_micro", "none"], default=None)
    p.add_argument("--cost_model", default=None, help="flop | tokens | calibration.json")
    p.add_argument("--max_tokens_per_microbatch", type=int, default=None)
    p.add_argument("--grpo_layout", choices=["auto", "packed", "padded"], default=None,
                   help="training microbatches: packed rows (no padding) or TRL's padded layout (default auto)")
    p.add_argument("--attention", choices=["auto", "flash_attention_4", "sdpa_varlen", "model"], default=None,
                   help="ODCConfig.attention (default auto: flash_attention_4 where it runs, else sdpa_varlen)")
    p.add_argument("--losses_json", default=None, help="write per-step losses and microbatch counts here")
    return p.parse_args(argv)


# -- the task: arithmetic prompts, a programmatic reward ---------------------------------------------------------
def arithmetic_dataset(num_prompts: int, seed: int):
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-*")
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        rows.append({"prompt": f"Compute {a} {op} {b} = ", "answer": str(answer)})
    return Dataset.from_list(rows)


def arithmetic_reward(completions, answer, **kwargs) -> list[float]:
    """1 for the right number first in the completion; otherwise partial credit for digits (max 0.5)."""
    rewards = []
    for text, truth in zip(completions, answer):
        found = re.search(r"-?\d+", text)
        if found and found.group() == truth:
            rewards.append(1.0)
        else:
            rewards.append(0.5 * sum(ch.isdigit() for ch in text) / max(1, len(text)))
    return rewards


def fixed_rollouts(tokenizer, max_completion_length: int, tool_outputs: bool = False):
    """A TRL ``rollout_func``: completions that depend only on the prompt (and its repeat index), with lengths
    drawn from a long-tailed mix (short right answers, long wrong ones) and an eos at the end of short ones.
    ``tool_outputs``: in each completion of more than 6 tokens, the quarter that starts at its first third is marked
    as a tool's output (TRL's ``env_mask`` 0: not trained on, as in multi-turn rollouts)."""
    eos = tokenizer.eos_token_id

    def rollout(prompts, trainer):
        seen: dict[str, int] = {}
        prompt_ids, completion_ids = [], []
        for prompt in prompts:
            k = seen[prompt] = seen.get(prompt, -1) + 1
            rng = random.Random(zlib.crc32(f"{prompt}|{k}".encode()))
            length = min(max_completion_length, max(2, int(rng.lognormvariate(2.0, 1.1))))
            ids = [rng.randrange(3, len(tokenizer)) for _ in range(length)]
            if length < max_completion_length:
                ids[-1] = eos
            prompt_ids.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            completion_ids.append(ids)
        out = {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}
        if tool_outputs:
            out["env_mask"] = [[int(not (n > 6 and n // 3 <= j < n // 3 + n // 4)) for j in range(n)]
                               for n in map(len, completion_ids)]  # fmt: skip
        return out

    return rollout


def build_model(args, tokenizer, output_dir: Path):
    """The policy: a hub id / local path, or the tiny offline model. With ``--beta`` TRL builds the reference model
    from the policy's path, so the tiny model is saved to disk and passed by path."""
    from odc_hf.testing.data import TINY_HEAD_DIM_64, tiny_qwen2_model

    if args.model_name_or_path:
        return args.model_name_or_path
    wide = TINY_HEAD_DIM_64 if args.head_dim == 64 else {}
    model = tiny_qwen2_model(tokenizer, seed=args.seed, tie_word_embeddings=not args.untied_lm_head,
                             initializer_range=args.initializer_range, **wide)
    if args.beta == 0.0:
        return model
    path = output_dir / "init_model"
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    return str(path)


def train_one(args, loss_type: str, tokenizer, dataset):
    import torch
    from trl import GRPOTrainer

    from odc_hf import ODCConfig, ODCGRPOConfig
    from odc_hf.integrations.launch.exit_cleanup import destroy_gloo_group_at_exit
    from odc_hf.integrations.trl.grpo_trainer import ODCGRPOTrainer

    output_dir = Path(args.output_dir) / loss_type
    model = build_model(args, tokenizer, output_dir)
    config = ODCGRPOConfig(  # TRL's GRPOConfig (+ odc_* fields, unused here: odc_config= below wins)
        output_dir=str(output_dir), max_steps=args.max_steps, per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, num_iterations=args.num_iterations, epsilon=args.epsilon,
        steps_per_generation=args.steps_per_generation,
        learning_rate=args.learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, beta=args.beta, loss_type=loss_type, seed=args.seed, logging_steps=1,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        report_to=args.report_to, bf16=args.bf16, gradient_checkpointing=args.gradient_checkpointing,
        model_init_kwargs={"dtype": torch.bfloat16 if args.bf16 else torch.float32},
        disable_tqdm=True, temperature=1.0, per_device_eval_batch_size=args.per_device_train_batch_size,
        eval_strategy="steps" if args.eval_steps else "no", eval_steps=args.eval_steps or None,
        eval_on_start=args.eval_on_start and bool(args.eval_steps), sync_ref_model=args.ref_model_sync_steps > 0,
        ref_model_sync_steps=max(args.ref_model_sync_steps, 1), ref_model_mixup_alpha=args.ref_model_mixup_alpha,
        entropy_coef=args.entropy_coef, use_adaptive_entropy=args.use_adaptive_entropy,
        entropy_target=args.entropy_target, top_entropy_quantile=args.top_entropy_quantile,
    )  # fmt: skip
    kwargs = dict(model=model, reward_funcs=arithmetic_reward, args=config, train_dataset=dataset,
                  processing_class=tokenizer)  # fmt: skip
    if args.eval_steps:  # prompts of another seed
        kwargs["eval_dataset"] = arithmetic_dataset(8, args.seed + 1)
    if args.use_peft:
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0,
                                           target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")  # fmt: skip
    # TRL draws the LoRA weights in __init__, before the Trainer seeds: seed here so every rank and both trainers
    # start from the same adapter.
    torch.manual_seed(args.seed)
    if args.fixed_rollouts:
        kwargs["rollout_func"] = fixed_rollouts(tokenizer, args.max_completion_length, args.tool_outputs)
    if args.trainer == "odc":
        odc_config = ODCConfig.from_env(balance=args.balance, cost_model=args.cost_model,
                                        max_tokens_per_microbatch=args.max_tokens_per_microbatch,
                                        grpo_layout=args.grpo_layout, attention=args.attention)  # fmt: skip
        trainer = ODCGRPOTrainer(**kwargs, odc_config=odc_config)
    else:
        trainer = GRPOTrainer(**kwargs)
    resume = args.resume_from_checkpoint
    if resume is not None and resume.lower() in ("true", "last"):
        resume = True
    elif resume is not None and (output_dir / resume).is_dir():
        resume = str(output_dir / resume)
    trainer.train(resume_from_checkpoint=resume)
    if args.trainer == "trl":  # TRL's own trainer: the gloo exit guard the ODC trainers register themselves
        destroy_gloo_group_at_exit()
    history = [h for h in trainer.state.log_history if "loss" in h]
    evaluations = [h for h in trainer.state.log_history if "eval_loss" in h]
    steps = [{"microbatches": s.microbatches, "busy_s": s.busy_s, "wait_s": s.wait_s}
             for s in getattr(trainer, "odc_stats", None).steps] if args.trainer == "odc" else []  # fmt: skip
    layout = {"attention": trainer.odc_attention, "packed": trainer.odc_grpo_packed} if args.trainer == "odc" else {}
    for handle in (getattr(trainer, "odc", None), getattr(trainer, "odc_ref", None)):
        if handle is not None:
            handle.close()
    return trainer, {"history": history, "evaluations": evaluations, "steps": steps, **layout}


def main(argv=None) -> None:
    args = parse_args(argv)
    from odc_hf.testing.data import default_tokenizer

    if args.model_name_or_path:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    else:
        tokenizer = default_tokenizer()
    tokenizer.padding_side = "left"
    dataset = arithmetic_dataset(args.num_prompts, args.seed)
    results = {}
    for loss_type in args.loss_type.split(","):
        trainer, results[loss_type] = train_one(args, loss_type, tokenizer, dataset)
        # the ODC trainer prints its own summary line at the end of train(); TRL's prints none
        if args.trainer == "trl" and trainer.accelerator.is_main_process:
            history = results[loss_type]["history"]
            print(f"\nTRL GRPOTrainer summary ({loss_type}, {trainer.accelerator.num_processes} processes, "
                  f"{trainer.state.global_step} steps): final loss {history[-1]['loss']:.6f}, "
                  f"reward {history[-1].get('reward', float('nan')):.4f}", flush=True)  # fmt: skip
    if args.losses_json and trainer.accelerator.is_main_process:
        Path(args.losses_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.losses_json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    parse_args()  # --help and bad flags are answered here, once, before any process is launched
    from odc_hf.integrations.launch.relaunch import relaunch_if_needed

    relaunch_if_needed(__file__, sys.argv[1:], config_dir=ROOT / "accelerate_configs",
                       processes=parse_args().num_processes)  # fmt: skip
    main()
