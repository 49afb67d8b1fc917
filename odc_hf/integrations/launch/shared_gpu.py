"""Several ranks on one GPU: the shared-GPU run mode, for development and tests on a machine with fewer GPUs than
ranks (correctness, not speed: the ranks share the GPU's SMs and memory).

Entered automatically when a launch starts more processes on a node than the node has visible GPUs
(``LOCAL_WORLD_SIZE`` > ``torch.cuda.device_count()`` >= 1), e.g. ``python examples/sft.py`` or
``accelerate launch --config_file accelerate_configs/odc.yaml --num_processes 2 ...`` on a one-GPU machine:

* every rank computes on ``cuda:<local_rank % GPUs>``, and its ``LOCAL_RANK`` is set to that GPU's index
  (:func:`localize_rank`): accelerate's barrier passes ``device_ids=[LOCAL_RANK]``, and a gloo barrier asked for
  ``cuda:1`` on a one-GPU machine fails with "invalid device ordinal" (measured);
* the process group is **gloo** (NCCL refuses two ranks on one GPU, "duplicate GPU"); gloo runs the few
  collectives the Trainer and TRL need on CUDA tensors (all-reduce, all-gather, broadcast, barrier);
* ODC's CUDA transport maps peers' buffers with CUDA IPC (``cuda_peer_memory="auto"``; symmetric memory refuses
  ranks on one device);
* the paths that would run torch's functional collectives on gloo + CUDA tensors (``DTensor.full_tensor()``, which
  crashed the process there) are routed around: gradient-norm clipping is computed from the local shards
  (:meth:`odc_hf.integrations.accelerate.accelerator.ODCAccelerator.clip_grad_norm_`) and full state dicts are gathered
  through CPU tensors (:func:`full_state_dict`);
* ``activation_checkpointing="auto"`` plans against the GPU's memory divided by the ranks sharing it.

Automatic, not a switch: on such a launch nothing else can run (NCCL cannot start), so there is no choice to make;
``one line`` on the main process says the mode is on. Every way in gets the gloo group (:func:`settle_process_group`):

* arguments that odc_hf builds (``ODCSFTConfig``, ``ODCGRPOConfig``, ``ODCTrainingArguments``) take
  ``ddp_backend="gloo"`` by themselves;
* ``python -m odc_hf.run`` and ``ODCAccelerator`` start the gloo group before anything else;
* transformers' ``TrainingArguments`` and TRL's ``SFTConfig`` / ``GRPOConfig`` built in your own script or notebook
  start NCCL (lazily: it connects at its first collective, which two ranks on one GPU cannot do). The ODC trainers,
  ``ODCAccelerator`` and ``odc_hf.prepare`` replace that unused NCCL group with a gloo group before their first
  collective (:func:`replace_default_group`; under torchrun, ``accelerate launch`` and ``notebook_launcher``, whose
  rendezvous store outlives the group), and accelerate's state is told the group's backend
  (:mod:`odc_hf.integrations.upstream.accelerate`: its gathers of 2-D tensors depend on it). A collective your own
  code runs before the trainer (``training_args.main_process_first()``) still meets NCCL there: build odc_hf's
  arguments for that, or launch through ``python -m odc_hf.run`` (both set the ranks up before the arguments).
"""

from __future__ import annotations

import logging
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

BACKEND = "gloo"
_ANNOUNCED: list[bool] = []


def _int_env(environ, name: str) -> int | None:
    value = environ.get(name, "").strip()
    return int(value) if value.isdigit() else None


def _cpu_launch(environ) -> bool:
    return environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes")


def ranks_per_gpu(environ=None, gpus: int | None = None) -> int:
    """How many ranks of this node share each visible GPU: 1 for one GPU per rank, CPU launches and single
    processes; ``ceil(LOCAL_WORLD_SIZE / GPUs)`` where a launch started more processes than there are GPUs."""
    environ = os.environ if environ is None else environ
    local = _int_env(environ, "LOCAL_WORLD_SIZE")
    if local is None or local < 2 or _cpu_launch(environ):
        return 1
    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 1 or local <= gpus:
        return 1
    return math.ceil(local / gpus)


def active(environ=None, gpus: int | None = None) -> bool:
    """Whether this process is a rank of a shared-GPU launch (:func:`ranks_per_gpu` > 1)."""
    return ranks_per_gpu(environ, gpus) > 1


def describe(environ=None, gpus: int | None = None) -> str:
    """The one line that says the mode is on, e.g. ``2 ranks share cuda:0: for development and tests, not speed``."""
    environ = os.environ if environ is None else environ
    local = _int_env(environ, "LOCAL_WORLD_SIZE") or 1
    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    where = "cuda:0" if gpus == 1 else f"{gpus} GPUs"
    return f"{local} ranks share {where}: for development and tests, not speed"


def announce(environ=None) -> None:
    """Say once per process, on rank 0, that the shared-GPU mode is on (a warning: seen at every verbosity)."""
    environ = os.environ if environ is None else environ
    if _ANNOUNCED or not active(environ):
        return
    _ANNOUNCED.append(True)
    if _int_env(environ, "RANK") in (0, None):
        logger.warning("odc_hf: %s (process group gloo, CUDA IPC peer memory; docs/troubleshooting.md)",
                       describe(environ))  # fmt: skip


def device(environ=None) -> torch.device:
    """This rank's GPU in a shared-GPU launch: ``cuda:<LOCAL_RANK % GPUs>`` (accelerate's rule)."""
    environ = os.environ if environ is None else environ
    local_rank = _int_env(environ, "LOCAL_RANK") or 0
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def localize_rank(environ=None) -> None:
    """In the mode: ``LOCAL_RANK`` := ``LOCAL_RANK % GPUs``, the index of this rank's GPU, before accelerate reads it.

    accelerate takes its device from it (``local_process_index % device_count``: unchanged) and passes it as
    ``torch.distributed.barrier(device_ids=[local_process_index])``, which a gloo group turns into a tensor on that
    device: ``cuda:1`` on a one-GPU machine ("invalid device ordinal"). Ranks of the node are told apart by ``RANK``."""
    environ = os.environ if environ is None else environ
    local_rank = _int_env(environ, "LOCAL_RANK")
    if active(environ) and local_rank is not None and torch.cuda.is_available():
        environ["LOCAL_RANK"] = str(local_rank % torch.cuda.device_count())


def init_process_group(environ=None, timeout_s: float = 1800.0) -> bool:
    """In a shared-GPU launch, before anything else starts torch.distributed: set this rank's GPU and initialise
    the default process group with gloo. Returns whether the mode is on. A no-op elsewhere, or when a process
    group exists already (then :func:`check_backend` says whether it can serve)."""
    environ = os.environ if environ is None else environ
    if not active(environ):
        return False
    announce(environ)
    localize_rank(environ)
    if dist.is_available() and not dist.is_initialized():
        if torch.cuda.is_available():  # always, in the mode (a CPU test stands in for it without)
            torch.cuda.set_device(device(environ))
        dist.init_process_group(BACKEND, timeout=timedelta(seconds=timeout_s))
    check_backend(environ)
    return True


def settle_process_group(environ=None, timeout_s: float = 1800.0) -> None:
    """Before the first collective of an ODC trainer or accelerator: in a shared-GPU launch, the default process group
    is gloo (started here if none exists; an NCCL group that the training arguments started is replaced, see
    :func:`replace_default_group`) and ``LOCAL_RANK`` names this rank's GPU; in every launch, accelerate's state names
    the group's real backend (:func:`odc_hf.integrations.upstream.accelerate.align_backend`) and, in the mode, its
    local process index this rank's GPU."""
    from odc_hf.integrations.upstream.accelerate import align_backend, align_local_process_index

    environ = os.environ if environ is None else environ
    if active(environ):
        announce(environ)
        localize_rank(environ)  # idempotent; the arguments may have read LOCAL_RANK before (aligned below)
        if not (dist.is_available() and dist.is_initialized()):
            init_process_group(environ, timeout_s=timeout_s)  # no group yet: gloo now
        elif _group_backend() == "nccl" and _store_outlives_group(environ):
            replace_default_group(environ, timeout_s=timeout_s)
        check_backend(environ)  # anything but gloo now is refused, saying what to set
        align_local_process_index(_int_env(environ, "LOCAL_RANK"))
    align_backend()


def _group_backend() -> str:
    return str(dist.get_backend()).lower() if dist.is_available() and dist.is_initialized() else ""


def _store_outlives_group(environ) -> bool:
    """Whether the launch's rendezvous store lives on when the group is destroyed: torchrun's (``accelerate launch``,
    ``notebook_launcher``) agent holds it (``TORCHELASTIC_USE_AGENT_STORE=True``) and every rank is its client."""
    return environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and bool(environ.get("MASTER_PORT", "").isdigit())


_REPLACEMENTS: list[int] = []


def replace_default_group(environ=None, timeout_s: float = 1800.0) -> None:
    """Replace the default process group by a gloo group of the same ranks, through the launch's rendezvous store.

    For an NCCL group that the training arguments started in a shared-GPU launch: torch starts NCCL's communicators
    at the first collective, and that collective cannot succeed with two ranks on one GPU ("duplicate GPU"), so the
    group has carried nothing when odc_hf takes over. The new group meets under a key prefix of its own in the
    launcher's store (the old group's keys stay where they are), with every rank's rank and world size unchanged.
    Collective: every rank calls it at the same point. torch supports re-creating the default group after
    ``destroy_process_group`` (it resets its group counter for that)."""
    environ = os.environ if environ is None else environ
    rank, world_size = dist.get_rank(), dist.get_world_size()
    old = _group_backend()
    dist.destroy_process_group()
    _REPLACEMENTS.append(1)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(environ.get("MASTER_ADDR", "127.0.0.1"), int(environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)  # fmt: skip
    prefix = dist.PrefixStore(f"odc_hf/shared_gpu_gloo/{len(_REPLACEMENTS)}", store)
    dist.init_process_group(BACKEND, store=prefix, rank=rank, world_size=world_size, timeout=timeout)
    if rank == 0:
        logger.warning("odc_hf: %s: the %s process group that the training arguments started was replaced by gloo",
                       describe(environ), old)  # fmt: skip


def check_backend(environ=None) -> None:
    """Refuse a shared-GPU launch whose process group is NCCL (its first collective would fail with "duplicate
    GPU"), or whose ``LOCAL_RANK`` names a GPU that does not exist (accelerate's barrier would fail with "invalid
    device ordinal"), saying what to set."""
    environ = os.environ if environ is None else environ
    if not (active(environ) and dist.is_available() and dist.is_initialized()):
        return
    local_rank = _int_env(environ, "LOCAL_RANK")
    if local_rank is not None and torch.cuda.is_available() and local_rank >= torch.cuda.device_count():
        raise RuntimeError(
            f"odc_hf: {describe(environ)}, but LOCAL_RANK={local_rank} names no GPU: accelerate's barrier would ask "
            f"for cuda:{local_rank} ('invalid device ordinal'). Let odc_hf set up the ranks before your training "
            "arguments: use odc_hf's ODCSFTConfig / ODCGRPOConfig / ODCTrainingArguments, launch through "
            "`python -m odc_hf.run`, or call odc_hf.integrations.launch.shared_gpu.init_process_group() first "
            "(docs/troubleshooting.md, 'Ranks sharing a GPU')"
        )
    backend = str(dist.get_backend()).lower()
    if "nccl" in backend:
        raise RuntimeError(
            f"odc_hf: {describe(environ)}, but the process group is {backend}: NCCL refuses two ranks on one GPU "
            "('duplicate GPU'), and odc_hf replaces an unused NCCL group only under torchrun, `accelerate launch` or "
            "notebook_launcher (their rendezvous store outlives the group). Use gloo: ddp_backend='gloo' in the "
            "training arguments (odc_hf's ODCSFTConfig / ODCGRPOConfig / ODCTrainingArguments set it by themselves), "
            "or launch through `python -m odc_hf.run` (docs/troubleshooting.md, 'Ranks sharing a GPU')"
        )


def default_ddp_backend(requested: str | None, environ=None) -> str | None:
    """The ``ddp_backend`` odc_hf's training arguments take: ``gloo`` in a shared-GPU launch (an explicit ``nccl``
    is refused there), the user's value otherwise."""
    if not active(environ):
        return requested
    if requested not in (None, BACKEND):
        raise ValueError(
            f"ddp_backend={requested!r} cannot run here: {describe(environ)}, and only gloo runs several ranks on "
            "one GPU (leave ddp_backend unset)"
        )
    announce(environ)
    localize_rank(environ)
    return BACKEND


__all__ = [
    "BACKEND",
    "active",
    "announce",
    "check_backend",
    "default_ddp_backend",
    "describe",
    "device",
    "init_process_group",
    "localize_rank",
    "ranks_per_gpu",
    "replace_default_group",
    "settle_process_group",
]
