"""Resuming the ODC trainers from a checkpoint: what a checkpoint must hold, checked before anything is built.

``ODCMixin.train(resume_from_checkpoint=...)`` calls :func:`check_resume` on every rank before the Trainer loads
anything: the checks read files only, so every rank raises the same error before any collective (a missing part
found later, inside the Trainer's loading, would leave the other ranks waiting in a collective).
"""

from __future__ import annotations

import os

from accelerate.utils import DistributedType
from transformers.trainer import TRAINER_STATE_NAME

from odc_hf.integrations.checkpoint import CheckpointPartMissing, check_sharded_parts


def shards_itself(trainer) -> bool:
    """Whether odc_hf (not accelerate) will shard the model (the CPU path), so its optimizer is saved as
    ``odc_optimizer/`` (known before ``prepare``, unlike ``ODCMixin._odc_self_sharded``)."""
    accelerator = trainer.accelerator
    return accelerator.distributed_type != DistributedType.FSDP and accelerator.num_processes > 1


def check_resume(trainer, checkpoint: str) -> None:
    """Raise, naming the part and the checkpoint, when ``checkpoint`` lacks something the resumed run needs."""
    if not os.path.isdir(checkpoint):
        raise FileNotFoundError(f"resume_from_checkpoint={checkpoint!r}: no such checkpoint directory")
    if not os.path.isfile(os.path.join(checkpoint, TRAINER_STATE_NAME)):
        # the Trainer would restart at step 0 with the checkpoint's weights, from the first sample
        raise CheckpointPartMissing(checkpoint, TRAINER_STATE_NAME, "the step, epoch and log to continue from")
    if shards_itself(trainer):
        check_sharded_parts(checkpoint, scheduler=True)  # the Trainer always builds a scheduler
