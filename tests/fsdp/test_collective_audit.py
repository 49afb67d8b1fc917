"""Collective audit: no process-group collective runs inside an ODC minibatch's microbatch loop.

Ranks run different numbers of microbatches per optimizer step (LB-Mini; a rank may run none). A collective issued per
microbatch, by any library on the path (TRL's fused LM head reading a still-sharded ``lm_head`` with
``DTensor.full_tensor()``, TRL's per-microbatch metric gathers, PEFT, Liger's layer kernels), would pair up different
microbatches across ranks or deadlock. So this test watches every collective the default group (and any other) runs
while the real trainers train on 2 CPU ranks (gloo), full fine-tuning and LoRA (peft), and checks:

- none runs between the start of a rank's microbatch loop and ``finish_minibatch()`` (the one synchronisation);
- outside the loop, every rank runs the same collectives in the same order, step after step, whatever its microbatch
  count (the run has steps where ranks differ, and a step where one rank runs none).

How: a ``TorchDispatchMode`` in the spawned ranks (test code) records every op of torch's c10d namespaces: legacy ops
(``dist.all_reduce`` -> ``c10d.allreduce_``, barriers, ``all_gather_object``) and functional collectives (what
``DTensor.full_tensor()`` and DTensor redistributions issue; the mode lets DTensor desugar first, as torch's own
``CommDebugMode`` does). The loop is delimited by the trainers' public ``odc_before_bundle`` hook and the handle's
``finish_minibatch``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from odc_hf.testing import run_ranks

ROOT = Path(__file__).resolve().parents[2]
COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd"}
NOT_COLLECTIVES = {"wait_tensor", "wait", "_wrap_tensor_autograd"}


def _collective_log():
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveLog(TorchDispatchMode):
        """Records ``(step, in_loop, op, caller)`` for every collective op dispatched while active."""

        def __init__(self):
            super().__init__()
            self.step, self.in_loop, self.events, self.microbatches = -1, False, [], []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **(kwargs or {}))
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # let DTensor run: its redistributions come back here as collectives
            name = func.name()  # "namespace::op.overload"
            namespace, op = name.split("::")[0], name.split("::")[1].split(".")[0]
            if namespace in COLLECTIVE_NAMESPACES and op not in NOT_COLLECTIVES:
                self.events.append((self.step, self.in_loop, f"{namespace}.{op}", _caller()))
            return func(*args, **(kwargs or {}))

        def begin_step(self):
            self.step += 1
            self.microbatches.append(0)

        def cancel_step(self):
            self.step -= 1
            self.microbatches.pop()

        def begin_loop(self):
            self.in_loop = True

        def end_loop(self):
            self.in_loop = False

    return CollectiveLog()


def _caller() -> str:
    """The innermost library frame outside torch that led to a collective (for the failure messages)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/torch/" not in path and not path.endswith("test_collective_audit.py"):
            return f"{'/'.join(path.split('/')[-2:])}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _audited(trainer_cls, log):
    """``trainer_cls`` with each optimizer step's start (``get_batch_samples``), its microbatch loop's start
    (``odc_before_bundle``, the trainers' public hook) and end (``finish_minibatch``) marked."""

    class Audited(trainer_cls):
        def get_batch_samples(self, *args, **kwargs):
            log.begin_step()  # its collective (the global label-token count) belongs to the step
            batch, count = super().get_batch_samples(*args, **kwargs)
            if not batch:  # the data is exhausted: no step
                log.cancel_step()
            return batch, count

        def odc_before_bundle(self):
            snapshot = super().odc_before_bundle()
            odc = self.odc
            if not getattr(odc, "_audited", False):
                finish = odc.finish_minibatch

                def finish_minibatch(*args, **kwargs):
                    log.end_loop()
                    return finish(*args, **kwargs)

                odc.finish_minibatch, odc._audited = finish_minibatch, True
            log.begin_loop()
            return snapshot

        def compute_loss(self, *args, **kwargs):
            log.microbatches[-1] += 1
            return super().compute_loss(*args, **kwargs)

    return Audited


# Characters kept of each of 17 standard-library sources: LB-Mini then gives the ranks 3 and 2 microbatches in the
# first step and 1 and 0 in the last (17 samples, 8 per step: steps of 8, 8 and 1).
SFT_CUTS = (2000, 1000, 1000, 2000, 500, 120, 2000, 120, 120, 1000, 120, 2000, 1000, 500, 250, 500, 120)


def _lora(use_peft: bool):
    from peft import LoraConfig

    return LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM") if use_peft else None


def _sft_rank(rank, world, output_dir, use_peft):
    from datasets import Dataset
    from trl import SFTConfig

    from odc_hf import ODCSFTTrainer
    from odc_hf.testing.data import default_documents, default_tokenizer, tiny_qwen2_model

    tokenizer = default_tokenizer()
    log = _collective_log()
    docs = [doc for doc in default_documents() if len(doc) > max(SFT_CUTS)]
    dataset = Dataset.from_dict({"text": [doc[:cut] for doc, cut in zip(docs, SFT_CUTS)]})
    args = SFTConfig(output_dir=output_dir, max_length=1024, per_device_train_batch_size=4, num_train_epochs=1,
                     packing=False, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none",
                     bf16=False, use_cpu=True, disable_tqdm=True)  # fmt: skip
    trainer = _audited(ODCSFTTrainer, log)(model=tiny_qwen2_model(tokenizer), args=args, processing_class=tokenizer,
                                           train_dataset=dataset, peft_config=_lora(use_peft))  # fmt: skip
    with log:
        trainer.train()
    trainer.odc.close()
    return log.events, log.microbatches


def _grpo_rank(rank, world, output_dir, use_peft):
    from example_scripts import load_example

    grpo = load_example("grpo")
    arithmetic_dataset, arithmetic_reward = grpo.arithmetic_dataset, grpo.arithmetic_reward
    from trl import GRPOConfig

    from odc_hf import ODCConfig
    from odc_hf.integrations.trl.grpo_trainer import ODCGRPOTrainer
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    tokenizer = default_tokenizer()
    tokenizer.padding_side = "left"
    log = _collective_log()
    # Real generate() (TRL's own call). A random model almost never writes eos, so 5% of the vocabulary also stops
    # generation (stop tokens): completions get different lengths, LB-Mini gives the ranks different microbatch counts,
    # and ranks finish generating at different times (where a per-token collective would show).
    stop = [tokenizer.eos_token_id, *range(3, 3 + len(tokenizer) // 20)]
    args = GRPOConfig(output_dir=output_dir, max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                      num_generations=4, max_completion_length=32, learning_rate=1e-3, logging_steps=1,
                      save_strategy="no", report_to="none", bf16=False, use_cpu=True, disable_tqdm=True,
                      temperature=1.0, generation_kwargs={"eos_token_id": stop})  # fmt: skip
    # Attention-bound costs: LB-Mini splits the packed rows (the CPU default) unevenly (see test_grpo_parity.QUADRATIC)
    costs = Path(output_dir) / f"quadratic_{rank}.json"
    costs.parent.mkdir(parents=True, exist_ok=True)
    costs.write_text('{"a": 0.0, "b": 1e-6, "c": 1e-5}')
    trainer = _audited(ODCGRPOTrainer, log)(
        model=tiny_qwen2_model(tokenizer), reward_funcs=arithmetic_reward, args=args,
        train_dataset=arithmetic_dataset(64, 0), processing_class=tokenizer,
        odc_config=ODCConfig(max_tokens_per_microbatch=80, cost_model=str(costs)), peft_config=_lora(use_peft),
    )  # fmt: skip
    with log:
        trainer.train()
    trainer.odc.close()
    return log.events, log.microbatches


def _per_step(events, steps):
    """The collectives of each step's window outside its loop: from its first batch to the next step's (the window of
    the last step also holds the end of training)."""
    return [[op for s, in_loop, op, _ in events if s == step and not in_loop] for step in range(steps)]


def _audit(results):
    (events_0, counts_0), (events_1, counts_1) = results
    steps = len(counts_0)
    assert len(counts_1) == steps >= 3
    report = f"microbatches per step: rank 0 {counts_0}, rank 1 {counts_1}"
    assert any(a != b for a, b in zip(counts_0, counts_1)), (
        "the test needs uneven microbatch counts: " + report
    )
    for rank, events in enumerate((events_0, events_1)):
        in_loop = [(s, op, caller) for s, loop, op, caller in events if loop]
        assert not in_loop, f"rank {rank} ran collectives inside its microbatch loop: {in_loop}; {report}"
    per_step_0, per_step_1 = _per_step(events_0, steps), _per_step(events_1, steps)
    assert per_step_0 == per_step_1, f"ranks ran different per-step collectives; {report}"
    setup_0, setup_1 = ([op for s, _, op, _ in events if s < 0] for events in (events_0, events_1))
    assert setup_0 == setup_1  # set-up, and the first step's label-token count
    # The same collectives every step, whatever the microbatch counts (the last step also ends the run).
    assert all(step == per_step_0[0] for step in per_step_0[:-1]), per_step_0
    assert per_step_0[-1][: len(per_step_0[0])] == per_step_0[0], per_step_0
    return [(op, caller) for s, loop, op, caller in events_0 if s == 0 and not loop]


ALLGATHER, ALLREDUCE = "c10d.allgather_", "c10d.allreduce_"
# Every step of the trainers, in order; none depends on a rank's microbatch count. Gradient clipping runs none:
# ODCAccelerator.clip_grad_norm_ sums the local shards' norms at ODC's host barrier (accelerate's DTensor clipping
# all-reduced the norm with a functional collective, which crashes on gloo with CUDA tensors).
TRAINER_STEP_END = [
    ALLGATHER,  # odc_hf: the step's per-rank busy / wait / microbatch statistics (ODCMixin._odc_record)
    ALLGATHER,  # transformers: the logged loss (Trainer._nested_gather)
    ALLGATHER,  # transformers: the logged grad norm (distributed_broadcast_scalars)
]
SFT_STEP = [
    ALLREDUCE,  # odc_hf: the minibatch's global label-token count (ODCMixin.get_batch_samples), the loss normaliser
    ALLGATHER,  # odc_hf: step statistics
    ALLREDUCE,  # odc_hf: TRL's SFT metrics, summed once per step (_SFTPart.odc_after_bundle)
    *TRAINER_STEP_END[1:],
]
GRPO_STEP = [
    # TRL's scoring, once per generation: rewards, advantages, completion logs (gather and gather_object)
    *[ALLGATHER] * 13,
    ALLGATHER,
    ALLGATHER,  # odc_hf: the one exchange of the generation batch (all_gather_object)
    ALLGATHER,  # odc_hf: step statistics
    ALLGATHER,  # odc_hf: TRL's loss metrics, gathered once per step (ODCGRPOTrainer.odc_after_bundle)
    *TRAINER_STEP_END[1:],
]


# The same collective under another op name: torch >= 2.15 gathers an object's bytes with all_gather_into_tensor
# (c10d._allgather_base_), earlier releases with allgather_.
SAME_COLLECTIVE = {"c10d._allgather_base_": ALLGATHER}


def _assert_step(per_step, expected):
    assert [SAME_COLLECTIVE.get(op, op) for op, _ in per_step] == expected, per_step


@pytest.mark.slow
@pytest.mark.parametrize("use_peft", [False, True], ids=["full", "lora"])
def test_sft_runs_no_collective_inside_the_microbatch_loop(tmp_path, one_torch_thread, use_peft):
    per_step = _audit(run_ranks(_sft_rank, 2, str(tmp_path), use_peft, env={"ACCELERATE_USE_CPU": "true"}))
    _assert_step(per_step, SFT_STEP)


@pytest.mark.slow
@pytest.mark.parametrize("use_peft", [False, True], ids=["full", "lora"])
def test_grpo_runs_no_collective_inside_the_microbatch_loop(tmp_path, one_torch_thread, use_peft):
    # generate() included: it runs no collective per token (ODCGRPOTrainer turns transformers' synced_gpus off)
    per_step = _audit(run_ranks(_grpo_rank, 2, str(tmp_path), use_peft, env={"ACCELERATE_USE_CPU": "true"}))
    _assert_step(per_step, GRPO_STEP)


def test_liger_layer_kernels_are_audited_on_gpus_only():
    pytest.skip(
        "Liger's layer kernels are Triton kernels that odc_hf applies only on CUDA (odc_hf.integrations.compute.fused_head."
        "liger_problem); there is nothing to audit on a CPU host"
    )
