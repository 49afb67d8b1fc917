"""TRL's configs with the ``odc_*`` fields of :class:`~odc_hf.integrations.arguments.ODCArguments`:
``ODCSFTConfig`` (for ``ODCSFTTrainer``) and ``ODCGRPOConfig`` (for ``ODCGRPOTrainer``), the way TRL pairs
``<x>_config.py`` with ``<x>_trainer.py``. ``TrlParser`` shows their ``--odc_*`` options.

:func:`quiet_upstream_deprecations` silences two transformers 5.24 FutureWarnings that TRL 1.16 triggers by itself,
whatever the user sets (``SFTConfig`` / ``GRPOConfig`` default ``gradient_checkpointing=True``, which transformers
renamed ``activation_checkpointing``; TRL's generation helpers read ``model.is_gradient_checkpointing``): nothing a
user can change, printed once per process (docs/troubleshooting.md). Only these two messages are filtered, and only
where odc_hf builds or uses the configs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

from trl import GRPOConfig, SFTConfig

from odc_hf.integrations.arguments import ODCArguments
from odc_hf.integrations.cuda_allocator import prefer_expandable_segments
from odc_hf.integrations.vllm_version import prefer_vllm_environment

UPSTREAM_DEPRECATIONS = (
    r"`gradient_checkpointing` is deprecated and will be removed in v6",
    r"`is_gradient_checkpointing` is deprecated and will be removed in v6",
)


def ignore_upstream_deprecations() -> None:
    """Filter :data:`UPSTREAM_DEPRECATIONS` for the rest of the process (``python -m odc_hf.run`` does, as the recipe
    builds TRL's own config)."""
    for message in UPSTREAM_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


@contextlib.contextmanager
def quiet_upstream_deprecations():
    """Filter :data:`UPSTREAM_DEPRECATIONS` inside the block only."""
    with warnings.catch_warnings():
        ignore_upstream_deprecations()
        yield


@dataclasses.dataclass
class ODCSFTConfig(ODCArguments, SFTConfig):
    """``trl.SFTConfig`` plus the ``odc_*`` fields of :class:`ODCArguments`."""

    def __post_init__(self):
        prefer_expandable_segments()  # before the arguments start CUDA (``self.device``): see cuda_allocator
        with quiet_upstream_deprecations():
            super().__post_init__()


@dataclasses.dataclass
class ODCGRPOConfig(ODCArguments, GRPOConfig):
    """``trl.GRPOConfig`` plus the ``odc_*`` fields of :class:`ODCArguments`."""

    def __post_init__(self):
        prefer_expandable_segments()  # before the arguments start CUDA (``self.device``): see cuda_allocator
        if self.use_vllm:  # before anything imports and starts vLLM: see vllm_version
            prefer_vllm_environment()
        with quiet_upstream_deprecations():
            super().__post_init__()


__all__ = ["ODCGRPOConfig", "ODCSFTConfig", "ignore_upstream_deprecations", "quiet_upstream_deprecations"]
