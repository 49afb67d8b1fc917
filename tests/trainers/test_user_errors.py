"""What a new user meets in the first hour (issue 21): each mistake stops before training with the numbers and the
fix, the figures the Trainer reports are true, and warnings come once."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from odc_hf.config import ODCConfig, parse_count
from odc_hf.testing import accelerate_cpu, run_ranks

ROOT = Path(__file__).resolve().parents[2]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def _trainer_on(rank, output_dir, dataset, **overrides):
    from fsdp_helpers import tiny_qwen2
    from transformers import TrainingArguments

    from odc_hf import ODCTrainer

    settings = dict(output_dir=output_dir, max_steps=2, per_device_train_batch_size=2, logging_steps=1,
                    save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True)  # fmt: skip
    odc = overrides.pop("odc_config", ODCConfig())
    settings.update(overrides)
    return ODCTrainer(model=tiny_qwen2(), args=TrainingArguments(**settings), train_dataset=dataset, odc_config=odc)


def _first_hour(rank, world_size, output_dir):
    """Every trainer-level check on one pair of spawned ranks (each spawn costs seconds)."""
    import torch
    from datasets import Dataset

    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 256, (int(n),), generator=gen).tolist() for n in torch.randint(8, 40, (32,), generator=gen)]
    data = Dataset.from_dict({"input_ids": ids})
    seen = {}

    def error_of(trainer):
        try:
            trainer.train()
        except ValueError as err:
            return str(err)
        return None

    try:  # refused at construction, before the base trainer reads a first row (TRL's SFTTrainer would)
        _trainer_on(rank, output_dir, Dataset.from_dict({"input_ids": []}))
        seen["empty"] = None
    except ValueError as err:
        seen["empty"] = str(err)
    seen["too_small"] = error_of(_trainer_on(rank, output_dir, data.select(range(10)), per_device_train_batch_size=4,
                                             gradient_accumulation_steps=2, dataloader_drop_last=True))  # fmt: skip
    seen["too_long"] = error_of(_trainer_on(rank, output_dir, data, odc_config=ODCConfig(max_tokens_per_microbatch=16)))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    for name in ("odc_hf.integrations.trainer.train_data", "odc_hf.integrations.compute.attention"):
        logging.getLogger(name).addHandler(handler)
    # Truncation on, gradient accumulation 2 (folded into each bundle): trains, and reports samples per second. The
    # model keeps its dense-mask "sdpa" (attention="model"; "auto" would replace it): the warning for that, once.
    trainer = _trainer_on(rank, output_dir, data, gradient_accumulation_steps=2,
                          odc_config=ODCConfig(max_tokens_per_microbatch=16, truncate=True, attention="model"))  # fmt: skip
    metrics = trainer.train().metrics
    seen["samples"] = metrics["train_samples_per_second"] * metrics["train_runtime"]
    seen["warnings"] = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    return seen


def test_trainer_stops_before_training_with_the_numbers_and_reports_true_samples_per_second(tmp_path):
    outcomes = run_ranks(_first_hour, 2, str(tmp_path), timeout_s=300, env={"ACCELERATE_USE_CPU": "true"})
    for rank, seen in enumerate(outcomes):
        assert seen["empty"].startswith("train_dataset is empty (0 samples)"), seen["empty"]
        assert seen["too_small"].startswith(
            "the training dataset (10 samples) is smaller than one global minibatch (16 = per_device_train_batch_size "
            "4 x gradient_accumulation_steps 2 x 2 processes), and dataloader_drop_last=True drops it"
        ), seen["too_small"]
        assert "dataloader_drop_last=False" in seen["too_small"]
        too_long = seen["too_long"]
        assert too_long.startswith(
            "21 of 32 training samples are longer than max_tokens_per_microbatch=16 (the longest has 35 tokens)"
        ), too_long
        for setting in ("ODCConfig(truncate=True)", "--odc_truncate true", "--truncate", "ODC_TRUNCATE=1"):
            assert setting in too_long, (setting, too_long)
        # 2 steps x (2 per device x 2 accumulation x 2 ranks): the Trainer alone would count half (it runs with 1).
        assert seen["samples"] == pytest.approx(16, rel=1e-3), seen["samples"]
        truncation = [w for w in seen["warnings"] if w.startswith("odc_hf: truncating")]
        attention = [w for w in seen["warnings"] if "packs several documents per microbatch" in w]
        expected = 1 if rank == 0 else 0  # once, on rank 0
        assert len(truncation) == expected and len(attention) == expected, (rank, seen["warnings"])
    truncation = [w for w in outcomes[0]["warnings"] if w.startswith("odc_hf: truncating")]
    assert truncation[0].startswith("odc_hf: truncating 21 of 32 training samples to max_tokens_per_microbatch=16")


def test_sft_example_stops_on_a_dataset_smaller_than_a_minibatch_and_its_summary_survives_no_logs(tmp_path):
    env = {**os.environ, **OFFLINE, "ODC_NO_RELAUNCH": "1"}

    def run(*flags):
        return subprocess.run([sys.executable, str(ROOT / "examples/sft.py"), "--output_dir", str(tmp_path), *flags],
                              env=env, capture_output=True, text=True, timeout=300)  # fmt: skip

    small = run("--num_samples", "10", "--per_device_train_batch_size", "64", "--max_steps", "3")  # the command
    assert small.returncode != 0 and "IndexError" not in small.stderr, small.stderr[-3000:]
    assert "the training dataset (10 samples) is smaller than one global minibatch (64" in small.stderr, small.stderr[-3000:]
    quiet = run("--num_samples", "8", "--per_device_train_batch_size", "2", "--max_steps", "1", "--logging_steps", "5",
                "--max_length", "128")  # fmt: skip
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert "final loss n/a (no step logged)" in quiet.stdout, quiet.stdout[-2000:]
    assert "FutureWarning" not in quiet.stderr, quiet.stderr[-3000:]  # TRL's config defaults (docs/troubleshooting.md)


def test_example_help_is_printed_once_without_launching_processes():
    for script in ("examples/sft.py", "examples/grpo.py"):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "ODC_NO_RELAUNCH")}
        proc = subprocess.run([sys.executable, str(ROOT / script), "--help"], env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.count("usage:") == 1 and "launching" not in proc.stdout, proc.stdout[:500]


def test_odc_integers_name_the_variable_and_take_k_suffixes():
    assert ODCConfig.from_env({"ODC_MAX_TOKENS_PER_MICROBATCH": "2k"}).max_tokens_per_microbatch == 2048
    assert ODCConfig.from_env({"ODC_MAX_TOKENS_PER_MICROBATCH": "32K"}).max_tokens_per_microbatch == 32768
    assert parse_count("1m") == 1 << 20 and parse_count("32_768") == 32768
    with pytest.raises(ValueError, match=r"^ODC_MAX_TOKENS_PER_MICROBATCH='2x': expected an integer such as 32768"):
        ODCConfig.from_env({"ODC_MAX_TOKENS_PER_MICROBATCH": "2x"})
    with pytest.raises(ValueError, match=r"^ODC_TIMEOUT_S='ten'"):
        ODCConfig.from_env({"ODC_TIMEOUT_S": "ten"})


def test_odc_configs_build_without_trl_default_warnings():
    from odc_hf import ODCGRPOConfig, ODCSFTConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ODCSFTConfig(output_dir="unused", report_to="none", bf16=False)
        ODCGRPOConfig(output_dir="unused", report_to="none", bf16=False)
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]


LAUNCH_CHECK = textwrap.dedent(
    """
    from odc_hf import ODCAccelerator

    ODCAccelerator()
    print("CONSTRUCTED", flush=True)
    """
)


@pytest.mark.parametrize("case", ["cpu_yaml_without_use_cpu", "fsdp1_on_cpu"])
def test_launch_mistakes_stop_with_the_fix(case, tmp_path):
    script = tmp_path / "launch_check.py"
    script.write_text(LAUNCH_CHECK)
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if case == "cpu_yaml_without_use_cpu":
        proc = accelerate_cpu(script, env={**env, "ACCELERATE_USE_CPU": "false"}, timeout=300)
        expected = "RuntimeError: 2 processes were launched (WORLD_SIZE=2) but accelerate set up each one as a single"
    else:  # accelerate's FSDP1 plugin fails first on a CPU host ("no available devices") unless odc_hf checks before
        yaml = (ROOT / "accelerate_configs/odc.yaml").read_text().replace("fsdp_version: 2", "fsdp_version: 1")
        (tmp_path / "fsdp1.yaml").write_text(yaml)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "fsdp1.yaml"),
               "--num_processes", "2", "--main_process_port", "0", str(script)]  # fmt: skip
        proc = subprocess.run(cmd, env={**os.environ, **OFFLINE, **env, "ACCELERATE_USE_CPU": "true"},
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        expected = "ValueError: odc_hf needs FSDP2: set `fsdp_version: 2` in the accelerate config's fsdp_config"
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "CONSTRUCTED" not in output, output[-3000:]
    assert expected in output, output[-3000:]  # on every rank that got there before the launcher stopped the others
    assert "no available devices" not in output
