"""odc_hf: On-Demand Communication for FSDP2 training in the Hugging Face stack.

Layers (each knows nothing of the one above): ``odc_hf.transport`` (one-sided primitives), ``odc_hf.fsdp``
(FSDP2 adapter), ``odc_hf.balance`` (LB-Mini / LB-Micro), ``odc_hf.integrations`` (Accelerate, Trainer, TRL).
"""

from odc_hf.config import ODCConfig

__version__ = "0.1.0"

_LAZY = {
    "install_odc": "odc_hf.fsdp",
    "shard_model": "odc_hf.fsdp",
    "ODCAccelerator": "odc_hf.integrations.accelerator",
    "prepare": "odc_hf.integrations.accelerator",
    "failure_guard": "odc_hf.integrations.failures",
    "ODCFSDPPlugin": "odc_hf.integrations.plugin",
    "ODCMixin": "odc_hf.integrations.trainer",
    "ODCTrainer": "odc_hf.integrations.trainer",
    "make_odc_trainer": "odc_hf.integrations.trainer",
    "ODCSFTTrainer": "odc_hf.integrations.trl",
    "ODCGRPOTrainer": "odc_hf.integrations.grpo",
    "patch_trl": "odc_hf.integrations.trl",
    "ODCTrainingArguments": "odc_hf.integrations.arguments",
    "ODCSFTConfig": "odc_hf.integrations.trl_config",
    "ODCGRPOConfig": "odc_hf.integrations.trl_config",
    "make_odc_arguments": "odc_hf.integrations.arguments",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'odc_hf' has no attribute {name!r}")


__all__ = ["ODCConfig", *_LAZY]
