"""TRL's own SFT recipe module (trl.scripts.sft), unmodified, runs with ODC through the runpy launcher:
`accelerate launch ... -m odc_hf.run trl.scripts.sft ...` on CPU with 2 processes, offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_trl_sft_recipe_runs_with_odc(tmp_path):
    from odc_hf.data import default_documents, default_tokenizer, tiny_qwen2_model

    tokenizer = default_tokenizer()
    model_dir, data_dir = tmp_path / "model", tmp_path / "data"
    tiny_qwen2_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data_dir.mkdir()
    docs = [d[:3000] for d in default_documents(64) if len(d) > 200]
    (data_dir / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "ODC_MAX_TOKENS_PER_MICROBATCH": "2048"}  # fmt: skip
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs/cpu.yaml"),
           "--main_process_port", "0", "-m", "odc_hf.run", "trl.scripts.sft",
           "--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir), "--output_dir", str(tmp_path / "out"),
           "--max_steps", "3", "--per_device_train_batch_size", "4", "--max_length", "512", "--packing", "false",
           "--report_to", "none", "--logging_steps", "1", "--save_strategy", "no", "--dtype", "float32", "--bf16", "false"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "Training completed" in out
    assert "odc/bubble_rate" in out  # the ODC trainer (not TRL's) ran: its step metrics are in the logs
    assert (tmp_path / "out" / "config.json").exists()  # the recipe's final save_model() worked
