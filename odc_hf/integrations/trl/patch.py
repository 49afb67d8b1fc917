"""``patch_trl()``: TRL's public trainer names bound to the ODC trainers, for recipes that import them.

The trainers themselves are ``odc_hf.integrations.trl.sft_trainer`` (``ODCSFTTrainer``) and
``odc_hf.integrations.trl.grpo_trainer`` (``ODCGRPOTrainer``); ``python -m odc_hf.run`` patches TRL before it runs a recipe.
"""

from __future__ import annotations

import trl
import trl.trainer

from odc_hf.integrations.trl.grpo_trainer import ODCGRPOTrainer
from odc_hf.integrations.trl.sft_trainer import ODCSFTTrainer

_PATCHED: dict[str, list] = {}  # name -> [(module, TRL's class)] while patch_trl() is in effect


class TRLPatch:
    """What :func:`patch_trl` returns. As a context manager, leaving the ``with`` block undoes the patch it applied
    (``unpatch_trl()``); if TRL was already patched when ``patch_trl()`` was called, leaving does nothing."""

    def __init__(self, applied: bool):
        self.applied = applied

    def __enter__(self) -> TRLPatch:
        return self

    def __exit__(self, *exc) -> None:
        if self.applied:
            unpatch_trl()


def patch_trl() -> TRLPatch:
    """Make ``trl.SFTTrainer`` and ``trl.GRPOTrainer`` (as recipe scripts import them) the ODC versions, in this
    process only, until :func:`unpatch_trl` (or the end of ``with patch_trl(): ...``).

    TRL has no plugin mechanism and its recipes do ``from trl import SFTTrainer`` / ``GRPOTrainer``; rebinding
    those public names before the recipe imports them is the least intrusive way in (nothing inside TRL is modified).
    Names a module imported while patched keep pointing at the ODC classes after ``unpatch_trl()``.
    """
    if _PATCHED:
        return TRLPatch(applied=False)
    modules = [trl, trl.trainer]
    # odc_hf.ODCSFTTrainer is trl.SFTTrainer while patched; both ODC classes were built from TRL's own classes when
    # this module was imported, before anything is rebound.
    replacements = {"SFTTrainer": ODCSFTTrainer, "GRPOTrainer": ODCGRPOTrainer}
    for name, cls in replacements.items():
        _PATCHED[name] = [(module, getattr(module, name)) for module in modules]
        for module in modules:
            setattr(module, name, cls)
    return TRLPatch(applied=True)


def unpatch_trl() -> None:
    """Give ``trl`` / ``trl.trainer`` back TRL's own ``SFTTrainer`` and ``GRPOTrainer``; a no-op when not patched."""
    for name, saved in _PATCHED.items():
        for module, original in saved:
            setattr(module, name, original)
    _PATCHED.clear()


__all__ = ["TRLPatch", "patch_trl", "unpatch_trl"]
