"""What the recipe tests run on, offline: ``accelerate launch`` of this checkout on CPU (:func:`accelerate_cpu`), and a
local model folder and data set where a recipe expects hub names (:func:`write_model_and_data`, which
``python -m odc_hf.offline DIR`` runs; :func:`local_model_and_data`).

Writes ``DIR/model``: a tiny Qwen2 causal LM (random weights, 2 layers) with odc_hf's offline byte-level BPE tokenizer
(ChatML template), loadable with ``AutoModelForCausalLM.from_pretrained`` / ``--model_name_or_path``; and
``DIR/data/train.jsonl``: conversations of real text (``{"messages": [user, assistant]}``, from the Python standard
library's docstrings), loadable with ``datasets.load_dataset`` / ``--dataset_name``. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["CPU_LAUNCH_ENV", "accelerate_cpu", "local_model_and_data", "write_model_and_data"]

# What :func:`accelerate_cpu` adds to the environment of its processes: CPU ranks (accelerate_configs/cpu.yaml),
# one torch thread each, offline.
CPU_LAUNCH_ENV = {"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                  "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


def accelerate_cpu(*args, env: dict | None = None, cwd=None, timeout: float = 600,
                   config: str = "cpu.yaml") -> subprocess.CompletedProcess:  # fmt: skip
    """``accelerate launch --config_file accelerate_configs/<config> --main_process_port 0 *args`` from the checkout.

    ``cpu.yaml``: two CPU processes; ``cpu_hsdp.yaml``: four, as a 2 x 2 HSDP mesh. Offline (no hub, no datasets
    downloads), one torch thread each; ``env`` entries are added to the environment. Returns the finished process
    (output captured as text). For the tests of this repository.
    """
    root = Path(__file__).resolve().parents[2]  # the checkout: odc_hf/testing/ is two levels down
    full_env = {**os.environ, **CPU_LAUNCH_ENV, **(env or {})}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(root / "accelerate_configs" / config),
           "--main_process_port", "0", *map(str, args)]  # fmt: skip
    return subprocess.run(cmd, env=full_env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def write_model_and_data(directory, rows: list[dict] | None = None, *, tokenizer=None, num_rows: int = 64,
                         eos_prone: bool = False, **config_kwargs) -> tuple[Path, Path]:  # fmt: skip
    """Write ``directory/model`` (the tiny Qwen2 model sized to ``tokenizer`` and the tokenizer; default: the embedded
    ``odc_hf.testing.data.default_tokenizer()``) and ``directory/data/train.jsonl`` (``rows``, one JSON object a line;
    default: ``num_rows`` conversations of ``odc_hf.testing.data.default_conversations``). Returns both folders.
    ``config_kwargs`` go to the model's config (e.g. ``tie_word_embeddings=False``); ``eos_prone=True`` makes the
    model end its completions early (``odc_hf.testing.data.make_eos_prone``: lengths that differ, for GRPO)."""
    from odc_hf.testing.data import default_conversations, default_tokenizer, make_eos_prone, tiny_qwen2_model

    model_dir, data_dir = Path(directory) / "model", Path(directory) / "data"
    tokenizer = tokenizer if tokenizer is not None else default_tokenizer()
    rows = rows if rows is not None else default_conversations(num_rows, max_chars=600)
    model = tiny_qwen2_model(tokenizer, **config_kwargs)
    if eos_prone:
        make_eos_prone(model)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return model_dir, data_dir


def local_model_and_data(directory, rows: list[dict], tokenizer=None, **config_kwargs) -> tuple[Path, Path]:
    """Offline stand-ins for a hub model and a hub data set, for recipe tests: :func:`write_model_and_data`
    (``python -m odc_hf.offline``) with the rows given: the tiny Qwen2 model sized to ``tokenizer`` (default: the
    embedded ``odc_hf.testing.data.default_tokenizer()``; a pretrained one:
    ``odc_hf.testing.pretrained_tokenizer.qwen2_5_tokenizer()``) and the tokenizer saved in ``directory/model``, ``rows``
    as ``directory/data/train.jsonl``. Returns both folders. ``config_kwargs`` go to the model's config (e.g.
    ``tie_word_embeddings=False``)."""
    return write_model_and_data(directory, rows, tokenizer=tokenizer, **config_kwargs)
