"""odc_hf: On-Demand Communication for FSDP2 training in the Hugging Face stack.

Layers (each knows nothing of the one above): ``odc_hf.transport`` (one-sided primitives), ``odc_hf.fsdp``
(FSDP2 adapter), ``odc_hf.balance`` (LB-Mini / LB-Micro), ``odc_hf.integrations`` (Accelerate, Trainer, TRL).
"""

from odc_hf.config import ODCConfig

__version__ = "0.1.0"

# The one lazy mechanism of odc_hf's classes: importing any odc_hf module runs this file first, and the planning
# package (odc_hf.balance) must import without transformers, accelerate or TRL (tests/project/test_layering.py); the trainers
# and accelerators below import them, so they load on first use.
_LAZY = {
    "install_odc": "odc_hf.fsdp",
    "shard_model": "odc_hf.fsdp",
    "ODCAccelerator": "odc_hf.integrations.accelerate.accelerator",
    "prepare": "odc_hf.integrations.accelerate.accelerator",
    "failure_guard": "odc_hf.integrations.trainer.failure_guard",
    "ODCFSDPPlugin": "odc_hf.integrations.accelerate.plugin",
    "ODCMixin": "odc_hf.integrations.trainer.mixin",
    "ODCTrainer": "odc_hf.integrations.trainer.mixin",
    "make_odc_trainer": "odc_hf.integrations.trainer.mixin",
    "ODCSFTTrainer": "odc_hf.integrations.trl.sft_trainer",
    "ODCGRPOTrainer": "odc_hf.integrations.trl.grpo_trainer",
    "patch_trl": "odc_hf.integrations.trl.patch",
    "unpatch_trl": "odc_hf.integrations.trl.patch",
    "ODCTrainingArguments": "odc_hf.integrations.trainer.arguments",
    "ODCSFTConfig": "odc_hf.integrations.trl.sft_config",
    "ODCGRPOConfig": "odc_hf.integrations.trl.grpo_config",
    "make_odc_arguments": "odc_hf.integrations.trainer.arguments",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'odc_hf' has no attribute {name!r}")


__all__ = ["ODCConfig", *_LAZY]
