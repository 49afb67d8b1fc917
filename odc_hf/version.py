"""The version policy of odc_hf: the releases it is tested on, and what it does on others.

odc_hf is tested on the minors in :data:`TESTED` (the GPU image: torch 2.11, transformers 5.17, accelerate 1.15;
the CPU suite installs exactly ``tests/constraints.txt``, whose versions ``tests/project/test_version_policy.py`` checks are
listed here). On another minor of one of these packages odc_hf **warns once**, on rank 0, naming the tested
versions (:func:`warn_if_untested`, an :class:`UntestedVersionWarning`), and goes on. It **refuses** only where a
name it needs is missing from the installed release, and then names it: the private names odc_hf reads are listed
per package (``odc_hf.fsdp.internals`` for torch, ``odc_hf.integrations.upstream.transformers``,
``odc_hf.integrations.upstream.trl``, ``odc_hf.integrations.upstream.vllm``) and checked when they are first needed.
A name that changed meaning without disappearing cannot be detected at run time: that is what the warning is for,
and what the parity tests check before a minor is added here.
"""

from __future__ import annotations

import importlib.metadata
import os
import warnings

import torch
from packaging.version import InvalidVersion, Version

TESTED: dict[str, tuple[str, ...]] = {
    "torch": ("2.11", "2.13"),
    "transformers": ("5.17", "5.24", "5.25"),
    "accelerate": ("1.15", "1.16"),
    "trl": ("1.16",),
    "vllm": ("0.26",),
}
"""Minor versions odc_hf is tested on, per package (the one list; the ``TESTED_*`` names are views of it)."""

TESTED_TORCH = TESTED["torch"]


class UntestedVersionWarning(UserWarning):
    """A package odc_hf depends on is at a minor version odc_hf was not tested on."""


_warned: set[str] = set()


def torch_version() -> Version:
    return Version(Version(torch.__version__).base_version)


def require_torch(minimum: str, feature: str) -> None:
    if torch_version() < Version(minimum):
        raise RuntimeError(f"{feature} needs torch >= {minimum}; this is torch {torch.__version__}")


def installed_version(package: str) -> str | None:
    """The installed distribution's version string, or None when it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def minor(version: str) -> str | None:
    """``"5.25"`` for ``"5.25.0"``, ``"2.11"`` for ``"2.11.0+cu130"``; None for a string that is no version."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        return None
    return f"{parsed.major}.{parsed.minor}"


def untested(package: str, version: str | None = None) -> str | None:
    """The sentence saying ``package`` (at ``version``, default: the installed one) is untested, or None when its
    minor is in :data:`TESTED` or it is not installed."""
    version = version or installed_version(package)
    if version is None or minor(version) in TESTED[package]:
        return None
    return (f"{package} {version} is not a version odc_hf was tested on (tested: {package} "
            f"{', '.join(TESTED[package])}). odc_hf goes on, and stops only where a name it needs is missing, naming "
            f"it; install a tested {package} for results known to match")  # fmt: skip


def is_rank_zero() -> bool:
    """Whether this process is rank 0 (of the process group once it exists, else by the launcher's ``RANK``)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def warn_if_untested(*packages: str, versions: dict[str, str] | None = None) -> list[str]:
    """Warn (:class:`UntestedVersionWarning`) once per process and package, on rank 0 only, for each of
    ``packages`` whose installed minor is untested; returns the packages warned about now. ``versions``: versions
    to assume instead of the installed ones (tests)."""
    warned = []
    for package in packages:
        if package in _warned:
            continue
        message = untested(package, (versions or {}).get(package))
        if message is None:
            continue
        _warned.add(package)
        if is_rank_zero():
            warnings.warn(f"odc_hf: {message}", UntestedVersionWarning, stacklevel=2)
            warned.append(package)
    return warned
