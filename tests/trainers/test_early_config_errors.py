"""Configuration mistakes stop early, with the setting's name (issue 29, defect 6): before the ranks load a model or
tokenize where they can be checked then, and nothing that is not wrong is reported."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from odc_hf.config import ODCConfig
from odc_hf.testing import run_ranks

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1"])
def test_timeouts_that_never_or_always_expire_are_refused(value):
    # NaN passed the old `timeout_s <= 0` check (every comparison with NaN is False): a barrier would never time out
    with pytest.raises(ValueError, match=r"timeout_s must be a finite number of seconds > 0 \(ODC_TIMEOUT_S"):
        ODCConfig.from_env({"ODC_TIMEOUT_S": value})


def test_finite_settings_are_accepted_and_nan_memory_is_not():
    assert ODCConfig.from_env({"ODC_TIMEOUT_S": "5"}).timeout_s == 5.0
    with pytest.raises(ValueError, match="device_memory_gib must be a finite number > 0, got nan"):
        ODCConfig(device_memory_gib=float("nan"))


def test_a_missing_shm_dir_is_named_when_the_config_is_made(tmp_path):
    with pytest.raises(ValueError, match=r"shm_dir '/nonexistent' \(ODC_SHM_DIR, --odc_shm_dir\) is not an existing"):
        ODCConfig.from_env({"ODC_SHM_DIR": "/nonexistent"})
    assert ODCConfig.from_env({"ODC_SHM_DIR": str(tmp_path)}).shm_dir == str(tmp_path)


def _run(*args, env=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    return subprocess.run([sys.executable, "-m", "odc_hf.run", *args], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_odc_hf_run_checks_its_target_and_the_odc_variables_before_running_anything():
    missing = _run("trl.scripts.sftt", "--output_dir", "x")
    assert missing.returncode != 0 and "odc_hf.run: no module 'trl.scripts.sftt' to run" in missing.stderr
    assert "Traceback" not in missing.stderr, missing.stderr
    script = _run("no_such_script.py")
    assert script.returncode != 0 and "odc_hf.run: no script 'no_such_script.py'" in script.stderr
    # the target would run (json.tool reads stdin) if the variables were read only where the trainer is built
    budget = _run("json.tool", env={"ODC_MAX_TOKENS_PER_MICROBATCH": "0"})
    assert budget.returncode != 0, budget.stdout
    assert "odc_hf.run: max_tokens_per_microbatch must be a positive integer, got 0" in budget.stderr, budget.stderr


def test_odc_hf_run_says_when_its_target_trains_without_odc(tmp_path):
    from odc_hf.run import check_target, names_nothing_of_odc

    def unnamed(target: str) -> bool:
        return names_nothing_of_odc(check_target(target))

    # TRL's recipes name the one trainer they build: SFT and GRPO are the ones odc_hf.run replaces
    assert not unnamed("trl.scripts.sft") and not unnamed("trl.scripts.grpo")
    assert unnamed("trl.scripts.dpo") and unnamed("trl.scripts.reward")
    assert not unnamed(str(ROOT / "examples" / "own_loop.py"))  # an ODCAccelerator, no trainer
    assert check_target("pip").endswith(os.path.join("pip", "__main__.py"))  # a package runs its __main__
    plain = tmp_path / "plain.py"
    plain.write_text("print('trained something')\n")
    proc = _run(str(plain))
    assert proc.returncode == 0 and proc.stdout == "trained something\n", proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("odc_hf.run:")]
    assert len(lines) == 2, proc.stderr
    assert "names neither TRL's SFTTrainer or GRPOTrainer (the trainers odc_hf.run replaces) nor odc_hf" in lines[0]
    assert f"odc_hf.run: {plain} set up no accelerator for ODC" in lines[1] and "it ran without ODC" in lines[1]
    # a script that builds an ODC trainer under a name the source check cannot read: only the behavioural check
    # speaks, and it counts the trainer (no end line)
    builder = tmp_path / "builder.py"
    builder.write_text(textwrap.dedent("""
        import importlib
        from transformers import TrainingArguments
        package = importlib.import_module("odc" + "_hf")
        data = importlib.import_module("odc" + "_hf.testing.data")
        tokenizer = data.default_tokenizer()
        getattr(package, "ODC" + "Trainer")(
            model=data.tiny_qwen2_model(tokenizer), processing_class=tokenizer,
            args=TrainingArguments(output_dir="out", report_to="none", use_cpu=True),
            train_dataset=data.default_tokenized_dataset(tokenizer, 4))
    """))
    proc = _run(str(builder), env={"ACCELERATE_USE_CPU": "true"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("odc_hf.run:")]
    assert len(lines) == 1 and "names neither" in lines[0], proc.stderr[-3000:]


def test_odc_keys_in_an_fsdp_config_are_refused_with_where_they_go(tmp_path, monkeypatch):
    from transformers import TrainingArguments

    from odc_hf import ODCTrainer
    from odc_hf.integrations.accelerate.refusals import check_fsdp_config
    from odc_hf.testing.data import default_tokenized_dataset, default_tokenizer, tiny_qwen2_model

    check_fsdp_config({"version": 2, "reshard_after_forward": True}, "x")  # accelerate's own keys: fine
    with pytest.raises(ValueError, match=r"'fsdp_odc_balance', which accelerate ignores.*ODC_BALANCE="):
        check_fsdp_config({"fsdp_odc_balance": "lb_micro"}, "x")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    tokenizer = default_tokenizer()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                             fsdp_config={"odc_max_tokens_per_microbatch": 64})  # fmt: skip
    with pytest.raises(ValueError, match=r"the training arguments' fsdp_config has 'odc_max_tokens_per_microbatch'"):
        ODCTrainer(model=tiny_qwen2_model(tokenizer), args=args,
                   train_dataset=default_tokenized_dataset(tokenizer, 4, max_length=32))  # fmt: skip


def test_auto_find_batch_size_is_turned_off_with_the_setting_that_bounds_memory(tmp_path, monkeypatch, caplog):
    """transformers' auto_find_batch_size halves the batch size after an out-of-memory error and trains on: under ODC
    the token budget, not the batch size, sets a microbatch's memory, and the batch size is what is trained."""
    from transformers import TrainingArguments

    from odc_hf import ODCTrainer
    from odc_hf.testing.data import default_tokenized_dataset, default_tokenizer, tiny_qwen2_model

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    tokenizer = default_tokenizer()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", auto_find_batch_size=True,
                             max_steps=1)  # fmt: skip
    with caplog.at_level("WARNING", logger="odc_hf"):
        trainer = ODCTrainer(model=tiny_qwen2_model(tokenizer), args=args, processing_class=tokenizer,
                             train_dataset=default_tokenized_dataset(tokenizer, 8, max_length=32))  # fmt: skip
    assert args.auto_find_batch_size  # the user's arguments stay as they were made
    assert trainer.args.auto_find_batch_size is False  # what Trainer.train reads
    assert "auto_find_batch_size=True is turned off" in caplog.text and "max_tokens_per_microbatch" in caplog.text
    # an out-of-memory error in training is the user's to see, not a silent restart on a smaller batch
    calls = []

    def out_of_memory(*a, **k):
        calls.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(trainer, "training_step", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        trainer.train()
    assert calls == [1]


def test_odc_keys_in_the_launch_yaml_are_refused_on_every_rank(tmp_path):
    """accelerate launch copies only the fsdp_config keys it knows into the ranks' environment; odc_hf reads the YAML
    named on the launcher's command line (the rank's parent process). A stand-in launcher, to stay cheap."""
    config = tmp_path / "my.yaml"
    config.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  odc_balance: lb_micro\n")
    rank = textwrap.dedent("""
        from odc_hf.integrations.accelerate.refusals import check_launch_before_accelerate
        check_launch_before_accelerate()
    """)
    launcher = textwrap.dedent(f"""
        import os, subprocess, sys
        env = dict(os.environ, LOCAL_RANK="0")
        sys.exit(subprocess.run([sys.executable, "-c", {rank!r}], env=env).returncode)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", launcher, "launch", "--config_file", str(config)], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0
    assert re.search(r"fsdp_config in the accelerate config '.*my.yaml' has 'odc_balance'", proc.stderr), proc.stderr
    config.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n")
    clean = subprocess.run([sys.executable, "-c", launcher, "launch", "--config_file", str(config)], env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert clean.returncode == 0, clean.stderr


def _collective_run(rank, world, output_dir):
    from datasets import Dataset
    from fsdp_helpers import tiny_qwen2
    from transformers import TrainingArguments

    from odc_hf import ODCTrainer

    args = TrainingArguments(output_dir=output_dir, max_steps=1, per_device_train_batch_size=2, use_cpu=True,
                             report_to="none", disable_tqdm=True, save_strategy="no", logging_steps=1)  # fmt: skip
    data = Dataset.from_dict({"input_ids": [[5, 6, 7, 8, 9, 10]] * 8})
    trainer = ODCTrainer(model=tiny_qwen2(), args=args, train_dataset=data,
                         odc_config=ODCConfig(enabled=False, balance="lb_micro", log_timeline=False))  # fmt: skip
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return dict(getattr(trainer, "odc_summary", {})), logged


def test_a_collective_run_reports_no_bubble_rate(tmp_path):
    (summary, logged), _ = run_ranks(_collective_run, 2, str(tmp_path), env={"ACCELERATE_USE_CPU": "true"})
    assert "odc/tokens_per_s" in summary, summary
    assert "odc/bubble_rate" not in summary and all("odc/bubble_rate" not in h for h in logged), (summary, logged)


def test_the_quickstart_script_uses_the_quiet_config():
    text = (ROOT / "docs/quickstart.md").read_text()
    block = re.search(r"```python\n(# my_sft\.py.*?)```", text, re.S).group(1)
    assert "from trl import SFTConfig" not in block and "ODCSFTConfig(" in block
    config_part = block[: block.index("trainer = ")]  # imports, tokenizer, model, data, config: no launch needed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(config_part, "quickstart", "exec"), {})  # builds the config only: writes nothing
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]
