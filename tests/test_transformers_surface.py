"""The transformers names odc_hf uses beyond transformers' top-level exports, listed in
odc_hf/integrations/transformers_version.py: each exists in the installed transformers, and the list covers every
private Trainer method the ODC trainers override or call."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import transformers
from packaging.version import Version
from transformers import Trainer

from odc_hf.integrations import transformers_version as tv

ROOT = Path(__file__).resolve().parents[1]


def test_installed_transformers_is_a_tested_one():
    version = Version(transformers.__version__)
    assert f"{version.major}.{version.minor}" in tv.TESTED_TRANSFORMERS, transformers.__version__


def test_private_trainer_methods_exist():
    for name in tv.TRAINER_HOOKS:
        assert callable(getattr(Trainer, name, None)), name


def test_submodule_names_exist():
    for module, names in tv.SUBMODULE_NAMES.items():
        imported = importlib.import_module(module)
        for name in names:
            assert hasattr(imported, name), f"{module}.{name}"


def test_private_attributes_exist():
    from odc_hf.integrations.activation_checkpointing import enable_checkpointing

    config = transformers.Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    model = transformers.Qwen2ForCausalLM(config)
    assert set(tv.PRIVATE_ATTRIBUTES) == {"PretrainedConfig", "PreTrainedModel", "GradientCheckpointingLayer"}
    assert "_attn_implementation" in tv.PRIVATE_ATTRIBUTES["PretrainedConfig"] and tv.attn_implementation(model)
    assert hasattr(transformers.PreTrainedModel, "_supports_flash_attn") and tv.supports_flash_attention(model)
    enable_checkpointing(model, 1)  # transformers' own switch, the name of this transformers version
    layers = [m for m in model.modules() if isinstance(m, transformers.GradientCheckpointingLayer)]
    assert layers and all(tv.checkpointing_installed(layer) for layer in layers)


def _private_trainer_names_used() -> set[str]:
    """Every ``x._name`` in odc_hf/integrations whose name is a private attribute of ``transformers.Trainer``."""
    used = set()
    for path in (ROOT / "odc_hf" / "integrations").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if hasattr(Trainer, node.attr):
                    used.add(node.attr)
    return used


def test_the_list_covers_every_private_trainer_method_odc_hf_overrides_or_calls():
    from odc_hf import ODCGRPOTrainer, ODCSFTTrainer, ODCTrainer

    overridden = set()
    for cls in (ODCTrainer, ODCSFTTrainer, ODCGRPOTrainer):
        for part in cls.__mro__:
            if part.__module__.startswith("odc_hf."):
                overridden |= {name for name in vars(part) if name.startswith("_") and not name.startswith("__")
                               and hasattr(Trainer, name)}  # fmt: skip
    assert overridden, "found no override of a private Trainer method: the scan is broken"
    assert overridden <= set(tv.TRAINER_HOOKS), overridden - set(tv.TRAINER_HOOKS)
    assert _private_trainer_names_used() <= set(tv.TRAINER_HOOKS), _private_trainer_names_used() - set(tv.TRAINER_HOOKS)


def test_a_trainer_without_a_listed_method_is_refused():
    class Renamed:
        pass

    with pytest.raises(RuntimeError, match=r"Renamed lacks \['_build_accelerator_args'"):
        tv.check_trainer(Renamed)
    tv.check_trainer(Trainer)
