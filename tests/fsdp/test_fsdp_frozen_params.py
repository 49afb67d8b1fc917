"""Frozen parameters under ODC (LoRA): units mixing frozen and trainable parameters, and all-frozen (gather-only)
units. A tiny Llama with peft LoRA adapters on q_proj / v_proj, 2 ranks, uneven microbatch counts including zero:
LoRA weights after each of 3 minibatches equal a single process; frozen weights stay bit-identical; the fp32
accumulators hold exactly the trainable shards; gradients exist on trainable parameters only. Also: a bf16
frozen base next to fp32 adapters (FSDP2 then all-gathers bytes), the same under a bf16 param_dtype policy, and
a trainable parameter unused in some microbatches (torch >= 2.12 keeps the layout; older torch refuses clearly),
and LoRA on a 2 x 1 (replicate, shard) mesh.

The adapter never sees peft: it reads ``requires_grad`` only. The test builds the peft model.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from fsdp_helpers import VOCAB, loss_sum, max_rel_error, microbatch, snapshot, tokens
from torch.distributed.fsdp import FSDPModule

from odc_hf.testing import rank_device, run_ranks

SCHEDULE = [(2, 0), (1, 3), (0, 2)]  # microbatches per rank in each minibatch: uneven, with zeros
WORLD = 2


def tiny_llama_lora(base_dtype: torch.dtype = torch.float32):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).to(base_dtype)
    # r=3: LoRA A (3 x 32) shards unevenly over 2 ranks, so its padded shard is exercised. Random B (not the
    # default zeros) gives the A matrices a gradient from the first step on.
    lora = LoraConfig(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                      init_lora_weights=False)  # fmt: skip
    return get_peft_model(
        base, lora
    )  # adapters stay fp32 next to a bf16 base (peft's autocast_adapter_dtype)


def batches(minibatch: int, rank: int | None) -> list[torch.Tensor]:
    counts = SCHEDULE[minibatch]
    start = 0 if rank is None else sum(counts[:rank])
    n = sum(counts) if rank is None else counts[rank]
    return [microbatch(minibatch, start + i) for i in range(n)]


def trainable_of(model) -> dict[str, torch.Tensor]:
    return {n: t for n, t in snapshot(model, grads=False).items() if "lora_" in n}


def frozen_of(model) -> dict[str, torch.Tensor]:
    return {n: t for n, t in snapshot(model, grads=False).items() if "lora_" not in n}


def reference(base_dtype: torch.dtype) -> list[dict]:
    model = tiny_llama_lora(base_dtype)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    record = []
    for m in range(len(SCHEDULE)):
        batch = batches(m, None)
        total = tokens(batch)
        for ids in batch:
            (loss_sum(model, ids) / total).backward()
        opt.step()
        opt.zero_grad()
        record.append(trainable_of(model))
    return record


def _check_publishes_frozen_once(odc) -> None:
    """After install, the optimizer hook (publish(frozen=False)) rewrites trainable shards only."""
    unit = next(u for u in odc.units if u.trainable and len(u.trainable) < len(u.slots))
    slot = next(s for s in unit.slots if not s.trainable)
    staging = odc.transport.staging(unit.id)
    before = staging[slot.gather_offset : slot.gather_offset + slot.gather_numel].clone()
    local = slot.param.to_local()
    saved = local.clone()
    with torch.no_grad():
        local.add_(1.0)
        odc.publish(frozen=False)
        assert torch.equal(staging[slot.gather_offset : slot.gather_offset + slot.gather_numel], before)
        local.copy_(saved)
        odc.publish()  # explicit publish (after a checkpoint load, say) republishes every shard


def _run_lora(rank, world_size, variant):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from odc_hf.fsdp import install_odc, shard_model

    base_dtype = torch.bfloat16 if variant in ("mixed", "policy") else torch.float32
    model = tiny_llama_lora(base_dtype).to(rank_device())  # CUDA ranks (run_ranks(cuda=True)) may share a GPU
    initial_frozen = frozen_of(model)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if variant == "policy"
        else None
    )
    # "replicated": a 2 x 1 (replicate, shard) mesh: no ODC transport, one all-reduce per minibatch
    mesh = (
        init_device_mesh(rank_device().type, (2, 1), mesh_dim_names=("replicate", "shard"))
        if variant == "replicated"
        else None
    )
    shard_model(
        model.base_model.model, mp_policy=policy, mesh=mesh
    )  # the LlamaForCausalLM inside peft's wrappers
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    odc = install_odc(model, timeout_s=60)
    odc.attach_optimizer(opt)
    record = {"trainable": [], "gather_dtypes": sorted({str(u.spec.param_dtype) for u in odc.units})}
    for m in range(len(SCHEDULE)):
        mine = batches(m, rank)
        total = tokens(batches(m, None))
        for ids in mine:
            (loss_sum(model, ids) / total).backward()
        assert odc.finish_minibatch(tokens(mine)) == total
        for name, p in model.named_parameters():
            assert (p.grad is not None) == p.requires_grad, name  # .grad on trainable parameters only
        opt.step()
        opt.zero_grad()
        record["trainable"].append(trainable_of(model))
    record["frozen_unchanged"] = all(torch.equal(initial_frozen[n], t) for n, t in frozen_of(model).items())
    if odc.transport is None:  # replicated: FSDP2 accumulates locally, nothing to measure in a transport
        odc.close()
        return record
    # Accumulator bytes, read from the transport's buffers, against the trainable shards computed from the
    # parameter shapes: ceil(dim0 / world) rows each, fp32. The CPU transport keeps one slot per sender.
    trainable_shard_bytes = sum(math.ceil(p.shape[0] / world_size) * math.prod(p.shape[1:]) * 4
                                for p in model.parameters() if p.requires_grad)  # fmt: skip
    owner_bytes = sum(odc.transport.accumulated(u.id).nbytes for u in odc.units if not u.spec.gather_only)
    allocated = sum(odc.transport.nbytes(u.id).accumulator for u in odc.units)
    gather_only = [u.name for u in odc.units if u.spec.gather_only]
    record["accumulators"] = (owner_bytes, allocated, trainable_shard_bytes, gather_only)
    record["gather_only_bytes"] = [
        odc.transport.nbytes(u.id).accumulator for u in odc.units if u.spec.gather_only
    ]
    # what the benchmarks count per unit (UnitSpec.device_bytes) against this rank's buffers: staging + the owner's
    # accumulator shard (the CPU transport's other slots are the senders', the GPU transport has none)
    record["device_bytes"] = [
        (u.spec.device_bytes, odc.transport.nbytes(u.id).staging
         + (0 if u.spec.gather_only else odc.transport.accumulated(u.id).nbytes))
        for u in odc.units
    ]  # fmt: skip
    if variant == "fp32":
        _check_publishes_frozen_once(odc)
    odc.close()
    return record


class Gated(torch.nn.Module):
    """A frozen base, a trainable branch always used, and a trainable branch used in some microbatches only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.base, self.always, self.sometimes = (torch.nn.Linear(8, 8) for _ in range(3))
        self.base.requires_grad_(False)

    def forward(self, x, use_sometimes: bool):
        y = self.base(x) + self.always(x)
        return y + self.sometimes(x) if use_sometimes else y


def _gated_data(m: int, i: int):
    g = torch.Generator().manual_seed(100 * m + i)
    return torch.randn(3, 8, generator=g), (m + i) % 2 == 0


def _run_gated(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    from odc_hf.fsdp import install_odc
    from odc_hf.transport import ODCError

    model = Gated()
    fully_shard(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    odc = install_odc(model, timeout_s=60)
    odc.attach_optimizer(opt)
    try:
        for m, counts in enumerate(SCHEDULE):
            start = sum(counts[:rank])
            with odc.failure_guard():  # torch < 2.12 refuses on one rank: tell the other at once
                for i in range(start, start + counts[rank]):
                    x, use = _gated_data(m, i)
                    model(x, use).square().sum().backward()
            odc.finish_minibatch()
            opt.step()
            opt.zero_grad()
    except ODCError as err:
        odc.close()
        return f"ODCError: {err}"
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    odc.close()
    return params


def _everything(rank, world_size):
    return {"lora": {v: _run_lora(rank, world_size, v) for v in ("fp32", "mixed", "policy", "replicated")},
            "gated": _run_gated(rank, world_size)}  # fmt: skip


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_everything, WORLD, timeout_s=600)


@pytest.mark.parametrize("variant", ["fp32", "mixed", "replicated"])
def test_lora_matches_single_process(variant, runs):
    ref = reference(torch.bfloat16 if variant == "mixed" else torch.float32)
    got = runs[0]["lora"][variant]
    for m in range(len(SCHEDULE)):
        # fp32 LoRA arithmetic on both sides, the same per-sample forward; only the order in which microbatch
        # gradients are summed differs (a few fp32 ulps), carried over 3 SGD steps.
        assert max_rel_error(got["trainable"][m], ref[m]) <= 1e-5, m
    assert got["frozen_unchanged"], "frozen weights must stay bit for bit"
    if variant == "mixed":  # bf16 frozen base + fp32 adapters in one unit, no policy: FSDP2 gathers bytes
        assert "torch.uint8" in got["gather_dtypes"], got["gather_dtypes"]


def test_lora_under_a_bf16_policy(runs):
    got = runs[0]["lora"]["policy"]
    assert got["gather_dtypes"] == ["torch.bfloat16"]  # one dtype per unit: the policy's
    assert got["frozen_unchanged"]
    ref = reference(torch.bfloat16)
    for m in range(len(SCHEDULE)):
        # bf16 compute of the adapters (the policy casts them for the forward) vs fp32 adapters: bf16 tolerance.
        assert max_rel_error(got["trainable"][m], ref[m]) <= 3e-2, m


def test_accumulators_hold_exactly_the_trainable_shards(runs):
    for rank_record in runs:
        for variant, got in rank_record["lora"].items():
            if variant == "replicated":
                continue
            owner_bytes, allocated, trainable_shard_bytes, gather_only = got["accumulators"]
            assert owner_bytes == trainable_shard_bytes, variant
            assert allocated == WORLD * trainable_shard_bytes, variant  # CPU transport: one slot per sender
            # embed_tokens alone, and the tail [norm, lm_head]: nothing trainable, no accumulator at all
            assert len(gather_only) == 2 and any("embed_tokens" in n for n in gather_only), gather_only
            assert got["gather_only_bytes"] == [0] * len(gather_only)
            counted, measured = zip(*got["device_bytes"])
            assert counted == measured, variant  # frozen units: staging only (was shard_numel * (itemsize + 4))


def test_benchmarks_count_odc_buffers_as_the_transport_allocates_them():
    """Frozen (LoRA) units are gather-only: the benchmarks' ODC buffer bytes leave their fp32 accumulator out."""
    from odc_hf.transport import UnitSpec

    trainable = UnitSpec(name="t", shard_numel=1000, param_dtype=torch.bfloat16)
    frozen = UnitSpec(name="f", shard_numel=1000, param_dtype=torch.bfloat16, accum_numel=0)
    mixed = UnitSpec(name="m", shard_numel=1000, param_dtype=torch.bfloat16, accum_numel=24)  # LoRA A/B in a block
    assert (trainable.device_bytes, frozen.device_bytes, mixed.device_bytes) == (6000, 2000, 2096)
    root = Path(__file__).resolve().parents[2]
    for script in ("sft/fsdp_parity.py", "sft/e2e.py"):
        text = (root / "benchmarks" / script).read_text()
        assert "u.spec.device_bytes for u in odc.units" in text and "itemsize + 4" not in text, script


def test_trainable_param_unused_in_some_microbatches(runs):
    got = runs[0]["gated"]
    if not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):  # torch 2.11: a clear refusal
        assert "got no gradient" in got and "torch >= 2.12" in got, got
        return
    model = Gated()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for m, counts in enumerate(SCHEDULE):
        for i in range(sum(counts)):
            x, use = _gated_data(m, i)
            model(x, use).square().sum().backward()
        opt.step()
        opt.zero_grad()
    expected = {n: p.detach() for n, p in model.named_parameters()}
    assert max_rel_error(got, expected) <= 1e-5
    assert torch.equal(got["base.weight"], expected["base.weight"])


def _lora_on_cuda(rank, world_size, variant):
    return _run_lora(rank, world_size, variant)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (2 ranks share it when there is one)")
def test_lora_on_cuda_matches_single_process():
    # fp32 LoRA arithmetic on the GPU vs the CPU reference, the same per-sample forwards: the bound of the CPU test
    # (1e-5), frozen weights bit for bit; one GPU for both ranks (gloo, CUDA IPC) or one each. An untied head (the
    # tiny Llama's lm_head is its own weight).
    for variant in ("fp32", "mixed", "replicated"):  # one set of ranks each: a crash names its variant
        record = run_ranks(_lora_on_cuda, WORLD, variant, timeout_s=300, cuda=True)[0]
        ref = reference(torch.bfloat16 if variant == "mixed" else torch.float32)
        errors = [max_rel_error(record["trainable"][m], ref[m]) for m in range(len(SCHEDULE))]
        print(f"LoRA {variant} on CUDA vs one CPU process: {max(errors):.2e} max relative")
        # "mixed": the bf16 base's matmuls round to bf16 on another device than the CPU reference: bf16 tolerance
        assert max(errors) <= (3e-2 if variant == "mixed" else 1e-5), (variant, errors)
        assert record["frozen_unchanged"], variant


def test_unit_spec_accumulator_size():
    from odc_hf.transport import UnitSpec

    assert UnitSpec(name="u", shard_numel=8, param_dtype=torch.bfloat16).accum_numel == 8  # default: all trainable
    frozen = UnitSpec(name="f", shard_numel=8, param_dtype=torch.bfloat16, accum_numel=0)
    assert frozen.gather_only
    with pytest.raises(ValueError, match="accum_numel must be >= 0"):
        UnitSpec(name="x", shard_numel=8, param_dtype=torch.float32, accum_numel=-1)
