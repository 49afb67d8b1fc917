"""Offline default data (odc_hf.testing.data): stdlib documents, a cached BPE tokenizer, datasets, a tiny Qwen2."""

import socket
import statistics
import threading

import pytest
import torch

from odc_hf.testing import data

VOCAB = 1024  # small vocab: the same training text, a little faster, and what the tests check still holds


@pytest.fixture(scope="module", autouse=True)
def no_network():
    """Everything here must work on a machine with no network: any connection attempt fails the test."""

    def refuse(*args, **kwargs):
        raise OSError("odc_hf.testing.data tried to use the network")

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(socket.socket, "connect", refuse)
        yield


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tokenizer-cache")


@pytest.fixture(scope="module")
def tok(cache):
    return data.default_tokenizer(VOCAB, cache_dir=str(cache))


def test_documents_are_nonempty_deterministic_and_shuffled_by_seed():
    docs = data.default_documents(50)
    assert len(docs) == 50 and all(isinstance(d, str) and d.strip() for d in docs)
    assert docs == data.default_documents(50)
    everything = data.default_documents()
    assert len(everything) > 300  # CPython 3.10-3.13 ship ~600 usable modules
    assert docs == everything[:50]
    other = data.default_documents(seed=1)
    assert other != everything and sorted(other) == sorted(everything)
    assert not any("import unittest" in d and "class Test" in d for d in everything[:200])  # no test suites


def test_document_lengths_are_long_tailed():
    lengths = [len(d) for d in data.default_documents(500)]
    assert max(lengths) / statistics.median(lengths) > 5
    assert min(lengths) < statistics.median(lengths) / 5


def test_tokenizer_training_is_deterministic(tok, tmp_path):
    again = data.default_tokenizer(VOCAB, cache_dir=str(tmp_path))  # a second training, in a fresh dir
    assert again.get_vocab() == tok.get_vocab()
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()  # merges too
    assert len(tok) == VOCAB


def test_tokenizer_special_tokens_and_round_trip(tok):
    assert tok.eos_token == tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tok.model_max_length >= 1 << 20
    samples = data.default_documents(4, seed=3) + ["  déjà vu\t\r\n x  =  1 ;  😀\n\n", "a<|im_end|>b"]
    for text in samples:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    assert tok("a<|im_end|>b")["input_ids"][1] == 2  # special tokens are never split


def test_chat_template_is_chatml_with_assistant_mask(tok):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    out = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    masked = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tok.decode(masked) == "hello<|im_end|>"


@pytest.mark.skipif(data.fcntl is None, reason="no fcntl: concurrent callers all train (same result)")
def test_cache_trains_once_for_concurrent_callers_then_loads(tmp_path, monkeypatch):
    calls = []
    train = data._train_bpe
    monkeypatch.setattr(data, "_train_bpe", lambda *a: calls.append(1) or train(*a))
    results = [None, None]

    def worker(i):
        results[i] = data.default_tokenizer(VOCAB, cache_dir=str(tmp_path))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1  # the other caller waited on the lock and loaded the file
    assert results[0].get_vocab() == results[1].get_vocab()
    (entry,) = tmp_path.iterdir()
    assert entry.name.startswith(f"tokenizer-{VOCAB}-")
    assert sorted(p.name for p in entry.iterdir()) == ["tokenizer.json", "tokenizer.lock"]  # no temp file

    again = data.default_tokenizer(VOCAB, cache_dir=str(tmp_path))
    assert len(calls) == 1 and again.get_vocab() == results[0].get_vocab()  # loaded, not retrained (no clock needed)


def test_text_dataset_columns_bounds_and_cycling():
    ds = data.default_text_dataset(64, min_chars=500, max_chars=3000, seed=1)
    assert ds.column_names == ["text"] and len(ds) == 64
    assert all(500 <= len(t) <= 3000 for t in ds["text"])
    n_long = sum(len(d) >= 100_000 for d in data.default_documents())
    cycled = data.default_text_dataset(2 * n_long + 1, min_chars=100_000, max_chars=None)["text"]
    assert len(cycled) == 2 * n_long + 1 and cycled[:n_long] == cycled[n_long : 2 * n_long]
    assert max(len(t) for t in cycled) > 200_000  # max_chars=None keeps documents whole


def test_tokenized_dataset_matches_whole_document_tokenization(tok, monkeypatch):
    n, max_length = 32, 256
    ds = data.default_tokenized_dataset(tok, n, max_length=max_length, seed=2)
    assert ds.column_names == ["input_ids"] and len(ds) == n
    texts = list(data.default_text_dataset(n, max_chars=None, seed=2)["text"])
    full = tok(texts, add_special_tokens=False)["input_ids"]
    expected = [(ids + [tok.eos_token_id])[:max_length] for ids in full]
    assert ds["input_ids"] == expected  # cutting long documents before tokenizing changed nothing
    lengths = [len(x) for x in ds["input_ids"]]
    assert max(lengths) == max_length and min(lengths) < max_length
    assert sum(len(t) > 6 * max_length for t in texts) > n // 2  # the cut was exercised
    # a cut that leaves too few tokens falls back to the whole document
    monkeypatch.setattr(data, "_head", lambda text, min_chars: text[:50])
    assert data.default_tokenized_dataset(tok, n, max_length=max_length, seed=2)["input_ids"] == expected


def test_tiny_qwen2_model_forward_and_seeding(tok):
    config = data.tiny_qwen2_config(len(tok))
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (64, 128, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.tie_word_embeddings and not config.use_cache and config.max_position_embeddings >= 4096

    rng_before = torch.get_rng_state()
    model = data.tiny_qwen2_model(tok, seed=0)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's RNG is left alone
    assert model.config.pad_token_id == model.config.eos_token_id == tok.eos_token_id
    assert model.config.vocab_size == len(tok)
    ids = data.default_tokenized_dataset(tok, 1, max_length=37)[0]["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, 37, len(tok)) and torch.isfinite(logits).all()

    same = data.tiny_qwen2_model(tok, seed=0).state_dict()
    other = data.tiny_qwen2_model(tok, seed=1).state_dict()
    weights = model.state_dict()
    assert all(torch.equal(weights[k], same[k]) for k in weights)
    assert not torch.equal(weights["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_corpus_is_the_shipped_snapshot_on_any_python_build(monkeypatch, tmp_path):
    """The default documents come from the file shipped in odc_hf/assets, checked by its digest, never from the running
    interpreter's standard library (whose files differ between CPython builds, e.g. Debian's 3.11.2 and 3.11.7)."""
    from odc_hf.testing import corpus

    docs = corpus.corpus_documents()
    assert len(docs) == 598 and corpus.corpus_digest(docs) == corpus.CORPUS_SHA256
    assert corpus.CORPUS_SHA256 == "c686bf778a14a1ec9af6dc4bf7bd1b78912ba273286681b168f312f5e4cf497b"
    first = data.default_documents(20, seed=0)
    # Control: an interpreter whose stdlib is an empty directory. The old reader (which walked sysconfig's stdlib)
    # fails here; the shipped snapshot gives the same documents.
    import sysconfig

    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": str(tmp_path)})
    corpus.corpus_documents.cache_clear()
    assert data.default_documents(20, seed=0) == first
    assert corpus._read_stdlib(str(tmp_path)) == []  # what reading the interpreter would have given


def test_damaged_corpus_is_refused_with_its_name(monkeypatch, tmp_path):
    import lzma

    from odc_hf.testing import corpus

    damaged = tmp_path / "corpus.json.xz"
    with lzma.open(damaged, "wt", encoding="utf-8") as f:
        f.write('{"documents": [{"path": "a.py", "text": "x = 1\\n"}]}')
    monkeypatch.setattr(corpus, "CORPUS_FILE", damaged)
    corpus.corpus_documents.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"corpus\.json\.xz is damaged \(checksum differs\); reinstall"):
            corpus.corpus_documents()
    finally:
        corpus.corpus_documents.cache_clear()
