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
    # the normaliser branches grpo_batch.LOSS_CODE and sample_weights rely on
    assert 'self.loss_type in ["cispo", "dapo", "vespo"]' in source and 'self.loss_type in ["grpo", "sapo"]' in source
    assert "loss = (per_token_loss * mask).sum(-1).mean()" in source  # luspo
    assert "self.accelerator.reduce(" in source  # kept local by LocalGathers inside the bundle loop
    init = inspect.getsource(GRPOTrainer.__init__)
    for attr in ("self._metrics", "self.loss_type", "self.beta", "self.ref_model", "self.max_completion_length",
                 "self.num_iterations"):  # fmt: skip
        assert attr in init, attr


def test_a_trl_without_the_grpo_names_odc_hf_reads_is_refused_by_name():
    with pytest.raises(RuntimeError, match=r"ODCGRPOTrainer lacks \['_generate_and_score_completions'"):
        trl_version.check_trl_grpo(object())


def _weights(loss_type, mask, slices, num_items_in_batch=40.0):
    return grpo_batch.sample_weights(mask, slices, loss_type=loss_type, num_slices=2, world_size=2,
                                     max_completion_length=8, num_items_in_batch=num_items_in_batch)  # fmt: skip


def _trl_loss(loss_type, mask, slices, per_token, num_items_in_batch=40.0):
    """TRL's loss of this rank's two microbatches as it divides them (G = 2 accumulation steps, W = 2 ranks,
    steps_per_generation 2, max_completion_length 8), averaged over the ranks."""
    trl = torch.zeros((), dtype=torch.float64)
    for s in (0, 1):
        m, x = mask[slices == s].double(), per_token[slices == s].double()
        if loss_type in ("grpo", "sapo"):
            loss = ((x * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean() / 2
        elif loss_type == "luspo":
            loss = (x * m).sum(-1).mean() / 2
        elif loss_type == "bnpo":
            loss = (x * m).sum() / m.sum().clamp(min=1.0) / 2
        elif loss_type == "dr_grpo":
            loss = (x * m).sum() / (x.size(0) * 8) / 2
        else:  # dapo, cispo, vespo
            loss = (x * m).sum() / (max(num_items_in_batch, 1.0) / 2 * 2 / 2)
        trl = trl + loss / 2  # gradients averaged over W = 2 ranks
    return trl


@pytest.mark.parametrize("loss_type", grpo_batch.SUPPORTED_LOSS_TYPES)
def test_sample_weights_reproduce_trl_normalisers(loss_type):
    torch.manual_seed(0)
    mask = (torch.rand(4, 8) < 0.7).long()
    slices = torch.tensor([0, 0, 1, 1])
    per_token = torch.randn(4, 8)
    ours = (_weights(loss_type, mask, slices).unsqueeze(1) * per_token.double() * mask).sum()
    torch.testing.assert_close(ours, _trl_loss(loss_type, mask, slices, per_token))


@pytest.mark.parametrize("loss_type", grpo_batch.SUPPORTED_LOSS_TYPES)
@pytest.mark.parametrize("num_items_in_batch", [40.0, 1.0, 0.0])
def test_sample_weights_at_the_clamps_and_with_unequal_microbatches(loss_type, num_items_in_batch):
    """The edges of TRL's normalisers: a completion of one token and one of none (``grpo`` clamps a sequence's
    tokens at 1), a microbatch of one sample with one token (``bnpo`` clamps a microbatch's tokens at 1), microbatches
    of 3 and 1 samples (P differs), and ``dapo``'s global token count at 1 and 0 (clamped at 1). Killed mutants:
    each clamp at 2 instead of 1."""
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0], [0] * 8, [0, 0, 1, 0, 0, 0, 0, 0]])
    slices = torch.tensor([0, 0, 0, 1])
    per_token = torch.linspace(-1.0, 2.0, 32).reshape(4, 8)
    weights = _weights(loss_type, mask, slices, num_items_in_batch)
    assert weights.dtype == torch.float64 and weights.shape == (4,)
    ours = (weights.unsqueeze(1) * per_token.double() * mask).sum()
    torch.testing.assert_close(ours, _trl_loss(loss_type, mask, slices, per_token, num_items_in_batch))
    if loss_type == "grpo":  # one token: weight 1 / (1 x 3 x 4); none: finite (clamped), read against a zero mask
        assert weights[1].item() == pytest.approx(1 / 12) and torch.isfinite(weights).all()
    if loss_type == "bnpo":
        assert weights[3].item() == pytest.approx(1 / 4)


@pytest.mark.parametrize("loss_type", grpo_batch.SUPPORTED_LOSS_TYPES)
def test_sample_weights_of_a_generation_batch_that_spans_two_steps(loss_type):
    """steps_per_generation S = 4 slices of 2 samples, gradient_accumulation_steps G = 2: optimizer step k trains
    slices 2k and 2k + 1, each divided by G (not S); dapo's normaliser is the generation batch's tokens rescaled to a
    step (N / W x G / S). Each step's weighted sum equals TRL's loss of that step, averaged over W = 2 ranks."""
    torch.manual_seed(1)
    mask = (torch.rand(8, 6) < 0.7).long()
    slices = torch.arange(8) // 2
    per_token = torch.randn(8, 6).double()
    n_items = 50.0  # the generation batch's completion tokens, all ranks
    weights = grpo_batch.sample_weights(mask, slices, loss_type=loss_type, num_slices=4, accumulation=2, world_size=2,
                                        max_completion_length=6, num_items_in_batch=n_items)  # fmt: skip
    for step in (0, 1):
        trl = torch.zeros((), dtype=torch.float64)
        for g in (2 * step, 2 * step + 1):
            m, x = mask[slices == g].double(), per_token[slices == g]
            if loss_type in ("grpo", "sapo"):
                loss = ((x * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean() / 2
            elif loss_type == "luspo":
                loss = (x * m).sum(-1).mean() / 2
            elif loss_type == "bnpo":
                loss = (x * m).sum() / m.sum().clamp(min=1.0) / 2
            elif loss_type == "dr_grpo":
                loss = (x * m).sum() / (x.size(0) * 6) / 2
            else:
                loss = (x * m).sum() / (n_items / 2 * 2 / 4)
            trl = trl + loss / 2
        rows = slices // 2 == step
        ours = (weights[rows].unsqueeze(1) * per_token[rows] * mask[rows]).sum()
        torch.testing.assert_close(ours, trl)


def test_an_unknown_loss_type_is_refused_by_name():
    with pytest.raises(ValueError, match=r"loss_type 'gxpo' is not supported \(supported: \('dapo', 'grpo', 'bnpo', "
                                         r"'dr_grpo', 'luspo', 'cispo', 'vespo', 'sapo'\)\)"):  # fmt: skip
        _weights("gxpo", torch.ones(2, 3), torch.tensor([0, 1]))


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
    with pytest.raises(NotImplementedError, match=r"ODCGRPOTrainer cannot rebalance batches with \['pixel_values'\]"):
        grpo_batch.unbatch({**batch, "pixel_values": torch.zeros(2, 3)}, torch.ones(2))
    # a completion masked out whole (mask_truncated_completions) keeps one masked token, whatever the other rows hold
    truncated = {**batch, "completion_mask": torch.tensor([[1, 1, 0], [0, 0, 0]])}
    samples = grpo_batch.unbatch(truncated, torch.tensor([1.0, 2.0]))
    assert [s["completion_ids"].tolist() for s in samples] == [[11, 12], [13]]
    assert [s["completion_mask"].tolist() for s in samples] == [[1, 1], [0]] and samples[1]["weight"] == 2.0


def test_collate_of_one_sample_and_of_every_key_trl_reads():
    """A microbatch of one sample (common in GRPO: a long completion alone) and the keys beside the tokens: the pad
    token fills completion columns (not 0), every other per-token key pads right with its own value, the weights
    stay float64, TRL's slice of each sample rides along, ``tool_mask`` takes its tokens out of the label count,
    no packed row unless asked, the exact width unless a multiple is asked, every tensor on the device asked."""
    pad = 99

    def sample(prompt, completion, slice_, weight, tool):
        n = len(completion)
        return {"prompt_ids": torch.tensor(prompt), "completion_ids": torch.tensor(completion),
                "completion_mask": torch.ones(n, dtype=torch.long), "tool_mask": torch.tensor(tool),
                "old_per_token_logps": torch.full((n,), -1.5), "ref_per_token_logps": torch.full((n,), -2.0),
                "importance_sampling_ratio": torch.full((n,), 0.5),
                "advantages": torch.tensor(float(weight)), "weight": weight, "odc_slice": slice_}  # fmt: skip

    one = grpo_batch.collate([sample([5, 6], [7, 8, 9], 1, 0.125, [1, 0, 1])], pad_token_id=pad, device="cpu")
    assert one["prompt_ids"].tolist() == [[5, 6]] and one["completion_ids"].tolist() == [[7, 8, 9]]
    assert one["odc_weight"].dtype == torch.float64 and one["odc_weight"].tolist() == [0.125]
    assert one["odc_slice"].dtype == torch.long and one["odc_slice"].tolist() == [1]
    assert one["num_label_tokens"] == 2 and grpo_batch.PACKED_KEY not in one
    assert grpo_batch.sample_length(sample([5, 6], [7, 8, 9], 1, 0.125, [1, 0, 1])) == 5  # what the planner weighs
    two = grpo_batch.collate([sample([5, 6], [7, 8, 9], 1, 0.125, [1, 0, 1]), sample([4], [3], 0, 0.5, [1])],
                             pad_token_id=pad, device="cpu")  # fmt: skip
    assert two["prompt_ids"].tolist() == [[5, 6], [pad, 4]] and two["prompt_mask"].tolist() == [[1, 1], [0, 1]]
    assert two["completion_ids"].tolist() == [[7, 8, 9], [3, pad, pad]]
    assert two["completion_mask"].tolist() == [[1, 1, 1], [1, 0, 0]] and two["tool_mask"].tolist() == [[1, 0, 1], [1, 0, 0]]
    assert two["old_per_token_logps"].tolist() == [[-1.5] * 3, [-1.5, 0.0, 0.0]]
    assert two["ref_per_token_logps"].tolist() == [[-2.0] * 3, [-2.0, -1e4, -1e4]]
    # TRL's vLLM importance ratio in its padding columns (vespo sums its log over every column)
    assert two["importance_sampling_ratio"].tolist() == [[0.5] * 3, [0.5, 1.0, 1.0]]
    assert two["odc_weight"].tolist() == [0.125, 0.5] and two["odc_slice"].tolist() == [1, 0]
    assert two["num_label_tokens"] == 3  # 2 + 1: the tool's token is not a label
    assert two["prompt_ids"].size(1) + two["completion_ids"].size(1) == 5  # odd: no multiple by default
    on_meta = grpo_batch.collate([sample([5, 6], [7, 8, 9], 1, 0.125, [1, 0, 1])], pad_token_id=pad, device="meta",
                                 packed=True)  # fmt: skip
    assert all(v.device.type == "meta" for v in on_meta.values() if isinstance(v, torch.Tensor))
    assert on_meta[grpo_batch.PACKED_KEY]["input_ids"].tolist() == [[5, 6, 7, 8, 9]]  # built on the CPU


def test_a_collated_packed_row_holds_each_sample_back_to_back():
    """``collate(packed=True)``: the packed row is each sample's prompt then completion, unpadded, in sample order,
    with a boundary after each (the padded batch's columns and masks, not other tensors, go in)."""
    samples = [{"prompt_ids": torch.tensor(p), "completion_ids": torch.tensor(c),
                "completion_mask": torch.tensor(m), "advantages": torch.tensor(0.0), "weight": 1.0}
               for p, c, m in (([5, 6], [7, 8, 9], [1, 1, 1]), ([4], [3], [1]), ([1, 2, 3], [11, 12], [1, 0]))]  # fmt: skip
    batch = grpo_batch.collate(samples, pad_token_id=0, device="cpu", packed=True, pad_to_multiple_of=4)
    packed = batch[grpo_batch.PACKED_KEY]
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9, 4, 3, 1, 2, 3, 11]]
    assert packed["cu_seq_lens_q"].tolist() == [0, 5, 7, 11] and packed["max_length_q"] == 5
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3]]
    assert packed["index"].shape == batch["completion_ids"].shape  # TRL's completion columns (5, padded to 8)


def test_pack_padded_keeps_padded_microbatches_within_budget():  # more in test_grpo_packing.py
    lengths = [100, 10, 10, 10, 60, 50]
    parts = pack_padded([0, 1, 2, 3, 4, 5], lengths, 200)
    assert sorted(i for p in parts for i in p) == list(range(6))
    assert all(len(p) * max(lengths[i] for i in p) <= 200 for p in parts)


def test_a_loss_type_odc_hf_does_not_know_is_refused_clearly(tmp_path):
    """Every loss type of the installed TRL is supported (the list above); TRL itself checks the name only when
    its loss runs, so an unknown one (a newer TRL's, a typo) is refused by ODC at construction."""
    from trl import GRPOConfig

    from odc_hf import ODCGRPOTrainer
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    tokenizer = default_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), loss_type="gxpo", per_device_train_batch_size=4, num_generations=4,
                      report_to="none", bf16=False, max_completion_length=8)  # fmt: skip
    with pytest.raises(ValueError, match=r"ODCGRPOTrainer does not support loss_type='gxpo' \(supported: dapo, grpo"):
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


def test_what_the_grpo_arguments_refuse_and_accept(tmp_path):
    """steps_per_generation a multiple of the accumulation steps, sync_ref_model and an entropy bonus are trained
    (test_grpo_parity.py, test_grpo_metrics.py); a generation batch that ends inside an optimizer step and a quantile
    mask are refused by name."""
    from trl import GRPOConfig

    from odc_hf.integrations.trl.grpo_config import refusals

    def args(**changes):
        return GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, per_device_train_batch_size=4,
                          num_generations=4, gradient_accumulation_steps=2, **changes)  # fmt: skip

    assert refusals(args(steps_per_generation=4), 2) == []
    assert refusals(args(sync_ref_model=True, beta=0.1), 2) == []
    assert refusals(args(loss_type="sapo"), 2) == []
    assert refusals(args(steps_per_generation=3), 2) == [
        "steps_per_generation=3, not a multiple of gradient_accumulation_steps=2 (an optimizer step of TRL's would "
        "then span two generation batches; ODC trains a generation batch in whole optimizer steps)"
    ]
    assert refusals(args(entropy_coef=0.01, use_adaptive_entropy=True), 2) == []
    assert refusals(args(top_entropy_quantile=0.5), 2) == []
    assert refusals(args(top_entropy_quantile=0.5, entropy_coef=0.01, use_adaptive_entropy=True), 2) == []


def test_collate_carries_the_entropy_bonus_weights_only_when_the_samples_have_them():
    """With an entropy bonus each sample carries its weight in TRL's per-microbatch entropy mean (bnpo's weight, far
    below float32's precision of the loss weights' ratios): collated in float64, in sample order; absent otherwise."""
    def sample(completion, **extra):
        return {"prompt_ids": torch.tensor([5]), "completion_ids": torch.tensor(completion),
                "completion_mask": torch.ones(len(completion), dtype=torch.long), "advantages": torch.tensor(0.0),
                "weight": 0.25, **extra}  # fmt: skip

    weights = (1 / 3 + 1e-12, 1 / 7)
    batch = grpo_batch.collate([sample([7, 8], entropy_weight=weights[0]), sample([9], entropy_weight=weights[1])],
                               pad_token_id=0, device="cpu")  # fmt: skip
    assert batch["odc_entropy_weight"].dtype == torch.float64
    assert batch["odc_entropy_weight"].tolist() == list(weights)
    assert "odc_entropy_weight" not in grpo_batch.collate([sample([7, 8])], pad_token_id=0, device="cpu")
