"""``python -m odc_hf.estimate``: will ODC pay off on YOUR data? Predicted step times before you rent GPUs.

Give it your samples (a dataset plus a tokenizer, or a file of token counts), a model (a Qwen2.5 size or a
causal LM's config), the cluster (GPUs per node, nodes, network) and the step (samples per GPU, token
budget). It plans every step of one epoch the way the trainers do (LB-Mini for ODC, LB-Micro for FSDP2,
balanced over all GPUs; transformers' ``batch_rebalance`` sampler for "what you have today") and prices it with
the calibrated H200 cost model (:mod:`odc_hf.prediction.simulate`):

    python -m odc_hf.estimate --lengths lengths.txt --model 7B --nodes 4
    python -m odc_hf.estimate --dataset my_sft.jsonl --tokenizer Qwen/Qwen2.5-7B --model Qwen/Qwen2.5-7B \\
        --nodes 2 --per-device-train-batch-size 1 --gradient-accumulation-steps 4 --max-length 32768

See docs/multi_node.md ("Estimate it for your data") for the model behind the numbers and its assumptions.
"""

# torch, transformers and the planners are imported where they are used, so that ``--help`` and bad arguments
# answer in well under a second (tests/prediction/test_estimate.py times it).
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from .estimate import REBALANCE_MAX_STEPS, REBALANCE_TIME_S, estimate, format_report, verdict
from .estimate_inputs import EstimateError, dataset_lengths, model_shape, read_lengths_file
from .workloads import QWEN2_5_SHAPES

__all__ = ["build_parser", "main", "run"]


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and ``(default: ...)`` after the help of every option that has a default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, argparse.SUPPRESS) or "%(default)" in text:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m odc_hf.estimate",
        description=__doc__,
        formatter_class=_HelpFormatter,
    )
    data = p.add_argument_group("data (one of)")
    data.add_argument(
        "--lengths", help="file of token counts: one integer per line, or JSON (list or {'lengths': [...]})"
    )
    data.add_argument(
        "--dataset", help="local .jsonl/.json/.parquet/.csv file, a saved dataset folder, or a hub name"
    )
    data.add_argument("--dataset-config", help="the hub dataset's configuration name")
    data.add_argument("--split", default="train", help="the dataset's split")
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
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node")
    p.add_argument("--nodes", type=int, default=2, help="number of nodes (1: a single node only)")
    p.add_argument(
        "--network-gb-per-s",
        type=float,
        default=50.0,
        help="inter-node bandwidth per GPU, GB/s (400 Gb/s = 50)",
    )
    p.add_argument("--per-device-train-batch-size", type=int, default=1,
                   help="samples per GPU per microbatch (TRL's per_device_train_batch_size)")  # fmt: skip
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
    p.add_argument("--rebalance-time-s", type=float, default=REBALANCE_TIME_S,
                   help="stop planning with batch_rebalance once this many seconds are spent (per layout)")
    p.add_argument("--rebalance-max-steps", type=int, default=REBALANCE_MAX_STEPS,
                   help="plan at most this many steps with transformers' batch_rebalance sampler (pure Python, slow "
                        "at hundreds of GPUs); 0 leaves its rows out")  # fmt: skip
    p.add_argument("--json", type=Path, help="also write the numbers to this JSON file")
    return p


def _lengths_from_args(args) -> tuple[np.ndarray, str]:
    if (args.lengths is None) == (args.dataset is None):
        raise EstimateError("give exactly one of --lengths FILE or --dataset PATH_OR_NAME")
    if args.lengths is not None:
        return read_lengths_file(args.lengths), Path(args.lengths).name
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
    if args.rebalance_max_steps < 0:
        raise EstimateError(f"--rebalance-max-steps must be >= 0, got {args.rebalance_max_steps}")
    if (args.lengths is None) == (args.dataset is None):
        raise EstimateError("give exactly one of --lengths FILE or --dataset PATH_OR_NAME")
    # everything that can be checked without the data first: tokenizing a large dataset takes minutes
    from .cost_models import load_cost_model

    shape = model_shape(args.model)
    try:
        cost_model, cost_text = load_cost_model(args.cost_model, shape)
    except ValueError as err:
        raise EstimateError(f"--cost-model: {err}") from None
    lengths, source = _lengths_from_args(args)
    if lengths.size == 0 or lengths.max() == 0:
        raise EstimateError(f"{source}: no samples with tokens")
    if args.max_length is not None:
        lengths = np.minimum(lengths, args.max_length)
    budget = args.max_tokens or int(lengths.max())
    per_rank = args.per_device_train_batch_size * args.gradient_accumulation_steps
    from tqdm.auto import tqdm

    def progress(it):
        return tqdm(it, desc="planning steps", unit="step", disable=len(it) < 50, file=sys.stderr)

    try:
        result = estimate(
            lengths, shape, cost_model, gpus_per_node=args.gpus_per_node, num_nodes=args.nodes,
            network_gb_per_s=args.network_gb_per_s, per_rank=per_rank, max_tokens=budget, seed=args.seed,
            max_steps=args.max_steps, progress=progress,
            grad_accum=args.gradient_accumulation_steps if args.rebalance_max_steps else None,
            rebalance_max_steps=args.rebalance_max_steps, rebalance_time_s=args.rebalance_time_s,
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
    world = args.gpus_per_node * args.nodes
    print(format_report(result, header, step_samples={"world": world, "per_rank": per_rank,
                                                      "per_step": world * per_rank}))  # fmt: skip
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
