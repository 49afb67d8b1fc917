"""What a resume checks beyond the checkpoint's parts (one process, in this process: ODCSFTTrainer on a tiny model):

- the model files: a ``model.safetensors`` cut short (a copy that did not finish), a shard that a sharded model's
  ``model.safetensors.index.json`` lists but that is missing, an index that cannot be read, and accelerate's sharded
  model folder (``pytorch_model_fsdp_0/``) without its metadata or with a shard cut short, are each named before
  anything loads, with the earlier checkpoint to resume from, instead of the loader's own error without the
  checkpoint's name. For every damage the library's own loader (transformers', safetensors', DCP's) is shown to fail
  on it too (so the check refuses nothing loadable), and the intact files pass (a sharded model resumes);
- the training data: resuming with another dataset than the checkpoint saw warns, giving both sizes and
  fingerprints (the checkpoint marker records them): 8 samples where it had 16, and 16 samples of other content or
  in another order (the same size: only the token-count fingerprint tells them apart);
- the notices odc_hf gives about settings it changed (gradient accumulation folded into the minibatch, a checkpoint
  resumed on another number of ranks) are warnings, shown at transformers' default verbosity.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from types import SimpleNamespace

import pytest

SAMPLES, PER_DEVICE, ACCUMULATION = 16, 4, 2  # 8 samples per step: 2 steps per epoch


class _Warnings(logging.Handler):
    """odc_hf's warnings as a user sees them: records that pass odc_hf's loggers at their default level."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _trainer(out, num_samples: int, *, seed: int = 0, reverse: bool = False):
    from odc_hf import ODCConfig, ODCSFTConfig, ODCSFTTrainer
    from odc_hf.testing.data import default_text_dataset, default_tokenizer, tiny_qwen2_model

    tokenizer = default_tokenizer()
    args = ODCSFTConfig(output_dir=str(out), max_steps=2, per_device_train_batch_size=PER_DEVICE,
                        gradient_accumulation_steps=ACCUMULATION, save_strategy="steps", save_steps=1, max_length=256,
                        packing=False, bf16=False, use_cpu=True, logging_steps=1, report_to="none",
                        disable_tqdm=True)  # fmt: skip
    data = default_text_dataset(num_samples, max_chars=300, seed=seed)
    if reverse:
        data = data.select(range(num_samples - 1, -1, -1))
    return ODCSFTTrainer(model=tiny_qwen2_model(tokenizer), args=args, train_dataset=data, processing_class=tokenizer,
                         odc_config=ODCConfig(log_timeline=False))  # fmt: skip


def _warnings_of(fn):
    handler = _Warnings()
    logging.getLogger("odc_hf").addHandler(handler)
    try:
        return fn(), handler.lines
    finally:
        logging.getLogger("odc_hf").removeHandler(handler)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """2 steps of 16 samples with a checkpoint after each; the warnings building the trainer gave."""
    before = dict(os.environ)  # the Accelerator sets variables; conftest restores them only around each test
    os.environ["ACCELERATE_USE_CPU"] = "true"
    try:
        out = tmp_path_factory.mktemp("resume_data") / "run"
        trainer, warnings = _warnings_of(lambda: _trainer(out, SAMPLES))
        trainer.train()
    finally:
        os.environ.clear()
        os.environ.update(before)
    return out, warnings


def test_folded_gradient_accumulation_is_a_notice_users_see(saved_run):
    _, warnings = saved_run
    folded = [w for w in warnings if "gradient_accumulation_steps=2 becomes part of the minibatch" in w]
    assert len(folded) == 1 and "gradient_accumulation_steps set to 1" in folded[0], warnings


def test_the_marker_records_the_dataset(saved_run):
    out, _ = saved_run
    marker = json.loads((out / "checkpoint-2" / "odc_checkpoint.json").read_text())
    assert marker["dataset"]["num_samples"] == SAMPLES and len(marker["dataset"]["lengths_sha256"]) == 16, (
        marker
    )


def test_resuming_with_another_dataset_warns_with_both_sizes(saved_run, tmp_path, monkeypatch):
    out, _ = saved_run
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    run = shutil.copytree(out, tmp_path / "run")
    same, warnings = _warnings_of(lambda: _trainer(run, SAMPLES))
    _, warnings = _warnings_of(lambda: same.train(resume_from_checkpoint=True))
    assert not [w for w in warnings if "another training dataset" in w], warnings
    smaller = _trainer(run, SAMPLES // 2)
    _, warnings = _warnings_of(lambda: smaller.train(resume_from_checkpoint=True))
    changed = [w for w in warnings if "another training dataset" in w]
    assert len(changed) == 1, warnings
    marker = json.loads((run / "checkpoint-2" / "odc_checkpoint.json").read_text())
    fingerprint = marker["dataset"]["lengths_sha256"]
    assert (
        f"the checkpoint's had 16 samples (token-count fingerprint {fingerprint}), this run's has 8 samples"
        in (changed[0])
    ), changed[0]
    assert f"{run / 'checkpoint-2'}" in changed[0] and "skips the 2 steps already trained" in changed[0], (
        changed[0]
    )


@pytest.mark.parametrize("change", ["other_samples", "other_order"])
def test_resuming_with_a_dataset_of_the_same_size_but_other_content_warns(saved_run, tmp_path, monkeypatch, change):
    """The fingerprint branch: the sizes agree, so only the token-count fingerprint can tell. Reference: the texts
    themselves differ (other documents, or the same ones in reverse order). The fingerprint hashes the samples' token
    counts: samples all truncated to one length (max_length 64 here, before) look alike, so max_length keeps every
    sample whole."""
    from odc_hf.testing.data import default_text_dataset

    out, _ = saved_run
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    run = shutil.copytree(out, tmp_path / "run")
    options = {"seed": 1} if change == "other_samples" else {"reverse": True}
    saved_texts = default_text_dataset(SAMPLES, max_chars=300)["text"]
    assert saved_texts != (default_text_dataset(SAMPLES, max_chars=300, seed=1)["text"] if options.get("seed")
                           else saved_texts[::-1])  # fmt: skip
    other = _trainer(run, SAMPLES, **options)
    _, warnings = _warnings_of(lambda: other.train(resume_from_checkpoint=True))
    changed = [w for w in warnings if "another training dataset" in w]
    assert len(changed) == 1, warnings
    saved = json.loads((run / "checkpoint-2" / "odc_checkpoint.json").read_text())["dataset"]["lengths_sha256"]
    ours = other.odc_dataset["lengths_sha256"]
    assert ours != saved and len(ours) == 16
    assert (f"the checkpoint's had 16 samples (token-count fingerprint {saved}), this run's has 16 samples "
            f"(token-count fingerprint {ours})") in changed[0], changed[0]  # fmt: skip


def _resume_error(run, **options):
    """Resume ``run``'s last checkpoint with a fresh trainer; the CheckpointPartMissing it raises (and the step)."""
    from odc_hf.integrations.checkpoint.sharded import CheckpointPartMissing

    trainer = _trainer(run, SAMPLES)
    with pytest.raises(CheckpointPartMissing) as caught:
        trainer.train(resume_from_checkpoint=True)  # the marker is there: the save itself had finished
    assert trainer.state.global_step == 0  # nothing was loaded or trained
    return str(caught.value)


def _shard(checkpoint) -> list:
    """Rewrite the checkpoint's model as transformers writes a large one: several safetensors shards and an index.
    Returns the shard names."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    (checkpoint / "model.safetensors").unlink()
    model.save_pretrained(checkpoint, max_shard_size="400KB")
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2, shards
    return shards


def test_a_sharded_model_resumes_and_its_damaged_index_or_missing_shard_is_named(saved_run, tmp_path, monkeypatch):
    from transformers.trainer import load_sharded_checkpoint  # what the Trainer loads a sharded model with

    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    out, _ = saved_run
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    intact = shutil.copytree(out, tmp_path / "intact")
    shards = _shard(intact / "checkpoint-2")
    trainer = _trainer(intact, SAMPLES)
    trainer.train(resume_from_checkpoint=True)  # the intact sharded model loads (nothing left to train)
    assert trainer.state.global_step == 2

    # transformers' own loader is the reference of what the damage does: the intact files load, each damaged copy
    # raises its own error. strict=False: the tied lm_head is not in the files (strict loading fails on the intact
    # checkpoint too, "Missing key(s): lm_head.weight", so it would tell nothing about the damage)
    load_sharded_checkpoint(tiny_qwen2_model(default_tokenizer()), str(intact / "checkpoint-2"), strict=False)

    def library_fails(checkpoint, kind, words) -> None:
        with pytest.raises(kind, match=words):
            load_sharded_checkpoint(tiny_qwen2_model(default_tokenizer()), str(checkpoint), strict=False)

    missing = shutil.copytree(intact, tmp_path / "missing")
    (missing / "checkpoint-2" / shards[-1]).unlink()
    library_fails(missing / "checkpoint-2", FileNotFoundError, f"No such file or directory: .*{re.escape(shards[-1])}")
    message = _resume_error(missing)
    assert (f"checkpoint {missing / 'checkpoint-2'} cannot be resumed: {shards[-1]} (a shard of the model weights, "
            "listed in model.safetensors.index.json) is missing") in message, message  # fmt: skip
    assert f"resume from the earlier checkpoint {missing / 'checkpoint-1'}" in message, message

    unreadable = shutil.copytree(intact, tmp_path / "unreadable")
    index = unreadable / "checkpoint-2" / "model.safetensors.index.json"
    index.write_text(index.read_text()[: len(index.read_text()) // 2])  # a copy that did not finish
    library_fails(unreadable / "checkpoint-2", json.JSONDecodeError, r"line \d+ column \d+")
    message = _resume_error(unreadable)
    assert (f"checkpoint {unreadable / 'checkpoint-2'} cannot be resumed: model.safetensors.index.json (the index of "
            "the model's shards) cannot be read") in message, message  # fmt: skip


def test_accelerates_sharded_model_folder_without_metadata_or_with_a_short_shard_is_named(tmp_path):
    """accelerate's FSDP checkpoints keep the model in ``pytorch_model_fsdp_0/`` (torch.distributed.checkpoint: shard
    files and a ``.metadata`` written last). Written here with DCP itself; DCP's own load is the reference."""
    import torch
    import torch.distributed.checkpoint as dcp

    from odc_hf.integrations.checkpoint.sharded import CheckpointPartMissing, check_model_files

    state = {"model.embed_tokens.weight": torch.randn(512, 64), "model.norm.weight": torch.ones(64)}

    def write(name):
        checkpoint = tmp_path / name
        dcp.save(state, checkpoint_id=str(checkpoint / "pytorch_model_fsdp_0"))
        return checkpoint

    def dcp_loads(checkpoint) -> bool:
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        try:
            dcp.load(target, checkpoint_id=str(checkpoint / "pytorch_model_fsdp_0"))
        except (Exception, dcp.CheckpointException):  # noqa: BLE001 - DCP's own error (a BaseException)
            return False
        return all(torch.equal(target[k], v) for k, v in state.items())

    intact = write("intact")
    check_model_files(str(intact), earlier=None)
    assert dcp_loads(intact)
    shard = next(p for p in (intact / "pytorch_model_fsdp_0").iterdir() if p.suffix == ".distcp")

    no_metadata = write("no_metadata")
    (no_metadata / "pytorch_model_fsdp_0" / ".metadata").unlink()
    assert not dcp_loads(no_metadata)
    with pytest.raises(CheckpointPartMissing, match=r"pytorch_model_fsdp_0/\.metadata \(the model weights, sharded\) "
                       r"is missing"):  # fmt: skip
        check_model_files(str(no_metadata), earlier=str(intact))

    short = write("short")
    path = short / "pytorch_model_fsdp_0" / shard.name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert not dcp_loads(short)
    with pytest.raises(CheckpointPartMissing, match=rf"pytorch_model_fsdp_0/{shard.name} \(a rank's shard of the "
                       r"model weights\) is missing or cut short"):  # fmt: skip
        check_model_files(str(short), earlier=str(intact))


def test_a_model_file_cut_short_is_named_with_the_checkpoint_to_use(saved_run, tmp_path, monkeypatch):
    from odc_hf.integrations.checkpoint.sharded import CheckpointPartMissing

    out, _ = saved_run
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    run = shutil.copytree(out, tmp_path / "run")
    weights = run / "checkpoint-2" / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    trainer = _trainer(run, SAMPLES)
    with pytest.raises(CheckpointPartMissing) as caught:
        trainer.train(resume_from_checkpoint=True)  # the marker is there: the save itself had finished
    message = str(caught.value)
    assert f"checkpoint {run / 'checkpoint-2'} cannot be resumed: model.safetensors (the model weights) is cut short (" \
           f"{size // 2:,} bytes; its header records {size:,})" in message, message  # fmt: skip
    assert f"resume from the earlier checkpoint {run / 'checkpoint-1'}" in message, message
    assert trainer.state.global_step == 0  # nothing was loaded or trained


def test_safetensors_headers_are_checked_without_loading_tensors(tmp_path):
    import torch
    from safetensors.torch import save_file

    from odc_hf.integrations.checkpoint.sharded import safetensors_damage

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(64), "b": torch.ones(3, 5)}, path)
    assert safetensors_damage(str(path)) is None
    whole = path.read_bytes()
    for cut, expected in ((4, "not even a safetensors header"), (20, "its header alone should take"),
                          (len(whole) - 1, f"is cut short ({len(whole) - 1:,} bytes; its header records "
                                           f"{len(whole):,})")):  # fmt: skip
        path.write_bytes(whole[:cut])
        assert expected in (safetensors_damage(str(path)) or ""), cut
    path.write_bytes(whole + b"\0")
    assert "is longer than its header says" in safetensors_damage(str(path))
    path.write_bytes(whole[:8] + b"{not json" + whole[17:])
    assert safetensors_damage(str(path)) == "has an unreadable safetensors header"


def test_resuming_on_another_number_of_ranks_is_a_notice_users_see():
    from odc_hf.config import ODCConfig
    from odc_hf.integrations.checkpoint.resume import check_layout

    accelerator = SimpleNamespace(num_processes=3, is_main_process=True, torch_device_mesh=None)
    trainer = SimpleNamespace(accelerator=accelerator, odc_global_batch_size=8,
                              odc_config=ODCConfig(global_batch_size=8))  # fmt: skip
    saved = {"global_step": 4, "world_size": 2, "mesh": [2], "global_batch_size": 8}
    _, warnings = _warnings_of(lambda: check_layout(trainer, "out/checkpoint-4", saved))
    assert (
        len(warnings) == 1
        and "resuming out/checkpoint-4, written by 2 ranks (mesh [2]), on 3 ranks" in warnings[0]
    )


def test_the_words_a_command_line_passes_for_resuming():
    from odc_hf.integrations.checkpoint.resume import requested

    for word in ("true", "True", "TRUE", "last", "Last", " last "):
        assert requested(word) is True, word  # what resume_from_checkpoint=True means
    for word in ("false", "False", ""):
        assert requested(word) is None, word
    assert requested(True) is True and requested(False) is None and requested(None) is None
    assert requested("out/checkpoint-2") == "out/checkpoint-2" and requested("./last") == "./last"


@pytest.mark.parametrize("word", ["true", "last"])
def test_true_or_last_resumes_the_newest_complete_checkpoint(saved_run, tmp_path, monkeypatch, capsys, word):
    # `--resume_from_checkpoint true` reaches train() as the string "true" (transformers' and TRL's parsers keep the
    # field a string); it was taken for a folder named "true". checkpoint-3 is newer but unfinished (no marker):
    # transformers' own get_last_checkpoint would take it; the newest COMPLETE one is checkpoint-2.
    out, _ = saved_run
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    run = shutil.copytree(out, tmp_path / "run")
    shutil.copytree(run / "checkpoint-2", run / "checkpoint-3")
    (run / "checkpoint-3" / "odc_checkpoint.json").unlink()
    trainer = _trainer(run, SAMPLES)
    capsys.readouterr()
    trainer.train(resume_from_checkpoint=word)
    assert trainer._odc_resume_checkpoint == str(run / "checkpoint-2")
    assert trainer.state.global_step == 2  # resumed at step 2 of 2: nothing left to train
    # the user is told which checkpoint resumed: when training starts, and in the run's summary line (its last)
    printed = capsys.readouterr().out.strip().splitlines()
    assert f"odc_hf: resuming from {run / 'checkpoint-2'} (step 2)" in printed, printed
    assert printed[-1].startswith("odc_hf summary (single process, no ODC, lb_mini, 1 processes, 2 steps): final loss ")
    assert printed[-1].endswith(f"; resumed from {run / 'checkpoint-2'} (step 2)"), printed[-1]


def test_a_run_ends_with_its_summary_line(tmp_path, monkeypatch, capsys):
    """Every run of an ODC trainer (a notebook's ``trainer.train()`` here) ends with one line: loss, tokens/s,
    microbatches; no "resumed from" part when it did not resume."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    trainer = _trainer(tmp_path / "run", SAMPLES)
    capsys.readouterr()
    trainer.train()
    printed = capsys.readouterr().out.strip().splitlines()
    loss = [h["loss"] for h in trainer.state.log_history if "loss" in h][-1]
    assert printed[-1] == trainer.odc_summary_text, printed[-3:]
    assert printed[-1].startswith(
        f"odc_hf summary (single process, no ODC, lb_mini, 1 processes, 2 steps): final loss {loss:.4f}, tokens/s "
    ), printed[-1]
    assert re.search(r"tokens/s \d+, microbatches per rank \d+-\d+$", printed[-1]), printed[-1]  # nothing resumed


def test_true_without_any_checkpoint_says_so_before_anything_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    trainer = _trainer(tmp_path / "fresh", SAMPLES)
    with pytest.raises(ValueError, match=r"resume_from_checkpoint='true' resumes from the newest complete checkpoint "
                                         r"in the output directory .*fresh.*, but it holds no checkpoint"):  # fmt: skip
        trainer.train(resume_from_checkpoint="true")
    assert trainer.state.global_step == 0
