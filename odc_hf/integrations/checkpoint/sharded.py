"""Trainer checkpoints on the CPU path, where odc_hf (not accelerate) sharded the model with fully_shard.

The Trainer only knows how to save sharded optimizers for accelerate's FSDP; on the CPU path it would write
rank 0's optimizer shard alone. These two functions replace the Trainer's private
``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler`` for that path only (the mixin calls them;
those names are in ``TRAINER_HOOKS``, odc_hf/integrations/upstream/transformers.py): the optimizer goes
through torch.distributed.checkpoint (every rank writes its shard; DCP reshards on load, so a checkpoint of N ranks
loads on M), the scheduler is written by the main process as the Trainer does. Model weights are saved whole
(:func:`save_full_model`, through ``ODCMixin.save_model``) and the Trainer loads them before sharding.

A checkpoint that lacks what the run needs is an error naming the part and the checkpoint, never a silent fresh
optimizer (the Trainer's own loader skips a missing ``optimizer.pt`` without a word).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from odc_hf.integrations.upstream.transformers import TRAINING_ARGS_NAME

OPTIMIZER_DIR = "odc_optimizer"
SAFE_WEIGHTS_NAME = "model.safetensors"  # what save_pretrained writes for a model of one file
ADAPTER_NAME = "adapter_model.safetensors"  # and for a PEFT model
DCP_METADATA = ".metadata"  # written last by dcp.save's coordinator, once every rank's shard is on disk
SCHEDULER_NAME = "scheduler.pt"


RESUME_ADVICE = (
    "Resuming without it would silently change the run; resume from a complete checkpoint (resume_from_checkpoint=True "
    "takes the last complete one in the output directory)"
)


class CheckpointPartMissing(FileNotFoundError):
    """A checkpoint lacks (or cannot read) a part the resumed run needs."""

    def __init__(self, checkpoint: str, part: str, what: str, detail: str = "", advice: str = RESUME_ADVICE):
        self.checkpoint, self.part = checkpoint, part
        detail = detail or "is missing"
        super().__init__(f"checkpoint {checkpoint} cannot be resumed: {part} ({what}) {detail}. {advice}")


def _optimizer(trainer):
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)


def save_full_model(trainer, output_dir: str, state: dict | None = None) -> None:
    """What ``Trainer.save_model`` writes: a full state dict gathered on every rank (a collective), written from the
    main process with the processing class and ``training_args.bin``. ``state``: the gathered state dict (the main
    process's; accelerate's convention), else gathered here (the CPU path, where odc_hf sharded the model)."""
    if state is None:
        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # Tied parameters (lm_head / embed_tokens) come back as two gathered copies, which save_pretrained cannot
    # recognise as one tensor: make them one again, so that it drops the tied name as it does for its own
    # state dict (the model's _tied_weights_keys decide which).
    model = trainer.accelerator.unwrap_model(trainer.model)
    first_name: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first = first_name.setdefault(id(param), name)
        if first != name and first in state and name in state:
            state[name] = state[first]
    if trainer.accelerator.is_main_process:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(output_dir, state_dict=state)
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(output_dir)
        torch.save(trainer.args, Path(output_dir) / TRAINING_ARGS_NAME)  # as Trainer._save: tools read it
    trainer.accelerator.wait_for_everyone()


def load_full_model(trainer, checkpoint: str) -> None:
    """Load the whole weights :func:`save_full_model` wrote into the model odc_hf sharded (every rank reads the file
    and keeps its shards). A checkpoint without them (an adapter's alone, a missing file) or missing any weight but
    a tied copy raises :class:`CheckpointPartMissing`."""
    from safetensors.torch import load_file

    path = os.path.join(checkpoint, SAFE_WEIGHTS_NAME)
    index = os.path.join(checkpoint, SAFE_WEIGHTS_NAME + ".index.json")  # save_pretrained's files of a large model
    files = [path]
    if not os.path.isfile(path) and os.path.isfile(index):
        with open(index) as f:
            files = [os.path.join(checkpoint, name) for name in sorted(set(json.load(f)["weight_map"].values()))]
    if not all(os.path.isfile(file) for file in files):
        what = "the adapter's weights only" if os.path.isfile(os.path.join(checkpoint, ADAPTER_NAME)) else "no weights"
        raise CheckpointPartMissing(checkpoint, SAFE_WEIGHTS_NAME, "the model's whole weights", f"is missing ({what})",
                                    advice="load_best_model_at_end needs the whole model's weights; with an adapter, "
                                    "load it from trainer.state.best_model_checkpoint after training")  # fmt: skip
    state = {name: tensor for file in files for name, tensor in load_file(file, device="cpu").items()}
    model = trainer.accelerator.unwrap_model(trainer.model)
    absent = set(get_model_state_dict(model)) - set(state)
    missing = sorted(absent - missing_tied_keys(model, sorted(absent)))
    if missing:
        raise CheckpointPartMissing(checkpoint, SAFE_WEIGHTS_NAME, "the model's whole weights",
                                    f"lacks {len(missing)} of them ({', '.join(missing[:3])}, ...)")  # fmt: skip
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def save_optimizer_and_scheduler(trainer, output_dir: str) -> None:
    state = get_optimizer_state_dict(trainer.model, _optimizer(trainer))
    dcp.save({"optimizer": state}, checkpoint_id=os.path.join(output_dir, OPTIMIZER_DIR))
    if trainer.args.should_save and trainer.lr_scheduler is not None:
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


def check_sharded_parts(checkpoint: str, *, scheduler: bool) -> None:
    """Raise :class:`CheckpointPartMissing` when the sharded optimizer (or, with ``scheduler``, the scheduler) that
    :func:`save_optimizer_and_scheduler` writes is not in ``checkpoint``. Reads files only: every rank raises alike,
    before any collective."""
    path = os.path.join(checkpoint, OPTIMIZER_DIR)
    what = "the optimizer state, saved shard by shard with torch.distributed.checkpoint"
    if not os.path.isdir(path):
        raise CheckpointPartMissing(checkpoint, f"{OPTIMIZER_DIR}/", what)
    if not os.path.isfile(os.path.join(path, DCP_METADATA)):
        raise CheckpointPartMissing(checkpoint, f"{OPTIMIZER_DIR}/{DCP_METADATA}", what, "is missing (its save did "
                                    "not finish)")  # fmt: skip
    short = _short_shards(path)
    if short:
        raise CheckpointPartMissing(checkpoint, f"{OPTIMIZER_DIR}/{short[0]}", "a rank's optimizer shard, listed in "
                                    f"{OPTIMIZER_DIR}/{DCP_METADATA}", "is missing or cut short")  # fmt: skip
    if scheduler and not os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME)):
        raise CheckpointPartMissing(checkpoint, SCHEDULER_NAME, "the learning-rate scheduler's state")


def _short_shards(path: str) -> list[str]:
    """The shard files DCP's metadata lists that are absent or shorter than the data it records in them."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    needed: dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    return sorted(
        name for name, size in needed.items()
        if not os.path.isfile(os.path.join(path, name)) or os.path.getsize(os.path.join(path, name)) < size
    )  # fmt: skip


MODEL_DCP_PREFIX = "pytorch_model_fsdp"  # accelerate's FSDP_MODEL_NAME: sharded models, pytorch_model_fsdp_0/


def check_model_files(checkpoint: str, earlier: str | None) -> None:
    """Raise :class:`CheckpointPartMissing` naming the first damaged model file of ``checkpoint``: a ``.safetensors``
    file (the model, a shard, a PEFT adapter) whose header is unreadable or whose size is not the data end its header
    records, a shard ``model.safetensors.index.json`` lists that is not there, or accelerate's sharded model folder
    (``pytorch_model_fsdp_0/``) without its metadata or with a short shard. Reads headers and sizes only, never a
    tensor, so every rank raises alike before anything is loaded. ``earlier``: the last complete checkpoint before
    this one (the message offers it), or ``None``."""
    what = "the model weights"
    if earlier is not None:
        advice = (f"The checkpoint was damaged after its save (a copy or a disk that did not finish), and loading it "
                  f"would fail: resume from the earlier checkpoint {earlier} (resume_from_checkpoint={earlier!r}; True "
                  "would take this one again), or copy the file again from where the checkpoint came from")  # fmt: skip
    else:
        advice = ("The checkpoint was damaged after its save (a copy or a disk that did not finish), and loading it "
                  "would fail; no earlier complete checkpoint is beside it: copy the file again from where the "
                  "checkpoint came from, or start the run again")  # fmt: skip
    names = sorted(os.listdir(checkpoint))
    for name in names:
        if name.endswith(".index.json") and ".safetensors" in name:
            try:
                with open(os.path.join(checkpoint, name)) as f:
                    shards = sorted(set(json.load(f).get("weight_map", {}).values()))
            except (OSError, ValueError, AttributeError):
                raise CheckpointPartMissing(checkpoint, name, "the index of the model's shards", "cannot be read",
                                            advice) from None  # fmt: skip
            for shard in shards:
                if not os.path.isfile(os.path.join(checkpoint, shard)):
                    raise CheckpointPartMissing(checkpoint, shard, f"a shard of {what}, listed in {name}",
                                                "is missing", advice)  # fmt: skip
    for name in names:
        path = os.path.join(checkpoint, name)
        if name.endswith(".safetensors") and os.path.isfile(path):
            damage = safetensors_damage(path)
            if damage:
                raise CheckpointPartMissing(checkpoint, name, what, damage, advice)
        elif name.startswith(MODEL_DCP_PREFIX) and os.path.isdir(path):
            if not os.path.isfile(os.path.join(path, DCP_METADATA)):
                raise CheckpointPartMissing(checkpoint, f"{name}/{DCP_METADATA}", f"{what}, sharded", "is missing",
                                            advice)  # fmt: skip
            short = _short_shards(path)
            if short:
                raise CheckpointPartMissing(checkpoint, f"{name}/{short[0]}", f"a rank's shard of {what}",
                                            "is missing or cut short", advice)  # fmt: skip


def safetensors_damage(path: str) -> str | None:
    """Why the safetensors file at ``path`` cannot be complete, or ``None``. The format: 8 bytes (little-endian) giving
    the header's length, the JSON header (each tensor's ``data_offsets`` into the data that follows), then the data;
    a complete file ends where the last tensor's data ends. Reads the header only."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return f"is cut short ({size} bytes: not even a safetensors header)"
        header_length = int.from_bytes(prefix, "little")
        if header_length > size - 8:
            return f"is cut short ({size} bytes; its header alone should take {header_length + 8})"
        try:
            header = json.loads(f.read(header_length))
            ends = [int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"]
            end = max(ends, default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "has an unreadable safetensors header"
    expected = 8 + header_length + end
    if size != expected:
        cut = "is cut short" if size < expected else "is longer than its header says"
        return f"{cut} ({size:,} bytes; its header records {expected:,})"
    return None


def load_optimizer_and_scheduler(trainer, checkpoint: str) -> None:
    """Load what :func:`save_optimizer_and_scheduler` wrote (on any number of ranks); raise
    :class:`CheckpointPartMissing` if a part is missing or unreadable."""
    check_sharded_parts(checkpoint, scheduler=trainer.lr_scheduler is not None)
    path = os.path.join(checkpoint, OPTIMIZER_DIR)
    optimizer = _optimizer(trainer)
    state = {"optimizer": get_optimizer_state_dict(trainer.model, optimizer)}
    try:
        dcp.load(state, checkpoint_id=path)  # collective; a read error on one rank is raised on every rank
    except (Exception, dcp.CheckpointException) as err:  # DCP's (a BaseException) carries each rank's error
        raise CheckpointPartMissing(checkpoint, f"{OPTIMIZER_DIR}/", "the optimizer state",
                                    f"cannot be read ({_reason(err)})") from err  # fmt: skip
    set_optimizer_state_dict(trainer.model, optimizer, optim_state_dict=state["optimizer"])
    if trainer.lr_scheduler is not None:
        trainer.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))


def _reason(err: BaseException) -> str:
    """One line per distinct failure: a CheckpointException's per-rank errors (its text is their full tracebacks)."""
    failures = getattr(err, "failures", None)
    errors = [exc for exc, _ in failures.values()] if failures else [err]
    return "; ".join(dict.fromkeys(f"{type(e).__name__}: {e}"[:300] for e in errors))


def missing_tied_keys(model: torch.nn.Module, missing: list[str]) -> set[str]:
    """The names in ``missing`` that are tied to (the same tensor as) a name that is not missing: loading that name
    loaded them too. ``save_pretrained`` drops a tied copy (``lm_head.weight`` of a model whose head shares the
    embedding), so a correct checkpoint always "misses" it."""
    owner: dict[int, set[str]] = {}
    for name, tensor in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        owner.setdefault(id(tensor), set()).add(name)
    by_name = {name: names for names in owner.values() for name in names}
    absent = set(missing)
    return {name for name in absent if by_name.get(name, set()) - absent}


def check_trainer_optimizer(checkpoint: str, *, scheduler: bool) -> None:
    """On the paths where the Trainer itself loads the optimizer (accelerate's FSDP2 on GPUs, one process): the files
    its loader looks for (``optimizer.pt``, accelerate's ``optimizer*.bin`` / ``optimizer_*`` folder, and the
    scheduler), whose absence it skips without a word."""
    names = os.listdir(checkpoint)
    if not any(n.startswith("optimizer") for n in names):
        raise CheckpointPartMissing(checkpoint, "optimizer.pt (or accelerate's optimizer_0/)", "the optimizer state")
    if scheduler and SCHEDULER_NAME not in names:
        raise CheckpointPartMissing(checkpoint, SCHEDULER_NAME, "the learning-rate scheduler's state")
