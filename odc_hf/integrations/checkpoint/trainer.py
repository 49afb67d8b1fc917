"""The ODC trainers' checkpoints: complete saves, resuming from complete checkpoints only, the CPU path's optimizer.

A part of :class:`~odc_hf.integrations.trainer.mixin.ODCMixin` (a mixin on the trainer below it). It takes the
Trainer's checkpoint cycle (its private methods, overridden in one place, with the versions they were tested on:
:class:`odc_hf.integrations.upstream.transformers.TrainerHooks`): a save adds a completion marker once every rank has
written every part, the optimizer's save and load go through torch.distributed.checkpoint where odc_hf sharded the
model itself (the CPU path, :mod:`odc_hf.integrations.checkpoint.sharded`), and a resumed checkpoint is checked
before the Trainer loads anything (:mod:`odc_hf.integrations.checkpoint.resume`).
"""

from __future__ import annotations

import os

from odc_hf.integrations.checkpoint import resume
from odc_hf.integrations.checkpoint.sharded import (
    check_trainer_optimizer,
    load_full_model,
    load_optimizer_and_scheduler,
    missing_tied_keys,
    save_optimizer_and_scheduler,
)
from odc_hf.integrations.upstream.transformers import PREFIX_CHECKPOINT_DIR, output_dir, rotate_checkpoints


class CheckpointPart:
    """Checkpoint saving and resuming of :class:`~odc_hf.integrations.trainer.mixin.ODCMixin`; see the module docstring."""

    odc_dataset: dict | None = None
    """The training data's size and fingerprint, recorded in the checkpoints (:func:`odc_note_dataset`)."""
    _odc_resume_checkpoint: str | None = None
    """The checkpoint ``train()`` resumes from."""
    odc_resumed_from: tuple[str, int] | None = None
    """The checkpoint the last ``train()`` resumed from and its step, or None (printed when training starts and in the
    run's summary line)."""

    def _odc_resolve_resume(self, resume_from_checkpoint):
        """``train()``'s ``resume_from_checkpoint``, checked on every rank before the Trainer loads anything: ``True``
        (or ``"true"`` / ``"last"``, as command lines pass it) becomes the last COMPLETE checkpoint of the output
        directory; a path must be complete."""
        given = resume_from_checkpoint
        resume_from_checkpoint = resume.requested(resume_from_checkpoint)
        if resume_from_checkpoint:
            resume_from_checkpoint = resume.resolve(self, resume_from_checkpoint, given)
        resuming = isinstance(resume_from_checkpoint, str)
        self._odc_resume_checkpoint = resume_from_checkpoint if resuming else None
        self.odc_resumed_from = (resume_from_checkpoint, resume.checkpoint_step(resume_from_checkpoint)) if resuming else None
        if resuming and self.accelerator.is_main_process:
            print(f"odc_hf: resuming from {resume_from_checkpoint} (step {self.odc_resumed_from[1]})", flush=True)
        return resume_from_checkpoint

    def odc_note_dataset(self, num_samples: int, lengths: list[int] | None = None) -> None:
        """Record the training data's size (and its samples' token counts' fingerprint) for the checkpoints; resuming,
        warn when it is not the checkpoint's (:func:`odc_hf.integrations.checkpoint.resume.check_dataset`)."""
        self.odc_dataset = resume.dataset_record(num_samples, lengths)
        if self._odc_resume_checkpoint is not None:
            resume.check_dataset(self, self._odc_resume_checkpoint, self.odc_dataset)

    def odc_save_checkpoint(self, parent, model, trial):
        """The Trainer's save, then a completion marker once every rank has written every part, then the rotation of
        old checkpoints (``save_total_limit``): a job killed while saving leaves the previous checkpoint loadable,
        and ``resume_from_checkpoint=True`` takes the last complete one (:mod:`odc_hf.integrations.checkpoint.resume`)."""
        run_dir = output_dir(self, trial)
        checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            resume.unmark(checkpoint)  # overwriting an older save of this step: incomplete until marked again
        limit, self.args.save_total_limit = self.args.save_total_limit, None  # self.args is odc_hf's copy
        try:
            parent(model, trial)
        finally:
            self.args.save_total_limit = limit
        self.accelerator.wait_for_everyone()  # every rank's parts are on disk
        if self.args.should_save:
            resume.mark_complete(self, checkpoint)
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)  # fmt: skip

    # The optimizer's own format on the CPU path only (odc_hf/integrations/checkpoint/sharded.py).
    def odc_save_optimizer_and_scheduler(self, parent, folder):
        if not self._odc_self_sharded():
            return parent(folder)
        save_optimizer_and_scheduler(self, folder)

    def odc_load_optimizer_and_scheduler(self, parent, checkpoint):
        if checkpoint is None:
            return parent(checkpoint)
        if self._odc_self_sharded() or resume.reads_sharded_optimizer(self, checkpoint):
            return load_optimizer_and_scheduler(self, checkpoint)
        check_trainer_optimizer(checkpoint, scheduler=self.lr_scheduler is not None)  # the Trainer skips silently
        return parent(checkpoint)

    def odc_load_best_model(self, parent):
        """``load_best_model_at_end``: the best checkpoint's weights into the sharded model (on the CPU path, where
        the Trainer would copy whole tensors into sharded ones, through torch.distributed.checkpoint's state-dict
        API), then published: the peers' gathers read the published shards, not the parameters."""
        if self._odc_self_sharded():
            load_full_model(self, self.state.best_model_checkpoint)
        else:
            parent()
        if self.odc is not None:
            self.odc.publish()

    def odc_issue_warnings_after_load(self, parent, load_result):
        # A tied copy (lm_head.weight sharing the embedding) is never saved, so every correct checkpoint "misses" it:
        # warn only about keys that are really missing.
        if hasattr(load_result, "_replace"):  # torch's _IncompatibleKeys (a namedtuple)
            tied = missing_tied_keys(self.accelerator.unwrap_model(self.model), load_result.missing_keys)
            load_result = load_result._replace(missing_keys=[k for k in load_result.missing_keys if k not in tied])
        return parent(load_result)
