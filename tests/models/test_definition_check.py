"""The behavioural check that packed rows train the model in hand as it is defined (odc_hf.integrations.models.definition_check)
and the runtime guard of the attention path: each failure class caught, each with its control.

Failure classes (tiny configs of families in transformers, fp32, CPU):
- a decoder layer that does not pass its keyword arguments on (Nemotron, StableLM, Falcon): the document boundaries
  never reach the attention, so the row's documents attend to each other;
- a sliding window that lives only in the model's mask (Phi-MoE): the attention is never handed it;
- an attention that drops the soft-cap (Gemma 2 through an attention that ignores ``softcap``, as transformers 5.17's
  SDPA does): invisible at the model's own cap on a small copy, caught at the probe's cap;
- a family whose code cannot run a packed row at all (Falcon with ALiBi: it needs a padding mask);
- a router loss TRL computes from names the family's config does not have (GraniteMoE, JetMoE).
Controls: Llama (plain), Qwen2-MoE with a sliding layer (a window kept as a layer attribute, applied by odc_hf), the
check's own row with its boundaries removed (the check must see documents attending to each other).
"""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers as t
from packaging.version import Version
from transformers.masking_utils import AttentionMaskInterface, eager_mask

import odc_hf.attention.varlen
from odc_hf.integrations.compute.cost_model import flop_cost_model
from odc_hf.integrations.models import definition_check as dc

# What transformers' own code does with a packed row changed between the releases odc_hf supports (measured on 5.17 to
# 5.25, tests/README.md): the check measures it, and these tests expect what each release does.
TRANSFORMERS = Version(t.__version__)
FALCON_TAKES_AN_ATTENTION = TRANSFORMERS >= Version("5.25")  # before, Falcon ignores set_attn_implementation
FALCON_MASKS_KEEP_DOCUMENTS_APART = TRANSFORMERS >= Version("5.24")  # its own masks over a packed row
CHUNKED_MASKS_KEEP_DOCUMENTS_APART = TRANSFORMERS >= Version("5.23")  # Llama 4's chunked masks over a packed row
LLAMA4_UNCHUNKED_LAYERS_ARE_FULL = TRANSFORMERS >= Version("5.24")  # before: "chunked_attention" with no chunk size
GEMMA2_RUNS_SDPA = TRANSFORMERS < Version("5.21")  # and its SDPA drops the soft-cap; from 5.21 Gemma 2 refuses SDPA

SIZE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)  # fmt: skip
WINDOW = 8


def tiny(build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build().float()


def llama():
    return tiny(lambda: t.LlamaForCausalLM(t.LlamaConfig(**SIZE)))


def nemotron():
    return tiny(lambda: t.NemotronForCausalLM(t.NemotronConfig(**SIZE)))


def phimoe(window=WINDOW):
    return tiny(lambda: t.PhimoeForCausalLM(t.PhimoeConfig(**SIZE, num_local_experts=4, num_experts_per_tok=2,
                                                           sliding_window=window)))  # fmt: skip


def qwen2_moe_window():
    return tiny(lambda: t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(
        **SIZE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
        layer_types=["sliding_attention", "full_attention"])))  # fmt: skip


@pytest.fixture(autouse=True)
def fresh_verdicts():
    dc._verdicts.clear(), dc._fused_verdicts.clear()
    yield
    dc._verdicts.clear(), dc._fused_verdicts.clear()


def test_a_plain_family_passes_and_the_check_sees_documents_attending_to_each_other():
    verdict = dc.verify_definition(llama(), "sdpa_varlen")
    assert verdict.exact and verdict.difference < 1e-5, verdict
    # the control: the same row with its boundaries removed is far from the documents alone
    assert verdict.control > dc.SENSITIVITY * dc.THRESHOLD, verdict
    print(f"llama: {verdict.difference:.1e}, control {verdict.control:.1e}, {verdict.seconds:.2f} s")


@pytest.mark.parametrize("family,build", [
    ("nemotron", lambda: nemotron()),
    ("stablelm", lambda: tiny(lambda: t.StableLmForCausalLM(t.StableLmConfig(**SIZE)))),
    ("falcon", lambda: tiny(lambda: t.FalconForCausalLM(t.FalconConfig(
        **{k: v for k, v in SIZE.items() if k not in ("intermediate_size", "num_key_value_heads")},
        new_decoder_architecture=True, num_kv_heads=2)))),
])  # fmt: skip
def test_a_layer_that_drops_the_boundaries_is_refused_by_name_with_a_setting_that_works(family, build):
    model = build()
    with pytest.raises(dc.DefinitionMismatch, match="documents of the packed row attend to each other") as refused:
        dc.verify_definition(model, "sdpa_varlen")
    message = str(refused.value)
    assert family in message and "self_attn" in message or "self_attention" in message, message
    if family == "falcon" and not FALCON_MASKS_KEEP_DOCUMENTS_APART:
        # no setting of odc_hf works: transformers' own masks mix Falcon's packed documents too, and the check says so
        assert "What works: TRL's own trainer" in message, message
        assert not dc.check_definition(model, "sdpa").exact
        return
    assert "attention='model'" in message and "attn_implementation='sdpa'" in message, message
    # the setting it names passes the same check: transformers' own masks over packed rows
    assert dc.check_definition(model, "sdpa").exact


@pytest.mark.parametrize("family,build", [
    ("bloom", lambda: tiny(lambda: t.BloomForCausalLM(t.BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4)))),
    ("rwkv", lambda: tiny(lambda: t.RwkvForCausalLM(t.RwkvConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                                                 attention_hidden_size=32, intermediate_size=64)))),
])  # fmt: skip
def test_a_family_that_never_calls_odc_hfs_attention_is_refused_for_that_not_for_dropped_boundaries(family, build):
    # Bloom computes ALiBi attention itself, RWKV is recurrent: neither reaches transformers' attention interface, so
    # no boundary can help; the words must not send the user looking for a decoder layer that drops its kwargs
    with pytest.raises(dc.DefinitionMismatch, match="never calls the attention odc_hf trains with") as refused:
        dc.verify_definition(build(), "sdpa_varlen")
    assert family in str(refused.value) and "keyword arguments" not in str(refused.value)
    # its contrast: Nemotron does call odc_hf's attention (without the boundaries) and is told so
    with pytest.raises(dc.DefinitionMismatch, match="do not reach the attention .*keyword arguments"):
        dc.verify_definition(nemotron(), "sdpa_varlen")


def test_a_window_that_lives_only_in_the_mask_is_refused_and_its_control_passes():
    with pytest.raises(dc.DefinitionMismatch, match="sliding window is not applied") as refused:
        dc.verify_definition(phimoe(), "sdpa_varlen")
    assert "phimoe" in str(refused.value) and "PhimoeAttention" in str(refused.value)
    assert dc.verify_definition(phimoe(window=None), "sdpa_varlen").exact  # the same family without a window


def test_a_window_kept_as_a_layer_attribute_is_applied_per_document():
    model = qwen2_moe_window()
    verdict = dc.verify_definition(model, "sdpa_varlen")
    assert verdict.exact, verdict
    # broken twin: the same model with the layers' windows gone is no longer the model's definition
    for module in model.modules():
        if hasattr(module, "sliding_window"):
            module.sliding_window = None
    ids = torch.randint(3, 100, (1, 3 * WINDOW + 5))
    bounds = [(0, 2 * WINDOW), (2 * WINDOW, 3 * WINDOW + 5)]
    model.set_attn_implementation("sdpa_varlen")
    packed = dc._logits(model, **dc._packed_inputs(ids, bounds))
    reference = qwen2_moe_window()
    alone = torch.cat([dc._logits(reference, input_ids=ids[:, a:b]) for a, b in bounds], dim=1)
    assert dc._relative(packed, alone) > 100 * dc.THRESHOLD


def test_a_family_that_cannot_run_a_packed_row_is_refused_clearly():
    model = tiny(lambda: t.FalconForCausalLM(t.FalconConfig(
        **{k: v for k, v in SIZE.items() if k not in ("intermediate_size", "num_key_value_heads")}, alibi=True)))
    # a Falcon that does not take odc_hf's attention runs its own, which the check sees mixing the documents
    words = "falcon \\(FalconForCausalLM\\) cannot run a packed row" if FALCON_TAKES_AN_ATTENTION else (
        "falcon differently from its definition .* documents of the packed row attend to each other")  # fmt: skip
    with pytest.raises(dc.DefinitionMismatch, match=words):
        dc.verify_definition(model, "sdpa_varlen")


def test_a_blind_check_is_refused():
    verdict = dc.Verdict("x", "sdpa_varlen", difference=0.0, control=1e-6, seconds=0.0)
    dc._verdicts[("blind",)] = verdict
    original = dc.check_definition
    try:
        dc.check_definition = lambda *a, **k: verdict
        with pytest.raises(dc.DefinitionMismatch, match="cannot verify"):
            dc.verify_definition(llama(), "sdpa_varlen")
    finally:
        dc.check_definition = original


def test_the_check_runs_once_per_model_and_attention():
    model = llama()
    first = dc.check_definition(model, "sdpa_varlen")
    assert dc.check_definition(model, "sdpa_varlen") is first
    assert dc.LAST_COST["family"] == "llama" and dc.LAST_COST["on"] == "a small copy"


def gemma2(cap=50.0, tied=True):
    return tiny(lambda: t.Gemma2ForCausalLM(t.Gemma2Config(**SIZE, head_dim=8, sliding_window=WINDOW,
                                                           attn_logit_softcapping=cap, tie_word_embeddings=tied)))  # fmt: skip


def _attention_without_softcap(module, query, key, value, attention_mask, **kwargs):
    kwargs.pop("softcap", None)  # the fault: the family's cap is handed over and applied nowhere
    return gemma2_modeling.eager_attention_forward(module, query, key, value, attention_mask, **kwargs)


DROPS_SOFTCAP = "odc_hf_test_drops_softcap"
gemma2_modeling = importlib.import_module("transformers.models.gemma2.modeling_gemma2")
t.AttentionInterface.register(DROPS_SOFTCAP, _attention_without_softcap)
AttentionMaskInterface.register(DROPS_SOFTCAP, eager_mask)


def test_an_attention_that_drops_the_soft_cap_is_refused_naming_the_soft_cap(monkeypatch):
    with pytest.raises(dc.DefinitionMismatch, match=r"soft-capping \(attn_logit_softcapping\) is applied by only one of") as refused:
        dc.verify_definition(gemma2(), DROPS_SOFTCAP, sdpa=False)
    assert "gemma2" in str(refused.value) and "attn_implementation='eager'" in str(refused.value), refused.value
    # controls: the attention odc_hf trains Gemma 2 with applies the cap; a family without a cap is not refused
    assert dc.verify_definition(gemma2(), "eager_varlen", sdpa=False).exact
    assert dc.verify_definition(gemma2(cap=None), DROPS_SOFTCAP, sdpa=False).exact
    # broken twin of the check: at the model's own cap (no shrinking) the small copy cannot see the dropped cap
    dc._verdicts.clear()
    monkeypatch.setattr(dc, "PROBE_SOFTCAP", 50.0)
    blind = dc.check_definition(gemma2(), DROPS_SOFTCAP, sdpa=False)
    assert blind.exact and blind.difference < dc.THRESHOLD / 10, blind


def _attention_without_softcap_or_window(module, query, key, value, attention_mask, **kwargs):
    kwargs.pop("softcap", None), kwargs.pop("sliding_window", None)  # the faults: both handed over, neither applied
    # each document causal on its own (from the boundaries, as a varlen attention keeps them), with no window
    bounds = kwargs.get("cu_seq_lens_q")
    document = torch.zeros(query.shape[2], dtype=torch.long)
    if bounds is not None:
        document = torch.bucketize(torch.arange(query.shape[2]), bounds[1:].long(), right=True)
    allowed = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool).tril() & (document[:, None] == document[None])
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]
    return gemma2_modeling.eager_attention_forward(module, query, key, value, mask, **kwargs)


DROPS_BOTH = "odc_hf_test_drops_softcap_and_window"
t.AttentionInterface.register(DROPS_BOTH, _attention_without_softcap_or_window)
AttentionMaskInterface.register(DROPS_BOTH, eager_mask)


def test_an_attention_that_drops_the_soft_cap_and_the_window_is_refused_naming_both():
    with pytest.raises(dc.DefinitionMismatch, match=r"soft-capping \(attn_logit_softcapping\) and its sliding window "
                                                    r"are both applied by only one of") as refused:  # fmt: skip
        dc.verify_definition(gemma2(), DROPS_BOTH, sdpa=False)
    assert "gemma2" in str(refused.value)
    # the single faults keep their own words (each removal alone passes there)
    with pytest.raises(dc.DefinitionMismatch, match="soft-capping .* is applied by only one of .*the same check without"):
        dc.verify_definition(gemma2(), DROPS_SOFTCAP, sdpa=False)


def _attention_without_sinks(module, query, key, value, attention_mask, **kwargs):
    kwargs.pop("s_aux", None)  # the fault: the family's sinks are handed over and applied nowhere
    sinks = module.sinks
    module.sinks = torch.nn.Parameter(torch.full_like(sinks, -1e4))  # exp(-1e4) = 0: no sink
    try:
        return gpt_oss_modeling.eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
    finally:
        module.sinks = sinks


DROPS_SINKS = "odc_hf_test_drops_sinks"
gpt_oss_modeling = importlib.import_module("transformers.models.gpt_oss.modeling_gpt_oss")
t.AttentionInterface.register(DROPS_SINKS, _attention_without_sinks)
AttentionMaskInterface.register(DROPS_SINKS, eager_mask)


def test_an_attention_that_drops_the_sinks_is_refused_without_blaming_the_window():
    model = tiny(lambda: t.GptOssForCausalLM(t.GptOssConfig(**SIZE, head_dim=8, sliding_window=WINDOW,
                                                            num_local_experts=4, num_experts_per_tok=2)))  # fmt: skip
    with pytest.raises(dc.DefinitionMismatch, match="also with the model's windows taken away") as refused:
        dc.verify_definition(model, DROPS_SINKS, sdpa=False)
    assert "gpt_oss" in str(refused.value) and "sliding window is not applied" not in str(refused.value)
    assert dc.verify_definition(model, "eager_varlen", sdpa=False).exact  # control: odc_hf's attention applies them


def test_the_check_itself_sees_transformers_sdpa_drop_gemma2s_soft_cap():
    # with SDPA as the model's own attention (what transformers 5.17-5.20 load Gemma 2 with), the reference drops the
    # cap and odc_hf's attention applies it: the check says so; from 5.21 transformers refuses SDPA for Gemma 2
    words = (r"soft-capping \(attn_logit_softcapping\) is applied by only one of 'eager_varlen' and the model's own "
             r"'sdpa'") if GEMMA2_RUNS_SDPA else "does not support an attention implementation through"  # fmt: skip
    with pytest.raises(dc.DefinitionMismatch, match=words):
        dc.verify_definition(gemma2(), "eager_varlen", sdpa=True)


@pytest.mark.parametrize("tied", [True, False], ids=["tied_head", "untied_head"])
def test_a_fused_head_that_drops_the_final_soft_cap_is_refused(monkeypatch, tied):
    import trl.trainer.utils

    assert dc.fused_head_problem(gemma2(tied=tied)) is None  # control: TRL's head applies Gemma 2's final soft-cap
    add = trl.trainer.utils.add_fused_lm_head

    def add_without_the_cap(model, *args, **kwargs):  # the fault: a head built as if the family had no final cap
        cap, model.config.final_logit_softcapping = model.config.final_logit_softcapping, None
        try:
            return add(model, *args, **kwargs)
        finally:
            model.config.final_logit_softcapping = cap

    monkeypatch.setattr(trl.trainer.utils, "add_fused_lm_head", add_without_the_cap)
    dc._fused_verdicts.clear()
    with pytest.raises(dc.DefinitionMismatch, match="TRL's fused LM head's loss differs from gemma2's own by"):
        dc.verify_fused_head(gemma2(tied=tied))
    # broken twin of the check: at the model's own final cap (30) the small copy cannot see the dropped cap
    dc._fused_verdicts.clear()
    monkeypatch.setattr(dc, "PROBE_FINAL_SOFTCAP", 30.0)
    assert dc.fused_head_problem(gemma2(tied=tied)) is None


def test_without_a_small_copy_the_check_runs_on_the_model_itself_and_puts_it_back(monkeypatch):
    def no_small_copy(cls, config):
        raise ValueError("its small copy would have 200M parameters")

    monkeypatch.setattr(dc, "_build_probe", no_small_copy)
    model = llama().train()
    model.set_attn_implementation("eager")
    verdict = dc.verify_definition(model, "sdpa_varlen")
    assert verdict.exact and verdict.control > dc.SENSITIVITY * dc.THRESHOLD, verdict
    assert dc.LAST_COST["on"] == "the model itself"
    assert model.training and model.config._attn_implementation == "eager"  # put back as it was
    with pytest.raises(dc.DefinitionMismatch, match="nemotron .*documents of the packed row attend to each other"):
        dc.verify_definition(nemotron(), "sdpa_varlen")
    with pytest.raises(dc.DefinitionMismatch, match=r"sliding windows, likely not applied inside each document \(checked on the model itself"):
        dc.verify_definition(phimoe(), "sdpa_varlen")
    # and with no small copy and no model, a clear refusal (not the verdict cached for the same config above)
    dc._verdicts.clear()
    with pytest.raises(dc.DefinitionMismatch, match="could not build a small copy of llama .*200M parameters"):
        dc.check_class(t.LlamaForCausalLM, t.LlamaConfig(**SIZE), "sdpa_varlen")


def test_the_probe_keeps_layers_and_switches_and_shrinks_widths_and_windows():
    config = t.Gemma3TextConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=6, num_attention_heads=8,
                                num_key_value_heads=4, head_dim=256, sliding_window=512, vocab_size=1000)  # fmt: skip
    probe = dc.probe_config(config)
    assert (probe.hidden_size, probe.num_attention_heads, probe.num_key_value_heads, probe.head_dim) == (32, 4, 2, 8)
    assert probe.sliding_window == dc.PROBE_WINDOW < min(dc.PROBE_DOCUMENTS)
    assert probe.num_hidden_layers == 6 and probe.layer_types == config.layer_types
    assert probe.attn_logit_softcapping is None  # no cap: none added
    capped = dc.probe_config(t.Gemma2Config(attn_logit_softcapping=50.0, final_logit_softcapping=30.0))
    assert capped.attn_logit_softcapping == dc.PROBE_SOFTCAP and capped.final_logit_softcapping == 30.0
    capped.use_attn_softcapping = True  # a switch, not a cap: kept
    assert dc.probe_config(capped).use_attn_softcapping is True
    assert config.hidden_size == 2048  # the model's own config is untouched


@pytest.mark.parametrize("cls,config,share", [
    (t.GPTJForCausalLM, t.GPTJConfig(n_embd=4096, n_head=16, rotary_dim=64, n_layer=2, vocab_size=128), 2),  # 6B: 1/4
    (t.CodeGenForCausalLM, t.CodeGenConfig(n_embd=1024, n_head=16, rotary_dim=32, n_layer=2, vocab_size=128), 4),
    (t.GPTJForCausalLM, t.GPTJConfig(n_embd=256, n_head=4, rotary_dim=64, n_layer=2, vocab_size=128), 8),  # all of it
])  # fmt: skip
def test_rotary_on_part_of_each_head_keeps_its_share_in_the_small_copy(cls, config, share):
    # the mutation: rotary_dim left at the model's (64) is wider than the probe's heads (8); the small copy then cannot
    # run and the check falls back to the model itself (a 6B forward for GPT-J)
    assert dc.probe_config(config).rotary_dim == share and dc.HEAD_DIM == 8
    verdict = dc.check_class(cls, config, "sdpa_varlen")
    if not hasattr(importlib.import_module(cls.__module__), "ALL_ATTENTION_FUNCTIONS"):
        # releases (5.17) whose GPT-J/CodeGen compute an attention of their own (not transformers' interface): odc_hf's
        # attention is never called and transformers' masks keep the documents apart even with the boundaries
        # removed, so the check cannot see cross-document attention and the run is refused as unverifiable
        assert verdict.exact and verdict.control < dc.SENSITIVITY * dc.THRESHOLD, verdict
        assert dc.LAST_COST["on"] == "a small copy"
        return
    assert verdict.exact and verdict.control > dc.SENSITIVITY * dc.THRESHOLD, verdict
    assert dc.LAST_COST["on"] == "a small copy"


def test_encoder_decoder_head_counts_are_shrunk_with_the_width():
    probe = dc.probe_config(t.WhisperConfig(encoder_attention_heads=6, decoder_attention_heads=6, d_model=384))
    assert (probe.d_model, probe.encoder_attention_heads, probe.decoder_attention_heads) == (32, 4, 4)


# -- the runtime guard ------------------------------------------------------------------------------------------------
def packed_forward(model, lengths=(9, 7)):
    bounds = dc._document_bounds(lengths)
    ids = torch.randint(3, 100, (1, bounds[-1][1]))
    return dc._logits(model, **dc._packed_inputs(ids, bounds))


def test_a_packed_row_whose_attention_gets_no_boundaries_is_an_error():
    model = nemotron()
    model.set_attn_implementation("sdpa_varlen")
    packed_forward(model)  # unguarded: one long document, silently
    handles = odc_hf.attention.guard_boundaries(model)
    with pytest.raises(odc_hf.attention.PackedRowWithoutBoundaries, match="NemotronAttention"):
        packed_forward(model)
    for handle in handles:
        handle.remove()


def test_the_guard_lets_boundaries_through_and_leaves_other_forwards_alone():
    model = llama()
    model.set_attn_implementation("sdpa_varlen")
    odc_hf.attention.guard_boundaries(model)
    packed_forward(model)  # boundaries reach every layer
    model(input_ids=torch.randint(3, 100, (2, 6)))  # a batch of whole documents
    assert odc_hf.attention.varlen._in_flight[0] == 0


# -- router losses ----------------------------------------------------------------------------------------------------
MOE = dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.05)


@pytest.mark.parametrize("family,build", [
    ("GraniteMoe", lambda: t.GraniteMoeForCausalLM(t.GraniteMoeConfig(**SIZE, **MOE))),
    ("Phimoe", lambda: t.PhimoeForCausalLM(t.PhimoeConfig(**SIZE, **MOE))),
    ("JetMoe", lambda: t.JetMoeForCausalLM(t.JetMoeConfig(
        **{k: v for k, v in SIZE.items() if k not in ("num_attention_heads", "intermediate_size")}, kv_channels=8,
        **MOE))),
])  # fmt: skip
def test_a_router_loss_trl_cannot_compute_for_the_family_is_refused_by_name(family, build):
    model = tiny(build)
    with pytest.raises(dc.DefinitionMismatch, match=rf"config.num_experts, which {family}Config \("):
        dc.verify_router_loss(model)


def test_a_router_loss_trl_computes_as_the_family_defines_it_passes():
    model = tiny(lambda: t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(**SIZE, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                                moe_intermediate_size=32, router_aux_loss_coef=0.05)))  # fmt: skip
    assert dc.router_loss_problem(model) is None


# -- the default cost model, any family -------------------------------------------------------------------------------
def test_the_flop_cost_model_is_read_off_the_modules_for_any_family():
    from odc_hf.balance import FlopCostModel

    config = t.Qwen2Config(**SIZE)
    assert flop_cost_model(t.Qwen2ForCausalLM(config)) == FlopCostModel.from_config(config)
    gpt2 = t.GPT2LMHeadModel(t.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4))  # Conv1D, no intermediate_size
    cost = flop_cost_model(gpt2)
    assert cost.num_layers == 2 and cost.attn_dim == 32
    assert cost.num_matmul_params == 2 * (32 * 96 + 32 * 32 + 2 * 32 * 128) + 128 * 32
    falcon = t.FalconForCausalLM(t.FalconConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4))
    assert flop_cost_model(falcon).num_layers == 2


# -- the loss: TRL's fused LM head against the model's own --------------------------------------------------------------
def llama4_text():
    return tiny(lambda: t.Llama4ForCausalLM(t.Llama4TextConfig(**SIZE, intermediate_size_mlp=64, head_dim=8,
                                                               num_local_experts=2, attention_chunk_size=WINDOW)))  # fmt: skip


def test_trls_fused_head_is_checked_against_the_models_own_loss():
    assert dc.fused_head_problem(llama()) is None
    problem = dc.fused_head_problem(llama4_text())  # TRL's head reads last_hidden_state, Llama 4 text returns none
    assert problem is not None and "llama4_text" in problem, problem
    with pytest.raises(dc.DefinitionMismatch, match="What works: ODCTrainer"):
        dc.verify_fused_head(llama4_text())


def test_chunked_attention_through_transformers_masks_passes_the_static_refusals_and_the_check():
    from odc_hf.integrations.models.family import check_packable

    model = llama4_text()
    with pytest.raises(ValueError, match="chunked attention"):
        check_packable(model)  # odc_hf's own attention does not apply the chunks
    check_packable(model, masked=True)  # the refusal's advice: transformers' masks (chunked layers are attention)
    # chunked layers with no chunk size in the config (Llama 4 text on transformers < 5.24): the same refusal and
    # advice, not "not attention layers" (the old words, the mutation this catches)
    model.config.attention_chunk_size, model.config.layer_types = None, ["chunked_attention"] * 2
    with pytest.raises(ValueError, match=r"llama4_text uses chunked attention \(layers of type 'chunked_attention'\)"
                       r".*attention='model'"):  # fmt: skip
        check_packable(model)
    check_packable(model, masked=True)
    model = llama4_text()
    if CHUNKED_MASKS_KEEP_DOCUMENTS_APART:
        assert dc.check_definition(model, "sdpa").exact
    else:  # transformers' chunked masks mix a packed row's documents: the check refuses the advice's setting too
        with pytest.raises(dc.DefinitionMismatch, match="odc_hf would train llama4_text differently"):
            dc.verify_definition(model, "sdpa")


# -- in the trainers ---------------------------------------------------------------------------------------------------
def test_the_sft_trainer_refuses_a_family_whose_layers_drop_the_boundaries_before_training(tmp_path, monkeypatch):
    import zoo_runs
    from datasets import Dataset

    from odc_hf import ODCSFTTrainer
    from odc_hf.testing.data import default_tokenizer

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    tokenizer = default_tokenizer()
    model = tiny(lambda: t.NemotronForCausalLM(t.NemotronConfig(**dict(SIZE, vocab_size=len(tokenizer),
                                                                          pad_token_id=tokenizer.pad_token_id))))  # fmt: skip
    with pytest.raises(dc.DefinitionMismatch, match=r"nemotron .* documents of the packed row attend to each other"):
        ODCSFTTrainer(model=model, args=zoo_runs.sft_args(tmp_path), processing_class=tokenizer,
                      train_dataset=Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 8}))  # fmt: skip


@pytest.mark.skipif(not CHUNKED_MASKS_KEEP_DOCUMENTS_APART, reason="transformers < 5.23 mixes a packed row's "
                    "documents in Llama 4's chunked masks: the family is refused before training (the test above)")
def test_odc_trainer_keeps_the_models_own_loss_where_trls_fused_head_does_not_give_it(tmp_path, monkeypatch):
    import zoo_runs

    from odc_hf import ODCConfig, ODCTrainer
    from odc_hf.integrations.compute.fused_head import FULL_LOGITS
    from odc_hf.testing.data import default_tokenizer

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    tokenizer = default_tokenizer()
    model = tiny(lambda: t.Llama4ForCausalLM(t.Llama4TextConfig(**dict(SIZE, vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id), intermediate_size_mlp=64, head_dim=8, num_local_experts=2,
        attention_chunk_size=WINDOW)))  # fmt: skip
    model.set_attn_implementation("sdpa")
    trainer = ODCTrainer(model=model, args=zoo_runs.plain_args(tmp_path), train_dataset=zoo_runs.dataset(tokenizer),
                         processing_class=tokenizer,
                         odc_config=ODCConfig(attention="model", max_tokens_per_microbatch=zoo_runs.CPU.budget))  # fmt: skip
    assert trainer.odc_compute.loss == FULL_LOGITS
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == zoo_runs.STEPS and all(loss > 0 for loss in losses), losses


def test_the_grpo_trainer_refuses_a_family_trls_fused_head_cannot_score(tmp_path, monkeypatch):
    from datasets import Dataset
    from trl import GRPOConfig

    from odc_hf import ODCGRPOTrainer
    from odc_hf.testing.data import default_tokenizer

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    tokenizer = default_tokenizer()
    model = tiny(lambda: t.Llama4ForCausalLM(t.Llama4TextConfig(**dict(SIZE, vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id), intermediate_size_mlp=64, head_dim=8, num_local_experts=2,
        attention_chunk_size=None)))  # fmt: skip
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_steps=1,
                      use_cpu=True, report_to="none", router_aux_loss_coef=0.0)  # fmt: skip
    words = "TRL's fused LM head fails on llama4_text" if LLAMA4_UNCHUNKED_LAYERS_ARE_FULL else (
        "llama4_text uses chunked attention \\(layers of type 'chunked_attention'\\)")  # refused earlier, by name
    with pytest.raises(dc.DefinitionMismatch if LLAMA4_UNCHUNKED_LAYERS_ARE_FULL else ValueError, match=words):
        ODCGRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                       train_dataset=Dataset.from_dict({"prompt": ["a b c"] * 8}), processing_class=tokenizer)  # fmt: skip
