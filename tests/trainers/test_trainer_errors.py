"""Setups odc_hf cannot serve fail with a message saying what to change; a single process trains without ODC."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from odc_hf.config import ODCConfig
from odc_hf.integrations.accelerate.refusals import check_supported
from odc_hf.integrations.trainer.mixin import ODCMixin

ROOT = Path(__file__).resolve().parents[2]


def _fake_accelerator(kind, version=2):
    plugin = SimpleNamespace(fsdp_version=version)
    return SimpleNamespace(
        distributed_type=kind, state=SimpleNamespace(fsdp_plugin=plugin), parallelism_config=None
    )


def test_fsdp1_deepspeed_and_ddp_configs_are_refused():
    with pytest.raises(ValueError, match="fsdp_version: 2"):
        check_supported(_fake_accelerator(DistributedType.FSDP, version=1))
    with pytest.raises(ValueError, match="does not support"):
        check_supported(_fake_accelerator(DistributedType.DEEPSPEED))
    with pytest.raises(ValueError, match="FSDP2 config"):
        check_supported(_fake_accelerator(DistributedType.MULTI_GPU))
    check_supported(_fake_accelerator(DistributedType.FSDP))  # FSDP2: fine
    check_supported(_fake_accelerator(DistributedType.MULTI_CPU))  # CPU: odc_hf shards itself


def test_iterable_dataset_is_refused():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield {"input_ids": [1, 2, 3]}

    with pytest.raises(ValueError, match="map-style dataset"):
        ODCMixin.get_train_dataloader(SimpleNamespace(train_dataset=Stream()))


def test_config_validation_and_environment():
    with pytest.raises(ValueError, match="collectives cannot run"):
        ODCConfig(enabled=False, balance="lb_mini")
    with pytest.raises(ValueError, match="balance must be one of"):
        ODCConfig(balance="fastest")
    config = ODCConfig.from_env({"ODC_BALANCE": "lb_micro", "ODC_TIMEOUT_S": "5", "ODC_ENABLED": "false"})
    assert (config.balance, config.timeout_s, config.enabled) == ("lb_micro", 5.0, False)
    assert ODCConfig.from_env({"ODC_BALANCE": "none"}, balance="lb_mini").balance == "lb_mini"
    with pytest.raises(ValueError, match="not a boolean"):
        ODCConfig.from_env({"ODC_ENABLED": "maybe"})


@pytest.mark.slow
def test_single_process_trains_without_odc_with_a_notice(tmp_path):
    env = {**os.environ, "ODC_NO_RELAUNCH": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(ROOT / "examples/sft.py"), "--max_steps", "3", "--num_samples", "32",
           "--max_length", "256", "--output_dir", str(tmp_path), "--losses_json", str(tmp_path / "losses.json")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "single process has nothing to communicate" in proc.stderr
    assert "odc_hf summary (single process, no ODC, lb_mini, 1 processes, 3 steps)" in proc.stdout, proc.stdout[-2000:]
    record = json.loads((tmp_path / "losses.json").read_text())
    losses = [h["loss"] for h in record["history"]]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert all(len(step["microbatches"]) == 1 for step in record["steps"])  # one rank, on the same bundle path


def test_private_trainer_hooks_odc_hf_overrides_exist():
    # odc_hf/integrations/upstream/transformers.py lists the private Trainer methods odc_hf overrides or calls.
    from transformers import Trainer

    from odc_hf.integrations.upstream.transformers import TRAINER_HOOKS

    assert all(callable(getattr(Trainer, name, None)) for name in TRAINER_HOOKS)


def test_odc_options_from_trainer_arguments():
    from transformers import HfArgumentParser

    from odc_hf import ODCSFTConfig, ODCTrainingArguments
    from odc_hf.integrations.trainer.arguments import odc_config_from_args

    (args,) = HfArgumentParser(ODCTrainingArguments).parse_args_into_dataclasses(
        [
            "--output_dir",
            "out_unused",
            "--odc_balance",
            "lb_micro",
            "--odc_max_tokens_per_microbatch",
            "4096",
            "--report_to",
            "none",
        ]  # fmt: skip
    )
    config = odc_config_from_args(args, environ={"ODC_TIMEOUT_S": "12", "ODC_BALANCE": "none"})
    assert (config.balance, config.max_tokens_per_microbatch, config.timeout_s) == ("lb_micro", 4096, 12.0)
    sft = ODCSFTConfig(
        output_dir="out_unused", odc_enabled=False, odc_balance="lb_micro", report_to="none", bf16=False
    )
    assert odc_config_from_args(sft, environ={}).enabled is False
    assert "ODC:" in ODCTrainingArguments.__dataclass_fields__["odc_balance"].metadata["help"]
