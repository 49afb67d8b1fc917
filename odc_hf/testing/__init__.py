"""Fixtures for tests, examples and benchmarks: what lets odc_hf run anywhere with nothing downloaded.

- :mod:`.ranks`: :func:`run_ranks` runs a function on N fresh processes with torch.distributed initialised
  (:func:`rank_device`, :func:`cuda_backend`, :func:`free_port`), :func:`run_process` in one plain process;
- :mod:`.recipes`: :func:`accelerate_cpu` (``accelerate launch`` of this checkout on CPU) and a local model + data
  set where a recipe expects hub names (:func:`local_model_and_data`; ``python -m odc_hf.offline DIR``);
- :mod:`.data`: the offline corpus (a shipped snapshot of the Python standard library's sources, :mod:`.corpus`),
  a byte-level BPE tokenizer trained on it
  and tiny Qwen2 models: the main job's embedded defaults (``examples/sft.py``), not the training data path
  (:mod:`odc_hf.integrations.trainer.bundle`);
- :mod:`.pretrained_tokenizer`: Qwen2.5's pretrained tokenizer, offline (the ``test`` extra).

The harness is exported here (``from odc_hf.testing import run_ranks``); the data modules load torch, transformers
and datasets when imported, so they are imported by name (``from odc_hf.testing.data import default_tokenizer``).
"""

from odc_hf.testing.ranks import (
    RankOutcome,
    RanksFailed,
    cuda_backend,
    free_port,
    rank_device,
    run_process,
    run_ranks,
)
from odc_hf.testing.recipes import accelerate_cpu, local_model_and_data

__all__ = [
    "RankOutcome",
    "RanksFailed",
    "accelerate_cpu",
    "cuda_backend",
    "free_port",
    "local_model_and_data",
    "rank_device",
    "run_process",
    "run_ranks",
]
