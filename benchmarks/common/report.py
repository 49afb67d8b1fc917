"""What every benchmark result records: versions, hardware, commit, command; and writing JSON + markdown."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
"""benchmarks/results: one folder per topic (the benchmarks' folders), indexed in docs/benchmarks.md."""


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def commit() -> str:
    if os.environ.get("ODC_COMMIT"):
        return os.environ["ODC_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).parent)  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                               cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict:
    import torch

    info = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit(),
        "python": platform.python_version(),
        "versions": {
            n: _version(n) for n in ("torch", "transformers", "accelerate", "trl", "triton", "numpy")
        },
        "cpu": platform.processor() or platform.machine(),
        "gpus": [],
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["versions"]["cuda"] = torch.version.cuda
        try:
            info["versions"]["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            pass
    return info


def env_markdown(env: dict) -> str:
    gpus = env["gpus"]
    hw = f"{len(gpus)} x {gpus[0]}" if gpus else f"CPU ({env['cpu']})"
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    return (
        f"- date: {env['date']}\n- hardware: {hw}\n- versions: {versions}\n"
        f"- commit: `{env['commit']}`\n- command: `{env['command']}`\n"
    )


def table(headers, rows, align: str = "") -> list[str]:
    """A markdown table as lines: the header, the alignment row, one line per row (cells through ``str``).

    ``align`` has one letter per column, ``l`` (``---``) or ``r`` (``---:``); columns past its end are ``l``.
    """
    marks = {"l": "---", "r": "---:"}
    widths = [marks[a] for a in align.ljust(len(headers), "l")]

    def line(cells) -> str:
        return "| " + " | ".join(str(c) for c in cells) + " |"

    return [line(headers), "|" + "|".join(widths) + "|", *(line(r) for r in rows)]


def portable(text: str) -> str:
    """``text`` with the run's own output folder written as ``$OUT``: results name no machine's paths."""
    out = os.environ.get("OUT")
    return text.replace(out.rstrip("/"), "$OUT") if out and len(out.strip("/")) > 1 else text


def write_json(path: str | os.PathLike, payload: dict, *, indent: int | None = 2) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(portable(json.dumps(payload, indent=indent, default=str)))
    return path


def write(out_dir: str | os.PathLike, stem: str, payload: dict, markdown: str) -> tuple[Path, Path]:
    out = Path(out_dir)
    json_path = write_json(out / f"{stem}.json", payload)
    md_path = out / f"{stem}.md"
    md_path.write_text(portable(markdown))
    return json_path, md_path


def today() -> str:
    return _dt.date.today().isoformat()


def hardware_tag(env: dict) -> str:
    """``h200x2``-style tag for file names (``cpu`` without GPUs)."""
    gpus = env["gpus"]
    if not gpus:
        return "cpu"
    name = gpus[0].lower().replace("nvidia", "").strip().split()[0]
    return f"{name}x{len(gpus)}"
