"""HSDP through the Trainer and accelerate: ODCSFTTrainer on 4 CPU processes as "2 nodes x 2 ranks"
(accelerate_configs/cpu_hsdp.yaml: a (replicate=2, shard=2) mesh), and the checks that refuse what ODC cannot run.

- With LB-Mini the ranks run uneven microbatch counts, and the last rank (in the second "node") none in the first
  step; per-step losses and grad norms equal TRL's own SFTTrainer in one process on each whole minibatch
  (tests/support/sft_runs.py: an independent reference, no ODC code, no distribution).
- A fresh trainer resumed from the step-3 checkpoint repeats steps 4-6 (bit for bit, and so TRL's too).
- A shard group spanning nodes, a 3-D mesh, tensor / context parallel dims and pure replication are refused before
  accelerate builds anything, with what to set instead; odc_hsdp.yaml launches 2 nodes x 8 GPUs as a 2 x 8 mesh.

One launch only (4 processes, as accelerate launches them, forked: tests/support/launched.py): it trains, then
resumes from its checkpoint in the same processes (``sft_runs.py --then_resume_from``).
"""

from __future__ import annotations

import json
import time

import pytest
import sft_runs
import torch
from accelerate.parallelism_config import ParallelismConfig
from sft_runs import assert_same_steps, odc_run, trl_reference

from odc_hf.integrations.accelerate.parallelism import check_topology

ROOT = sft_runs.ROOT
CHECKPOINT_STEP = 3
STEPS = sft_runs.MAX_STEPS


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = tmp_path_factory.mktemp("trainer_hsdp")
    odc = odc_run(path / "odc", "--zero_rank_first_step", "--save_steps", str(CHECKPOINT_STEP),
                  "--then_resume_from", str(CHECKPOINT_STEP), config="cpu_hsdp.yaml")  # fmt: skip
    resumed = json.loads((path / "odc" / "resumed" / "losses.json").read_text())
    return {"odc": odc, "resumed": resumed, "trl": trl_reference(path / "trl"), "path": path}


@pytest.mark.slow
def test_odc_hsdp_trainer_matches_trl_in_one_process_step_by_step(runs):
    odc, trl = runs["odc"], runs["trl"]
    assert odc["odc"] and odc["world"] == 4
    # sharded over accelerate's (dp_replicate, dp_shard) mesh, built from the YAML: rows are the shard groups
    # ("nodes"), columns the replicate groups
    assert odc["mesh"] == {"ranks": [[0, 1], [2, 3]], "names": ["dp_replicate", "dp_shard_cp"]}, odc["mesh"]
    counts = odc["microbatches"]  # per step: every rank's microbatch count
    assert len(counts) == STEPS and all(len(c) == 4 for c in counts), counts
    assert counts[0][3] == 0 and counts[0][0] > 1, counts  # the second node's last rank: nothing in step 1
    assert any(len(set(c)) > 1 for c in counts[1:]), counts  # LB-Mini: uneven counts later
    assert any(sum(c[:2]) != sum(c[2:]) for c in counts), counts  # and the two nodes run different totals
    # fp32; the same gradient terms in another order (one-sided accumulation per node, one all-reduce across the
    # nodes; vs one process on the padded minibatch): sft_runs' tolerances. Measured here as on 2 ranks: losses
    # 0 to 1.2e-7 relative, gradient norms 4.5e-6 to 1.2e-5 (bound 5e-5).
    assert_same_steps(odc["history"], trl["history"], range(1, STEPS + 1))


@pytest.mark.slow
def test_odc_hsdp_trainer_resumes_exactly(runs):
    checkpoint = runs["path"] / "odc" / f"checkpoint-{CHECKPOINT_STEP}"
    assert (checkpoint / "odc_optimizer").is_dir(), "the optimizer is saved shard by shard (DCP)"
    first, resumed = runs["odc"], runs["resumed"]
    assert len(resumed["microbatches"]) == STEPS - CHECKPOINT_STEP  # only steps 4-6 ran
    assert resumed["microbatches"] == first["microbatches"][CHECKPOINT_STEP:]
    assert resumed["history"][:CHECKPOINT_STEP] == first["history"][:CHECKPOINT_STEP]  # the checkpoint's log
    # The same processes, plans and arithmetic: bit for bit the uninterrupted run's steps (and so TRL's, above).
    assert resumed["history"][CHECKPOINT_STEP:] == first["history"][CHECKPOINT_STEP:]
    assert_same_steps(resumed["history"][CHECKPOINT_STEP:], runs["trl"]["history"], range(CHECKPOINT_STEP + 1, STEPS + 1))


# -- refusals, before accelerate builds anything -------------------------------------------------------------------


def test_shard_groups_must_lie_within_a_node():
    for shape, local in (((2, 2), 2), ((2, 2), 4), ((1, 4), 4), ((4, 2), 4), ((2, 8), 8)):
        check_topology(
            ParallelismConfig(dp_replicate_size=shape[0], dp_shard_size=shape[1]), shape[0] * shape[1], local
        )
    check_topology(None, 8, 8)  # one node, 1-D: fine
    check_topology(None, 16, None)  # node layout unknown: left to install_odc's host-name check
    with pytest.raises(ValueError) as err:
        check_topology(ParallelismConfig(dp_shard_size=16), 16, 8)
    message = str(err.value)
    assert "within one node" in message and "2 nodes of 8" in message, message
    assert "dp_replicate_size: 2 and dp_shard_size: 8" in message and "odc_hsdp.yaml" in message, message
    with pytest.raises(
        ValueError, match=r"no parallelism_config: one group over every process.*dp_replicate_size: 2"
    ):
        check_topology(None, 16, 8)  # a multi-node launch of the single-node config
    # 3 does not divide a node of 4: a group straddles two nodes
    with pytest.raises(ValueError, match="groups of 3"):
        check_topology(ParallelismConfig(dp_replicate_size=4, dp_shard_size=3), 12, 4)


def test_tensor_context_parallel_and_3d_meshes_are_refused():
    with pytest.raises(ValueError) as err:
        check_topology(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2), 8, 8)
    message = str(err.value)
    assert "tp_size=2" in message and "3-D mesh ('dp_replicate', 'dp_shard', 'tp')" in message, message
    assert "set tp_size: 1" in message, message
    with pytest.raises(ValueError, match=r"cp_size=2, a 2-D mesh \('dp_shard', 'cp'\).*set cp_size: 1"):
        check_topology(ParallelismConfig(dp_shard_size=2, cp_size=2), 4, 4)
    with pytest.raises(ValueError, match="pure replication"):
        check_topology(ParallelismConfig(dp_replicate_size=4), 4, 4)


def test_odc_accelerator_refuses_before_accelerate_builds_the_mesh(monkeypatch):
    from odc_hf import ODCAccelerator

    # 4 processes on 2 "nodes" of 2: checked from the launcher's variables, before any process group exists.
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="dp_replicate_size: 2 and dp_shard_size: 2"):
        ODCAccelerator(parallelism_config=ParallelismConfig(dp_shard_size=4))
    # from `parallelism_config` in an accelerate YAML: the variables `accelerate launch` sets
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    with pytest.raises(ValueError, match="Tensor / context / sequence parallelism are not supported"):
        ODCAccelerator()


def test_hsdp_yaml_launches_two_nodes_of_eight_as_a_2x8_mesh():
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    parser = launch_command_parser()
    argv = ["--config_file", str(ROOT / "accelerate_configs/odc_hsdp.yaml"), "--machine_rank", "1",
            "--main_process_ip", "10.0.0.1", "train.py"]  # fmt: skip
    args, _, _ = _validate_launch_command(parser.parse_args(argv))
    env = prepare_multi_gpu_env(args)  # what every torchrun process of this node gets
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "8", 1)
    assert args.rdzv_endpoint == "10.0.0.1:29500"
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    assert _mesh_sizes(env) == ("2", "8")
    check_topology(ParallelismConfig(dp_replicate_size=2, dp_shard_size=8), 16, 8)  # accepted

    args, _, _ = _validate_launch_command(
        parser.parse_args(["--config_file", str(ROOT / "accelerate_configs/cpu_hsdp.yaml"), "train.py"])
    )
    env = prepare_multi_gpu_env(args)
    assert args.nproc_per_node == "4"
    assert _mesh_sizes(env) == ("2", "2")


def _mesh_sizes(env: dict) -> tuple[str, str]:
    return env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"], env["PARALLELISM_CONFIG_DP_SHARD_SIZE"]


# -- the GPU path's checkpoints: accelerate's FSDP2 sharded state dict (DCP), on the 2-D mesh --------------------


def _accelerate_sharded_checkpoint(rank, world_size, directory):
    """Train one minibatch under ODC on accelerate's (dp_replicate, dp_shard_cp) mesh, save with accelerate's
    save_fsdp_model / save_fsdp_optimizer (what the Trainer calls on FSDP launches, SHARDED_STATE_DICT as in
    odc_hsdp.yaml), train another; then a fresh model + optimizer + ODC install loads with load_fsdp_model /
    load_fsdp_optimizer and trains the same minibatch. Returns both results (full parameters, rank 0)."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from accelerate import PartialState
    from accelerate.utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer
    from fsdp_helpers import (
        all_microbatches,
        full,
        loss_sum,
        make_optimizer,
        rank_microbatches,
        tiny_qwen2,
        tokens,
    )
    from torch.distributed.device_mesh import init_device_mesh

    from odc_hf import ODCFSDPPlugin
    from odc_hf.fsdp import install_odc, shard_model

    PartialState(cpu=True)  # accelerate's logging, used by those functions, needs its state
    counts = (3, 1, 0, 2)  # rotated per minibatch: uneven, and a rank with none
    plugin = ODCFSDPPlugin(state_dict_type="SHARDED_STATE_DICT")
    accelerator = SimpleNamespace(process_index=rank, num_processes=world_size, is_main_process=rank == 0,
                                  is_fsdp2=True, wait_for_everyone=dist.barrier)  # what those functions read  # fmt: skip

    def build():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard_cp"))
        model = shard_model(tiny_qwen2(), mesh=mesh)
        optimizer = make_optimizer(model)
        odc = install_odc(model, timeout_s=60)
        odc.attach_optimizer(optimizer)
        return model, optimizer, odc

    def train(model, optimizer, odc, m):
        total = tokens(all_microbatches(counts, m))
        mine = rank_microbatches(counts, m, rank)
        for ids in mine:
            (loss_sum(model, ids) / total).backward()
        odc.finish_minibatch(tokens(mine))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return {name: full(p) for name, p in model.named_parameters()}

    model, optimizer, odc = build()
    train(model, optimizer, odc, 0)
    save_fsdp_model(plugin, accelerator, model, directory)
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, directory)
    uninterrupted = train(model, optimizer, odc, 1)
    odc.close()
    model, optimizer, odc = build()
    load_fsdp_model(plugin, accelerator, model, directory)
    load_fsdp_optimizer(plugin, accelerator, optimizer, model, directory)
    odc.publish()  # what the ODC trainers' callback does at train begin: peers read the loaded shards
    resumed = train(model, optimizer, odc, 1)
    odc.close()
    return (uninterrupted, resumed) if rank == 0 else None


def test_accelerate_sharded_checkpoint_resumes_exactly_on_the_hsdp_mesh(tmp_path):
    from odc_hf.testing import run_ranks

    started = time.monotonic()
    uninterrupted, resumed = run_ranks(
        _accelerate_sharded_checkpoint, 4, str(tmp_path / "ckpt"), timeout_s=300
    )[0]
    print(f"4-rank accelerate checkpoint round trip: {time.monotonic() - started:.1f} s")
    assert uninterrupted.keys() == resumed.keys()
    for name, value in uninterrupted.items():  # same shards, optimizer state and arithmetic: bit for bit
        assert torch.equal(value, resumed[name]), name
