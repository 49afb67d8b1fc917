"""Explicit version checks. odc_hf is tested on torch 2.11 (GPU image) and 2.13 (CPU)."""

from __future__ import annotations

import torch
from packaging.version import Version

TESTED_TORCH = ("2.11", "2.13")


def torch_version() -> Version:
    return Version(Version(torch.__version__).base_version)


def require_torch(minimum: str, feature: str) -> None:
    if torch_version() < Version(minimum):
        raise RuntimeError(f"{feature} needs torch >= {minimum}; this is torch {torch.__version__}")
