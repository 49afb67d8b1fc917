"""odc_hf's gradient clipping (odc_hf/fsdp/gradients.py) against torch's own ``clip_grad_norm_`` on one process: the
norm over every shard, each norm type, the clipping coefficient, and the reductions it asks of the handle."""

from __future__ import annotations

import math

import pytest
import torch

from odc_hf.fsdp.gradients import clip_grad_norm_


class OneRank:
    """A handle of one rank: its barrier sums/maxes its own value; what it was asked is recorded."""

    def __init__(self):
        self.asked = []

    def reduce_sum(self, value, what=None):
        self.asked.append(("sum", value, what))
        return value

    def reduce_max(self, value):
        self.asked.append(("max", value))
        return value

    def _device(self):
        return torch.device("cpu")


def _params(seed=0, shapes=((3, 5), (7,), (0,), (2, 2))):
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=g) * 3
        params.append(p)
    params.append(torch.nn.Parameter(torch.zeros(4)))  # no gradient: skipped, as torch skips it
    return params


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.5, 4.0, 1e9, math.inf])
def test_norm_and_clipped_gradients_equal_torchs(norm_type, max_norm):
    ours, theirs = _params(), _params()
    got = clip_grad_norm_(OneRank(), ours, max_norm, norm_type)
    # torch's inf norm refuses an empty gradient (no identity for max); it adds nothing to any norm: leave it out
    want = torch.nn.utils.clip_grad_norm_([p for p in theirs if p.numel()], max_norm, norm_type)
    assert got.dtype == torch.float32 and got.dim() == 0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs):
        if b.grad is None:
            assert a.grad is None
        else:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_a_small_max_norm_really_clips_and_a_large_one_leaves_gradients_alone():
    """Control for the comparison above: the clipped norm is max_norm (so the coefficient was applied), and with a
    max_norm above the norm every gradient is bitwise unchanged (the coefficient is clamped at 1)."""
    params = _params()
    before = [p.grad.clone() for p in params if p.grad is not None]
    norm = float(clip_grad_norm_(OneRank(), params, 1e9))
    assert all(torch.equal(a, p.grad) for a, p in zip(before, [p for p in params if p.grad is not None]))
    clip_grad_norm_(OneRank(), params, norm / 4)
    after = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params if p.grad is not None]))
    assert abs(float(after) - norm / 4) < 1e-5 * norm


def test_the_shard_group_reduces_powers_for_finite_norms_and_maxima_for_inf():
    params = _params()
    handle = OneRank()
    clip_grad_norm_(handle, params, math.inf, 3.0)
    kind, value, what = handle.asked[0]
    expected = sum(float((p.grad.double().abs() ** 3).sum()) for p in params if p.grad is not None)
    assert (kind, what) == ("sum", "gradient-norm barrier") and value == pytest.approx(expected, rel=1e-12)
    handle = OneRank()
    clip_grad_norm_(handle, params, math.inf, math.inf)
    assert handle.asked == [("max", max(float(p.grad.abs().max()) for p in params if p.grad is not None and p.numel()))]


def test_the_norm_is_the_reduced_one_not_the_local_one():
    """Another rank's shards count: the handle's barrier returns the group's sum, and the norm and the clipping use it."""

    class TwoRanks(OneRank):
        def reduce_sum(self, value, what=None):
            return value + 16.0  # the other rank's |g|^2: 16

        def reduce_max(self, value):
            return max(value, 100.0)

    params = [torch.nn.Parameter(torch.zeros(1))]
    params[0].grad = torch.tensor([3.0])
    assert float(clip_grad_norm_(TwoRanks(), params, math.inf)) == pytest.approx(5.0)
    assert float(clip_grad_norm_(TwoRanks(), params, 2.5)) == pytest.approx(5.0)
    assert float(params[0].grad) == pytest.approx(3.0 * 2.5 / (5.0 + 1e-6))
    assert float(clip_grad_norm_(TwoRanks(), params, math.inf, math.inf)) == 100.0


def test_a_rank_with_no_gradients_joins_the_barrier_with_zero():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(0))]
    params[1].grad = torch.zeros(0)
    handle = OneRank()
    assert float(clip_grad_norm_(handle, params, 1.0)) == 0.0
    assert handle.asked == [("sum", 0.0, "gradient-norm barrier")]
    handle = OneRank()
    assert float(clip_grad_norm_(handle, params, 1.0, math.inf)) == 0.0 and handle.asked == [("max", 0.0)]


def test_dtensor_gradients_are_read_through_their_local_part():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from odc_hf.testing import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.tensor([3.0, 0.0, 0.0, 4.0]), mesh, [Shard(0)])
        assert float(clip_grad_norm_(OneRank(), [p], 1.0)) == pytest.approx(5.0)
        torch.testing.assert_close(p.grad.to_local(), torch.tensor([0.6, 0.0, 0.0, 0.8]), rtol=1e-5, atol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("norm_type", [0.5, 0.0, -1.0, float("nan")])
def test_a_norm_type_below_one_is_refused(norm_type):
    with pytest.raises(ValueError, match=r"norm_type must be >= 1 or inf, got"):
        clip_grad_norm_(OneRank(), _params(), 1.0, norm_type)


def _two_rank_dtensor_norm(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    class Group(OneRank):
        def reduce_sum(self, value, what=None):
            total = torch.tensor([value], dtype=torch.float64)
            dist.all_reduce(total)
            return float(total)

    mesh = init_device_mesh("cpu", (world_size,))
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Shard(0)]))
    full = torch.tensor([3.0, 0.0, 0.0, 4.0])  # rank 0 holds [3, 0], rank 1 [0, 4]
    p.grad = distribute_tensor(full, mesh, [Shard(0)])
    return float(clip_grad_norm_(Group(), [p], math.inf))


def test_dtensor_gradients_count_once_over_two_ranks():
    """Each rank's norm term is of its own shard, summed once by the handle's barrier: sqrt(9 + 16) = 5 on both ranks.
    A DTensor read whole (without its local part) would be reduced over the mesh and then again by the barrier."""
    from odc_hf.testing import run_ranks

    assert run_ranks(_two_rank_dtensor_norm, 2) == [pytest.approx(5.0)] * 2


def test_the_norm_is_fp32_on_the_gradients_device_or_the_handles_without_gradients():
    """The returned norm is a 0-d fp32 tensor (whatever torch's default dtype) on the gradients' device; a rank with
    no gradients puts it on its handle's device (meta here: a device no gradient is on)."""

    class MetaHandle(OneRank):
        def _device(self):
            return torch.device("meta")

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        norm = clip_grad_norm_(MetaHandle(), _params(), 1.0)
        assert norm.dtype == torch.float32 and norm.device.type == "cpu" and norm.dim() == 0
        empty = clip_grad_norm_(MetaHandle(), [torch.nn.Parameter(torch.zeros(2))], 1.0)
        assert empty.dtype == torch.float32 and empty.device.type == "meta"
    finally:
        torch.set_default_dtype(previous)


def test_the_clip_coefficient_is_max_norm_over_norm_plus_1e_6():
    """torch's clip_grads_with_norm_ divides by (norm + 1e-6): visible when the norm itself is ~1e-6."""
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3e-6, 4e-6])  # norm 5e-6
    clip_grad_norm_(OneRank(), [p], 1e-6)
    torch.testing.assert_close(p.grad, torch.tensor([3e-6, 4e-6]) * (1e-6 / 6e-6), rtol=1e-5, atol=0)
