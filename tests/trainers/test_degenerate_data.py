"""Degenerate training data says what is wrong with the data (issue 29, defects 3 and 4), in one process.

- An empty dataset on the SFT path: TRL's ``SFTTrainer.__init__`` reads the first row, which gave a bare
  ``StopIteration`` before odc_hf's own check ran; ``examples/sft.py --num_samples 0`` likewise.
- Every sample tokenized to nothing (or to one token, as every ``""`` text does: just the EOS): no next-token target
  anywhere. That is an error naming the data; it used to surface as "max_tokens_per_microbatch must be a positive
  integer, got 0" (a setting the user never set), or as training at loss 0.0.
- A step whose whole minibatch has no label token (every target masked) trains at loss 0.0: a warning naming the step
  and the masks, as a TRL user would want it (TRL itself says nothing), not an error (one such step can be legitimate).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")


def _sft_trainer(tmp_path, texts: list[str]):
    from datasets import Dataset

    from odc_hf import ODCSFTConfig, ODCSFTTrainer
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    tokenizer = default_tokenizer()
    args = ODCSFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, use_cpu=True,
                        report_to="none", disable_tqdm=True, packing=False, save_strategy="no")  # fmt: skip
    return ODCSFTTrainer(model=tiny_qwen2_model(tokenizer), args=args, processing_class=tokenizer,
                         train_dataset=Dataset.from_dict({"text": texts}))  # fmt: skip


def test_an_empty_dataset_on_the_sft_path_is_named(tmp_path, cpu):
    with pytest.raises(ValueError, match=r"^train_dataset is empty \(0 samples\)"):
        _sft_trainer(tmp_path, [])
    # positionally too (Trainer's order: model, args, data_collator, train_dataset)
    from datasets import Dataset
    from transformers import TrainingArguments

    from odc_hf import ODCTrainer
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=r"^train_dataset is empty"):
        ODCTrainer(tiny_qwen2_model(default_tokenizer()), args, None, Dataset.from_dict({"input_ids": []}))


def test_sft_example_refuses_bad_settings_before_launching(capsys):
    from example_scripts import load_example

    sft = load_example("sft")
    with pytest.raises(SystemExit):
        sft.parse_args(["--num_samples", "0"])
    assert "--num_samples must be at least 1, got 0" in capsys.readouterr().err
    # the other settings it can check before launching (issue 29, defect 6): the budget, a local model path
    with pytest.raises(SystemExit):
        sft.parse_args(["--max_tokens_per_microbatch", "0"])
    assert "max_tokens_per_microbatch must be a positive integer, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sft.parse_args(["--model_name_or_path", "./no_such_model"])
    assert "--model_name_or_path './no_such_model' is not a directory" in capsys.readouterr().err
    assert sft.parse_args(["--odc", "off"]).odc == "off"  # validated with the LB-Micro plan main() gives it


def test_every_text_empty_is_an_error_about_the_data(tmp_path, cpu):
    trainer = _sft_trainer(tmp_path, [""] * 4)  # TRL keeps them: each is one token (EOS), no next-token target
    with pytest.raises(ValueError, match=r"every one of the 4 training samples tokenized to 1 token\(s\) or fewer"):
        trainer.train()


def test_every_sample_tokenized_to_nothing_is_an_error_about_the_data():
    from datasets import Dataset

    from odc_hf.integrations.trainer.train_data import train_lengths

    with pytest.raises(ValueError, match=r"every one of the 3 training samples tokenized to 0 token\(s\)") as err:
        train_lengths(Dataset.from_dict({"input_ids": [[], [], []]}))
    assert "max_tokens_per_microbatch" not in str(err.value)
    assert train_lengths(Dataset.from_dict({"input_ids": [[], [5, 6]]})) == [0, 2]  # one sample to learn from: fine


def test_a_step_without_label_tokens_warns_with_the_step_and_the_masks(tmp_path, cpu):
    from datasets import Dataset
    from fsdp_helpers import tiny_qwen2
    from transformers import TrainingArguments

    from odc_hf import ODCTrainer

    ids = [[5, 6, 7, 8, 9]] * 4
    data = Dataset.from_dict({"input_ids": ids, "completion_mask": [[0] * 5] * 4})  # every target masked
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, use_cpu=True,
                             report_to="none", disable_tqdm=True, save_strategy="no")  # fmt: skip
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("odc_hf.integrations.trainer.train_data")
    logger.addHandler(handler)
    try:
        ODCTrainer(model=tiny_qwen2(), args=args, train_dataset=data).train()
    finally:
        logger.removeHandler(handler)
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].startswith("odc_hf: step 1 has no label tokens"), warned
    assert warned[0].endswith("every target masked by completion_mask or assistant_masks"), warned
