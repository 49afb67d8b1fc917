"""The transformers names odc_hf uses beyond transformers' top-level exports, listed in
odc_hf/integrations/upstream/transformers.py: each exists in the installed transformers, and the list covers every
private Trainer method the ODC trainers override or call."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest
import transformers
from transformers import Trainer

from odc_hf.integrations.upstream import transformers as tv
from odc_hf.integrations.upstream import trl as trl_version

ROOT = Path(__file__).resolve().parents[2]


def test_private_trainer_methods_exist():
    for name in tv.TRAINER_HOOKS:
        assert callable(getattr(Trainer, name, None)), name


def test_submodule_names_exist():
    for module, names in tv.SUBMODULE_NAMES.items():
        imported = importlib.import_module(module)
        for name in names:
            assert hasattr(imported, name), f"{module}.{name}"


def test_private_attributes_exist():
    from odc_hf.integrations.compute.activation_checkpointing import enable_checkpointing

    config = transformers.Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    model = transformers.Qwen2ForCausalLM(config)
    assert set(tv.PRIVATE_ATTRIBUTES) == {"PretrainedConfig", "PreTrainedModel", "GradientCheckpointingLayer"}
    assert "_attn_implementation" in tv.PRIVATE_ATTRIBUTES["PretrainedConfig"] and tv.attn_implementation(model)
    assert hasattr(transformers.PreTrainedModel, "_supports_flash_attn") and tv.supports_flash_attention(model)
    assert hasattr(transformers.PreTrainedModel, "_supports_sdpa") and tv.supports_sdpa(model)
    assert not tv.supports_sdpa(transformers.GptOssForCausalLM)  # no SDPA: the sinks (eager_varlen instead)
    for name in tv.PRIVATE_ATTRIBUTES["PreTrainedModel"]:  # odc_hf.fsdp's units: _no_split_modules
        assert hasattr(transformers.PreTrainedModel, name), name
    assert "Qwen2DecoderLayer" in model._no_split_modules
    enable_checkpointing(model, 1)  # transformers' own switch, the name of this transformers version
    layers = [m for m in model.modules() if isinstance(m, transformers.GradientCheckpointingLayer)]
    assert layers and all(tv.checkpointing_installed(layer) for layer in layers)


def _odc_trainer_parts() -> list[type]:
    from odc_hf import ODCGRPOTrainer, ODCSFTTrainer, ODCTrainer

    parts = {part for cls in (ODCTrainer, ODCSFTTrainer, ODCGRPOTrainer) for part in cls.__mro__
             if part.__module__.startswith("odc_hf.")}  # fmt: skip
    return sorted(parts, key=lambda part: part.__name__)


def _upstream_private_names() -> set[str]:
    """Every private name (``_x``, not odc_hf's own ``_odc_x``) that the odc_hf parts of the ODC trainers define
    (an override) or read as ``self._x`` (a call or attribute of the base trainer), or that the upstream fence's
    functions read as ``trainer._x``, found in their source, whether or not the installed transformers still has it:
    a method transformers removed must show up here."""
    names = set()
    for part in _odc_trainer_parts():
        (node,) = [n for n in ast.walk(ast.parse(Path(inspect.getsourcefile(part)).read_text()))
                   if isinstance(n, ast.ClassDef) and n.name == part.__name__]  # fmt: skip
        for child in ast.walk(node):
            if isinstance(child, ast.FunctionDef) and child in node.body:
                names.add(child.name)
            elif (isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name)
                  and child.value.id == "self"):  # fmt: skip
                names.add(child.attr)
    for module in (tv, trl_version):  # the fence's accessors: ``trainer._x`` in its functions
        for child in ast.walk(ast.parse(Path(inspect.getsourcefile(module)).read_text())):
            if isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name) and child.value.id == "trainer":
                names.add(child.attr)
    return {n for n in names if n.startswith("_") and not n.startswith(("__", "_odc_"))}


def _unlisted_or_missing(trainer_cls: type) -> list[str]:
    """The problems of the lists against ``trainer_cls`` (transformers' Trainer): a private name odc_hf uses that is
    neither a Trainer hook (``TRAINER_HOOKS``) nor a TRL name (``trl_version``), and a listed hook ``trainer_cls``
    lacks."""
    trl_names = set(trl_version.SFT_PRIVATE_ATTRIBUTES + trl_version.GRPO_PRIVATE_METHODS
                    + trl_version.GRPO_PRIVATE_ATTRIBUTES)  # fmt: skip
    problems = [f"{name}: not listed" for name in sorted(_upstream_private_names() - set(tv.TRAINER_HOOKS) - trl_names)]
    problems += [f"{name}: missing" for name in tv.TRAINER_HOOKS if not callable(getattr(trainer_cls, name, None))]
    return problems


def test_the_list_covers_every_private_trainer_name_odc_hf_overrides_or_calls():
    names = _upstream_private_names()
    assert {"_save_checkpoint", "_build_accelerator_args", "_get_output_dir", "_metrics"} <= names, names  # the scan works
    assert _unlisted_or_missing(Trainer) == []


def test_a_hook_transformers_removed_is_found():
    # negative control: a transformers whose Trainer lost _save_checkpoint (odc_hf still overrides it)
    old = type("OldTrainer", (), {n: getattr(Trainer, n) for n in tv.TRAINER_HOOKS if n != "_save_checkpoint"})
    assert _unlisted_or_missing(old) == ["_save_checkpoint: missing"]
    with pytest.raises(RuntimeError, match=r"OldTrainer lacks \['_save_checkpoint'\]"):
        tv.check_trainer(old)


def test_a_trainer_without_a_listed_method_is_refused():
    class Renamed:
        pass

    with pytest.raises(RuntimeError, match=r"Renamed lacks \['_build_accelerator_args'"):
        tv.check_trainer(Renamed)
    tv.check_trainer(Trainer)
