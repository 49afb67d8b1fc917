"""accelerate's idea of the process group's backend, made to match the group that really runs.

accelerate's ``PartialState`` takes its ``backend`` when it is created: the one passed to it (``ddp_backend`` of the
training arguments, ``InitProcessGroupKwargs``), else the device's default (``nccl`` on a CUDA host). When
torch.distributed is already initialised it keeps the existing group and does not read that group's backend
(``PartialState.__init__`` / ``_prepare_backend``, accelerate 1.15 and 1.16). Its gathers choose their path from the
name it holds (``accelerate.utils.operations._gpu_gather``): any backend but ``gloo`` gathers with
``all_gather_into_tensor`` into a flat buffer of ``world_size * numel`` elements, which gloo splits into
``world_size`` 1-D pieces and compares with the input's shape, so every tensor of two or more dimensions fails on a
gloo group ("ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (4, 1), got (4))": TRL's
``_calculate_rewards`` gathering rewards of shape (n, functions)); 1-D tensors pass by luck.

odc_hf starts a gloo group before accelerate's state exists where ranks share a GPU (``python -m odc_hf.run``,
``ODCAccelerator``; :mod:`odc_hf.integrations.launch.shared_gpu`), and transformers' and TRL's own training arguments then
create that state with the CUDA default. :func:`align_backend` puts the group's real backend into accelerate's state;
every accelerator odc_hf uses passes through it (``adopt``). Where the training arguments created the state before
odc_hf could set ``LOCAL_RANK`` to the rank's GPU, :func:`align_local_process_index` does the same for accelerate's
local process index. Neither field is documented as settable, so this module is the one place that writes them;
``tests/trainers/test_shared_gpu_backend.py`` checks that accelerate's gathers then work on gloo for 2-D tensors of every
dtype gloo carries, on the tested accelerate minors (``odc_hf.version.TESTED``; another one warns once).
"""

from __future__ import annotations

import logging

import accelerate
import torch.distributed as dist
from accelerate.state import AcceleratorState, PartialState, is_initialized

from odc_hf.version import warn_if_untested

logger = logging.getLogger(__name__)

GLOO = "gloo"


def _check_version() -> None:
    warn_if_untested("accelerate")  # once per process, on rank 0


def believed_backend() -> str | None:
    """The backend accelerate's state names, or ``None`` when no state exists yet (does not create one)."""
    if not PartialState._shared_state:  # PartialState() would create the state; read the shared dict instead
        return None
    return PartialState._shared_state.get("backend")


def align_backend() -> bool:
    """When the default process group is gloo and accelerate's state names another backend, make it name gloo (see
    the module docstring). Returns whether it changed anything. A no-op without a process group or accelerate state,
    and for groups of other backends (accelerate's list-based gather, which it takes for gloo, works on every
    backend)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    believed = believed_backend()
    if believed is None or str(dist.get_backend()) != GLOO or believed == GLOO:
        return False
    _check_version()
    PartialState().backend = GLOO  # the instance's __dict__ is the shared state
    if is_initialized():
        AcceleratorState().backend = GLOO  # AcceleratorState keeps its own copy of PartialState's fields
    logger.debug("odc_hf: accelerate %s named the process group %r; it is gloo", accelerate.__version__, believed)
    return True


def align_local_process_index(index: int | None) -> bool:
    """Make accelerate's ``local_process_index`` ``index`` (the GPU a rank computes on where ranks share one: see
    :func:`odc_hf.integrations.launch.shared_gpu.localize_rank`), when accelerate read ``LOCAL_RANK`` before odc_hf set it.
    accelerate passes it as ``torch.distributed.barrier(device_ids=[local_process_index])``, which a gloo group turns
    into a tensor on that GPU ("invalid device ordinal" for ``cuda:1`` on a one-GPU machine). Returns whether it
    changed anything; a no-op without accelerate state."""
    if index is None or not PartialState._shared_state:
        return False
    if PartialState._shared_state.get("local_process_index") in (index, None):
        return False
    _check_version()
    PartialState().local_process_index = index
    if is_initialized():
        AcceleratorState().local_process_index = index
    return True


__all__ = ["align_backend", "align_local_process_index", "believed_backend"]
