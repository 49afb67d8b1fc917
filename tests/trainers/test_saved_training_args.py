"""``training_args.bin`` records the user's ``gradient_accumulation_steps`` (issue 29, carried): the ODC trainers run
the Trainer with 1 (the accumulation is folded into each step's bundle), and the file used to say 1. Checked on the
CPU-sharded save path (2 ranks) and on the Trainer's own save path (one process, what the GPU path uses), in the
output directory and in a checkpoint; the running trainer keeps its folded 1."""

from __future__ import annotations

from pathlib import Path

import torch

from odc_hf.testing import run_ranks


def _train_and_save(rank, world, output_dir):
    from datasets import Dataset
    from fsdp_helpers import tiny_qwen2
    from transformers import TrainingArguments

    from odc_hf import ODCConfig, ODCTrainer

    args = TrainingArguments(output_dir=output_dir, max_steps=1, per_device_train_batch_size=2,
                             gradient_accumulation_steps=3, use_cpu=True, report_to="none", disable_tqdm=True,
                             save_strategy="steps", save_steps=1)  # fmt: skip
    data = Dataset.from_dict({"input_ids": [[5, 6, 7, 8, 9, 10]] * 12})
    trainer = ODCTrainer(model=tiny_qwen2(), args=args, train_dataset=data, odc_config=ODCConfig(log_timeline=False))
    trainer.train()
    trainer.save_model()
    if trainer.odc is not None:
        trainer.odc.close()
    return trainer.args.gradient_accumulation_steps, args.gradient_accumulation_steps


def _saved(folder: Path) -> list[int]:
    return [torch.load(f, weights_only=False).gradient_accumulation_steps
            for f in (folder / "training_args.bin", folder / "checkpoint-1" / "training_args.bin")]  # fmt: skip


def test_training_args_bin_records_the_users_accumulation(tmp_path, monkeypatch):
    for rank_result in run_ranks(_train_and_save, 2, str(tmp_path / "two"), env={"ACCELERATE_USE_CPU": "true"}):
        assert rank_result == (1, 3)  # the trainer runs with the folded 1; the user's object is untouched
    assert _saved(tmp_path / "two") == [3, 3]
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    assert _train_and_save(0, 1, str(tmp_path / "one")) == (1, 3)
    assert _saved(tmp_path / "one") == [3, 3]
