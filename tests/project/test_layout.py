"""README's layout section names the folders the repository has: every package of odc_hf, room of
odc_hf/integrations, topic of benchmarks/ and concern of tests/ is listed, and every folder it lists exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _listed() -> set[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("\n## Layout\n", 1)[1].split("```", 2)[1]
    return set(re.findall(r"(?<![\w.])([a-z_]+)/", block))


def _folders(path: Path) -> set[str]:
    return {p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith((".", "__")) and
            any(p.rglob("*.*"))}  # fmt: skip


def test_every_folder_of_the_tree_is_in_the_readme_layout():
    listed = _listed()
    for folder in (ROOT / "odc_hf", ROOT / "odc_hf" / "integrations", ROOT / "benchmarks", ROOT / "tests"):
        missing = _folders(folder) - {"assets"} - listed
        assert not missing, f"README's layout does not list {sorted(missing)} of {folder.relative_to(ROOT)}/"


def test_every_folder_the_readme_layout_lists_exists():
    tree = {p.name for p in ROOT.rglob("*") if p.is_dir() and not any(part.startswith(".") for part in p.parts)}
    assert not sorted(_listed() - tree)


def test_the_check_sees_a_missing_folder():
    assert "vllm" in _listed() and "benchmark_runs" in _listed()
    assert "no_such_room" not in _listed()
