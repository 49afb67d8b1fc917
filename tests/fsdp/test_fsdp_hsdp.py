"""HSDP under ODC (a (replicate, shard) mesh): ODC within each shard group, one all-reduce across the replicas per
minibatch. With uneven microbatch counts (a rank with zero in the first minibatch), parameters after every step
equal a single-process run and FSDP2's own HSDP collectives; 2 x 2, 3 x 2, 4 x 1 and 1 x 4 meshes; a checkpoint
resumes exactly; a failure on another "node" ends every rank quickly with its name; unsupported meshes are
refused clearly.

To keep CI short, one spawn of 4 ranks runs every 4-rank mesh in both modes (plus the checkpoint resume), and
"nodes" are faked by giving each shard group its own host name, as it would have on a real cluster.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from fsdp_helpers import distributed_run, loss_sum, max_rel_error, microbatch, reference_run, tiny_qwen2

from odc_hf.testing import run_ranks

COUNTS = {4: (3, 1, 0, 2), 6: (1, 0, 2, 1, 0, 1)}  # schedule() rotates them: minibatch 0 has a rank with zero
MINIBATCHES = 3
SHAPES = {4: [(2, 2), (4, 1), (1, 4)], 6: [(3, 2)]}
# fp32 on both sides; the summation order of the microbatch gradients differs (per-node then across nodes vs
# one process), a few ulps on ~1e-1 gradients, which SGD with lr 0.5 carries into the parameters over 3 steps.
TOLERANCE = 1e-5


def fake_nodes(rank: int, shard_size: int) -> None:
    """Give every shard group its own host name, so ODC's one-node check sees a multi-node layout."""
    import socket

    socket.gethostname = lambda: f"node{rank // shard_size}"


def _all_meshes(rank, world_size, checkpoint_dir):
    out = {}
    for shape in SHAPES[world_size]:
        fake_nodes(rank, shape[1])
        counts = COUNTS[world_size]
        save = {"save_after": 1, "checkpoint_dir": checkpoint_dir} if shape == (2, 2) else {}
        out[shape, "odc"] = distributed_run(
            rank, world_size, counts, MINIBATCHES, "odc", mesh_shape=shape, **save
        )
        out[shape, "fsdp"] = distributed_run(rank, world_size, counts, MINIBATCHES, "fsdp", mesh_shape=shape)
        if save:  # a fresh model, optimizer and ODC install resume from the checkpoint
            out[shape, "resumed"] = distributed_run(rank, world_size, counts, MINIBATCHES, "odc", mesh_shape=shape,
                                                    start=2, load_from=checkpoint_dir)  # fmt: skip
    if world_size == 4:
        out["unsupported"] = _unsupported(rank, world_size)  # last: one case leaves its model mid-backward
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    started = time.monotonic()
    four = run_ranks(_all_meshes, 4, str(tmp_path_factory.mktemp("hsdp") / "ckpt"), timeout_s=600)[0]
    print(f"4-rank spawn (3 meshes x 2 modes, resume, refusals): {time.monotonic() - started:.1f} s")
    started = time.monotonic()
    six = run_ranks(_all_meshes, 6, None, timeout_s=600)[0]
    print(f"6-rank spawn (3 x 2, 2 modes): {time.monotonic() - started:.1f} s")
    return {**four, **six}


@pytest.fixture(scope="module")
def references():
    return {w: reference_run(COUNTS[w], MINIBATCHES) for w in COUNTS}


@pytest.mark.parametrize("shape", [(2, 2), (3, 2), (4, 1), (1, 4)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_hsdp_matches_single_process_and_fsdp2_hsdp(shape, runs, references):
    world = shape[0] * shape[1]
    odc, fsdp, ref = runs[shape, "odc"], runs[shape, "fsdp"], references[world]
    assert all(len(set(r["counts"])) > 1 for r in odc), "microbatch counts must be uneven"
    assert 0 in odc[0]["counts"], "a rank must run zero microbatches in the first minibatch"
    for m in range(MINIBATCHES):
        assert (
            odc[m]["tokens"] == ref[m]["tokens"]
        )  # finish_minibatch returned the GLOBAL count (asserted in-rank)
        for other in (ref[m], fsdp[m]):
            assert max_rel_error(odc[m]["params"], other["params"]) <= TOLERANCE, (shape, m)
            assert max_rel_error(odc[m]["grads"], other["grads"]) <= TOLERANCE, (shape, m)
            assert odc[m]["norm"] == pytest.approx(other["norm"], rel=TOLERANCE)


def test_hsdp_checkpoint_resume_is_exact(runs):
    full, resumed = runs[(2, 2), "odc"], runs[(2, 2), "resumed"]
    assert len(resumed) == 1
    assert max_rel_error(resumed[0]["grads"], full[2]["grads"]) == 0.0
    assert max_rel_error(resumed[0]["params"], full[2]["params"]) == 0.0


FAILURE_TIMEOUT_S = 30


def _failing(rank, world_size, fail_mode):
    import fsdp_helpers

    fake_nodes(rank, 2)
    try:
        distributed_run(rank, world_size, (1, 1, 1, 1), 3, "odc", mesh_shape=(2, 2), fail_rank=3,
                        fail_mode=fail_mode, timeout_s=FAILURE_TIMEOUT_S)  # fmt: skip
    except Exception as err:  # noqa: BLE001
        # The cross-replica all-reduce this rank gave up on is still pending in gloo, and destroying the process
        # group at exit would wait for gloo's own timeout (a launcher kills such ranks; run_ranks would wait).
        # Leave the process 5 s after reporting (plenty for run_ranks' queue), whatever it is doing then.
        threading.Timer(5.0, os._exit, (0,)).start()
        # Seconds from the start of minibatch 1 (rank 3 fails 1 s into it) until this rank gave up.
        return {"error": f"{type(err).__name__}: {err}", "waited": time.monotonic() - fsdp_helpers.STARTED[1]}
    return {"error": None}


@pytest.mark.parametrize("fail_mode", ["raise", "die"])
def test_failure_on_another_node_ends_every_rank_naming_it(fail_mode):
    # Rank 3 fails in minibatch 1; ranks 0 and 1 are on the other "node" and learn it through the job's store,
    # rank 2 through its node's control block. Each must stop well within the ODC timeout, naming rank 3 (with
    # only the timeout to go by, they would wait FAILURE_TIMEOUT_S).
    outcomes = run_ranks(_failing, 4, fail_mode, raise_on_failure=False, timeout_s=240)
    if fail_mode == "die":
        assert outcomes[3].exitcode == 3
    else:
        assert "data loader exploded" in outcomes[3].value["error"]
    expected = "rank 3 failed (RuntimeError: data loader exploded)" if fail_mode == "raise" else "rank 3 (pid"
    for rank in (0, 1, 2):
        result = outcomes[rank].value
        assert result is not None and result["error"] is not None, outcomes[rank]
        assert "PeerFailedError" in result["error"] and expected in result["error"], result["error"]
        assert result["waited"] < FAILURE_TIMEOUT_S / 2, result


def _unsupported(rank, world_size):
    import os

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from odc_hf.fsdp import install_odc, shard_model
    from odc_hf.transport import ODCError

    messages = {}

    def attempt(case, fn):
        try:
            fn()
            messages[case] = "no error"
        except (NotImplementedError, ValueError) as err:
            messages[case] = f"{type(err).__name__}: {err}"

    mesh3d = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    attempt("3d_mesh", lambda: shard_model(tiny_qwen2(), mesh=mesh3d))

    def tensor_parallel():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        install_odc(model, timeout_s=20)

    attempt("tensor_parallel", tensor_parallel)

    def spanning_nodes():
        fake_nodes(rank, 2)  # two "nodes" of two ranks, but a 1-D mesh shards over all four
        os.environ["LOCAL_WORLD_SIZE"] = "2"
        install_odc(shard_model(tiny_qwen2()), timeout_s=20)

    attempt("spanning_nodes", spanning_nodes)

    def all_reduce_switched_back_on():
        fake_nodes(rank, 2)
        model = shard_model(
            tiny_qwen2(), mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        )
        install_odc(model, timeout_s=20)
        model.set_requires_gradient_sync(True)  # e.g. a training loop's own "sync now" toggle
        loss_sum(model, microbatch(0, rank)).backward()

    try:
        all_reduce_switched_back_on()
        messages["all_reduce_on"] = "no error"
    except ODCError as err:
        messages["all_reduce_on"] = str(err)
    return messages


def test_unsupported_meshes_are_refused_clearly(runs):
    messages = runs["unsupported"]
    assert "3-D mesh" in messages["3d_mesh"] and "(replicate, shard)" in messages["3d_mesh"], messages
    assert "tensor / context parallel" in messages["tensor_parallel"], messages
    spanning = messages["spanning_nodes"]
    assert "spans several nodes" in spanning and "{'node0': [0, 1], 'node1': [2, 3]}" in spanning, spanning
    assert "(2, 2)" in spanning and "dp_replicate_size" in spanning, spanning
    assert "cross-replica all-reduce was switched back on" in messages["all_reduce_on"], messages


def _cuda_meshes(rank, world_size, shapes):
    return {shape: distributed_run(rank, world_size, COUNTS[world_size], MINIBATCHES, "odc", mesh_shape=shape)
            for shape in shapes}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (4 ranks share it when there are fewer)")
def test_hsdp_on_cuda_matches_single_process(references):
    # the CUDA transport over each shard group; NCCL (4 GPUs) or gloo (ranks sharing a GPU) across the replicas
    shapes = [(2, 2), (4, 1), (1, 4)]
    runs = run_ranks(_cuda_meshes, 4, shapes, cuda=True, timeout_s=600)[0]
    for shape in shapes:
        for m in range(MINIBATCHES):
            # fp32 atomics on the GPU add in no fixed order: a few ulps more than on CPU, far below 1e-5.
            assert max_rel_error(runs[shape][m]["params"], references[4][m]["params"]) <= TOLERANCE, (shape, m)
