"""The cross-node transport interface.

A transport moves bytes between ranks of one communicator (the rail
communicator for hierarchical algorithms, the whole communicator for the
flat ring). It knows nothing about dtypes or reductions. An exchange is
*posted* (non-blocking sends and receives, so local work can overlap the
network) and later *completed* under a deadline.

Every message carries a small integer tag chosen by the algorithm. The
algorithms put a digest of (size, dtype, op) in it, so a receiver detects a
peer that called a different collective without an extra message, and a
reserved POISON tag spreads "this collective failed" along the exchange
pattern so that every rank raises instead of some waiting forever.
"""

from __future__ import annotations

import abc
import os
import time

from ..base.kind import MAX_TAG, POISON_TAG
from ..errors import HarmpiTimeoutError

__all__ = ["Transport", "Pending", "POISON_TAG", "MAX_TAG", "timeout_error", "idle",
           "NAP_FIRST_S", "NAP_MAX_S"]


class Pending(abc.ABC):
    """Handle of posted operations; completed by :meth:`Transport.complete`."""


class Transport(abc.ABC):
    """Moves byte buffers between ranks of ``comm``."""

    #: short name shown in logs and benchmark headers
    name = "abstract"
    #: after its spin budget, a wait sleeps between polls (HARMPI_WAIT auto
    #: or sleep; the context sets it) instead of yielding the core in a loop
    naps = False
    #: past the spin budget, how long a wait still yields the core between
    #: polls before it naps (ns; the context sets it when ranks outnumber
    #: cores: harmpi.base.sync's yield window)
    yield_ns = 0
    #: address of the context's wait state (sync.WS_*; 0: none): the tcp
    #: rail's busy-host look (sync.host_busy) reads and updates it
    wait_state = 0
    #: whether compiled steps can drive this transport themselves (its
    #: sockets through sockio: the two-node compiled all-reduce, har_latency)
    compiled_rail = False

    @abc.abstractmethod
    def post(self, sends, recvs) -> Pending:
        """Post non-blocking operations.

        ``sends``: list of (peer, buffer, tag); ``recvs``: list of (peer, buffer).
        Buffers are writable/readable objects exposing the buffer protocol
        (numpy arrays); they must stay untouched until completion.
        """

    def post_exchange(self, peer, send_buf, tag, recv_buf) -> Pending:
        """Post one send to and one receive from ``peer`` (the common case)."""
        return self.post([(peer, send_buf, tag)], [(peer, recv_buf)])

    @abc.abstractmethod
    def complete(self, pending: Pending, timeout_s: float, what: str) -> list:
        """Wait for everything in ``pending``; return [(nbytes, tag)] per receive.

        Raises HarmpiTimeoutError naming the peers still outstanding after
        ``timeout_s``. A message larger than its receive buffer should fill
        the buffer, drop the rest and report the sender's count, so that the
        algorithm's recv_check poisons the step on every rank (tcp does). A
        transport that cannot (MPI truncates) raises HarmpiMismatchError with
        ``unclean = True``: the context then gives up, so its peers fail at
        once instead of waiting for a flag round this rank never posts.
        """

    def watch_signals(self, sigfd: int) -> None:
        """Let this transport's waits notice a SIGINT written to ``sigfd``
        (Python's wakeup fd). A transport whose waits run Python (where the
        signal handler runs anyway) has nothing to do."""

    def give_up(self, extra_ops=()) -> None:
        """This rank gave up on the collective in progress: tell every peer
        at once, best effort and without waiting, so a peer that waits on
        this rank fails now instead of at its deadline. ``extra_ops``: op
        rows of compiled steps that drive this transport (compiled_rail)."""

    def close_local(self) -> None:
        """Release what needs no peer to take part (sockets); what needs a
        collective (a communicator's free) is left to MPI_Finalize."""

    def close(self):
        """Release resources (connections, registered memory)."""


def timeout_error(rank, what, timeout_s, transport, waiting, late):
    """The HarmpiTimeoutError of a rail exchange past its deadline: ``rank``
    (world rank) waited for ``waiting`` ("a message from rank 3", "delivery
    to rank 3"); ``late``: their world ranks, the first becomes the culprit."""
    return HarmpiTimeoutError(
        f"rank {rank}: {what}: waited {timeout_s:g} s for {', '.join(waiting)} over the "
        f"{transport} transport; that rank crashed, hangs, or called a different collective "
        "(HARMPI_TIMEOUT_S sets the deadline)",
        culprit=late[0] if late else -1)


#: first and longest sleep between the polls of a napping transport wait:
#: doubling from NAP_FIRST_S keeps a prompt peer's wait short and a late
#: one's cheap (a nap of 1 ms costs ~0.1% of a core in wake-ups)
NAP_FIRST_S, NAP_MAX_S = 10e-6, 1e-3


def idle(naps: bool, pause: float) -> float:
    """One idle poll of a transport wait past its spin budget: yield the core
    (``naps`` false) or sleep ``pause`` seconds; returns the next pause."""
    if not naps:
        os.sched_yield()
        return pause
    time.sleep(pause)
    return min(2 * pause, NAP_MAX_S)
