"""``ODCSFTConfig``: TRL's ``SFTConfig`` with the ``odc_*`` fields of
:class:`~odc_hf.integrations.trainer.arguments.ODCArguments`, for ``ODCSFTTrainer`` (``TrlParser`` shows its ``--odc_*``
options)."""

from __future__ import annotations

import dataclasses

from trl import SFTConfig

from odc_hf.integrations.launch.cuda_allocator import prefer_expandable_segments
from odc_hf.integrations.trainer.arguments import ODCArguments
from odc_hf.integrations.upstream.deprecations import quiet_upstream_deprecations


@dataclasses.dataclass
class ODCSFTConfig(ODCArguments, SFTConfig):
    """``trl.SFTConfig`` plus the ``odc_*`` fields of :class:`ODCArguments`."""

    def __post_init__(self):
        prefer_expandable_segments()  # before the arguments start CUDA (``self.device``): see cuda_allocator
        with quiet_upstream_deprecations():
            super().__post_init__()


__all__ = ["ODCSFTConfig"]
