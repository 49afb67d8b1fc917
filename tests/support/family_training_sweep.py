"""Every causal-LM family the definition check calls exact, trained end to end: ODCSFTTrainer (one process, packed
rows, ``attention="auto"``) against TRL's SFTTrainer (padded rows, the model's own attention) on the same
microbatches (tests/support/zoo_runs.py's CPU setting: 3 steps of 8 real-text documents of 40-96 tokens, fp32).

Each family's default config is shrunk by the definition check's own ``probe_config`` (every layer kept) and given
the offline tokenizer's vocabulary; ``--no_dropout`` sets every dropout probability of the config to 0 (default
configs with dropout differ between packed and padded rows by their random masks alone). Per family: the largest
relative difference of the logged loss, gradient norm and router loss, the largest difference of a final weight
relative to its tensor's largest element, the attention odc_hf chose, and the error either trainer stopped with (each
trainer runs whatever the other did, so a family TRL cannot train still shows whether odc_hf refuses it by name).
``--grpo``: ODCGRPOTrainer's packed layout against TRL's GRPOTrainer on fixed rollouts instead (:func:`train_grpo`).

    python tests/support/family_training_sweep.py SWEEP.json --out DIR [--families a b ...] [--no_dropout] [--grpo]
    # two processes, then one report:
    python tests/support/family_training_sweep.py SWEEP.json --out A --shard 0/2 &
    python tests/support/family_training_sweep.py SWEEP.json --out B --shard 1/2
    python tests/support/family_training_sweep.py SWEEP.json --out DIR --merge A/family_training_sweep.json B/family_training_sweep.json

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
        if isinstance(getattr(config, "vocab_size_per_layer_input", None), int):  # Gemma 3n / 4: as their releases
            config.vocab_size_per_layer_input = token_ids["vocab_size"]
        if no_dropout:
            for key, value in list(vars(config).items()):
                if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                    setattr(config, key, 0.0)
        return config

    return make


TOLERANCE = 1e-5
"""Largest relative difference of the logged loss, gradient norm and router loss counted as float noise (the zoo's)."""


def _odc_error(error: Exception) -> bool:
    """An error odc_hf raised on purpose: a refusal that names what it refuses (not a crash inside the run)."""
    from odc_hf.integrations.models.definition_check import DefinitionMismatch

    return isinstance(error, DefinitionMismatch) or (isinstance(error, ValueError) and "odc_hf" in str(error))


def _run_both(run_trl, run_odc) -> tuple:
    """(TRL's result or None, odc_hf's or None, the row so far): both runs, each whatever the other did; when odc_hf's
    stops, the row's ``result`` says how (:func:`train`)."""
    row: dict = {}
    try:
        trl = run_trl()
    except Exception as error:  # noqa: BLE001 - recorded
        trl, row["trl_error"] = None, f"{type(error).__name__}: {str(error)[:300]}"
    try:
        return trl, run_odc(), row
    except Exception as error:  # noqa: BLE001 - recorded
        row["odc_error"] = f"{type(error).__name__}: {str(error)[:400]}"
        row["result"] = "refused" if _odc_error(error) else ("trl_fails" if trl is None else "error")
        return trl, None, row


def train(name: str, out: Path, no_dropout: bool) -> dict:
    """Both trainers on ``name``, each run whatever the other did; the row's ``result``: ``exact`` (within
    :data:`TOLERANCE`), ``chaotic`` (beyond it, but TRL against itself in microbatches of one is too, and the first
    step agrees within it), ``differs`` (both trained, beyond it), ``refused`` (odc_hf refused by name), ``trl_fails`` (TRL's
    own trainer stops; odc_hf's outcome kept), or ``error`` (odc_hf stopped with an error that is not a refusal)."""
    import torch
    import zoo_runs

    from odc_hf.testing.data import default_tokenizer

    zoo_runs.FAMILIES[name] = zoo_runs.Family(name, _config(name, no_dropout))
    trl, odc, row = _run_both(lambda: zoo_runs.trl_run(name, out / f"{name}_trl"),
                              lambda: zoo_runs.odc_run([name], str(out / "odc"), 1)[name])  # fmt: skip
    if odc is None:
        return row
    row["attention"] = odc["attention"].get("implementation")
    if trl is None:
        row["result"] = "trl_fails"
        return row
    ours = torch.load(out / "odc" / name / zoo_runs.FINAL_WEIGHTS)
    theirs = torch.load(out / f"{name}_trl" / zoo_runs.FINAL_WEIGHTS)
    weights = math.inf if ours.keys() != theirs.keys() else max(
        float((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max().clamp(min=1e-30)) for k in theirs)  # fmt: skip
    history = zoo_runs.largest_difference(odc["history"], trl)
    row.update(history=history, weights=weights, result="exact" if history <= TOLERANCE else "differs",
               losses=[[h["loss"] for h in odc["history"]], [h["loss"] for h in trl]])  # fmt: skip
    if row["result"] == "differs":
        # the control: TRL against itself on the same documents in microbatches of one (the same sums, another
        # order). Where that moves the run beyond the tolerance too, the training is chaotic (3 AdamW steps amplify
        # rounding), and only the first step (before any update) can be compared
        again = zoo_runs.trl_run(name, out / f"{name}_trl_micro1", per_device_train_batch_size=1,
                                 gradient_accumulation_steps=zoo_runs.MINIBATCH)  # fmt: skip
        row.update(trl_spread=zoo_runs.largest_difference(again, trl),
                   first_step=zoo_runs.largest_difference(odc["history"][:1], trl[:1]))  # fmt: skip
        if row["trl_spread"] > TOLERANCE and row["first_step"] <= TOLERANCE:
            row["result"] = "chaotic"
        row["known"] = _known_causes(zoo_runs.build(name, default_tokenizer()))
    return row


def train_grpo(name: str, out: Path, no_dropout: bool) -> dict:
    """:func:`train` for GRPO: ODCGRPOTrainer's packed layout against TRL's GRPOTrainer on the same fixed rollouts
    (tests/support/zoo_runs.py's ``grpo_run``: 2 steps, 8 rows each, a reward that varies), comparing the logged loss,
    gradient norm, router loss and entropy. TRL's run counts as failed when it logs NaN. Where the two differ: how much
    TRL's left-padded rows change the model (:func:`_left_padding_effect`), and, when the first step agrees (and no
    router loss, which depends on the microbatch), each trainer against itself in several microbatches (``chaotic``
    when either moves as much as the difference, or beyond 10x the tolerance)."""
    import zoo_runs

    from odc_hf.testing.data import default_tokenizer

    zoo_runs.FAMILIES[name] = zoo_runs.Family(name, _config(name, no_dropout))
    trl, odc, row = _run_both(lambda: zoo_runs.grpo_run(name, out / f"{name}_grpo_trl", "trl"),
                              lambda: zoo_runs.grpo_run(name, out / f"{name}_grpo_odc", "odc"))  # fmt: skip
    if odc is None:
        return row
    row.update(attention=odc["attention"].get("implementation"), packed=odc["packed"])
    if trl is not None and not _finite(trl["history"]):
        trl, row["trl_error"] = None, f"TRL's GRPOTrainer logged NaN or nothing: {trl['history']}"
    if trl is None:
        row["result"] = "trl_fails"
        return row
    keys = ("loss", "grad_norm", "aux_loss", "entropy")
    history = zoo_runs.largest_difference(odc["history"], trl["history"], keys)
    row.update(history=history, first_step=zoo_runs.largest_difference(odc["history"][:1], trl["history"][:1], keys),
               result="exact" if history <= TOLERANCE else "differs",
               losses=[[h["loss"] for h in odc["history"]], [h["loss"] for h in trl["history"]]])  # fmt: skip
    if row["result"] == "differs":
        model = zoo_runs.build(name, default_tokenizer())
        causes = [cause for cause in (_known_causes(model),) if cause]
        row["left_padding"] = _left_padding_effect(model)
        if row["left_padding"] > TOLERANCE:  # TRL's rows put the prompt's padding on the left
            causes.append(f"TRL's left-padded rows change this model's gradient by {row['left_padding']:.1e} "
                          "(a batch of left-padded rows vs each row alone)")  # fmt: skip
        if row["first_step"] <= TOLERANCE and "aux_loss" not in trl["history"][0]:
            # the controls: TRL against itself in two microbatches of 4 rows (the same sums in another order),
            # and odc_hf against itself in several packed microbatches
            again = zoo_runs.grpo_run(name, out / f"{name}_grpo_trl_split", "trl", split=True)
            row["trl_spread"] = zoo_runs.largest_difference(again["history"], trl["history"], keys)
            again = zoo_runs.grpo_run(name, out / f"{name}_grpo_odc_split", "odc", split=True)
            row["odc_spread"] = zoo_runs.largest_difference(again["history"], odc["history"], keys)
            if max(row["trl_spread"], row["odc_spread"]) >= min(history, 10 * TOLERANCE):
                row["result"] = "chaotic"
        row["known"] = "; ".join(causes)
    return row


def _finite(history: list[dict]) -> bool:
    return bool(history) and all(isinstance(h.get(k), float) and math.isfinite(h[k]) for h in history
                                 for k in ("loss", "grad_norm"))  # fmt: skip


def _left_padding_effect(model) -> float:
    """Relative difference of the gradient of three rows' token log-likelihoods, in one left-padded batch (with its
    attention mask, as TRL's GRPOTrainer builds its rows) vs each row alone: 0 up to rounding for a model that padding
    does not change."""
    import torch

    def gradient(batches) -> torch.Tensor:
        model.zero_grad()
        for ids, mask in batches:
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            likely = logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
            (likely * mask[:, 1:] * mask[:, :-1]).sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        rows = [torch.randint(3, model.config.vocab_size, (n,)) for n in (50, 35, 20)]
    model.eval()  # no dropout: padding alone
    alone = gradient([(r[None], torch.ones(1, len(r), dtype=torch.long)) for r in rows])
    width, pad = max(len(r) for r in rows), model.config.pad_token_id or 0
    ids = torch.stack([torch.cat([torch.full((width - len(r),), pad), r]) for r in rows])
    mask = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), torch.ones(len(r), dtype=torch.long)])
                        for r in rows])  # fmt: skip
    padded = gradient([(ids, mask)])
    model.zero_grad()
    return float((padded - alone).norm() / alone.norm())


def _known_causes(model) -> str:
    """Causes of a difference to TRL that are not odc_hf training another model: dropout's random masks, and TRL's
    loss normaliser on classes transformers' Trainer does not count as causal LMs (tests/models/test_loss_normaliser.py)."""
    causes = [f"dropout ({k}={v})" for k, v in vars(model.config).items()
              if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0]  # fmt: skip
    if getattr(model, "loss_type", "") is None:
        causes.append("TRL's loss normaliser counts each document's first label (loss_type None)")
    return "; ".join(causes)


def render(results: dict, meta: dict, path: Path) -> None:
    """The markdown report of ``results`` (family -> row of :func:`train` or :func:`train_grpo`)."""
    counts = {k: sum(r.get("result") == k for r in results.values())
              for k in ("exact", "chaotic", "differs", "refused", "trl_fails", "error")}  # fmt: skip
    lines = [f"# {meta['trainers']} on the families the definition check calls exact (CPU, fp32)", "",
             f"{meta}", "", ", ".join(f"{k} {v}" for k, v in counts.items()) + f" (exact: <= {TOLERANCE:.0e})", "",
             "| family | result | loss / grad norm / aux | final weights | first step | TRL vs TRL | odc_hf vs odc_hf "
             "| TRL's left padding | attention | why |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in sorted(results):
        row = results[name]
        why = " / ".join(row[k] for k in ("known", "odc_error", "trl_error") if row.get(k))
        lines.append(f"| {name} | {row.get('result', 'error')} | {row.get('history', math.nan):.1e} | "
                     f"{row.get('weights', math.nan):.1e} | {row.get('first_step', math.nan):.1e} | "
                     f"{row.get('trl_spread', math.nan):.1e} | {row.get('odc_spread', math.nan):.1e} | "
                     f"{row.get('left_padding', math.nan):.1e} | {row.get('attention') or ''} | "
                     f"{why.replace('|', '/').replace(chr(10), ' ')[:200]} |")  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path, help="a family_sweep JSON report")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--families", nargs="*", help="these families only (default: every exact row)")
    parser.add_argument("--shard", default="0/1", help="I/N: every N-th family from the I-th (parallel processes)")
    parser.add_argument("--merge", nargs="*", type=Path, help="no training: these shards' JSON reports into one")
    parser.add_argument("--no_dropout", action="store_true", help="every dropout probability of the configs at 0")
    parser.add_argument("--grpo", action="store_true", help="ODCGRPOTrainer vs TRL's GRPOTrainer instead of SFT")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import subprocess

    import torch
    import transformers
    import trl

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "torch": torch.__version__,
            "transformers": transformers.__version__, "trl": trl.__version__,
            "dropout": "0 (--no_dropout)" if args.no_dropout else "as in each default config",
            "trainers": "ODCGRPOTrainer vs GRPOTrainer" if args.grpo else "ODCSFTTrainer vs SFTTrainer",
            "sweep": args.sweep.name}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        results = {k: v for path in args.merge for k, v in json.loads(path.read_text()).items()}
        (args.out / "family_training_sweep.json").write_text(json.dumps(results, indent=1))
        render(results, meta, args.out / "family_training_sweep.md")
        return
    torch.set_num_threads(1)
    rows = json.loads(args.sweep.read_text())["rows"]
    index, shards = (int(x) for x in args.shard.split("/"))
    names = (args.families or [name for name, row in rows.items() if row["result"] == "exact"])[index::shards]
    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            results[name] = (train_grpo if args.grpo else train)(name, args.out, args.no_dropout)
        except Exception as error:  # noqa: BLE001 - recorded per family
            results[name] = {"result": "error", "odc_error": f"{type(error).__name__}: {str(error)[:400]}"}
        results[name]["seconds"] = time.perf_counter() - start
        print(name, results[name], flush=True)
        (args.out / "family_training_sweep.json").write_text(json.dumps(results, indent=1))
    render(results, meta, args.out / "family_training_sweep.md")


if __name__ == "__main__":
    main()
