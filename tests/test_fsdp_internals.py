"""The FSDP2 internals odc_hf reads (odc_hf/fsdp/internals.py) exist on the installed torch and mean what we
assume: a unit's all-gather input is the concatenation of its params' padded shards, in fsdp_params order."""

from __future__ import annotations

import torch
from fsdp_helpers import tiny_qwen2

from odc_hf.testing import run_ranks


def _inspect(rank, world_size):
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    from odc_hf.fsdp import internals, shard_model

    model = shard_model(tiny_qwen2(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    for name in ("set_custom_all_gather", "set_custom_reduce_scatter", "set_force_sum_reduction_for_comms",
                 "set_gradient_divide_factor"):  # fmt: skip
        assert hasattr(FSDPModule, name), name
    groups_seen = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = internals.param_groups(module)
        if not groups:
            continue
        groups_seen.add(id(groups[0]))  # fully_shard([norm, embed, lm_head]): three modules, one group
        params = internals.fsdp_params(groups[0])
        assert internals.all_gather_dtype(groups[0], params) == {torch.bfloat16}
        for fp in params:
            padded = fp.padded_sharded_param_size.numel()
            assert fp.sharded_param.to_local().numel() <= padded
            assert padded * world_size >= fp.sharded_param.numel()
    return len(groups_seen)


def test_internals_exist_and_layout_is_as_assumed():
    # 2 decoder layers + the tied tail unit [norm, embed, lm_head]; the root owns no parameters.
    assert run_ranks(_inspect, 2) == [3, 3]
