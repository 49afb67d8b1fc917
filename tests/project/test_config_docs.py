"""docs/configuration.md's ODCConfig table is made from ODCConfig's fields (name, type, default, environment variable,
and the field's ``help``, the one text of each option): one row per field, in the dataclass's order.

After changing a field or its help, rewrite the table's rows with ``python tests/project/test_config_docs.py``.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

from odc_hf.config import ODCConfig

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "configuration.md"
HEADER = "| field | type | default | environment variable | effect |"


def _default(value) -> str:
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"


def _links(text: str) -> str:
    """``docs/x.md`` (with an optional ``#anchor``) in a help text: a link relative to the docs folder."""
    return re.sub(r"docs/([\w-]+\.md(?:#[\w-]+)?)", r"[\1](\1)", text)


def config_rows() -> list[str]:
    """The table's rows, as ODCConfig's fields give them."""
    rows = []
    for option in dataclasses.fields(ODCConfig):
        kind = str(option.type)
        variable = f"`ODC_{option.name.upper()}`"
        if kind.endswith("| None") and kind.split(" ")[0] in ("int", "float"):
            variable += " (`none` for `None`)"  # how the environment says None (odc_hf.config._parse)
        cells = [f"`{option.name}`", "`" + kind.replace("|", "\\|") + "`", _default(option.default), variable,
                 _links(option.metadata["help"])]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def documented_rows(text: str) -> tuple[int, int]:
    """Line range of the table's rows (after its header and separator) in docs/configuration.md."""
    lines = text.splitlines()
    start = lines.index(HEADER) + 2
    end = start
    while end < len(lines) and lines[end].startswith("| "):
        end += 1
    return start, end


def test_the_docs_table_is_made_from_odcconfig_fields():
    text = DOCS.read_text()
    start, end = documented_rows(text)
    documented = text.splitlines()[start:end]
    expected = config_rows()
    assert [row.split(" | ")[0] for row in documented] == [row.split(" | ")[0] for row in expected], (
        "docs/configuration.md's ODCConfig table lists other fields: run python tests/project/test_config_docs.py"
    )
    for ours, theirs in zip(documented, expected):
        assert ours == theirs, f"run python tests/project/test_config_docs.py to rewrite the row:\n{theirs}"


def test_every_field_has_its_help_once():
    for option in dataclasses.fields(ODCConfig):
        assert option.metadata.get("help"), f"ODCConfig.{option.name} has no help"


if __name__ == "__main__":  # rewrite the table's rows from ODCConfig
    text = DOCS.read_text()
    start, end = documented_rows(text)
    lines = text.splitlines()
    lines[start:end] = config_rows()
    DOCS.write_text("\n".join(lines) + "\n")
    sys.exit(0)
