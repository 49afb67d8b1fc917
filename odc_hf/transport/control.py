"""Host-side control block: the one synchronisation ODC needs per minibatch, with timeouts that name peers.

Why not a gloo/NCCL barrier? A collective that times out says "timed out" or "connection closed by peer
<address>"; it cannot tell which rank is missing, and NCCL's watchdog tears the process down. Our ranks live
on one node (both transports are intra-node), so a few bytes of shared memory per rank give a barrier that
knows exactly who has not arrived, notices a dead peer within ~50 ms (its pid vanished), and carries a
failure message from a rank that raised (:meth:`HostControl.abort`).

Layout: one record of ``_RECORD`` bytes per rank: int64 fields (pid, epoch, aborted), two float64 count
slots (double-buffered by epoch parity: a fast rank at epoch ``e+1`` writes the other slot while a slow
rank still reads epoch ``e``'s), and an abort message.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from odc_hf.transport import shm_files
from odc_hf.transport.base import PeerFailedError, PeerTimeoutError

_RECORD = 512
_PID, _EPOCH, _ABORTED = 0, 1, 2
_INTS = 8  # int64 fields at the start of a record
_COUNTS_OFFSET = _INTS * 8  # two float64 slots
_MSG_OFFSET = _COUNTS_OFFSET + 16
_MSG_LEN = _RECORD - _MSG_OFFSET
_LIVENESS_PERIOD_S = 0.05


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order (errors name ranks by their global rank)."""
    return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)


def check_single_node(group: dist.ProcessGroup | None) -> None:
    """Collective over ``group``: raise (on every rank) unless all its ranks run on one host."""
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) == 1:
        return
    ranks = group_ranks(group)
    by_host: dict[str, list[int]] = {}
    for rank, host in zip(ranks, hosts):
        by_host.setdefault(host, []).append(rank)
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    world = dist.get_world_size()
    known = local.isdigit() and int(local) > 0 and world % int(local) == 0
    shape = f"({world // int(local)}, {local})" if known else "(nodes, ranks_per_node)"
    raise NotImplementedError(
        f"ODC's shard group spans several nodes (ranks by host: {by_host}), but its one-sided transfers work "
        "within one node. Shard within each node and replicate across nodes (HSDP): "
        f"fully_shard(mesh=init_device_mesh(device_type, {shape}, mesh_dim_names=('replicate', 'shard'))) "
        "or odc_hf.fsdp.shard_model(model, mesh=...); with accelerate, ParallelismConfig("
        "dp_replicate_size=<nodes>, dp_shard_size=<ranks per node>)"
        + (f" (LOCAL_WORLD_SIZE={local} here)." if known else ".")
    )


class HostControl:
    """Barrier + sum of one float per rank over shared memory, with timeout, abort and liveness checks."""

    def __init__(self, group: dist.ProcessGroup | None, *, timeout_s: float, shm_dir: str | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.global_ranks = group_ranks(group)  # errors name global ranks (the group may be an HSDP shard group)
        self.timeout_s = float(timeout_s)
        self.remote_check: Callable[[str], None] | None = None
        """Called with the waiting rank's context every liveness period while waiting: raises when a rank
        outside this node failed (the HSDP failure channel, :mod:`odc_hf.transport.replicas`)."""
        check_single_node(group)
        nbytes = self.world_size * _RECORD
        box: list = [None]
        own = None
        if self.rank == 0:
            directory = shm_files.pick_dir(nbytes, shm_dir)
            shm_files.sweep_stale(directory)
            job = shm_files.new_job_id()
            own = shm_files.create(directory, job, "control", nbytes)
            box = [(job, str(own.path))]
        dist.broadcast_object_list(box, group=group, group_src=0)
        self.job, path = box[0]
        self._buffer = shm_files.map_file(path, nbytes)
        raw = self._buffer.numpy()
        self._ints = raw.view(np.int64).reshape(self.world_size, _RECORD // 8)[:, :_INTS]
        self._counts = raw.view(np.float64).reshape(self.world_size, _RECORD // 8)[
            :, _COUNTS_OFFSET // 8 : _COUNTS_OFFSET // 8 + 2
        ]
        self._raw = raw.reshape(self.world_size, _RECORD)
        self._ints[self.rank, _PID] = os.getpid()
        dist.barrier(group=group)
        if own is not None:
            own.release()
        self.pids = [int(p) for p in self._ints[:, _PID]]
        # Ranks in other pid namespaces (containers) are invisible; then rely on the timeout alone.
        self._check_pids = all(shm_files.pid_alive(p) for p in self.pids)
        self.epoch = 0

    # -- failure reporting ------------------------------------------------------------------------
    def abort(self, reason: str) -> None:
        message = reason.encode("utf-8", "replace")[: _MSG_LEN - 1]
        row = self._raw[self.rank, _MSG_OFFSET : _MSG_OFFSET + _MSG_LEN]
        row[:] = 0
        row[: len(message)] = np.frombuffer(message, dtype=np.uint8)
        self._ints[self.rank, _ABORTED] = 1

    def _abort_message(self, rank: int) -> str:
        row = bytes(self._raw[rank, _MSG_OFFSET : _MSG_OFFSET + _MSG_LEN])
        return row.split(b"\0", 1)[0].decode("utf-8", "replace")

    @property
    def announced(self) -> bool:
        """Whether this rank has written a failure message (:meth:`abort`)."""
        return self._ints is not None and bool(self._ints[self.rank, _ABORTED])

    def check_peers(self, where: str) -> None:
        """Raise :class:`PeerFailedError` if a peer announced a failure or died (what a waiting barrier checks);
        ``where`` says what this rank was doing, for the message."""
        if self._ints is not None:
            others = [r for r in range(self.world_size) if r != self.rank]
            self._raise_if_peer_failed(where, others, check_pids=True)

    def _raise_if_peer_failed(self, where: str, lagging: list[int], check_pids: bool) -> None:
        for peer in np.flatnonzero(self._ints[:, _ABORTED]).tolist():
            if peer != self.rank:
                name = self.global_ranks[peer]
                raise PeerFailedError(f"rank {name} failed ({self._abort_message(peer)}); {where}")
        if check_pids and self._check_pids:
            for peer in lagging:
                if not shm_files.pid_alive(self.pids[peer]):
                    raise PeerFailedError(f"rank {self.global_ranks[peer]} (pid {self.pids[peer]}) died; {where}")
        if check_pids and self.remote_check is not None:
            self.remote_check(where)

    # -- the barrier ------------------------------------------------------------------------------
    def barrier(self, count: float = 0.0, *, what: str = "barrier", minibatch: int | None = None) -> float:
        """Arrive, wait for every rank (or raise naming the missing ones), return the rank-ordered sum."""
        epoch = self.epoch + 1
        slot = epoch % 2
        self._counts[self.rank, slot] = float(count)
        self._ints[self.rank, _EPOCH] = epoch  # published after the count (x86-TSO store order)
        start = time.monotonic()
        next_check = start + _LIVENESS_PERIOD_S
        pause = 0.0
        while True:
            epochs = self._ints[:, _EPOCH]
            if epochs.min() >= epoch:
                break
            now = time.monotonic()
            lagging = np.flatnonzero(epochs < epoch).tolist()
            mb = "" if minibatch is None else f" of minibatch {minibatch}"
            where = f"rank {self.global_ranks[self.rank]} was waiting in the {what}{mb}"
            try:
                self._raise_if_peer_failed(where, lagging, check_pids=now >= next_check)
            except PeerFailedError:
                # Every rank arrived before the peer failed (it raised after passing this barrier): the barrier is
                # complete; the failure is reported at this rank's next wait, not as a failure to arrive here.
                if self._ints[:, _EPOCH].min() >= epoch:
                    break
                raise
            if now >= next_check:
                next_check = now + _LIVENESS_PERIOD_S
            if now - start > self.timeout_s:
                raise PeerTimeoutError(
                    f"rank(s) {[self.global_ranks[r] for r in lagging]} did not arrive within {self.timeout_s:g} s; "
                    f"{where}. "
                    "Raise the timeout (ODC_TIMEOUT_S) if they are just slow."
                )
            # Yield first (barrier latency matters between microsecond-apart arrivals), then back off.
            time.sleep(pause)
            pause = min(max(pause * 2, 2e-5), 2e-3)
        self.epoch = epoch
        total = 0.0
        for value in self._counts[:, slot].tolist():
            total += value
        return total

    def close(self) -> None:
        self._ints = self._counts = self._raw = None
        self._buffer = torch.empty(0, dtype=torch.uint8)
