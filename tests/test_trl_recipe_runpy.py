"""TRL's own SFT recipe module (trl.scripts.sft), unmodified, runs with ODC through the runpy launcher:
`accelerate launch ... -m odc_hf.run trl.scripts.sft ...` on CPU with 2 processes, offline."""

from __future__ import annotations

import pytest

from odc_hf.testing import accelerate_cpu, local_model_and_data


@pytest.mark.slow
def test_trl_sft_recipe_runs_with_odc(tmp_path):
    from odc_hf.data import default_documents

    docs = [d[:3000] for d in default_documents(64) if len(d) > 200]
    model_dir, data_dir = local_model_and_data(tmp_path, [{"text": d} for d in docs])
    args = ["-m", "odc_hf.run", "trl.scripts.sft",
           "--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir), "--output_dir", str(tmp_path / "out"),
           "--max_steps", "3", "--per_device_train_batch_size", "4", "--max_length", "512", "--packing", "false",
           "--report_to", "none", "--logging_steps", "1", "--save_strategy", "no", "--dtype", "float32", "--bf16", "false"]  # fmt: skip
    proc = accelerate_cpu(*args, env={"ODC_MAX_TOKENS_PER_MICROBATCH": "2048"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "Training completed" in out
    assert "odc/bubble_rate" in out  # the ODC trainer (not TRL's) ran: its step metrics are in the logs
    assert (tmp_path / "out" / "config.json").exists()  # the recipe's final save_model() worked
