"""Shared-memory files: create, map, sweep.

Every file is named ``odc-<job>-<pid>-<tag>`` so that a later job can tell whether its creator is still alive.
Files are unlinked as soon as every rank has mapped them (the mappings stay valid), so a crash leaves nothing
behind except in the short window between creating a file and the end of registration; :func:`sweep_stale`
removes such leftovers of dead processes when the next job starts.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path

import torch

_NAME = re.compile(r"^odc-[0-9a-f]+-(\d+)-")
_ALIGN = 256


def align(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def new_job_id() -> str:
    return uuid.uuid4().hex[:12]


def pick_dir(nbytes: int, preferred: str | None = None) -> Path:
    """``preferred`` if given, else /dev/shm when it has room for ``nbytes`` (+25%), else the temp directory."""
    if preferred:
        return Path(preferred)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= nbytes * 1.25:
        return shm
    return Path(tempfile.gettempdir())


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A process that exited but was not reaped yet (its launcher is busy) is a zombie: dead for us.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def sweep_stale(directory: Path) -> list[Path]:
    """Remove ``odc-*`` files whose creating process no longer exists. Returns what was removed."""
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for path in entries:
        match = _NAME.match(path.name)
        if match and not pid_alive(int(match.group(1))):
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed


def create(directory: Path, job: str, tag: str, nbytes: int) -> Path:
    """Create a zero-filled file of ``nbytes`` for this process; the caller maps it with :func:`map_file`."""
    path = directory / f"odc-{job}-{os.getpid()}-{tag}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return path


def map_file(path: str | os.PathLike, nbytes: int) -> torch.Tensor:
    """Map a file shared (MAP_SHARED) as a uint8 tensor; writes are seen by every process mapping it."""
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def unlink_quietly(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
