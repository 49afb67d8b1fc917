"""A real-size run with its ranks sharing one GPU: ODCSFTTrainer on 2 ranks of one GPU (gloo, CUDA IPC) against one
process on the same GPU, the same samples in the same order, and the bf16 noise of the one-process run against itself.

    python -m benchmarks.transport.shared_gpu_real_size --out $OUT [--steps 6] [--samples_per_step 4]

Qwen2.5-1.5B shape (random init, bf16, odc_hf's default compute path: TRL's fused LM head, Liger when installed,
``attention="auto"``, ``activation_checkpointing="auto"``), LongAlign-like rows up to 32k tokens
(``examples/sft.py --workload longalign``). Runs, one after another: world 1, world 1 again (the noise), world 2
sharing the GPU. Per-step losses compared against the first world-1 run; peak memory per rank (torch's allocator).
Writes ``shared_gpu_real_size_<hw>_<date>.md`` + ``.json`` (benchmarks/common/report.py). Correctness, not speed: two ranks
on one GPU share its SMs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from benchmarks.common import report  # noqa: E402

VARIANTS = {  # name: (processes, extra examples/sft.py flags)
    "world1": (1, []),
    "world1_again": (1, []),
    "world2_shared": (2, []),
    "world2_shared_again": (2, []),
    "world2_lb_micro": (2, ["--balance", "lb_micro"]),
    "world2_fsdp2_collectives": (2, ["--odc", "off", "--balance", "lb_micro"]),
}


def run(out: Path, processes: int, args, extra=()) -> dict:
    per_device = args.samples_per_step // processes
    cmd = [sys.executable, str(ROOT / "examples/sft.py"), "--num_processes", str(processes), "--model_shape", "1.5B",
           "--workload", "longalign", "--max_length", "32768", "--max_tokens_per_microbatch", "32768", "--bf16",
           "--num_samples", str(args.samples_per_step * args.steps), "--max_steps", str(args.steps),
           "--per_device_train_batch_size", str(per_device), "--learning_rate", "1e-5", "--output_dir", str(out),
           "--losses_json", str(out / "losses.json"), "--seed", "0", *extra]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "ODC_NO_RELAUNCH")}
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    seconds = time.perf_counter() - start
    out.mkdir(parents=True, exist_ok=True)
    (out / "log.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{processes}-process run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    data = json.loads((out / "losses.json").read_text())
    summary = next((line for line in proc.stdout.splitlines() if line.startswith("odc_hf summary")), "")
    return {"processes": processes, "seconds": round(seconds, 1), "losses": [h["loss"] for h in data["history"]],
            "peak_memory_gib_per_rank": data["summary"].get("peak_memory_gib_per_rank"),
            "microbatches": [s["microbatches"] for s in data["steps"]], "attention": data["attention"],
            "summary": summary, "command": " ".join(cmd[1:])}  # fmt: skip


def rel(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--samples_per_step", type=int, default=4)
    p.add_argument("--timeout", type=float, default=420)
    p.add_argument("--variants", default="world1,world1_again,world2_shared", help=f"of {sorted(VARIANTS)}")
    p.add_argument("--merge", type=Path, nargs="*", default=[],
                   help="runs JSON files of earlier calls (same commit, same GPU) to report together with these")
    args = p.parse_args(argv)
    env = report.environment()
    runs = {}
    for path in args.merge:
        earlier = json.loads(path.read_text())
        env = earlier["environment"] if not runs else env
        runs.update(earlier["runs"])
    for name in filter(None, args.variants.split(",")):
        processes, extra = VARIANTS[name]
        runs[name] = run(args.out / name, processes, args, extra)
    (args.out / "runs.json").write_text(json.dumps({"environment": env, "runs": runs}, indent=1))
    if "world1" not in runs or "world1_again" not in runs or "world2_shared" not in runs:
        return
    ref = runs["world1"]["losses"]
    noise, shared = rel(runs["world1_again"]["losses"], ref), rel(runs["world2_shared"]["losses"], ref)
    same_world = {name: rel(r["losses"], runs["world2_shared"]["losses"]) for name, r in runs.items()
                  if name.startswith("world2_") and name != "world2_shared"}  # fmt: skip
    payload = {"environment": env, "runs": runs, "noise_rel": noise, "shared_rel": shared,
               "world2_rel_to_world2_shared": same_world}  # fmt: skip
    losses = "\n".join(report.table(
        ["step", "world 1", "world 1 again", "world 2 sharing the GPU", "world 1 vs itself (rel.)",
         "world 2 vs world 1 (rel.)", "microbatches per rank (world 2)"],
        [[i + 1, f"{ref[i]:.6f}", f"{runs['world1_again']['losses'][i]:.6f}", f"{runs['world2_shared']['losses'][i]:.6f}",
          f"{noise[i]:.2e}", f"{shared[i]:.2e}", runs["world2_shared"]["microbatches"][i]] for i in range(len(ref))],
        "rrrrrrl",
    ))  # fmt: skip
    peaks = {k: r["peak_memory_gib_per_rank"] for k, r in runs.items()}
    md = f"""# Real-size run, ranks sharing one GPU: 1.5B, LongAlign-like rows to 32k

{report.env_markdown(env)}
ODCSFTTrainer, Qwen2.5-1.5B shape (random init), bf16, odc_hf's default compute path, {args.samples_per_step}
LongAlign-like samples per step, {args.steps} steps, the same samples in the same order in every run. World 2: both
ranks on cuda:0 ({runs['world2_shared']['summary']}).

{losses}

- bf16 noise (world 1 against itself): max {max(noise):.2e}, median {sorted(noise)[len(noise) // 2]:.2e}
- world 2 against world 1: max {max(shared):.2e}, median {sorted(shared)[len(shared) // 2]:.2e}
- other world-2 runs against the world-2 ODC run (max relative per step): {json.dumps({k: f"{max(v):.2e}" for k, v in same_world.items()})}
{"".join(f"  - {k}: {[round(x, 6) for x in runs[k]['losses']]}" + chr(10) for k in same_world)}
- peak memory per rank, GiB (torch's allocator): {json.dumps({k: [round(x, 1) for x in v or []] for k, v in peaks.items()})}
- wall seconds per run: {json.dumps({k: r['seconds'] for k, r in runs.items()})}; attention: {runs['world1']['attention']}
"""
    stem = f"shared_gpu_real_size_{report.hardware_tag(env)}_{report.today()}"
    report.write(args.out, stem, payload, md)
    print(md)


if __name__ == "__main__":
    main()
