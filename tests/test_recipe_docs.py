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

ROOT = Path(__file__).resolve().parents[1]
MARK = "# the same on CPU and offline"


def _documented_commands() -> list[str]:
    """The CPU commands of the recipe block (from MARK to the block's end): one per logical line, comments dropped."""
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
    launch = launch.replace("accelerate_configs/", f"{ROOT}/accelerate_configs/")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    proc = subprocess.run(
        launch, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    logged = re.findall(
        r"\{'loss': .*?\}", output
    )  # one line per step (--logging_steps 1), ODC's metrics in it
    assert len(logged) == 3 and all("'odc/bubble_rate'" in line for line in logged), output[-3000:]
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_the_offline_helper_writes_conversational_prompts_for_grpo(tmp_path, monkeypatch):
    import datasets

    from odc_hf.offline import main

    monkeypatch.chdir(tmp_path)
    main(["demo", "--prompts", "--num-rows", "5"])
    rows = datasets.load_dataset(str(tmp_path / "demo" / "data"), split="train")
    assert rows.column_names == ["prompt"] and len(rows) == 5
    # TRL's conversational prompt format: a list of turns ending with the user's, which the model is to answer
    assert all([turn["role"] for turn in row["prompt"]] == ["user"] and row["prompt"][0]["content"] for row in rows)
