"""Resuming the ODC trainers from a checkpoint: complete checkpoints only, checked before anything is built.

**Complete checkpoints.** A save writes many files from every rank (the model from the main process, one optimizer
shard per rank, RNG states, the trainer state); a job killed in the middle leaves a ``checkpoint-N`` folder that
looks like a checkpoint. transformers 5.17 and 5.24 write straight into ``checkpoint-N`` and
``resume_from_checkpoint=True`` takes the highest-numbered folder whatever it holds. (4.36 staged saves in
``tmp-checkpoint-N`` and renamed the folder at the end; the rename raced between the ranks and nodes writing into it,
transformers issues 27925, 28364 and 28848, and 5.x no longer stages.) So the ODC trainers keep transformers' layout
and add a completion marker, :data:`MARKER`, written atomically (temp
file, then rename) by the main process after every rank has finished every part; it also records the run's layout
(world size, mesh, samples per optimizer step) and its training data (size, and a fingerprint of the samples' token
counts). A save first removes an older marker from its folder, and rotation
(``save_total_limit``) runs only after the new marker is down, so the previous checkpoint stays until a newer one is
complete. Resuming takes the last marked checkpoint (``True``, or the words ``true`` / ``last`` of a command line:
:func:`requested`) or refuses an unmarked one (a path).

``ODCMixin.train(resume_from_checkpoint=...)`` calls :func:`resolve` on every rank before the Trainer loads
anything: the checks read files only, so every rank raises the same error before any collective (a missing part
found later, inside the Trainer's loading, would leave the other ranks waiting in a collective). They cover the model
files too (safetensors headers against their files' sizes: a copy cut short after the save is named, with the earlier
checkpoint to resume from). Resuming with another training dataset than the checkpoint's is a warning
(:func:`check_dataset`), given when the data loader is built.
"""

from __future__ import annotations

import array
import hashlib
import json
import logging
import os
import re

from accelerate.utils import DistributedType

from odc_hf.integrations.checkpoint.sharded import (
    OPTIMIZER_DIR,
    CheckpointPartMissing,
    check_model_files,
    check_sharded_parts,
)
from odc_hf.integrations.upstream.transformers import PREFIX_CHECKPOINT_DIR, TRAINER_STATE_NAME

logger = logging.getLogger(__name__)

MARKER = "odc_checkpoint.json"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")  # transformers' own pattern (trainer_utils)


def reads_sharded_optimizer(trainer, checkpoint: str) -> bool:
    """Whether this run loads the optimizer from ``odc_optimizer/`` (torch.distributed.checkpoint): where odc_hf, not
    accelerate, shards the model (the CPU path, known before ``prepare``), and in one process from a checkpoint of
    several CPU ranks (DCP loads it unsharded)."""
    accelerator = trainer.accelerator
    if accelerator.distributed_type == DistributedType.FSDP:
        return False
    return accelerator.num_processes > 1 or os.path.isdir(os.path.join(checkpoint, OPTIMIZER_DIR))


def layout(trainer) -> dict:
    """What the marker records of the run that wrote the checkpoint (and what resuming compares with)."""
    mesh = getattr(trainer.accelerator, "torch_device_mesh", None)
    return {
        "world_size": trainer.accelerator.num_processes,
        "mesh": list(mesh.shape) if mesh is not None else [trainer.accelerator.num_processes],
        "global_batch_size": trainer.odc_global_batch_size,
    }


# -- saving --------------------------------------------------------------------------------------------------------
def unmark(checkpoint: str) -> None:
    """Before (re)writing ``checkpoint``: it is incomplete until :func:`mark_complete` says otherwise."""
    try:
        os.remove(os.path.join(checkpoint, MARKER))
    except FileNotFoundError:
        pass


def dataset_record(num_samples: int, lengths: list[int] | None = None) -> dict:
    """What the marker records of the training data: its size and, given the samples' token counts in dataset order,
    a fingerprint of them (sha256 of the counts: the same data, tokenized the same way and in the same order, gives the
    same value). The counts are what the sampler reads anyway, so this costs nothing extra."""
    record: dict = {"num_samples": num_samples}
    if lengths is not None:
        record["lengths_sha256"] = hashlib.sha256(array.array("q", lengths).tobytes()).hexdigest()[:16]
    return record


def mark_complete(trainer, checkpoint: str) -> None:
    """After every rank finished every part of ``checkpoint`` (main process only): write the marker atomically."""
    record = {"global_step": trainer.state.global_step, **layout(trainer)}
    if getattr(trainer, "odc_dataset", None) is not None:
        record["dataset"] = trainer.odc_dataset
    temporary = os.path.join(checkpoint, f".{MARKER}.tmp")
    with open(temporary, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, os.path.join(checkpoint, MARKER))


# -- resuming ------------------------------------------------------------------------------------------------------
def read_marker(checkpoint: str) -> dict | None:
    try:
        with open(os.path.join(checkpoint, MARKER)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def checkpoints(output_dir: str) -> list[str]:
    """``checkpoint-N`` folders of ``output_dir``, by step."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name))]
    return [os.path.join(output_dir, name) for _, name in sorted(found) if os.path.isdir(os.path.join(output_dir, name))]


def last_complete(output_dir: str) -> str | None:
    complete = [c for c in checkpoints(output_dir) if read_marker(c) is not None]
    return complete[-1] if complete else None


LATEST = ("true", "last")
"""``resume_from_checkpoint`` words (any case) that mean what ``True`` means: the newest complete checkpoint in the
output directory. Command lines can only pass strings (``--resume_from_checkpoint true``: transformers' and TRL's
argument parsers keep the field a string), so the word stands for ``True``. A folder named so: ``./last``."""
NO_RESUME = ("false", "")
"""Words that mean ``False`` / ``None``: start from the beginning."""


def requested(resume_from_checkpoint):
    """``train()``'s ``resume_from_checkpoint`` as a user gives it (a bool, ``None``, a path, or a word of
    :data:`LATEST` / :data:`NO_RESUME` from a command line) -> ``True`` (the newest complete checkpoint), a path, or
    ``None``."""
    if isinstance(resume_from_checkpoint, str):
        word = resume_from_checkpoint.strip().lower()
        if word in LATEST:
            return True
        return None if word in NO_RESUME else resume_from_checkpoint
    return None if resume_from_checkpoint is False else resume_from_checkpoint


def resolve(trainer, resume_from_checkpoint, given=None):
    """The checkpoint to resume from: ``True`` -> the last complete one in the output directory; a path -> itself,
    if complete and holding every part the run needs. Raises, naming the part and the checkpoint, otherwise.
    ``given``: what the user passed (for the message when there is no checkpoint at all)."""
    if resume_from_checkpoint is True:
        found = checkpoints(trainer.args.output_dir)
        if not found:
            raise ValueError(
                f"resume_from_checkpoint={given if given is not None else True!r} resumes from the newest complete "
                f"checkpoint in the output directory {trainer.args.output_dir!r}, but it holds no checkpoint "
                f"({PREFIX_CHECKPOINT_DIR}-<step> folder). Start without resume_from_checkpoint, point output_dir at "
                "the run to continue, or pass a checkpoint folder"
            )
        chosen = last_complete(trainer.args.output_dir)
        skipped = found[found.index(chosen) + 1 :] if chosen else found
        if skipped and trainer.accelerator.is_main_process:
            logger.warning(
                "odc_hf: skipping %s: no %s, so the save did not finish (the job stopped while writing it)",
                ", ".join(os.path.basename(s) for s in skipped), MARKER,
            )  # fmt: skip
        if chosen is None:
            raise CheckpointPartMissing(found[-1], MARKER, "written last, once every rank has saved every part",
                                        f"is missing in every checkpoint of {trainer.args.output_dir}")  # fmt: skip
        resume_from_checkpoint = chosen
    check_parts(trainer, resume_from_checkpoint)
    return resume_from_checkpoint


def checkpoint_step(checkpoint: str) -> int:
    """The optimizer step a checkpoint was saved at (its ``trainer_state.json``; :func:`check_parts` checked it is
    there)."""
    with open(os.path.join(checkpoint, TRAINER_STATE_NAME)) as f:
        return int(json.load(f)["global_step"])


def check_parts(trainer, checkpoint: str) -> None:
    """Raise, naming the part and the checkpoint, when ``checkpoint`` lacks something the resumed run needs."""
    if not os.path.isdir(checkpoint):
        raise FileNotFoundError(f"resume_from_checkpoint={checkpoint!r}: no such checkpoint directory")
    if read_marker(checkpoint) is None:
        last = last_complete(os.path.dirname(os.path.abspath(checkpoint)))
        raise CheckpointPartMissing(
            checkpoint, MARKER, "written last, once every rank has saved every part",
            "is missing: its save did not finish (the job stopped while writing it), or another trainer or an older "
            f"odc_hf wrote it (if you know it is complete, write {{}} into {MARKER} there). The last complete "
            f"checkpoint beside it is {last}",
        )  # fmt: skip
    if not os.path.isfile(os.path.join(checkpoint, TRAINER_STATE_NAME)):
        # the Trainer would restart at step 0 with the checkpoint's weights, from the first sample
        raise CheckpointPartMissing(checkpoint, TRAINER_STATE_NAME, "the step, epoch and log to continue from")
    check_model_files(checkpoint, earlier=_earlier_complete(checkpoint))
    if reads_sharded_optimizer(trainer, checkpoint):
        check_sharded_parts(checkpoint, scheduler=True)  # the Trainer always builds a scheduler
    check_layout(trainer, checkpoint, read_marker(checkpoint))


def _earlier_complete(checkpoint: str) -> str | None:
    """The last complete checkpoint beside ``checkpoint`` with a lower step, or ``None``."""
    match = _CHECKPOINT.match(os.path.basename(os.path.normpath(checkpoint)))
    if match is None:
        return None
    earlier = [c for c in checkpoints(os.path.dirname(os.path.abspath(checkpoint)))
               if int(_CHECKPOINT.match(os.path.basename(c)).group(1)) < int(match.group(1))
               and read_marker(c) is not None]  # fmt: skip
    return earlier[-1] if earlier else None


def check_layout(trainer, checkpoint: str, saved: dict) -> None:
    """Another number of ranks is fine (DCP reshards the optimizer, the sampler plans every step for this world,
    and which samples form a step depends on the seed and the global batch only); another global batch is not: every
    step after the checkpoint would be another step than the run's, so it is refused, saying how to keep it."""
    if not saved:  # {} written by hand into a foreign checkpoint: nothing to compare with
        return
    saved_batch, saved_world = saved["global_batch_size"], saved["world_size"]
    batch, world = trainer.odc_global_batch_size, trainer.accelerator.num_processes
    if batch != saved_batch:
        if trainer.odc_config.global_batch_size is not None:
            ours = f"global_batch_size={batch}"
        else:
            ours = (f"per_device_train_batch_size {trainer.args.per_device_train_batch_size} x "
                    f"gradient_accumulation_steps {trainer.odc_folded_accumulation} x {world} processes")  # fmt: skip
        if trainer.odc_global_batch_option:
            keep = (f"set global_batch_size={saved_batch} (ODCConfig(global_batch_size={saved_batch}), "
                    f"--odc_global_batch_size {saved_batch} or ODC_GLOBAL_BATCH_SIZE={saved_batch})")  # fmt: skip
        else:
            keep = f"make per_device_train_batch_size x gradient_accumulation_steps x processes {saved_batch} again"
        moved = f"; on {world} ranks instead of {saved_world}," if world != saved_world else "; "
        raise ValueError(
            f"checkpoint {checkpoint} was trained with {saved_batch} samples per optimizer step on {saved_world} "
            f"ranks{moved} this run's settings give {batch} ({ours}). Resuming would silently change the run (every "
            f"later step would draw other samples). To continue the run with its batch, {keep}; to train on with "
            f"another batch, start a new run from the checkpoint's weights (model_name_or_path={checkpoint})"
        )
    if (world, saved.get("mesh")) != (saved_world, layout(trainer)["mesh"]) and trainer.accelerator.is_main_process:
        logger.warning(  # a notice: shown at transformers' default verbosity
            "odc_hf: resuming %s, written by %d ranks (mesh %s), on %d ranks (mesh %s): the global batch stays %d "
            "samples per optimizer step, the optimizer state is resharded and every step is planned for %d ranks",
            checkpoint, saved_world, saved.get("mesh"), world, layout(trainer)["mesh"], batch, world,
        )  # fmt: skip


def check_dataset(trainer, checkpoint: str, dataset: dict) -> None:
    """Resuming with another training dataset than the checkpoint's (``dataset``: :func:`dataset_record` of this run's):
    a warning on the main process giving both sizes and fingerprints. Not an error: as with TRL's own trainers, a run
    may go on with changed data on purpose (rows fixed, filtered or added); but the Trainer skips the steps already
    trained as if the data were the same, so the resumed steps are not the ones the checkpoint's run would have
    trained, and a smaller dataset has fewer steps per epoch."""
    saved = (read_marker(checkpoint) or {}).get("dataset")
    if not saved or not trainer.accelerator.is_main_process:
        return  # a checkpoint of an older odc_hf, or {} written by hand: nothing to compare with
    same_size = saved.get("num_samples") == dataset["num_samples"]
    fingerprints = saved.get("lengths_sha256"), dataset.get("lengths_sha256")
    if same_size and (None in fingerprints or fingerprints[0] == fingerprints[1]):
        return

    def describe(record):
        fingerprint = record.get("lengths_sha256")
        counts = f" (token-count fingerprint {fingerprint})" if fingerprint else ""
        return f"{record.get('num_samples')} samples{counts}"

    logger.warning(
        "odc_hf: resuming %s with another training dataset than the one it was trained on: the checkpoint's had %s, "
        "this run's has %s. The Trainer skips the %s steps already trained as if the data were the same, so the "
        "resumed steps train other samples than the checkpoint's run would have (and with fewer samples an epoch has "
        "fewer steps). To continue that run, resume with its dataset; to train on this data from the checkpoint's "
        "weights, start a new run from them (model_name_or_path=%s) instead of resuming",
        checkpoint, describe(saved), describe(dataset), (read_marker(checkpoint) or {}).get("global_step", "?"),
        checkpoint,
    )  # fmt: skip
