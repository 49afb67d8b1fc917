"""The offline CPU recipe of docs/trl_recipes.md, as written: ``python -m odc_hf.offline demo`` makes the model and
data folders the recipe command names, and the command (``trl.scripts.sft`` through ``odc_hf.run`` under ``accelerate
launch``, 2 CPU processes) runs and prints ODC's metrics on every step. Before, the page named ``MODEL_DIR`` and
``DATA_DIR`` without saying how to make them, and TRL's default ``logging_steps`` printed nothing of ODC in 3 steps."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from recipe_checks import changed_tensors

ROOT = Path(__file__).resolve().parents[2]
MARK = "# the same on CPU and offline"


GRPO_MARK = "# GRPO on CPU and offline"


def _documented_commands(mark: str = MARK) -> list[str]:
    """The CPU commands of a recipe block (from ``mark`` to the block's end): one per logical line, comments dropped."""
    text = (ROOT / "docs" / "trl_recipes.md").read_text()
    block = text[text.index(mark) :].split("```", 1)[0]
    commands, current = [], ""
    for line in block.splitlines()[1:]:
        line = line.split(" # ", 1)[0].strip()
        current += " " + line.removesuffix("\\").strip()
        if not line.endswith("\\") and current.strip():
            commands.append(" ".join(current.split()))
            current = ""
    return commands


@pytest.mark.slow
def test_the_documented_offline_cpu_recipe_runs_and_shows_odc_metrics(tmp_path, monkeypatch):
    from odc_hf.offline import main

    helper, launch = _documented_commands()
    assert helper == "python -m odc_hf.offline demo", helper
    assert (
        "--model_name_or_path demo/model --dataset_name demo/data" in launch and "--logging_steps 1" in launch
    )
    monkeypatch.chdir(tmp_path)
    main(helper.split()[3:])  # in this process: the interpreter and its imports are there already
    # as written, but from this checkout and this interpreter, on a port the OS picks (parallel jobs)
    launch = launch.replace(
        "accelerate launch", f"{sys.executable} -m accelerate.commands.launch --main_process_port 0"
    )
    output = _launch_as_written(launch, tmp_path)
    logged = re.findall(
        r"\{'loss': .*?\}", output
    )  # one line per step (--logging_steps 1), ODC's metrics in it
    assert len(logged) == 3 and all("'odc/bubble_rate'" in line for line in logged), output[-3000:]
    # one progress bar per task, as with one process (the other rank draws none): before, each rank drew its own
    # (the main process writes the model twice: the Trainer's checkpoint at the last step and the recipe's save_model)
    started, saves = bars_started(output), 1 + len(list((tmp_path / "out").glob("checkpoint-*")))
    assert started.pop("Writing model shards") == saves, (started, saves)
    assert started and all(n == 1 for n in started.values()), started
    # the run's last odc_hf line: how it trained, the final loss, tokens/s and the bubble rate
    summary = [line for line in output.splitlines() if line.startswith("odc_hf summary (")]
    assert len(summary) == 1, output[-3000:]  # once, by the main process
    assert summary[0].startswith("odc_hf summary (ODC over the CPU shared-memory transport"), summary
    assert re.search(r"3 steps\): final loss [0-9.]+, tokens/s \d+, bubble rate [0-9.]+%", summary[0]), summary
    assert (tmp_path / "out" / "model.safetensors").is_file()


def bars_started(output: str) -> dict[str, int]:
    """How many progress bars each description started (tqdm's ``desc:   0%|``; ``""``: the Trainer's own bar)."""
    import collections

    return collections.Counter(m.strip() for m in re.findall(r"(?:^|[\r\n])([^\r\n|]*?):?\s+0%\|", output))


def _launch_as_written(launch: str, cwd: Path) -> str:
    """Run a documented ``accelerate launch`` line as written, but from this checkout and this interpreter, on a port
    the OS picks (parallel jobs); returns its output, after checking it exited 0."""
    launch = launch.replace(
        "accelerate launch", f"{sys.executable} -m accelerate.commands.launch --main_process_port 0"
    )
    launch = launch.replace("accelerate_configs/", f"{ROOT}/accelerate_configs/")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    proc = subprocess.run(launch, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return output


def _grpo_run(tmp_path: Path, monkeypatch, reward: str | None = None, steps: int | None = None):
    """The documented GRPO CPU block as written (``reward`` / ``steps`` replace its reward and step count for the
    control): the per-step losses and rewards it logged, its saved weights and the initial ones."""
    from recipe_checks import load_weights, logged, training_losses

    from odc_hf.offline import main

    helper, launch = _documented_commands(GRPO_MARK)
    assert helper == "python -m odc_hf.offline demo-grpo --prompts", helper
    assert "--reward_funcs odc_hf.offline.length_reward" in launch and "--max_steps 6" in launch, launch
    if reward is not None:
        launch = launch.replace("--reward_funcs odc_hf.offline.length_reward", f"--reward_funcs {reward}")
    if steps is not None:
        launch = launch.replace("--max_steps 6", f"--max_steps {steps}")
    monkeypatch.chdir(tmp_path)
    main(helper.split()[3:])
    output = _launch_as_written(launch, tmp_path)
    losses = training_losses(output, steps or 6)
    rewards = logged(output, "reward")
    saved, initial = load_weights(tmp_path / "out-grpo"), load_weights(tmp_path / "demo-grpo" / "model")
    summary = [line for line in output.splitlines() if line.startswith("odc_hf summary (")]
    # the run's last odc_hf line, with GRPO's reward (the printed logs round to 4 digits, the line to 4 decimals)
    assert len(summary) == 1, output[-3000:]
    said = re.search(r"final loss (\S+), reward (\S+), tokens/s \d+, bubble rate", summary[0])
    assert said and [float(v) for v in said.groups()] == pytest.approx([losses[-1], rewards[-1]], rel=1e-3), summary
    return losses, rewards, saved, initial


@pytest.mark.slow
def test_the_documented_grpo_recipe_trains(tmp_path, monkeypatch):
    """The documented GRPO recipe on CPU visibly trains: rewards and losses are not zero, and every saved tensor
    moved. (With a reward a random model never earns, all three are zero: the control below.)"""
    losses, rewards, saved, initial = _grpo_run(tmp_path, monkeypatch)
    print(f"losses {losses}, rewards {rewards}")
    assert len(rewards) == 6 and all(r > 0 for r in rewards), rewards
    assert all(abs(x) > 1e-2 for x in losses), losses  # GRPO's loss is 0 up to rounding on equal-length completions
    changed = changed_tensors(saved, initial)
    assert sorted(changed) == sorted(saved), f"tensors that did not move: {sorted(set(saved) - set(changed))}"


@pytest.mark.slow
def test_control_the_old_documented_reward_trains_nothing(tmp_path, monkeypatch):
    """Control of the test above: with the reward the recipe used to document (TRL's ``think_format_reward``), the
    random model earns 0 on every completion, so every advantage, loss and gradient is 0 and no weight moves: each
    of the test's three checks fails on it."""
    losses, rewards, saved, initial = _grpo_run(tmp_path, monkeypatch, reward="think_format_reward", steps=2)
    assert rewards == [0.0, 0.0] and all(abs(x) < 1e-6 for x in losses), (losses, rewards)
    assert changed_tensors(saved, initial) == []


def test_the_offline_helper_writes_conversational_prompts_for_grpo(tmp_path, monkeypatch):
    import datasets

    from odc_hf.offline import main

    monkeypatch.chdir(tmp_path)
    main(["demo", "--prompts", "--num-rows", "5"])
    rows = datasets.load_dataset(str(tmp_path / "demo" / "data"), split="train")
    assert rows.column_names == ["prompt"] and len(rows) == 5
    # TRL's conversational prompt format: a list of turns ending with the user's, which the model is to answer
    assert all([turn["role"] for turn in row["prompt"]] == ["user"] and row["prompt"][0]["content"] for row in rows)
