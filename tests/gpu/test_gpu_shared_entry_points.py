"""Ranks sharing one GPU, started every way a user starts them, with nothing added for the shared-GPU mode (no
``ddp_backend``): TRL's GRPO recipe with vLLM through ``python -m odc_hf.run`` exactly as docs/trl_recipes.md writes
it, TRL's own ``SFTConfig`` in a notebook (``notebook_launcher``), and an own script with transformers'
``TrainingArguments`` under ``accelerate launch``. Each runs more processes than the machine has GPUs, so ranks share.

    python -m pytest -m gpu -rP tests/gpu/test_gpu_shared_entry_points.py

The CPU tests of the same paths (accelerate's state and gathers, the NCCL group replaced by gloo) are
tests/trainers/test_shared_gpu_backend.py.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from one_process_runs import ROOT, gpu_launch
from recipe_checks import changed_tensors, load_weights, logged, training_losses

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (ranks share it)"),
]
MARK = "# TRL's GRPO recipe with vLLM on one GPU"
GATHER_FAILURE = "invalid tensor size"  # what accelerate's gather raised on gloo before (2-D rewards)


def _processes() -> int:
    return torch.cuda.device_count() + 1  # more ranks than GPUs: the shared-GPU mode


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "ACCELERATE_USE_CPU")}
    return {**env, "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}  # fmt: skip


def documented_grpo_vllm_commands() -> list[str]:
    """The one-GPU GRPO + vLLM block of docs/trl_recipes.md (from MARK to the block's end), one command per logical
    line, comments dropped."""
    text = (ROOT / "docs" / "trl_recipes.md").read_text()
    block = text[text.index(MARK) :].split("```", 1)[0]
    commands, current = [], ""
    for line in block.splitlines()[1:]:
        line = line.split(" # ", 1)[0].strip()
        current += " " + line.removesuffix("\\").strip()
        if not line.endswith("\\") and current.strip():
            commands.append(" ".join(current.split()))
            current = ""
    return commands


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install 'odc_hf[vllm]')")
def test_trl_grpo_recipe_with_vllm_colocate_as_documented_on_ranks_sharing_the_gpu(tmp_path, monkeypatch):
    from odc_hf.offline import main

    helper, launch = documented_grpo_vllm_commands()
    assert helper.startswith("python -m odc_hf.offline demo --prompts"), helper
    assert "--use_vllm --vllm_mode colocate" in launch and "ddp_backend" not in launch, launch
    monkeypatch.chdir(tmp_path)
    main(helper.split()[3:])
    launch = launch.replace("accelerate launch", f"{sys.executable} -m accelerate.commands.launch --main_process_port 0")
    launch = launch.replace("accelerate_configs/", f"{ROOT}/accelerate_configs/")
    launch = launch.replace("--num_processes 2", f"--num_processes {_processes()}")
    proc = subprocess.run(launch, shell=True, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    (tmp_path / "log.txt").write_text(output)
    assert proc.returncode == 0 and GATHER_FAILURE not in output, output[-6000:]
    assert "ranks share" in output, output[-3000:]  # the shared-GPU mode said it is on
    losses, rewards = training_losses(output, 3), logged(output, "reward")  # rewards: gathered (n, functions)
    print(f"losses {losses}, rewards {rewards}, bubble rates {logged(output, 'odc/bubble_rate')}")
    assert len(rewards) == 3 and all(math.isfinite(r) and r > 0 for r in rewards), rewards
    assert len(logged(output, "odc/bubble_rate")) == 3  # the ODC trainer ran (TRL's own logs no odc/* keys)
    # it trained: the documented reward (a completion's length) varies within a group, and the offline model ends
    # completions early, so the loss is not zero up to rounding (as it is on completions of equal length); every
    # saved tensor is finite and moved (with the reward documented before, think_format_reward, none did)
    assert all(abs(x) > 1e-2 for x in losses), losses
    saved, initial = load_weights(tmp_path / "out"), load_weights(tmp_path / "demo" / "model")
    assert saved.keys() == initial.keys() and all(torch.isfinite(v).all() for v in saved.values())
    unmoved = sorted(set(saved) - set(changed_tensors(saved, initial)))
    assert not unmoved, f"tensors the recipe did not train: {unmoved}"


NOTEBOOK_CELL = textwrap.dedent(
    """
    import sys
    from accelerate import notebook_launcher

    def train(output_dir):
        from trl import SFTConfig   # TRL's own arguments: they start NCCL, which odc_hf replaces by gloo
        from odc_hf import ODCConfig, ODCSFTTrainer
        from odc_hf.testing.data import default_text_dataset, default_tokenizer, tiny_qwen2_model

        tok = default_tokenizer()
        args = SFTConfig(output_dir=output_dir, max_steps=3, per_device_train_batch_size=2, report_to="none",
                         bf16=False, max_length=256, logging_steps=1, save_strategy="no", learning_rate=1e-3)
        trainer = ODCSFTTrainer(model=tiny_qwen2_model(tok), args=args, train_dataset=default_text_dataset(32),
                                processing_class=tok, odc_config=ODCConfig(max_tokens_per_microbatch=512, truncate=True))
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        import torch.distributed as dist
        print("RESULT", trainer.accelerator.process_index, dist.get_backend(), trainer.odc is not None, losses,
              flush=True)

    from odc_hf.testing import free_port
    notebook_launcher(train, args=(sys.argv[1],), num_processes=int(sys.argv[2]), use_port=str(free_port()))
    """
)


def test_trl_sft_config_in_a_notebook_trains_on_ranks_sharing_the_gpu(tmp_path):
    script = tmp_path / "cell.py"
    script.write_text(NOTEBOOK_CELL)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "out"), str(_processes())], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail("the notebook launch did not finish in 600 s:\n" + stderr[-4000:])
    assert proc.returncode == 0, stdout[-2000:] + stderr[-5000:]
    results = [line.split(" ", 4)[1:] for line in stdout.splitlines() if line.startswith("RESULT ")]
    print(results, [line for line in stderr.splitlines() if "replaced by gloo" in line][:1])
    assert sorted(r[0] for r in results) == [str(r) for r in range(_processes())], stdout[-2000:]
    assert all(r[1:3] == ["gloo", "True"] for r in results), results
    losses = [json.loads(r[3]) for r in results]
    assert all(x == losses[0] for x in losses) and len(losses[0]) == 3, losses  # the global loss on every rank


OWN_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from transformers import TrainingArguments
    from odc_hf import ODCTrainer
    from odc_hf.testing.data import default_tokenized_dataset, default_tokenizer, tiny_qwen2_model

    tok = default_tokenizer()
    args = TrainingArguments(output_dir=sys.argv[1], max_steps=2, per_device_train_batch_size=2, report_to="none",
                             logging_steps=1, save_strategy="no")
    trainer = ODCTrainer(model=tiny_qwen2_model(tok), args=args,
                         train_dataset=default_tokenized_dataset(tok, 32, max_length=128))
    trainer.train()
    acc = trainer.accelerator
    rows = acc.gather(torch.full((2, 3), float(acc.process_index), device=acc.device))  # 2-D, as TRL's rewards
    print("RESULT", json.dumps([acc.process_index, str(torch.distributed.get_backend()), rows[:, 0].tolist()]))
    """
)


def test_own_script_with_transformers_training_arguments_under_accelerate_launch(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(OWN_SCRIPT)
    proc = gpu_launch(script, tmp_path / "out", processes=_processes())
    output = proc.stdout + proc.stderr
    (tmp_path / "log.txt").write_text(output)
    assert proc.returncode == 0, output[-6000:]
    results = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    n = _processes()
    want = [float(r) for r in range(n) for _ in range(2)]
    assert sorted(r[0] for r in results) == list(range(n)), output[-3000:]
    assert all(r[1] == "gloo" and r[2] == want for r in results), results
