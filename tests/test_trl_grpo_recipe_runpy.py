"""TRL's own GRPO recipe module (trl.scripts.grpo), unmodified, runs with ODC through the runpy launcher:
`accelerate launch ... -m odc_hf.run trl.scripts.grpo ...` on CPU with 2 processes, offline (a tiny local model,
a local prompt data set and a reward function given by its import path, which the recipe supports)."""

from __future__ import annotations

import pytest

from odc_hf.testing import accelerate_cpu, local_model_and_data

REWARD = '''
def digits_reward(completions, **kwargs):
    """1 per digit character, a programmatic reward that needs nothing else."""
    return [float(sum(ch.isdigit() for ch in str(c))) for c in completions]
'''


@pytest.mark.slow
def test_trl_grpo_recipe_runs_with_odc(tmp_path):
    prompts = [f"{a} + {b} = " for a in range(3, 40, 3) for b in range(2, 20, 4)]
    model_dir, data_dir = local_model_and_data(tmp_path, [{"prompt": p} for p in prompts])
    (tmp_path / "odc_test_reward.py").write_text(REWARD)
    args = ["-m", "odc_hf.run", "trl.scripts.grpo",
           "--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir), "--output_dir", str(tmp_path / "out"),
           "--reward_funcs", "odc_test_reward.digits_reward", "--max_steps", "2", "--per_device_train_batch_size", "4",
           "--gradient_accumulation_steps", "2", "--num_generations", "4", "--max_completion_length", "12",
           "--report_to", "none", "--logging_steps", "1", "--save_strategy", "no", "--dtype", "float32",
            "--bf16", "false"]  # fmt: skip
    proc = accelerate_cpu(*args, cwd=tmp_path)  # the recipe imports the reward module from the working directory
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "Training completed" in out
    assert "odc/bubble_rate" in out  # the ODC trainer (not TRL's) ran: its step metrics are in the logs
    assert (tmp_path / "out" / "config.json").exists()  # the recipe's final save_model() worked
