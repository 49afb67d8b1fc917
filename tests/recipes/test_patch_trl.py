"""patch_trl() rebinds TRL's public trainer names for recipes and is reversible: unpatch_trl() and the context
manager give TRL its own classes back, so nothing leaks into later code (or later tests, in any order)."""

from __future__ import annotations

import pytest


def _bound():
    import trl
    import trl.trainer

    return trl.SFTTrainer, trl.trainer.SFTTrainer, trl.GRPOTrainer, trl.trainer.GRPOTrainer


def _trl_own():
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.sft_trainer import SFTTrainer

    return SFTTrainer, SFTTrainer, GRPOTrainer, GRPOTrainer


def test_context_manager_patches_both_names_and_restores_them():
    from odc_hf import ODCGRPOTrainer, ODCSFTTrainer, patch_trl

    assert _bound() == _trl_own()
    with patch_trl() as patch:
        assert patch.applied
        assert _bound() == (ODCSFTTrainer, ODCSFTTrainer, ODCGRPOTrainer, ODCGRPOTrainer)
        from trl import GRPOTrainer, SFTTrainer  # what a recipe does

        assert SFTTrainer is ODCSFTTrainer and GRPOTrainer is ODCGRPOTrainer
        # the ODC classes were built from TRL's own classes, not from each other
        assert ODCSFTTrainer.__mro__[1:].count(_trl_own()[0]) == 1
        assert ODCGRPOTrainer.__mro__[1:].count(_trl_own()[2]) == 1
    assert _bound() == _trl_own()


def test_unpatch_restores_and_repeated_calls_are_harmless():
    from odc_hf import ODCSFTTrainer, patch_trl, unpatch_trl

    unpatch_trl()  # not patched: nothing happens
    assert _bound() == _trl_own()
    try:
        first = patch_trl()
        again = patch_trl()  # already patched: a no-op whose exit must not undo the outer patch
        assert first.applied and not again.applied
        with again:
            pass
        assert _bound()[0] is ODCSFTTrainer
    finally:
        unpatch_trl()
    assert _bound() == _trl_own()
    unpatch_trl()
    assert _bound() == _trl_own()


def test_patch_is_undone_when_the_block_raises():
    from odc_hf import patch_trl

    with pytest.raises(RuntimeError, match="recipe failed"):
        with patch_trl():
            raise RuntimeError("recipe failed")
    assert _bound() == _trl_own()
