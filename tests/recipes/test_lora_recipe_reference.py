"""TRL's SFT recipe with LoRA on an untied head (``trl.scripts.sft --use_peft``, unmodified) through ``odc_hf.run`` on 2
CPU ranks (``accelerate launch ... -m odc_hf.run trl.scripts.sft``, as users run it), against TRL's own recipe in one
process on the same samples per step (tests/support/lora_recipe_runs.py): the CPU twin of tests/gpu/test_gpu_shared.py's
recipe test, whose ranks share a GPU. The saved adapter is what PEFT saves and reloads into the base model with PEFT.
The untied lm_head (Llama / Mistral / Qwen2.5-7B style) crashed at step 1 before the head shared the final norm's FSDP
unit through the PeftModel; LoRA on a tied head runs in tests/trainers/test_peft_sft.py."""

from __future__ import annotations

import lora_recipe_runs as recipe
import pytest
import sft_runs
from launched import run_plain
from recipe_checks import assert_same_tokenizer

from odc_hf.testing import accelerate_cpu


@pytest.mark.slow
def test_lora_recipe_on_two_ranks_equals_trls_recipe_in_one_process(tmp_path):
    model_dir, data_dir, ordered = recipe.write_inputs(tmp_path)
    proc = accelerate_cpu("-m", "odc_hf.run", "trl.scripts.sft",
                          *recipe.recipe_args(model_dir, data_dir, tmp_path / "odc", recipe.PER_RANK),
                          env=sft_runs.launch_env(), timeout=900)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "odc/bubble_rate" in proc.stdout + proc.stderr  # ODC's trainer ran (its step metrics are logged)
    # `python -m trl.scripts.sft ...` in one plain process (forked: tests/support/launched.py)
    run_plain("-m trl.scripts.sft", *recipe.reference_args(model_dir, ordered, tmp_path / "trl"))
    odc, trl = recipe.history(tmp_path / "odc"), recipe.history(tmp_path / "trl")
    assert [h["step"] for h in odc] == [h["step"] for h in trl] == list(range(1, recipe.STEPS + 1))
    # fp32, the same samples per step, other microbatches and summation order: measured 8.0e-8 (losses) and 1.2e-7
    # (gradient norms) relative; bounds 1e-5 and 1e-4 as the SFT comparisons (sft_runs). Other samples in a step
    # move the losses by ~1e-3; a rank's gradient lost, ~1e-1 on the gradient norm.
    for a, b in zip(odc, trl, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (a, b)
    _check_saved_adapter(model_dir, ordered, tmp_path / "odc")


def _check_saved_adapter(model_dir, ordered, out):
    import json

    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from odc_hf.testing.pretrained_tokenizer import qwen2_5_tokenizer

    # The recipe's final save_model() writes what PEFT writes: the adapter, not the base model.
    assert not list(out.glob("model*.safetensors"))
    adapter = load_file(out / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter), sorted(adapter)
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and all(v.abs().max() > 0 for v in lora_b)  # LoRA's B starts at zero: training moved it
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), out)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = qwen2_5_tokenizer()
    # The reloaded adapter lowers the loss of every conversation the run trained on (the first STEPS minibatches of
    # ODC's order) against the base model it was trained from (measured: by 0.08-0.13 nats; 0.01 is the bound).
    rows = [json.loads(line) for line in (ordered / "train.jsonl").read_text().splitlines()]
    trained = rows[: recipe.STEPS * recipe.PER_RANK * recipe.RANKS]
    for conversation in trained:
        ids = tokenizer.apply_chat_template(conversation["messages"], return_dict=True, return_tensors="pt")
        ids = ids["input_ids"][:, :256]  # the recipe's --max_length
        with torch.no_grad():
            tuned, plain = reloaded(input_ids=ids, labels=ids).loss, base(input_ids=ids, labels=ids).loss
        assert torch.isfinite(tuned) and tuned < plain - 0.01, (tuned, plain)
    assert_same_tokenizer(out, tokenizer, trained[0]["messages"][1]["content"])
