"""A short ODCSFTTrainer job for tests/gpu/test_gpu_shm_files.py: every rank prints ``STEP <step> <rank> <pid>`` after
each optimizer step (so a test can signal a rank mid-run), and one rank can be made to raise.

    accelerate launch --config_file accelerate_configs/odc.yaml --num_processes 2 tests/support/shm_job.py OUT \\
        [--steps 6] [--step_sleep 0.5] [--raise_at 2 --raise_rank 1]
"""

from __future__ import annotations

import argparse
import os
import time


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("output_dir")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--step_sleep", type=float, default=0.0, help="seconds each rank waits after a step")
    p.add_argument("--raise_at", type=int, default=None, help="this step raises RuntimeError on --raise_rank")
    p.add_argument("--raise_rank", type=int, default=1)
    args = p.parse_args(argv)

    from transformers import TrainerCallback

    from odc_hf import ODCConfig, ODCSFTConfig, ODCSFTTrainer
    from odc_hf.testing.data import default_text_dataset, default_tokenizer, tiny_qwen2_model

    class Steps(TrainerCallback):
        def on_step_end(self, train_args, state, control, **kwargs):
            rank = int(os.environ.get("RANK", "0"))
            print(f"STEP {state.global_step} {rank} {os.getpid()}", flush=True)
            if args.raise_at == state.global_step and rank == args.raise_rank:
                raise RuntimeError(f"shm_job: rank {rank} fails at step {state.global_step} on purpose")
            time.sleep(args.step_sleep)

    tok = default_tokenizer()
    config = ODCSFTConfig(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=2,
                          report_to="none", bf16=False, max_length=256, logging_steps=1, save_strategy="no",
                          learning_rate=1e-3, disable_tqdm=True)  # fmt: skip
    trainer = ODCSFTTrainer(model=tiny_qwen2_model(tok), args=config, train_dataset=default_text_dataset(64),
                            processing_class=tok, callbacks=[Steps()],
                            odc_config=ODCConfig(max_tokens_per_microbatch=512, truncate=True))  # fmt: skip
    trainer.train()
    print(f"DONE {os.environ.get('RANK', '0')} {os.getpid()}", flush=True)


if __name__ == "__main__":
    main()
