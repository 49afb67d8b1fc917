"""Does `attention.warm_up` plan every attention shape training meets? (one GPU, a few seconds per mode)

cuDNN's attention builds an execution plan for each new shape *and strides*. `sdpa_varlen` copies each document
into a shape bucket with one fixed layout so that `warm_up`'s plans are the ones training uses. This benchmark
checks it the way a run meets it: after `warm_up`, a packed row of never-seen document lengths runs twice; a
missed plan shows as a first run several times slower than the second. It also records the (q, k, v) strides
SDPA received for one bucket length: a single stride triple means one plan per length.

Modes (each in a fresh process): ``bucketed`` (the default ``sdpa_varlen``: buckets + warm_up), ``bucketed_liger``
(the same under Liger's rotary embedding, RMSNorm and SwiGLU, when liger-kernel is installed: its q/k layout
differs from transformers'), ``exact`` (shape bucket 0, no warm-up: every new document length is a new plan).

    python -m benchmarks.attention.plans --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from benchmarks.common import report

ROWS = ([4096, 1500, 777], [8192, 123, 2000, 901], [5000, 5000, 3333], [16384 - 17, 17], [3000, 3100, 3200])
PROBE_LENGTH = 4096  # the bucket length whose SDPA input strides are recorded


def _measure(mode: str, layers: int) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from odc_hf.attention import varlen as attention

    if mode == "bucketed_liger":
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2

        apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)  # fmt: skip
    name = attention.register(attention.VarlenAttention(shape_bucket=0)) if mode == "exact" else "sdpa_varlen"
    config = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=layers, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=4096, max_position_embeddings=32768)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM._from_config(config, attn_implementation=name, dtype=torch.bfloat16).cuda()
    strides = set()
    sdpa = attention.sdpa_attention_forward

    def recording(module, q, k, v, *args, **kwargs):  # this process only: a probe of what SDPA receives
        if q.shape[2] == PROBE_LENGTH:
            strides.add(tuple(tuple(t.stride()) for t in (q, k, v)))
        return sdpa(module, q, k, v, *args, **kwargs)

    attention.sdpa_attention_forward = recording
    start = time.perf_counter()
    shapes = attention.warm_up(model, 16384)
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - start

    def step(lengths) -> float:
        ids = torch.randint(0, config.vocab_size, (1, sum(lengths)), device="cuda")
        pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).cuda()
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                    max_length_q=max(lengths), max_length_k=max(lengths))  # fmt: skip
        out.logits.float().mean().backward()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    for _ in range(3):  # the allocator grown to the longest row; kernels loaded (8192 is a bucket multiple)
        step([8192, 8192])
    rows = []
    for lengths in ROWS:
        first, second = step(lengths), step(lengths)
        rows.append({"lengths": list(lengths), "first_s": first, "second_s": second, "ratio": first / second})
    return {"mode": mode, "warm_up_shapes": shapes, "warm_up_s": warm_s, "rows": rows,
            "strides_at_probe_length": sorted(strides)}  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["bucketed", "bucketed_liger", "exact"])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the 1.5B-shaped model")
    parser.add_argument("--out", default=str(report.RESULTS / "attention"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(_measure(args.child, args.layers)), flush=True)
        return
    import torch


    if not torch.cuda.is_available():
        raise SystemExit("attention_plans.py measures cuDNN plans: it needs a CUDA GPU")
    env = report.environment()
    results = []
    for mode in args.modes:
        if mode == "bucketed_liger":
            try:
                import liger_kernel  # noqa: F401
            except ImportError:
                print("liger-kernel is not installed: skipping bucketed_liger")
                continue
        proc = subprocess.run([sys.executable, __file__, "--child", mode, "--layers", str(args.layers)],
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            raise SystemExit(f"mode {mode} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
        results.append(json.loads(line[len("RESULT "):]))
        print(mode, [round(r["ratio"], 2) for r in results[-1]["rows"]], flush=True)
    lines = ["# Attention plans after warm_up: first vs second run of packed rows of new document lengths", "",
             report.env_markdown(env),
             f"- model: Qwen2.5-1.5B shape with {args.layers} decoder layers, vocab 4096, bf16, fwd + bwd of one packed "
             "row (`sdpa_varlen`, per-document attention); after `warm_up(model, 16384)` and three runs of an "
             "8192+8192 row, each row below runs twice. A first run much slower than the second is a cuDNN plan "
             "built during training.", ""]  # fmt: skip
    for result in results:
        lines += [f"## {result['mode']}", "",
                  f"warm-up: {result['warm_up_shapes']} shapes in {result['warm_up_s']:.2f} s; (q, k, v) strides SDPA "
                  f"received at {PROBE_LENGTH} tokens: {result['strides_at_probe_length']}", "",
                  *report.table(["documents", "first ms", "second ms", "first / second"],
                                [["+".join(map(str, r["lengths"])), f"{1e3 * r['first_s']:.1f}", f"{1e3 * r['second_s']:.1f}",
                                  f"{r['ratio']:.2f}"] for r in result["rows"]], "lrrr")]  # fmt: skip
        lines.append("")
    hardware = "h200" if "H200" in (env["gpus"] or [""])[0] else "gpu"
    stem = f"attention_plans_{hardware}x1_{env['date'][:10]}"
    paths = report.write(args.out, stem, {"env": env, "results": results}, "\n".join(lines))
    print("wrote", *paths)


if __name__ == "__main__":
    main()
