"""Ranks sharing a GPU, on CPU: every way into training ends on a gloo process group that accelerate knows to be gloo,
and accelerate's gathers then work on 2-D tensors of every dtype gloo carries.

On a GPU host accelerate's state names the device's default backend (``nccl``) unless it is told otherwise, and keeps
a process group started before it (odc_hf's gloo group) without reading that group's backend; its gathers then take
the ``all_gather_into_tensor`` path, which gloo refuses for tensors of two or more dimensions (TRL's rewards of shape
(n, functions): ``ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (4, 1), got (4))``, seen on
one H200). These tests stand in for the GPU host in each rank: accelerate's device detection reports what it reports
with CUDA (``nccl``, multi-GPU) while tensors stay on the CPU (``ACCELERATE_TORCH_DEVICE=cpu``), and
``shared_gpu.active`` says the ranks share a GPU. The rest is the real code: transformers' and TRL's argument classes,
accelerate's state and gathers, odc_hf's trainers, accelerator and ``python -m odc_hf.run``. On the GPU:
tests/gpu/test_gpu_shared_entry_points.py.
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from odc_hf.integrations.launch import shared_gpu
from odc_hf.testing import run_ranks

GLOO_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
               torch.int64, torch.bool)  # fmt: skip  (gloo has no int16, uint16/32 or float8 collectives at all)
GATHER_FAILURE = "invalid tensor size"  # gloo's words for a flat output buffer against a 2-D input


def _as_on_a_gpu_host_sharing_it() -> None:
    """In a rank: accelerate detects what it detects on a CUDA host (its default backend ``nccl``, multi-GPU) with the
    tensors on the CPU, and odc_hf's shared-GPU mode is on."""
    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    def cuda_host(self, cpu=False, sagemaker_dp=False, backend=None):  # accelerate's answer on a CUDA host
        return (backend or "nccl", DistributedType.MULTI_GPU)

    PartialState._prepare_backend = cuda_host
    shared_gpu.active = lambda environ=None, gpus=None: True


def _sample(rank: int, dtype: torch.dtype, shape=(3, 2)) -> torch.Tensor:
    """What rank ``rank`` contributes: distinct values per rank and position, representable in every dtype."""
    values = torch.arange(int(torch.tensor(shape).prod())).reshape(shape) % 5 + 10 * rank
    return (values % 2).bool() if dtype == torch.bool else values.to(dtype)


def _gather_mismatches(accelerator, world_size: int, rank: int) -> list[str]:
    """accelerate's ``gather`` and ``gather_for_metrics`` of 2-D (and 3-D, nested, 0-d) tensors against the
    concatenation of every rank's tensor, built here independently."""
    wrong = []
    for dtype in GLOO_DTYPES:
        want = torch.cat([_sample(r, dtype) for r in range(world_size)])
        for name, gather in (("gather", accelerator.gather), ("gather_for_metrics", accelerator.gather_for_metrics)):
            try:
                got = gather(_sample(rank, dtype))
            except Exception as err:  # noqa: BLE001 - reported with the dtype
                wrong.append(f"{name} {dtype}: {str(err).splitlines()[0]}")
                continue
            if got.dtype != dtype or not torch.equal(got, want):
                wrong.append(f"{name} {dtype}: {got.tolist()} != {want.tolist()}")
    nested = {"rewards": _sample(rank, torch.float32, (4, 1)), "ids": [_sample(rank, torch.int64, (2, 2, 3))]}
    got = accelerator.gather(nested)
    if not torch.equal(got["rewards"], torch.cat([_sample(r, torch.float32, (4, 1)) for r in range(world_size)])):
        wrong.append("nested (4, 1) rewards")
    if not torch.equal(got["ids"][0], torch.cat([_sample(r, torch.int64, (2, 2, 3)) for r in range(world_size)])):
        wrong.append("nested (2, 2, 3) ids")
    if accelerator.gather(torch.tensor(float(rank))).tolist() != [float(r) for r in range(world_size)]:
        wrong.append("0-d")
    return wrong


def _gathers_ranks(rank, world_size, out):
    _as_on_a_gpu_host_sharing_it()
    from accelerate import Accelerator
    from transformers import TrainingArguments

    import odc_hf
    from odc_hf.integrations.upstream.accelerate import believed_backend
    from odc_hf.version import TESTED, minor

    TrainingArguments(output_dir=out, report_to="none")  # transformers' own arguments create accelerate's state
    accelerator = Accelerator()
    before = believed_backend()
    try:  # the condition of the failure seen on the GPU, on accelerate's own code
        accelerator.gather(_sample(rank, torch.float32, (4, 1)))
        failed_before = ""
    except Exception as err:  # noqa: BLE001
        failed_before = str(err)
    odc_hf.prepare(accelerator, torch.utils.data.DataLoader(list(range(4))))  # through adopt, as every ODC accelerator
    import accelerate

    tested = minor(accelerate.__version__) in TESTED["accelerate"]
    return before, failed_before, tested, believed_backend(), _gather_mismatches(accelerator, world_size, rank)


def test_accelerates_gathers_work_on_2d_tensors_of_every_dtype_on_a_gloo_group_it_did_not_start(tmp_path):
    for before, failed_before, tested, after, wrong in run_ranks(_gathers_ranks, 2, str(tmp_path / "out")):
        assert before == "nccl"  # accelerate named the CUDA default, not the gloo group odc_hf started
        if tested:  # the failure seen on the GPU, reproduced on the accelerate versions odc_hf was checked on
            assert GATHER_FAILURE in failed_before, failed_before
        assert after == "gloo"
        assert wrong == [], wrong


# -- every way in -----------------------------------------------------------------------------------------------------
RUN_SCRIPT = """
import sys, torch
import torch.distributed as dist
from trl import SFTConfig, SFTTrainer   # TRL's own config; the trainer is odc_hf's under `python -m odc_hf.run`
from odc_hf import ODCConfig
from odc_hf.testing.data import default_text_dataset, default_tokenizer, tiny_qwen2_model

tok = default_tokenizer()
args = SFTConfig(output_dir=sys.argv[1], max_steps=1, per_device_train_batch_size=2, report_to="none", bf16=False,
                 max_length=128, save_strategy="no")
trainer = SFTTrainer(model=tiny_qwen2_model(tok), args=args, train_dataset=default_text_dataset(8),
                     processing_class=tok, odc_config=ODCConfig(max_tokens_per_microbatch=256, truncate=True))
RESULT = trainer
"""


def _sft_trainer(out, arguments: str):
    from odc_hf import ODCConfig, ODCSFTConfig, ODCSFTTrainer
    from odc_hf.testing.data import default_text_dataset, default_tokenizer, tiny_qwen2_model

    if arguments == "trl":
        from trl import SFTConfig as config_class
    else:
        config_class = ODCSFTConfig
    tok = default_tokenizer()
    args = config_class(output_dir=out, max_steps=1, per_device_train_batch_size=2, report_to="none", bf16=False,
                        max_length=128, save_strategy="no")  # fmt: skip
    return ODCSFTTrainer(model=tiny_qwen2_model(tok), args=args, train_dataset=default_text_dataset(8),
                         processing_class=tok, odc_config=ODCConfig(max_tokens_per_microbatch=256, truncate=True))  # fmt: skip


def _transformers_trainer(out):
    from transformers import TrainingArguments

    from odc_hf import ODCTrainer
    from odc_hf.testing.data import default_tokenized_dataset, default_tokenizer, tiny_qwen2_model

    tok = default_tokenizer()
    args = TrainingArguments(output_dir=out, max_steps=1, per_device_train_batch_size=2, report_to="none")
    return ODCTrainer(model=tiny_qwen2_model(tok), args=args, train_dataset=default_tokenized_dataset(tok, 8, max_length=64))


def _entry_ranks(rank, world_size, entry, out):
    _as_on_a_gpu_host_sharing_it()
    import torch.distributed as dist

    from odc_hf.integrations.upstream.accelerate import believed_backend

    if entry == "odc.run, TRL's SFTConfig":
        import runpy

        from odc_hf import run, unpatch_trl

        script = os.path.join(out, f"recipe_{rank}.py")
        os.makedirs(out, exist_ok=True)
        with open(script, "w") as f:
            f.write(textwrap.dedent(RUN_SCRIPT))
        captured = {}
        real_run_path = runpy.run_path
        runpy.run_path = lambda path, run_name: captured.update(real_run_path(path, run_name=run_name))
        try:
            run.main([script, os.path.join(out, "run")])
        finally:
            runpy.run_path = real_run_path
            unpatch_trl()
        accelerator = captured["RESULT"].accelerator
    elif entry == "ODCSFTTrainer, TRL's SFTConfig":
        accelerator = _sft_trainer(out, "trl").accelerator
    elif entry == "ODCSFTTrainer, ODCSFTConfig":
        accelerator = _sft_trainer(out, "odc").accelerator
    elif entry == "ODCTrainer, transformers' TrainingArguments":
        accelerator = _transformers_trainer(out).accelerator
    elif entry == "ODCAccelerator":
        from odc_hf import ODCAccelerator

        accelerator = ODCAccelerator()
    else:  # odc_hf.prepare on the user's own accelerate.Accelerator
        from accelerate import Accelerator

        import odc_hf

        accelerator = Accelerator()
        odc_hf.prepare(accelerator, torch.utils.data.DataLoader(list(range(4))))
    return str(dist.get_backend()), believed_backend(), _gather_mismatches(accelerator, world_size, rank)


ENTRIES = ["odc.run, TRL's SFTConfig", "ODCSFTTrainer, TRL's SFTConfig", "ODCSFTTrainer, ODCSFTConfig",
           "ODCTrainer, transformers' TrainingArguments", "ODCAccelerator", "odc_hf.prepare(Accelerator())"]  # fmt: skip


@pytest.mark.parametrize("entry", ENTRIES)
def test_every_way_in_ends_on_gloo_that_accelerate_knows_and_its_gathers_work(entry, tmp_path):
    for group, believed, wrong in run_ranks(_entry_ranks, 2, entry, str(tmp_path)):
        assert (group, believed) == ("gloo", "gloo"), entry
        assert wrong == [], (entry, wrong)


# -- an NCCL group that the training arguments started ------------------------------------------------------------------
def _replacement_ranks(rank, world_size, started_nccl=True):
    import torch.distributed as dist
    from accelerate.state import PartialState

    from odc_hf.integrations.upstream.accelerate import believed_backend

    _as_on_a_gpu_host_sharing_it()
    PartialState()  # accelerate's state, as the training arguments create it
    old_group = dist.group.WORLD
    pretend = ["nccl"] if started_nccl else []  # the arguments' group (CPU torch has no NCCL): gloo, called nccl once
    real = shared_gpu._group_backend
    shared_gpu._group_backend = lambda: pretend.pop() if pretend else real()
    available, count = torch.cuda.is_available, torch.cuda.device_count
    torch.cuda.is_available, torch.cuda.device_count = (lambda: True), (lambda: 1)  # one GPU for the ranks to share
    try:
        shared_gpu.settle_process_group(timeout_s=60)
    finally:
        torch.cuda.is_available, torch.cuda.device_count = available, count
    replaced = dist.group.WORLD is not old_group
    local_index = (PartialState().local_process_index, os.environ["LOCAL_RANK"])  # rank 1 read 1: no cuda:1
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    rows = [torch.empty(2, 3) for _ in range(world_size)]
    dist.all_gather(rows, torch.full((2, 3), float(rank)))
    gathered = [r[0, 0].item() for r in rows]
    return replaced, str(dist.get_backend()), total.item(), gathered, believed_backend(), local_index


def test_an_unused_nccl_group_is_replaced_by_gloo_through_the_launchers_store():
    # run_ranks' parent holds the rendezvous store and every rank is its client: torchrun's agent store, as
    # `accelerate launch` and notebook_launcher give it (TORCHELASTIC_USE_AGENT_STORE=True)
    results = run_ranks(_replacement_ranks, 2, env={"TORCHELASTIC_USE_AGENT_STORE": "True"})
    for replaced, backend, total, gathered, believed, local_index in results:
        assert replaced and backend == "gloo" and believed == "gloo"
        assert total == 3.0 and gathered == [0.0, 1.0]  # the new group connects every rank, in rank order
        assert local_index == (0, "0")  # both ranks' barriers on cuda:0, the GPU they share


def test_a_gloo_group_started_without_odc_hf_gets_the_local_index_of_the_shared_gpu():
    # e.g. transformers' TrainingArguments(ddp_backend="gloo") in an own script: accelerate read LOCAL_RANK=1 and would
    # ask for cuda:1 in its barriers; nothing is replaced
    for replaced, backend, total, gathered, believed, local_index in run_ranks(_replacement_ranks, 2, False):
        assert not replaced and backend == believed == "gloo" and total == 3.0 and gathered == [0.0, 1.0]
        assert local_index == (0, "0")


def test_an_nccl_group_is_refused_where_the_store_would_not_outlive_it(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(shared_gpu, "active", lambda environ=None, gpus=None: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    replaced = []
    monkeypatch.setattr(shared_gpu, "replace_default_group", lambda *a, **k: replaced.append(1))
    with pytest.raises(RuntimeError, match="NCCL refuses two ranks on one GPU.*torchrun.*ddp_backend='gloo'"):
        shared_gpu.settle_process_group({"LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "29500"})
    assert replaced == []
    # the replacement is stubbed here: the group still says nccl afterwards, and check_backend says so
    with pytest.raises(RuntimeError, match="the process group is nccl: NCCL refuses two ranks on one GPU"):
        shared_gpu.settle_process_group({"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_PORT": "29500"})
    assert replaced == [1]
