"""The trainer's parameters under vLLM's names, LoRA merged (``odc_hf.integrations.vllm.weights``): the names TRL's own
weight sync gives vLLM, and peft's own merge, on single-process models (no vLLM, no ranks)."""

from __future__ import annotations

import copy

import pytest
import torch

from odc_hf.integrations.vllm.weights import LoraMerge, vllm_name, vllm_weights


def _model(tie: bool = True):
    from transformers import Qwen2ForCausalLM

    from odc_hf.testing.data import tiny_qwen2_config

    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_qwen2_config(64, num_layers=1, tie_word_embeddings=tie))


def _peft(model, **config):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"],
                           "lora_dropout": 0.0, "init_lora_weights": False, **config})  # fmt: skip
    torch.manual_seed(1)  # B random: peft's default B = 0 would make every merge the base weight
    return get_peft_model(model, config), config


def _trl_name(name: str) -> str | None:
    """TRL 1.16's own naming (VLLMGeneration._iter_fsdp2_params), through its _fix_param_name_to_vllm; None: skipped."""
    from trl.generation.vllm_generation import VLLMGeneration

    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    if "lora_" in name or "original_module" in name:
        return None
    return VLLMGeneration._fix_param_name_to_vllm(None, name, extra_prefixes=["modules_to_save.default."])


def _expected(merged_model) -> dict:
    """``merge_and_unload()``'s parameters, each once (``named_parameters()``: the tied head under the embedding)."""
    return {name: param.detach() for name, param in merged_model.named_parameters()}


def test_names_are_trls_for_a_peft_model_with_modules_to_save():
    model, _ = _peft(_model(tie=False), modules_to_save=["lm_head"])
    names = [n for n, _ in model.named_parameters()]
    assert any("original_module" in n for n in names) and any("modules_to_save" in n for n in names)
    ours = {n: vllm_name(n) for n in names if "lora_" not in n}
    assert ours == {n: _trl_name(n) for n in ours}
    assert (
        vllm_name("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight")
        == "model.layers.0.mlp.up_proj.weight"
    )
    plain = _model()
    assert [vllm_name(n) for n, _ in plain.named_parameters()] == [n for n, _ in plain.named_parameters()]


@pytest.mark.parametrize("variant", ["plain", "rslora", "rank_pattern", "modules_to_save"])
def test_lora_merge_equals_peft_merge_and_unload(variant):
    config = {"plain": {}, "rslora": {"use_rslora": True}, "rank_pattern": {"rank_pattern": {"v_proj": 2}},
              "modules_to_save": {"modules_to_save": ["lm_head"]}}[variant]  # fmt: skip
    model, lora_config = _peft(_model(tie=variant != "modules_to_save"), **config)
    expected = _expected(copy.deepcopy(model).merge_and_unload())
    got = dict(
        vllm_weights(
            ((n, p.detach()) for n, p in model.named_parameters()), LoraMerge.from_config(lora_config)
        )
    )
    assert set(got) == set(expected)
    for (
        name,
        value,
    ) in got.items():  # peft's arithmetic (W + (B @ A) * scaling) on the same operands: bit-equal
        assert torch.equal(value, expected[name]), name
    changed = [n for n in got if not torch.equal(got[n], dict(_model().named_parameters()).get(n, got[n]))]
    assert any("q_proj" in n for n in changed), "the merge changed nothing: B was zero?"


def test_fan_in_fan_out_transposes_the_delta():
    weight, a, b = (
        torch.randn(6, 5),
        torch.randn(2, 6),
        torch.randn(5, 2),
    )  # Conv1D layout: weight is (in, out)
    merged = LoraMerge(lora_alpha=4.0, fan_in_fan_out=True).merge(weight, a, b)
    torch.testing.assert_close(merged, weight + (b @ a).T * 2.0)


def test_other_adapters_are_left_out_and_the_merge_keeps_the_weight_dtype():
    model, config = _peft(_model())
    model.add_adapter("other", copy.deepcopy(config))
    named = [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()]
    got = dict(vllm_weights(named, LoraMerge.from_config(config, adapter="default")))
    assert not any("lora_" in n or "other" in n for n in got)
    assert all(t.dtype == torch.bfloat16 for t in got.values())


def test_what_the_merge_cannot_do_is_refused():
    from peft import AdaLoraConfig, LoraConfig

    for bad, match in ((LoraConfig(use_dora=True), "use_dora"), (LoraConfig(alpha_pattern={"q_proj": 4}), "alpha_pattern"),
                       (LoraConfig(lora_bias=True), "lora_bias"), (AdaLoraConfig(total_step=10), "LoRA adapters only")):  # fmt: skip
        with pytest.raises(NotImplementedError, match=match):
            LoraMerge.from_config(bad)
    model, config = _peft(_model())
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    with pytest.raises(ValueError, match="no LoraMerge"):
        list(vllm_weights(named))
    with pytest.raises(NotImplementedError, match="does not know"):
        list(vllm_weights([("model.embed_tokens.lora_embedding_A.default", torch.zeros(2, 3))], LoraMerge()))
    lone = [(n, t) for n, t in named if not n.endswith("q_proj.lora_B.default.weight")]
    with pytest.raises(ValueError, match="without the rest of the layer"):
        list(vllm_weights(lone, LoraMerge.from_config(config)))
