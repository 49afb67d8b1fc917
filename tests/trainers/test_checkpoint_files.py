"""The CPU-sharded save path writes the files TRL's own run writes (2 CPU processes as accelerate launch starts them), in the
output directory (``trainer.save_model()``) and in every checkpoint, so tools that read them (``training_args.bin``,
``trainer_state.json``, the tokenizer, ...) keep working. The differences: the optimizer, saved shard by shard
(``odc_optimizer/``, torch.distributed.checkpoint) instead of ``optimizer.pt``, and the completion marker
``odc_checkpoint.json`` (odc_hf/integrations/checkpoint/resume.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from launched import run_launched

SCRIPT = textwrap.dedent(
    """
    import sys

    from trl import SFTConfig, SFTTrainer

    from odc_hf import ODCConfig, ODCSFTTrainer
    from odc_hf.testing.data import default_text_dataset, default_tokenizer, tiny_qwen2_model

    tokenizer = default_tokenizer()
    for kind in ("trl", "odc"):
        args = SFTConfig(output_dir=f"{sys.argv[1]}/{kind}", max_steps=2, per_device_train_batch_size=2,
                         save_strategy="steps", save_steps=2, max_length=128, packing=False, bf16=False,
                         logging_steps=1, report_to="none", disable_tqdm=True)
        extra = {"odc_config": ODCConfig(log_timeline=False)} if kind == "odc" else {}
        trainer = (ODCSFTTrainer if kind == "odc" else SFTTrainer)(
            model=tiny_qwen2_model(tokenizer), args=args, train_dataset=default_text_dataset(16),
            processing_class=tokenizer, **extra)
        trainer.train()
        trainer.save_model()
    """
)


def files(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}


def test_cpu_sharded_save_writes_the_files_trl_writes(tmp_path):
    script = tmp_path / "save_both.py"
    script.write_text(SCRIPT)
    run_launched(script, tmp_path / "out", timeout_s=600)  # 2 CPU ranks, as accelerate launch starts them
    trl, odc = files(tmp_path / "out/trl"), files(tmp_path / "out/odc")
    assert "training_args.bin" in trl and "checkpoint-2/training_args.bin" in trl  # what the comparison is about
    sharded_optimizer = {f for f in odc if f.startswith("checkpoint-2/odc_optimizer/")}
    assert sharded_optimizer, odc
    assert "checkpoint-2/odc_checkpoint.json" in odc  # the completion marker, written last
    assert odc - sharded_optimizer - {"checkpoint-2/odc_checkpoint.json"} == trl - {"checkpoint-2/optimizer.pt"}, (
        sorted(odc), sorted(trl))  # fmt: skip
    _assert_same_contents(tmp_path / "out/trl", tmp_path / "out/odc")


def _assert_same_contents(trl: Path, odc: Path) -> None:
    """What the files hold, not only their names: the same tensors (names, shapes, dtypes; the two runs train other
    samples, so not the same values), a checkpoint's model equal to the final one it was saved at, the same
    tokenizer, a trainer state at the same step with the same logged keys, training arguments that load."""
    import json

    import torch
    from safetensors.torch import load_file

    for run in (trl, odc):
        final, saved = load_file(run / "model.safetensors"), load_file(run / "checkpoint-2/model.safetensors")
        assert final.keys() == saved.keys() and all(torch.equal(final[k], saved[k]) for k in final), run
    ours, theirs = load_file(odc / "model.safetensors"), load_file(trl / "model.safetensors")
    assert {k: (v.shape, v.dtype) for k, v in ours.items()} == {k: (v.shape, v.dtype) for k, v in theirs.items()}
    assert all(torch.isfinite(v).all() for v in ours.values())
    assert (odc / "tokenizer.json").read_bytes() == (trl / "tokenizer.json").read_bytes()
    states = [json.loads((run / "checkpoint-2/trainer_state.json").read_text()) for run in (trl, odc)]
    assert [s["global_step"] for s in states] == [2, 2]
    logged = [[sorted(h) for h in s["log_history"] if "loss" in h] for s in states]
    assert len(logged[0]) == len(logged[1]) == 2 and all(set(a) <= set(b) for a, b in zip(*logged)), logged
    for run in (trl, odc):
        args = torch.load(run / "training_args.bin", weights_only=False)
        assert (args.max_steps, args.save_steps, Path(args.output_dir)) == (2, 2, run), args


@pytest.mark.parametrize("tied", [True, False])
def test_a_final_save_under_sharded_state_dicts_writes_the_whole_model(tmp_path, monkeypatch, tied):
    """Under accelerate's FSDP with SHARDED_STATE_DICT (accelerate_configs/odc.yaml) ``Trainer.save_model`` writes
    no weights (its checkpoints save the shards); the ODC trainers' ``save_model`` called by the user (a TRL script's
    last line) writes the whole model from the gathered state dict, tied weights as transformers writes them. The
    gather stands in here as copies of one process's tensors (the GPU recipe test runs the real one)."""
    from types import SimpleNamespace

    import torch
    from datasets import Dataset
    from safetensors.torch import load_file
    from transformers import TrainingArguments

    from odc_hf import ODCConfig, ODCTrainer
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    tokenizer = default_tokenizer()
    model = tiny_qwen2_model(tokenizer, tie_word_embeddings=tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    args = TrainingArguments(output_dir=str(tmp_path / "run"), report_to="none", use_cpu=True, max_steps=1)
    data = Dataset.from_dict({"input_ids": [[1, 2, 3]] * 4})
    trainer = ODCTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                         odc_config=ODCConfig(max_tokens_per_microbatch=64))  # fmt: skip
    monkeypatch.setattr(trainer, "is_fsdp_enabled", True, raising=False)
    monkeypatch.setattr(trainer.accelerator.state, "fsdp_plugin",
                        SimpleNamespace(state_dict_type="StateDictType.SHARDED_STATE_DICT"), raising=False)  # fmt: skip
    gathered = {k: v.detach().clone() for k, v in model.state_dict().items()}  # tied: two copies, as gathered
    monkeypatch.setattr(trainer.accelerator, "get_state_dict", lambda m, unwrap=True: dict(gathered))
    pushes = []  # pushed as Trainer.save_model pushes: the user's save only, to the configured revision
    monkeypatch.setattr(trainer.args, "push_to_hub", True)
    monkeypatch.setattr(trainer.args, "hub_revision", "odc-test")
    monkeypatch.setattr(trainer, "push_to_hub", lambda **kw: pushes.append(kw))
    trainer.save_model(str(tmp_path / "checkpointish"), _internal_call=True)  # the Trainer's own checkpoint call
    assert not list((tmp_path / "checkpointish").glob("*.safetensors"))  # transformers: nothing for the shards
    trainer.save_model(str(tmp_path / "final"))
    assert pushes == [{"commit_message": "Model save", "revision": "odc-test"}], pushes
    saved = load_file(tmp_path / "final" / "model.safetensors")
    model.save_pretrained(tmp_path / "reference")
    want = load_file(tmp_path / "reference" / "model.safetensors")
    assert saved.keys() == want.keys() and all(torch.equal(saved[k], want[k]) for k in want)
    assert {"tokenizer_config.json", "training_args.bin", "config.json"} <= files(tmp_path / "final")
