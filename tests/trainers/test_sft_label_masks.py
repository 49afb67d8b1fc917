"""ODCSFTTrainer trains on the tokens TRL's SFTTrainer trains on, for every loss-mask setting: prompt-completion data
with ``completion_only_loss`` None (TRL's default: completion only), True and False (the whole sequence), and chats
with ``assistant_only_loss`` True and False, and a tokenized dataset that brings its own ``completion_mask`` (which
TRL applies only when told to: ``completion_only_loss=None`` means False there, as the data are not prompt-completion
pairs) or its own ``labels`` beside a mask (which TRL keeps as they are). The reference is TRL's own trainer and collator on the same examples:
the labels of each of odc_hf's packed documents equal the labels of TRL's padded row (the first position is no
target in either: the model shifts labels by one), and so does the count of tokens the loss is normalised by.

Each setting is also compared with its opposite, so a collator that ignored the setting could not pass."""

from __future__ import annotations

import pytest

PROMPTS = [("def add(x, y):", " return x + y"), ("import os", "\nprint(os.sep)"),
           ("class Stack:", "\n    def __init__(self):\n        self.items = []"), ("# a comment", "\nx = 1")]  # fmt: skip


def _trainers(data, **settings):
    """(ODCSFTTrainer, trl.SFTTrainer) on ``data`` with the same settings, in one process."""
    import os

    from trl import SFTConfig, SFTTrainer

    from odc_hf import ODCConfig, ODCSFTConfig, ODCSFTTrainer
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    os.environ["ACCELERATE_USE_CPU"] = "true"
    tokenizer = default_tokenizer()
    common = dict(output_dir="unused", max_steps=1, per_device_train_batch_size=len(data), max_length=512, bf16=False,
                  use_cpu=True, report_to="none", save_strategy="no")  # fmt: skip
    common.update(settings)
    odc = ODCSFTTrainer(model=tiny_qwen2_model(tokenizer), args=ODCSFTConfig(**common), train_dataset=data,
                        processing_class=tokenizer, odc_config=ODCConfig(timeout_s=30))  # fmt: skip
    trl = SFTTrainer(model=tiny_qwen2_model(tokenizer), args=SFTConfig(**common), train_dataset=data,
                     processing_class=tokenizer)  # fmt: skip
    return odc, trl


def _targets(odc, trl) -> tuple[list[list[int]], list[list[int]], int, int]:
    """Per example: the labels odc_hf trains on (its collator, one document per microbatch) and TRL's (its collator,
    padding cut off); both without the first position. Then the label-token counts of each."""
    examples = [odc.train_dataset[i] for i in range(len(odc.train_dataset))]
    bundle = odc.get_train_dataloader().collate_fn([[example] for example in examples])
    ours = [mb["labels"][0].tolist()[1:] for mb in bundle.microbatches]
    padded = trl.data_collator([trl.train_dataset[i] for i in range(len(trl.train_dataset))])
    theirs = [row[1:len(example["input_ids"])] for row, example in zip(padded["labels"].tolist(), examples)]
    counted = sum(int(mb["num_label_tokens"]) for mb in bundle.microbatches)
    return ours, theirs, counted, sum(t != -100 for row in theirs for t in row)


def _prompt_completion():
    from datasets import Dataset

    return Dataset.from_list([{"prompt": p, "completion": c} for p, c in PROMPTS])


def _tokenized():
    from datasets import Dataset

    return Dataset.from_list([{"input_ids": [5, 6, 7, 8, 9], "completion_mask": [0, 0, 1, 1, 1]},
                              {"input_ids": [5, 6, 7, 8], "completion_mask": [0, 1, 1, 1]}])  # fmt: skip


def _labelled():
    from datasets import Dataset

    return Dataset.from_list([{"input_ids": [5, 6, 7, 8, 9], "labels": [5, 6, 7, -100, 9], "completion_mask": [0] * 5},
                              {"input_ids": [5, 6, 7, 8], "labels": [5, 6, -100, 8], "completion_mask": [0] * 4}])


def _chats():
    from datasets import Dataset

    from odc_hf.testing.data import default_conversations

    return Dataset.from_list(default_conversations(4, max_chars=300))


@pytest.mark.parametrize(("data", "setting", "opposite"), [
    (_prompt_completion, {"completion_only_loss": None}, {"completion_only_loss": False}),
    (_prompt_completion, {"completion_only_loss": True}, {"completion_only_loss": False}),
    (_prompt_completion, {"completion_only_loss": False}, {"completion_only_loss": True}),
    (_tokenized, {"completion_only_loss": None}, {"completion_only_loss": True}),
    (_tokenized, {"completion_only_loss": True}, {"completion_only_loss": False}),
    (_labelled, {"completion_only_loss": True}, None),  # its mask is all zeros: applied, nothing would be trained
    (_chats, {"assistant_only_loss": True}, {"assistant_only_loss": False}),
    (_chats, {"assistant_only_loss": False}, {"assistant_only_loss": True}),
], ids=["completion_only_default", "completion_only", "whole_prompt_completion", "tokenized_default",
        "tokenized_completion_only", "own_labels", "assistant_only", "whole_chat"])  # fmt: skip
def test_odc_trains_on_the_tokens_trl_trains_on(data, setting, opposite):
    dataset = data()
    ours, theirs, counted, reference = _targets(*_trainers(dataset, **setting))
    assert ours == theirs
    assert counted == reference > 0
    if opposite is None:
        return
    # the control: the opposite setting trains on other tokens, seen by both trainers alike
    ours_opposite, theirs_opposite, _, _ = _targets(*_trainers(dataset, **opposite))
    assert ours_opposite == theirs_opposite != ours
