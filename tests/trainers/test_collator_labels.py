"""A data collator given to an ODC trainer decides the labels trained (odc_hf/integrations/trainer/collator_labels.py):
its labels are read at the examples' tokens, trained where they differ from the dataset's, and a collator odc_hf
cannot follow on packed rows (tokens changed, random labels, labels that depend on the batch) is refused by name.
Each refusal's collator differs from an accepted one by the one property refused."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening, DataCollatorWithPadding

from odc_hf.integrations.trainer.bundle import BundleCollator
from odc_hf.integrations.trainer.collator_labels import CHECKED_EXAMPLES, CollatorLabels, collator_labels
from odc_hf.testing.data import default_tokenizer

EOS = 0  # the default tokenizer's end-of-text token, also its pad token


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = default_tokenizer()
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == EOS
    return tokenizer


def _examples(n: int = 10, *, seed: int = 0, eos: bool = True) -> list[dict]:
    rng = random.Random(seed)
    return [{"input_ids": [rng.randrange(5, 200) for _ in range(rng.randrange(4, 30))] + ([EOS] if eos else [])}
            for _ in range(n)]  # fmt: skip


def _ids_only(collator):
    """The collator as the Trainer calls it, with the dataset's other columns removed."""
    return lambda features: collator([{"input_ids": f["input_ids"]} for f in features])


def test_causal_lm_collator_with_pad_as_end_of_text_gives_its_labels(tokenizer):
    data = _examples()
    labels = collator_labels(_ids_only(DataCollatorForLanguageModeling(tokenizer, mlm=False)), "LM", data)
    assert isinstance(labels, CollatorLabels)
    got = labels(data[:3])
    assert [x[:-1] for x in got] == [e["input_ids"][:-1] for e in data[:3]]
    assert [x[-1] for x in got] == [-100] * 3  # the end-of-text token: masked as a pad token


def test_left_padding_is_read_through_the_attention_mask(tokenizer):
    left = default_tokenizer()
    left.padding_side = "left"
    data = _examples()
    right_labels = collator_labels(_ids_only(DataCollatorForLanguageModeling(tokenizer, mlm=False)), "R", data)
    left_labels = collator_labels(_ids_only(DataCollatorForLanguageModeling(left, mlm=False)), "L", data)
    assert left_labels(data) == right_labels(data)


@pytest.mark.parametrize("make", [lambda t: DataCollatorWithPadding(t), lambda t: DataCollatorWithFlattening(),
                                  lambda t: DataCollatorForLanguageModeling(t, mlm=False)],
                         ids=["padding", "flattening", "lm_without_end_of_text"])  # fmt: skip
def test_collators_that_keep_the_datasets_labels_change_nothing(tokenizer, make):
    data = _examples(eos=False)  # no pad token in the documents: the causal-LM collator masks nothing
    assert collator_labels(_ids_only(make(tokenizer)), "C", data) is None


def test_labels_from_the_dataset_column_are_compared_not_the_input_ids(tokenizer):
    """A dataset whose labels mask the prompts, under a collator that passes them on: nothing to change. The
    causal-LM collator builds labels from input_ids instead, training the prompts: its labels win."""
    data = [dict(e, labels=[-100] * 3 + e["input_ids"][3:]) for e in _examples(eos=False)]
    padding = DataCollatorWithPadding(tokenizer)
    keep = lambda features: padding([{"input_ids": f["input_ids"]} for f in features]) | {  # noqa: E731
        "labels": torch.tensor([f["labels"] + [-100] * (max(len(g["labels"]) for g in features) - len(f["labels"]))
                                for f in features])}  # fmt: skip
    assert collator_labels(keep, "Keep", data) is None
    rebuilt = collator_labels(_ids_only(DataCollatorForLanguageModeling(tokenizer, mlm=False)), "LM", data)
    assert rebuilt(data[:1]) == [data[0]["input_ids"]]


def _prompt_masking(tokenizer, prompt: int = 3):
    base = DataCollatorForLanguageModeling(tokenizer, mlm=False)

    def collate(features):
        batch = base(features)
        first = batch["attention_mask"].long().argmax(-1)  # first real token (left padding too)
        for row, start in enumerate(first.tolist()):
            batch["labels"][row, start : start + prompt] = -100
        return batch

    return collate


def test_a_collator_of_ones_own_masking_prompts_is_followed(tokenizer):
    data = _examples(eos=False)
    labels = collator_labels(_prompt_masking(tokenizer), "PromptMasking", data)
    assert isinstance(labels, CollatorLabels)
    assert labels(data[:2]) == [[-100] * 3 + e["input_ids"][3:] for e in data[:2]]


def test_random_labels_are_refused(tokenizer):
    base = _prompt_masking(tokenizer, prompt=0)

    calls = []

    def random_masking(features):  # base's labels, one token masked that changes from call to call (as random would)
        calls.append(None)
        batch = base(features)
        batch["labels"][0, 1 + len(calls) % 3] = -100
        return batch

    with pytest.raises(ValueError, match=r"data_collator \(Random\) returns other labels each time"):
        collator_labels(random_masking, "Random", _examples(eos=False))


def test_labels_that_depend_on_the_other_examples_are_refused(tokenizer):
    base = DataCollatorForLanguageModeling(tokenizer, mlm=False)

    def shortest_only(features):  # trains each row up to the batch's shortest example: composition-dependent
        batch = base(features)
        shortest = min(len(f["input_ids"]) for f in features)
        batch["labels"][:, shortest:] = -100
        return batch

    with pytest.raises(ValueError, match=r"data_collator \(Shortest\) labels example \d+ differently with other"):
        collator_labels(shortest_only, "Shortest", _examples(eos=False))


def test_a_collator_that_changes_the_tokens_is_refused(tokenizer):
    base = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    cut = lambda features: base([{"input_ids": f["input_ids"][:6]} for f in features])  # noqa: E731
    with pytest.raises(ValueError, match=r"data_collator \(Cut\) does not keep the dataset's tokens .*example 0, "
                                         r"token 6: nothing"):  # fmt: skip
        collator_labels(cut, "Cut", _examples(eos=False))
    no_ids = lambda features: {"labels": base(features)["labels"]}  # noqa: E731
    with pytest.raises(ValueError, match=r"\(NoIds\) .*its batch has no input_ids \(it returned \['labels'\]\)"):
        collator_labels(no_ids, "NoIds", _examples(eos=False))


def test_labels_on_padding_are_refused(tokenizer):
    base = DataCollatorForLanguageModeling(tokenizer, mlm=False)

    def unmasked_padding(features):  # labels the pad positions: a collator that trains padding
        batch = base(features)
        batch["labels"] = batch["input_ids"].clone()
        del batch["attention_mask"]
        return batch

    with pytest.raises(ValueError, match=r"\(Pads\) .*labels \d+ positions after the examples' tokens"):
        collator_labels(unmasked_padding, "Pads", _examples(eos=False))


def test_only_the_first_examples_are_read_and_empty_ones_skipped(tokenizer):
    seen = []
    base = DataCollatorForLanguageModeling(tokenizer, mlm=False)

    def counting(features):
        seen.extend(len(f["input_ids"]) for f in features)
        return base(features)

    data = [{"input_ids": []}] + _examples(20)
    collator_labels(counting, "Counting", data)
    # one call on the first 8 non-empty examples, a second one, then each alone: 8 x 3 examples, none empty
    assert len(seen) == 3 * CHECKED_EXAMPLES and min(seen) > 0


def test_packed_rows_take_the_collators_labels_with_masks_on_top(tokenizer):
    """BundleCollator with labels_from: the collator's labels, then completion_mask, then the first label of each
    packed document -100; num_label_tokens counts them."""
    data = [dict(e, completion_mask=[0] * 2 + [1] * (len(e["input_ids"]) - 2)) for e in _examples(2)]
    labels = collator_labels(_ids_only(DataCollatorForLanguageModeling(tokenizer, mlm=False)), "LM", data)
    packed = BundleCollator(labels_from=labels, pad_token_id=EOS)([data])[0]
    expected = []
    for e in data:
        own = [-100, -100] + e["input_ids"][2:-1] + [-100]  # prompt masked, end-of-text masked by the collator
        expected += own
    assert packed["labels"][0].tolist() == expected
    assert packed["num_label_tokens"] == sum(label != -100 for label in expected)
    plain = BundleCollator(pad_token_id=EOS)([data])[0]
    assert plain["num_label_tokens"] == packed["num_label_tokens"] + 2  # control: without it, both eos trained


def test_a_microbatch_whose_tokens_the_collator_changes_raises(tokenizer):
    base = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    labels = CollatorLabels(lambda features: base([{"input_ids": f["input_ids"][:-1]} for f in features]), "Cut")
    with pytest.raises(ValueError, match=r"data_collator \(Cut\) changed the tokens of a microbatch"):
        labels(_examples(2))
