"""The fixed offline corpus: a snapshot of CPython 3.11.7's standard-library ``.py`` sources, shipped with odc_hf.

The snapshot lives in ``odc_hf/assets/corpus-stdlib-3.11.7.json.xz`` (598 documents, 11.1M characters, 1.8 MB
compressed) next to the Python Software Foundation licence it is distributed under. Reading it from the package, not
from the running interpreter, makes the default data, the tokenizer trained on them and every figure derived from
them the same on every Python build. ``CORPUS_SHA256`` is the digest of the documents' text; the loader checks it.

Maintainers regenerate the snapshot (only when the corpus is meant to change, which changes every default figure) with
``python -m odc_hf.testing.corpus --write`` under the Python whose standard library should be captured.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import lzma
import os
import sys
import sysconfig
from pathlib import Path

__all__ = ["CORPUS_SHA256", "corpus_digest", "corpus_documents"]

CORPUS_FILE = Path(__file__).resolve().parent.parent / "assets" / "corpus-stdlib-3.11.7.json.xz"
CORPUS_SHA256 = "c686bf778a14a1ec9af6dc4bf7bd1b78912ba273286681b168f312f5e4cf497b"
# Test suites, the IDLE GUI, third-party packages and the retired 2to3 tool are not "the library".
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__"}


def corpus_digest(texts, prefix: bytes = b"") -> str:
    """SHA-256 over ``prefix`` and the documents, each hashed on its own (so document boundaries count)."""
    digest = hashlib.sha256(prefix)
    for text in texts:
        digest.update(hashlib.sha256(text.encode("utf-8")).digest())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def corpus_documents() -> tuple[str, ...]:
    """The shipped documents, in sorted source-path order (read and checked once per process)."""
    try:
        with lzma.open(CORPUS_FILE, "rt", encoding="utf-8") as f:
            records = json.load(f)
    except (OSError, lzma.LZMAError, json.JSONDecodeError) as e:
        raise RuntimeError(f"odc_hf: cannot read the shipped corpus {CORPUS_FILE.name}: {e}; reinstall odc_hf") from e
    texts = tuple(record["text"] for record in records["documents"])
    if corpus_digest(texts) != CORPUS_SHA256:
        raise RuntimeError(f"odc_hf: the shipped corpus {CORPUS_FILE.name} is damaged (checksum differs); reinstall")
    return texts


def _read_stdlib(root: str) -> list[dict]:
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]  # prune: never walk site-packages
        paths += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f.endswith(".py")]
    records = []
    for rel in sorted(p.replace(os.sep, "/") for p in paths):
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            records.append({"path": rel, "text": text})
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="capture this interpreter's stdlib into the asset file")
    args = parser.parse_args(argv)
    if not args.write:
        texts = corpus_documents()
        print(f"{CORPUS_FILE.name}: {len(texts)} documents, {sum(map(len, texts))} characters, sha256 {CORPUS_SHA256}")
        return 0
    records = _read_stdlib(sysconfig.get_paths()["stdlib"])
    version = ".".join(map(str, sys.version_info[:3]))
    payload = {"source": f"CPython {version} standard library (.py files)", "documents": records}
    with lzma.open(CORPUS_FILE, "wt", encoding="utf-8", preset=9) as f:
        json.dump(payload, f, ensure_ascii=False)
    print(f"wrote {CORPUS_FILE} ({len(records)} documents); set CORPUS_SHA256 = {corpus_digest(r['text'] for r in records)!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
