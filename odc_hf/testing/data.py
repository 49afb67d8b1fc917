"""Offline default data for the main job and tests: text, a tokenizer and a tiny model, no downloads.

The corpus is a fixed snapshot of the Python standard library's own ``.py`` sources, shipped with odc_hf
(:mod:`.corpus`), so a fresh machine with no network has it, every Python build reads the same documents, and
they are real text (code, docstrings, comments) with a
naturally long-tailed length distribution (a few hundred characters for small modules, ~10k median,
hundreds of thousands for the largest): a few long documents dominate the compute of a batch, which is
the imbalance ODC's load balancing addresses. Uniform synthetic text would show nothing.

The tokenizer is a byte-level BPE trained at run time on a fixed subset of that corpus (1-2 s on one
CPU core). Training is deterministic, and the result is cached on disk keyed by a hash of the training
text, so every rank of a job, and every run, sees the same vocabulary, on any Python build.
"""

from __future__ import annotations

import ast
import contextlib
import math
import os
import random
import re
import warnings
from pathlib import Path

import datasets
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .corpus import corpus_digest, corpus_documents

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

__all__ = [
    "default_conversations",
    "default_documents",
    "default_tokenizer",
    "default_text_dataset",
    "default_tokenized_dataset",
    "tiny_qwen2_config",
    "tiny_qwen2_model",
]

EOS_TOKEN, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]
# Tokenizer training text: the first documents of default_documents(seed=0), each cut to this many
# characters (so one huge file cannot dominate the merges) until the budget is reached (~390 files).
_TRAIN_DOC_CHARS, _TRAIN_BUDGET_CHARS = 20_000, 4_000_000
_LINE_END = re.compile(r"(?<=[^\W_])\n")  # a newline after a letter or digit
_RECIPE = "odc_hf-bytelevel-bpe-v1"  # part of the cache key: bump when the training recipe changes
# ChatML, with {% generation %} marks around assistant turns so TRL's assistant_only_loss works.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{% else %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def default_documents(max_documents: int | None = None, *, seed: int = 0) -> list[str]:
    """The shipped standard-library ``.py`` sources as documents, shuffled with ``random.Random(seed)``.

    Why these: they need no download and have long-tailed lengths (see the module docstring). The order
    depends on the seed only: the snapshot is stored in sorted source-path order and then shuffled;
    ``max_documents`` keeps the first ones after the shuffle.
    """
    docs = list(corpus_documents())
    random.Random(seed).shuffle(docs)
    return docs if max_documents is None else docs[:max_documents]


def _training_text() -> list[str]:
    out, total = [], 0
    for doc in default_documents(seed=0):
        if total >= _TRAIN_BUDGET_CHARS:
            break
        out.append(doc[:_TRAIN_DOC_CHARS])
        total += len(out[-1])
    return out


def _train_bpe(texts: list[str], vocab_size: int):
    # Byte-level with no prefix space and no normalizer: every string round-trips exactly.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


@contextlib.contextmanager
def _file_lock(path: Path):
    """Exclusive advisory lock, so ranks started together train once (without fcntl: all train, same result)."""
    with open(path, "a") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when f is closed
        yield


def _load_or_train(path: Path, texts: list[str], vocab_size: int):
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tok = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(path.with_suffix(".lock")):
            if path.is_file():  # another rank trained it while we waited for the lock
                return Tokenizer.from_file(str(path))
            tok = _train_bpe(texts, vocab_size)
            tmp = path.with_name(f".tokenizer.{os.getpid()}.tmp")  # per process: unique even without fcntl
            try:
                tmp.write_text(tok.to_str(), encoding="utf-8")
                os.replace(tmp, path)  # atomic: readers see no file or the whole file
            finally:
                tmp.unlink(missing_ok=True)
    except OSError as e:  # unwritable cache: use (or train) an in-memory tokenizer
        warnings.warn(f"odc_hf: tokenizer cache {path.parent} unusable ({e}); not cached", stacklevel=3)
    return tok if tok is not None else _train_bpe(texts, vocab_size)


def default_tokenizer(
    vocab_size: int = 4096, *, cache_dir: str | None = None
) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the shipped corpus (a second or two), cached on disk.

    ``<|endoftext|>`` is eos and pad, ``<|im_start|>``/``<|im_end|>`` frame ChatML turns (the chat
    template), there is no bos. The trained JSON lives in ``<cache_dir>/tokenizer-<vocab_size>-<hash of
    the training text>/tokenizer.json`` (``cache_dir`` defaults to ``~/.cache/odc_hf``), so one cache dir
    serves any vocab size and Python version. The first process to take the file lock trains and writes
    it atomically; ranks started at the same time wait and load it.
    """
    texts = _training_text()
    root = cache_dir if cache_dir is not None else os.path.join(os.path.expanduser("~"), ".cache", "odc_hf")
    path = Path(root) / f"tokenizer-{vocab_size}-{corpus_digest(texts, _RECIPE.encode())[:16]}" / "tokenizer.json"
    backend = _load_or_train(path, texts, vocab_size)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 30,  # documents are long; truncation is the trainer's max_length's job
        clean_up_tokenization_spaces=False,  # keep decode(encode(s)) == s for code
    )


def default_text_dataset(
    num_samples: int = 512, *, min_chars: int = 200, max_chars: int | None = 20000, seed: int = 0
) -> datasets.Dataset:
    """``datasets.Dataset`` with one ``"text"`` column (TRL ``SFTTrainer``'s language-modeling format).

    Documents shorter than ``min_chars`` are dropped, the rest cut to ``max_chars``; the list is cycled
    when fewer than ``num_samples`` documents remain.
    """
    return datasets.Dataset.from_dict({"text": _samples(num_samples, min_chars, max_chars, seed)})


def default_conversations(num_samples: int = 64, *, max_chars: int = 1500, seed: int = 0) -> list[dict]:
    """Real-text chat samples for TRL's conversational format: ``{"messages": [user, assistant]}``.

    From the standard library's modules with a docstring: the user shows the first lines of a module's code after
    its docstring (up to ~``max_chars / 3`` characters) and asks for the docstring; the assistant answers with it
    (cut to ``max_chars``). Both sides are text of the shipped corpus; cycled when fewer modules qualify.
    """
    pairs = []
    for doc in default_documents(seed=seed):
        try:
            module = ast.parse(doc)
        except (SyntaxError, ValueError):
            continue
        docstring = ast.get_docstring(module)
        if not docstring or len(docstring) < 80 or len(module.body) < 2:
            continue
        code = "\n".join(ast.get_source_segment(doc, node) or "" for node in module.body[1:6])
        code = code[: max_chars // 3]
        question = f"Write the docstring of the Python module that begins with:\n```python\n{code}\n```"
        pairs.append({"messages": [{"role": "user", "content": question},
                                   {"role": "assistant", "content": docstring[:max_chars]}]})  # fmt: skip
        if len(pairs) == num_samples:
            break
    if not pairs:
        raise RuntimeError("no corpus module with a docstring was found")
    return [pairs[i % len(pairs)] for i in range(num_samples)]


def _samples(num_samples: int, min_chars: int, max_chars: int | None, seed: int) -> list[str]:
    docs = [d[:max_chars] for d in default_documents(seed=seed) if len(d) >= min_chars]
    if not docs:
        raise ValueError(f"no corpus document has at least min_chars={min_chars} characters")
    return [docs[i % len(docs)] for i in range(num_samples)]


def default_tokenized_dataset(
    tokenizer, num_samples: int = 512, *, max_length: int = 1024, seed: int = 0
) -> datasets.Dataset:
    """``datasets.Dataset`` with an ``"input_ids"`` column for the plain transformers ``Trainer``.

    The same documents as ``default_text_dataset(num_samples, seed=seed)`` but uncut, tokenized with eos
    appended and then truncated to ``max_length`` tokens (as TRL does: a truncated document loses its eos).
    Long documents are first cut at a line end past ``6 * max_length`` characters (stdlib text has at
    most ~4.6 characters a token), which tokenizes 4x less text at max_length 1024; byte-level
    pre-tokenizers (``default_tokenizer``, GPT-2/Qwen/Llama-3 style) never merge across that boundary, so
    the ids are those of the whole document.
    """
    texts = _samples(num_samples, 200, None, seed)
    heads = [_head(text, 6 * max_length) for text in texts]
    ids = tokenizer(heads, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    for i, (head, text) in enumerate(zip(heads, texts)):
        if len(ids[i]) < max_length and len(head) < len(text):  # > 6 characters a token: rare
            ids[i] = tokenizer(text, add_special_tokens=False)["input_ids"]
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return datasets.Dataset.from_dict({"input_ids": [(list(x) + eos)[:max_length] for x in ids]})


def _head(text: str, min_chars: int) -> str:
    """``text`` cut before the first newline at or after ``min_chars`` that ends a line on a letter or digit."""
    match = _LINE_END.search(text, min_chars)
    return text if match is None else text[: match.start()]


def tiny_qwen2_config(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    intermediate_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 32768,
    **kwargs,
) -> transformers.Qwen2Config:
    """A ``Qwen2Config`` for a tiny model (~0.3M parameters at vocab 4096): real architecture, GQA, tied
    embeddings, cheap enough for CPU tests; RoPE allocates nothing per position, so the long context is free.
    """
    kwargs = {"tie_word_embeddings": True, "use_cache": False, **kwargs}
    return transformers.Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        **kwargs,
    )


TINY_HEAD_DIM_64 = {"hidden_size": 128, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 256}
"""``tiny_qwen2_config`` keyword arguments for a tiny model with head_dim 64, the smallest FlashAttention-4 runs
(the default tiny model has head_dim 16)."""


def tiny_qwen2_model(tokenizer, seed: int = 0, **config_kwargs) -> transformers.Qwen2ForCausalLM:
    """Randomly initialised ``Qwen2ForCausalLM`` sized to ``tokenizer`` (pad/eos ids in the config).

    Initialisation is seeded on a forked CPU RNG, so the weights depend on ``seed`` only and the caller's
    global RNG state is left untouched.
    """
    ids = {f"{name}_token_id": getattr(tokenizer, f"{name}_token_id") for name in ("pad", "eos", "bos")}
    config = tiny_qwen2_config(len(tokenizer), **{**ids, **config_kwargs})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.Qwen2ForCausalLM(config)


def make_eos_prone(model, bonus: float = 7.2) -> None:
    """Make ``model`` end its completions early, in place: every token embedding +1 in coordinate 5 (a constant
    direction that the final norm scales to about sqrt(hidden)), EOS's row ``bonus / sqrt(hidden)`` more, so EOS's
    logit is about ``bonus`` above the rest. A random model otherwise runs every completion to the length limit;
    GRPO's loss on equal-length completions is zero up to rounding (the advantages of a group sum to zero), which
    hides whether anything trained. Measured on the tiny models: lengths 1 to 12 tokens, mean ~4.5."""
    eos = model.config.eos_token_id
    rows = {id(w): w for w in (model.get_input_embeddings().weight, model.get_output_embeddings().weight)}
    with torch.no_grad():
        for weight in rows.values():
            weight[:, 5] += 1.0
            weight[eos, 5] += bonus / math.sqrt(model.config.hidden_size)
