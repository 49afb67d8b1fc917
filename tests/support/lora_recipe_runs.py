"""TRL's SFT recipe (``trl.scripts.sft``, unmodified) with LoRA on an untied head, for tests/gpu/test_gpu_shared.py (ranks
sharing the GPU) and its CPU twin tests/recipes/test_lora_recipe_reference.py: through ``odc_hf.run`` on 2 ranks, and TRL's
own recipe in ONE process without odc_hf as the reference, on the same samples per step.

The reference sees ODC's samples: ODC's sampler draws each step's global minibatch from a permutation seeded by the
run's seed alone (``ODCBatchSampler.minibatch_indices``: the same on any number of ranks), so TRL's run gets a copy of
the data in that order and reads it sequentially (``--train_sampling_strategy sequential``), the whole minibatch per
step in one process. LoRA dropout is off (TRL's default 0.05 would draw other masks in each run); fp32. Both save a
checkpoint at the last step, whose trainer state holds the logged losses at full precision (:func:`history`).
"""

from __future__ import annotations

import json
from pathlib import Path

STEPS, PER_RANK, RANKS = 3, 2, 2
SEED = 42  # TRL's SFTConfig default, which the recipe keeps


def odc_order(num_samples: int, steps: int = STEPS, minibatch: int = PER_RANK * RANKS, seed: int = SEED) -> list[int]:
    """The dataset indices ODC trains, step after step (which samples form each global minibatch)."""
    from odc_hf.balance import ODCBatchSampler

    sampler = ODCBatchSampler([1] * num_samples, world_size=1, rank=0, minibatch_size=minibatch,
                              max_tokens_per_microbatch=256, seed=seed)  # fmt: skip
    return [int(i) for step in range(steps) for i in sampler.minibatch_indices(step)]


def write_inputs(directory: Path):
    """The model (untied head, Qwen2.5's tokenizer), ODC's data and the reference's copy in ODC's order; returns
    ``(model_dir, data_dir, ordered_dir)``."""
    from odc_hf.testing import local_model_and_data
    from odc_hf.testing.data import default_conversations
    from odc_hf.testing.pretrained_tokenizer import qwen2_5_tokenizer

    conversations = default_conversations(4 * PER_RANK * RANKS, max_chars=600)
    model_dir, data_dir = local_model_and_data(directory, conversations, tokenizer=qwen2_5_tokenizer(),
                                               tie_word_embeddings=False)  # fmt: skip
    ordered = directory / "ordered"
    ordered.mkdir(parents=True, exist_ok=True)
    rows = [conversations[i] for i in odc_order(len(conversations))]
    (ordered / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return model_dir, data_dir, ordered


def recipe_args(model_dir, data_dir, out, per_device: int, *extra) -> list:
    """``trl.scripts.sft``'s arguments (the module itself not included)."""
    return ["--model_name_or_path", model_dir, "--dataset_name", data_dir, "--output_dir", out, "--max_steps", STEPS,
            "--per_device_train_batch_size", per_device, "--max_length", 256, "--packing", "false",
            "--assistant_only_loss", "true", "--report_to", "none", "--logging_steps", 1, "--save_strategy", "steps",
            "--save_steps", STEPS,
            "--dtype", "float32", "--bf16", "false", "--use_peft", "--lora_r", 8, "--lora_alpha", 16,
            "--lora_dropout", 0.0, "--lora_target_modules", "all-linear", "--learning_rate", "1e-2",
            "--lr_scheduler_type", "constant", "--seed", SEED, *extra]  # fmt: skip


def history(out) -> list[dict]:
    """The run's logged steps at full precision (the checkpoint's trainer state: the printed log keeps 4 digits)."""
    state = json.loads((Path(out) / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [h for h in state["log_history"] if "loss" in h]


def reference_args(model_dir, ordered_dir, out) -> list:
    """TRL's own run: one process, the whole minibatch per step, ODC's samples in ODC's order."""
    return recipe_args(model_dir, ordered_dir, out, PER_RANK * RANKS, "--train_sampling_strategy", "sequential")
