"""Which thread may call a communicator's collectives: the one that set it up.

Ranks pair collectives by their order on the communicator, not by the
thread that calls them. Two threads calling harmpi on one communicator
(allowed by MPI_THREAD_MULTIPLE only if the program orders them) can
therefore pair thread A's call on rank 0 with thread B's on rank 1, and
both return a sum of the wrong tensors with no error. A lock per rank does
not prevent that (each rank serializes its own threads in its own order),
and refusing only the second of two concurrent callers does not either
(the first caller may be A on one rank and B on another).

So a context belongs to the thread that made it (its first collective, or
harmpi.init), and a call from any other thread is refused at once, before
anything moves: the compiled entry compares ``pthread_self()`` with the
control block's ``owner`` field (harmpi.node.enter, a few ns). For that to
be the same thread on every rank, the ranks agree at set-up: each posts the
name of the thread that sets the context up and, if the names differ, every
rank raises (:func:`agree`). Threads are told apart by their names
(``threading.current_thread().name``: "MainThread", "Thread-1 (worker)",
...), the same on every rank when each rank starts its threads in the same
order; a program that gives two threads one name defeats the check.

A thread that needs collectives of its own gets its own communicator
(``comm.Dup()``) and makes its first harmpi call on it itself.

When the owning thread ends, its contexts refuse every thread (:func:`watch`
sets ``owner`` to ENDED). Without that, a thread started later may be given
the ended thread's pthread id (glibc reuses them, and did in a test at one
rank) and pass the check: on one rank a new thread A, on another a new
thread B, and their calls would be paired.
"""

from __future__ import annotations

import hashlib
import threading
import weakref

import numpy as np
from mpi4py import MPI

from ..base.topology import wait_polled
from ..errors import HarmpiError

__all__ = ["agree", "current", "refusal", "watch", "ENDED"]

#: the owner field once the owning thread has ended: no pthread_self() is 1
#: (it is the address of the thread's descriptor), so every thread is refused
ENDED = 1

#: bytes per rank in the set-up exchange: a digest of the name, then its start
_DIGEST_NBYTES = 16
_RECORD_NBYTES = 128


def current() -> tuple:
    """(ident, name) of the calling thread; ident is what the compiled
    entry's pthread_self() returns on Linux."""
    return threading.get_ident(), threading.current_thread().name


def _record(name):
    raw = name.encode("utf-8", "replace")
    rec = np.zeros(_RECORD_NBYTES, np.uint8)
    rec[:_DIGEST_NBYTES] = np.frombuffer(hashlib.sha256(raw).digest()[:_DIGEST_NBYTES], np.uint8)
    head = raw[:_RECORD_NBYTES - _DIGEST_NBYTES]
    rec[_DIGEST_NBYTES:_DIGEST_NBYTES + len(head)] = np.frombuffer(head, np.uint8)
    return rec


def _shown(rec):
    return bytes(rec[_DIGEST_NBYTES:]).rstrip(b"\0").decode("utf-8", "replace")


def agree(comm, name, timeout_s):
    """Check that every rank of ``comm`` sets its context up from a thread
    named ``name`` (collective; a non-blocking allgather polled under the
    deadline). Raises HarmpiError on every rank, naming each rank's
    thread, if they differ; HarmpiTimeoutError if a rank does not arrive."""
    size = comm.Get_size()
    if size == 1:
        return
    mine = _record(name)
    table = np.empty((size, _RECORD_NBYTES), np.uint8)
    req = comm.Iallgather([mine, MPI.BYTE], [table, MPI.BYTE])
    # (polled under the deadline; a request given up on keeps its buffers)
    wait_polled(comm, req, timeout_s, "setting up harmpi (checking which thread sets it up)",
                (mine, table))
    digests = {bytes(row[:_DIGEST_NBYTES]) for row in table}
    if len(digests) == 1:
        return
    by_name = {}
    for r, row in enumerate(table):
        by_name.setdefault(_shown(row), []).append(r)
    seen = "; ".join(f"{n!r} on rank{'s' if len(rs) > 1 else ''} {_ranks(rs)}"
                     for n, rs in by_name.items())
    raise HarmpiError(
        f"rank {comm.Get_rank()}: setting up harmpi on a communicator of {size}: the ranks do "
        f"it from different threads ({seen}). A communicator's collectives belong to one "
        "thread, the same on every rank (ranks pair calls by order, not by thread, so two "
        "threads' calls could be paired and return wrong sums); this communicator is unusable "
        "now. Make the first harmpi call on it from that one thread, or give each thread "
        "its own communicator (comm.Dup()).")


def _ranks(ranks):
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


class _Owned:
    """The control blocks of the contexts one thread set up; dropped with the
    thread's thread-local data when the thread ends, which marks them ENDED."""

    def __init__(self):
        # by id, weakly: a freed context's entry goes with it, so a thread
        # that sets up and frees communicators in a loop does not grow this
        self.ctls = weakref.WeakValueDictionary()
        self.ended = ENDED  # kept here: at interpreter exit module globals may be gone

    def __del__(self):
        for ctl in list(self.ctls.values()):
            ctl[0]["owner"] = self.ended


_owned = threading.local()


def watch(ctl):
    """When the calling thread (the owner just written into ``ctl``) ends,
    set ``ctl``'s owner to ENDED, so no later thread passes for it."""
    owned = getattr(_owned, "owned", None)
    if owned is None:
        owned = _owned.owned = _Owned()
    owned.ctls[id(ctl)] = ctl


def refusal(owner_name, ended=False):
    """Why a call from the calling thread is refused on a context owned by
    the thread named ``owner_name`` (``ended``: that thread has ended)."""
    _, me = current()
    if ended:
        return (f"this communicator's harmpi context belonged to thread {owner_name!r}, which "
                f"set it up and has ended; no other thread (here {me!r}) may call its "
                "collectives, since ranks pair collectives by order, not by thread. Give this "
                "thread its own communicator (comm.Dup(), with its first harmpi call made from "
                "this thread)")
    return (f"this communicator's harmpi context belongs to thread {owner_name!r}, which set it "
            f"up; thread {me!r} may not call its collectives. Ranks pair collectives by order, "
            "not by thread, so calls from two threads on one communicator could be paired "
            "across ranks and return wrong sums. Call harmpi on this communicator from "
            f"{owner_name!r} only (on every rank), or give this thread its own communicator "
            "(comm.Dup(), with its first harmpi call made from this thread)")
