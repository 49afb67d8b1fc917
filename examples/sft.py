r"""SFT with ODC + LB-Mini through TRL's SFTTrainer: the main job.

    python examples/sft.py                  # 2 processes: GPUs if there are 2+, else CPU; tiny offline default
    python examples/sft.py --num_processes 1    # one process, on your GPU if there is one (docs/quickstart.md)
    accelerate launch --config_file accelerate_configs/odc.yaml examples/sft.py --model_shape 1.5B \
        --workload longalign --max_tokens_per_microbatch 32768 --bf16 --gradient_checkpointing
    accelerate launch --config_file accelerate_configs/odc.yaml examples/sft.py \
        --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name trl-lib/Capybara     # where a hub is reachable
    accelerate launch --config_file accelerate_configs/odc_hsdp.yaml --machine_rank 0 --main_process_ip 10.0.0.1 \
        examples/sft.py ...             # 2 nodes x 8 GPUs (HSDP), on each node: docs/multi_node.md

Defaults need no network: a tiny Qwen2-architecture model built from a config, a byte-level BPE trained on the
snapshot of the Python standard library's sources shipped with odc_hf (the same on every Python build), and those
sources as documents (a naturally long-tailed length mix).
``--workload longalign|swe_smith|tulu`` instead draws synthetic sample lengths from odc_hf.prediction.workloads (random
tokens: throughput needs no real text). Prints a summary (loss, tokens/s, bubble rate) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    from odc_hf.config import parse_count

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", default=None, help="hub model (default: tiny model from a config)")
    p.add_argument("--model_shape", choices=["tiny", "1.5B", "7B", "14B", "32B"], default="tiny",
                   help="random-init Qwen2/2.5 shape when no --model_name_or_path")  # fmt: skip
    p.add_argument("--dataset_name", default=None, help="hub dataset with a 'text' or 'messages' column")
    p.add_argument("--workload", choices=["stdlib", "longalign", "swe_smith", "tulu"], default="stdlib")
    p.add_argument("--num_samples", type=int, default=256)
    p.add_argument("--max_length", type=int, default=1024, help="samples are cut to this many tokens")
    p.add_argument("--max_steps", type=int, default=10)
    p.add_argument("--per_device_train_batch_size", type=int, default=4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--output_dir", default="output/sft")
    p.add_argument(
        "--attn_implementation",
        default="sdpa_varlen",
        help="sdpa_varlen (per-document SDPA on packed rows, odc_hf.attention), flash_attention_2, sdpa, ...",
    )
    p.add_argument("--attention", default=None, choices=["auto", "flash_attention_4", "sdpa_varlen", "model"],
                   help="ODCConfig.attention (default auto: flash_attention_4 where it runs, else sdpa_varlen)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--gradient_checkpointing", action="store_true", help="same as --activation_checkpointing full")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logging_steps", type=int, default=1)
    p.add_argument("--save_steps", type=int, default=0, help="checkpoint every N steps (0: never)")
    p.add_argument("--resume_from_checkpoint", default=None,
                   help="a checkpoint folder, or true / last: the newest complete checkpoint in --output_dir")  # fmt: skip
    p.add_argument("--report_to", default="none")
    p.add_argument("--num_processes", type=int, default=2,
                   help="processes of `python examples/sft.py` (ignored under accelerate launch): 2 run ODC on 2+ "
                        "GPUs, share the GPU on a one-GPU machine, run on CPU without GPUs; 1 runs here, on the "
                        "GPU if there is one")  # fmt: skip
    # ODC options (also settable as ODC_* environment variables)
    p.add_argument("--odc", choices=["on", "off"], default=None, help="off: FSDP2 collectives (A/B baseline)")
    p.add_argument("--balance", choices=["lb_mini", "lb_micro", "none"], default=None)
    p.add_argument("--cost_model", default=None, help="flop | tokens | calibration.json")
    p.add_argument("--max_tokens_per_microbatch", type=parse_count, default=None, help="e.g. 32768 or 32k")
    p.add_argument("--truncate", action="store_true", default=None,
                   help="cut samples longer than the token budget to it instead of stopping with an error")  # fmt: skip
    p.add_argument("--activation_checkpointing", default=None,
                   help="auto (default: the least recomputation that fits the GPU) | full | none | a fraction like 0.5")
    p.add_argument("--losses_json", default=None, help="write per-step losses and microbatch counts here")
    args = p.parse_args(argv)
    # what can be checked here is, once, before processes are launched and load the model and the data
    if args.num_samples < 1:
        p.error(f"--num_samples must be at least 1, got {args.num_samples}")
    name = args.model_name_or_path
    if name and (name.startswith((".", "/", "~")) or name.count("/") > 1) and not Path(name).expanduser().is_dir():
        p.error(f"--model_name_or_path {name!r} is not a directory (a local path), nor a hub name such as Qwen/Qwen2.5-0.5B")
    from odc_hf.config import ODCConfig

    try:
        balance = args.balance or ("lb_micro" if args.odc == "off" else None)  # as main() sets it
        ODCConfig.from_env(max_tokens_per_microbatch=args.max_tokens_per_microbatch, balance=balance,
                           cost_model=args.cost_model, activation_checkpointing=args.activation_checkpointing,
                           enabled=None if args.odc is None else args.odc == "on")  # fmt: skip
    except ValueError as err:
        p.error(str(err))
    return args


def build_model(args, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

    import odc_hf.attention  # noqa: F401 - registers "sdpa_varlen"
    from odc_hf.prediction.workloads import qwen2_5_config
    from odc_hf.testing.data import tiny_qwen2_model

    if args.model_name_or_path:
        return AutoModelForCausalLM.from_pretrained(
            args.model_name_or_path, dtype=torch.float32, attn_implementation=args.attn_implementation
        )
    if args.model_shape == "tiny":
        model = tiny_qwen2_model(tokenizer, seed=args.seed)
        model.set_attn_implementation(args.attn_implementation)
        return model
    config = qwen2_5_config(args.model_shape)
    config.tie_word_embeddings = args.model_shape == "1.5B"  # as the released Qwen2.5 models
    config.use_cache = False
    config._attn_implementation = args.attn_implementation
    torch.manual_seed(args.seed)
    # Random init of a billion parameters is slow on a CPU: build on this rank's GPU (same seed on every rank).
    with torch.device(training_device()):
        return Qwen2ForCausalLM(config)


def training_device():
    """The device accelerate will give this process: CPU for CPU ranks (``ACCELERATE_USE_CPU``, set by the launcher
    for CPU runs, even where CUDA is visible), else this rank's GPU; never a GPU picked from LOCAL_RANK on its own."""
    import torch

    if os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes") or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())


def peak_memory_gib(trainer) -> list[float] | None:
    """Every rank's peak CUDA memory (GiB, torch's allocator) over the run; ``None`` on CPU. Collective."""
    import torch

    device = trainer.accelerator.device
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    if trainer.accelerator.num_processes == 1:
        return [peak]
    import torch.distributed as dist

    peaks: list = [None] * trainer.accelerator.num_processes
    dist.all_gather_object(peaks, peak)
    return peaks


def build_dataset(args, tokenizer, vocab_size: int):
    from datasets import Dataset, load_dataset

    from odc_hf.prediction.workloads import generate_lengths
    from odc_hf.testing.data import default_text_dataset

    if args.dataset_name:
        return load_dataset(args.dataset_name, split="train").select(range(args.num_samples))
    if args.workload == "stdlib":
        return default_text_dataset(args.num_samples, seed=args.seed)
    import numpy as np

    lengths = generate_lengths(args.workload, args.num_samples, args.seed, max_length=args.max_length)
    rng = np.random.default_rng(args.seed)
    ids = [rng.integers(10, vocab_size, int(n)).tolist() for n in lengths]
    return Dataset.from_dict({"input_ids": ids})


def main(argv=None):
    """Train as the arguments say; returns the trainer."""
    args = parse_args(argv)
    from odc_hf import ODCConfig, ODCSFTConfig, ODCSFTTrainer
    from odc_hf.testing.data import default_tokenizer

    tokenizer = default_tokenizer() if not args.model_name_or_path else None
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    model = build_model(args, tokenizer)
    dataset = build_dataset(args, tokenizer, model.config.vocab_size)
    balance = args.balance or ("lb_micro" if args.odc == "off" else None)  # collectives need equal counts
    odc_config = ODCConfig.from_env(
        enabled=None if args.odc is None else args.odc == "on",
        balance=balance, cost_model=args.cost_model, max_tokens_per_microbatch=args.max_tokens_per_microbatch,
        truncate=args.truncate, attention=args.attention,
        activation_checkpointing=args.activation_checkpointing or ("full" if args.gradient_checkpointing else None),
    )  # fmt: skip
    sft_args = ODCSFTConfig(  # TRL's SFTConfig (+ odc_* fields, unused here: odc_config= below wins)
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, learning_rate=args.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, seed=args.seed,
        logging_steps=args.logging_steps, save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500, report_to=args.report_to, bf16=args.bf16, max_length=args.max_length,
        packing=False, gradient_checkpointing=False, dataloader_drop_last=True,  # odc_hf owns checkpointing
        disable_tqdm=False, use_liger_kernel=False, dataset_num_proc=None,
    )  # fmt: skip
    trainer = ODCSFTTrainer(model=model, args=sft_args, train_dataset=dataset, processing_class=tokenizer,
                            odc_config=odc_config)  # fmt: skip
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    peak_memory_per_rank = peak_memory_gib(trainer)  # a collective: every rank
    if trainer.accelerator.is_main_process:
        history = [h for h in trainer.state.log_history if "loss" in h]
        summary = getattr(trainer, "odc_summary", {})
        if args.losses_json:
            steps = [
                {"microbatches": s.microbatches, "busy_s": s.busy_s, "wait_s": s.wait_s}
                for s in trainer.odc_stats.steps
            ]
            mesh = getattr(next(trainer.model.parameters()), "device_mesh", None)  # fully_shard's (HSDP: 2-D)
            summary = {**summary, "peak_memory_gib_per_rank": peak_memory_per_rank}
            Path(args.losses_json).write_text(
                json.dumps({"history": history, "summary": summary, "steps": steps,
                            "attention": trainer.odc_attention, "attention_warm_up": trainer.odc_attention_warm_up,
                            "mesh": mesh and {"ranks": mesh.mesh.tolist(), "names": list(mesh.mesh_dim_names or ())}},
                           indent=1)
            )
    return trainer


if __name__ == "__main__":
    parse_args()  # --help and bad flags are answered here, once, before any process is launched
    from odc_hf.integrations.launch.relaunch import relaunch_if_needed

    relaunch_if_needed(__file__, sys.argv[1:], config_dir=ROOT / "accelerate_configs",
                       processes=parse_args().num_processes)  # fmt: skip
    main()
