"""TRL's own GRPO recipe module (trl.scripts.grpo), unmodified, runs with ODC through the runpy launcher:
`accelerate launch ... -m odc_hf.run trl.scripts.grpo ...` on CPU with 2 processes, offline (a tiny local model,
a local prompt data set and a reward function given by its import path, which the recipe supports). Every step logs
finite values and ODC's metrics, and the final save holds the whole model after its Adam steps."""

from __future__ import annotations

import ast
import math

import pytest
import torch

from odc_hf.testing import accelerate_cpu, local_model_and_data

REWARD = '''
def digits_reward(completions, **kwargs):
    """1 per digit character, a programmatic reward that needs nothing else."""
    return [float(sum(ch.isdigit() for ch in str(c))) for c in completions]
'''
STEPS, LR = 2, 1e-4


def logged(out: str) -> list[dict]:
    """The Trainer's per-step log lines ({'loss': ..., ...}) as dicts."""
    rows = []
    for line in out.splitlines():
        if "{'loss'" in line:
            start = line.index("{'loss'")
            rows.append(ast.literal_eval(line[start : line.index("}", start) + 1]))
    return rows


@pytest.mark.slow
def test_trl_grpo_recipe_runs_with_odc(tmp_path):
    from transformers import AutoModelForCausalLM

    prompts = [f"{a} + {b} = " for a in range(3, 40, 3) for b in range(2, 20, 4)]
    model_dir, data_dir = local_model_and_data(tmp_path, [{"prompt": p} for p in prompts])
    (tmp_path / "odc_test_reward.py").write_text(REWARD)
    args = ["-m", "odc_hf.run", "trl.scripts.grpo",
           "--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir), "--output_dir", str(tmp_path / "out"),
           "--reward_funcs", "odc_test_reward.digits_reward", "--max_steps", str(STEPS), "--per_device_train_batch_size", "4",
           "--gradient_accumulation_steps", "2", "--num_generations", "4", "--max_completion_length", "12",
           "--learning_rate", str(LR), "--report_to", "none", "--logging_steps", "1", "--save_strategy", "no",
           "--dtype", "float32", "--bf16", "false"]  # fmt: skip
    proc = accelerate_cpu(*args, cwd=tmp_path)  # the recipe imports the reward module from the working directory
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    rows = logged(out)
    assert len(rows) == STEPS, out[-3000:]
    for row in rows:
        assert "odc/bubble_rate" in row and "odc/predicted_bubble" in row  # ODCGRPOTrainer (not TRL's) ran
        assert all(math.isfinite(float(row[k])) for k in ("loss", "grad_norm", "reward")), row
    # The recipe's final save_model(): the whole model (shapes as created, not one rank's shard), finite, and moved
    # by its Adam steps: the first moves every element that has a gradient by lr, no step by much more.
    before = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).state_dict()
    assert {k: v.shape for k, v in after.items()} == {k: v.shape for k, v in before.items()}
    moved = max(float((after[k] - before[k]).abs().max()) for k in after)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert 0.5 * LR < moved < 2 * STEPS * LR, moved
