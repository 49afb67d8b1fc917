"""The transformers version policy of odc_hf: every name of transformers it uses that transformers does not export
at its top level (private methods and attributes, names of its submodules), in one place, with the versions they
were tested on.

odc_hf runs on transformers >= 5.17; it is tested on :data:`TESTED_TRANSFORMERS` (``odc_hf.version.TESTED``: 5.17 on
the GPU image, the locked version on CPU) and warns once on another minor (:func:`odc_hf.version.warn_if_untested`).
A private name can disappear or change meaning in any release. A name that disappears is found at start-up
(:func:`check_trainer`, which refuses naming it) or by ``tests/project/test_transformers_surface.py``, which checks every name
listed here against the installed transformers and that this list covers every private Trainer method the ODC
trainers override. Add a version to ``odc_hf.version.TESTED`` once that test and the parity tests pass on it.

The ODC trainers import the submodule names below from here; ``odc_hf.attention`` (a lower layer) imports its own
two, listed in :data:`SUBMODULE_NAMES` all the same.
"""

from __future__ import annotations

import transformers
from transformers import GradientCheckpointingLayer
from transformers.integrations.liger import apply_liger_kernel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.trainer import TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_pt_utils import LabelSmoother
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from transformers.utils import is_flash_attn_4_available

from odc_hf.attention.varlen import implementation_name
from odc_hf.version import TESTED, warn_if_untested

TESTED_TRANSFORMERS = TESTED["transformers"]
"""transformers minors odc_hf is tested on (a view of ``odc_hf.version.TESTED``)."""

TRAINER_HOOKS = (
    "_build_accelerator_args",  # where the Trainer builds its accelerator's arguments: ODC's FSDP plugin goes in
    "_save_checkpoint",  # a completion marker after every rank's parts, then the rotation of old checkpoints
    "_save_optimizer_and_scheduler",  # the CPU path's sharded optimizer (torch.distributed.checkpoint)
    "_load_optimizer_and_scheduler",  # and its loading; a checkpoint lacking the optimizer is an error
    "_issue_warnings_after_load",  # tied copies are never saved: not reported as missing
    "_get_output_dir",  # called: the run's output folder, where the checkpoints go
    "_get_train_sampler",  # GRPO: one dataloader batch per optimizer step (TRL overrides it too)
    "_load_best_model",  # load_best_model_at_end: into the sharded model, then published for the peers' gathers
    "_get_collator_with_removed_columns",  # called: a user's data collator as the Trainer calls it, for its labels
)
"""Private ``transformers.Trainer`` methods the ODC trainers override or call."""

SUBMODULE_NAMES = {
    "transformers.trainer": ("TRAINING_ARGS_NAME", "TRAINER_STATE_NAME"),  # saved / resumed checkpoint files
    "transformers.trainer_utils": ("PREFIX_CHECKPOINT_DIR", "rotate_checkpoints"),  # checkpoint folders
    "transformers.integrations.liger": ("apply_liger_kernel",),  # Liger's kernels, as the Trainer applies them
    "transformers.utils": ("is_flash_attn_4_available",),  # transformers' own FlashAttention-4 check
    "transformers.integrations.sdpa_attention": ("sdpa_attention_forward",),  # odc_hf.attention
    "transformers.masking_utils": ("sdpa_mask",),  # odc_hf.attention
    "transformers.trainer_pt_utils": ("LabelSmoother",),  # the Trainer's label smoothing, kept shifting under FSDP2
    "transformers.models.auto.modeling_auto": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",),  # which classes it shifts for
}
"""Names odc_hf imports from transformers' submodules (not exported by ``transformers`` itself)."""

PRIVATE_ATTRIBUTES = {
    "PretrainedConfig": ("_attn_implementation",),  # the model's attention implementation (read; set publicly)
    "PreTrainedModel": ("_supports_flash_attn", "_supports_sdpa",  # whether a model can run flash attention / SDPA
                        "_no_split_modules"),  # the decoder-layer classes odc_hf.fsdp shards as units
    "GradientCheckpointingLayer": ("_gradient_checkpointing_func",),  # whether checkpointing was enabled
}
"""Private attributes odc_hf reads, by the transformers class that holds them (``_gradient_checkpointing_func``
exists once checkpointing is enabled)."""


def attn_implementation(model) -> str | None:
    """The attention implementation a transformers model runs (its config's ``_attn_implementation``), or None.

    The read itself lives in the lower layer that needs it too (``odc_hf.attention.varlen.implementation_name``):
    one place in odc_hf touches the private name."""
    return implementation_name(model)


def supports_flash_attention(model) -> bool:
    """Whether a transformers model declares flash-attention support (``_supports_flash_attn``)."""
    return bool(getattr(model, "_supports_flash_attn", False))


def supports_sdpa(model) -> bool:
    """Whether transformers lets a model run an implementation named ``*sdpa*`` (``_supports_sdpa``; Gemma 2 and
    GPT-OSS do not: SDPA has no soft-capping or sinks)."""
    return bool(getattr(model, "_supports_sdpa", True))


def checkpointing_installed(layer) -> bool:
    """Whether transformers installed its checkpoint function on a ``GradientCheckpointingLayer``."""
    return hasattr(layer, "_gradient_checkpointing_func")


class TrainerHooks:
    """The private ``transformers.Trainer`` methods the ODC trainers override (:data:`TRAINER_HOOKS`), each handed to
    a public ``odc_*`` method of the trainer with the Trainer's own method as ``parent``: the one place those names
    are written. Goes right before the Trainer class in a trainer's bases (after ``ODCMixin``'s parts)."""

    def _build_accelerator_args(self, **kwargs):
        return self.odc_build_accelerator_args(super()._build_accelerator_args, **kwargs)

    def _save_checkpoint(self, model, trial):
        return self.odc_save_checkpoint(super()._save_checkpoint, model, trial)

    def _save_optimizer_and_scheduler(self, output_dir):
        return self.odc_save_optimizer_and_scheduler(super()._save_optimizer_and_scheduler, output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint):
        return self.odc_load_optimizer_and_scheduler(super()._load_optimizer_and_scheduler, checkpoint)

    def _issue_warnings_after_load(self, load_result):
        return self.odc_issue_warnings_after_load(super()._issue_warnings_after_load, load_result)

    def _load_best_model(self):
        return self.odc_load_best_model(super()._load_best_model)


def output_dir(trainer, trial=None) -> str:
    """The run's output folder, where the Trainer writes its checkpoints (``Trainer._get_output_dir``)."""
    return trainer._get_output_dir(trial=trial)


class ShiftingLabelSmoother(LabelSmoother):
    """The Trainer's ``LabelSmoother`` that always shifts the labels by one position, as for a causal LM."""

    def __call__(self, model_output, labels, shift_labels=False, num_items_in_batch=None):
        return super().__call__(model_output, labels, shift_labels=True, num_items_in_batch=num_items_in_batch)


def keep_label_smoothing_causal(trainer, model) -> None:
    """``label_smoothing_factor`` on a causal LM: the Trainer's label smoother shifts the labels by one position when
    the model's class name (``_get_name()``) is a causal LM's; FSDP2 renames the class it shards (``Qwen2ForCausalLM``
    becomes ``FSDPQwen2ForCausalLM``), so on every sharded run the Trainer would compare each position's logits with its
    own token. Given ``model`` before sharding (a PEFT model's base model), a causal LM by the Trainer's own list keeps a
    smoother that always shifts."""
    smoother = trainer.label_smoother
    if smoother is None or isinstance(smoother, ShiftingLabelSmoother):
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if {c.__name__ for c in type(base).__mro__} & set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        trainer.label_smoother = ShiftingLabelSmoother(epsilon=smoother.epsilon, ignore_index=smoother.ignore_index)


def collator_as_trainer_calls_it(trainer, collator):
    """``collator`` as the Trainer's training dataloader calls it: the examples' columns the model does not take
    removed first, when ``remove_unused_columns`` says so (``Trainer._get_collator_with_removed_columns``)."""
    return trainer._get_collator_with_removed_columns(collator, description="training")


def missing_upstream_methods(cls: type, names) -> list[str]:
    """The ``names`` no class of ``cls``'s MRO below its last odc_hf class defines as a method: what the upstream
    trainer (and a user's own base class) must provide, whatever odc_hf's hook classes define above it."""
    mro = cls.__mro__
    last = max((i for i, c in enumerate(mro) if c.__module__.startswith("odc_hf.")), default=-1)
    below = mro[last + 1 :]
    return [name for name in names  # the first class below that holds the name decides, as attribute lookup does
            if not callable(next((vars(c)[name] for c in below if name in vars(c)), None))]  # fmt: skip


def check_trainer(trainer_cls: type) -> None:
    """Raise when the transformers Trainer below ``trainer_cls``'s odc_hf classes lacks a private method of
    :data:`TRAINER_HOOKS` odc_hf overrides or calls (a transformers that renamed it), naming it and the tested
    versions; warn once on an untested transformers."""
    warn_if_untested("transformers")
    missing = missing_upstream_methods(trainer_cls, TRAINER_HOOKS)
    if missing:
        raise RuntimeError(
            f"transformers {transformers.__version__}: {trainer_cls.__name__} lacks {missing}, private Trainer methods "
            f"odc_hf overrides or calls; odc_hf was tested on transformers {TESTED_TRANSFORMERS} "
            "(odc_hf/integrations/upstream/transformers.py)"
        )


__all__ = [
    "PREFIX_CHECKPOINT_DIR",
    "PRIVATE_ATTRIBUTES",
    "SUBMODULE_NAMES",
    "TESTED_TRANSFORMERS",
    "TRAINER_HOOKS",
    "TRAINER_STATE_NAME",
    "TRAINING_ARGS_NAME",
    "apply_liger_kernel",
    "attn_implementation",
    "check_trainer",
    "collator_as_trainer_calls_it",
    "keep_label_smoothing_causal",
    "ShiftingLabelSmoother",
    "missing_upstream_methods",
    "checkpointing_installed",
    "is_flash_attn_4_available",
    "rotate_checkpoints",
    "supports_flash_attention",
    "supports_sdpa",
    "GradientCheckpointingLayer",
    "TrainerHooks",
    "output_dir",
]
