"""A dataset ODCSFTTrainer cannot read the text of (only a ``content`` column) stops every rank with the same error,
naming the columns and ``dataset_text_field``, before TRL's dataset preparation. Before, TRL's preparation (the main
process first, the others waiting in a barrier) ended rank 0 in ``KeyError: 'text'`` and rank 1 in a gloo
"Connection closed by peer" that named no cause."""

from __future__ import annotations

import pytest


def _dataset(columns: dict):
    import datasets

    return datasets.Dataset.from_dict({name: [value] * 4 for name, value in columns.items()})


def _build(rank, world, columns: dict):
    """ODCSFTTrainer on a dataset of ``columns``, on every rank; the error each rank raised."""
    import os

    from odc_hf import ODCConfig, ODCSFTConfig, ODCSFTTrainer
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    os.environ["ACCELERATE_USE_CPU"] = "true"
    tokenizer = default_tokenizer()
    args = ODCSFTConfig(output_dir=f"unused_{rank}", max_steps=1, per_device_train_batch_size=2, max_length=64,
                        packing=False, bf16=False, use_cpu=True, report_to="none", save_strategy="no")  # fmt: skip
    try:
        ODCSFTTrainer(model=tiny_qwen2_model(tokenizer), args=args, train_dataset=_dataset(columns),
                      processing_class=tokenizer, odc_config=ODCConfig(timeout_s=30))  # fmt: skip
    except Exception as err:  # noqa: BLE001 - the test reads it
        return f"{type(err).__name__}: {err}"
    return None


def test_every_rank_names_the_missing_text_column_before_trl_prepares_the_data():
    from odc_hf.testing import run_ranks

    errors = run_ranks(_build, 2, {"content": "Some text to train on."}, timeout_s=120)
    assert errors[0] == errors[1], errors  # the peer reports the root cause, not a lost connection
    assert errors[0].startswith("ValueError: train_dataset has no column TRL's SFTTrainer can train on: its columns "
                                "are ['content']"), errors[0]  # fmt: skip
    assert "Set dataset_text_field='content'" in errors[0], errors[0]


def test_which_columns_trl_can_read():
    from odc_hf.integrations.trl.sft_config import ODCSFTConfig
    from odc_hf.integrations.trl.sft_trainer import check_sft_columns

    args = ODCSFTConfig(output_dir="unused", report_to="none", bf16=False)
    content = ODCSFTConfig(output_dir="unused", report_to="none", bf16=False, dataset_text_field="content")
    for columns in ({"text": "a"}, {"messages": [{"role": "user", "content": "a"}]}, {"prompt": "a", "completion": "b"},
                    {"input_ids": [1, 2]}, {"prompt": "a", "input_ids": [1, 2]}):  # fmt: skip
        check_sft_columns(_dataset(columns), args, None)
    check_sft_columns(_dataset({"content": "a"}), content, None)  # the setting the message names
    check_sft_columns(_dataset({"content": "a"}), args, lambda row: row["content"])  # or a formatting_func
    check_sft_columns(_dataset({"content": "a"}), None, lambda row: row["content"])
    with pytest.raises(ValueError, match=r"^eval_dataset has no column .* are \['body', 'id'\]\. .* names \('text'\)"
                                         r".* Set dataset_text_field to the text's column "):  # fmt: skip
        check_sft_columns(_dataset({"body": "a", "id": "b"}), None, None, "eval_dataset")
    with pytest.raises(ValueError, match=r"^train_dataset has a 'prompt' column but no 'completion' column"):
        check_sft_columns(_dataset({"prompt": "a"}), args, None)
