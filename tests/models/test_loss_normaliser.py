"""Families whose causal-LM class transformers' Trainer does not recognise as a causal LM (``GPT2LMHeadModel``,
``CTRLLMHeadModel``, ``BertGenerationDecoder``: their ``loss_type`` is None) get a loss normaliser that counts every
label, the first of each document included, though nothing predicts it (transformers 5.25's
``Trainer._get_num_items_in_batch`` shifts the count only for ``ForCausalLM`` losses). TRL's SFTTrainer divides by
that count, so its loss and gradients are (n - 1) / n of the model's own token mean on documents of n tokens; odc_hf
divides by the tokens that are predicted, and equals the model's definition. docs/models.md says so; when
transformers changes the count this test says the page is stale."""

from __future__ import annotations

import pytest
import torch
import zoo_runs

from odc_hf.testing.data import default_tokenizer


def _gpt2(tokenizer):
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, **zoo_runs.token_ids(tokenizer))  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def test_trls_loss_on_an_lm_head_model_is_n_minus_1_over_n_of_its_own_and_odc_hf_is_its_own(tmp_path):
    from trl import SFTTrainer

    from odc_hf import ODCConfig, ODCSFTTrainer

    tokenizer = default_tokenizer()
    data = zoo_runs.dataset(tokenizer)
    documents = data["input_ids"][: zoo_runs.MINIBATCH]  # step 1's documents (sequential order)
    n = {len(d) for d in documents}
    assert len(n) == 1  # one length: the normaliser's error is one factor
    (n,) = n
    model = _gpt2(tokenizer)
    assert model.loss_type is None  # what transformers' Trainer reads: no ForCausalLM loss, no shifted count
    with torch.no_grad():
        own = sum(model(input_ids=torch.tensor([d]), labels=torch.tensor([d])).loss.item() * (n - 1)
                  for d in documents) / (len(documents) * (n - 1))  # fmt: skip
    logged = {}
    odc = type("ZooODCSFTTrainer", (ODCSFTTrainer,), {"odc_sampler_class": zoo_runs.forced_sampler(1)})  # TRL's order
    for name, cls, extra in (("trl", SFTTrainer, {}),
                             ("odc", odc, {"odc_config": ODCConfig(max_tokens_per_microbatch=zoo_runs.CPU.budget)})):  # fmt: skip
        trainer = cls(model=_gpt2(tokenizer), args=zoo_runs.sft_args(tmp_path / name, max_steps=1), train_dataset=data,
                      processing_class=tokenizer, **extra)  # fmt: skip
        trainer.train()
        logged[name] = zoo_runs.history(trainer)[0]["loss"]
    print(f"model's own {own:.6f}, odc_hf {logged['odc']:.6f}, TRL {logged['trl']:.6f} (x {(n - 1) / n:.5f})")
    assert logged["odc"] == pytest.approx(own, rel=1e-6)
    assert logged["trl"] == pytest.approx(own * (n - 1) / n, rel=1e-6)
