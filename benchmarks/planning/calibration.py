"""Calibrate the planner's cost model on ONE GPU, on odc_hf's default microbatch compute path.

    python -m benchmarks.planning.calibration --model 1.5B --out $OUT                                  # ~1 min on one H200
    python -m benchmarks.planning.calibration --model 1.5B --attention flash_attention_4 --out $OUT   # FA4, when installed
    python -m benchmarks.planning.calibration --model tiny --lengths 64,128,256,512 --out /tmp/cal    # CPU smoke run

The path the ODC trainers run (odc_hf/integrations/compute/fused_head.py; docs/performance.md): TRL's fused LM head (no
logits), Liger's layer kernels when liger-kernel is installed and the device is CUDA, activation checkpointing as
``activation_checkpointing="auto"`` plans it for ``--max-tokens`` on this GPU (``--world-size`` ranks' resident
state: auto picks for the sharded run it will plan, not for this unsharded copy), the ``--attention`` given. An
unsharded bf16 copy (random init) runs forward + backward of one random sequence per length (``odc_hf.prediction.calibrate``:
one warm-up, the median of ``--repeats``); ``max(floor, a + b*s + c*s^2)`` is fitted to the medians.

Writes ``calibration_qwen2.5-<model>_<hw>_<date>_<attention>.json`` under ``--out``: ``lengths``, ``seconds``, the
fit (``a``, ``b``, ``c``, ``floor``: what ``ODCConfig(cost_model=...)`` reads), ``compute_path``, ``model_shape``
(so the simulators scale it by FLOPs to other shapes) and the environment. Then, on CPU:

    python -m benchmarks.planning.simulate --workload longalign --model 1.5B --calibration CAL.json --tag newpath
    python -m benchmarks.planning.simulate multinode --cost-model CAL.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
from benchmarks.common import report  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1.5B", help="Qwen2.5 shape (1.5B, 7B, ...) or tiny (CPU)")
    p.add_argument("--attention", default="sdpa_varlen", help="sdpa_varlen | flash_attention_4 | sdpa | ...")
    p.add_argument("--lengths", default="512,2048,4096,8192,16384,24576,32768")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32768, help="token budget activation checkpointing plans for")
    p.add_argument("--world-size", type=int, default=8, help="ranks whose sharded state the checkpointing plan assumes")
    p.add_argument("--out", default=os.environ.get("OUT") or str(report.RESULTS / "planning"))
    return p.parse_args(argv)


def build(args, device):
    import torch
    from transformers import Qwen2ForCausalLM

    import odc_hf.attention  # noqa: F401 - registers "sdpa_varlen"
    from odc_hf.prediction.workloads import qwen2_5_config
    from odc_hf.testing.data import tiny_qwen2_config

    if args.model == "tiny":
        config = tiny_qwen2_config(512, max_position_embeddings=max(2048, args.max_tokens))
    else:
        config = qwen2_5_config(args.model)
        config.tie_word_embeddings = args.model == "1.5B"  # as the released Qwen2.5 models
        config.max_position_embeddings = max(32768, args.max_tokens)
    config.use_cache = False
    config._attn_implementation = args.attention
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.to(torch.bfloat16) if device.type == "cuda" else model


def calibrate_default_path(args) -> dict:
    import torch

    from odc_hf.integrations.compute import activation_checkpointing as ac
    from odc_hf.integrations.compute import fused_head as cp
    from odc_hf.prediction.calibrate import time_lengths
    from odc_hf.prediction.cluster import ModelShape

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = build(args, device)
    kernels = cp.resolve_kernels("auto", False, device)
    if kernels == "liger":
        cp.apply_liger_kernels(model, fused_linear_cross_entropy=False)  # SFT keeps TRL's fused head
    cp.install_fused_head(model, outputs=cp.SFT_HEAD_OUTPUTS)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    path = ac.plan_checkpointing(cp.ComputePath(kernels=kernels, loss=cp.TRL_FUSED_HEAD, checkpointing="auto"), model,
                                 policy="auto", tokens=args.max_tokens, device=device, compute_dtype=dtype,
                                 world_size=args.world_size, odc=args.world_size > 1, device_memory_gib=None)  # fmt: skip
    lengths = [int(s) for s in args.lengths.split(",")]
    seconds = time_lengths(model, lengths, repeats=args.repeats, forward_kwargs={"fused_lm_head": True})
    from odc_hf.balance.cost import QuadraticCostModel

    fitted = QuadraticCostModel.fit(lengths, seconds)
    name = "tiny" if args.model == "tiny" else f"Qwen2.5-{args.model}"
    return {
        "description": f"forward+backward seconds of one sequence of a {name}-shaped model (random init) on one "
                       f"{'GPU' if device.type == 'cuda' else 'CPU'}, odc_hf's default compute path",  # fmt: skip
        "lengths": lengths, "seconds": seconds, **fitted.to_dict(), "describe": fitted.describe(),
        "compute_path": path.describe(), "attention": args.attention, "max_tokens": args.max_tokens,
        "world_size_planned": args.world_size, "repeats": args.repeats,
        "model_shape": dataclasses.asdict(ModelShape.from_config(model.config, name=name)),
    }  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    env = report.environment()
    result = {**calibrate_default_path(args), "env": env, "date": env["date"][:10]}
    stem = f"calibration_qwen2.5-{args.model}_{report.hardware_tag(env)}_{env['date'][:10]}_{args.attention}"
    path = report.write_json(Path(args.out) / f"{stem}.json", result)
    print(f"calibration: {result['describe']}; path {result['compute_path']}; written to {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
