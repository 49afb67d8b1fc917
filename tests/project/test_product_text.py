"""The product's text (README.md, docs/*.md) names no commit hashes, issue numbers or words of the work process.

Provenance lives in ``benchmarks/results/`` (every report records its commit and command) and in the test log
``tests/README.md`` (which commit each GPU run tested); neither is scanned. A finding prints as ``file:line: what``.
``python tests/project/test_product_text.py odc_hf`` scans other roots (for example docstrings) the same way.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# what the product's text is: paths or globs relative to the repository root
PRODUCT_TEXT = ("README.md", "docs/*.md", "odc_hf", "examples")  # the product: its pages, code and docstrings

# a commit hash: 7-40 hex digits, with a digit and a letter (so neither "1234567" nor "defaced" counts)
HASH = re.compile(r"(?<![\w./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])")
UPSTREAM = ("torch", "pytorch", "transformers", "accelerate", "trl", "TRL", "peft", "vllm", "vLLM", "liger-kernel")
RULES = (
    ("commit hash", HASH),
    # an upstream project's issues ("transformers issues 27925") are references, not the work process
    ("issue number", re.compile("".join(f"(?<!{p} )" for p in UPSTREAM) + r"\bissues?\s+#?\d+", re.I)),
    ("issue reference", re.compile(r"\bthe issue\b|\(issue\b", re.I)),
    ("process word", re.compile(r"\b(this session|previous run|owed|the lead|stage \d+|lent|next commits?)\b", re.I)),
    ("missing file", re.compile(r"\bDESIGN\.md\b")),
)


def files(roots=PRODUCT_TEXT) -> list[Path]:
    """The files under ``roots`` (files, folders or globs relative to the repository root): .md and .py text."""
    out = []
    for root in roots:
        for path in sorted(ROOT.glob(root)) if any(c in root for c in "*?[") else [ROOT / root]:
            if path.is_dir():
                out += sorted(p for p in path.rglob("*") if p.suffix in (".md", ".py"))
            elif path.is_file():
                out.append(path)
    return out


def findings(roots=PRODUCT_TEXT) -> list[str]:
    out = []
    for path in files(roots):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for what, pattern in RULES:
                for match in pattern.finditer(line):
                    out.append(f"{path.relative_to(ROOT)}:{number}: {what} {match.group(0)!r}")
    return out


def test_the_rules_catch_what_they_are_for():
    caught = {what for what, pattern in RULES for text in (
        "at `befe45a`", "commit 9007e32 ran", "issue 29", "(issue 21)", "issues 18-20", "this session",
        "previous run", "owed a re-run", "stage 7", "not lent", "DESIGN.md §6", "the issue measured") if pattern.search(text)}  # fmt: skip
    assert caught == {what for what, _ in RULES}
    harmless = ("2026-12-02", "1234567 tokens", "pytorch/pytorch#196678", "odc_hf/assets/h200_x.json", "e-5",
                "the first run of a user", "0x1f2e3d4", "transformers issues 27925", "sha256:abc", "1.5e-5", "fp32", "bf16")
    assert not [t for t in harmless for _, p in RULES if p.search(t)]


def test_readme_and_docs_carry_no_process_text():
    assert files(), "no product text found"
    found = findings()
    assert not found, "\n".join(found)


def test_the_benchmarks_page_lists_every_report_once():
    """docs/benchmarks.md ends with the index of benchmarks/results/ (one folder per topic, no flat list): every report
    there once, none that is not."""
    text = (ROOT / "docs/benchmarks.md").read_text(encoding="utf-8")
    index = text.split("\n## Every report\n", 1)[1]
    listed = re.findall(r"\]\(\.\./benchmarks/results/([^)]+\.md)\)", index)
    results = ROOT / "benchmarks/results"
    assert not [p.name for p in results.iterdir() if p.is_file()], "a result file outside the topic folders"
    reports = sorted(str(p.relative_to(results)) for p in results.rglob("*.md"))
    assert sorted(listed) == reports, (sorted(set(reports) - set(listed)), sorted(set(listed) - set(reports)))
    linked = set(re.findall(r"\]\(\.\./benchmarks/results/([^)#]+)\)", text))
    assert not [name for name in linked if not (ROOT / "benchmarks/results" / name).exists()]


if __name__ == "__main__":
    lines = findings(sys.argv[1:] or PRODUCT_TEXT)
    print("\n".join(lines) or "clean")
    counts: dict[str, int] = {}
    for line in lines:
        counts[line.split(":", 1)[0]] = counts.get(line.split(":", 1)[0], 0) + 1
    for name, n in sorted(counts.items()):
        print(f"{n:4d} {name}", file=sys.stderr)
    sys.exit(1 if lines else 0)


def test_every_directory_the_documented_commands_write_is_ignored_by_git():
    """`--output_dir X`, `output/...` and `python -m odc_hf.offline X` in README, docs and examples: git ignores X."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    texts = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "examples").glob("*.py"))]
    written = set()
    for path in texts:
        text = path.read_text()
        written |= set(re.findall(r"--output_dir[ =]([A-Za-z0-9_.-]+)", text))
        written |= set(re.findall(r"-m odc_hf\.offline ([a-z][A-Za-z0-9_.-]*)", text))
        written |= {"output"} if re.search(r"\boutput/\w", text) else set()
    assert {"out", "demo", "output"} <= written, written  # what the docs say today: the scan is not blind
    ignored = {line.strip().strip("/") for line in (root / ".gitignore").read_text().splitlines()}
    for name in sorted(written):  # a checkout need not be a git repository: .gitignore's own lines are read
        assert name in ignored, f"{name}/ is written by a documented command but not in .gitignore"


@pytest.mark.parametrize("example", ["sft.py", "grpo.py"])
def test_example_help_prints_the_docstrings_command_lines_unjoined(example):
    """`python examples/X --help` shows the docstring's multi-line commands as written: each line that ends with a
    shell continuation keeps its backslash and its line break (a non-raw docstring eats both)."""
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / example
    continued = [line.rstrip() for line in path.read_text().split('"""')[1].splitlines() if line.rstrip().endswith("\\")]
    assert continued, "the docstring shows no multi-line command: nothing to check"
    import os

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path.parents[1]), os.environ.get("PYTHONPATH", "")]))
    shown = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=300,
                           check=True, env=env).stdout.splitlines()  # fmt: skip
    for line in continued:
        assert line in [s.rstrip() for s in shown], f"{line!r} is not a line of --help"
