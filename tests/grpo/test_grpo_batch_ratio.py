"""Samples of TRL's GRPO batch through ODC's exchange and back (``odc_hf.integrations.trl.grpo_batch``): the importance-
sampling ratio keeps its level (token or sequence) whatever the completions' lengths."""

from __future__ import annotations


def test_a_one_token_completion_keeps_its_token_level_importance_ratio():
    """TRL's token-level importance-sampling ratio is (B, T) and its sequence-level one (B, 1). A sample whose
    completion is one token (EOS first) has a token-level ratio of one value too: it must stay token-level, whichever
    sample comes first in a microbatch (it crashed the collation of the others: seen in tests/grpo/test_grpo_vllm.py once its
    model ended completions early). Reference: TRL's own batch, trailing padding dropped."""
    import torch

    from odc_hf.integrations.trl.grpo_batch import collate, unbatch

    batch = {
        "prompt_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]),
        "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
        "completion_ids": torch.tensor([[0, 0, 0], [13, 14, 0]]),
        "completion_mask": torch.tensor([[1, 0, 0], [1, 1, 1]]),
        "advantages": torch.tensor([0.5, -0.5]),
    }
    token_level = torch.tensor([[0.9, 1.0, 1.0], [1.1, 1.2, 1.3]])  # masked columns: TRL's ratio there, exp(0)
    sequence_level = torch.tensor([[0.9], [1.1]])
    for ratio in (token_level, sequence_level):
        samples = unbatch({**batch, "importance_sampling_ratio": ratio}, torch.ones(2))
        for order in ([0, 1], [1, 0]):
            again = collate([samples[i] for i in order], pad_token_id=0, device="cpu")["importance_sampling_ratio"]
            assert torch.equal(again, ratio[order]), (ratio, order, again)
