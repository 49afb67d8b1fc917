"""ODCSFTTrainer from a notebook: accelerate's notebook_launcher starts 2 CPU processes, ODC is installed, and both
ranks log the same finite, falling losses (the logged loss is the global one).

Run as a subprocess because notebook_launcher must start from a process with no distributed state."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap

import pytest

CELL = textwrap.dedent(
    """
    import os, sys
    from accelerate import notebook_launcher

    def train(output_dir):
        from trl import SFTConfig
        from odc_hf import ODCConfig, ODCSFTTrainer
        from odc_hf.testing.data import default_text_dataset, default_tokenizer, tiny_qwen2_model

        tok = default_tokenizer()
        args = SFTConfig(output_dir=output_dir, max_steps=3, per_device_train_batch_size=2, report_to="none",
                         bf16=False, max_length=256, logging_steps=1, save_strategy="no", use_cpu=True,
                         learning_rate=1e-3)
        trainer = ODCSFTTrainer(model=tiny_qwen2_model(tok), args=args, train_dataset=default_text_dataset(32),
                                processing_class=tok, odc_config=ODCConfig(max_tokens_per_microbatch=512, truncate=True))
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print("RESULT", trainer.accelerator.process_index, trainer.accelerator.num_processes, trainer.odc is not None,
              losses, flush=True)

    # Not the default port 29500 (another job on a shared host may hold it), and not "0" (the launcher's workers
    # then wait on port 0 forever): a port that was free a moment ago, and another one should it be taken meanwhile.
    from odc_hf.testing import free_port

    for attempt in range(3):
        try:
            notebook_launcher(train, args=(sys.argv[1],), num_processes=2, use_port=str(free_port()))
            break
        except Exception as err:  # noqa: BLE001
            if "EADDRINUSE" not in str(err) or attempt == 2:
                raise
            print("port taken, retrying:", err, flush=True)
    """
)


@pytest.mark.slow
def test_notebook_launcher_runs_odc_on_two_cpu_processes(tmp_path):
    script = tmp_path / "cell.py"
    script.write_text(CELL)
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    # A session of its own, so that a hung launch can be killed with its workers (they outlive the cell otherwise).
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "out")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail("the notebook launch did not finish in 300 s:\n" + stderr[-4000:])
    assert proc.returncode == 0, stderr[-4000:]
    proc = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    results = [line.split(" ", 4)[1:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert sorted(r[:3] for r in results) == [["0", "2", "True"], ["1", "2", "True"]], proc.stdout[-2000:]
    losses = [json.loads(r[3]) for r in results]
    assert losses[0] == losses[1] and len(losses[0]) == 3, losses  # the global loss, the same on both ranks
    assert all(math.isfinite(x) for x in losses[0]) and losses[0][-1] < losses[0][0], losses
