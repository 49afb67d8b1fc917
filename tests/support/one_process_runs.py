"""SFT runs in ONE process (world size 1) on whatever device accelerate gives it (the GPU when there is one): the
ODC trainer and its independent reference, TRL's own ``SFTTrainer``, on the same samples in the same order as
``tests/support/sft_runs.py`` (its data, model and hyperparameters; nothing is redefined here).

    python tests/support/one_process_runs.py odc OUT [--attn sdpa_varlen] [--bf16] [--peft] [--save_steps N] [--resume DIR]
        [--head_dim 64]
    python tests/support/one_process_runs.py trl OUT [--attn sdpa] [--bf16] [--peft] [--head_dim 64]

Writes ``OUT/losses.json``: ``history`` (step, loss, grad_norm), ``device``, ``attention``, and for ODC the compute
path it chose and the microbatches per step. For the one-GPU tests (``tests/gpu/test_gpu_one_device.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import sft_runs

ROOT = Path(__file__).resolve().parents[2]


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                      task_type="CAUSAL_LM")  # fmt: skip


def _model(tokenizer, attn: str, head_dim: int | None):
    import odc_hf.attention  # noqa: F401 - registers "sdpa_varlen"
    from odc_hf.testing.data import TINY_HEAD_DIM_64, tiny_qwen2_model

    wide = TINY_HEAD_DIM_64 if head_dim == 64 else {}  # what FlashAttention-4 takes (the default tiny model has 16)
    if head_dim not in (None, 64):
        raise ValueError(f"head_dim: 64 or the tiny default, got {head_dim}")
    model = tiny_qwen2_model(tokenizer, seed=sft_runs.SEED, **wide)
    model.set_attn_implementation(attn)
    return model


def run(trainer_name: str, out: Path, *, attn: str, bf16: bool, peft: bool, save_steps: int, resume: str | None,
        head_dim: int | None = None, zero_rank_first_step: bool = False):
    import torch

    from odc_hf.testing.data import default_tokenizer

    world = int(os.environ.get("WORLD_SIZE", "1"))  # > 1 under `accelerate launch` (ranks may share the GPU)
    tokenizer = default_tokenizer()
    saving = {"save_strategy": "steps", "save_steps": save_steps} if save_steps else {}
    if trainer_name == "odc":  # the ODC config, built before anything starts CUDA, as docs/quickstart.md does
        from odc_hf import ODCSFTConfig

        args = sft_runs.sft_config(out, config_class=ODCSFTConfig, bf16=bf16,
                                   per_device_train_batch_size=sft_runs.MINIBATCH // world, **saving)  # fmt: skip
    model = _model(tokenizer, attn, head_dim)
    data = sft_runs.dataset(tokenizer)
    extra = {"peft_config": _lora()} if peft else {}
    torch.manual_seed(0)  # TRL draws the LoRA weights in __init__, before the Trainer seeds
    if trainer_name == "odc":
        from odc_hf import ODCConfig, ODCSFTTrainer

        trainer_cls = ODCSFTTrainer
        if zero_rank_first_step:  # the last rank starts training with no microbatch at all
            trainer_cls = type("ZeroFirstODCSFTTrainer", (ODCSFTTrainer,), {
                "odc_sampler_class": sft_runs.zero_rank_on_first_step(ODCSFTTrainer.odc_sampler_class)})  # fmt: skip
        trainer = trainer_cls(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                                odc_config=ODCConfig(balance="lb_mini", max_tokens_per_microbatch=sft_runs.BUDGET),
                                **extra)  # fmt: skip
    else:
        from trl import SFTTrainer

        data = data.select(sft_runs.minibatch_order(len(data)))  # one whole minibatch per step, in ODC's order
        args = sft_runs.sft_config(out, bf16=bf16, train_sampling_strategy="sequential", **saving)
        trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, **extra)
    assert trainer.accelerator.num_processes == world
    trainer.train(resume_from_checkpoint=resume)
    result = {"history": sft_runs.trainer_history(trainer), "device": str(trainer.accelerator.device),
              "attention": model.config._attn_implementation, "world": world}  # fmt: skip
    if trainer_name == "odc":
        result["odc"] = trainer.odc.describe() if trainer.odc is not None else None
        result["compute_path"] = trainer.odc_compute.describe() if trainer.odc_compute is not None else None
        result["microbatches"] = [s.microbatches for s in trainer.odc_stats.steps]
        result["cuda_allocator"] = trainer.odc_cuda_allocator
        result["cuda_alloc_retries"] = [h.get("odc/cuda_alloc_retries") for h in trainer.state.log_history
                                        if "loss" in h]  # fmt: skip
    if trainer.accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "losses.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trainer", choices=["odc", "trl"])
    p.add_argument("out", type=Path)
    p.add_argument("--attn", default=None, help="attn_implementation (default: sdpa_varlen for odc, sdpa for trl)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--peft", action="store_true", help="LoRA r=8 on q_proj, v_proj")
    p.add_argument("--save_steps", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--head_dim", type=int, default=None, help="64: a wider tiny model (FlashAttention-4's sizes)")
    p.add_argument("--zero_rank_first_step", action="store_true", help="launched: the last rank's first step is empty")
    a = p.parse_args(argv)
    attn = a.attn or ("sdpa_varlen" if a.trainer == "odc" else "sdpa")
    run(a.trainer, a.out, attn=attn, bf16=a.bf16, peft=a.peft, save_steps=a.save_steps, resume=a.resume,
        head_dim=a.head_dim, zero_rank_first_step=a.zero_rank_first_step)


def one_process_run(out: Path, *args) -> dict:
    """``python tests/support/one_process_runs.py *args OUT`` in a new plain process (no launcher); its losses.json."""
    trainer, *rest = map(str, args)
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
           **sft_runs.launch_env()}  # fmt: skip
    proc = subprocess.run([sys.executable, str(ROOT / "tests/support/one_process_runs.py"), trainer, str(out), *rest],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (out / "log.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    return json.loads((out / "losses.json").read_text())


def gpu_launch(*args, processes: int = 2, timeout: float = 900) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file accelerate_configs/odc.yaml --num_processes N --mixed_precision no *args`` on
    this machine's GPU(s): with fewer GPUs than processes the ranks share them (gloo, CUDA IPC). Output captured."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
           **sft_runs.launch_env(), "ODC_NO_RELAUNCH": "1"}  # fmt: skip
    env.pop("ACCELERATE_USE_CPU", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs/odc.yaml"),
           "--num_processes", str(processes), "--main_process_port", "0", "--mixed_precision", "no",
           *map(str, args)]  # fmt: skip  (the config's bf16 off: the runs' own --bf16 decides, as in one process)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def launched_run(out: Path, *args, processes: int = 2) -> dict:
    """``tests/support/one_process_runs.py odc OUT *args`` on ``processes`` GPU ranks (:func:`gpu_launch`); its losses.json."""
    proc = gpu_launch(ROOT / "tests/support/one_process_runs.py", "odc", out, *args, processes=processes)
    out.mkdir(parents=True, exist_ok=True)
    (out / "log.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((out / "losses.json").read_text())


def grpo_run(out: Path, trainer: str, *args) -> list[dict]:
    """``examples/grpo.py --trainer TRAINER --fixed_rollouts`` (2 steps, dapo) in a new plain process: its history."""
    return grpo_result(out, trainer, *args)["history"]


def grpo_result(out: Path, trainer: str, *args) -> dict:
    """:func:`grpo_run`'s whole record: ``history``, and for ODC ``steps``, ``attention`` and ``packed``."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
           **sft_runs.launch_env(), "ODC_NO_RELAUNCH": "1"}  # fmt: skip
    cmd = [sys.executable, str(ROOT / "examples/grpo.py"), "--trainer", trainer, "--fixed_rollouts", "--max_steps", "2",
           "--loss_type", "dapo", "--output_dir", str(out), "--losses_json", str(out / "losses.json"), *map(str, args)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((out / "losses.json").read_text())["dapo"]


if __name__ == "__main__":
    main()
