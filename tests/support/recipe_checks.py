"""Checks shared by the recipe tests (TRL's scripts run unmodified through ``odc_hf.run``): what a run logged and what it
saved, read from its output and files rather than from its return code."""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch


def logged(output: str, key: str) -> list[float]:
    """Every value of ``key`` in the Trainer's printed log dicts (``{'loss': '8.321', ...}``), in order."""
    pattern = re.compile(r"'" + re.escape(key) + r"': '?([-+0-9.eE]+|nan|inf|-inf)'?[,}]")
    return [float(v) for v in pattern.findall(output)]


def training_losses(output: str, steps: int) -> list[float]:
    """The ``steps`` per-step training losses (``logging_steps=1``): all present and finite."""
    losses = logged(output, "loss")
    assert len(losses) == steps, (losses, output[-3000:])
    assert all(math.isfinite(x) for x in losses), losses
    return losses


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    assert files, f"no .safetensors in {folder}: {sorted(p.name for p in Path(folder).iterdir())}"
    return {k: v for f in files for k, v in load_file(f).items()}


def changed_tensors(saved: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]) -> list[str]:
    """The names of the tensors of ``saved`` that differ from ``initial``'s (both hold the same names)."""
    assert saved.keys() == initial.keys(), sorted(saved.keys() ^ initial.keys())
    return [k for k in saved if not torch.equal(saved[k].float(), initial[k].float())]


def assert_trained_copy(saved: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]) -> None:
    """``saved`` holds the same tensors (names, shapes) as ``initial``, all finite, and training changed them. (A
    tied output embedding is not written out: odc_hf's CPU save path drops it as transformers' own save does.)"""
    assert saved.keys() == initial.keys(), sorted(saved.keys() ^ initial.keys())
    assert all(saved[k].shape == initial[k].shape for k in saved)
    assert all(torch.isfinite(v).all() for v in saved.values())
    changed = changed_tensors(saved, initial)
    assert changed, "the saved weights equal the initial ones: nothing trained (or the wrong state was saved)"


def assert_same_tokenizer(folder: Path, tokenizer, text: str) -> None:
    """The tokenizer saved in ``folder`` encodes ``text`` and renders chats as ``tokenizer`` does."""
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(folder)
    assert saved(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert (saved.eos_token_id, saved.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert saved.chat_template == tokenizer.chat_template
