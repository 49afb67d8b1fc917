"""The vLLM version policy and environment of odc_hf's vLLM generation (``ODCGRPOTrainer(use_vllm=True)``).

odc_hf pushes its weights into the colocated engine through vLLM's ``LLM.apply_model`` and the model's
``load_weights``, and relies on TRL's ``VLLMGeneration`` for everything else; it is tested on the vLLM minor versions
in :data:`TESTED_VLLM` (``odc_hf.version.TESTED``). vllm 0.26.0 is the last release that pins torch 2.11 (with CUDA 13
extras); 0.28 and later pin torch 2.13. Another minor warns once, naming the tested ones (odc_hf's version policy:
``odc_hf.version``); a missing ``LLM.apply_model`` is refused by name. Add a minor to ``odc_hf.version.TESTED`` once
the GPU tests (``tests/gpu/test_grpo_vllm_gpu.py``) pass on it.

The environment vLLM needs beside a trainer, set where the user has not set it (their value is kept), before TRL
builds the engine (:func:`prefer_vllm_environment`):

- ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine runs in the training process. vLLM's multiprocess engine hung at
  start-up on an H200 (torch 2.11.0+cu130; no output for minutes); in-process, ``apply_model`` hands the weights to the model
  without copying them to another process. (vLLM 0.26 also sets it itself for the ``external_launcher`` executor
  that colocated engines use.)
- ``VLLM_USE_FLASHINFER_SAMPLER=0``, only where FlashInfer is not importable: vLLM's default top-k / top-p sampler
  on CUDA is FlashInfer's; without the package it falls back to PyTorch's.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections.abc import MutableMapping

from odc_hf.version import TESTED, warn_if_untested

TESTED_VLLM = TESTED["vllm"]
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
FLASHINFER_SAMPLER_ENV = "VLLM_USE_FLASHINFER_SAMPLER"


def installed_vllm() -> str | None:
    """The installed vLLM's version, or ``None``."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_vllm(version: str | None = None) -> str:
    """Refuse a missing vLLM, saying what to install; warn once on one outside :data:`TESTED_VLLM`; returns the
    version."""
    version = version or installed_vllm()
    if version is None:
        raise ImportError(
            f"use_vllm=True needs vLLM: pip install 'odc_hf[vllm]' (vllm=={TESTED_VLLM[-1]}.0, which pins torch 2.11), "
            "or generate with use_vllm=False"
        )
    warn_if_untested("vllm", versions={"vllm": version})
    return version


def flashinfer_importable() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def prefer_vllm_environment(environ: MutableMapping[str, str] | None = None, *,
                            flashinfer: bool | None = None) -> dict[str, str]:  # fmt: skip
    """Set the variables of the module docstring in ``environ`` (default ``os.environ``) where they are unset; returns
    what was set. ``flashinfer``: whether FlashInfer is importable (default: look)."""
    environ = os.environ if environ is None else environ
    wanted = {MULTIPROCESSING_ENV: "0"}
    if not (flashinfer_importable() if flashinfer is None else flashinfer):
        wanted[FLASHINFER_SAMPLER_ENV] = "0"
    chosen = {name: value for name, value in wanted.items() if name not in environ}
    environ.update(chosen)
    return chosen
