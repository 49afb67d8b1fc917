"""Checkpoint / resume runs for the resume tests: ODCSFTTrainer on ranks forked by ``odc_hf.testing.run_ranks`` (no
launcher: a rank starts in well under a second), several trainers one after another in the same processes.

The data: 25 real-text samples (<= 192 tokens) and 8 samples per optimizer step, so each epoch has 4 steps and its
last minibatch holds ONE sample (``dataloader_drop_last=False``): on any number of ranks, LB-Mini gives every rank but
one zero microbatches in that step (step 4, then again step 8), and uneven counts in the others.

``train(rank, world, out, **options)`` builds a fresh model, trainer and ODC install, trains (or resumes), and returns
``history`` (step, loss, grad_norm per logged step), ``microbatches`` (per step run, every rank's microbatch count,
recorded by the trainer), ``mesh`` (the device mesh's shape), ``warnings`` (transformers' warning lines) and ``error``
(the exception's type and text, if ``train()`` raised one: every rank then raised before any collective).
"""

from __future__ import annotations

import logging
import os

NUM_SAMPLES = 25
MINIBATCH = 8  # samples per optimizer step, all ranks together
MAX_LENGTH, BUDGET = 192, 256
MAX_STEPS = 6
SEED = 0
ENV = {"ACCELERATE_USE_CPU": "true", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def train(rank, world, out, *, resume=None, save_steps=0, save_total_limit=None, max_steps=MAX_STEPS,
          per_device=None, global_batch_size=None, mesh=None, kill_rank_in_save=None, use_cpu=True):  # fmt: skip
    """One trainer on this rank (see the module docstring). ``per_device``: ``per_device_train_batch_size`` (default
    MINIBATCH / world); ``global_batch_size``: ODCConfig's; ``mesh``: ``(replicate, shard)`` for HSDP;
    ``kill_rank_in_save``: ``(rank, step)``, that rank SIGKILLs itself inside the save of that step's checkpoint,
    after the model was written and before the optimizer."""
    import signal

    import torch
    from accelerate.parallelism_config import ParallelismConfig
    from trl import SFTConfig

    from odc_hf import ODCConfig, ODCSFTTrainer
    from odc_hf.testing.data import default_tokenized_dataset, default_tokenizer, tiny_qwen2_model

    class Trainer(ODCSFTTrainer):
        def _save_optimizer_and_scheduler(self, output_dir):
            if kill_rank_in_save == (rank, self.state.global_step):
                os.kill(os.getpid(), signal.SIGKILL)
            return super()._save_optimizer_and_scheduler(output_dir)

    lines = _Lines()
    logging.getLogger("transformers").addHandler(lines)
    tokenizer = default_tokenizer()
    model = tiny_qwen2_model(tokenizer, seed=SEED)
    model.set_attn_implementation("sdpa_varlen")
    saving = {"save_strategy": "steps", "save_steps": save_steps} if save_steps else {"save_strategy": "no"}
    args = SFTConfig(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=per_device or MINIBATCH // world,
        learning_rate=1e-3, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, seed=SEED,
        logging_steps=1, report_to="none", bf16=False, use_cpu=use_cpu, max_length=BUDGET, packing=False,
        dataloader_drop_last=False, disable_tqdm=True, gradient_checkpointing=False, save_total_limit=save_total_limit,
        parallelism_config=mesh and ParallelismConfig(dp_replicate_size=mesh[0], dp_shard_size=mesh[1]), **saving,
    )  # fmt: skip
    extra = {} if global_batch_size is None else {"global_batch_size": global_batch_size}
    config = ODCConfig(balance="lb_mini", max_tokens_per_microbatch=BUDGET, timeout_s=60, log_timeline=False, **extra)
    data = default_tokenized_dataset(tokenizer, NUM_SAMPLES, max_length=MAX_LENGTH, seed=SEED)
    trainer = Trainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, odc_config=config)
    result = {"error": None}
    try:
        trainer.train(resume_from_checkpoint=resume)
    except BaseException as err:  # noqa: BLE001 - the tests read it (DCP raises BaseExceptions)
        result["error"] = f"{type(err).__name__}: {err}"
    finally:
        logging.getLogger("transformers").removeHandler(lines)
    result["history"] = [{k: h[k] for k in ("step", "loss", "grad_norm")} for h in trainer.state.log_history
                         if "loss" in h]  # fmt: skip
    result["microbatches"] = [list(s.microbatches) for s in trainer.odc_stats.steps]
    result["warnings"] = lines.lines
    param = next(trainer.model.parameters())
    result["mesh"] = tuple(param.device_mesh.shape) if hasattr(param, "device_mesh") else None
    if trainer.odc is not None:
        trainer.odc.close()  # the next trainer in these processes installs its own
    if result["error"] is None:  # after an error inside train(), ODC's failure report may have closed the group
        torch.distributed.barrier()
    return result


def train_ranks(world, *runs, timeout_s=300, raise_on_failure=True, cuda=False):
    """``train(**options)`` for each ``(out, options)`` of ``runs``, one after another on the same ``world`` forked
    ranks; per rank, the list of results (or ``run_ranks``' outcomes with ``raise_on_failure=False``). ``cuda``: the
    ranks train on the GPU(s), sharing them when there are fewer than ranks."""
    from odc_hf.testing import run_ranks

    runs = [(str(out), {**options, "use_cpu": not cuda}) for out, options in runs]
    env = {k: v for k, v in ENV.items() if not (cuda and k == "ACCELERATE_USE_CPU")}
    return run_ranks(_train_entry, world, runs, env=env, timeout_s=timeout_s, raise_on_failure=raise_on_failure,
                     cuda=cuda)  # fmt: skip


def _train_entry(rank, world, runs):
    return [train(rank, world, out, **options) for out, options in runs]
