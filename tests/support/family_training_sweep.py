"""Every causal-LM family the definition check calls exact, trained end to end: ODCSFTTrainer (one process, packed
rows, ``attention="auto"``) against TRL's SFTTrainer (padded rows, the model's own attention) on the same
microbatches (tests/support/zoo_runs.py's CPU setting: 3 steps of 8 real-text documents of 40-96 tokens, fp32).

Each family's default config is shrunk by the definition check's own ``probe_config`` (every layer kept) and given
the offline tokenizer's vocabulary; ``--no_dropout`` sets every dropout probability of the config to 0 (default
configs with dropout differ between packed and padded rows by their random masks alone). Per family: the largest
relative difference of the logged loss, gradient norm and router loss, the largest difference of a final weight
relative to its tensor's largest element, the attention odc_hf chose, or the error either trainer stopped with.

    python tests/support/family_training_sweep.py SWEEP.json --out DIR [--families a b ...] [--no_dropout]

``SWEEP.json``: a report of ``python -m benchmarks.attention.family_sweep`` (its ``exact`` rows are trained).
Writes ``DIR/family_training_sweep.json`` after every family, and a markdown table at the end. ~45 s a family.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import time
import warnings
from pathlib import Path


def _config(name: str, no_dropout: bool):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from odc_hf.integrations.models.definition_check import probe_config

    base = probe_config(CONFIG_MAPPING[name]())

    def make(token_ids: dict):
        config = copy.deepcopy(base)
        for key in ("vocab_size", "pad_token_id", "eos_token_id", "bos_token_id"):
            try:
                setattr(config, key, token_ids[key])
            except Exception:  # noqa: BLE001 - a field the config types strictly (no None): kept
                pass
        if no_dropout:
            for key, value in list(vars(config).items()):
                if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                    setattr(config, key, 0.0)
        return config

    return make


def train(name: str, out: Path, no_dropout: bool) -> dict:
    import torch
    import zoo_runs

    zoo_runs.FAMILIES[name] = zoo_runs.Family(name, _config(name, no_dropout))
    trl = zoo_runs.trl_run(name, out / f"{name}_trl")
    odc = zoo_runs.odc_run([name], str(out / "odc"), 1)[name]
    ours = torch.load(out / "odc" / name / zoo_runs.FINAL_WEIGHTS)
    theirs = torch.load(out / f"{name}_trl" / zoo_runs.FINAL_WEIGHTS)
    weights = math.inf if ours.keys() != theirs.keys() else max(
        float((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max().clamp(min=1e-30)) for k in theirs)  # fmt: skip
    return {"history": zoo_runs.largest_difference(odc["history"], trl), "weights": weights,
            "attention": odc["attention"].get("implementation"),
            "losses": [[h["loss"] for h in odc["history"]], [h["loss"] for h in trl]]}  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path, help="a family_sweep JSON report")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--families", nargs="*", help="these families only (default: every exact row)")
    parser.add_argument("--no_dropout", action="store_true", help="every dropout probability of the configs at 0")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch

    torch.set_num_threads(1)
    rows = json.loads(args.sweep.read_text())["rows"]
    names = args.families or [name for name, row in rows.items() if row["result"] == "exact"]
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            results[name] = train(name, args.out, args.no_dropout)
        except Exception as error:  # noqa: BLE001 - recorded per family
            results[name] = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
        results[name]["seconds"] = time.perf_counter() - start
        print(name, results[name], flush=True)
        (args.out / "family_training_sweep.json").write_text(json.dumps(results, indent=1))
    lines = ["| family | loss / grad norm / aux | final weights | attention | error |", "|---|---|---|---|---|"]
    for name, row in results.items():
        lines.append(f"| {name} | {row.get('history', math.nan):.1e} | {row.get('weights', math.nan):.1e} | "
                     f"{row.get('attention') or ''} | {(row.get('error') or '').replace('|', '/')[:160]} |")  # fmt: skip
    (args.out / "family_training_sweep.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
