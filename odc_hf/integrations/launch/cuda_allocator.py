"""CUDA's caching allocator with expandable segments: what variable-length training asks of it.

Variable-length training allocates activations of new sizes every step (each microbatch holds a different number of
tokens). With torch's default allocator settings, blocks cached for one step's sizes fit the next step's badly, so
the memory it reserves grows past what is allocated; once it reaches the GPU's size, an allocation that finds no
fitting block frees every cached block and retries (``torch.cuda.memory_stats()["num_alloc_retries"]``), which
synchronises the device. With ``expandable_segments:True`` the reserved memory stays close to what is allocated and
those retries disappear, at the same step time (docs/performance.md has the measurement). So it buys memory headroom
-- what ``activation_checkpointing="auto"`` plans against -- not speed.

torch reads the setting once, when CUDA starts in the process (``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF``);
no public call changes it afterwards. So odc_hf sets ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` where it
runs before CUDA starts -- ``python -m odc_hf.run``, the examples' launcher, building ``ODCSFTConfig`` /
``ODCGRPOConfig`` -- unless the user set either variable (their value is kept) or ``ODC_EXPANDABLE_SEGMENTS=0``.
The ODC trainers log whether the process runs with it (:func:`check`) and the retries per logging step
(``odc/cuda_alloc_retries``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

logger = logging.getLogger("odc_hf")

SETTING_ENV = "PYTORCH_CUDA_ALLOC_CONF"  # read by torch 2.11 and 2.13
USER_ENVS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # the first: torch >= 2.9's device-generic name
OPT_OUT_ENV = "ODC_EXPANDABLE_SEGMENTS"
VALUE = "expandable_segments:True"
_FALSE = ("0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on", "")


def wanted(environ: MutableMapping[str, str] | None = None) -> bool:
    """False when ``ODC_EXPANDABLE_SEGMENTS`` turns the default off; a clear error for a value that is not a boolean."""
    environ = os.environ if environ is None else environ
    value = environ.get(OPT_OUT_ENV, "").strip().lower()
    if value in _FALSE:
        return False
    if value not in _TRUE:
        raise ValueError(f"{OPT_OUT_ENV} must be 1/true or 0/false, got {environ[OPT_OUT_ENV]!r}")
    return True


def user_setting(environ: MutableMapping[str, str] | None = None) -> str | None:
    """The allocator setting the user gave torch (``PYTORCH_ALLOC_CONF`` first, as torch >= 2.9 reads it), or None."""
    environ = os.environ if environ is None else environ
    for name in USER_ENVS:
        if environ.get(name):
            return environ[name]
    return None


def expandable(setting: str | None) -> bool:
    """Whether an allocator setting string turns expandable segments on (``...,expandable_segments:True,...``)."""
    for part in (setting or "").split(","):
        key, _, value = part.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() == "true"
    return False


def prefer_expandable_segments(environ: MutableMapping[str, str] | None = None, *, cuda_started: bool | None = None) -> str:
    """Set :data:`VALUE` in ``environ`` (default ``os.environ``) if nobody chose a setting and CUDA has not started.

    Returns what happened: ``"set"``; ``"user"`` (a setting was there: kept); ``"off"`` (``ODC_EXPANDABLE_SEGMENTS=0``);
    ``"late"`` (CUDA already started in this process: torch would not read it). ``cuda_started=False`` is for the
    environment of processes still to be launched.
    """
    environ = os.environ if environ is None else environ
    if not wanted(environ):
        return "off"
    if user_setting(environ) is not None:
        return "user"
    if cuda_started is None:
        import torch

        cuda_started = torch.cuda.is_initialized()
    if cuda_started:
        return "late"
    environ[SETTING_ENV] = VALUE
    return "set"


def check(device, *, main_process: bool) -> dict:
    """At the ODC trainer's start on CUDA: whether the process runs with expandable segments; a note (main process)
    when CUDA started before odc_hf could ask for them and the user chose nothing."""
    setting = user_setting()
    on = expandable(setting)
    state = {"expandable_segments": on, "setting": setting}
    if getattr(device, "type", str(device)) != "cuda" or on or not main_process:
        return state
    if setting is None and wanted():
        logger.info(
            "odc_hf: CUDA started in this process before odc_hf could set %s=%s (build ODCSFTConfig/ODCGRPOConfig "
            "before the model, or set the variable), so the caching allocator runs without expandable segments: "
            "with new sizes every step it reserves more than it allocates (odc/cuda_alloc_retries counts its "
            "flush-and-retry). %s=0 keeps torch's default quietly.", SETTING_ENV, VALUE, OPT_OUT_ENV,
        )  # fmt: skip
    return state


class RetryCounter:
    """``num_alloc_retries`` of the CUDA caching allocator since the last call (None off CUDA)."""

    def __init__(self, device) -> None:
        self.device = device
        self.last = self._read()

    def _read(self) -> int | None:
        if getattr(self.device, "type", None) != "cuda":
            return None
        import torch

        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def delta(self) -> int | None:
        now = self._read()
        if now is None or self.last is None:
            return None
        grown, self.last = now - self.last, now
        return grown
