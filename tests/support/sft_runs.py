"""SFT runs for the trainer tests: ODCSFTTrainer on 2 CPU processes (or 4, as HSDP "2 nodes x 2 ranks" with
accelerate_configs/cpu_hsdp.yaml), and its independent reference, TRL's own ``trl.SFTTrainer`` in ONE process on
each whole minibatch (same samples, same step, no distribution; TRL's padded batches and transformers' sdpa instead
of odc_hf's packed rows and sdpa_varlen). The global minibatch is 8 samples whatever the number of ranks, so one
reference serves every layout.

    ACCELERATE_USE_CPU=true accelerate launch --config_file accelerate_configs/cpu.yaml tests/support/sft_runs.py odc OUT \
        [--zero_rank_first_step] [--save_steps N] [--resume_from_checkpoint DIR] [--then_resume_from STEP]
    python tests/support/sft_runs.py trl OUT [--save_steps N]

(the tests run both in processes forked from their fork server, with the environment those commands give:
:func:`launch`, :func:`one_process`).

Both write ``OUT/losses.json``: ``history`` (the Trainer's per-step log: step, loss, grad_norm) and, for ODC,
``microbatches`` (per step, every rank's microbatch count, from ``trainer.odc_stats``) and ``mesh`` (the ranks of the
model's device mesh: rows are shard groups). ``--then_resume_from STEP`` then builds a fresh trainer (new model,
optimizer, ODC install) in the same processes, resumes it from ``OUT/checkpoint-STEP`` and writes
``OUT/resumed/losses.json`` (for launches too costly to repeat: 4 processes importing TRL). Everything the runs share
(data, model, hyperparameters) is defined once here, so they differ only where the comparison means them to.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MINIBATCH = 8  # samples per step, all ranks together: 4 per rank on 2 ranks, 2 per rank on 4
MAX_STEPS = 6
BUDGET = 1024  # tokens per packed microbatch; also TRL's max_length
MAX_LENGTH = 768  # tokens per sample
NUM_SAMPLES = 64  # 8 steps per epoch: every run stays in epoch 0
SEED = 0
EVAL_SAMPLES = 12  # 6 evaluation batches of 2: 3 a rank on 2 ranks, none dropped by dataloader_drop_last


def dataset(tokenizer):
    """The offline default text (Python standard library sources), cut to <= 768 tokens: real text, so per-sample
    losses differ and fall as the model learns (random tokens would all cost ln(vocab)); with the 1024-token
    budget LB-Mini packs 2-4 microbatches per rank on 2 ranks (1-4 on 4), unevenly on some steps."""
    from odc_hf.testing.data import default_tokenized_dataset

    return default_tokenized_dataset(tokenizer, NUM_SAMPLES, max_length=MAX_LENGTH, seed=SEED)


def eval_dataset(tokenizer):
    """Held-out text for ``--eval_steps``: other documents of the same corpus (of many lengths: padded batches)."""
    from odc_hf.testing.data import default_tokenized_dataset

    return default_tokenized_dataset(tokenizer, EVAL_SAMPLES, max_length=MAX_LENGTH, seed=SEED + 1)


def evaluation(tokenizer, eval_steps: int) -> tuple[dict, dict]:
    """Training arguments and trainer arguments that evaluate every ``eval_steps`` steps (none for 0)."""
    if not eval_steps:
        return {}, {}
    return ({"eval_strategy": "steps", "eval_steps": eval_steps, "per_device_eval_batch_size": 2,
             "eval_on_start": True},
            {"eval_dataset": eval_dataset(tokenizer)})


def minibatch_order(num_samples: int, steps: int = MAX_STEPS) -> list[int]:
    """The dataset indices ODC trains, step after step: the sampler's public epoch order (which samples form each
    global minibatch; how they are split over ranks and microbatches is what the comparison tests)."""
    from odc_hf.balance import ODCBatchSampler

    # which samples form a minibatch depends on the seed and the minibatch size only, not on the number of ranks
    sampler = ODCBatchSampler([1] * num_samples, world_size=1, rank=0, minibatch_size=MINIBATCH,
                              max_tokens_per_microbatch=BUDGET, seed=SEED)  # fmt: skip
    return [int(i) for step in range(steps) for i in sampler.minibatch_indices(step)]


def sft_config(out: Path, config_class=None, **changes):
    from trl import SFTConfig

    fields = dict(
        output_dir=str(out), max_steps=MAX_STEPS, per_device_train_batch_size=MINIBATCH, learning_rate=1e-3,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, seed=SEED, logging_steps=1,
        save_strategy="no", report_to="none", bf16=False, max_length=BUDGET, packing=False, dataloader_drop_last=True,
        disable_tqdm=True, dataset_num_proc=None, gradient_checkpointing=False,
        include_num_input_tokens_seen="non_padding",
    )  # fmt: skip
    return (config_class or SFTConfig)(**{**fields, **changes})


def offload_probe():
    """Stands in for TRL's activation-offloading context (``SFTTrainer.maybe_activation_offload_context``, a
    ``saved_tensors_hooks`` that offloads on CUDA only): counts its entries, the tensors saved inside it, and those read
    back while it is not entered (a backward run outside it)."""
    import torch

    class OffloadProbe(torch.autograd.graph.saved_tensors_hooks):
        def __init__(self):
            self.entered = self.packed = self.unpacked_outside = 0
            self.inside = False
            super().__init__(self._pack, self._unpack)

        def _pack(self, tensor):
            self.packed += 1
            return tensor

        def _unpack(self, tensor):
            self.unpacked_outside += not self.inside
            return tensor

        def __enter__(self):
            self.entered, self.inside = self.entered + 1, True
            return super().__enter__()

        def __exit__(self, *exc):
            self.inside = False
            return super().__exit__(*exc)

    return OffloadProbe()


def zero_rank_on_first_step(sampler_cls):
    """A sampler whose first step gives every microbatch of the last rank to rank 0 (LB-Mini's plans otherwise):
    the last rank starts training with zero microbatches, before it ever had a gradient or optimizer state."""
    from odc_hf.balance import Plan

    class ZeroRankOnFirstStep(sampler_cls):
        def plan(self, step):
            plan = super().plan(step)
            if step != 0:
                return plan
            mbs, costs = [list(m) for m in plan.microbatches], [list(c) for c in plan.microbatch_costs]
            mbs[0], costs[0] = mbs[0] + mbs[-1], costs[0] + costs[-1]
            mbs[-1], costs[-1] = [], []
            return Plan(mode=plan.mode, microbatches=mbs, microbatch_costs=costs, lower_bound=plan.lower_bound,
                        cost_model=plan.cost_model)  # fmt: skip

    return ZeroRankOnFirstStep


def slow_planner(sampler_cls, seconds: float):
    """An artificially slow planner: every plan takes ``seconds`` more (what 65,536 samples over 1,024 ranks cost)."""
    import time

    class SlowPlanner(sampler_cls):
        def plan(self, step):
            time.sleep(seconds)
            return super().plan(step)

    return SlowPlanner


def step_gaps_callback():
    """A TrainerCallback recording the seconds between one step's end and the next one's begin: where the Trainer
    fetches the next bundle (and plans it, unless it was planned ahead)."""
    import time

    from transformers import TrainerCallback

    class StepGaps(TrainerCallback):
        def __init__(self):
            self.gaps, self._end = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            if self._end is not None:
                self.gaps.append(time.perf_counter() - self._end)

        def on_step_end(self, args, state, control, **kwargs):
            self._end = time.perf_counter()

    return StepGaps()


def run_odc(out: Path, *, zero_rank_first_step: bool, save_steps: int, resume: str | None,
            slow_plan_s: float = 0.0, plan_ahead: int = 0, eval_steps: int = 0, loss_type: str = "nll",
            load_best: bool = False, train_twice: bool = False) -> dict:  # fmt: skip
    import os

    from odc_hf import ODCConfig, ODCSFTTrainer
    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    world = int(os.environ["WORLD_SIZE"])  # set by accelerate launch
    assert MINIBATCH % world == 0, world

    tokenizer = default_tokenizer()
    model = tiny_qwen2_model(tokenizer, seed=SEED)
    model.set_attn_implementation("sdpa_varlen")
    trainer_cls = ODCSFTTrainer
    if zero_rank_first_step:
        trainer_cls = type("ZeroFirstODCSFTTrainer", (ODCSFTTrainer,),
                           {"odc_sampler_class": zero_rank_on_first_step(ODCSFTTrainer.odc_sampler_class)})  # fmt: skip
    if slow_plan_s:
        trainer_cls = type("SlowPlanODCSFTTrainer", (trainer_cls,),
                           {"odc_sampler_class": slow_planner(trainer_cls.odc_sampler_class, slow_plan_s)})  # fmt: skip
    saving = {"save_strategy": "steps", "save_steps": save_steps} if save_steps else {}
    evaluating, eval_data = evaluation(tokenizer, 2 if load_best else eval_steps)
    if load_best:  # a best model that is not the last one: the highest evaluation loss
        saving = {"save_strategy": "steps", "save_steps": 2, "load_best_model_at_end": True,
                  "metric_for_best_model": "eval_loss", "greater_is_better": True}
    args = sft_config(out, per_device_train_batch_size=MINIBATCH // world, loss_type=loss_type, **saving, **evaluating)
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset(tokenizer), **eval_data,
                          processing_class=tokenizer,
                          odc_config=ODCConfig(balance="lb_mini", max_tokens_per_microbatch=BUDGET, timeout_s=300,
                                               plan_ahead=plan_ahead))  # fmt: skip
    gaps = step_gaps_callback()
    trainer.add_callback(gaps)
    probe = trainer.maybe_activation_offload_context = offload_probe()
    trainer.train(resume_from_checkpoint=resume)
    mesh = getattr(next(trainer.model.parameters()), "device_mesh", None)  # fully_shard's (HSDP: 2-D)
    result = {"history": trainer_history(trainer), "evaluations": trainer_evaluations(trainer),
              "microbatches": [s.microbatches for s in trainer.odc_stats.steps],
              "tokens_seen": trainer.state.num_input_tokens_seen,
              "offload": {"entered": probe.entered, "packed": probe.packed, "unpacked_outside": probe.unpacked_outside},
              "odc": trainer.odc is not None, "world": trainer.accelerator.num_processes, "step_gaps_s": gaps.gaps,
              "step_s": [s.step_s for s in trainer.odc_stats.steps],
              "mesh": mesh and {"ranks": mesh.mesh.tolist(), "names": list(mesh.mesh_dim_names or ())}}  # fmt: skip
    if train_twice:
        trainer.train()
        result["again"] = trainer_history(trainer)
    if load_best:
        result["best_model_checkpoint"] = trainer.state.best_model_checkpoint
        result["evaluated_after_training"] = trainer.evaluate()["eval_loss"]
        trainer.save_model(str(out / "final"))
    if trainer.odc is not None:
        trainer.odc.close()  # a trainer resumed in the same processes installs its own
    return result


def run_trl(out: Path, *, save_steps: int, eval_steps: int = 0, loss_type: str = "nll", train_twice: bool = False
            ) -> dict:  # fmt: skip
    from trl import SFTTrainer

    from odc_hf.testing.data import default_tokenizer, tiny_qwen2_model

    tokenizer = default_tokenizer()
    model = tiny_qwen2_model(tokenizer, seed=SEED)
    model.set_attn_implementation("sdpa")
    data = dataset(tokenizer)
    data = data.select(minibatch_order(len(data)))  # TRL reads it in order, one whole minibatch per step
    saving = {"save_strategy": "steps", "save_steps": save_steps} if save_steps else {}
    evaluating, eval_data = evaluation(tokenizer, eval_steps)
    args = sft_config(out, train_sampling_strategy="sequential", use_cpu=True, loss_type=loss_type, **saving,
                      **evaluating)  # fmt: skip
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, **eval_data)
    assert trainer.accelerator.num_processes == 1
    trainer.train()
    result = {"history": trainer_history(trainer), "evaluations": trainer_evaluations(trainer),
              "tokens_seen": trainer.state.num_input_tokens_seen}
    if train_twice:
        trainer.train()
        result["again"] = trainer_history(trainer)
    return result


def trainer_history(trainer) -> list[dict]:
    return [{"step": h["step"], "loss": h["loss"], "grad_norm": h["grad_norm"]}
            for h in trainer.state.log_history if "loss" in h]  # fmt: skip


def trainer_evaluations(trainer) -> list[dict]:
    """The Trainer's evaluation logs: step, loss and TRL's token accuracy."""
    return [{"step": h["step"], "loss": h["eval_loss"], "mean_token_accuracy": h["eval_mean_token_accuracy"]}
            for h in trainer.state.log_history if "eval_loss" in h]  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trainer", choices=["odc", "trl"])
    p.add_argument("out", type=Path)
    p.add_argument("--zero_rank_first_step", action="store_true")
    p.add_argument("--save_steps", type=int, default=0)
    p.add_argument("--eval_steps", type=int, default=0, help="evaluate on held-out text every this many steps")
    p.add_argument("--loss_type", default="nll", choices=["nll", "dft"], help="SFTConfig.loss_type")
    p.add_argument("--load_best", action="store_true",
                   help="evaluate and save every 2 steps, keep the WORST evaluation loss as the best model, load it at "
                        "the end; then evaluate again and save the model to OUT/final")
    p.add_argument("--train_twice", action="store_true", help="call train() a second time on the same trainer")
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--then_resume_from", type=int, default=0, help="then resume a fresh trainer from this step")
    p.add_argument("--slow_plan_s", type=float, default=0.0,
                   help="make every plan this much slower, and run twice: planned inline, then one step ahead")
    args = p.parse_args(argv)
    if args.slow_plan_s:
        for ahead in (0, 1):
            result = run_odc(args.out / f"ahead{ahead}", zero_rank_first_step=False, save_steps=0, resume=None,
                             slow_plan_s=args.slow_plan_s, plan_ahead=ahead)  # fmt: skip
            _write(args.out / f"ahead{ahead}", result)
        return
    if args.trainer == "odc":
        result = run_odc(args.out, zero_rank_first_step=args.zero_rank_first_step, save_steps=args.save_steps,
                         resume=args.resume_from_checkpoint, eval_steps=args.eval_steps,
                         loss_type=args.loss_type, load_best=args.load_best, train_twice=args.train_twice)  # fmt: skip
    else:
        result = run_trl(args.out, save_steps=args.save_steps, eval_steps=args.eval_steps, loss_type=args.loss_type,
                         train_twice=args.train_twice)  # fmt: skip
    _write(args.out, result)
    if args.then_resume_from:
        resumed = run_odc(args.out / "resumed", zero_rank_first_step=False, save_steps=0,
                          resume=str(args.out / f"checkpoint-{args.then_resume_from}"))  # fmt: skip
        _write(args.out / "resumed", resumed)


def _write(out: Path, result: dict) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "losses.json").write_text(json.dumps(result, indent=1))


# -- for the tests: launch the runs, compare them --------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]

# The losses are means over ~5k tokens of fp32 cross-entropies that the two runs compute with different kernels
# (packed rows and per-document attention vs padded rows and masked attention): they agree to an ulp or so (measured:
# <= 1.2e-7 relative, 1 ulp of 8.3); 2e-6 leaves that 16x room. Gradients are sums of per-token terms with heavy
# cancellation (per-token terms ~1, their mean ~1e-4 per element), so their norms carry more of the reordering
# (measured 4e-6 to 1.2e-5); 5e-5 for them. The bugs these tests exist for move both by > 1e-3: a per-rank instead of
# a global token normaliser reweights samples whose mean losses differ by ~0.1; a lost or doubled microbatch, or a
# lost update on the rank that ran none, changes the step's gradient by a whole sample's share.
LOSS_RTOL, GRAD_NORM_RTOL = 2e-6, 5e-5


def launch_env() -> dict:
    """What the runs' processes need: this checkout importable, one thread each, offline."""
    import os

    return {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


def launch(script: str, *args, config: str = "cpu.yaml") -> None:
    """``tests/support/<script>`` on the CPU processes ``accelerate launch`` starts with ``config`` (2 with
    accelerate_configs/cpu.yaml, 4 as "2 nodes x 2 ranks" (HSDP) with cpu_hsdp.yaml), in ranks forked from the test
    process's fork server with the launcher's environment (tests/support/launched.py)."""
    from launched import run_launched

    run_launched(ROOT / "tests" / "support" / script, *args, config=config)


def one_process(script: str, *args) -> None:
    """``python tests/support/<script>`` in one plain process (no launcher, no process group), forked likewise."""
    from launched import run_plain

    run_plain(ROOT / "tests" / "support" / script, *args)


def odc_run(out: Path, *args: str, config: str = "cpu.yaml") -> dict:
    """The ODC run on CPU processes (2, or HSDP 2 x 2 with ``config="cpu_hsdp.yaml"``); its losses.json."""
    launch("sft_runs.py", "odc", out, *args, config=config)
    return json.loads((out / "losses.json").read_text())


def trl_reference(out: Path, *args: str) -> dict:
    """TRL's SFTTrainer in one plain process; its losses.json."""
    one_process("sft_runs.py", "trl", out, *args)
    return json.loads((out / "losses.json").read_text())


def assert_same_steps(odc: list[dict], reference: list[dict], steps) -> None:
    """``odc`` logged exactly ``steps``, each with the reference's loss and gradient norm at that step."""
    import pytest

    by_step = {h["step"]: h for h in reference}
    assert [h["step"] for h in odc] == list(steps)
    for h in odc:
        ref = by_step[h["step"]]
        assert h["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL), (h, ref)
        assert h["grad_norm"] == pytest.approx(ref["grad_norm"], rel=GRAD_NORM_RTOL), (h, ref)


if __name__ == "__main__":
    main()
