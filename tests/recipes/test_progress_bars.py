"""One progress bar per task with several ranks: the ODC trainers turn off the ``datasets`` and transformers bars on
every rank but the main process (transformers draws its training bar there alone). The launched runs are checked in
tests/recipes/test_recipe_docs.py (each bar's description starts once); this is the switch itself."""

from __future__ import annotations

from types import SimpleNamespace

import datasets
import pytest
from transformers.utils import logging as transformers_logging

from odc_hf.integrations.trainer.observability import one_progress_bar


@pytest.fixture
def bars_restored():
    yield
    datasets.enable_progress_bars()
    transformers_logging.enable_progress_bar()


@pytest.mark.parametrize("rank, drawn", [(0, True), (1, False), (3, False)])
def test_only_the_main_process_draws_progress_bars(bars_restored, rank, drawn):
    datasets.enable_progress_bars()
    transformers_logging.enable_progress_bar()
    one_progress_bar(SimpleNamespace(process_index=rank))
    assert datasets.is_progress_bar_enabled() is drawn
    assert transformers_logging.is_progress_bar_enabled() is drawn
