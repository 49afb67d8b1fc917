"""Run a function on N spawned ranks with torch.distributed initialised: for tests, examples and benchmarks.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` fresh processes, initialises the default
process group (gloo on CPU; with ``cuda=True`` rank r computes on ``cuda:<r % GPUs>``, over nccl when every rank has
a GPU of its own and over gloo when ranks share one: :func:`cuda_backend`) through a rendezvous store the parent
holds on a port the OS picked (port 0: no free-port race), calls ``fn(rank, world_size, *args)`` and returns the
per-rank results; :func:`rank_device` tells ``fn`` its device. A rank that raises is reported with its traceback; one that
crashes in native code (a segfault) or that the harness kills with its exit code and faulthandler's Python stack of
where it was. The parent never waits longer than ``timeout_s``, and once a rank has failed the others get
``FAILURE_GRACE_S`` to finish or report their own error.

On Linux the ranks are forked from a multiprocessing fork server that imported torch, transformers, accelerate and
TRL once (``PRELOAD``): a rank starts in well under a second instead of re-importing them (~10 s of CPU per rank),
which is most of a small distributed test's time. The server never runs torch code (no CUDA, no torch threads), and each
rank gets the caller's environment of the moment plus ``env``, as a spawned process would. ``start_method="spawn"``
(the default elsewhere) starts each rank from scratch. :func:`run_process` runs a function the same way in one plain
process: no process group, no rank variables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from odc_hf.transport.peer_memory import SAFE_GPU_ENV


@dataclasses.dataclass
class RankOutcome:
    rank: int
    value: Any = None
    error: str | None = None  # formatted traceback, or a description of how the process ended
    exitcode: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class RanksFailed(AssertionError):
    def __init__(self, outcomes: list[RankOutcome]):
        self.outcomes = outcomes
        parts = [f"--- rank {o.rank} (exit {o.exitcode}) ---\n{o.error}" for o in outcomes if not o.ok]
        super().__init__("ranks failed:\n" + "\n".join(parts))


def free_port() -> int:
    """A port that was free a moment ago. Racy (another process may take it before you bind it): prefer binding
    port 0 where the port is used, as :func:`run_ranks` does with its rendezvous store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RENDEZVOUS_TIMEOUT = timedelta(seconds=120)
FAILURE_GRACE_S = 60.0
"""With ``raise_on_failure``: once a rank has failed, how long the others get to finish or report their own error
(e.g. a peer-failure message) before the harness kills them; the run has failed either way."""

# Imported once by the fork server (modules that are not installed are skipped); nothing of odc_hf's own state.
PRELOAD = ["torch", "torch.distributed", "transformers", "accelerate", "datasets", "trl", "peft"]


def _context(start_method: str | None):
    method = start_method or ("forkserver" if sys.platform.startswith("linux") else "spawn")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first run_ranks call)
    return ctx


def _rendezvous_store(world_size: int):
    """A TCPStore server in the calling process, bound to port 0 (the OS picks a free port and it stays bound while
    the store lives: no window in which another process can take it); the ranks connect to it as clients."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=_RENDEZVOUS_TIMEOUT,
                         wait_for_workers=False)  # fmt: skip


DEVICE_VARIABLE = "RUN_RANKS_DEVICE"


def cuda_backend(world_size: int) -> str:
    """The process group for ``world_size`` CUDA ranks on this machine: nccl with a GPU per rank, else gloo (ranks
    sharing a GPU; NCCL refuses them)."""
    import torch

    return "nccl" if torch.cuda.device_count() >= world_size else "gloo"


def rank_device():
    """Inside a :func:`run_ranks` rank: its GPU when started with ``cuda=True``, else the CPU."""
    import torch

    if os.environ.get(DEVICE_VARIABLE) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _entry(rank, world_size, port, backend, fn, args, queue, env, init_group, crash_path):
    os.environ.clear()  # the caller's environment now, not the fork server's from when it started
    os.environ.update(env)
    if backend is None:  # a plain process: none of a launcher's rank variables, whatever the caller's environment
        for name in _RANK_VARIABLES:
            os.environ.pop(name, None)
    else:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        )  # fmt: skip
        if not init_group:  # the group is the launched code's to start: env:// as under torchrun, the parent's store
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    import faulthandler

    import torch
    import torch.distributed as dist

    # A rank that crashes (SIGSEGV in a native library) writes where to its crash file, which the parent puts in the
    # rank's error: on stderr it would be lost in a test runner's captured output.
    crash_file = open(crash_path, "w")  # noqa: SIM115 - open until the process ends
    faulthandler.enable(file=crash_file, all_threads=True)
    if hasattr(signal, "SIGUSR1"):  # POSIX: the harness asks for the stacks before killing
        faulthandler.register(signal.SIGUSR1, file=crash_file, all_threads=True)
    if "OMP_NUM_THREADS" in env:  # read by OpenMP when torch was imported, which may have been in the fork server
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        cuda = env.get(DEVICE_VARIABLE) == "cuda" or backend == "nccl"
        if backend is None:  # run_process: a plain process, no process group
            queue.put((rank, pickle.dumps(fn(*args)), None))
            return
        if cuda:
            os.environ[DEVICE_VARIABLE] = "cuda"
            torch.cuda.set_device(rank % torch.cuda.device_count())
            # ranks sharing a GPU: LOCAL_RANK names this rank's GPU (odc_hf.integrations.launch.shared_gpu.localize_rank)
            os.environ["LOCAL_RANK"] = str(rank % torch.cuda.device_count())
        if init_group:
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=_RENDEZVOUS_TIMEOUT)
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size, timeout=_RENDEZVOUS_TIMEOUT,
                device_id=torch.device("cuda", rank) if backend == "nccl" else None,
            )  # fmt: skip
        # Plain pickle bytes: tensors sent through a multiprocessing queue would be shared-memory handles,
        # which die with this process before the parent reads them.
        value = pickle.dumps(fn(rank, world_size, *args))
        queue.put((rank, value, None))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def _loads(value: bytes | None):
    return None if value is None else pickle.loads(value)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = "gloo",
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    raise_on_failure: bool = True,
    start_method: str | None = None,
    cuda: bool = False,
    init_process_group: bool = True,
) -> list[Any] | list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes (see the module docstring).

    ``cuda=True``: every rank on a GPU (``cuda:<rank % GPUs>``; :func:`rank_device`), the process group
    :func:`cuda_backend` unless ``backend`` is given as ``"nccl"``.

    Returns the list of values (``raise_on_failure=True``, raising :class:`RanksFailed` otherwise) or the
    list of :class:`RankOutcome` (``raise_on_failure=False``, for tests where a rank is meant to fail).

    ``init_process_group=False``: the ranks get the rank, world and master variables and the rendezvous store as
    torchrun's workers do (``TORCHELASTIC_USE_AGENT_STORE``: ``init_process_group`` with ``env://`` connects to the
    parent's store), and ``fn`` starts the group itself, or lets accelerate start it, as a launched script would.
    """
    if backend is None and world_size != 1:
        raise ValueError("backend=None (no process group) runs one process: use run_process")
    if cuda:
        backend = "nccl" if backend == "nccl" else cuda_backend(world_size)
        env = {**(env or {}), DEVICE_VARIABLE: "cuda"}
    ctx = _context(start_method)
    queue = ctx.Queue()
    # held until every rank has finished (see the end of this function); none for a plain process
    store = _rendezvous_store(world_size) if backend is not None else None
    port = store.port if store is not None else 0
    child_env = {**os.environ, **SAFE_GPU_ENV, "OMP_NUM_THREADS": "1", **(env or {})}
    crash_dir = tempfile.mkdtemp(prefix="run_ranks-")
    crash_paths = [os.path.join(crash_dir, f"rank{r}.txt") for r in range(world_size)]
    procs = [
        ctx.Process(
            target=_entry,
            args=(r, world_size, port, backend, fn, args, queue, child_env, init_process_group, crash_paths[r]),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes = {r: RankOutcome(r) for r in range(world_size)}
    reported: set[int] = set()

    def take(wait_s: float) -> None:
        """Record one rank's report from the queue; ``queue.Empty`` when none arrives within ``wait_s``."""
        rank, value, error = queue.get(timeout=wait_s)
        outcomes[rank].value, outcomes[rank].error = _loads(value), error
        reported.add(rank)

    deadline = time.monotonic() + timeout_s
    failed_at = None  # when the first rank failed: the others then get FAILURE_GRACE_S to report, not the deadline
    while len(reported) < world_size and time.monotonic() < deadline:
        if raise_on_failure and failed_at is None and (
            any(outcomes[r].error for r in reported)  # a rank raised
            or any(p.exitcode not in (None, 0) and r not in reported for r, p in enumerate(procs))  # or crashed
        ):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() > failed_at + FAILURE_GRACE_S:
            deadline = time.monotonic()  # the run has failed; the ranks still waiting (on the failed one) are killed
            break
        try:
            take(0.2)
        except queue_mod.Empty:
            if all(not p.is_alive() for p in procs):
                with contextlib.suppress(queue_mod.Empty):  # drain what the dead processes managed to send
                    while True:
                        take(0.5)
                break
    for r, p in enumerate(procs):
        p.join(timeout=max(0.0, deadline - time.monotonic()) if r in reported else 1.0)
        if p.is_alive():
            _dump_stacks(p)
            p.kill()
            p.join()
            if r not in reported:
                why = f"after {timeout_s:g} s" if failed_at is None else f"{FAILURE_GRACE_S:g} s after another rank failed"
                outcomes[r].error = f"killed by the harness {why}" + _crash_report(
                    crash_paths[r], "where it was waiting"
                )
        outcomes[r].exitcode = p.exitcode
        if r not in reported and outcomes[r].error is None:
            outcomes[r].error = f"process died with exit code {p.exitcode} before reporting" + _crash_report(
                crash_paths[r]
            )
    shutil.rmtree(crash_dir, ignore_errors=True)
    del store  # after every rank has exited or been killed: nobody needs the rendezvous any more
    result = [outcomes[r] for r in range(world_size)]
    if not raise_on_failure:
        return result
    if not all(o.ok for o in result):
        raise RanksFailed(result)
    return [o.value for o in result]


def _dump_stacks(process) -> None:
    """Ask a rank about to be killed for its Python stacks (faulthandler, into its crash file)."""
    try:
        os.kill(process.pid, signal.SIGUSR1)
    except (OSError, AttributeError):  # gone already, or no SIGUSR1 (Windows)
        return
    process.join(timeout=2.0)


def _crash_report(path: str, what: str = "where it crashed") -> str:
    """What faulthandler wrote to the rank's crash file (its Python stacks), or nothing."""
    try:
        with open(path, errors="replace") as f:
            text = f.read().strip()
    except OSError:
        return ""
    return f"; {what} (faulthandler):\n{text}" if text else ""


def run_process(fn: Callable[..., Any], *args: Any, timeout_s: float = 300.0, env: dict[str, str] | None = None,
                start_method: str | None = None) -> Any:
    """``fn(*args)`` in one new process without a process group or rank variables (a plain ``python script.py``
    process, forked from the same server as :func:`run_ranks`' ranks); returns its value or raises
    :class:`RanksFailed` with its traceback."""
    return run_ranks(_call, 1, fn, args, backend=None, timeout_s=timeout_s, env=env, start_method=start_method)[0]


def _call(fn, args):
    return fn(*args)
