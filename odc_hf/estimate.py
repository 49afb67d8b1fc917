"""``python -m odc_hf.estimate``: will ODC pay off on YOUR data? Predicted step times before you rent GPUs.

Give it your samples (a dataset plus a tokenizer, or a file of token counts), a model (a Qwen2.5 size or any
dense decoder config), the cluster (GPUs per node, nodes, network) and the step (samples per GPU, token
budget). It plans every step of one epoch the way the trainers do (LB-Mini for ODC, LB-Micro for FSDP2,
balanced over all GPUs) and prices it with the calibrated H200 cost model (:mod:`odc_hf.balance.simulate`):

    python -m odc_hf.estimate --lengths lengths.txt --model 7B --nodes 4
    python -m odc_hf.estimate --dataset my_sft.jsonl --tokenizer Qwen/Qwen2.5-7B --model Qwen/Qwen2.5-7B \\
        --nodes 2 --per-device-train-batch-size 1 --gradient-accumulation-steps 4 --max-length 32768

See docs/multi_node.md ("Estimate it for your data") for the model behind the numbers and its assumptions.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from .balance.cluster import Cluster, ModelShape
from .balance.simulate import h200_overheads, load_cost_model, plan_steps, step_times, summarize
from .estimate_data import EstimateError
from .workloads import QWEN2_5_SHAPES, qwen2_5_config

__all__ = ["THRESHOLD", "EstimateError", "estimate", "main", "read_lengths_file"]

THRESHOLD = 1.05
"""ODC is called worth it when it is predicted at least 5 % faster than the best FSDP2 layout: on 2 x H200 the
measured speedups were 0.95-1.00 of the predicted ones, and ODC's fixed per-step costs on short, launch-bound
steps (1-4 % measured) are only partly in the model."""
TIED_PRESETS = {"1.5B"}  # Qwen2.5-1.5B ties its embeddings; 7B, 14B, 32B do not
LABELS = {
    "fsdp2_full": "FSDP2 full sharding + LB-Micro",
    "fsdp2_hsdp": "FSDP2 HSDP + LB-Micro",
    "odc_hsdp": "ODC HSDP + LB-Mini",
}
SINGLE_NODE_LABELS = {"fsdp2_hsdp": "FSDP2 + LB-Micro", "odc_hsdp": "ODC + LB-Mini"}


# ---- inputs ------------------------------------------------------------------------------------------------


def read_lengths_file(path: str | Path) -> np.ndarray:
    """Token counts from a file: one integer per line (blank lines and ``#`` comments skipped), or JSON (a list,
    or an object with a ``lengths`` list)."""
    path = Path(path)
    if not path.is_file():
        raise EstimateError(f"--lengths {path}: no such file")
    text = path.read_text()
    if path.suffix == ".json" or text.lstrip().startswith(("[", "{")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise EstimateError(f"--lengths {path}: not valid JSON ({err})") from None
        values = data.get("lengths") if isinstance(data, dict) else data
        if not isinstance(values, list):
            raise EstimateError(
                f"--lengths {path}: expected a JSON list of integers or an object with 'lengths'"
            )
        bad = [(i, v) for i, v in enumerate(values) if isinstance(v, bool) or not isinstance(v, int) or v < 0]
        if bad:
            raise EstimateError(
                f"--lengths {path}: entry {bad[0][0]} is {bad[0][1]!r}, not a token count (int >= 0)"
            )
        return np.asarray(values, dtype=np.int64)
    values = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if not line.isdigit():
            raise EstimateError(
                f"--lengths {path}, line {number}: {line!r} is not a token count (one integer per line)"
            )
        values.append(int(line))
    return np.asarray(values, dtype=np.int64)


def model_shape(spec: str) -> ModelShape:
    """A Qwen2.5 size (``1.5B``, ``7B``, ...) or a config path / hub name read with ``transformers.AutoConfig``."""
    if spec in QWEN2_5_SHAPES:
        config = qwen2_5_config(spec)
        config.tie_word_embeddings = spec in TIED_PRESETS
        return ModelShape.from_config(config, name=f"Qwen2.5-{spec}")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(spec)
    except Exception as err:  # noqa: BLE001 - any loading failure is the user's input to fix
        raise EstimateError(
            f"--model {spec!r}: not a preset ({', '.join(QWEN2_5_SHAPES)}) and AutoConfig could not load it "
            f"({type(err).__name__}: {err})"
        ) from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        return ModelShape.from_config(text, name=spec)
    except ValueError as err:
        raise EstimateError(f"--model {spec!r}: {err}") from None


# ---- the estimate ------------------------------------------------------------------------------------------


def estimate(
    lengths,
    shape: ModelShape,
    cost_model,
    *,
    gpus_per_node: int,
    num_nodes: int,
    network_gb_per_s: float,
    per_rank: int,
    max_tokens: int,
    seed: int = 0,
    max_steps: int | None = None,
    progress=None,
) -> dict:
    """Summaries (:func:`~odc_hf.balance.simulate.summarize`) on one node and, for ``num_nodes > 1``, on all."""
    overheads = h200_overheads()
    out = {}
    layouts = [("single_node", 1)] + ([("multi_node", num_nodes)] if num_nodes > 1 else [])
    for key, nodes in layouts:
        cluster = Cluster(gpus_per_node=gpus_per_node, num_nodes=nodes, network_gb_per_s=network_gb_per_s)
        steps = plan_steps(
            lengths, cluster.world_size, per_rank, max_tokens, cost_model,
            seed=seed, max_steps=max_steps, progress=progress,
        )  # fmt: skip
        out[key] = {"cluster": cluster.describe(), **summarize(step_times(steps, shape, cluster, overheads))}
    return out


def verdict(result: dict) -> dict:
    """Worth it when ODC is >= THRESHOLD x faster than the better FSDP2 layout on the target cluster."""
    key = "multi_node" if "multi_node" in result else "single_node"
    s = result[key]
    baseline = "fsdp2_full" if s["fsdp2_full"]["total_s"] < s["fsdp2_hsdp"]["total_s"] else "fsdp2_hsdp"
    speedup = s[f"speedup_vs_{baseline}"]
    return {
        "layout": key,
        "baseline": baseline,
        "speedup": speedup,
        "threshold": THRESHOLD,
        "worth_it": speedup >= THRESHOLD,
    }


def format_report(result: dict, header: list[str]) -> str:
    lines = ["odc_hf.estimate: predicted step times, ODC + LB-Mini vs FSDP2 + LB-Micro", "", *header]
    columns = f"  {'':34}{'step s':>9}{'ODC speedup':>13}{'bubble':>9}{'comm s':>9}{'optim. s':>10}"
    for key in ("single_node", "multi_node"):
        if key not in result:
            continue
        s = result[key]
        lines += ["", f"{s['cluster']}: {s['steps']} steps", columns]
        names = SINGLE_NODE_LABELS if key == "single_node" else LABELS
        for name, label in names.items():
            row = s[name]
            speedup = "" if name == "odc_hsdp" else f"{s[f'speedup_vs_{name}']:.3f}x"
            lines.append(
                f"  {label:34}{row['total_s']:9.3f}{speedup:>13}{row['bubble']:9.1%}{row['comm_s']:9.3f}"
                f"{row['overhead_s']:10.3f}"
            )
        lines.append(f"  {'balance bound':34}{s['bound_s']:9.3f}")
    v = verdict(result)
    where = result[v["layout"]]["cluster"]
    base = (SINGLE_NODE_LABELS if v["layout"] == "single_node" else LABELS)[v["baseline"]]
    odc = (SINGLE_NODE_LABELS if v["layout"] == "single_node" else LABELS)["odc_hsdp"]
    answer = "worth it" if v["worth_it"] else "NOT worth it"
    lines += [
        "",
        f"verdict: ODC is {answer} for this data. On {where}, {odc} is predicted {v['speedup']:.3f}x as fast "
        f"as {base}, the faster FSDP2 layout (threshold {THRESHOLD:.2f}x: predictions were up to 5 % above "
        "measurements on 2 x H200).",
        "step s: mean predicted step time; ODC speedup: summed baseline time / summed ODC time; bubble: median "
        "fraction of GPU time spent waiting for other GPUs; comm s: inter-node communication not hidden under "
        "compute; optim. s: optimizer step and ODC's minibatch sync; balance bound: perfect balance, free "
        "communication.",
    ]
    return "\n".join(lines)


# ---- command line ------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m odc_hf.estimate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    data = p.add_argument_group("data (one of)")
    data.add_argument(
        "--lengths", help="file of token counts: one integer per line, or JSON (list or {'lengths': [...]})"
    )
    data.add_argument(
        "--dataset", help="local .jsonl/.json/.parquet/.csv file, a saved dataset folder, or a hub name"
    )
    data.add_argument("--dataset-config", help="the hub dataset's configuration name")
    data.add_argument("--split", default="train")
    data.add_argument(
        "--column",
        help="text column, or 'messages' (chat); default: input_ids, messages, text, prompt+completion",
    )
    data.add_argument(
        "--tokenizer",
        help="path or hub name, or 'default' (odc_hf's offline byte-level BPE); default: --model",
    )
    data.add_argument("--max-samples", type=int, help="tokenize only the first N rows")
    p.add_argument(
        "--model",
        default="1.5B",
        help=f"Qwen2.5 size ({', '.join(QWEN2_5_SHAPES)}) or a config path / hub name",
    )
    p.add_argument("--cost-model", default="h200",
                   help="'h200' (measured on an H200, scaled to your model by FLOPs), 'flop', or your calibration .json "
                        "(the formats ODCConfig.cost_model accepts)")  # fmt: skip
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nodes", type=int, default=2, help="number of nodes (1: a single node only)")
    p.add_argument(
        "--network-gb-per-s",
        type=float,
        default=50.0,
        help="inter-node bandwidth per GPU, GB/s (400 Gb/s = 50)",
    )
    p.add_argument("--per-device-train-batch-size", type=int, default=1)
    p.add_argument("--gradient-accumulation-steps", type=int, default=4,
                   help="samples per GPU per step = per-device batch x gradient accumulation")  # fmt: skip
    p.add_argument("--max-length", type=int, help="truncate samples to this many tokens (TRL's max_length)")
    p.add_argument(
        "--max-tokens",
        type=int,
        help="token budget per microbatch; default: the longest sample (as ODCConfig)",
    )
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (the sampler's)")
    p.add_argument("--max-steps", type=int, help="simulate at most this many steps per layout")
    p.add_argument("--json", type=Path, help="also write the numbers to this JSON file")
    return p


def _lengths_from_args(args) -> tuple[np.ndarray, str]:
    if (args.lengths is None) == (args.dataset is None):
        raise EstimateError("give exactly one of --lengths FILE or --dataset PATH_OR_NAME")
    if args.lengths is not None:
        return read_lengths_file(args.lengths), Path(args.lengths).name
    from .estimate_data import dataset_lengths

    tokenizer = args.tokenizer
    if tokenizer is None:
        if args.model in QWEN2_5_SHAPES:
            raise EstimateError(
                f"--dataset needs --tokenizer (a path or hub name, or 'default'); --model {args.model} is a preset"
            )
        tokenizer = args.model
    lengths = dataset_lengths(
        args.dataset, tokenizer=tokenizer, column=args.column, split=args.split,
        config_name=args.dataset_config, max_samples=args.max_samples,
    )  # fmt: skip
    return lengths, f"{args.dataset} ({args.split}), tokenizer {tokenizer}"


def run(argv=None) -> dict:
    """Parse, estimate, print; returns everything printed as numbers (raises EstimateError on bad input)."""
    args = build_parser().parse_args(argv)
    for name in ("gpus_per_node", "nodes", "per_device_train_batch_size", "gradient_accumulation_steps"):
        if getattr(args, name) < 1:
            raise EstimateError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("max_length", "max_tokens", "max_samples", "max_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise EstimateError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.network_gb_per_s <= 0:
        raise EstimateError(f"--network-gb-per-s must be > 0, got {args.network_gb_per_s}")
    lengths, source = _lengths_from_args(args)
    if lengths.size == 0 or lengths.max() == 0:
        raise EstimateError(f"{source}: no samples with tokens")
    if args.max_length is not None:
        lengths = np.minimum(lengths, args.max_length)
    budget = args.max_tokens or int(lengths.max())
    shape = model_shape(args.model)
    try:
        cost_model, cost_text = load_cost_model(args.cost_model, shape)
    except ValueError as err:
        raise EstimateError(f"--cost-model: {err}") from None
    per_rank = args.per_device_train_batch_size * args.gradient_accumulation_steps
    from tqdm.auto import tqdm

    def progress(it):
        return tqdm(it, desc="planning steps", unit="step", disable=len(it) < 50, file=sys.stderr)

    try:
        result = estimate(
            lengths, shape, cost_model, gpus_per_node=args.gpus_per_node, num_nodes=args.nodes,
            network_gb_per_s=args.network_gb_per_s, per_rank=per_rank, max_tokens=budget, seed=args.seed,
            max_steps=args.max_steps, progress=progress,
        )  # fmt: skip
    except ValueError as err:
        raise EstimateError(str(err)) from None
    clipped = int((lengths > budget).sum())
    header = [
        f"data        {lengths.size:,} samples from {source}: median {int(np.median(lengths)):,} tokens, "
        f"mean {lengths.mean():,.0f}, max {int(lengths.max()):,}"
        + (
            f"; {clipped:,} longer than the budget, clipped (the trainer needs truncate=True)"
            if clipped
            else ""
        ),
        f"model       {shape.describe()}",
        f"cost model  {cost_text}",
        f"step        {per_rank} samples per GPU ({args.per_device_train_batch_size} x {args.gradient_accumulation_steps}"
        f" gradient accumulation), budget {budget:,} tokens per microbatch, shuffled with seed {args.seed}",
    ]
    print(format_report(result, header))
    result.update(verdict=verdict(result), samples=int(lengths.size), max_tokens=budget, per_rank=per_rank,
                  model=shape.describe(), cost_model=cost_text)  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return result


def main(argv=None) -> None:
    try:
        run(argv)
    except EstimateError as err:
        print(f"odc_hf.estimate: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
