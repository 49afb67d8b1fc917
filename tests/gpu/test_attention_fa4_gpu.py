"""FlashAttention-4 through transformers (one GPU, Hopper or newer, flash-attn-4 installed; `pytest -m gpu`): a
2-layer Qwen2 model's loss and gradients on packed rows of several documents equal sdpa_varlen's within bf16
tolerance, and ODCConfig.attention="auto" resolves to it there."""

from __future__ import annotations

import pytest
import torch

from odc_hf.integrations.compute.attention import FLASH_ATTENTION_4, fa4_problem

pytestmark = pytest.mark.gpu


def _why_not() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return fa4_problem("cuda", torch.bfloat16, type("FlashModel", (), {"_supports_flash_attn": True})())


@pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))
def test_fa4_loss_and_gradients_equal_sdpa_varlen_on_packed_rows():
    from transformers import Qwen2ForCausalLM

    from odc_hf.attention import VARLEN_ATTENTION
    from odc_hf.integrations.compute.attention import resolve_attention
    from odc_hf.integrations.trainer.bundle import BundleCollator
    from odc_hf.testing.data import tiny_qwen2_config

    # head_dim 128 and GQA 12/2 as Qwen2.5-1.5B (FA4's kernels are built for such heads), 2 layers
    config = tiny_qwen2_config(1024, hidden_size=1536, num_layers=2, intermediate_size=2048, num_heads=12,
                               num_kv_heads=2)  # fmt: skip
    torch.manual_seed(0)
    models = {}
    for name in (VARLEN_ATTENTION, FLASH_ATTENTION_4):
        with torch.device("cuda"):
            models[name] = Qwen2ForCausalLM._from_config(config, attn_implementation=VARLEN_ATTENTION,
                                                         dtype=torch.bfloat16)  # fmt: skip
        models[name].load_state_dict(models[VARLEN_ATTENTION].state_dict())  # the same weights
        models[name].set_attn_implementation(name)
    assert resolve_attention("auto", "sdpa", _why_not(), VARLEN_ATTENTION)[0] == FLASH_ATTENTION_4
    g = torch.Generator().manual_seed(1)
    docs = [1500, 700, 333, 64, 17, 1]  # several documents of uneven lengths, one of a single token
    examples = [{"input_ids": torch.randint(1, 1024, (n,), generator=g).tolist()} for n in docs]
    batch = BundleCollator().collate_microbatch(examples)
    batch.pop("num_label_tokens")
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
    losses = {}
    for name, model in models.items():
        out = model(**batch)
        out.loss.backward()
        losses[name] = out.loss.float().item()
    # bf16 (unit roundoff 3.9e-3), two kernels with different accumulation orders: the loss to 1e-2 relative, every
    # gradient tensor to 5e-2 of its norm (FA4 vs cuDNN dq/dk differ by 3.2e-3 / 3.6e-3 relative at kernel level).
    assert losses[FLASH_ATTENTION_4] == pytest.approx(losses[VARLEN_ATTENTION], rel=1e-2)
    params = dict(models[FLASH_ATTENTION_4].named_parameters())
    for name, p in models[VARLEN_ATTENTION].named_parameters():
        a, b = params[name].grad.float(), p.grad.float()
        assert (a - b).norm() <= 5e-2 * b.norm() + 1e-6, (name, ((a - b).norm() / b.norm()).item())
