"""The Trainer paths end to end, through `accelerate launch` with 2 processes: the checks the CPU test suite runs,
here on GPUs (ODC over symmetric memory, FSDP2 over NCCL) when there are 2, else on CPU.

    python -m benchmarks.sft.trainer_checks --out benchmarks/results                   # all checks
    python -m benchmarks.sft.trainer_checks --checks sft,resume --out /tmp/checks     # some

Checks (each runs the repository's examples in fresh processes and compares their per-step records):
- ``sft``: `examples/sft.py`, ODCSFTTrainer + LB-Mini (uneven microbatch counts) vs FSDP2 collectives + LB-Micro,
  fp32, same global minibatches: per-step losses and gradient norms; on CUDA also whether the trainer planned the
  attention shapes (`trainer.odc_attention_warm_up`, bf16 run).
- ``resume``: the ODC run saves at step 5; a second run resumes from that checkpoint: steps 6-10 again.
- ``elastic`` (4 GPUs or more): an ODC run on 4 processes (4 samples each, 16 per step) saves at step 5; a run on 2
  processes (8 each: the same 16 per step) resumes from that checkpoint: steps 6-10 equal the 4-process run's.
- ``grpo``: `examples/grpo.py --fixed_rollouts`, ODCGRPOTrainer + LB-Mini vs TRL's GRPOTrainer (collectives),
  fp32, loss types dapo and grpo, KL reference model (beta 0.05): per-step losses and gradient norms.
- ``grpo_generate``: ODCGRPOTrainer with `generate()` (no lockstep), bf16 on GPUs: finishes, finite losses.

Writes ``trainer_checks_<hardware>_<date>.{json,md}``. Tolerances (the CPU tests'): losses 1e-5 relative or 1e-7
absolute (GRPO's first on-policy step has loss 0 up to rounding), gradient norms 1e-4 relative.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import report
from odc_hf.testing.compare import check_rows, compare

ROOT = Path(__file__).resolve().parents[2]

CHECKS = ("sft", "resume", "elastic", "grpo", "grpo_generate")
SFT = ["--workload", "tulu", "--max_steps", "10", "--max_length", "2048", "--max_tokens_per_microbatch", "2048",
       "--per_device_train_batch_size", "8", "--learning_rate", "1e-3"]  # fmt: skip
GRPO = ["--max_steps", "4", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
        "--max_completion_length", "48"]  # fmt: skip


def launch(script: str, out: Path, *args, mixed_precision: str = "no", timeout: float = 400,
           num_processes: int = 2) -> dict:  # fmt: skip
    """Run ``script`` on 2 processes (GPUs through accelerate_configs/odc.yaml, else CPU; ``num_processes`` other than
    2: GPUs only); its losses JSON.

    The full output goes to ``out/log.txt``."""
    import torch

    from odc_hf.transport.peer_memory import SAFE_GPU_ENV

    out.mkdir(parents=True, exist_ok=True)
    args = [*map(str, args), "--output_dir", str(out), "--losses_json", str(out / "losses.json")]
    start = time.perf_counter()
    if torch.cuda.device_count() >= 2:
        env = {**os.environ, **SAFE_GPU_ENV, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs/odc.yaml"),
               "--num_processes", str(num_processes), "--mixed_precision", mixed_precision, "--main_process_port", "0",
               str(ROOT / script), *args]  # fmt: skip
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    else:
        from odc_hf.testing import accelerate_cpu

        if mixed_precision != "no":
            raise ValueError("CPU runs are fp32 (transformers rejects bf16 training on CPU)")
        proc = accelerate_cpu(ROOT / script, *args, timeout=timeout,
                              env={"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})  # fmt: skip
    (out / "log.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-4000:]}{proc.stderr[-8000:]}")
    print(f"  {out.name}: {script} ran in {time.perf_counter() - start:.0f} s", flush=True)
    return json.loads((out / "losses.json").read_text())


def uneven(record: dict) -> list:
    return [s["microbatches"] for s in record.get("steps", []) if len(set(s["microbatches"])) > 1]


def run_checks(checks, work: Path) -> list[dict]:
    import torch

    cuda = torch.cuda.device_count() >= 2
    results = []
    if "sft" in checks or "resume" in checks:
        odc = launch("examples/sft.py", work / "sft_odc", *SFT, "--odc", "on", "--balance", "lb_mini",
                     "--save_steps", "5")  # fmt: skip
    if "sft" in checks:
        fsdp = launch("examples/sft.py", work / "sft_fsdp", *SFT, "--odc", "off", "--balance", "lb_micro")
        r = compare("sft: ODCSFTTrainer + LB-Mini vs FSDP2 + LB-Micro (fp32)", odc["history"], fsdp["history"])
        r["uneven_steps"] = len(uneven(odc))
        r["ok"] = r["ok"] and r["uneven_steps"] > 0 and len(odc["history"]) == 10
        results.append(r)
        if cuda:  # the trainer's attention warm-up runs under half precision only
            bf16 = launch("examples/sft.py", work / "sft_bf16", *SFT, "--odc", "on", "--balance", "lb_mini",
                          "--bf16", mixed_precision="bf16")  # fmt: skip
            warm = bf16.get("attention_warm_up")
            losses = [h["loss"] for h in bf16["history"]]
            # sdpa_varlen plans its cuDNN shapes; FlashAttention-4 (attention="auto" where installed) compiles once
            warmed = bool(warm and (warm["shapes"] >= 2 or warm.get("kind") == "flash_attention_4"))
            results.append({"name": "sft bf16: trainer warmed up the attention (sdpa_varlen shapes / FA4 kernels)",
                            "ok": warmed and all(map(math.isfinite, losses)),
                            "warm_up": warm, "losses": losses, "why": "" if warm else "no warm-up recorded"})  # fmt: skip
    if "resume" in checks:
        checkpoint = work / "sft_odc" / "checkpoint-5"
        again = launch("examples/sft.py", work / "sft_odc", *SFT, "--odc", "on", "--balance", "lb_mini",
                       "--resume_from_checkpoint", checkpoint)  # fmt: skip
        r = compare("resume: ODC run from its step-5 checkpoint, steps 6-10", again["history"], odc["history"],
                    steps=range(6, 11))  # fmt: skip
        r["exact"] = r.get("max_abs_loss") == 0.0
        r["ok"] = r["ok"] and len(again["steps"]) == 5
        results.append(r)
    if "elastic" in checks:
        results.append(elastic(work) if torch.cuda.device_count() >= 4 else
                       {"name": "elastic: 4 -> 2 processes", "ok": True, "skipped": "needs 4 GPUs", "why": ""})  # fmt: skip
    if "grpo" in checks:
        common = [*GRPO, "--fixed_rollouts", "--loss_type", "dapo,grpo", "--beta", "0.05"]
        odc = launch("examples/grpo.py", work / "grpo_odc", *common, "--trainer", "odc", "--balance", "lb_mini",
                     "--max_tokens_per_microbatch", "64")  # fmt: skip
        trl = launch("examples/grpo.py", work / "grpo_trl", *common, "--trainer", "trl")
        for loss_type in ("dapo", "grpo"):
            r = compare(f"grpo {loss_type}: ODCGRPOTrainer + LB-Mini vs TRL GRPOTrainer (fp32, beta 0.05)",
                        odc[loss_type]["history"], trl[loss_type]["history"])  # fmt: skip
            r["uneven_steps"] = len(uneven(odc[loss_type]))
            results.append(r)
    if "grpo_generate" in checks:
        half = ["--bf16"] if cuda else []  # transformers trains bf16 on GPUs only
        gen = launch("examples/grpo.py", work / "grpo_generate", *GRPO, "--trainer", "odc", "--max_steps", "3",
                     *half, mixed_precision="bf16" if cuda else "no")  # fmt: skip
        history = gen["dapo"]["history"]
        losses = [h["loss"] for h in history]
        results.append({"name": f"grpo_generate: ODCGRPOTrainer with generate(), {'bf16' if cuda else 'fp32'}, 3 steps",
                        "ok": len(losses) == 3 and all(map(math.isfinite, losses)), "losses": losses,
                        "rewards": [h.get("reward") for h in history],
                        "microbatches": [s["microbatches"] for s in gen["dapo"]["steps"]], "why": ""})  # fmt: skip
    return results


def elastic(work: Path) -> dict:
    """Checkpoint on 4 GPUs, resume on 2 with the same 16 samples per step (``per_device_train_batch_size`` 4 -> 8)."""
    at = SFT.index("--per_device_train_batch_size")
    args = SFT[:at] + SFT[at + 2 :]
    first = launch("examples/sft.py", work / "elastic_4", *args, "--per_device_train_batch_size", "4", "--odc", "on",
                   "--balance", "lb_mini", "--save_steps", "5", num_processes=4)  # fmt: skip
    again = launch("examples/sft.py", work / "elastic_2", *args, "--per_device_train_batch_size", "8", "--odc", "on",
                   "--balance", "lb_mini", "--resume_from_checkpoint", work / "elastic_4" / "checkpoint-5")  # fmt: skip
    r = compare("elastic: checkpoint of 4 processes resumed on 2, steps 6-10", again["history"], first["history"],
                steps=range(6, 11))  # fmt: skip
    r["ok"] = r["ok"] and len(again["steps"]) == 5 and all(len(s["microbatches"]) == 2 for s in again["steps"])
    return r


def markdown(payload: dict) -> str:
    """The report: the environment, then one table row per check (:func:`odc_hf.testing.compare.check_rows`)."""
    description = "Checks" + __doc__.split("Checks", 1)[1].split("Writes")[0].rstrip()
    lines = ["# Trainer paths end to end (2 processes through `accelerate launch`)", "",
             report.env_markdown(payload["env"]).rstrip(), "", description, "",
             *report.table(["check", "ok", "max rel. loss diff", "max abs. loss diff", "max rel. grad-norm diff", "notes"],
                           check_rows(payload["results"]), "llrrrl")]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from benchmarks.common import report

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma list of {', '.join(CHECKS)}")
    parser.add_argument("--out", default=str(report.RESULTS / "sft"))
    parser.add_argument("--work", default=None, help="scratch folder for the runs (default: OUT/trainer_checks_runs)")
    args = parser.parse_args(argv)
    checks = args.checks.split(",")
    if unknown := set(checks) - set(CHECKS):
        parser.error(f"unknown checks {sorted(unknown)}; choose from {', '.join(CHECKS)}")
    env = report.environment()
    work = Path(args.work or Path(args.out) / "trainer_checks_runs")
    results = run_checks(checks, work)
    payload = {"env": env, "results": results}
    text = markdown(payload)
    report.write(args.out, f"trainer_checks_{report.hardware_tag(env)}_{env['date'][:10]}", payload, text)
    print(text)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
