"""The FSDP2 internals odc_hf reads (odc_hf/fsdp/internals.py) exist on the installed torch and mean what we
assume: a unit's all-gather input is the concatenation of its params' padded shards, in fsdp_params order (which is
not parameters() order), checked against the buffer FSDP2 really hands a custom all-gather."""

from __future__ import annotations

import torch
from fsdp_helpers import VOCAB, tiny_qwen2

from odc_hf.testing import run_ranks


class _RecordingAllGather:
    """A custom all-gather (FSDP2's public hook) that records its input, then all-gathers it for real."""

    def __init__(self, log: list):
        self.log = log

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        import torch.distributed as dist

        self.log.append(input_tensor.detach().clone())
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def _padded_shards(params) -> torch.Tensor:
    """Each param's local shard, flattened, cast to bf16 and zero-padded to its padded shard size; concatenated."""
    parts = []
    for fp in params:
        local = fp.sharded_param.to_local().detach().reshape(-1).to(torch.bfloat16)
        padded = torch.zeros(fp.padded_sharded_param_size.numel(), dtype=torch.bfloat16)
        padded[: local.numel()] = local
        parts.append(padded)
    return torch.cat(parts)


def _inspect(rank, world_size):
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    from odc_hf.fsdp import internals, shard_model

    model = shard_model(tiny_qwen2(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    for name in ("set_custom_all_gather", "set_custom_reduce_scatter", "set_force_sum_reduction_for_comms",
                 "set_gradient_divide_factor"):  # fmt: skip
        assert hasattr(FSDPModule, name), name
    order_in_model = {id(p): i for i, p in enumerate(model.parameters())}
    units = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = internals.param_groups(module)
        if not groups or any(groups[0] is u[0] for u in units):
            continue  # no parameters, or fully_shard([norm, embed, lm_head]): three modules, one group
        params = internals.fsdp_params(groups[0])
        assert internals.all_gather_dtype(params) == {torch.bfloat16}
        log: list = []
        module.set_custom_all_gather(_RecordingAllGather(log))
        units.append((groups[0], params, log))
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids)
    results = []
    for _, params, log in units:
        assert log, "FSDP2 never called the unit's custom all-gather"
        by_model_order = sorted(params, key=lambda fp: order_in_model[id(fp.sharded_param)])
        results.append({
            "fsdp_order": torch.equal(log[0], _padded_shards(params)),
            "parameters_order": torch.equal(log[0], _padded_shards(by_model_order)),
            "padded": any(fp.sharded_param.to_local().numel() < fp.padded_sharded_param_size.numel() for fp in params),
        })  # fmt: skip
    return results


def test_all_gather_input_is_the_padded_shards_in_fsdp_params_order():
    # 3 ranks: the tiny model's even dimensions do not divide by 3, so the last rank's shards carry padding.
    ranks = run_ranks(_inspect, 3)
    for units in ranks:
        assert len(units) == 3  # 2 decoder layers + the tied tail unit [norm, embed, lm_head]; the root owns none
        assert all(u["fsdp_order"] for u in units), units
        assert any(not u["parameters_order"] for u in units), "no unit tells the two orders apart"
    assert any(u["padded"] for units in ranks for u in units), "no shard is padded: the padding went untested"
