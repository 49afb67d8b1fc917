"""BundleCollator: padding-free packing that isolates documents, masks, budget, dummies, DataLoader wiring."""

import pytest
import torch

from odc_hf.balance.sampler import ODCBatchSampler
from odc_hf.integrations.trainer.bundle import BundleCollator, BundleDataset


def test_packs_documents_into_one_row_with_restarting_positions():
    collator = BundleCollator(pad_token_id=0)
    (batch,) = collator([[{"input_ids": [5, 6, 7]}, {"input_ids": torch.tensor([8, 9])}]])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9]]  # no prediction across the boundary
    assert "attention_mask" not in batch
    assert batch["input_ids"].dtype == torch.long
    assert batch["num_label_tokens"] == 3


def test_labels_and_masks_are_folded_in():
    collator = BundleCollator(pad_token_id=0)
    examples = [
        {"input_ids": [1, 2, 3, 4], "completion_mask": [0, 0, 1, 1]},
        {"input_ids": [5, 6, 7], "labels": [-100, 6, -100]},
        {"input_ids": [8, 9, 10], "assistant_masks": [1, 0, 1]},
    ]
    (batch,) = collator([examples])
    assert batch["labels"].tolist() == [[-100, -100, 3, 4, -100, 6, -100, -100, -100, 10]]
    assert batch["num_label_tokens"] == 4


def test_budget_is_enforced_or_documents_truncated():
    with pytest.raises(ValueError, match="more than max_tokens_per_microbatch=4"):
        BundleCollator(max_tokens_per_microbatch=4)([[{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]])
    (batch,) = BundleCollator(max_tokens_per_microbatch=4, truncate=True)(
        [[{"input_ids": [1, 2, 3, 4, 5, 6]}]]
    )
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4]]
    with pytest.raises(ValueError, match="truncate=True needs"):
        BundleCollator(truncate=True)


def test_empty_microbatch_becomes_a_one_token_dummy_and_empty_bundle_stays_empty():
    collator = BundleCollator(pad_token_id=3)
    dummy, real = collator([[], [{"input_ids": [1, 2]}]])
    assert dummy["input_ids"].tolist() == [[3]] and dummy["labels"].tolist() == [[-100]]
    assert dummy["num_label_tokens"] == 0 and real["num_label_tokens"] == 1
    assert collator([]) == []


def test_dataloader_yields_one_bundle_per_step():
    from datasets import Dataset

    lengths = [3, 9, 4, 7, 2, 8, 5, 6]
    dataset = Dataset.from_dict({"input_ids": [list(range(1, n + 1)) for n in lengths]})
    sampler = ODCBatchSampler(lengths, world_size=2, rank=1, minibatch_size=4, max_tokens_per_microbatch=12)
    loader = torch.utils.data.DataLoader(
        BundleDataset(dataset),
        batch_sampler=sampler,
        collate_fn=BundleCollator(max_tokens_per_microbatch=12),
    )
    steps = list(loader)
    assert len(steps) == len(sampler) == 2
    for step, bundle in enumerate(steps):
        planned = sampler.plan(step).for_rank(1)
        assert [mb["input_ids"].shape[1] for mb in bundle] == [sum(lengths[i] for i in mb) for mb in planned]


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_logits_equal_each_document_run_alone(attn_implementation, one_torch_thread):
    from transformers import Qwen2ForCausalLM

    from odc_hf.testing.data import tiny_qwen2_config

    torch.manual_seed(0)
    config = tiny_qwen2_config(128, attn_implementation=attn_implementation)
    model = Qwen2ForCausalLM(config).eval()
    documents = [torch.randint(0, 128, (n,)).tolist() for n in (7, 1, 12, 5)]
    (batch,) = BundleCollator(pad_token_id=0)([[{"input_ids": doc} for doc in documents]])
    inputs = {key: value for key, value in batch.items() if key != "num_label_tokens"}
    with torch.no_grad():
        packed = model(**inputs).logits[0]
        start = 0
        for doc in documents:
            alone = model(input_ids=torch.tensor([doc])).logits[0]
            torch.testing.assert_close(packed[start : start + len(doc)], alone, atol=1e-5, rtol=0)
            start += len(doc)


def test_the_bundles_attention_mask_covers_every_document_token_and_no_dummy():
    """What the Trainer's include_num_input_tokens_seen="non_padding" sums: documents ending in eos, which is also the
    pad token, count whole (transformers' fallback, input_ids != pad, dropped them); an empty microbatch's pad does not."""
    from odc_hf.integrations.trainer.bundle import TrainerBundleCollator

    collator = TrainerBundleCollator(pad_token_id=0)
    bundle = collator([[{"input_ids": [5, 6, 0]}, {"input_ids": [7, 0]}], [], [{"input_ids": [0]}]])
    assert "attention_mask" in bundle and bundle.empty == (False, True, False)
    assert bundle["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 1]]
    assert bundle["attention_mask"].shape == bundle["input_ids"].shape
    assert collator([])["attention_mask"].shape == (1, 0)  # a rank without microbatches counts nothing
