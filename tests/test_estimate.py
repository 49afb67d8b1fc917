"""``python -m odc_hf.estimate`` end to end: the printed numbers are the simulation core's, and bad input is named."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from odc_hf.balance.cluster import Cluster
from odc_hf.balance.simulate import h200_overheads, load_cost_model, plan_steps, step_times, summarize
from odc_hf.estimate import THRESHOLD, model_shape, run
from odc_hf.estimate_data import EstimateError

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(
    r"^  (\S.*?)\s{2,}(\d+\.\d{3})(?:\s+(\d+\.\d{3})x)?(?:\s+(\d+\.\d)%\s+(\d+\.\d{3})\s+(\d+\.\d{3}))?$"
)


def run_cli(*args) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "odc_hf.estimate", *args], capture_output=True, text=True,
                          env=env, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def parse(stdout: str) -> list[dict[str, tuple]]:
    """Each cluster section's rows: label -> (step s, speedup or None, bubble %, comm s, optimizer s)."""
    sections: list[dict[str, tuple]] = []
    for line in stdout.splitlines():
        if re.match(r"^\d+ nodes? x \d+ GPUs", line):
            sections.append({})
        elif sections and (m := ROW.match(line)):
            sections[-1][m.group(1).strip()] = tuple(None if g is None else float(g) for g in m.groups()[1:])
    return sections


def expected(lengths, *, per_rank, budget, gpus_per_node, nodes, model="1.5B"):
    shape = model_shape(model)
    cost_model, _ = load_cost_model("h200", shape)
    out = []
    for n in (1, nodes):
        cluster = Cluster(gpus_per_node=gpus_per_node, num_nodes=n)
        steps = plan_steps(lengths, cluster.world_size, per_rank, budget, cost_model)
        out.append(summarize(step_times(steps, shape, cluster, h200_overheads())))
    return out


def check(rows: dict, summary: dict, labels: dict):
    for name, label in labels.items():
        step, speedup, bubble, comm, overhead = rows[label]
        part = summary[name]
        assert step == pytest.approx(part["total_s"], abs=5e-4)
        assert bubble == pytest.approx(100 * part["bubble"], abs=0.05)
        assert comm == pytest.approx(part["comm_s"], abs=5e-4)
        assert overhead == pytest.approx(part["overhead_s"], abs=5e-4)
        if name != "odc_hsdp":
            assert speedup == pytest.approx(summary[f"speedup_vs_{name}"], abs=5e-4)
    assert rows["balance bound"][0] == pytest.approx(summary["bound_s"], abs=5e-4)


def test_lengths_file_end_to_end(tmp_path):
    rng = np.random.default_rng(3)
    lengths = np.clip(rng.lognormal(np.log(9000), 0.8, 96), 200, 40000).astype(np.int64)
    path = tmp_path / "lengths.txt"
    path.write_text("# token counts\n" + "\n".join(map(str, lengths)) + "\n")
    args = ["--lengths", str(path), "--gpus-per-node", "4", "--nodes", "2", "--per-device-train-batch-size", "2",
            "--gradient-accumulation-steps", "2", "--max-tokens", "16384", "--json", str(tmp_path / "out.json")]  # fmt: skip
    stdout = run_cli(*args)
    single, multi = parse(stdout)
    want = expected(lengths, per_rank=4, budget=16384, gpus_per_node=4, nodes=2)
    check(single, want[0], {"fsdp2_hsdp": "FSDP2 + LB-Micro", "odc_hsdp": "ODC + LB-Mini"})
    check(multi, want[1], {"fsdp2_full": "FSDP2 full sharding + LB-Micro", "fsdp2_hsdp": "FSDP2 HSDP + LB-Micro",
                           "odc_hsdp": "ODC HSDP + LB-Mini"})  # fmt: skip
    assert f"{(lengths > 16384).sum()} longer than the budget, clipped" in stdout
    saved = json.loads((tmp_path / "out.json").read_text())
    best = min(want[1]["fsdp2_full"]["total_s"], want[1]["fsdp2_hsdp"]["total_s"])
    base = "fsdp2_full" if best == want[1]["fsdp2_full"]["total_s"] else "fsdp2_hsdp"
    assert saved["verdict"]["speedup"] == pytest.approx(want[1][f"speedup_vs_{base}"])
    verdict = "worth it" if saved["verdict"]["speedup"] >= THRESHOLD else "NOT worth it"
    assert f"verdict: ODC is {verdict} for this data" in stdout
    assert f"predicted {saved['verdict']['speedup']:.3f}x as fast" in stdout


def test_local_jsonl_with_the_default_tokenizer(tmp_path):
    from odc_hf.data import default_documents, default_tokenizer

    docs = [d[:6000] for d in default_documents(48, seed=1)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    stdout = run_cli("--dataset", str(path), "--tokenizer", "default", "--gpus-per-node", "2", "--nodes", "2",
                     "--gradient-accumulation-steps", "3")  # fmt: skip
    tok = default_tokenizer()
    lengths = np.array([len(ids) for ids in tok([d + tok.eos_token for d in docs])["input_ids"]])
    budget = int(lengths.max())  # the default budget: the longest sample
    assert f"median {int(np.median(lengths)):,} tokens" in stdout and f"max {budget:,}" in stdout
    single, multi = parse(stdout)
    want = expected(lengths, per_rank=3, budget=budget, gpus_per_node=2, nodes=2)
    check(single, want[0], {"fsdp2_hsdp": "FSDP2 + LB-Micro", "odc_hsdp": "ODC + LB-Mini"})
    check(multi, want[1], {"fsdp2_hsdp": "FSDP2 HSDP + LB-Micro", "odc_hsdp": "ODC HSDP + LB-Mini"})


def test_bad_input_is_named(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("100\n2k\n")
    with pytest.raises(EstimateError, match=r"line 2: '2k' is not a token count"):
        run(["--lengths", str(bad)])
    with pytest.raises(EstimateError, match="exactly one of --lengths"):
        run([])
    few = tmp_path / "few.json"
    few.write_text(json.dumps({"lengths": [100, 200, 300]}))
    with pytest.raises(EstimateError, match="do not fill one step"):
        run(["--lengths", str(few), "--nodes", "1"])
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"body": "x"}\n')
    with pytest.raises(EstimateError, match=r"pass --column NAME"):
        run(["--dataset", str(rows), "--tokenizer", "default"])
    with pytest.raises(EstimateError, match="needs --tokenizer"):
        run(["--dataset", str(rows)])
    with pytest.raises(EstimateError, match="no such file"):
        run(["--dataset", str(tmp_path / "missing.parquet"), "--tokenizer", "default"])
    with pytest.raises(EstimateError, match="--cost-model"):
        run(["--lengths", str(few), "--cost-model", "tokens"])
