"""One GPU: what one microbatch costs on each compute path (loss, Liger kernels, activation checkpointing).

Qwen2.5-shaped models from a config (random init, bf16, ``attn_implementation="sdpa_varlen"``), forward + backward
of one row: single documents, and packed rows of several documents built by odc_hf's ``BundleCollator`` (what
the trainers feed the model; per-document attention). Variants, in this order (Liger patches are not undone):

- ``today``: full logits + HF loss, full activation checkpointing (what the benchmarks ran before);
- ``trl``: TRL 1.16's fused LM head (SFTTrainer's loss), full AC (SFTConfig's default), then no AC;
- ``liger``: TRL's fused head + Liger RMSNorm/SwiGLU/RoPE, AC full, every second layer ("0.5"), none, and
  whatever ``auto`` picks if it is none of those;
- ``flce``: Liger's fused linear cross-entropy + layer kernels (ODCTrainer's loss on plain models), auto AC.

odc_hf's default path is the ``liger`` row with the AC that ``auto`` chooses (ODCSFTTrainer; ODCTrainer: ``flce``):
``odc_hf.integrations.compute.fused_head`` calibrates the memory model on this GPU exactly as the trainers do. Seconds:
median of ``--repeats`` CUDA-event timings after a warm-up run. MFU: causal-halved FLOPs ``6·N·s + 6·L·d·s²`` per
document / (seconds x 989 TFLOP/s), recomputation not counted. Losses are compared with the fp32 full-logits loss
of the same weights. Each model runs in its own process (Liger's patches are process-wide).

    python -m benchmarks.single_gpu.compute_ceiling --out benchmarks/results                         # one GPU, ~8 min
    python -m benchmarks.single_gpu.compute_ceiling --models 7B:8192,16384 --tag _7b --out $OUT
    python -m benchmarks.single_gpu.compute_ceiling --tiny --out /tmp/cc                               # CPU dry run
    python -m benchmarks.single_gpu.compute_ceiling --attn flash_attention_4,sdpa_varlen --models 1.5B --out $OUT

``--attn`` with several implementations (a comma list of auto, flash_attention_4, sdpa_varlen, ...) runs them side by
side instead, interleaved on the default path, on LongAlign-like, Tulu-like and GRPO-like rows
(``benchmarks/attention/compare.py``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

from benchmarks.common import report

PEAK_TFLOPS = 989.0
LOSS_RTOL = 1e-2  # bf16: unit roundoff 2**-8 = 3.9e-3 per rounding; 1e-2 allows a few roundings' worth
SELECTIVE = "0.5"


def rows_for(lengths: list[int]) -> list[tuple[str, list[int]]]:
    """Single documents (every length, and every document length the packed rows use), then packed rows."""
    packed = []
    for i, total in enumerate(sorted(lengths)):
        docs = (
            [total // 2, total // 4, total // 4]
            if i == 0
            else [total // 2, total // 4, total // 8, total // 8]
        )
        packed.append((f"packed {total}", docs))
    singles = sorted({d for _, docs in packed for d in docs} | set(lengths))
    return [(f"single {s}", [s]) for s in singles] + packed


def _batch(docs: list[int], vocab: int, device, seed: int) -> dict:
    import torch

    from odc_hf.integrations.trainer.bundle import BundleCollator

    g = torch.Generator().manual_seed(seed)
    examples = [{"input_ids": torch.randint(1, vocab, (n,), generator=g).tolist()} for n in docs]
    batch = BundleCollator(pad_token_id=0).collate_microbatch(examples)
    batch.pop("num_label_tokens")
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def _step(model, batch, loss: str):
    from odc_hf.integrations.compute.fused_head import TRL_FUSED_HEAD

    out = model(**batch, fused_lm_head=True) if loss == TRL_FUSED_HEAD else model(**batch)
    out.loss.backward()
    return out.loss.detach().float()


def measure(model, batch, loss: str, repeats: int, device) -> dict:
    """Warm-up, then ``repeats`` timed forward+backward runs: median seconds, peak GiB, the loss."""
    import torch

    cuda = device.type == "cuda"
    try:
        _step(model, batch, loss)
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        times, value = [], None
        for _ in range(repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            value = _step(model, batch, loss)
            if cuda:
                end.record()
                torch.cuda.synchronize(device)
                times.append(start.elapsed_time(end) / 1e3)
            else:
                times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
        return {"seconds": statistics.median(times), "times": times, "peak_gib": peak, "loss": value.item()}
    except torch.cuda.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return {"oom": True}


def _calibrate(model, kernels, loss, tokens, device, dtype, device_gib):
    """The trainers' memory model (activation_checkpointing.calibrate_memory), with this process's unsharded static state."""
    import dataclasses

    import torch

    from odc_hf.integrations.compute.activation_checkpointing import calibrate_memory
    from odc_hf.integrations.compute.fused_head import DEVICE_HEADROOM

    memory = calibrate_memory(model, device=device, dtype=dtype, kernels=kernels, loss=loss, tokens=tokens)
    params = float(sum(p.numel() * p.element_size() for p in model.parameters()))
    memory = dataclasses.replace(
        memory, static_bytes=params, fixed_bytes=memory.fixed_bytes + params
    )  # + grads
    total = device_gib * 2**30 if device_gib else torch.cuda.get_device_properties(device).total_memory
    return memory, DEVICE_HEADROOM * total


def run_model(size: str, lengths: list[int], args: dict) -> dict:
    """Every variant of one model, in a fresh process."""
    import torch

    from odc_hf import attention
    from odc_hf.balance.cost import FlopCostModel
    from odc_hf.balance.memory import checkpointed_indices, choose_checkpointing, describe_checkpointing
    from odc_hf.integrations.compute import fused_head as cp
    from odc_hf.integrations.compute.activation_checkpointing import enable_checkpointing

    tiny = args["tiny"]
    device = torch.device("cpu" if tiny else "cuda")
    if tiny:
        from odc_hf.testing.data import tiny_qwen2_config

        config = tiny_qwen2_config(512, num_layers=4)
    else:
        from odc_hf.prediction.workloads import qwen2_5_config

        config = qwen2_5_config(size)
        config.tie_word_embeddings = size in ("0.5B", "1.5B", "3B")  # as the released Qwen2.5 checkpoints
        config.use_cache = False
    config.max_position_embeddings = max(32768, max(lengths))
    config._attn_implementation = args.get("attn", attention.VARLEN_ATTENTION)
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)  # fp32 first: the reference losses
    model.train()
    rows = rows_for(lengths) if not args.get("quick") else [(f"single {t}", [t]) for t in lengths]
    batches = {name: _batch(docs, config.vocab_size, device, seed=i) for i, (name, docs) in enumerate(rows)}
    reference = {}
    with torch.no_grad():
        for name, batch in batches.items():
            reference[name] = model(**batch).loss.item()
    dtype = torch.float32 if tiny else torch.bfloat16
    model.to(dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # return the fp32 copy's blocks: the peaks below are of the bf16 model
    flops = FlopCostModel.from_config(config)
    if device.type == "cuda":
        attention.warm_up(model, max(lengths), dtype=dtype, device=device)
    L = config.num_hidden_layers
    liger_ok = cp.liger_problem(device) is None
    results, memory_models = [], {}

    def run(variant: str, loss: str, kernels: str, checkpointed: int, note: str = ""):
        enable_checkpointing(model, checkpointed)
        ac = describe_checkpointing(checkpointed, L)
        for name, docs in rows:
            r = measure(model, batches[name], loss, args["repeats"], device)
            r.update(variant=variant, loss_path=loss, kernels=kernels, ac=ac, checkpointed=checkpointed, row=name,
                     docs=docs, tokens=sum(docs), note=note, reference_loss=reference[name])  # fmt: skip
            if "seconds" in r:
                r["mfu"] = float(flops.doc_costs(docs).sum()) / (r["seconds"] * PEAK_TFLOPS * 1e12)
                r["loss_rel_err"] = abs(r["loss"] - reference[name]) / abs(reference[name])
            results.append(r)
            print(f"{size} {variant:6s} {ac:16s} {name:14s} "
                  + (f"{r['seconds']:.3f} s" if "seconds" in r else "OOM"), flush=True)  # fmt: skip

    def auto_choices(kernels, loss):
        if device.type != "cuda":
            return {t: 0 for t in lengths}
        memory, usable = _calibrate(model, kernels, loss, max(lengths), device, dtype, args["device_gib"])
        memory_models[f"{kernels}/{loss}"] = {"model": memory.to_dict(), "usable_bytes": usable}
        return {t: choose_checkpointing(memory, t, usable)[0] for t in lengths}

    quick = args.get("quick", False)
    if not quick:
        run("today", cp.FULL_LOGITS, "none", L)
    cp.install_fused_head(
        model, outputs=cp.SFT_HEAD_OUTPUTS
    )  # exactly SFTTrainer's head (its metrics' outputs too)
    if quick:  # the default path without checkpointing only (e.g. to compare attention implementations)
        if liger_ok:
            cp.apply_liger_kernels(model, fused_linear_cross_entropy=False)
        run("liger", cp.TRL_FUSED_HEAD, "liger" if liger_ok else "none", 0)
        return {"size": size, "lengths": lengths, "num_layers": L, "results": results, "auto": {t: 0 for t in lengths},
                "memory_models": {}, "config": config.to_dict(), "attn": config._attn_implementation}  # fmt: skip
    auto_choices("none", cp.TRL_FUSED_HEAD)  # recorded: what auto does for TRL users without Liger
    for n in (L, 0):
        run("trl", cp.TRL_FUSED_HEAD, "none", n)
    if not liger_ok and not tiny:
        raise SystemExit(f"Liger unavailable: {cp.liger_problem(device)}")
    kernels = "liger" if liger_ok else "none"
    if liger_ok:
        cp.apply_liger_kernels(model, fused_linear_cross_entropy=False)
    auto = auto_choices(kernels, cp.TRL_FUSED_HEAD)
    for n in sorted({L, len(checkpointed_indices(L // 2, L)), 0} | set(auto.values()), reverse=True):
        run(
            "liger",
            cp.TRL_FUSED_HEAD,
            kernels,
            n,
            note="auto at " + ",".join(str(t) for t in lengths if auto[t] == n),
        )
    if liger_ok:  # ODCTrainer on a plain model: Liger's fused linear cross-entropy replaces the forward
        cp.apply_liger_kernels(model, fused_linear_cross_entropy=True)
        auto_flce = auto_choices(kernels, cp.LIGER_FLCE)
        for n in sorted(set(auto_flce.values()), reverse=True):
            run("flce", cp.LIGER_FLCE, kernels, n, note="auto")
    return {"size": size, "lengths": lengths, "num_layers": L, "results": results, "auto": auto,
            "memory_models": memory_models, "config": config.to_dict()}  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["1.5B:8192,16384,32768", "7B:8192,16384"],
                        help="SIZE:LENGTH,LENGTH,... (each in its own process)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--device-gib", type=float, default=None, help="plan 'auto' for this much device memory"
    )
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: tiny model, short rows")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only the default path without checkpointing on single documents (no AC sweep, no calibration)",
    )
    parser.add_argument("--attn", default="sdpa_varlen",
                        help="attn_implementation (sdpa_varlen, sdpa, ...); a comma list (auto, flash_attention_4, "
                             "sdpa_varlen): those side by side, interleaved (benchmarks/attention/compare.py)")
    parser.add_argument("--ac", default="none", help="activation checkpointing of the --attn list comparison")
    parser.add_argument("--rows", default=None,
                        help="--attn list comparison: only the rows whose names start with one of these comma-separated "
                             "prefixes (e.g. grpo, tulu)")  # fmt: skip
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", default=str(report.RESULTS / "single_gpu"))
    args = parser.parse_args(argv)

    if "," in args.attn or args.attn == "auto":
        return compare_attention(args)

    specs = [("tiny", [128, 256])] if args.tiny else [
        (m.split(":")[0], [int(x) for x in m.split(":")[1].split(",")]) for m in args.models]  # fmt: skip
    options = {
        "tiny": args.tiny,
        "repeats": args.repeats,
        "device_gib": args.device_gib,
        "quick": args.quick,
        "attn": args.attn,
    }
    from benchmarks.single_gpu.compute_ceiling_report import render

    env = report.environment()
    payload = {"env": env, "args": vars(args), "peak_tflops": PEAK_TFLOPS, "loss_rtol": LOSS_RTOL, "models": [],
               "failed": []}  # fmt: skip
    stem = f"compute_ceiling_{report.hardware_tag(env)}_{report.today()}{args.tag}"
    ctx = mp.get_context("spawn")
    for size, lengths in specs:
        try:
            with ctx.Pool(1) as pool:
                payload["models"].append(pool.apply(run_model, (size, lengths, options)))
        except Exception as err:  # noqa: BLE001 - keep what the other models measured
            payload["failed"].append({"size": size, "error": f"{type(err).__name__}: {err}"})
            print(f"{size} failed: {err}", flush=True)
        markdown = render(payload)
        report.write(args.out, stem, payload, markdown)  # after every model: a later failure loses nothing
    print(markdown)
    if payload["failed"]:
        raise SystemExit(f"failed: {payload['failed']}")


def compare_attention(args) -> None:
    """``--attn A,B,...``: the implementations side by side (benchmarks/attention/compare.py), one process per model."""
    from benchmarks.attention import compare as attention_compare

    attns = [a.strip() for a in args.attn.split(",") if a.strip()]
    # --models SIZE or SIZE:TOKENS (rows of at most TOKENS tokens, e.g. 7B:16384, where 32k rows without AC do not fit)
    sizes = [("tiny", None)] if args.tiny else [(m.split(":")[0], max(int(x) for x in m.split(":")[1].split(","))
                                                 if ":" in m else None) for m in args.models]  # fmt: skip
    env = report.environment()
    payload = {"env": env, "args": vars(args), "peak_tflops": PEAK_TFLOPS, "models": [], "failed": []}
    stem = f"attention_compare_{report.hardware_tag(env)}_{report.today()}{args.tag}"
    options = {"tiny": args.tiny, "repeats": args.repeats, "ac": args.ac, "peak_tflops": PEAK_TFLOPS,
               "rows": [p.strip() for p in args.rows.split(",") if p.strip()] if args.rows else None}  # fmt: skip
    ctx = mp.get_context("spawn")
    markdown = ""
    for size, tokens in sizes:
        try:
            with ctx.Pool(1) as pool:
                payload["models"].append(pool.apply(attention_compare.run, (size, attns, {**options, "max_tokens": tokens})))
        except Exception as err:  # noqa: BLE001 - keep what the other models measured
            payload["failed"].append({"size": size, "error": f"{type(err).__name__}: {err}"})
            print(f"{size} failed: {err}", flush=True)
        markdown = attention_compare.render(payload)
        report.write(args.out, stem, payload, markdown)
    print(markdown)
    if payload["failed"]:
        raise SystemExit(f"failed: {payload['failed']}")


if __name__ == "__main__":
    main()
