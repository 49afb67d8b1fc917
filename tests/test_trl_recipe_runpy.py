"""TRL's own SFT recipe module (trl.scripts.sft), unmodified, runs with ODC through the runpy launcher:
`accelerate launch ... -m odc_hf.run trl.scripts.sft ...` on CPU with 2 processes, offline. It trains (finite,
falling losses, ODC's step metrics in the log) and its final save is the full trained model."""

from __future__ import annotations

import ast
import math

import pytest
import torch

from odc_hf.testing import accelerate_cpu, local_model_and_data


def logged(out: str) -> list[dict]:
    """The Trainer's per-step log lines ({'loss': ..., ...}) as dicts."""
    rows = []
    for line in out.splitlines():
        if "{'loss'" in line:
            start = line.index("{'loss'")
            rows.append(ast.literal_eval(line[start : line.index("}", start) + 1]))
    return rows


def mean_loss(model, docs: list[list[int]]) -> float:
    with torch.no_grad():
        return sum(float(model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss) for ids in docs) / len(docs)


@pytest.mark.slow
def test_trl_sft_recipe_runs_with_odc(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from odc_hf.data import default_documents

    docs = [d[:3000] for d in default_documents(64) if len(d) > 200]
    model_dir, data_dir = local_model_and_data(tmp_path, [{"text": d} for d in docs])
    args = ["-m", "odc_hf.run", "trl.scripts.sft",
           "--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir), "--output_dir", str(tmp_path / "out"),
           "--max_steps", "4", "--per_device_train_batch_size", "4", "--max_length", "512", "--packing", "false",
           "--learning_rate", "1e-3", "--report_to", "none", "--logging_steps", "1", "--save_strategy", "no",
           "--dtype", "float32", "--bf16", "false"]  # fmt: skip
    proc = accelerate_cpu(*args, env={"ODC_MAX_TOKENS_PER_MICROBATCH": "2048"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    rows = logged(out)
    assert len(rows) == 4, out[-3000:]
    assert all("odc/bubble_rate" in r for r in rows)  # the ODC trainer (not TRL's) ran: its step metrics
    losses = [float(r["loss"]) for r in rows]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.05, losses
    # The recipe's final save_model(): the whole model (not one rank's shard), trained: it predicts the training
    # text better than the initial weights do.
    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    before, after = initial.state_dict(), trained.state_dict()
    assert {k: v.shape for k, v in after.items()} == {k: v.shape for k, v in before.items()}
    assert all(torch.isfinite(v).all() for v in after.values())
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    sample = [tokenizer(d, add_special_tokens=False)["input_ids"][:256] for d in docs[:4]]
    assert mean_loss(trained, sample) < mean_loss(initial, sample) - 0.05
