"""A rank that raises anywhere in a step tells every peer at once (measured well under a second; asserted: long before
the peer timeout), with its exception's type and message:
peers waiting at an ODC barrier and peers blocked in a torch.distributed collective that knows nothing of ODC (a gloo
all-reduce, clip_grad_norm_'s all-reduce, DTensor.full_tensor), whether the failing process exits or lives on
(its exception caught by user code, a notebook cell). Own loops use ``odc_hf.failure_guard``; the ODC trainers guard
their whole ``train()`` (the last test here)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from odc_hf.testing import run_ranks

MESSAGE = "exploded after the optimizer step on purpose"
TIMEOUT_S = 120  # ODC's peer timeout: a peer that learned nothing of the failure would wait this long
# A peer that learned of the failure raises at once (measured well under 1 s; printed with pytest -s): a quarter of the
# timeout separates "told" from "waited it out" with ample room for a loaded 2-core machine. How fast is measured by
# the printed times, not asserted.
BOUND_S = TIMEOUT_S / 4


def _wait_for_peers_inside(signal_dir, world_size):
    """The failing rank waits until every peer has signalled that it is entering the call (a file each) instead of
    sleeping a fixed time; then a moment more so that they are blocked inside it. A peer that only enters the call
    after the failure is told as well (the failing rank's connections are already severed), so the moment is not a
    correctness condition, only what makes the test exercise a peer that is already blocked."""
    deadline = time.monotonic() + 60
    while len(list(Path(signal_dir).glob("entering*"))) < world_size - 1:
        assert time.monotonic() < deadline, "the peers never reached the call"
        time.sleep(0.01)
    time.sleep(0.2)


def _entering(signal_dir, rank):
    (Path(signal_dir) / f"entering{rank}").touch()


def _step_then_fail(rank, world_size, where, lives_on, signal_dir):
    """One good step on every rank; then rank 1 raises inside the guard while the others are inside ``where``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import odc_hf
    from odc_hf.fsdp import install_odc

    torch.manual_seed(0)  # a plain two-unit model: no transformers import, so the ranks start fast
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    odc = install_odc(model, timeout_s=TIMEOUT_S)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    odc.attach_optimizer(optimizer)

    def loss_sum(model, index):
        return model(torch.randn(4, 16, generator=torch.Generator().manual_seed(index))).square().sum()

    def microbatch(minibatch, rank):
        return 10 * minibatch + rank

    failed_at = None
    try:
        with odc_hf.failure_guard(odc):
            loss_sum(model, microbatch(0, rank)).backward()
            odc.finish_minibatch(1.0)
            optimizer.step()
            if rank == 1:
                _wait_for_peers_inside(signal_dir, world_size)
                failed_at = time.time()
                raise RuntimeError(MESSAGE)
            _entering(signal_dir, rank)
            if where == "all_reduce":  # e.g. the Trainer's token-count all-reduce of the next step
                dist.all_reduce(torch.ones(4))
            elif where == "clip_grad_norm":  # an all-reduce over the DTensor's mesh
                loss_sum(model, microbatch(1, rank)).backward()
                odc.finish_minibatch(1.0)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            elif where == "full_tensor":  # all-gathers, as a full state dict for a checkpoint does
                [p.full_tensor() for p in model.parameters()]
            elif where == "odc_barrier":
                loss_sum(model, microbatch(1, rank)).backward()
                odc.finish_minibatch(1.0)
    except BaseException as err:  # noqa: BLE001 - "user code" catches it: the process lives on
        seen = {"error": f"{type(err).__name__}: {err}", "at": time.time(), "failed_at": failed_at,
                "cause": repr(err.__cause__)}  # fmt: skip
        if rank != 1:
            (Path(signal_dir) / f"reported{rank}").touch()
        elif lives_on:  # stay alive (and inside the process group) until every peer has reported
            deadline = time.monotonic() + 30
            while len(list(Path(signal_dir).glob("reported*"))) < world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            seen["alive_until"] = time.time()
        return seen
    return {"error": None}


@pytest.mark.parametrize(
    "where,world_size,lives_on",
    [("all_reduce", 2, True), ("clip_grad_norm", 2, True), ("full_tensor", 3, True), ("odc_barrier", 2, True),
     ("all_reduce", 3, False)],
)  # fmt: skip
def test_every_peer_gets_the_failing_ranks_exception_at_once(where, world_size, lives_on, tmp_path):
    outcomes = run_ranks(_step_then_fail, world_size, where, lives_on, str(tmp_path), timeout_s=240)
    failing = outcomes[1]
    assert failing["error"] == f"RuntimeError: {MESSAGE}", failing  # the failing rank keeps its own exception
    for rank, seen in enumerate(outcomes):
        if rank == 1:
            continue
        took = seen["at"] - failing["failed_at"]
        print(f"{where} ({world_size} ranks, failing rank {'alive' if lives_on else 'exits'}): rank {rank} "
              f"raised {took:.3f} s after the failure")  # fmt: skip
        assert seen["error"].startswith(f"PeerFailedError: rank 1 failed (RuntimeError: {MESSAGE}); rank {rank} "), seen
        assert took < BOUND_S, (took, seen)
        if lives_on:
            assert seen["at"] < failing["alive_until"], "the failing process was still alive when the peer raised"


def _trainer_fails(rank, world_size, where, lives_on, signal_dir, output_dir):
    """ODCTrainer on every rank; rank 1 raises after step 1 in ``where`` (a logging callback, or saving a checkpoint)
    while the others go on into the next collective (the next step's token-count all-reduce, the full state dict)."""
    import torch
    from datasets import Dataset
    from fsdp_helpers import VOCAB, tiny_qwen2
    from transformers import TrainerCallback, TrainingArguments

    from odc_hf import ODCConfig, ODCTrainer

    failed_at = []

    def fail():
        failed_at.append(time.time())
        raise RuntimeError(MESSAGE)

    class FailInLog(TrainerCallback):
        def on_log(self, args, state, control, **kwargs):
            if where == "log" and rank == 1 and state.global_step == 1:
                fail()

    class Trainer(ODCTrainer):
        def save_model(self, output_dir=None, _internal_call=False):
            if where == "save" and rank == 1:
                _wait_for_peers_inside(signal_dir, world_size)  # the peers are gathering the full state dict
                fail()
            if where == "save":
                _entering(signal_dir, rank)
            return super().save_model(output_dir, _internal_call)

    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, VOCAB, (int(n),), generator=gen).tolist() for n in torch.randint(8, 40, (32,), generator=gen)]
    args = TrainingArguments(output_dir=output_dir, max_steps=3, per_device_train_batch_size=2, logging_steps=1,
                             save_strategy="steps" if where == "save" else "no", save_steps=1, report_to="none",
                             use_cpu=True, disable_tqdm=True)  # fmt: skip
    trainer = Trainer(model=tiny_qwen2(), args=args, train_dataset=Dataset.from_dict({"input_ids": ids}),
                      callbacks=[FailInLog()], odc_config=ODCConfig(timeout_s=TIMEOUT_S))  # fmt: skip
    try:
        trainer.train()
    except BaseException as err:  # noqa: BLE001 - "user code" catches it: the process lives on
        seen = {"error": f"{type(err).__name__}: {err}", "at": time.time(), "failed_at": failed_at[0] if failed_at else None}
        if rank != 1:
            (Path(signal_dir) / f"reported{rank}").touch()
        elif lives_on:
            deadline = time.monotonic() + 30
            while len(list(Path(signal_dir).glob("reported*"))) < world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            seen["alive_until"] = time.time()
        return seen
    return {"error": None}


@pytest.mark.parametrize("where,lives_on", [("log", True), ("save", False)])
def test_odc_trainer_reports_a_failure_outside_the_microbatch_loop(where, lives_on, tmp_path):
    outcomes = run_ranks(_trainer_fails, 2, where, lives_on, str(tmp_path), str(tmp_path / "out"), timeout_s=240,
                         env={"ACCELERATE_USE_CPU": "true"})  # fmt: skip
    failing, peer = outcomes[1], outcomes[0]
    assert failing["error"] == f"RuntimeError: {MESSAGE}", failing
    took = peer["at"] - failing["failed_at"]
    print(f"ODCTrainer, failure in {where} (failing rank {'alive' if lives_on else 'exits'}): rank 0 raised "
          f"{took:.3f} s after the failure")  # fmt: skip
    assert peer["error"].startswith(f"PeerFailedError: rank 1 failed (RuntimeError: {MESSAGE}); rank 0 "), peer
    assert took < BOUND_S, (took, peer)
    if lives_on:
        assert peer["at"] < failing["alive_until"]
