"""One rank's failure, reported to every peer within a second, wherever the peers are waiting.

Peers wait in two kinds of places. ODC's own barriers read the control block (:mod:`odc_hf.transport.control`), so a
message a failing rank writes there (:meth:`~odc_hf.transport.control.HostControl.abort`) reaches them at once. But
between ODC's barriers they also wait inside torch.distributed collectives that know nothing of it: the Trainer's
token-count all-reduce, ``clip_grad_norm_``'s all-reduce, ``DTensor.full_tensor`` when a checkpoint is gathered,
metric gathers. A gloo collective pending on a rank whose process is still alive (its exception caught by user
code, a notebook cell) waits for the process group's timeout (30 minutes in the Trainer), and nothing in
torch.distributed releases it: measured on torch 2.13, 2 CPU ranks, a peer blocked in ``all_reduce`` while the
failing rank called ``destroy_process_group()``, ``ProcessGroup.abort()`` or ``shutdown()`` (gloo's ``abort`` is a
no-op, and destroying a group that other objects still reference closes nothing) stayed blocked until the failing
process exited (6.5 s later, when it did). What releases it is what a crash does: the failing process's TCP
connections to its peers close, and the peer's collective raises "Connection closed by peer" at once (measured:
within the 0.5 s poll of the probe, 2 and 3 ranks).

So :func:`report_failure`, which ``ODCHandle.failure_guard`` runs on any exception, does on the failing rank:

1. write ``"<ExceptionType>: <message>"`` into the control block (peers at an ODC barrier raise with it);
2. shut down this process's TCP connections to its peers' processes (:func:`sever_peer_connections`), so that a
   peer blocked in a collective fails now instead of at the timeout; the process itself may live on;

and on a rank whose exception came from a peer (the severed collective, an ODC barrier), it raises
:class:`~odc_hf.transport.base.PeerFailedError` naming the failed rank and its message, chained to the local
exception, instead of announcing a failure of its own. A rank that failed first keeps its own exception.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path

from odc_hf.transport.base import ODCError, PeerFailedError, Transport

PEER_GRACE_S = 2.0
"""How long a rank whose collective lost its connection waits for the cause to show in the control block (a peer's
message, or its pid gone) before announcing the failure as its own. A failing rank writes its message before it
severs, so this only matters for a peer that died without a message (killed)."""

_POLL_S = 0.02
_LOST_PEER = re.compile(r"connection (closed|reset)|broken pipe|peer", re.IGNORECASE)


def report_failure(transport: Transport | None, err: BaseException, *,
                   announce: Callable[[str], None] | None = None) -> None:  # fmt: skip
    """Report ``err``, raised on this rank, to the peers (see the module docstring). Raises
    :class:`PeerFailedError` (from ``err``) when a peer failed first; otherwise returns and the caller re-raises
    ``err``. ``announce`` tells the peers (default ``transport.abort``; a caller with more channels, e.g. one
    across nodes, passes its own, which should also call ``transport.abort``)."""
    message = f"{type(err).__name__}: {err}"[:400]
    if announce is None:
        announce = transport.abort if transport is not None else (lambda message: None)
    control = None if transport is None or getattr(transport, "_closed", True) else transport.control
    if control is None:  # no control block (closed, or none on this rank): the caller's channel alone
        if not isinstance(err, PeerFailedError):
            announce(message)
        return
    if isinstance(err, PeerFailedError) or control.announced:  # already reported, by a peer or by an inner guard
        sever_peer_connections(control.pids, control.rank)
        return
    if isinstance(err, Exception):
        where = f"rank {control.rank} stopped at {type(err).__name__}: {_first_line(err)}"
        deadline = time.monotonic() + (PEER_GRACE_S if _lost_a_peer(err) else 0.0)
        while True:
            try:
                control.check_peers(where)
            except PeerFailedError as peer:
                sever_peer_connections(control.pids, control.rank)
                raise peer from err
            if time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
    announce(message)
    sever_peer_connections(control.pids, control.rank)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else ""


def _lost_a_peer(err: BaseException) -> bool:
    """Whether ``err`` looks like a collective that lost a peer (gloo: "Connection closed by peer"), or an ODC wait."""
    import torch.distributed as dist

    if isinstance(err, ODCError):
        return True
    dist_error = getattr(dist, "DistError", ())
    return isinstance(err, dist_error) or (isinstance(err, RuntimeError) and bool(_LOST_PEER.search(str(err))))


# -- severing ---------------------------------------------------------------------------------------------------
def _tcp_endpoints() -> dict[int, tuple[str, str]]:
    """socket inode -> (local, remote) address, as /proc/net/tcp{,6} print them, for this network namespace."""
    table: dict[int, tuple[str, str]] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9:
                table[int(fields[9])] = (fields[1], fields[2])
    return table


def _socket_fds(pid: int | str) -> dict[int, int]:
    """socket inode -> file descriptor, for the sockets process ``pid`` (or "self") holds; {} if not readable."""
    found: dict[int, int] = {}
    directory = f"/proc/{pid}/fd"
    try:
        names = os.listdir(directory)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"{directory}/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(name)
    return found


def sever_peer_connections(peer_pids: list[int], rank: int) -> int:
    """Shut down this process's TCP connections to the processes ``peer_pids`` (all but index ``rank``), as the
    kernel does when a process exits; returns how many. Collectives pending on this rank then fail on the peers at
    once ("Connection closed by peer"); this process's own later collectives fail too (the job is over anyway).

    Linux only (reads /proc); 0 elsewhere, or where the peers' /proc entries are not visible (another pid namespace,
    another user): the peers then wait for their collective's timeout. Only sockets whose other end belongs to a
    peer process are touched: other connections of this process (a logging service, the launcher's rendezvous
    store) stay open.
    """
    table = _tcp_endpoints()
    if not table:
        return 0
    peer_ends = set()
    for index, pid in enumerate(peer_pids):
        if index != rank and pid != os.getpid():
            peer_ends.update(table[inode][0] for inode in _socket_fds(pid) if inode in table)
    severed = 0
    for inode, fd in _socket_fds("self").items():
        if inode in table and table[inode][1] in peer_ends:
            try:
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)  # acts on the connection, shared by every descriptor of it
                severed += 1
            except OSError:
                pass
            finally:
                sock.close()  # closes our duplicate only
    return severed
