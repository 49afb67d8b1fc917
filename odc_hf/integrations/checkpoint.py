"""Trainer checkpoints on the CPU path, where odc_hf (not accelerate) sharded the model with fully_shard.

The Trainer only knows how to save sharded optimizers for accelerate's FSDP; on the CPU path it would write
rank 0's optimizer shard alone. These two functions replace the Trainer's private
``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler`` for that path only (the mixin calls them;
transformers 5.17 and 5.24 both have those names, checked by ``TRAINER_HOOKS`` and a test): the optimizer goes
through torch.distributed.checkpoint (every rank writes its shard), the scheduler is written by the main
process as the Trainer does. Model weights go through ``ODCMixin.save_model`` (full state dict) and the Trainer
loads them before sharding, so they need nothing here.
"""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

TRAINER_HOOKS = ("_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler")
OPTIMIZER_DIR = "odc_optimizer"
SCHEDULER_NAME = "scheduler.pt"


def _optimizer(trainer):
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)


def save_optimizer_and_scheduler(trainer, output_dir: str) -> None:
    state = get_optimizer_state_dict(trainer.model, _optimizer(trainer))
    dcp.save({"optimizer": state}, checkpoint_id=os.path.join(output_dir, OPTIMIZER_DIR))
    if trainer.args.should_save and trainer.lr_scheduler is not None:
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


def load_optimizer_and_scheduler(trainer, checkpoint: str) -> bool:
    """Load what :func:`save_optimizer_and_scheduler` wrote; False if the checkpoint has no odc_hf optimizer."""
    path = os.path.join(checkpoint, OPTIMIZER_DIR)
    if not os.path.isdir(path):
        return False
    optimizer = _optimizer(trainer)
    state = {"optimizer": get_optimizer_state_dict(trainer.model, optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(trainer.model, optimizer, optim_state_dict=state["optimizer"])
    scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
    if trainer.lr_scheduler is not None and os.path.isfile(scheduler):
        trainer.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
    return True
