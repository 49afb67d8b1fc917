"""The boundaries of a packed row reach every attention layer in the form transformers' flash path hands straight to
the varlen kernel: ``cu_seq_lens_q/k`` (int32 tensors) and ``max_length_q/k`` (Python ints), all four present
(``modeling_flash_attention_utils._flash_attention_forward``'s ``is_fa_with_varlen_kwargs``). With ``position_ids``
alone, the flash path would infer them in every layer (``_is_packed_sequence``'s ``.bool()`` and
``prepare_fa_kwargs_from_position_ids``' ``nonzero``: host syncs per layer). FlashAttention-4 itself needs a GPU; a
recording attention function in its place shows what each layer receives, from the SFT collator and from the GRPO
packed rows."""

from __future__ import annotations

import torch
from transformers import AttentionInterface, Qwen2ForCausalLM

from odc_hf.attention import sdpa_varlen_attention_forward
from odc_hf.integrations.trainer.bundle import BundleCollator
from odc_hf.integrations.trl.grpo_batch import pack_rows
from odc_hf.testing.data import tiny_qwen2_config

SEEN: list[dict] = []


def _recording(module, query, key, value, attention_mask, **kwargs):
    SEEN.append({k: kwargs.get(k) for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")})
    return sdpa_varlen_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("odc_test_recording", _recording)


def _layers_saw(batch: dict, lengths: list[int]) -> None:
    model = Qwen2ForCausalLM._from_config(tiny_qwen2_config(97), attn_implementation="odc_test_recording")
    SEEN.clear()
    model(**batch)
    assert len(SEEN) == model.config.num_hidden_layers
    expected = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    for seen in SEEN:
        for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
            assert seen[name].dtype == torch.int32 and seen[name].tolist() == expected, (name, seen[name])
        for name in ("max_length_q", "max_length_k"):
            assert type(seen[name]) is int and seen[name] == max(lengths), (name, seen[name])


def test_sft_microbatches_carry_the_varlen_kernel_s_boundaries():
    lengths = [7, 3, 12, 1]
    examples = [{"input_ids": list(range(1, n + 1))} for n in lengths]
    batch = BundleCollator(max_tokens_per_microbatch=64)([examples])[0]
    batch.pop("num_label_tokens")
    _layers_saw(batch, lengths)


def test_grpo_packed_rows_carry_the_varlen_kernel_s_boundaries():
    ids = torch.randint(1, 97, (2, 9))
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1]])
    packed = pack_rows(ids, mask, 5)
    packed.pop("index")
    _layers_saw(packed, [5, 9])
