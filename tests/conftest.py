"""Fixtures shared by several test modules."""

import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """Tiny models are dominated by thread hand-off cost on small CPU hosts; one thread is much faster."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
