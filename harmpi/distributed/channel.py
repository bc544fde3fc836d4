"""A harmpi process group's state and its MPI channel: the base class of
:class:`harmpi.distributed.group.ProcessGroupHarmpi`.

Each group is one MPI communicator and one harmpi context: the default
group is MPI.COMM_WORLD (shared with ``harmpi.allreduce``, so the two may
be mixed in program order), a ``new_group`` gets a communicator of its own
ranks. Besides harmpi's context, a group makes two private duplicates of its
communicator: one for the backend's own collectives and the headers ranks
exchange before any data moves (:meth:`GroupChannel._agree`), one for users'
messages (send/recv), so neither meets the application's own MPI traffic.

Every wait is bounded by the group's deadline (harmpi.distributed.waits): a
collective that times out, fails or is interrupted leaves the group unusable
(its peers may still be inside it, its request stays with MPI); a message
that times out is cancelled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from ..base.topology import vote, world_ranks
from ..config import Config
from ..errors import (
    HarmpiArgumentError,
    HarmpiError,
    HarmpiMismatchError,
    HarmpiTimeoutError,
)
from ..runtime.registry import STATE
from .tables import CALL_NAMES, CALLS, DTYPE_BY_CODE, HEADER_TAG, dtype_code
from .waits import STRANDED, cancel, unfinished, wait_requests
from .work import MpiWork

__all__ = ["BACKEND", "GroupChannel"]

log = logging.getLogger("harmpi")

#: the name torch knows the backend by (dist.init_process_group("harmpi"))
BACKEND = "harmpi"

_WORLD = MPI.COMM_WORLD


class GroupChannel(dist.ProcessGroup):
    """What a harmpi process group is before its collectives: one MPI
    communicator with its harmpi context and two private duplicates, the
    group's identity for torch, its deadline, its state (usable, pending
    collective) and its lifetime. :class:`harmpi.distributed.group.ProcessGroupHarmpi`
    adds the collectives."""

    def __init__(self, comm, rank, size, timeout_s=None):
        super().__init__(rank, size)
        self._comm = comm
        self._default = comm is _WORLD
        #: what harmpi's API takes as this group's communicator
        self._harmpi_comm = None if self._default else comm
        self._ctx = _context(self._harmpi_comm, timeout_s)
        #: the deadline of every wait of this group: the timeout= given to
        #: init_process_group/new_group, else HARMPI_TIMEOUT_S
        self._timeout_s = timeout_s if timeout_s is not None else self._ctx.config.timeout_s
        #: private duplicates: the backend's own collectives and headers, and
        #: users' messages (send/recv), kept apart from the application's MPI
        self._mpi, self._p2p = _private_comms(comm, self._timeout_s)
        self._world_ranks = world_ranks(comm)
        self._size, self._rank = size, rank
        #: the other ranks of the group, to which headers go
        self._peers = [r for r in range(size) if r != rank]
        #: why the MPI channel may not be used any more (a timed-out collective)
        self._broken = None
        self._closed = False
        self._pending = None
        self._group_name = ""
        self._group_desc = ""
        #: (start, finish, max bytes) of the context's split-phase all-reduce, or None
        self._split = self._ctx.split
        #: harmpi._C.allreduce_sum on the default group, when the native part is built
        self._native_sum = _native_sum() if self._default else None

    # -- identity ------------------------------------------------------------

    def getBackendName(self):
        return BACKEND

    @property
    def comm(self):
        """The MPI communicator of this group."""
        return self._comm

    def _set_group_name(self, name):
        self._group_name = name

    def getGroupName(self):
        return self._group_name

    @property
    def group_name(self):
        return self._group_name

    def _set_group_desc(self, desc):
        self._group_desc = desc

    def getGroupDesc(self):
        return self._group_desc

    @property
    def group_desc(self):
        return self._group_desc

    def __repr__(self):
        return f"{type(self).__name__}(rank={self.rank()}, size={self.size()}, " \
               f"name={self._group_name!r})"

    # -- helpers ---------------------------------------------------------------

    def _settle(self):
        """Complete a started collective before anything else runs on this group."""
        work = self._pending
        if work is not None:
            work.wait()

    # -- the MPI channel -------------------------------------------------------

    def _check_usable(self):
        if self._broken is not None:
            raise HarmpiError(f"harmpi backend: this process group is unusable: {self._broken}")

    def _wait(self, reqs, what, peer=None, nbytes=None):
        """Complete ``reqs`` under the deadline (wait_requests); a collective
        that times out or fails leaves the group unusable (its peers may still
        be inside it), a message that times out is cancelled. ``nbytes``: a
        receive's buffer size, for the error of a message too large for it."""
        try:
            return wait_requests(reqs, self._timeout_s,
                                 lambda pending: self._timed_out(pending, what, peer),
                                 statuses=peer is not None)
        except MPI.Exception as exc:
            err = self._mpi_error(exc, what, peer, nbytes)
        except KeyboardInterrupt:
            # a message is cancelled; a collective cannot be: its request
            # stays with MPI and may still complete with the peers' data,
            # so the group's next collective would meet this one's leftovers
            # (a broadcast once returned the dropped call's value): unusable
            if peer is not None:
                cancel(reqs)
            else:
                self._broken = f"{what} was interrupted (Ctrl-C) on this rank"
            raise
        if peer is None:
            self._broken = str(err)
        raise err

    def _mpi_error(self, exc, what, peer, nbytes=None):
        me = self._who()
        if exc.Get_error_class() == MPI.ERR_TRUNCATE:
            # the status names the sender (a receive from any rank has no peer)
            status = getattr(exc, "status", None)
            source = status.Get_source() if status is not None else peer
            src = "a peer" if source is None or source < 0 else \
                f"world rank {self._world_rank(source)}"
            holds = "" if nbytes is None else f" ({nbytes} bytes)"
            return HarmpiMismatchError(
                f"{me}: harmpi backend {what}: {src} sent a message larger than this rank's "
                f"tensor{holds}; the ranks passed tensors of different sizes (the message is "
                "consumed; the tensor holds its first bytes)")
        return HarmpiError(f"{me}: harmpi backend {what}: MPI failed: {exc}")

    def _timed_out(self, reqs, what, peer, late=None):
        if MPI.Request.Testall(reqs):
            return  # completed just now
        timeout_s = self._timeout_s
        if peer is not None:
            cancel(reqs)
            raise HarmpiTimeoutError(
                f"{self._who()}: harmpi backend {what}: world rank {self._world_rank(peer)} did "
                f"not complete the message within {timeout_s:g} s (it crashed, hangs, or "
                "never posted the matching call; HARMPI_TIMEOUT_S sets the deadline)",
                culprit=self._world_rank(peer))
        if late:
            who = "world rank" + ("s " if len(late) > 1 else " ") + \
                ", ".join(str(self._world_rank(r)) for r in late)
            why = f"{who} did not arrive within {timeout_s:g} s (it crashed, hangs, raised " \
                  "before the call, or called another collective)"
        else:
            why = f"the other ranks did not complete it within {timeout_s:g} s (a rank " \
                  "crashed or hangs)"
        self._broken = f"{what} timed out: {why}"
        raise HarmpiTimeoutError(
            f"{self._who()}: harmpi backend {what}: {why}; this group is unusable now "
            "(HARMPI_TIMEOUT_S sets the deadline)",
            culprit=self._world_rank(late[0]) if late else -1)

    @contextlib.contextmanager
    def _interruptible(self, what, reqs, *buffers):
        """Ctrl-C inside a wait of this group's own exchanges (the headers,
        monitored_barrier) leaves the group unusable: the requests stay with
        MPI (kept alive with their buffers) and would meet the next call's."""
        try:
            yield
        except KeyboardInterrupt:
            self._broken = f"{what} was interrupted (Ctrl-C) on this rank"
            if not MPI.Request.Testall(reqs):
                STRANDED.append((reqs, buffers))
            raise

    def _who(self):
        return f"rank {self._world_rank(self.rank())} (group rank {self.rank()} of {self.size()})"

    def _world_rank(self, r):
        return self._world_ranks[r] if 0 <= r < len(self._world_ranks) else r

    _HEADER = ("call", "dtype", "bytes", "op/root", "refused")

    def _agree(self, what, dtype=None, nbytes=0, extra=0, problem=None):
        """Before any data moves, every rank learns what every other passes:
        a header sent to each peer (so a rank that never comes is named at
        the deadline). A difference, or an argument some rank refused
        (``problem``), raises on every rank, naming the ranks and their values.
        Returns the headers (rows by group rank)."""
        if self._broken is not None:
            self._check_usable()
        n, me, peers = self._size, self._rank, self._peers
        mine = np.array((CALLS[what], dtype_code(dtype) if dtype is not None else 0, nbytes,
                         extra, problem is not None), np.int64)
        seen = np.empty((n, 5), np.int64)
        seen[me] = mine
        if n > 1:
            mpi = self._mpi
            reqs = [mpi.Irecv(seen[r], source=r, tag=HEADER_TAG) for r in peers]
            reqs += [mpi.Isend(mine, dest=r, tag=HEADER_TAG) for r in peers]

            def late(pending):
                left = unfinished(pending)
                if left:
                    self._timed_out(pending, what, None,
                                    [peers[i] for i in left if i < len(peers)])

            try:
                with self._interruptible(what, reqs, seen, mine):
                    wait_requests(reqs, self._timeout_s, late, statuses=False)
            except MPI.Exception as exc:
                err = self._mpi_error(exc, what, None)
                self._broken = str(err)
                raise err from None
        if problem is not None:
            raise HarmpiArgumentError(f"{self._who()}: harmpi backend {what}: {problem}")
        if seen.tobytes() == mine.tobytes() * n:
            return seen  # every rank passes what this one does (and none refused)
        if seen[:, 4].any():
            bad = [self._world_rank(r) for r in np.flatnonzero(seen[:, 4])]
            raise HarmpiArgumentError(
                f"{self._who()}: harmpi backend {what}: world rank(s) {bad} refused their "
                "arguments (see their error); no data moved")
        differ = np.flatnonzero((seen != seen[0]).any(axis=1))
        if differ.size:
            raise HarmpiMismatchError(
                f"{self._who()}: harmpi backend {what}: ranks disagree: "
                + "; ".join(self._describe_header(r, seen[r]) for r in (0, *differ))
                + ". Every rank must make the same call with a tensor of the same size and "
                "dtype (and the same op or root); no data moved.")
        return seen

    def _describe_header(self, r, row):
        call = CALL_NAMES.get(int(row[0]), f"call #{row[0]}")
        dtype = DTYPE_BY_CODE.get(int(row[1]), f"dtype #{row[1]}")
        return f"world rank {self._world_rank(r)} calls {call} with {dtype}, {row[2]} bytes, " \
               f"op/root {row[3]}"

    def _run(self, reqs, finish, result, what, async_op, keep=None):
        """The MPI requests of one collective: a work object to wait on later
        (async_op; the group's next call completes it first), or completed now."""
        work = MpiWork(self, reqs, finish, result, what, keep=keep)
        if async_op:
            self._pending = work
        else:
            work.wait()
        return work

    # -- lifetime ----------------------------------------------------------------------------

    def _get_backend(self, device):
        """torch asks a group for its backend per device: a harmpi group is
        its own CPU backend (torch's Python reaches every op through it)."""
        if torch.device(device).type != "cpu":
            raise HarmpiArgumentError(f"harmpi backend: no backend for {device}; harmpi "
                                      "serves CPU tensors")
        return self

    supports_coalescing = False
    supports_splitting = False
    supports_time_estimate = False

    def shutdown(self):
        """dist.destroy_process_group: free this group's MPI communicators and
        its harmpi context (window, transports). The ranks first vote (a
        polled MPI_Iallgather under the deadline, topology.vote): only if
        every rank is healthy do they free; otherwise each leaves the context
        to MPI_Finalize, with a warning, instead of entering a collective free
        that would wait for the others forever. A rank whose context broke
        (say, a collective that failed there and not on its peers) votes
        too, so the healthy ones hear no at once instead of at their deadline
        (2 x 2, after an all-to-all only one node failed: 20 s); only a rank
        whose own MPI calls on the group were left unfinished (self._broken)
        stays away, as its next collective there could meet the peers' wrongly."""
        if self._closed:
            return
        self._closed = True
        try:
            self._settle()
        except HarmpiError as exc:
            log.warning("harmpi backend: destroying a group whose last call failed: %s", exc)
        healthy = False
        if self._broken is None:
            healthy, why = vote(self._mpi, self._timeout_s, "destroying a harmpi process group",
                                self._ctx.broken is None)
            if not healthy and self._ctx.broken is None:
                log.warning("%s; its MPI communicator and harmpi context are left to "
                            "MPI_Finalize", why)
        self._broken = "the group was destroyed (dist.destroy_process_group)"
        if not healthy:
            return
        for c in (self._mpi, self._p2p):
            c.Free()
        if not self._default:
            # the context hangs on the communicator: its free frees the context
            self._comm.Free()

    def abort(self):
        """No collective: the group is unusable from now on; MPI_Finalize
        reclaims its resources."""
        self._closed = True
        self._broken = "the group was aborted"


def _context(comm, timeout_s):
    """The harmpi context of a group's communicator (None: the world), made
    with the group's deadline when one was given. The world's context is
    shared with harmpi.allreduce: one made before the group keeps its own
    deadline for harmpi's sums and barrier (the MPI ops use the group's)."""
    if timeout_s is None:
        return STATE.get(comm)
    live = STATE.lookup(comm if comm is not None else _WORLD)
    if live is not None and live.broken is None:
        if live.config.timeout_s != timeout_s:
            log.info("harmpi backend: the group's timeout (%g s) applies to its MPI ops; "
                     "harmpi's context of this communicator was set up earlier with %g s",
                     timeout_s, live.config.timeout_s)
        return live
    config = dataclasses.replace(Config.from_env(), timeout_s=timeout_s)
    return STATE.create(comm if comm is not None else _WORLD, config)


def _private_comms(comm, timeout_s):
    """Two duplicates of ``comm`` (MPI_Comm_idup, under the deadline)."""
    (a, ra), (b, rb) = comm.Idup(), comm.Idup()

    def late(_pending):
        raise HarmpiTimeoutError(
            f"rank {_WORLD.Get_rank()}: harmpi backend: creating a process group: the other "
            f"ranks of the group did not arrive within {timeout_s:g} s (HARMPI_TIMEOUT_S sets "
            "the deadline)")

    wait_requests([ra, rb], timeout_s, late)
    return a, b


def _native_sum():
    """harmpi._C.allreduce_sum (the default group's hot path), or None when
    the native module is not built."""
    from ..runtime import native  # noqa: PLC0415 - imports harmpi._C (torch's C++ side)

    mod = native.load()
    return getattr(mod, "allreduce_sum", None) if mod is not None else None
