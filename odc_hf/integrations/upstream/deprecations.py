"""Two transformers 5.24 FutureWarnings that TRL 1.16 triggers by itself, silenced where odc_hf builds or uses TRL's
configs.

Whatever the user sets, ``SFTConfig`` / ``GRPOConfig`` default ``gradient_checkpointing=True``, which transformers
renamed ``activation_checkpointing``, and TRL's generation helpers read ``model.is_gradient_checkpointing``: nothing a
user can change, printed once per process (docs/troubleshooting.md). Only these two messages are filtered.
"""

from __future__ import annotations

import contextlib
import warnings

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
