"""The pieces of the shared-GPU run mode that a CPU can check: when the mode is on, which peer memory ``auto`` picks,
the process-group choice, the gradient-norm clipping that replaces the functional all-reduce, and the full state dict
gathered through CPU tensors. The mode itself runs on a GPU: tests/gpu/test_gpu_shared.py."""

from __future__ import annotations

import math

import pytest
import torch

from odc_hf.integrations.launch import shared_gpu
from odc_hf.testing import run_ranks
from odc_hf.transport import ODCError
from odc_hf.transport.peer_memory import PEER_MEMORY_CHOICES, choose


def test_auto_picks_symmetric_memory_with_a_gpu_per_rank_and_ipc_when_ranks_share_one():
    assert choose("auto", ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]).backend == "symmetric_memory"
    shared = choose("auto", ["GPU-a", "GPU-a"])
    assert (shared.backend, shared.ranks_per_device) == ("ipc", 2) and "share a GPU" in shared.reason
    assert choose("auto", ["GPU-a", "GPU-a", "GPU-b", "GPU-b"]).backend == "ipc"  # 4 ranks on 2 GPUs
    missing = choose("auto", ["GPU-a", "GPU-b"], (False, "torch 2.8 has no symmetric memory"))
    assert missing.backend == "ipc" and "unavailable" in missing.reason
    assert choose("ipc", ["GPU-a", "GPU-b"]).backend == "ipc"  # forced
    assert choose("symmetric_memory", ["GPU-a", "GPU-b"]).backend == "symmetric_memory"
    with pytest.raises(ODCError, match="needs one GPU per rank.*2 ranks share a GPU"):
        choose("symmetric_memory", ["GPU-a", "GPU-a"])
    with pytest.raises(ODCError, match="not available"):
        choose("symmetric_memory", ["GPU-a", "GPU-b"], (False, "no"))
    with pytest.raises(ValueError, match="peer memory must be one of"):
        choose("nvshmem", ["GPU-a"])


def test_the_config_knob_takes_the_transports_choices():
    from odc_hf import ODCConfig
    from odc_hf.config import PEER_MEMORY_CHOICES as CONFIG_CHOICES

    assert CONFIG_CHOICES == PEER_MEMORY_CHOICES
    assert ODCConfig().cuda_peer_memory == "auto" and ODCConfig().deterministic is False
    assert ODCConfig.from_env({"ODC_CUDA_PEER_MEMORY": "ipc", "ODC_DETERMINISTIC": "1"}).cuda_peer_memory == "ipc"
    with pytest.raises(ValueError, match="cuda_peer_memory must be one of"):
        ODCConfig(cuda_peer_memory="nccl")


@pytest.mark.parametrize(
    ("environ", "gpus", "share"),
    [
        ({"LOCAL_WORLD_SIZE": "2"}, 1, 2),  # python examples/sft.py on a one-GPU machine
        ({"LOCAL_WORLD_SIZE": "4"}, 2, 2),
        ({"LOCAL_WORLD_SIZE": "3"}, 2, 2),
        ({"LOCAL_WORLD_SIZE": "2"}, 2, 1),  # a GPU per rank: not the mode
        ({"LOCAL_WORLD_SIZE": "8"}, 8, 1),
        ({"LOCAL_WORLD_SIZE": "2"}, 0, 1),  # CPU-only host
        ({"LOCAL_WORLD_SIZE": "2", "ACCELERATE_USE_CPU": "true"}, 1, 1),  # CPU ranks on a GPU machine
        ({}, 1, 1),  # one plain process
    ],
)
def test_the_mode_is_on_where_a_node_has_more_ranks_than_gpus(environ, gpus, share):
    assert shared_gpu.ranks_per_gpu(environ, gpus) == share
    assert shared_gpu.active(environ, gpus) == (share > 1)


def test_the_mode_says_so_in_one_line():
    assert shared_gpu.describe({"LOCAL_WORLD_SIZE": "2"}, 1) == "2 ranks share cuda:0: for development and tests, not speed"


def test_training_arguments_take_gloo_in_the_mode_and_refuse_nccl(monkeypatch):
    monkeypatch.setattr(shared_gpu, "active", lambda environ=None, gpus=None: True)
    assert shared_gpu.default_ddp_backend(None) == "gloo"
    assert shared_gpu.default_ddp_backend("gloo") == "gloo"
    with pytest.raises(ValueError, match="ddp_backend='nccl' cannot run here"):
        shared_gpu.default_ddp_backend("nccl")
    monkeypatch.setattr(shared_gpu, "active", lambda environ=None, gpus=None: False)
    assert shared_gpu.default_ddp_backend("nccl") == "nccl" and shared_gpu.default_ddp_backend(None) is None


def test_an_nccl_group_in_the_mode_is_refused_saying_what_to_set(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(shared_gpu, "active", lambda environ=None, gpus=None: True)
    monkeypatch.setattr(shared_gpu, "describe", lambda environ=None, gpus=None: "2 ranks share cuda:0")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(RuntimeError, match="NCCL refuses two ranks on one GPU.*ddp_backend='gloo'"):
        shared_gpu.check_backend({})
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    shared_gpu.check_backend({})


def test_a_local_rank_that_names_no_gpu_is_refused_saying_what_to_do(monkeypatch):
    """A launch whose LOCAL_RANK was not localised (arguments that started torch.distributed before odc_hf could set
    it): on a one-GPU machine rank 1's LOCAL_RANK=1 names cuda:1, which accelerate's barrier would ask for."""
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    with pytest.raises(RuntimeError, match=r"2 ranks share cuda:0: .*, but LOCAL_RANK=1 names no GPU: accelerate's "
                       r"barrier would ask for cuda:1 .*init_process_group\(\) first"):  # fmt: skip
        shared_gpu.check_backend({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    shared_gpu.check_backend({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"})  # localised: cuda:0 exists
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # a GPU per rank: not the mode, nothing to refuse
    shared_gpu.check_backend({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"})


def _configs_in_the_mode(rank, world_size, out):
    """odc_hf's own TRL configs built for real (TrainingArguments' __post_init__ and accelerate's state run, on the
    ranks' gloo group) with the mode on, then off."""
    import odc_hf

    real = shared_gpu.active
    result = {}
    try:
        shared_gpu.active = lambda environ=None, gpus=None: True
        for name in ("ODCSFTConfig", "ODCGRPOConfig"):
            cls = getattr(odc_hf, name)
            args = cls(output_dir=f"{out}/{name}", use_cpu=True, report_to="none")
            result[name] = {"backend": args.ddp_backend, "state": str(args.distributed_state.backend),
                            "processes": args.distributed_state.num_processes}  # fmt: skip
            try:
                cls(output_dir=f"{out}/{name}", use_cpu=True, report_to="none", ddp_backend="nccl")
                result[name]["nccl"] = "accepted"
            except ValueError as err:
                result[name]["nccl"] = str(err)
        shared_gpu.active = lambda environ=None, gpus=None: False
        result["off"] = odc_hf.ODCSFTConfig(output_dir=f"{out}/off", use_cpu=True, report_to="none").ddp_backend
    finally:
        shared_gpu.active = real
    return result


def test_odc_training_arguments_choose_gloo_in_the_mode(tmp_path):
    # (before: a toy dataclass stood in for TrainingArguments, whose __post_init__ starts accelerate's distributed
    # state; here the real configs, on ranks whose gloo group exists, as in a shared-GPU launch)
    for result in run_ranks(_configs_in_the_mode, 2, str(tmp_path)):
        for name in ("ODCSFTConfig", "ODCGRPOConfig"):
            got = result[name]
            assert (got["backend"], got["state"], got["processes"]) == ("gloo", "gloo", 2), (name, got)
            assert "ddp_backend='nccl' cannot run here" in got["nccl"], (name, got)
        assert result["off"] is None  # outside the mode the user's value (unset) stands


def _clip_ranks(rank, world_size):
    """ODC's clipping vs torch's DTensor norm (``get_total_norm``, a functional all-reduce: CPU gloo runs it) on the
    same gradients, and the clipped gradients vs torch's rule ``g * min(1, max_norm / (norm + 1e-6))``."""
    from fsdp_helpers import loss_sum, microbatch, tiny_qwen2
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import get_total_norm

    from odc_hf.fsdp import install_odc, shard_model

    model = tiny_qwen2(tie=False)
    shard_model(model)
    odc = install_odc(model, timeout_s=60)
    for i in range(rank + 1):  # uneven: rank r runs r + 1 microbatches
        loss_sum(model, microbatch(7, 10 * rank + i)).backward()
    odc.finish_minibatch()
    params = list(model.parameters())
    grads = [p.grad.to_local().clone() for p in params]
    results = {}
    for norm_type in (1.0, 2.0, 3.5, math.inf):
        for p, g in zip(params, grads):
            p.grad.to_local().copy_(g)
        norm = get_total_norm([p.grad for p in params], norm_type)
        theirs = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        ours = float(odc.clip_grad_norm_(params, 0.5, norm_type=norm_type))
        coefficient = min(1.0, 0.5 / (theirs + 1e-6))
        scaled = max((p.grad.to_local() - g * coefficient).abs().max().item() for p, g in zip(params, grads))
        results[norm_type] = (ours, theirs, scaled)
    only_norm = float(odc.clip_grad_norm_(params, float("inf"), norm_type=math.inf))
    odc.close()
    return results, only_norm


@pytest.mark.parametrize("world_size", [2, 3])
def test_odc_clipping_equals_torchs_dtensor_clipping(world_size):
    # world 3: every dimension of the tiny model (256, 128, 64, 32) splits into uneven dim-0 chunks
    per_rank = run_ranks(_clip_ranks, world_size)
    for results, only_norm in per_rank:
        for norm_type, (ours, theirs, scaled) in results.items():
            # fp64 partial sums here, fp32 in torch's (|g|^3.5 in fp32 measured 1.1e-6 off): 1e-5 relative; the
            # clipped gradients to a few fp32 ulps. A shard left out of the sum, or a rank's sum counted twice, moves
            # the norm by far more (each rank holds half of every parameter).
            assert ours == pytest.approx(theirs, rel=1e-5), norm_type
            assert scaled <= 1e-6, (norm_type, scaled)
            assert ours > 0.5  # the gradients were really clipped
        assert only_norm == pytest.approx(0.5, rel=1e-5)  # after the last clip to 0.5 (inf norm): no scaling
    norms = [{k: v[0] for k, v in results.items()} for results, _ in per_rank]
    assert all(n == norms[0] for n in norms)  # every rank the same norm (the barrier's rank-order sum)


def _full_state_dict_ranks(rank, world_size):
    from fsdp_helpers import tiny_qwen2
    from torch.distributed.tensor import DTensor

    from odc_hf.fsdp import shard_model
    from odc_hf.fsdp.state_dict import full_state_dict

    model = tiny_qwen2(tie=False)
    shard_model(model)
    local_rows = {n: p.to_local().shape[0] for n, p in model.named_parameters() if isinstance(p, DTensor)}
    return full_state_dict(model, rank0_only=True), local_rows


@pytest.mark.parametrize("world_size", [2, 3])
def test_full_state_dict_through_cpu_equals_the_unsharded_model(world_size):
    """Reference: the unsharded model's own state dict. At world 3 the dim-0 chunks are uneven (256 rows: 86, 86, 84;
    64: 22, 22, 20): the gather must place each rank's rows by the global shape (a gather that assumed equal chunks
    would build 258 or 252 rows, or misplace the last rank's)."""
    from fsdp_helpers import tiny_qwen2

    per_rank = run_ranks(_full_state_dict_ranks, world_size)
    (main, _), others = per_rank[0], per_rank[1:]
    want = tiny_qwen2(tie=False).state_dict()
    assert all(state == {} for state, _ in others) and main.keys() == want.keys()
    assert all(torch.equal(main[k], v) for k, v in want.items())
    rows = [local["model.embed_tokens.weight"] for _, local in per_rank]
    assert sum(rows) == 256 and (len(set(rows)) > 1) == (world_size == 3), rows  # uneven chunks at world 3
