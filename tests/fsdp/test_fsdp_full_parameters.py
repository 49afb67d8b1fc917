"""Whole parameters from ODC's published shards (``ODCHandle.full_parameters``), no collective, mapped to vLLM's names
(``odc_hf.integrations.vllm.weights``): equal to ``state_dict()`` of a single-process copy of the model, bit for bit.

2 CPU ranks, ``shard_model`` + ``install_odc``. The tiny Qwen2 has an odd vocabulary (257) and MLP width (75), so
FSDP2 pads rank 1's chunk of the embedding and of the gate/up projections: the padding must be cut exactly as FSDP2
lays it out. Cases: tied head (the shared weight comes once, under ``model.embed_tokens.weight``, as
``named_parameters()`` and vLLM's ``load_weights`` take it), untied head, a bf16 all-gather policy, after an
optimizer step (the newly published shards, compared with FSDP2's own ``full_tensor()``), LoRA merged (vs peft's
``merge_and_unload()``), and a unit that gathers mixed dtypes as raw bytes (a bf16 base with fp32 adapters). Negative
controls: a slot moved by one element is refused, an own shard put in the peer's row is caught by the comparison, and
reading between ``finish_minibatch`` and ``publish`` is refused.
"""

from __future__ import annotations

from odc_hf.testing import run_ranks

VOCAB, MLP = 257, 75  # odd: rank 1's chunks of the embedding and of gate/up_proj are padded


def _model(tie: bool, dtype=None):
    import torch
    from transformers import Qwen2ForCausalLM

    from odc_hf.testing.data import tiny_qwen2_config

    config = tiny_qwen2_config(
        VOCAB, intermediate_size=MLP, tie_word_embeddings=tie, attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    return model.to(dtype) if dtype is not None else model


def _lora(model, dtype=None):
    import torch
    from peft import LoraConfig, get_peft_model

    # init_lora_weights=False: B random (peft's default B = 0 would make every merge the base weight)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0,
                        init_lora_weights=False)  # fmt: skip
    torch.manual_seed(1)
    peft_model = get_peft_model(model, config)
    if dtype is not None:  # a bf16 base beside fp32 adapters: FSDP2 gathers the unit's raw bytes
        for name, param in peft_model.named_parameters():
            if "lora_" not in name:
                param.data = param.data.to(dtype)
    return peft_model, config


def _sharded(model, mp=None):
    from odc_hf.fsdp import install_odc, shard_model

    shard_model(model, mp_policy=mp)
    return install_odc(model, timeout_s=60)


def _compare(ours: dict, expected: dict, what: str) -> None:
    import torch

    assert set(ours) == set(expected), f"{what}: names {sorted(set(ours) ^ set(expected))} differ"
    for name, value in ours.items():
        ref = expected[name]
        assert value.dtype == ref.dtype and value.shape == ref.shape, (what, name, value.dtype, ref.dtype)
        assert torch.equal(value, ref), (
            f"{what}: {name} differs by {(value.float() - ref.float()).abs().max()}"
        )


def _mapped(odc, lora=None) -> dict:
    from odc_hf.integrations.vllm.weights import vllm_weights

    return {name: t.clone() for name, t in vllm_weights(odc.full_parameters(), lora)}


def _cases(rank: int, world_size: int) -> dict:
    import copy

    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from odc_hf.integrations.vllm.weights import LoraMerge
    from odc_hf.transport import ODCError

    torch.set_num_threads(1)
    report = {}
    for tie in (True, False):
        model = _model(tie)
        expected = {n: t.clone() for n, t in model.state_dict().items()}
        if tie:  # one tensor under two names in state_dict(); named_parameters() and vLLM take it once
            assert model.lm_head.weight is model.model.embed_tokens.weight
            del expected["lm_head.weight"]
        odc = _sharded(model)
        padded = [s.fsdp_param.padded_sharded_param_size[0] * world_size - s.param.shape[0]
                  for u in odc.units for s in u.slots]  # fmt: skip
        assert max(padded) > 0, "no parameter is padded: the case would not test FSDP2's padding"
        _compare(_mapped(odc), expected, f"tie={tie}")
        # after an optimizer step: the new shards, as FSDP2's own (collective) full_tensor() assembles them
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        odc.attach_optimizer(optimizer)
        ids = torch.randint(0, VOCAB, (1, 9 + 4 * rank))
        model(input_ids=ids, labels=ids).loss.backward()
        odc.finish_minibatch(0.0)
        try:
            next(iter(odc.full_parameters()))
            raise AssertionError("full_parameters() between finish_minibatch() and publish() was not refused")
        except ODCError as err:
            assert "publish" in str(err), err
        optimizer.step()
        stepped = {n: p.full_tensor() for n, p in model.named_parameters()}
        _compare(_mapped(odc), stepped, f"tie={tie} after a step")
        if tie:  # negative controls on this layout
            unit = next(u for u in odc.units if len(u.slots) > 1)
            unit.slots[1].gather_offset += 1
            try:
                list(odc.full_parameters())
                raise AssertionError("a slot moved by one element was not refused")
            except ODCError as err:
                assert "layout is corrupt" in str(err), err
            unit.slots[1].gather_offset -= 1
            odc.rank = 1 - odc.rank  # own shard into the peer's row: the peer's is lost
            wrong = _mapped(odc)
            odc.rank = 1 - odc.rank
            differ = [n for n in stepped if not torch.equal(wrong[n], stepped[n])]
            assert differ, "an own shard in the wrong row went unnoticed"
            report["wrong_row_detected_in"] = len(differ)
        odc.close()
    # bf16 all-gather dtype: the whole parameters in bf16, each the cast of the fp32 master
    model = _model(True)
    expected = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    odc = _sharded(model, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    _compare(_mapped(odc), expected, "bf16 policy")
    odc.close()
    # LoRA (fp32): merged as peft merges
    peft_model, config = _lora(_model(True))
    reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    del reference["lm_head.weight"]
    odc = _sharded(peft_model)
    # the merge is peft's arithmetic (W + (B @ A) * scaling, fp32) on the same operands in the same order: bit-equal
    _compare(_mapped(odc, LoraMerge.from_config(config)), reference, "LoRA fp32")
    odc.close()
    # a bf16 base with fp32 adapters: the units gather raw bytes; the raw parameters exactly, then the merge
    peft_model, config = _lora(_model(True), torch.bfloat16)
    raw = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    del reference["lm_head.weight"]
    odc = _sharded(peft_model)
    assert any(u.spec.param_dtype == torch.uint8 for u in odc.units), "no unit gathers bytes"
    _compare({n: t.clone() for n, t in odc.full_parameters()}, raw, "mixed dtypes, raw")
    # peft adds the fp32 delta into the bf16 weight (one rounding of the fp32 sum), as the merge here does
    _compare(_mapped(odc, LoraMerge.from_config(config)), reference, "LoRA bf16 base")
    odc.close()
    return report


def test_full_parameters_equal_the_single_process_state_dict():
    reports = run_ranks(_cases, 2, timeout_s=240)
    # the own shard copied into the peer's row changes every parameter of every unit (26 of the tied model's 26)
    assert all(report["wrong_row_detected_in"] == 26 for report in reports), reports
