"""Across nodes: one bounded all-reduce per minibatch over the replicate group, and a job-wide failure channel.

Under hybrid sharding (HSDP) ODC runs within each shard group (one node: :class:`~odc_hf.transport.control.
HostControl` plus a one-sided transport) and the shard groups hold replicas of the same shards. Once per
minibatch every rank sums its accumulated gradient shard with the ranks that own the same shard on the other
nodes (its *replicate group*) on the process group's own engine: NCCL on GPUs, gloo on CPU.

Two things the intra-node control block cannot do are added here:

* **Bounded waits.** The all-reduces are issued with ``async_op=True`` and polled against ``timeout_s``,
  so a replica that never arrives makes this rank raise :class:`PeerTimeoutError` naming it, instead of
  hanging until the process group's own timeout (NCCL's watchdog would then kill the process without
  saying who was missing).
* **A failure channel that reaches every node**: a ``torch.distributed.TCPStore`` served by the rank at
  mesh position (0, 0). A rank that fails (or sees a peer of its node die) writes one message there (first
  writer wins); every rank waiting anywhere in ODC (in this all-reduce, or in its node's barriers through
  ``HostControl.remote_check``) polls it every 50 ms and raises :class:`PeerFailedError` with it. Each
  rank also records the last minibatch it reached the all-reduce in, so a timeout names the replicas that
  never arrived.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from odc_hf.transport.base import PeerFailedError, PeerTimeoutError
from odc_hf.transport.control import group_ranks

_POLL_PERIOD_S = 0.05
_ABORT_KEY = "odc/abort"
_GRACE_S = 3.0
"""After a failed all-reduce (a peer's connection closed), how long to wait for the failure's own report."""


def open_job_store(shard_group: dist.ProcessGroup, replicate_group: dist.ProcessGroup, timeout_s: float):
    """Collective over the mesh: a TCPStore served by the rank at mesh position (0, 0), reachable from all.

    The address travels along the two mesh groups (first the shard group of replica 0, then every replicate
    group), so no collective over ranks outside the mesh is needed.
    """
    timeout = timedelta(seconds=max(10.0, min(float(timeout_s), 300.0)))
    is_host = dist.get_rank(shard_group) == 0 and dist.get_rank(replicate_group) == 0
    server = None
    box: list = [None]
    if is_host:
        # MASTER_ADDR is how the launcher reaches global rank 0; elsewhere the host name must resolve.
        host = os.environ.get("MASTER_ADDR") if dist.get_rank() == 0 else None
        host = host or socket.getfqdn()
        server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        box = [(host, server.port, dist.get_rank())]
    if dist.get_rank(replicate_group) == 0:
        dist.broadcast_object_list(box, group=shard_group, group_src=0)
    dist.broadcast_object_list(box, group=replicate_group, group_src=0)
    host, port, host_rank = box[0]
    store = server or dist.TCPStore(host, port, is_master=False, timeout=timeout)
    return store, host_rank


class ReplicaSync:
    """Sum tensors over the replicate group once per minibatch, within ``timeout_s``, and carry failures."""

    def __init__(
        self, shard_group: dist.ProcessGroup, replicate_group: dist.ProcessGroup, *, timeout_s: float
    ):
        self.group = replicate_group
        self.ranks = group_ranks(replicate_group)
        self.rank = dist.get_rank()
        self.timeout_s = float(timeout_s)
        self.store, self.store_rank = open_job_store(shard_group, replicate_group, timeout_s)
        self._closed = False

    # -- the failure channel ----------------------------------------------------------------------------------
    def announce(self, message: str) -> None:
        """Tell every rank of the job that ``message`` happened (keeps the first message if several fail)."""
        if self._closed:
            return
        try:
            self.store.compare_set(_ABORT_KEY, "", message[:2000])
        except Exception:  # noqa: BLE001 - the store's host may be the rank that died; nothing more to tell
            pass

    def check(self, where: str) -> None:
        """Raise :class:`PeerFailedError` if any rank announced a failure (or the store's host is gone)."""
        message = self._announced(where)
        if message is not None:
            raise PeerFailedError(f"{message} [news from ODC's failure channel; {where}]")

    def _announced(self, where: str) -> str | None:
        try:
            if not self.store.check([_ABORT_KEY]):
                return None
            return self.store.get(_ABORT_KEY).decode("utf-8", "replace")
        except Exception as err:  # noqa: BLE001 - a store that cannot be reached is itself the news
            raise self._unreachable(err, where) from err

    # -- the all-reduce ---------------------------------------------------------------------------------------
    def all_reduce(self, tensors: list[torch.Tensor], *, what: str, minibatch: int) -> None:
        """Sum ``tensors`` in place over the replicate group; every wait bounded by ``timeout_s``."""
        where = f"rank {self.rank} was waiting in the {what} of minibatch {minibatch}"
        self._arrive(minibatch)
        try:
            works = [dist.all_reduce(t, group=self.group, async_op=True) for t in tensors]
        except Exception as err:  # noqa: BLE001 - gloo may fail at once when a peer's connection is gone
            self._raise_failed(err, what, where, minibatch)
        start = time.monotonic()
        next_check = start + _POLL_PERIOD_S
        pause = 0.0
        while not all(w.is_completed() for w in works):
            now = time.monotonic()
            if now >= next_check:
                self.check(where)
                next_check = now + _POLL_PERIOD_S
            if now - start > self.timeout_s:
                missing = self._missing(minibatch)
                message = (
                    f"replica rank(s) {missing or self.ranks} did not arrive at the {what} of minibatch "
                    f"{minibatch} within {self.timeout_s:g} s; {where}. Raise the timeout (ODC_TIMEOUT_S) if they "
                    "are just slow."
                )
                self.announce(message)
                raise PeerTimeoutError(message)
            time.sleep(pause)
            pause = min(max(pause * 2, 2e-5), 2e-3)
        try:
            for w in works:
                w.wait()  # completed: returns at once (and on CUDA orders the current stream after it)
        except Exception as err:  # noqa: BLE001
            self._raise_failed(err, what, where, minibatch)

    def _arrive(self, minibatch: int) -> None:
        try:
            self.store.set(f"odc/arrived/{self.rank}", str(minibatch))
        except Exception as err:  # noqa: BLE001
            raise self._unreachable(err, f"rank {self.rank} was arriving at minibatch {minibatch}") from err

    def _unreachable(self, err: BaseException, where: str) -> PeerFailedError:
        return PeerFailedError(
            f"rank {self.store_rank}, which serves ODC's failure channel (a TCPStore), cannot be reached "
            f"({type(err).__name__}: {err}); it probably died. {where}"
        )

    def _missing(self, minibatch: int) -> list[int]:
        """Replicas that have not reached the all-reduce of ``minibatch`` (best effort: [] if unknown)."""
        missing = []
        try:
            for rank in self.ranks:
                key = f"odc/arrived/{rank}"
                if not self.store.check([key]) or int(self.store.get(key)) < minibatch:
                    missing.append(rank)
        except Exception:  # noqa: BLE001
            return []
        return missing

    def _raise_failed(self, err: BaseException, what: str, where: str, minibatch: int):
        """The all-reduce itself failed (a peer's connection closed): report the cause, not just the symptom."""
        deadline = time.monotonic() + _GRACE_S
        while time.monotonic() < deadline:  # the failed rank's node reports it within ~50 ms of noticing
            self.check(where)
            time.sleep(_POLL_PERIOD_S)
        missing = self._missing(minibatch)
        message = (
            f"the {what} failed ({type(err).__name__}: {str(err)[:300]}); replica rank(s) "
            f"{missing or 'unknown'} never arrived at minibatch {minibatch}; {where}"
        )
        self.announce(message)
        raise PeerFailedError(message) from err

    def close(self) -> None:
        self._closed = True
