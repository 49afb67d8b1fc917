"""sdpa_varlen: per-document attention on packed rows equals separate forwards and transformers' masked sdpa."""

import pytest
import torch
from transformers import Qwen2ForCausalLM
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from odc_hf.attention import VARLEN_ATTENTION, document_bounds
from odc_hf.testing.data import tiny_qwen2_config


def _model(attn: str) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = tiny_qwen2_config(97)
    return Qwen2ForCausalLM._from_config(config, attn_implementation=attn, torch_dtype=torch.float32).eval()


def _packed(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    docs = [{"input_ids": torch.randint(1, 97, (n,), generator=g).tolist()} for n in lengths]
    return docs, DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(docs)


@pytest.mark.parametrize("lengths", [[5], [3, 9, 1, 6], [1, 2, 1], [17, 4]])
def test_packed_row_equals_separate_documents_and_masked_sdpa(lengths):
    varlen, masked = _model(VARLEN_ATTENTION), _model("sdpa")
    masked.load_state_dict(varlen.state_dict())
    docs, batch = _packed(lengths)
    out = varlen(**batch)
    ref = masked(**batch)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
    start = 0
    for doc in docs:
        ids = torch.tensor([doc["input_ids"]])
        alone = varlen(input_ids=ids).logits
        torch.testing.assert_close(out.logits[:, start : start + ids.shape[1]], alone, rtol=1e-5, atol=1e-5)
        start += ids.shape[1]
    out.loss.backward()
    ref.loss.backward()
    for (name, p), q in zip(varlen.named_parameters(), masked.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_generation_falls_back_to_sdpa():
    varlen, plain = _model(VARLEN_ATTENTION), _model("sdpa")
    plain.load_state_dict(varlen.state_dict())
    ids = torch.tensor([[5, 6, 7, 8]])
    a = varlen.generate(ids, max_new_tokens=5, do_sample=False)
    b = plain.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(a, b)


def test_bad_boundaries_are_an_error():
    with pytest.raises(ValueError, match="does not describe"):
        document_bounds(torch.tensor([0, 3, 9]), 7)
    assert document_bounds(None, 4) == [(0, 4)]
    assert document_bounds(torch.tensor([0, 0, 2, 4]), 4) == [(0, 2), (2, 4)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (flash varlen kernel)")
def test_cuda_varlen_kernel_matches_per_document_sdpa():
    import odc_hf.attention.varlen as attention

    config = tiny_qwen2_config(97)
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads = 256, 4, 2
    torch.manual_seed(0)
    model = Qwen2ForCausalLM._from_config(
        config, attn_implementation=VARLEN_ATTENTION, torch_dtype=torch.bfloat16
    )
    model = model.cuda()
    _, batch = _packed([300, 17, 129, 64])
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
    outputs = {}
    for use in (True, False):
        model.set_attn_implementation(attention.register(attention.VarlenAttention(varlen_kernel=use)))
        before = dict(attention.CALLS)
        out = model(**batch)
        out.loss.backward()
        grads = [p.grad.float().clone() for p in model.parameters()]
        model.zero_grad()
        outputs[use] = (out.logits.float(), grads, attention.CALLS["varlen"] - before.get("varlen", 0))
    assert outputs[True][2] > 0 and outputs[False][2] == 0
    torch.testing.assert_close(outputs[True][0], outputs[False][0], rtol=2e-2, atol=2e-2)
    for a, b in zip(outputs[True][1], outputs[False][1]):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("bucket", [4, 7, 16])
@pytest.mark.parametrize("lengths", [[5], [3, 9, 1, 6], [17, 4]])
def test_shape_buckets_change_no_output_or_gradient(monkeypatch, bucket, lengths):
    """Padding every document to the shape bucket gives the same logits and gradients as exact shapes (bucket 0)."""
    from odc_hf.attention import varlen as attention

    exact = _model(attention.register(attention.VarlenAttention(shape_bucket=0)))
    padded = _model(attention.register(attention.VarlenAttention(shape_bucket=bucket)))
    padded.load_state_dict(exact.state_dict())
    _, batch = _packed(lengths)
    ref = exact(**batch)
    ref.loss.backward()
    seen = []  # key lengths SDPA ran on: the padded path must have run, or the comparison proves nothing
    sdpa = attention.sdpa_attention_forward

    def recording(module, query, key, *args, **kwargs):
        seen.append(key.shape[2])
        return sdpa(module, query, key, *args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", recording)
    out = padded(**batch)
    out.loss.backward()
    padded_docs = sorted(n + (-n) % bucket for n in lengths)
    assert padded_docs != sorted(lengths)  # some document really is padded
    assert sorted(seen) == sorted(padded_docs * padded.config.num_hidden_layers)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-6)
    # fp32 rounding only: padded rows change the order in which the embedding gradient sums its rows (measured
    # up to 2.1e-7 on entries of magnitude ~1 with transformers 5.24); a wrong mask would move it by > 1e-3.
    for (name, p), q in zip(padded.named_parameters(), exact.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_warm_up_plans_every_bucket_and_is_a_no_op_off_cuda():
    from odc_hf.attention import varlen as attention

    model = _model(VARLEN_ATTENTION)
    assert attention.warm_up(model, max_length=64) == 0
    module = model.model.layers[0].self_attn
    assert attention._plan_shapes(module, model.config, 40, torch.device("cpu"), torch.float32, 16) == 3  # 16, 32, 48
    assert all(p.grad is None for p in model.parameters())


def test_non_causal_attention_is_never_padded():
    """Zero keys after the tokens would be visible to non-causal queries: those calls keep exact shapes."""
    from types import SimpleNamespace

    from odc_hf.attention import varlen as attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    for module, kwargs in ((SimpleNamespace(is_causal=False), {}), (SimpleNamespace(is_causal=True), {"is_causal": False})):
        out = attention._document(module, q, k, v, 0, 5, {"dropout": 0.0, "scaling": None, **kwargs}, 16)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        torch.testing.assert_close(out, ref)
    causal = attention._document(SimpleNamespace(is_causal=True), q, k, v, 0, 5, {"dropout": 0.0, "scaling": None}, 16)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(causal, ref)


def test_trainer_applies_the_odcconfig_attention_setting():
    """ODCConfig.attention_shape_bucket / attention_varlen_kernel choose the setting of a model on sdpa_varlen."""
    from types import SimpleNamespace

    from odc_hf.attention import varlen as attention
    from odc_hf.config import ODCConfig
    from odc_hf.integrations.compute.attention import choose_attention

    def check(model, config):
        accelerator = SimpleNamespace(unwrap_model=lambda m: m, mixed_precision="no", device=torch.device("cpu"),
                                      is_main_process=True)
        choose_attention(SimpleNamespace(accelerator=accelerator, model=model, odc_config=config))
        return attention.attention_of(model)

    model = _model(VARLEN_ATTENTION)
    assert check(model, ODCConfig()) == attention.VarlenAttention()  # the default: left as it is
    assert model.config._attn_implementation == VARLEN_ATTENTION
    setting = check(model, ODCConfig(attention_shape_bucket=0, attention_varlen_kernel=True))
    assert setting == attention.VarlenAttention(shape_bucket=0, varlen_kernel=True)
    assert model.config._attn_implementation == "sdpa_varlen_bucket0_kernel"
    plain = _model("sdpa")
    assert check(plain, ODCConfig(attention_shape_bucket=0, attention="model")) is None  # the model's own: untouched
    assert plain.config._attn_implementation == "sdpa"


def test_padded_batches_keep_their_mask_on_sdpa_varlen():
    """Left-padded batches (generation, TRL's padded GRPO rows) on sdpa_varlen: the padding mask reaches SDPA (the
    registered mask function), so logits and greedy generation equal transformers' sdpa exactly."""
    varlen, plain = _model(VARLEN_ATTENTION), _model("sdpa")
    plain.load_state_dict(varlen.state_dict())
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    a, b = varlen(input_ids=ids, attention_mask=mask).logits, plain(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(a[mask.bool()], b[mask.bool()], rtol=0, atol=0)
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(varlen.generate(ids, **kwargs), plain.generate(ids, **kwargs))


def test_bucketed_inputs_have_one_layout_and_skip_copies_of_whole_rows():
    """Every SDPA call of one length sees the same strides (one cuDNN plan, the one warm_up builds): (1, seq, heads,
    dim) in memory, the projections' layout. A one-document row of a bucket multiple already in that layout goes
    through as is (no copy); a padded, sliced or otherwise laid out document is copied."""
    from odc_hf.attention import varlen as attention

    g = torch.Generator().manual_seed(0)
    canonical = {32: (32 * 3 * 8, 8, 3 * 8, 1), 16: (16 * 3 * 8, 8, 3 * 8, 1)}
    for seq_major in (True, False):  # (1, seq, heads, dim) memory as transformers' projections make it; or contiguous
        base = torch.randn((1, 32, 3, 8) if seq_major else (1, 3, 32, 8), generator=g)
        row = base.transpose(1, 2) if seq_major else base
        whole = attention._bucketed(row, 32)
        assert (whole is row) == seq_major and whole.stride() == canonical[32] and torch.equal(whole, row)
        padded = attention._bucketed(row[:, :, 5:22], 32)  # a 17-token document padded to the bucket
        assert padded.shape == row.shape and padded.stride() == canonical[32]
        assert torch.equal(padded[:, :, :17], row[:, :, 5:22]) and not padded[:, :, 17:].any()
        inner = attention._bucketed(row[:, :, 16:], 16)  # a bucket multiple inside a longer row: copied
        assert inner.data_ptr() != row.data_ptr() and inner.stride() == canonical[16]
        assert torch.equal(inner, row[:, :, 16:])
