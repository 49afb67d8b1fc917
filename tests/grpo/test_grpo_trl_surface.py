"""The TRL surfaces ODCGRPOTrainer depends on (private names, batch keys, loss normalisers) and its refusals."""

from __future__ import annotations

import inspect

import pytest
import torch

from odc_hf.balance.padded import pack_padded
from odc_hf.integrations.trl import grpo_batch
from odc_hf.integrations.upstream import trl as trl_version


def test_private_grpo_surfaces_exist_on_the_installed_trl():
    # TRL's own class, also after patch_trl() rebound trl.GRPOTrainer
    from trl.trainer.grpo_trainer import GRPOTrainer

    for name in trl_version.GRPO_PRIVATE_METHODS:
        assert callable(getattr(GRPOTrainer, name, None)), name
    source = inspect.getsource(GRPOTrainer._compute_loss)
    # compute_loss: our weights ride in tool_mask (mask = completion_mask * tool_mask), dapo normalises by
    # num_items_in_batch / W * accumulation / steps_per_generation; the four loss types share one per-token loss.
    assert 'completion_mask * inputs["tool_mask"]' in source
    assert 'normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes' in source
    assert 'self.loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]' in source
    assert "self.accelerator.reduce(" in source  # kept local by LocalGathers inside the bundle loop
    init = inspect.getsource(GRPOTrainer.__init__)
    for attr in ("self._metrics", "self.loss_type", "self.beta", "self.ref_model", "self.max_completion_length",
                 "self.num_iterations"):  # fmt: skip
        assert attr in init, attr


def test_a_trl_without_the_grpo_names_odc_hf_reads_is_refused_by_name():
    with pytest.raises(RuntimeError, match=r"ODCGRPOTrainer lacks \['_generate_and_score_completions'"):
        trl_version.check_trl_grpo(object())


def _weights(loss_type, mask, slices):
    return grpo_batch.sample_weights(mask, slices, loss_type=loss_type, num_slices=2, world_size=2,
                               max_completion_length=8, num_items_in_batch=40.0)  # fmt: skip


@pytest.mark.parametrize("loss_type", grpo_batch.SUPPORTED_LOSS_TYPES)
def test_sample_weights_reproduce_trl_normalisers(loss_type):
    torch.manual_seed(0)
    mask = (torch.rand(4, 8) < 0.7).long()
    slices = torch.tensor([0, 0, 1, 1])
    per_token = torch.randn(4, 8)
    ours = (_weights(loss_type, mask, slices).float().unsqueeze(1) * per_token * mask).sum()
    trl = torch.zeros(())
    for s in (0, 1):  # this rank's two microbatches as TRL divides them (G = 2 accumulation steps, W = 2 ranks)
        m, x = mask[slices == s], per_token[slices == s]
        if loss_type == "grpo":
            loss = ((x * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean() / 2
        elif loss_type == "bnpo":
            loss = (x * m).sum() / m.sum().clamp(min=1.0) / 2
        elif loss_type == "dr_grpo":
            loss = (x * m).sum() / (x.size(0) * 8) / 2
        else:
            loss = (x * m).sum() / (40.0 / 2 * 2 / 2)
        trl = trl + loss / 2  # gradients averaged over W = 2 ranks
    torch.testing.assert_close(ours, trl)


def test_unbatch_collate_round_trip():
    batch = {
        "prompt_ids": torch.tensor([[0, 0, 5, 6], [7, 8, 9, 4]]),
        "prompt_mask": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
        "completion_ids": torch.tensor([[11, 12, 0], [13, 0, 0]]),
        "completion_mask": torch.tensor([[1, 1, 0], [1, 0, 0]]),
        "advantages": torch.tensor([0.5, -1.0]),
        "num_items_in_batch": torch.tensor(3),
    }
    samples = grpo_batch.unbatch(batch, torch.tensor([1.0, 2.0]))
    assert samples[0]["prompt_ids"].tolist() == [5, 6] and samples[1]["completion_ids"].tolist() == [13]
    again = grpo_batch.collate(samples, pad_token_id=0, device="cpu")
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages"):
        expected = batch[key][:, :2] if key.startswith("completion") else batch[key]  # trailing padding dropped
        assert torch.equal(again[key], expected), key
    assert again["num_label_tokens"] == 3
    with pytest.raises(NotImplementedError, match="pixel_values"):
        grpo_batch.unbatch({**batch, "pixel_values": torch.zeros(2, 3)}, torch.ones(2))


def test_pack_padded_keeps_padded_microbatches_within_budget():  # more in test_grpo_packing.py
    lengths = [100, 10, 10, 10, 60, 50]
    parts = pack_padded([0, 1, 2, 3, 4, 5], lengths, 200)
    assert sorted(i for p in parts for i in p) == list(range(6))
    assert all(len(p) * max(lengths[i] for i in p) <= 200 for p in parts)


def test_unsupported_loss_type_is_refused_clearly(tmp_path):
    from trl import GRPOConfig

    from odc_hf import ODCGRPOTrainer
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    tokenizer = default_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), loss_type="cispo", per_device_train_batch_size=4, num_generations=4,
                      report_to="none", bf16=False, max_completion_length=8)  # fmt: skip
    with pytest.raises(ValueError, match="loss_type='cispo'"):
        ODCGRPOTrainer(model=tiny_qwen2_model(tokenizer), reward_funcs=lambda completions, **k: [0.0] * len(completions),
                       args=args, train_dataset=__import__("datasets").Dataset.from_list([{"prompt": "1+1="}] * 8),
                       processing_class=tokenizer)  # fmt: skip


def test_grpo_drops_the_unread_head_warning_as_sft_does(tmp_path, monkeypatch):
    """GRPOTrainer scores with TRL's fused LM head, which reads lm_head.weight without calling lm_head: torch 2.11's
    FSDP2 warned "1 of the 3 modules ... did not run forward before backward" on every GPU GRPO run. The ODC GRPO
    trainer installs the filter SFT's compute path installs (tests/fsdp/test_head_unit.py: what it drops and keeps)."""
    import logging

    from trl import GRPOConfig

    from odc_hf import ODCGRPOTrainer
    from odc_hf.integrations.compute.fused_head import FSDP_LOGGER, UnreadHeadFilter
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    fsdp_logger = logging.getLogger(FSDP_LOGGER)
    fsdp_logger.filters = [f for f in fsdp_logger.filters if not isinstance(f, UnreadHeadFilter)]
    tokenizer = default_tokenizer()
    model = tiny_qwen2_model(tokenizer, tie_word_embeddings=False)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, report_to="none",
                      bf16=False, use_cpu=True, max_completion_length=8)  # fmt: skip
    try:
        ODCGRPOTrainer(model=model, reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
                       train_dataset=__import__("datasets").Dataset.from_list([{"prompt": "1+1="}] * 8),
                       processing_class=tokenizer)  # fmt: skip
        installed = [f for f in fsdp_logger.filters if isinstance(f, UnreadHeadFilter)]
        assert len(installed) == 1 and installed[0].head is model.get_output_embeddings(), fsdp_logger.filters
    finally:
        fsdp_logger.filters = [f for f in fsdp_logger.filters if not isinstance(f, UnreadHeadFilter)]


def test_a_hooked_method_trl_removed_is_found_below_odc_hfs_hooks():
    """odc_hf's hook classes define the private methods they override, so the check looks only at the classes
    below them: a TRL whose GRPOTrainer lost ``_get_train_sampler`` is refused although the hook still exists."""
    from trl import GRPOTrainer

    from odc_hf.integrations.trainer.mixin import ODCMixin
    from odc_hf.integrations.upstream.transformers import missing_upstream_methods

    lost = type("LostSampler", (GRPOTrainer,), {"_get_train_sampler": None})
    hooked = type("Hooked", (ODCMixin, trl_version.GRPOHooks, lost), {})
    assert callable(hooked._get_train_sampler)  # the hook alone would satisfy a plain lookup
    assert missing_upstream_methods(hooked, trl_version.GRPO_PRIVATE_METHODS) == ["_get_train_sampler"]
