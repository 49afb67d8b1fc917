"""Fixtures shared by several test modules."""

import sys

import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """Tiny models are dominated by thread hand-off cost on small CPU hosts; one thread is much faster."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def trl_left_unpatched():
    """A test that patches TRL (odc_hf.patch_trl) must undo it: later tests, in any order, see TRL's own classes."""
    yield
    if "odc_hf.integrations.trl" in sys.modules and sys.modules["odc_hf.integrations.trl"]._PATCHED:
        sys.modules["odc_hf.integrations.trl"].unpatch_trl()
        pytest.fail("this test left trl.SFTTrainer / trl.GRPOTrainer patched: use `with odc_hf.patch_trl():`")
