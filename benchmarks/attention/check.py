"""Cost of one packed row by attention path: does a row of several documents cost the sum of its documents?

One unsharded Qwen2.5-shaped model (bf16, activation checkpointing), forward+backward of a single row:
one long document vs the same number of tokens split into 2 or 4 documents, with ``sdpa_varlen`` through
torch's flash varlen kernel, ``sdpa_varlen`` with one SDPA call per document, and transformers' ``sdpa``
(block-diagonal mask from ``position_ids``). Writes JSON + markdown.

    python -m benchmarks.attention.check --out benchmarks/results            # one GPU
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="1.5B")
    parser.add_argument("--tokens", type=int, default=28672)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(report.RESULTS / "attention"))
    args = parser.parse_args(argv)
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from odc_hf import attention
    from odc_hf.prediction.workloads import QWEN2_5_SHAPES

    device = torch.device("cuda")
    config = Qwen2Config(**QWEN2_5_SHAPES[args.model], tie_word_embeddings=True, use_cache=False,
                         max_position_embeddings=65536)  # fmt: skip
    torch.manual_seed(0)
    with device:
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    collate = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    T = args.tokens
    rows = {"1 doc": [T], "2 docs": [T * 5 // 8, T - T * 5 // 8], "4 docs": [T // 4] * 4}
    paths = {"varlen kernel": attention.register(attention.VarlenAttention(varlen_kernel=True)),
             "per-doc SDPA": attention.VARLEN_ATTENTION, "sdpa + mask": "sdpa"}  # attn_implementation names
    results = []
    for row_name, lengths in rows.items():
        g = torch.Generator().manual_seed(1)
        docs = [
            {"input_ids": torch.randint(1, config.vocab_size, (n,), generator=g).tolist()} for n in lengths
        ]
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in collate(docs).items()}
        for path_name, impl in paths.items():
            model.config._attn_implementation = impl
            times = []
            for _ in range(args.repeats + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model(**batch).loss.backward()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                model.zero_grad(set_to_none=True)
            results.append(
                {
                    "row": row_name,
                    "lengths": lengths,
                    "path": path_name,
                    "seconds": statistics.median(times[1:]),
                }
            )
            print(results[-1], flush=True)
    env = report.environment()
    lines = [f"# Packed-row attention cost, Qwen2.5-{args.model} shape, one GPU, {T} tokens per row\n",
             report.env_markdown(env), f"fwd+bwd seconds (median of {args.repeats}), activation checkpointing, bf16\n",
             *report.table(["row", *paths],
                           [[f"{row_name} {lengths}",
                             *(f"{next(r['seconds'] for r in results if r['row'] == row_name and r['path'] == p):.3f}"
                               for p in paths)] for row_name, lengths in rows.items()],
                           "l" + "r" * len(paths))]  # fmt: skip
    md = "\n".join(lines) + "\n"
    report.write(
        args.out,
        f"attention_check_{report.hardware_tag(env)}_{report.today()}",
        {"env": env, "results": results},
        md,
    )
    print(md)


if __name__ == "__main__":
    main()
