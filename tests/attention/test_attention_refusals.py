"""The attention refusals docs/attention.md and docs/models.md promise, each with the words the user is told: FA2 with
attention sinks, FlashAttention-4's missing variant arguments, bidirectional attention. Each also runs its twin that
must pass (a family without the variant, a kernel that takes it, a causal config)."""

from __future__ import annotations

import pytest
import transformers

from odc_hf.integrations.compute import attention
from odc_hf.integrations.models import family
from odc_hf.integrations.models.family import FamilyNeeds

SIZE = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
ALL_FA4 = frozenset({"q", "k", "v", "window_size", "softcap", "learnable_sink"})


def test_flash_attention_2_with_sinks_is_refused_naming_the_family():
    with pytest.raises(ValueError, match=r"gpt_oss uses attention sinks, which FlashAttention-2 does not apply"):
        attention.check_kernel_variants("flash_attention_2", FamilyNeeds("gpt_oss", sinks=True))
    attention.check_kernel_variants("flash_attention_2", FamilyNeeds("llama"))  # twin: no sinks, no refusal
    attention.check_kernel_variants("sdpa_varlen", FamilyNeeds("gpt_oss", sinks=True))  # applied per document


@pytest.mark.parametrize(("needs", "what"), [(FamilyNeeds("gemma2", window=True, softcap=True), "soft-capping"),
                                             (FamilyNeeds("gpt_oss", sinks=True), "attention sinks")])  # fmt: skip
def test_sdpa_with_soft_capping_or_sinks_is_refused_naming_the_family(needs, what):
    """transformers 5.17 loads Gemma 2 on SDPA by default and drops its soft-capping there; odc_hf does not train a
    model so loaded under ``attention="model"``. Twins: SDPA for a family without either, eager for one with them."""
    with pytest.raises(ValueError, match=rf"^{needs.family} uses {what}, which SDPA does not apply \(the model is "
                       r"loaded with attn_implementation='sdpa'\): use ODCConfig\(attention='auto'\)"):  # fmt: skip
        attention.check_kernel_variants("sdpa", needs)
    attention.check_kernel_variants("sdpa", FamilyNeeds("mistral", window=True))
    attention.check_kernel_variants("eager", needs)
    attention.check_kernel_variants("eager_varlen", needs)


@pytest.mark.parametrize(
    ("needs", "missing", "argument"),
    [
        (FamilyNeeds("mistral", window=True), "window", "window_size"),
        (FamilyNeeds("gemma2", window=True, softcap=True), "softcap", "softcap"),
        (FamilyNeeds("gpt_oss", window=True, sinks=True), "sinks", "learnable_sink"),
    ],
)
def test_fa4_is_not_chosen_for_a_variant_its_kernel_does_not_take(needs, missing, argument, monkeypatch):
    monkeypatch.setattr(attention, "flash_attention_4_arguments", lambda: ALL_FA4 - {argument})
    problem = attention.fa4_variant_problem(needs)
    assert problem == f"{needs.family} uses ['{missing}'] and the installed FlashAttention-4's varlen kernel takes no ['{argument}']"
    monkeypatch.setattr(attention, "flash_attention_4_arguments", lambda: ALL_FA4)  # twin: the kernel takes it
    assert attention.fa4_variant_problem(needs) is None


def test_fa4_unknown_arguments_refuse_every_variant_and_plain_families_need_none(monkeypatch):
    monkeypatch.setattr(attention, "flash_attention_4_arguments", lambda: None)  # FA4 not installed/readable
    needs = FamilyNeeds("gemma2", window=True, softcap=True)
    assert attention.fa4_variant_problem(needs) == (
        "gemma2 uses ['window', 'softcap'] and the installed FlashAttention-4's varlen kernel takes no "
        "['window_size', 'softcap']"
    )
    assert attention.fa4_variant_problem(FamilyNeeds("llama")) is None


@pytest.mark.parametrize("switch", [{"use_bidirectional_attention": True}, {"is_causal": False}])
def test_bidirectional_attention_is_refused_by_name(switch):
    config = transformers.Qwen2Config(**SIZE)
    model = transformers.Qwen2ForCausalLM(config)
    assert family.refusal(model) is None  # twin: the causal config is trained
    for name, value in switch.items():
        setattr(model.config, name, value)
    assert family.refusal(model) == "qwen2 is configured for bidirectional attention; odc_hf trains causal language models"
