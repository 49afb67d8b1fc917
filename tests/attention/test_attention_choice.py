"""ODCConfig.attention: "auto" resolves to FlashAttention-4 only where it runs (installed, CUDA capability >= 9.0,
bf16/fp16, a flash-capable model), to sdpa_varlen elsewhere, and keeps an implementation the model's user chose.
FA4 cannot be installed on the CPU machines CI runs on: its availability and the GPU's capability are mocked here,
in the resolution logic only (the real FA4 path is tests/gpu/test_attention_fa4_gpu.py, `pytest -m gpu`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2ForCausalLM

from odc_hf.attention import VARLEN_ATTENTION
from odc_hf.config import ODCConfig
from odc_hf.integrations.compute import attention
from odc_hf.integrations.compute.attention import (
    FLASH_ATTENTION_4,
    AttentionChoice,
    choose_attention,
    fa4_problem,
    resolve_attention,
)
from odc_hf.testing.data import tiny_qwen2_config

FLASH_MODEL = SimpleNamespace(_supports_flash_attn=True)


def _model(attn: str) -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM._from_config(tiny_qwen2_config(97), attn_implementation=attn, dtype=torch.float32)


def _trainer(model, **config):
    accelerator = SimpleNamespace(unwrap_model=lambda m: m, mixed_precision="no", device=torch.device("cpu"),
                                  is_main_process=True)  # fmt: skip
    return SimpleNamespace(accelerator=accelerator, model=model, odc_config=ODCConfig(**config))


def test_fa4_needs_the_package_cuda_hopper_and_half_precision(monkeypatch):
    monkeypatch.setattr(attention, "fa4_installed", lambda: False)
    assert "not installed" in fa4_problem("cuda", torch.bfloat16, FLASH_MODEL)
    monkeypatch.setattr(attention, "fa4_installed", lambda: True)
    assert "CUDA only" in fa4_problem("cpu", torch.bfloat16, FLASH_MODEL)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # A100
    assert "8.0" in fa4_problem("cuda:0", torch.bfloat16, FLASH_MODEL)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # H100 / H200
    assert "float32" in fa4_problem("cuda:0", None, FLASH_MODEL)
    assert "does not support" in fa4_problem("cuda:0", torch.bfloat16, SimpleNamespace())
    assert fa4_problem("cuda:0", torch.bfloat16, FLASH_MODEL) is None
    assert fa4_problem("cuda:0", torch.float16, FLASH_MODEL) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))  # B200
    assert fa4_problem("cuda:0", torch.bfloat16, FLASH_MODEL) is None


def test_fa4_is_chosen_only_at_the_head_dimensions_it_was_measured_exact(monkeypatch):
    # FA4 4.0.0b on an H100: head dimension 16 gave gradient norms 8-29% low, 64 agreed with TRL (GPU twin:
    # tests/gpu/test_attention_fa4_gpu.py)
    from odc_hf.testing.data import TINY_HEAD_DIM_64

    monkeypatch.setattr(attention, "fa4_installed", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    small = Qwen2ForCausalLM(tiny_qwen2_config(97))  # head_dim 16
    problem = fa4_problem("cuda:0", torch.bfloat16, small)
    assert "head dimension [16]" in problem and "64, 128, 256" in problem
    name, why = resolve_attention("auto", "sdpa", problem, VARLEN_ATTENTION)
    assert name == VARLEN_ATTENTION and "head dimension [16]" in why
    with pytest.raises(ValueError, match=r"head dimension \[16\]"):
        resolve_attention(FLASH_ATTENTION_4, "sdpa", problem, VARLEN_ATTENTION)
    assert fa4_problem("cuda:0", torch.bfloat16, Qwen2ForCausalLM(tiny_qwen2_config(97, **TINY_HEAD_DIM_64))) is None


def test_fa4_is_absent_here():
    """This CPU machine: transformers' own check says no, whatever is installed."""
    assert "not installed" in fa4_problem("cpu", torch.float32) or "CUDA only" in fa4_problem("cpu", torch.float32)


@pytest.mark.parametrize("current", ["sdpa", VARLEN_ATTENTION, "sdpa_varlen_bucket0"])
def test_auto_replaces_transformers_default_and_sdpa_varlen(current):
    from odc_hf.attention import VarlenAttention, register

    register(VarlenAttention(shape_bucket=0))
    assert resolve_attention("auto", current, None, VARLEN_ATTENTION)[0] == FLASH_ATTENTION_4
    name, why = resolve_attention("auto", current, "training runs on cpu", VARLEN_ATTENTION)
    assert name == VARLEN_ATTENTION and "cpu" in why


@pytest.mark.parametrize("current", ["eager", "flash_attention_2", FLASH_ATTENTION_4, "kernels-community/flash-attn3"])
def test_auto_keeps_an_implementation_the_user_chose(current):
    assert resolve_attention("auto", current, None, VARLEN_ATTENTION)[0] == current
    assert resolve_attention("auto", current, "no GPU", VARLEN_ATTENTION)[0] == current


def test_explicit_choices_force_one():
    assert resolve_attention("sdpa_varlen", "eager", None, VARLEN_ATTENTION)[0] == VARLEN_ATTENTION
    assert resolve_attention("flash_attention_4", "sdpa", None, VARLEN_ATTENTION)[0] == FLASH_ATTENTION_4
    assert resolve_attention("model", "sdpa", None, VARLEN_ATTENTION)[0] == "sdpa"
    with pytest.raises(ValueError, match=r"attention='flash_attention_4'\), but no GPU. Set attention='auto'"):
        resolve_attention("flash_attention_4", "sdpa", "no GPU", VARLEN_ATTENTION)
    with pytest.raises(ValueError, match="attention must be one of"):
        ODCConfig(attention="flash_attention_3")


def test_trainer_setup_on_cpu_picks_sdpa_varlen_and_says_why(caplog):
    model = _model("sdpa")
    with caplog.at_level("INFO", logger="odc_hf.integrations.compute.attention"):
        record = choose_attention(_trainer(model))
    assert model.config._attn_implementation == VARLEN_ATTENTION
    assert record["choice"] == "auto" and record["implementation"] == VARLEN_ATTENTION
    assert "sdpa_varlen because" in record["reason"] and "sdpa_varlen" in caplog.text
    eager = _model("eager")
    with caplog.at_level("WARNING"):
        assert choose_attention(_trainer(eager))["implementation"] == "eager"  # the user's choice
    assert eager.config._attn_implementation == "eager" and "dense block-diagonal mask" in caplog.text
    with pytest.raises(ValueError, match="not installed|CUDA only"):
        choose_attention(_trainer(_model("sdpa"), attention="flash_attention_4"))


def test_reference_model_gets_the_same_attention():
    model, ref = _model("sdpa"), _model("sdpa")
    trainer = _trainer(model)
    trainer.ref_model = ref
    choose_attention(trainer)
    assert ref.config._attn_implementation == model.config._attn_implementation == VARLEN_ATTENTION


def test_flash_attention_4_comes_with_the_kernels_extra_only():
    """`pip install odc_hf[kernels]` brings FA4 with the CUTLASS DSL's CUDA 13 libraries; CI's `test` extra does not."""
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]  # fmt: skip
    assert any(r.startswith("flash-attn-4[cu13]>=4.0.0b36") for r in extras["kernels"])
    assert any(r.startswith("nvidia-cutlass-dsl[cu13]") for r in extras["kernels"])
    assert not any("flash-attn" in r or "cutlass" in r for r in extras["test"])


@pytest.mark.parametrize("implementation, device, packed", [
    (FLASH_ATTENTION_4, "cuda", True), (VARLEN_ATTENTION, "cpu", True), (VARLEN_ATTENTION, "cuda", False),
    ("sdpa", "cpu", False), ("eager", "cuda", False), ("flash_attention_2", "cuda", True)])  # fmt: skip
def test_grpo_layout_auto_packs_under_varlen_attention_that_gains(implementation, device, packed):
    from odc_hf.integrations.trl.grpo_trainer import _GRPOPart

    def layout(choice):
        trainer = SimpleNamespace(odc_config=ODCConfig(grpo_layout=choice),
                                  odc_attention_choice=AttentionChoice("auto", implementation, ""),
                                  accelerator=SimpleNamespace(device=torch.device(device)))  # fmt: skip
        return _GRPOPart._odc_packed_layout(trainer)

    assert layout("auto") == packed
    assert layout("packed") and not layout("padded")


def test_a_family_with_soft_capping_or_sinks_runs_eager_even_where_transformers_allows_sdpa():
    """SDPA has no soft-capping or sinks, so such a family's definition is its eager attention: ``eager_varlen`` and
    an eager reference in the definition check, even where the release marks the class as SDPA-capable (transformers
    5.17 does for Gemma 2, and its SDPA then silently drops the soft-capping: the check against that SDPA refused
    Gemma 2 as trained differently). Without soft-capping the same class runs SDPA."""
    import transformers

    from odc_hf.integrations.models.family import needs_of

    def gemma2(softcap):
        config = transformers.Gemma2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           query_pre_attn_scalar=8, sliding_window=12, attn_logit_softcapping=softcap,
                                           layer_types=["sliding_attention", "full_attention"])  # fmt: skip
        model = transformers.Gemma2ForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)
        model._supports_sdpa = True  # as transformers 5.17 marks Gemma 2
        return model

    capped = gemma2(0.5)
    assert needs_of(capped).softcap and not needs_of(capped).sdpa
    record = choose_attention(_trainer(capped))
    assert record["implementation"] == "eager_varlen" == capped.config._attn_implementation
    # loaded as transformers 5.17 loads it when asked for nothing: on SDPA. auto replaces that default; "model" keeps
    # it, which would drop the soft-capping: refused by name
    on_sdpa = gemma2(0.5)
    on_sdpa.set_attn_implementation("sdpa")
    assert choose_attention(_trainer(on_sdpa))["implementation"] == "eager_varlen"
    on_sdpa.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match=r"^gemma2 uses soft-capping, which SDPA does not apply"):
        choose_attention(_trainer(on_sdpa, attention="model"))
    assert needs_of(gemma2(None)).sdpa  # nothing SDPA lacks: SDPA
    assert needs_of(_model("sdpa")).sdpa
    sinks = transformers.GptOssForCausalLM._from_config(
        transformers.GptOssConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                  num_experts_per_tok=2, layer_types=["full_attention"]),
        attn_implementation="eager")  # fmt: skip
    sinks._supports_sdpa = True
    assert needs_of(sinks).sinks and not needs_of(sinks).sdpa
