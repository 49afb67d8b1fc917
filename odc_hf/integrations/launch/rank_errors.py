"""A launched rank's uncaught exception as a user should see it: one message on the screen, the traceback in a file.

Under ``accelerate launch`` every rank prints its whole traceback and then the launcher (torch's elastic agent) prints
a report of every rank; a clear message of odc_hf's ends up in the middle of that. :func:`install` (called in each
launched rank by ``python -m odc_hf.run`` and the examples) replaces the rank's traceback by one line::

    odc_hf: rank 0 failed: ValueError: resume_from_checkpoint='last' resumes from ... (traceback: /tmp/.../rank0.log)

and records the failure in the run's error folder (``ODC_ERROR_DIR``; by default a folder named after the
launcher's run id in the temporary directory). A rank that stopped because a peer failed (``PeerFailedError``) is
recorded as such, so the rank that failed first is known. :func:`run_launcher` (the examples' relaunch) runs the
launcher, shows its output until a rank reports a failure, keeps the rest (the agent's report) in the error folder,
and ends with the failing rank's own message and where the details are.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ERROR_DIR_ENV = "ODC_ERROR_DIR"
"""The folder where launched ranks record their failures (set by the examples' relaunch; optional)."""

_FAILED = re.compile(rb"odc_hf: rank \d+ failed: ")

__all__ = ["ERROR_DIR_ENV", "error_dir", "first_failure", "install", "run_launcher"]


def error_dir(environ=None) -> Path:
    """The run's error folder: ``ODC_ERROR_DIR``, else ``<tmp>/odc_hf-errors-<launcher run id>``.

    torchrun's run id is ``none`` unless ``--rdzv-id`` is given (``accelerate launch`` gives none on one machine), so
    every such run would share one folder; there the launcher's process id (the parent of every rank it starts)
    names the folder instead."""
    environ = os.environ if environ is None else environ
    if environ.get(ERROR_DIR_ENV):
        return Path(environ[ERROR_DIR_ENV])
    run = environ.get("TORCHELASTIC_RUN_ID", "")
    if run in ("", "none"):
        run = f"pid{os.getppid()}"
    run = re.sub(r"[^A-Za-z0-9_.-]", "_", run)
    return Path(tempfile.gettempdir()) / f"odc_hf-errors-{run}"


def install() -> None:
    """In a launched rank (``RANK`` set): report an uncaught exception as one line and a file (module docstring).
    Elsewhere (a plain process, a notebook) Python's own report stays."""
    if "RANK" not in os.environ or getattr(sys.excepthook, "_odc_rank_errors", False):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        try:
            _report(int(os.environ["RANK"]), kind, value, tb)
        except Exception:  # never hide the original error behind one of the report's own
            previous(kind, value, tb)

    hook._odc_rank_errors = True
    sys.excepthook = hook


def _report(rank: int, kind, value, tb) -> None:
    from odc_hf.transport.base import PeerFailedError

    folder = error_dir()
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / f"rank{rank}.log"
    log.write_text("".join(traceback.format_exception(kind, value, tb)))
    message = f"{kind.__name__}: {value}".strip()
    record = {"rank": rank, "message": message, "peer": isinstance(value, PeerFailedError), "log": str(log),
              "time": time.time()}  # fmt: skip
    (folder / f"rank{rank}.json").write_text(json.dumps(record))
    sys.stderr.write(f"odc_hf: rank {rank} failed: {message} (traceback: {log})\n")
    sys.stderr.flush()


def first_failure(folder: Path) -> dict | None:
    """The failure that stopped the run: among the ranks' records in ``folder``, the earliest of a rank that did not
    stop because of a peer (else the earliest of any); ``None`` when no rank recorded one."""
    records = []
    for path in sorted(Path(folder).glob("rank*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if not records:
        return None
    return min(records, key=lambda r: (r.get("peer", False), r.get("time", 0.0), r.get("rank", 0)))


def run_launcher(cmd: list[str], env: dict[str, str]) -> int:
    """Run ``cmd`` (``accelerate launch ...``) with its output on the screen until a rank reports a failure; from
    there its output goes to ``launcher.log`` in the run's error folder, and the failing rank's own message is printed
    last. Returns the launcher's exit status."""
    folder = Path(tempfile.mkdtemp(prefix="odc_hf-errors-"))
    env = {**env, ERROR_DIR_ENV: str(folder)}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
    held = bytearray()  # what came after a rank's failure: the other ranks' lines and the launcher's report
    tail = b""  # the end of the last chunk shown, so a marker split across two reads is still found
    failed = False
    try:
        while chunk := os.read(proc.stderr.fileno(), 65536):
            if failed:
                held += chunk
                continue
            seen = tail + chunk
            found = _FAILED.search(seen)
            if found is None:
                os.write(sys.stderr.fileno(), chunk)
                tail = seen[-256:]
                continue
            line = max(seen.rfind(b"\n", 0, found.start()), seen.rfind(b"\r", 0, found.start())) + 1
            start = max(line - len(tail), 0)  # from the start of its line (the launcher may prefix "[rank0]: ")
            os.write(sys.stderr.fileno(), chunk[:start])
            held += chunk[start:]
            failed = True
    finally:
        status = proc.wait()
    if status == 0 or not failed:
        if held:
            os.write(sys.stderr.fileno(), bytes(held))
        return status
    (folder / "launcher.log").write_bytes(bytes(held))
    first = first_failure(folder)
    message = first["message"] if first else "see the log"
    rank = first["rank"] if first else "?"
    sys.stderr.write(
        f"\nodc_hf: rank {rank} failed: {message}\n"
        f"odc_hf: details (every rank's traceback, the launcher's report) in {folder}\n"
    )
    sys.stderr.flush()
    return status
