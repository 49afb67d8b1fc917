"""odc_hf's per-document attention applies each family's attention arguments (odc_hf/attention/variants.py): a packed
row through ``sdpa_varlen`` / ``eager_varlen`` gives the logits and gradients of each document run alone through the
model's own eager attention, with documents longer than the window split into several query blocks; an argument it
does not know is refused by name, and the arguments every model's forward passes down are not refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

import odc_hf.attention.varlen
from odc_hf.attention import variants

SIZE = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0)  # fmt: skip
TWO = ["sliding_attention", "full_attention"]
CONFIGS = {
    "mistral_window": lambda: transformers.MistralConfig(**SIZE, sliding_window=12),
    "gemma2_window_softcap": lambda: transformers.Gemma2Config(**SIZE, head_dim=8, query_pre_attn_scalar=8,
                                                              sliding_window=12, attn_logit_softcapping=0.05,
                                                              layer_types=TWO),  # fmt: skip
    "gpt_oss_window_sinks": lambda: transformers.GptOssConfig(**SIZE, head_dim=8, sliding_window=12, layer_types=TWO,
                                                              num_local_experts=4, num_experts_per_tok=2),  # fmt: skip
}
LENGTHS = (45, 7, 60, 12)  # two documents of several windows, one shorter than a window, one exactly one


def _model(name: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="eager").float()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_()  # unit-scale sinks: they take a real share of each row
    return model


def _logits_and_grads(model, forward):
    model.zero_grad()
    logits = forward()
    logits.pow(2).mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("block", [variants.BLOCK, 8, 13, 17])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_packed_row_equals_each_document_alone_through_the_models_own_attention(name, block, monkeypatch):
    # 8 (raised to the window, 12), 13 and 17: documents longer than the window run in several query blocks; 13 and 17
    # put block edges where no window edge is, so a window off by one at a block edge shows
    monkeypatch.setattr(variants, "BLOCK", block)
    model = _model(name)
    docs = [torch.randint(1, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
    reference = _logits_and_grads(model, lambda: torch.cat([model(input_ids=d[None], use_cache=False).logits[0]
                                                           for d in docs]))  # fmt: skip
    model.set_attn_implementation("sdpa_varlen" if model._supports_sdpa else "eager_varlen")
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    packed = dict(input_ids=torch.cat(docs)[None], position_ids=torch.cat([torch.arange(n) for n in LENGTHS])[None],
                  cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS), max_length_k=max(LENGTHS),
                  use_cache=False)  # fmt: skip
    ours = _logits_and_grads(model, lambda: model(**packed).logits[0])
    # fp32, the same terms in another order: measured <= 4.7e-7 (logits) and 7.3e-7 (gradients) relative to the
    # largest; a dropped window, soft-cap or sink moves them by > 1e-3 (tests/models/test_model_zoo.py's controls)
    torch.testing.assert_close(ours[0], reference[0], rtol=0, atol=1e-5 * float(reference[0].abs().max()))
    for a, b in zip(ours[1], reference[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * float(b.abs().max()))
    # broken twins: the same row without its boundaries (documents attend to each other), and with the window dropped
    bound = 1e-5 * float(reference[0].abs().max())
    unbounded = {k: v for k, v in packed.items() if not k.startswith(("cu_seq", "max_length"))}
    assert float((model(**unbounded).logits[0].detach() - reference[0]).abs().max()) > 100 * bound
    real = variants.take_variant
    monkeypatch.setattr(variants, "take_variant", lambda *a, **k: dataclasses.replace(real(*a, **k), window=None))
    monkeypatch.setattr(odc_hf.attention.varlen, "take_variant", variants.take_variant)
    assert float((model(**packed).logits[0].detach() - reference[0]).abs().max()) > 100 * bound


def test_an_attention_argument_odc_hf_does_not_apply_is_refused_by_name():
    module = torch.nn.Module()
    with pytest.raises(variants.UnsupportedAttentionArgument, match=r"\['chunk_size'\] from Module"):
        variants.take_variant(module, {"scaling": 0.5, "chunk_size": 16})
    variants.take_variant(module, {"chunk_size": None})  # an argument the family left unset changes nothing


def test_what_every_models_forward_passes_down_is_not_refused():
    flow = {"num_items_in_batch": torch.tensor(7), "output_hidden_states": False, "output_router_logits": True,
            "position_ids": torch.arange(4)[None], "use_cache": False, "is_causal": True}  # fmt: skip
    kwargs = dict(flow, scaling=0.5, sliding_window=4, softcap=None, s_aux=None)
    variant = variants.take_variant(torch.nn.Module(), kwargs)
    assert variant == variants.Variant(window=4)
    assert kwargs == {"scaling": 0.5, "is_causal": True}  # the rest was read or is inert


_BUILD_ON_EAGER_VARLEN = """
import sys, torch, transformers
if sys.argv[1] == "import":
    import odc_hf.attention
config = transformers.GptOssConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                   num_experts_per_tok=2, layer_types=["full_attention"])
model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager_varlen")
model(input_ids=torch.tensor([[1, 2, 3]]))
from odc_hf.attention import CALLS
print("calls", sum(CALLS.values()))
"""


def test_eager_varlen_is_registered_for_families_without_sdpa():
    """In a fresh interpreter, importing odc_hf.attention is what makes transformers accept ``"eager_varlen"`` for a
    family without SDPA (GPT-OSS), and its forward then runs through odc_hf's function; without the import (the
    control) transformers refuses the name."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    run = [sys.executable, "-c", _BUILD_ON_EAGER_VARLEN]
    ours = subprocess.run([*run, "import"], capture_output=True, text=True, timeout=300, env=env)
    assert ours.returncode == 0, ours.stderr[-2000:]
    assert int(ours.stdout.split("calls")[-1]) > 0, ours.stdout
    bare = subprocess.run([*run, "no-import"], capture_output=True, text=True, timeout=300, env=env)
    assert bare.returncode != 0 and "eager_varlen" in bare.stderr, bare.stderr[-2000:]
    assert odc_hf.attention.VarlenAttention(eager=True).name == odc_hf.attention.EAGER_VARLEN_ATTENTION


@pytest.mark.parametrize("name", list(CONFIGS))
def test_padded_rows_equal_the_models_own_attention_with_its_mask(name, monkeypatch):
    """Padded rows (a 2-D padding mask, as in batched generation and TRL's padded GRPO rows) take the masked path:
    SDPA with transformers' mask, or the family's eager attention with it (soft-capping, sinks). The real tokens'
    logits equal the model's own eager attention on the same batch, windows included (rows longer than the window).
    Twin: the mask dropped inside the masked path (padding attended) differs."""
    model = _model(name)
    ids = torch.randint(1, 97, (2, 30), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :7] = 0  # left padding, as generation pads
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        varlen = "eager_varlen" if name != "mistral_window" else "sdpa_varlen"
        model.set_attn_implementation(varlen)
        ours = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        real = mask.bool()
        difference = float((ours[real] - reference[real]).abs().max())
        assert difference <= 1e-5 * float(reference[real].abs().max()), difference
        original = variants.masked_attention
        monkeypatch.setattr(odc_hf.attention.varlen, "masked_attention",
                            lambda m, q, k, v, attention_mask, *a: original(m, q, k, v, None, *a))  # fmt: skip
        unmasked = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        assert float((unmasked[real] - reference[real]).abs().max()) > 100 * max(difference, 1e-7)


def test_a_window_the_layer_keeps_as_an_attribute_is_read_when_the_call_passes_none():
    """A layer that keeps ``sliding_window`` as an attribute and leaves it to the model's mask (Qwen2-MoE) gets it
    applied; an argument of the call wins; anything but an integer (a flag, a string) is no window."""
    layer = torch.nn.Module()
    layer.sliding_window = 4
    assert variants.take_variant(layer, {}).window == 4
    assert variants.take_variant(layer, {"sliding_window": 6}).window == 6
    for odd in (True, "4", 4.0, None):
        layer.sliding_window = odd
        assert variants.take_variant(layer, {}).window is None, odd


@pytest.mark.parametrize("window", [None, 1, 3, 50])
@pytest.mark.parametrize("offset", [0, 4])
def test_allowed_is_causal_within_the_window_and_additive_keeps_its_zeros(window, offset):
    """``allowed``: query i (at i + offset) sees key j iff j <= i + offset and, with a window w, j > i + offset - w;
    ``additive``: 0 where allowed, the dtype's minimum elsewhere, in that dtype."""
    mask = variants.allowed(2, 9, 1, 12, window, q_offset=offset)
    expected = torch.tensor([[j <= i + offset and (window is None or j > i + offset - window) for j in range(1, 12)]
                             for i in range(2, 9)])  # fmt: skip
    assert torch.equal(mask, expected)
    for dtype in (torch.float32, torch.bfloat16):
        add = variants.additive(mask, dtype)
        assert add.dtype == dtype and torch.equal(add == 0, mask)
        assert torch.all(add[~mask] == torch.finfo(dtype).min)


def test_the_familys_own_eager_function_or_a_named_refusal():
    from transformers.models.gemma2 import modeling_gemma2

    model = _model("gemma2_window_softcap")
    layer = next(m for m in model.modules() if type(m).__name__ == "Gemma2Attention")
    assert variants.eager_function(layer) is modeling_gemma2.eager_attention_forward
    with pytest.raises(variants.UnsupportedAttentionArgument,
                       match=r"^Linear needs soft-capping or attention sinks, and its modeling file "
                             r"\(torch\.nn\.modules\.linear\) has no eager_attention_forward"):  # fmt: skip
        variants.eager_function(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("name", ["gemma2_window_softcap", "gpt_oss_window_sinks"])
def test_cached_decoding_equals_the_models_own_attention(name):
    """Generation with a cache: each decode step's query sits at the end of its keys (no mask: the masked path builds
    the causal, windowed one with the queries' offset). Greedy tokens and every step's logits equal eager's."""
    model = _model(name)
    ids = torch.randint(1, 97, (1, 20), generator=torch.Generator().manual_seed(5))
    kwargs = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        reference = model.generate(ids, **kwargs)
        model.set_attn_implementation("eager_varlen")
        ours = model.generate(ids, **kwargs)
    assert torch.equal(ours.sequences, reference.sequences)
    for a, b in zip(ours.logits, reference.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_refusals_say_what_the_layer_passed_and_what_to_use():
    class OddLayer(torch.nn.Module):
        pass

    with pytest.raises(variants.UnsupportedAttentionArgument) as refused:
        variants.take_variant(OddLayer(), {"alibi": torch.zeros(1)})
    assert str(refused.value) == (
        f"odc_hf's packed-row attention (sdpa_varlen) got the attention argument(s) ['alibi'] from OddLayer "
        f"({__name__}) and does not apply them per document; the model would train differently from its definition. "
        "Use ODCConfig(attention='model') with the model loaded with attn_implementation='sdpa' or 'eager' "
        "(transformers' own masks over packed rows)"
    )
    assert variants.take_variant(OddLayer(), {"sliding_window": 1}).window == 1  # a query sees itself alone
    for bad in (0, -3, 2.5):
        with pytest.raises(variants.UnsupportedAttentionArgument,
                           match=rf"^OddLayer: sliding_window={bad!r} is not a window size$"):  # fmt: skip
            variants.take_variant(OddLayer(), {"sliding_window": bad})
    with pytest.raises(variants.UnsupportedAttentionArgument, match=r"ODCConfig\(attention='model'\) with "
                       r"attn_implementation='eager'$"):  # fmt: skip
        variants.eager_function(OddLayer())


def _by_hand(query, key, value, mask, scale, softcap=None):
    """Attention written out in float64: ``softmax(q k^T x scale [soft-capped] + mask) v`` as ``(batch, n, heads,
    dim)``; ``mask`` boolean (True: the key is seen)."""
    q, k, v = (t.double() for t in (query, key, value))
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (weights @ v).transpose(1, 2)


def _layer():
    layer = torch.nn.Module()  # what the attention functions read off the layer: training, groups, causality
    layer.num_key_value_groups, layer.is_causal, layer.training = 1, True, False
    return layer


def test_every_argument_of_the_call_reaches_the_attention_on_every_path():
    """The call's ``scaling`` and ``dropout`` reach SDPA on the windowed path of a packed row and on the padded path,
    and a cached decode step with more keys than its window sees only the last ``window`` of them. A scale that is not
    SDPA's default (1 / sqrt(dim)), because Gemma-style ``query_pre_attn_scalar`` sets one: a path that dropped it
    would use the default and differ from the hand-written reference; with ``dropout=1.0`` every weight is dropped
    (zeros), which a path that dropped it would not do."""
    from transformers.models.gemma2 import modeling_gemma2

    gen = torch.Generator().manual_seed(11)
    heads, n, dim, window, scale = 2, 21, 8, 5, 0.9  # SDPA's default here would be 8 ** -0.5 = 0.35
    q, k, v = (torch.randn(1, heads, n, dim, generator=gen) for _ in range(3))
    tol = dict(rtol=0, atol=1e-5)
    # a packed row's document longer than its window: banded SDPA over query blocks that straddle window edges
    banded = variants.allowed(0, n, 0, n, window)
    ours = variants.document_attention(_layer(), q, k, v, variants.Variant(window=window), {"scaling": scale})
    torch.testing.assert_close(ours.double(), _by_hand(q, k, v, banded, scale), **tol)
    dropped = variants.document_attention(_layer(), q, k, v, variants.Variant(window=window),
                                          {"scaling": scale, "dropout": 1.0})  # fmt: skip
    assert torch.count_nonzero(dropped) == 0
    # padded rows: transformers' boolean mask (left padding of 4), no window in the variant (it is in the mask)
    padded = torch.tril(torch.ones(n, n, dtype=torch.bool))
    padded[:, :4] = False
    padded[:4, :4] = torch.eye(4, dtype=torch.bool)  # padding positions see themselves (no empty rows)
    ours = variants.masked_attention(_layer(), q, k, v, padded[None, None], variants.Variant(), {"scaling": scale})[0]
    torch.testing.assert_close(ours.double(), _by_hand(q, k, v, padded, scale), **tol)
    dropped = variants.masked_attention(_layer(), q, k, v, padded[None, None], variants.Variant(),
                                        {"scaling": scale, "dropout": 1.0})[0]  # fmt: skip
    assert torch.count_nonzero(dropped) == 0
    # a cached decode step: 2 queries at the end of 21 keys, soft-capped (the family's eager path), no mask handed in
    gemma_layer = next(m for m in _model("gemma2_window_softcap").modules() if type(m).__name__ == "Gemma2Attention")
    gemma_layer.num_key_value_groups = 1
    decode = variants.allowed(0, 2, 0, n, window, q_offset=n - 2)
    assert int(decode.sum()) == 2 * window  # each query sees exactly its window, not the whole cache
    variant = variants.Variant(window=window, softcap=0.7)
    ours = variants.masked_attention(gemma_layer, q[:, :, -2:], k, v, None, variant, {"scaling": scale})[0]
    assert variants.eager_function(gemma_layer) is modeling_gemma2.eager_attention_forward
    torch.testing.assert_close(ours.double(), _by_hand(q[:, :, -2:], k, v, decode, scale, softcap=0.7), **tol)
    # the twin: the same decode step over the whole cache differs (the window is what the reference applies)
    whole = _by_hand(q[:, :, -2:], k, v, torch.ones_like(decode), scale, softcap=0.7)
    assert float((ours.double() - whole).abs().max()) > 1e-2


def test_the_familys_eager_function_gets_every_argument_by_transformers_names(monkeypatch):
    """The tested families read their sinks from the module and their window from the mask; a family whose eager
    function reads ``s_aux``, ``sliding_window`` or ``softcap`` from its arguments (transformers' names for them) gets
    what the call gave, on every path: per-document blocks, padded rows, a cached decode step; and ``eager_varlen``'s
    family_eager sends a call with only a window there too. The masks odc_hf builds for it are on the query's device
    (tensors on ``meta`` here stand for a GPU: a mask made on the CPU would not match them)."""
    import sys
    import types

    calls = []

    def eager_attention_forward(module, query, key, value, attention_mask, **kwargs):
        assert attention_mask.device == query.device
        calls.append(kwargs)
        return query.transpose(1, 2), None

    family = types.ModuleType("odc_hf_test_family_modeling")
    family.eager_attention_forward = eager_attention_forward
    monkeypatch.setitem(sys.modules, family.__name__, family)
    layer = type("FamilyAttention", (torch.nn.Module,), {"__module__": family.__name__})()
    for device in ("cpu", "meta"):
        sinks = torch.zeros(4, device=device)
        q = k = v = torch.zeros(1, 4, 40, 8, device=device)  # one document of 40 tokens, a window of 12: several blocks
        padded = torch.ones(1, 1, 40, 40, dtype=torch.bool, device=device)
        paths = [  # (name, function, its tensors before the variant)
            ("per-document blocks", variants.document_attention, (q, k, v)),
            ("padded rows", variants.masked_attention, (q, k, v, padded)),
            ("decode step", variants.masked_attention, (q[:, :, -1:], k, v, None)),
        ]
        with_sinks = {"scaling": 0.5, "sliding_window": 12, "softcap": 30.0, "s_aux": sinks}
        for family_eager, call in ((False, with_sinks), (True, {"scaling": 0.5, "sliding_window": 12})):
            want = {name: value for name, value in call.items() if name != "s_aux"}
            for path, function, tensors in paths:
                calls.clear()
                rest = dict(call)
                function(layer, *tensors, variants.take_variant(layer, rest, family_eager=family_eager), rest)
                assert calls, f"{path} on {device}: the family's eager function was not called"
                for got in calls:
                    assert {name: got.get(name) for name in want} == want, path
                    assert (got.get("s_aux") is sinks) == ("s_aux" in call), path
