"""TRL's configs with the ``odc_*`` fields of :class:`~odc_hf.integrations.arguments.ODCArguments`:
``ODCSFTConfig`` (for ``ODCSFTTrainer``) and ``ODCGRPOConfig`` (for ``ODCGRPOTrainer``), the way TRL pairs
``<x>_config.py`` with ``<x>_trainer.py``. ``TrlParser`` shows their ``--odc_*`` options."""

from __future__ import annotations

import dataclasses

from trl import GRPOConfig, SFTConfig

from odc_hf.integrations.arguments import ODCArguments


@dataclasses.dataclass
class ODCSFTConfig(ODCArguments, SFTConfig):
    """``trl.SFTConfig`` plus the ``odc_*`` fields of :class:`ODCArguments`."""


@dataclasses.dataclass
class ODCGRPOConfig(ODCArguments, GRPOConfig):
    """``trl.GRPOConfig`` plus the ``odc_*`` fields of :class:`ODCArguments`."""


__all__ = ["ODCGRPOConfig", "ODCSFTConfig"]
