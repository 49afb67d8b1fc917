"""The CPU stand-in for vLLM's engine (odc_hf/testing/vllm_fake.py) and the checks the vLLM tests apply to an engine's weights
(tests/support/vllm_runs.py ``compare``, ``vllm_layout``), each against an independent reference: the stand-in's own forward
against transformers' forward of the same weights; its stacked layout against vLLM's Qwen2 parameter names written out
here and a hand-stacked copy; the checks against an engine with a projection part left out, a longer parameter and a
padded vocabulary."""

from __future__ import annotations

import pytest
import torch
from vllm_runs import compare, vllm_layout

from odc_hf.testing import vllm_fake
from odc_hf.testing.data import TINY_HEAD_DIM_64, default_tokenizer, tiny_qwen2_config, tiny_qwen2_model

# vLLM's Qwen2ForCausalLM parameters at tensor parallel 1, for one decoder layer (vllm/model_executor/models/qwen2.py)
VLLM_LAYER = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.qkv_proj.weight",
              "self_attn.qkv_proj.bias", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight")  # fmt: skip


def _models(**config):
    model = tiny_qwen2_model(default_tokenizer(), seed=0, **config).eval()
    engine = vllm_fake.StackedQwen2(model.config)
    engine.randomize(seed=1)
    return model, engine


def _problems(result: dict) -> dict:
    return {k: result[k] for k in ("unequal", "beyond_ulp", "uncovered", "unfilled", "shapes") if result[k]}


@pytest.mark.parametrize("variant", ["tied_gqa", "untied_head_dim_64"])
def test_the_stand_ins_forward_is_the_models_own(variant):
    config = {} if variant == "tied_gqa" else {**TINY_HEAD_DIM_64, "tie_word_embeddings": False}
    model, engine = _models(**config)
    hf = {n: p.detach() for n, p in model.named_parameters()}
    assert engine.load_weights(hf.items()) == {n for n, _ in engine.named_parameters()}
    ids = torch.randint(1, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0].float()
    # fp32, the same arithmetic in another order (logits up to 1.3): measured 2.7e-7 (tied, 4 heads on 2 KV heads)
    # and 4.8e-7 (head_dim 64, untied); bound 1e-5. A rotary embedding on interleaved pairs, a head mapped to the
    # wrong KV head or the q / k / v slices swapped give > 1e-2.
    torch.testing.assert_close(engine.logits(ids), want, rtol=0, atol=1e-5)


def test_the_stand_in_has_vllms_stacked_layout():
    model, engine = _models()
    layers = model.config.num_hidden_layers
    names = {"model.embed_tokens.weight", "model.norm.weight"} | {  # tied head: no lm_head (it is the embedding)
        f"model.layers.{i}.{n}" for i in range(layers) for n in VLLM_LAYER}
    assert {n for n, _ in engine.named_parameters()} == names
    hf = {n: p.detach() for n, p in model.named_parameters()}
    engine.load_weights(hf.items())
    assert _problems(compare(engine.named_parameters(), vllm_layout(hf))) == {}
    attn = hf["model.layers.1.self_attn.q_proj.weight"].shape[0], hf["model.layers.1.self_attn.k_proj.weight"].shape[0]
    qkv = dict(engine.named_parameters())["model.layers.1.self_attn.qkv_proj.bias"]
    assert torch.equal(qkv[sum(attn):], hf["model.layers.1.self_attn.v_proj.bias"])  # v last, after q and k


def test_a_part_left_out_is_loaded_silently_and_caught_by_the_weight_check():
    """vLLM's ``load_weights`` reports ``qkv_proj`` loaded once any of q, k, v arrived; so does the stand-in. A sync
    that drops a part is therefore invisible to the loader's report (odc_hf's own check of it), and only a comparison
    with the expected weights catches it: stale v rows (the negative control of ``compare``)."""
    model, engine = _models()
    hf = {n: p.detach() for n, p in model.named_parameters()}
    loaded = engine.load_weights((n, t) for n, t in hf.items() if ".v_proj." not in n)
    assert loaded == {n for n, _ in engine.named_parameters()}  # nothing reported missing
    problems = _problems(compare(engine.named_parameters(), vllm_layout(hf)))
    assert sorted(problems["unequal"]) == sorted(f"model.layers.{i}.self_attn.qkv_proj.{k}" for i in range(2)
                                                 for k in ("bias", "weight")), problems  # fmt: skip
    ids = list(range(1, 30))
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0]
    assert (engine.logits(ids) - want).abs().max() > 1e-2


def test_the_check_refuses_a_longer_engine_parameter_and_allows_only_vllms_zero_vocabulary_padding():
    model, engine = _models()
    hf = {n: p.detach() for n, p in model.named_parameters()}
    engine.load_weights(hf.items())
    # expected weights missing a stacked part: the engine's qkv_proj is longer. Cut to the expected length (what the
    # check did before), the q and k rows would compare equal and the missing v would pass unseen.
    short = vllm_layout(hf)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    q_k = hf["model.layers.0.self_attn.q_proj.weight"].shape[0] + hf["model.layers.0.self_attn.k_proj.weight"].shape[0]
    short[name] = short[name][:q_k]
    problems = _problems(compare(engine.named_parameters(), short))
    assert problems["shapes"] == [f"{name}: engine (128, 64) vs expected ({q_k}, 64)"], problems
    assert name in problems["beyond_ulp"]
    with pytest.raises(ValueError, match="no \\['v_proj'\\] to stack"):
        vllm_layout({n: t for n, t in hf.items() if n != "model.layers.0.self_attn.v_proj.weight"})
    # an expected parameter the engine lacks (another layout) is reported, not skipped
    assert _problems(compare(engine.named_parameters(), {**vllm_layout(hf), "lm_head.weight": hf[
        "model.embed_tokens.weight"]}))["unfilled"] == ["lm_head.weight"]  # fmt: skip


def test_vllms_vocabulary_padding_is_allowed_only_as_zero_rows():
    config = tiny_qwen2_config(4000, num_layers=1)  # 4000 rows: vLLM pads them to 4032
    torch.manual_seed(0)
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM(config)
    engine = vllm_fake.StackedQwen2(config)
    engine.randomize(seed=1)
    hf = {n: p.detach() for n, p in model.named_parameters()}
    engine.load_weights(hf.items())
    embed = dict(engine.named_parameters())["model.embed_tokens.weight"]
    assert embed.shape[0] == 4032 and not embed[4000:].any()
    assert _problems(compare(engine.named_parameters(), vllm_layout(hf))) == {}
    embed.data[4010, 3] = 1.0  # a padding row that is not zero: not vLLM's padding
    assert _problems(compare(engine.named_parameters(), vllm_layout(hf)))["shapes"] == [
        "model.embed_tokens.weight: engine (4032, 64) vs expected (4000, 64)"]
