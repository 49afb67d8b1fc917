"""ODC through FSDP2's hooks gives the gradients of a single-process run and of FSDP2 collectives, with uneven
microbatch counts per rank (including zero), fp32 and bf16 mixed precision; clipping norms match."""

from __future__ import annotations

import functools

import pytest
import torch
from fsdp_helpers import distributed_run, max_rel_error, reference_run

from odc_hf.testing import run_ranks

COUNTS = {2: (3, 1), 4: (3, 1, 0, 2)}
MINIBATCHES = 3
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # GPU runs: tests/README.md


@pytest.fixture(scope="module")
def references():
    return {w: reference_run(COUNTS[w], MINIBATCHES) for w in COUNTS}


def _backend(device: str, world_size: int) -> dict:
    """run_ranks' arguments: CUDA ranks share the GPU(s) when there are fewer than ranks (gloo, CUDA IPC)."""
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        return {"cuda": True}
    return {}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world_size", [2, 4])
def test_odc_fp32_matches_single_process_and_fsdp(world_size, device, references):
    counts, backend = COUNTS[world_size], _backend(device, world_size)
    odc = run_ranks(distributed_run, world_size, counts, MINIBATCHES, "odc", "fp32", **backend)[0]
    fsdp = run_ranks(distributed_run, world_size, counts, MINIBATCHES, "fsdp", "fp32", **backend)[0]
    ref = references[world_size]
    assert all(len(set(r["counts"])) > 1 for r in odc), "microbatch counts must be uneven"
    if world_size == 4:
        assert all(0 in r["counts"] for r in odc), "a rank must run zero microbatches"
    for m in range(MINIBATCHES):
        # fp32, the same per-microbatch terms summed in another order (per rank, then across ranks; the single
        # process sums the whole minibatch at once). Norm-wise relative errors measured on CPU (torch 2.13):
        # gradients 5.6e-7 to 7.7e-7, parameters 2.1e-7 to 5.3e-7, norms <= 2.1e-7, against either reference;
        # bound 1e-5 (13x: gradient elements cancel, and GPU kernels reorder more). A lost or doubled microbatch, or a
        # rank's push landing in the wrong shard, gives >= 1e-1.
        for other in (ref[m], fsdp[m]):
            assert max_rel_error(odc[m]["grads"], other["grads"]) <= 1e-5, m
            assert max_rel_error(odc[m]["params"], other["params"]) <= 1e-5, m
            assert odc[m]["norm"] == pytest.approx(other["norm"], rel=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tie", [True, False], ids=["tied_head", "untied_head"])
def test_a_rank_without_microbatches_after_an_evaluation_clips_its_own_shards(references, tie, device):
    """An evaluation (a forward without backward) leaves FSDP2's root unit gathered: its module then shows unsharded
    parameters, without the gradient shards ODC set on the sharded ones. A rank that trains no microbatch in the next
    minibatch never runs the backward that would reshard it; its clip then left its shards of the root's parameters out
    of the norm and unclipped (the trainer's eval_on_start with such a first step deadlocked in the clip, half the
    ranks taking accelerate's path). Every rank ends the minibatch resharded, so the run equals the reference."""
    counts = COUNTS[4]
    odc = run_ranks(functools.partial(distributed_run, evaluate=True, tie=tie), 4, counts, MINIBATCHES, "odc",
                    "fp32", **_backend(device, 4))[0]  # fmt: skip
    ref = references[4] if tie else reference_run(counts, MINIBATCHES, tie=False)
    assert all(0 in r["counts"] for r in odc)
    for m in range(MINIBATCHES):
        assert max_rel_error(odc[m]["grads"], ref[m]["grads"]) <= 1e-5, m  # bound and measurements: the test above
        assert max_rel_error(odc[m]["params"], ref[m]["params"]) <= 1e-5, m
        assert odc[m]["norm"] == pytest.approx(ref[m]["norm"], rel=1e-5)


NO_CLIP = 1e9  # above every gradient norm (1.3-1.8 here): the clipping coefficient is exactly 1


@pytest.mark.parametrize("device", DEVICES)
def test_odc_bf16_matches_fsdp_within_bf16_tolerance(device):
    # Unclipped (NO_CLIP): ODC clips with its own code, FSDP2 with torch's, whose norms differ by rounding; under bf16
    # compute a last-bit difference in a clipped update can flip a parameter's bf16 rounding (measured on the GPU:
    # gradients 6.9e-3 apart by minibatch 3). The clipping itself is compared with torch's in the fp32 test above
    # (clipping active there: norms 1.3-1.8 against max_norm 1.0) and here through the norms.
    counts, backend = COUNTS[2], _backend(device, 2)
    odc = run_ranks(functools.partial(distributed_run, max_norm=NO_CLIP), 2, counts, MINIBATCHES, "odc", "bf16",
                    **backend)[0]  # fmt: skip
    fsdp = run_ranks(functools.partial(distributed_run, max_norm=NO_CLIP), 2, counts, MINIBATCHES, "fsdp", "bf16",
                     **backend)[0]  # fmt: skip
    ref = reference_run(counts, MINIBATCHES, max_norm=NO_CLIP)
    for m in range(MINIBATCHES):
        # Same policy, same bf16 compute on the same ranks: every microbatch's fp32 gradient rows are bitwise equal,
        # and only the order in which the <= 4 rows of an element are summed differs (FSDP2: reduce-scatter, then
        # accumulate; ODC: pushes into the accumulator). fp32 reordering moves a sum of k terms by at most
        # (k - 1) * 2^-24 of its absolute sum: 1.8e-7, so 1e-6 leaves room for some cancellation. Measured on CPU
        # (torch 2.13): 0 to 2.4e-9 for gradients, parameters bitwise equal. A wrong bf16 rounding of the gathered
        # parameters or of the pushed rows gives ~3e-3 (an 8-bit mantissa), 3000x above this bound.
        assert max_rel_error(odc[m]["grads"], fsdp[m]["grads"]) <= 1e-6, m
        assert max_rel_error(odc[m]["params"], fsdp[m]["params"]) <= 1e-6, m
        # ODC's norm (fp64 sums of the local shards) vs torch's (fp32, functional all-reduce) on those gradients:
        # measured <= 9.0e-8 relative; bound 1e-5 (a shard left out of the sum moves it by ~30%)
        assert odc[m]["norm"] == pytest.approx(fsdp[m]["norm"], rel=1e-5), m
        # Against the fp32 single-process run, bf16 compute: its unit roundoff 2^-8 = 3.9e-3, compounded over the
        # layers and, unclipped, over larger updates (measured 1.5e-2 to 2.4e-2 for gradients, 2.3e-4 to 9.2e-3 for
        # the gradient norm); bounds 5e-2 and 3e-2. A lost or doubled microbatch moves either by 1e-1 or more.
        assert max_rel_error(odc[m]["grads"], ref[m]["grads"]) <= 5e-2, m
        assert odc[m]["norm"] == pytest.approx(ref[m]["norm"], rel=3e-2)
