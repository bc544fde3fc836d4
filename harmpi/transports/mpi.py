"""Portable transport: MPI point-to-point (Isend/Irecv) on a communicator.

Works wherever MPI works (TCP, shared memory, UCX, ...). Completion polls
``Testall`` ``spin_count`` times, then yields the core between polls (wait
spin, and for ``yield_ns`` under the other policies) or naps, 10 us doubling
to 1 ms (wait auto and sleep: MPI has no
blocking wait that sleeps, its own MPI_Wait polls too), so oversubscribed
ranks still progress and a busy host gets the core back; it gives up at a
deadline with an error naming the peers that never answered.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from ..base.kind import ABANDON_TAG
from ..base.topology import dup_polled, world_ranks
from ..errors import HarmpiMismatchError, HarmpiTimeoutError
from .base import NAP_FIRST_S, Pending, Transport, idle

_EMPTY = np.empty(0, np.uint8)

__all__ = ["MpiTransport"]


class _MpiPending(Pending):
    __slots__ = ("reqs", "statuses", "recv_peers", "send_peers", "nrecv")

    def __init__(self, reqs, recv_peers, send_peers, statuses):
        self.reqs = reqs
        self.recv_peers = recv_peers
        self.send_peers = send_peers
        self.nrecv = len(recv_peers)
        self.statuses = statuses


class MpiTransport(Transport):
    name = "mpi"

    def __init__(self, comm, spin_count: int, timeout_s: float):
        # A private duplicate keeps our messages apart from the application's.
        self.comm = dup_polled(comm, timeout_s, "mpi transport set-up")
        self.rank = self.comm.Get_rank()
        self.spin_count = spin_count
        self._status_pool = []   # reused: one exchange is in flight at a time
        self._gave_up = []       # ABANDON_TAG sends, left to MPI_Finalize
        self._probe_status = MPI.Status()

    def _statuses(self, n):
        pool = self._status_pool
        while len(pool) < n:
            pool.append(MPI.Status())
        return pool[:n]

    def post(self, sends, recvs):
        comm = self.comm
        reqs = [comm.Irecv(buf, source=peer, tag=MPI.ANY_TAG) for peer, buf in recvs]
        reqs += [comm.Isend(buf, dest=peer, tag=tag) for peer, buf, tag in sends]
        return _MpiPending(reqs, [p for p, _ in recvs], [p for p, _, _ in sends],
                           self._statuses(len(reqs)))

    def post_exchange(self, peer, send_buf, tag, recv_buf):
        # the decode-size path: one receive and one send, no list building
        comm = self.comm
        reqs = [comm.Irecv(recv_buf, source=peer, tag=MPI.ANY_TAG),
                comm.Isend(send_buf, dest=peer, tag=tag)]
        return _MpiPending(reqs, (peer,), (peer,), self._statuses(2))

    def complete(self, pending, timeout_s, what):
        reqs, statuses = pending.reqs, pending.statuses
        try:
            polls = 0
            deadline = None
            pause = NAP_FIRST_S
            while not MPI.Request.Testall(reqs, statuses):
                polls += 1
                if polls < self.spin_count:
                    continue
                now = time.monotonic()
                if deadline is None:
                    deadline = now + timeout_s
                    naps_from = now + self.yield_ns * 1e-9
                elif now > deadline:
                    self._timeout(pending, timeout_s, what)
                pause = idle(self.naps and now >= naps_from, pause)
                if (polls & 63) == 0:
                    self._check_notice(pending, what)
        except MPI.Exception as exc:
            if exc.Get_error_class() == MPI.ERR_TRUNCATE:
                err = HarmpiMismatchError(
                    f"rank {self.rank}: {what}: a peer sent more bytes than this rank expects; "
                    "ranks passed tensors of different sizes")
                # raised mid-algorithm: the node's flag rounds are left
                # unfinished, so the context gives up (its peers fail at once)
                err.unclean = True
                raise err from None
            raise
        self._check_abandoned(pending, statuses, what)
        return [(st.Get_count(MPI.BYTE), st.Get_tag()) for st in statuses[: pending.nrecv]]

    def give_up(self, extra_ops=()):
        """This rank gave up on the collective in progress: tell every peer
        (a message with ABANDON_TAG), so that a peer completing its exchange
        with this rank later fails instead of completing a step this rank
        abandoned (MPI delivers in order, so the notice is seen right after
        any data this rank had sent)."""
        if self.comm is None or self._gave_up:
            return
        for peer in range(self.comm.Get_size()):
            if peer != self.rank:
                self._gave_up.append(self.comm.Isend(_EMPTY, dest=peer, tag=ABANDON_TAG))

    def _check_notice(self, pending, what):
        """While waiting: raise at once if a receive of this exchange got a
        peer's abandon notice (MPI_Request_get_status leaves the request to
        Testall), so a send this rank posted that the peer will never
        receive does not hold the wait until its deadline."""
        status = self._probe_status
        for i, peer in enumerate(pending.recv_peers):
            if ((pending.reqs[i].Get_status(status) and status.Get_tag() == ABANDON_TAG)
                    or self.comm.Iprobe(source=peer, tag=ABANDON_TAG)):
                self._cancel(pending)
                self._raise_abandoned(peer, what)

    @staticmethod
    def _cancel(pending):
        for req in pending.reqs:
            if req != MPI.REQUEST_NULL:
                try:
                    req.Cancel()
                except MPI.Exception:
                    pass  # a request that completed meanwhile cannot be cancelled

    def _raise_abandoned(self, peer, what):
        raise HarmpiTimeoutError(
            f"rank {self._world_rank(self.rank)}: {what}: rank {self._world_rank(peer)} gave up "
            "on this collective before this rank completed it (it timed out, failed or was "
            "interrupted; HARMPI_TIMEOUT_S sets the deadline)")

    def _check_abandoned(self, pending, statuses, what):
        """Raise if a peer of this exchange has given up on it (its notice
        came instead of, or right after, its data)."""
        for i, peer in enumerate(pending.recv_peers):
            if statuses[i].Get_tag() == ABANDON_TAG or self.comm.Iprobe(source=peer,
                                                                         tag=ABANDON_TAG):
                self._raise_abandoned(peer, what)

    def _world_rank(self, peer):
        """The COMM_WORLD rank of ``peer`` (errors should name ranks users know)."""
        try:
            (w,) = world_ranks(self.comm, [peer])
            return w
        except MPI.Exception:
            return peer

    def _timeout(self, pending, timeout_s, what):
        waiting, late = [], []
        for i, req in enumerate(pending.reqs):
            if not req.Test():
                kind, peer = (("a message from", pending.recv_peers[i]) if i < pending.nrecv
                              else ("delivery to", pending.send_peers[i - pending.nrecv]))
                waiting.append(f"{kind} rank {self._world_rank(peer)}")
                late.append(self._world_rank(peer))
        if not waiting:  # everything completed just now: not a timeout after all
            return
        self._cancel(pending)
        raise HarmpiTimeoutError(
            f"rank {self._world_rank(self.rank)}: {what}: waited {timeout_s:g} s for "
            f"{', '.join(waiting)} over the {self.name} transport; that rank crashed, hangs, or "
            "called a different collective (HARMPI_TIMEOUT_S sets the deadline)", culprit=late[0])

    def close(self):
        if self.comm is not None and self.comm != MPI.COMM_NULL:
            self.comm.Free()
        self.comm = None
