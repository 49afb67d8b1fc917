"""LoRA (peft) under ODC, end to end with ODCSFTTrainer on 2 CPU ranks.

- Per-step losses and grad norms equal TRL's own SFTTrainer + the same LoRA config, run by one process on each whole
  minibatch (the independent reference: no sharding, no ODC, padded batches), with the ranks running different
  numbers of microbatches (one runs none on the last step). The LoRA weights end equal; the frozen base weights
  never change.
- ``save_model`` writes the adapter as PEFT does (``adapter_model.safetensors`` + ``adapter_config.json``, no base
  weights), gathered from the sharded model; ``PeftModel.from_pretrained`` on a plain copy of the base model gives the
  trained model's outputs.
- A run resumed from a mid-run checkpoint repeats the uninterrupted run's later steps.
"""

from __future__ import annotations

import json

import pytest
import torch

from odc_hf.testing import run_ranks

# Characters kept of each source: varied lengths, so LB-Mini deals unevenly. 8 samples per step: the 11th step has
# 1 sample, so a rank runs no microbatch.
CUTS = (2000, 1000, 500, 250, 120)
NUM_SAMPLES, STEPS, CHECKPOINT_STEP = 81, 11, 5
PROBE = "def odc_probe(x):\n    return x + 1\n"


def _lora():
    from peft import LoraConfig

    return LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )


def _texts():
    from odc_hf.testing.data import default_documents

    docs = [doc for doc in default_documents() if len(doc) > max(CUTS)][:NUM_SAMPLES]
    return [doc[: CUTS[i % len(CUTS)]] for i, doc in enumerate(docs)]


def _args(output_dir, per_device: int, **kwargs):
    from trl import SFTConfig

    return SFTConfig(output_dir=output_dir, max_length=1024, per_device_train_batch_size=per_device,
                     num_train_epochs=1, packing=False, learning_rate=2e-3, lr_scheduler_type="constant",
                     logging_steps=1, report_to="none", bf16=False, use_cpu=True, disable_tqdm=True,
                     **{"save_strategy": "no", **kwargs})  # fmt: skip


def _odc_rank(rank, world, output_dir, resume, tied=True, num_samples=NUM_SAMPLES):
    from datasets import Dataset

    from odc_hf import ODCSFTTrainer
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    tokenizer = default_tokenizer()
    model = tiny_qwen2_model(tokenizer, tie_word_embeddings=tied)
    # TRL draws the LoRA weights in __init__ (before the Trainer seeds): the same on every rank
    torch.manual_seed(0)
    args = _args(output_dir, 4, save_strategy="steps", save_steps=CHECKPOINT_STEP)
    trainer = ODCSFTTrainer(model=model, args=args, processing_class=tokenizer,
                            train_dataset=Dataset.from_dict({"text": _texts()[:num_samples]}),
                            peft_config=_lora())  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    if not tied:  # the untied check below needs the losses only
        trainer.odc.close()
        return _history(trainer), trainer.odc_sampler
    history = _history(trainer)
    counts = [list(s.microbatches) for s in trainer.odc_stats.steps]  # per step: each rank's microbatches
    trainer.save_model(f"{output_dir}/adapter")
    params = {name: p.full_tensor().detach().clone() for name, p in trainer.model.named_parameters()}
    with torch.no_grad():  # the trained, still sharded model's logits on a probe (ODC gathers one-sidedly)
        logits = trainer.model(**tokenizer(PROBE, return_tensors="pt")).logits
    trainer.odc.close()
    return history, counts, trainer.odc_sampler, params, logits


def _history(trainer) -> list[dict]:
    return [{k: h[k] for k in ("step", "loss", "grad_norm")} for h in trainer.state.log_history if "loss" in h]


def _trl_single_process(output_dir, texts, sampler, tied=True, steps=STEPS):
    """TRL's SFTTrainer + the same LoRA, one process, each step on the whole minibatch ODC planned for it."""
    from datasets import Dataset
    from trl import SFTTrainer

    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    class InOrder(SFTTrainer):  # the ODC run's minibatches, in its order
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

    ordered = [texts[i] for step in range(steps) for i in sampler.minibatch_indices(step)]
    tokenizer = default_tokenizer()
    model = tiny_qwen2_model(tokenizer, tie_word_embeddings=tied)
    torch.manual_seed(0)
    trainer = InOrder(model=model, args=_args(output_dir, 8), processing_class=tokenizer,
                      train_dataset=Dataset.from_dict({"text": ordered}), peft_config=_lora())  # fmt: skip
    trainer.train()
    history = _history(trainer)
    return history, dict(trainer.model.named_parameters())


@pytest.fixture(scope="module")
def odc_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("peft_sft")
    return path, run_ranks(_odc_rank, 2, str(path / "odc"), None, env={"ACCELERATE_USE_CPU": "true"})


@pytest.mark.slow
def test_odc_lora_sft_matches_trl_lora_sft_in_one_process(odc_run, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    path, ((history, counts, sampler, params, _), (history_1, *_)) = odc_run
    assert history == history_1 and len(history) == STEPS
    # uneven counts, and a rank with none
    assert any(len(set(step)) > 1 for step in counts[:-1]) and 0 in counts[-1], counts
    reference, ref_params = _trl_single_process(str(path / "trl"), _texts(), sampler)
    for ours, ref in zip(history, reference, strict=True):
        # fp32 sums of the same terms in another order (packed rows vs padded batch, 2 ranks): measured <= 1.2e-7
        # (loss) and <= 2.4e-7 (grad norm) relative; bounds 2e-6 and 4e-6 (16x). A per-rank instead of a global
        # token normaliser, or a lost microbatch, moves them by > 1e-3.
        assert ours["loss"] == pytest.approx(ref["loss"], rel=2e-6), (ours, ref)
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=4e-6), (ours, ref)
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    initial = dict(tiny_qwen2_model(default_tokenizer()).named_parameters())
    for name, ref in ref_params.items():
        if ref.requires_grad:  # LoRA: 11 AdamW steps of lr 2e-3 (2.2e-2 of movement), gradients equal to ~1e-7:
            # measured <= 4.3e-6 absolute (Adam divides by the gradients' running RMS: small ones amplify), bound 2e-5
            torch.testing.assert_close(params[name], ref.detach(), rtol=0, atol=2e-5, msg=name)
        else:  # the frozen base model: bit for bit its initial weights
            base_name = name.replace("base_model.model.", "").replace(".base_layer", "")
            assert torch.equal(params[name], initial[base_name]), name


UNTIED_SAMPLES = 20  # 3 steps of 8, 8, 4 samples: short, with uneven microbatch counts


@pytest.mark.slow
def test_odc_lora_sft_on_an_untied_lm_head_matches_trl(tmp_path, monkeypatch):
    """An untied lm_head (Llama / Mistral / Qwen2.5-7B style) under LoRA: the head must share the final norm's unit
    through the PeftModel, or TRL's fused head reads a still-sharded weight at step 1 (issue 29)."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    (history, sampler), (history_1, _) = run_ranks(
        _odc_rank, 2, str(tmp_path / "odc"), None, False, UNTIED_SAMPLES, env={"ACCELERATE_USE_CPU": "true"}
    )
    assert history == history_1 and len(history) == 3
    reference, _ = _trl_single_process(str(tmp_path / "trl"), _texts()[:UNTIED_SAMPLES], sampler, False, 3)
    for ours, ref in zip(history, reference, strict=True):  # tolerances as in the tied test above
        assert ours["loss"] == pytest.approx(ref["loss"], rel=2e-6), (ours, ref)
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=4e-6), (ours, ref)


@pytest.mark.slow
def test_saved_adapter_reloads_into_a_plain_model(odc_run):
    from peft import PeftModel
    from safetensors.torch import load_file

    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    path, ((_, _, _, params, logits), _) = odc_run
    adapter = path / "odc" / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 8
    saved = load_file(adapter / "adapter_model.safetensors")
    assert saved and all("lora_" in key for key in saved), sorted(saved)  # the adapter only, no base weights
    trained = {k: v for k, v in params.items() if "lora_" in k}
    assert len(saved) == len(trained)
    tokenizer = default_tokenizer()
    reloaded = PeftModel.from_pretrained(tiny_qwen2_model(tokenizer), adapter)
    for name, value in reloaded.named_parameters():
        if "lora_" in name:
            assert torch.equal(value, trained[name]), name
    with torch.no_grad():
        again = reloaded(**tokenizer(PROBE, return_tensors="pt")).logits
    # the same weights, an unsharded forward vs the ODC-gathered one
    torch.testing.assert_close(again, logits, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_resume_from_a_lora_checkpoint_repeats_the_steps(odc_run):
    path, ((history, *_), _) = odc_run
    checkpoint = path / "odc" / f"checkpoint-{CHECKPOINT_STEP}"
    assert (checkpoint / "adapter_model.safetensors").is_file()
    resumed = run_ranks(
        _odc_rank, 2, str(path / "resumed"), str(checkpoint), env={"ACCELERATE_USE_CPU": "true"}
    )
    # the history up to the checkpoint comes from the checkpoint itself
    later = [h for h in resumed[0][0] if h["step"] > CHECKPOINT_STEP]
    assert [h["step"] for h in later] == list(range(CHECKPOINT_STEP + 1, STEPS + 1))
    for ours, before in zip(later, history[CHECKPOINT_STEP:], strict=True):
        assert ours["loss"] == pytest.approx(before["loss"], rel=1e-6), (ours, before)
        assert ours["grad_norm"] == pytest.approx(before["grad_norm"], rel=1e-5), (ours, before)


def test_quantized_base_models_are_refused_clearly():
    from peft import get_peft_model

    from odc_hf.integrations.accelerate.refusals import check_not_quantized
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    model = tiny_qwen2_model(default_tokenizer())
    check_not_quantized(get_peft_model(model, _lora()))  # LoRA on an unquantized base: fine
    model.hf_quantizer = type(
        "Bnb4BitHfQuantizer", (), {}
    )()  # what from_pretrained(quantization_config=...) sets
    with pytest.raises(NotImplementedError, match="quantized base models.*Bnb4BitHfQuantizer.*unquantized"):
        check_not_quantized(get_peft_model(model, _lora()))  # QLoRA: found through the PeftModel
    packed = tiny_qwen2_model(default_tokenizer())
    packed.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(
        torch.zeros(4, 4, dtype=torch.uint8), requires_grad=False
    )  # packed 4-bit storage, as bitsandbytes keeps it
    with pytest.raises(NotImplementedError, match="torch.uint8"):
        check_not_quantized(packed)
