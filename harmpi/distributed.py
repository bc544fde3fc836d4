"""torch.distributed backend "harmpi": existing torch code runs on harmpi with one word changed.

    import harmpi.distributed                       # registers the backend
    import torch.distributed as dist
    dist.init_process_group("harmpi")               # env:// (the launcher sets MASTER_ADDR)
    dist.all_reduce(t)                              # harmpi's all-reduce

``import harmpi`` registers it as well when the program imported torch
before harmpi; harmpi never imports torch on its own.

How it plugs in. torch lets a backend be a ``dist.ProcessGroup`` subclass
written in Python: the creator given to ``dist.Backend.register_backend``
returns :class:`ProcessGroupHarmpi`, and torch uses it as the group itself.
torch's Python collectives (``dist.all_reduce``...) call its methods
directly; its C++ side (functional collectives, DTensor) reaches the same
methods through torch's trampoline class. Each group is one MPI
communicator and one harmpi context: the default group is MPI.COMM_WORLD
(shared with ``harmpi.allreduce``, so the two may be mixed in program
order), a ``new_group`` gets a communicator of its own ranks (a TP group
inside a larger world, a group spanning virtual nodes).

Rank and world size come from MPI. torch's env:// rendezvous needs
MASTER_ADDR and MASTER_PORT, which harmpi's launcher (and torchrun) set;
under plain mpirun, ``init_method="mpi://"`` (any backend; registered with
torch's public ``register_rendezvous_handler``) rendezvouses over MPI
instead: rank 0 starts a TCPStore on a free port and broadcasts its
address, so gloo groups can be made beside harmpi ones in the same job. A
rank or world size given by the caller (or by RANK/WORLD_SIZE) must match
MPI's.

What each call does (``t``: a CPU tensor of bf16, f16, f32 or f64):

=========================  ==================================================
all_reduce SUM             harmpi's all-reduce, in place (the hot path: the
                           native entry on the default group, the group's
                           context's compiled entry called directly on
                           the others; nothing is cached per call)
all_reduce AVG             the sum, then divided by the group size (bf16/f16:
                           two roundings)
all_reduce MAX / MIN       allgather, then max/min over ranks (exact)
all_gather(_single)        harmpi's hierarchical allgather (exact); outputs of
                           uneven sizes along the last dimension: gather_logits'
                           route (harmpi.logits)
reduce_scatter_single      all-reduce of a copy, then this rank's block
broadcast, scatter         MPI_Bcast / MPI_Scatter of the bytes (exact, any dtype)
barrier                    harmpi's barrier
sparse all_reduce SUM      as gloo: every rank's coalesced indices and values
                           gathered (MPI_Iallgatherv), summed, coalesced
=========================  ==================================================

The rest of what gloo serves on CPU (integer and bool reductions, gather,
reduce, all_to_all, point to point, monitored_barrier, other dtypes) goes
over private duplicates of the group's communicator with MPI's
non-blocking calls, the ranks agreeing on sizes and dtypes first. What
none of these serve raises ``HarmpiArgumentError`` naming what is
supported, before any data moves.

Deadlines. Every wait is bounded: the ``timeout=`` given to
``init_process_group`` or ``new_group`` (as gloo honours it), else
HARMPI_TIMEOUT_S (torch passes its 30-minute default when none is given,
and that value means "not given" here). The MPI rendezvous and a group's
creation (the members meet on the group's store before
MPI_Comm_create_group) are bounded by the same deadline.

Async. ``async_op=True`` all-reduce (SUM or AVG) is split in two compiled
halves where the context's default all-reduce has them (Context.split): on
one node (harmpi.node.one_node_start / one_node_finish) the call copies
this rank's tensor into its slot, publishes it and returns; on two nodes
over tcp up to har_latency_max (har_latency.har2_start / har2_finish) it
also posts the rail exchange, so the network carries the tensor while the
caller computes. ``wait()`` (or ``get_future()``) waits for the peers and
sums. The peers need nothing more from this rank in between, so the
caller's compute overlaps every rank's arrival and the exchange. A group holds at most one started
collective: any later call on the group completes it first, in order, as
MPI orders collectives on one communicator. Other async calls complete
before they return (their work object is already done). While a torch
group's all-reduce is started, ``harmpi.allreduce`` on the same
communicator is refused with a clear error; ``wait()`` first.

Versions: written against torch 2.13's ``ProcessGroup`` Python API and
checked there; the creator refuses torch older than 2.6 with a clear
error (``MIN_TORCH``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
import os
import socket
import time
from urllib.parse import parse_qs, urlparse

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.constants import default_pg_timeout
from torch.futures import Future

from . import api, worldenv
from .config import Config
from .context import AUTO_CODE
from .errors import (
    HarmpiArgumentError,
    HarmpiError,
    HarmpiMismatchError,
    HarmpiTimeoutError,
)
from .registry import STATE
from .topology import LATE_FRACTION, arrive
from .torch import describe as _describe

__all__ = ["BACKEND", "MIN_TORCH", "RENDEZVOUS", "ProcessGroupHarmpi", "register"]

log = logging.getLogger("harmpi")

BACKEND = "harmpi"
#: oldest torch whose ProcessGroup Python API this module relies on
MIN_TORCH = (2, 6)

_WORLD = MPI.COMM_WORLD
_FLOATS = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32",
           torch.float64: "f64"}
_RED = dist.ReduceOp.RedOpType
_SUPPORTED_OPS = "SUM, AVG, MAX and MIN"
_SUM = dist.ReduceOp.SUM
_AVG = dist.ReduceOp.AVG
_SYNC_SUM = dist.AllreduceOptions()
_SYNC_SUM.asyncOp = False
_STRIDED = torch.strided


def _torch_version():
    parts = torch.__version__.split("+")[0].split(".")
    return tuple(int(p) if p.isdigit() else 0 for p in parts[:2])


# -- work objects -------------------------------------------------------------

class _DoneWork(dist._Work):
    """A collective that completed before its call returned."""

    def __init__(self, result=None):
        super().__init__()
        self._result = result

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def result(self):
        return self._result

    def get_future(self):
        fut = Future()
        fut.set_result(self._result)
        return fut


#: what a synchronous call returns (dist.all_reduce only waits on it)
_DONE = _DoneWork()


class _SplitWork(dist._Work):
    """A started split-phase all-reduce; wait() completes it (once)."""

    def __init__(self, pg, finish, tensor, addr, n, fmt, scale):
        super().__init__()
        self._pg = pg
        self._finish = finish
        self._tensor = tensor      # keeps the memory alive until the finish
        self._args = (addr, n, fmt)
        self._scale = scale
        self._error = None
        self._done = False

    def _complete(self):
        if self._done:
            if self._error is not None:
                raise self._error
            return
        self._done = True
        pg = self._pg
        if pg._pending is self:
            pg._pending = None
        ctx = pg._ctx
        ctx.split_pending = None
        addr, n, fmt = self._args
        rc = self._finish(ctx.ctl, addr, n, fmt)
        if rc:
            try:
                ctx.raise_status(rc, addr, n, fmt, AUTO_CODE | fmt, "allreduce (async)")
            except HarmpiError as exc:
                self._error = exc
                raise
        if self._scale is not None:
            self._tensor.div_(self._scale)

    def wait(self, timeout=None):
        self._complete()
        return True

    def is_completed(self):
        return self._done

    def is_success(self):
        return self._done and self._error is None

    def exception(self):
        return self._error

    def result(self):
        return [self._tensor]

    def get_future(self):
        # the second half runs in the caller's thread: completing the
        # future means finishing the collective
        self._complete()
        fut = Future()
        fut.set_result([self._tensor])
        return fut


# -- the process group ----------------------------------------------------------

def _one(tensors, what):
    if len(tensors) != 1:
        raise HarmpiArgumentError(
            f"harmpi backend: {what} takes one tensor per rank (got {len(tensors)}); "
            "harmpi serves one CPU device per process")
    return tensors[0]


def _float_tensor(t, what):
    if t.dtype not in _FLOATS:
        raise HarmpiArgumentError(
            f"harmpi backend: {what} of {t.dtype} is not supported; it reduces and gathers "
            "torch.bfloat16, float16, float32 and float64 (use a gloo group, "
            "dist.new_group(backend='gloo'), for other dtypes)")
    if not t.is_cpu:
        raise HarmpiArgumentError(f"harmpi backend: {what}: tensor is on {t.device}; harmpi "
                                  "works on CPU tensors")
    return t


def _contiguous_cpu(t, what):
    if not t.is_cpu:
        raise HarmpiArgumentError(f"harmpi backend: {what}: tensor is on {t.device}; harmpi "
                                  "works on CPU tensors")
    if not t.is_contiguous():
        raise HarmpiArgumentError(f"harmpi backend: {what}: tensor of shape {tuple(t.shape)} is "
                                  "not contiguous")
    return t


def _cpu(t, what):
    if not t.is_cpu:
        raise HarmpiArgumentError(f"harmpi backend: {what}: tensor is on {t.device}; harmpi "
                                  "works on CPU tensors")
    return t


def _async(opts):
    return bool(opts is not None and getattr(opts, "asyncOp", False))


def _copy_back(buf, t):
    """What completes an op that worked on a contiguous copy of ``t`` (None: no copy)."""
    if buf is t:
        return None
    return lambda _statuses: t.copy_(buf)


def _split_bytes(t, splits, n, which):
    """Bytes to or from each rank of all_to_all_single: rows of dim 0."""
    if t.dim() == 0:
        raise HarmpiArgumentError(f"harmpi backend: all_to_all_single: the {which} needs at "
                                  "least one dimension")
    rows = t.size(0)
    if not splits:
        if rows % n:
            raise HarmpiArgumentError(
                f"harmpi backend: all_to_all_single: the {which} has {rows} rows, not a "
                f"multiple of the group size {n}; pass split sizes")
        return [t.nbytes // n] * n
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    splits = list(splits)
    if len(splits) != n or sum(splits) != rows or min(splits) < 0:
        raise HarmpiArgumentError(
            f"harmpi backend: all_to_all_single: {which} split sizes {splits} must be {n} "
            f"counts that add up to its {rows} rows")
    return [s * row_bytes for s in splits]


#: the calls that agree on a header first (the codes ranks compare)
_CALL_NAMES = dict(enumerate(("all_reduce", "broadcast", "scatter", "gather", "all_gather",
                              "all_gather_into_tensor", "all_to_all", "all_to_all_single",
                              "all_reduce (sparse)"), 1))
_CALLS = {name: code for code, name in _CALL_NAMES.items()}
#: tags of the backend's own messages on its private communicator (users'
#: messages travel on another one)
_HEADER_TAG = 1
_MONITOR_TAG = 2


def _user_tag(tag):
    upper = _WORLD.Get_attr(MPI.TAG_UB)
    if not 0 <= tag <= upper:
        raise HarmpiArgumentError(f"harmpi backend: tag {tag} is outside MPI's 0..{upper}")
    return tag


def _bytes_of(t):
    """The tensor's memory as a writable numpy byte view (any dtype, no copy)."""
    return t.view(-1).view(torch.uint8).numpy() if t.numel() else bytearray(0)


def _buffer(t):
    """A contiguous tensor's memory as an MPI buffer (no copy; ~10x cheaper
    than _bytes_of's views). It holds no reference to ``t``: the caller
    keeps ``t`` alive until the request completes (the work object's ``keep``)."""
    nbytes = t.nbytes
    return MPI.buffer.fromaddress(t.data_ptr(), nbytes) if nbytes else bytearray(0)


# -- the MPI channel: dtypes, deadline waits, work objects -------------------------------------

def _dtype_table():
    """torch dtype -> (code agreed between ranks, MPI datatype for MPI's own
    reductions or None). Floats reduce in harmpi or in rank order here, never
    in MPI (whose float reductions may differ between ranks)."""
    ints = [(torch.int8, MPI.INT8_T), (torch.uint8, MPI.UINT8_T), (torch.int16, MPI.INT16_T),
            (torch.int32, MPI.INT32_T), (torch.int64, MPI.INT64_T), (torch.bool, MPI.C_BOOL)]
    for name, mpi_type in (("uint16", MPI.UINT16_T), ("uint32", MPI.UINT32_T),
                           ("uint64", MPI.UINT64_T)):
        if hasattr(torch, name):
            ints.append((getattr(torch, name), mpi_type))
    others = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.complex64,
              torch.complex128, getattr(torch, "float8_e4m3fn", None),
              getattr(torch, "float8_e5m2", None)]
    table = {dt: (code, mpi_type) for code, (dt, mpi_type) in enumerate(ints, 1)}
    for dt in others:
        if dt is not None:
            table[dt] = (len(table) + 1, None)
    return table


#: every fact about a dtype the MPI channel needs, in one table
_DTYPES = _dtype_table()
_DTYPE_BY_CODE = {code: dt for dt, (code, _) in _DTYPES.items()}

#: reductions MPI does for integers and bools (torch op -> MPI op); AVG has no
#: integer meaning (gloo refuses it too)
_INT_OPS = {_RED.SUM: MPI.SUM, _RED.PRODUCT: MPI.PROD, _RED.MIN: MPI.MIN, _RED.MAX: MPI.MAX,
            _RED.BAND: MPI.BAND, _RED.BOR: MPI.BOR, _RED.BXOR: MPI.BXOR}
#: the same on bool tensors, as gloo computes them (a sum of bools is their OR)
_BOOL_OPS = {_RED.SUM: MPI.LOR, _RED.PRODUCT: MPI.LAND, _RED.MIN: MPI.LAND, _RED.MAX: MPI.LOR,
             _RED.BAND: MPI.LAND, _RED.BOR: MPI.LOR, _RED.BXOR: MPI.LXOR}
#: float reductions other than SUM/AVG: gather every rank's tensor, reduce in rank order
_FLOAT_REDUCE = {_RED.MIN: lambda g: g.amin(dim=0), _RED.MAX: lambda g: g.amax(dim=0),
                 _RED.PRODUCT: lambda g: g.prod(dim=0, dtype=g.dtype)}


def _dtype_code(dtype):
    entry = _DTYPES.get(dtype)
    return entry[0] if entry is not None else 1000 + len(str(dtype))


def _op_name(kind):
    return getattr(kind, "name", str(kind))


#: polls of a wait before it starts yielding the core; yields before it sleeps
_SPIN_POLLS = 1000
_YIELD_S = 0.01


def wait_requests(reqs, timeout_s, on_timeout, statuses=True):
    """Wait until every MPI request in ``reqs`` completes, polling (spin,
    then yield, then short sleeps: a long wait does not burn its core), and
    call ``on_timeout(reqs)`` (which raises) once ``timeout_s`` has passed.
    The backend's one wait on MPI: every MPI operation it starts is
    non-blocking and completes here, under the deadline. Returns the
    statuses (None with ``statuses=False``: collectives need none)."""
    statuses = [MPI.Status() for _ in reqs] if statuses else None
    polls = 0
    deadline = calm = None
    pause = 1e-5
    while not MPI.Request.Testall(reqs, statuses):
        polls += 1
        if polls < _SPIN_POLLS:
            continue
        now = time.monotonic()
        if deadline is None:
            deadline, calm = now + timeout_s, now + _YIELD_S
        elif now > deadline:
            on_timeout(reqs)
            deadline = now + timeout_s  # on_timeout found everything complete after all
        if now < calm:
            os.sched_yield()
        else:
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
    return statuses


def _unfinished(reqs):
    """Indices of the requests still incomplete after a wait timed out (the
    others complete now: Testall changes no request unless all completed)."""
    if MPI.Request.Testall(reqs):
        return []
    return [i for i, q in enumerate(reqs) if q != MPI.REQUEST_NULL and not q.Test()]


#: requests given up on (timed out or interrupted) with what their buffers point into
_STRANDED = []


def _cancel(reqs):
    """Cancel what is left of a wait that timed out."""
    for req in reqs:
        if req != MPI.REQUEST_NULL:
            try:
                req.Cancel()
            except MPI.Exception:
                pass  # complete by now, or a send MPI cannot cancel


class _MpiWork(dist._Work):
    """MPI requests in flight (a collective or a message); wait() completes
    them under the deadline, then runs ``finish(statuses)`` (the copy-out), once.
    ``keep``: what the requests' buffers point into (tensors made by the
    call, buffers made from addresses), kept alive until they complete."""

    def __init__(self, pg, reqs, finish, result, what, peer=None, keep=None):
        super().__init__()
        self._pg = pg
        self._reqs = reqs
        self._keep = keep
        self._finish = finish
        self._result = result
        self._what = what
        self._peer = peer           # a message's peer (group rank); None: a collective
        self._error = None
        self._done = False
        self._source = -1

    def _complete(self):
        if self._done:
            if self._error is not None:
                raise self._error
            return
        self._done = True
        pg = self._pg
        if pg._pending is self:
            pg._pending = None
        try:
            statuses = pg._wait(self._reqs, self._what, self._peer)
            self._source = statuses[0].Get_source() if statuses else -1
            if self._finish is not None:
                self._finish(statuses)
        except HarmpiError as exc:
            self._error = exc
            self._strand()
            raise
        except KeyboardInterrupt:
            self._error = HarmpiError(f"harmpi backend: {self._what} was interrupted (Ctrl-C)")
            self._strand()
            raise
        self._keep = None

    def _strand(self):
        """Requests given up on stay with MPI, which may still write into
        their buffers: keep both alive for the life of the process."""
        if not MPI.Request.Testall(self._reqs):
            _STRANDED.append((self._reqs, self._keep, self._result))

    def wait(self, timeout=None):
        self._complete()
        return True

    def is_completed(self):
        return self._done

    def is_success(self):
        return self._done and self._error is None

    def exception(self):
        return self._error

    def result(self):
        return self._result

    def _source_rank(self):
        """The group rank a receive from any source heard (dist.recv(src=None))."""
        self._complete()
        return self._source

    def get_future(self):
        self._complete()
        fut = Future()
        fut.set_result(self._result)
        return fut


class ProcessGroupHarmpi(dist.ProcessGroup):
    """One torch process group over one MPI communicator (see the module docstring)."""

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
        self._world_ranks = _world_ranks(comm)
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
        return f"ProcessGroupHarmpi(rank={self.rank()}, size={self.size()}, " \
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

    def _wait(self, reqs, what, peer=None):
        """Complete ``reqs`` under the deadline (wait_requests); a collective
        that times out or fails leaves the group unusable (its peers may still
        be inside it), a message that times out is cancelled."""
        try:
            return wait_requests(reqs, self._timeout_s,
                                 lambda pending: self._timed_out(pending, what, peer),
                                 statuses=peer is not None)
        except MPI.Exception as exc:
            err = self._mpi_error(exc, what, peer)
        except KeyboardInterrupt:
            # a message is cancelled; a collective cannot be: its request
            # stays with MPI and may still complete with the peers' data,
            # so the group's next collective would meet this one's leftovers
            # (a broadcast once returned the dropped call's value): unusable
            if peer is not None:
                _cancel(reqs)
            else:
                self._broken = f"{what} was interrupted (Ctrl-C) on this rank"
            raise
        if peer is None:
            self._broken = str(err)
        raise err

    def _mpi_error(self, exc, what, peer):
        me = self._who()
        if exc.Get_error_class() == MPI.ERR_TRUNCATE:
            src = "" if peer is None else f" from world rank {self._world_rank(peer)}"
            return HarmpiMismatchError(
                f"{me}: harmpi backend {what}: a message{src} is larger than this rank's tensor; "
                "the ranks passed tensors of different sizes")
        return HarmpiError(f"{me}: harmpi backend {what}: MPI failed: {exc}")

    def _timed_out(self, reqs, what, peer, late=None):
        if MPI.Request.Testall(reqs):
            return  # completed just now
        timeout_s = self._timeout_s
        if peer is not None:
            _cancel(reqs)
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
                _STRANDED.append((reqs, buffers))
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
        mine = np.array((_CALLS[what], _dtype_code(dtype) if dtype is not None else 0, nbytes,
                         extra, problem is not None), np.int64)
        seen = np.empty((n, 5), np.int64)
        seen[me] = mine
        if n > 1:
            mpi = self._mpi
            reqs = [mpi.Irecv(seen[r], source=r, tag=_HEADER_TAG) for r in peers]
            reqs += [mpi.Isend(mine, dest=r, tag=_HEADER_TAG) for r in peers]

            def late(pending):
                left = _unfinished(pending)
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
        call = _CALL_NAMES.get(int(row[0]), f"call #{row[0]}")
        dtype = _DTYPE_BY_CODE.get(int(row[1]), f"dtype #{row[1]}")
        return f"world rank {self._world_rank(r)} calls {call} with {dtype}, {row[2]} bytes, " \
               f"op/root {row[3]}"

    def _run(self, reqs, finish, result, what, async_op, keep=None):
        """The MPI requests of one collective: a work object to wait on later
        (async_op; the group's next call completes it first), or completed now."""
        work = _MpiWork(self, reqs, finish, result, what, keep=keep)
        if async_op:
            self._pending = work
        else:
            work.wait()
        return work

    # -- all-reduce --------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        # the hot path, dist.all_reduce(t) as a synchronous SUM: as few
        # Python steps as possible before the context's compiled entry
        if self._pending is None:
            native = self._native_sum
            if native is not None:
                # the default group: C++ reads opts and runs the world entry
                # (harmpi/_native.cpp; -1 when no world context is served or
                # the tensor is not one it takes, -2 for anything but a
                # synchronous SUM): reading opts.reduceOp from Python alone
                # costs ~0.35 us
                rc = native(tensors, _SYNC_SUM if opts is None else opts)
                if rc == 0:
                    return _DONE
                if rc > 0:
                    api.native_failed(tensors[0], rc)
            elif len(tensors) == 1 and (opts is None or (not opts.asyncOp
                                                         and opts.reduceOp == _SUM)):
                # any other group: its context's entry, called here
                t = tensors[0]
                if t.dtype in _FLOATS and t.is_cpu and t.layout is _STRIDED:
                    self._sum(t)
                    return _DONE
        else:
            self._settle()
        if len(tensors) != 1:
            _one(tensors, "all_reduce")
        t = tensors[0]
        if opts is None:
            opts = _SYNC_SUM
        if t.layout != _STRIDED:
            return self._allreduce_sparse(t, opts)
        if opts.asyncOp:
            return self._allreduce_async(t, opts)
        if opts.reduceOp == _SUM:
            native = STATE.native
            if native is not None and self._default:
                rc = native(t)
                if rc == 0:
                    return _DONE
                if rc > 0:
                    api.native_failed(t, rc)
            if t.dtype in _FLOATS and t.device.type == "cpu":
                api.allreduce(t, comm=self._harmpi_comm)
                return _DONE
        return self._allreduce_other(t, opts.reduceOp, False)

    def _sum(self, t):
        """harmpi's all-reduce of the float CPU tensor ``t`` on this group's
        context: what harmpi.allreduce(t, comm=...) does on its Python path
        (the same checks and errors, the same entry), without looking the
        context up again. A context that broke or was freed since the group
        was made leaves the call to harmpi.allreduce, which raises (or, for
        the world after harmpi.finalize(), makes a new context)."""
        ctx = self._ctx
        if ctx.broken is not None:
            api.allreduce(t, comm=self._harmpi_comm)
            return
        addr, n, fmt = _describe(t, True)
        try:
            rc = ctx.entry(ctx.ctl, addr, n, fmt)
            if rc:
                ctx.raise_status(rc, addr, n, fmt, AUTO_CODE | fmt, "allreduce")
        except KeyboardInterrupt:
            ctx.interrupted()
            raise

    def _allreduce_async(self, t, opts):
        op = opts.reduceOp
        split = self._split
        if split is not None and (op == _SUM or op == _AVG) and t.dtype in _FLOATS \
                and t.numel() * t.element_size() <= split[2]:
            return self._start(t, None if op == _SUM else self.size())
        if op == _SUM and t.dtype in _FLOATS and t.device.type == "cpu":
            api.allreduce(t, comm=self._harmpi_comm)
            return _DoneWork([t])
        return self._allreduce_other(t, op, True)

    def _allreduce_other(self, t, op, async_op):
        """all_reduce beyond harmpi's sums: exact, the same bits on every rank."""
        kind = op.op if isinstance(op, dist.ReduceOp) else op
        if t.device.type != "cpu":
            raise HarmpiArgumentError(f"harmpi backend: all_reduce: tensor is on {t.device}; "
                                      "harmpi works on CPU tensors")
        if kind == _RED.PREMUL_SUM:
            raise HarmpiArgumentError("harmpi backend: all_reduce with PREMUL_SUM is not "
                                      "supported (gloo lacks it too); scale, then SUM")
        if t.dtype in _FLOATS:
            return self._allreduce_float(t, kind, async_op)
        entry = _DTYPES.get(t.dtype)
        ops = _BOOL_OPS if t.dtype == torch.bool else _INT_OPS
        mpi_op = ops.get(kind) if entry is not None and entry[1] is not None else None
        if mpi_op is None:
            raise HarmpiArgumentError(
                f"harmpi backend: all_reduce with {_op_name(kind)} of {t.dtype} is not "
                "supported; integer and bool tensors take SUM, PRODUCT, MIN, MAX, BAND, BOR "
                "and BXOR, floats SUM, AVG, PRODUCT, MIN and MAX")
        self._agree("all_reduce", t.dtype, t.numel() * t.element_size(), int(kind))
        buf = t if t.is_contiguous() else t.contiguous()
        req = self._mpi.Iallreduce(MPI.IN_PLACE, [buf.numpy(), entry[1]], mpi_op)
        return self._run([req], _copy_back(buf, t), [t], "all_reduce", async_op)

    def _allreduce_float(self, t, kind, async_op):
        if kind == _RED.AVG:
            api.allreduce(t, comm=self._harmpi_comm)
            t.div_(self.size())
            return _DoneWork([t]) if async_op else _DONE
        reduce = _FLOAT_REDUCE.get(kind)
        if reduce is None:
            raise HarmpiArgumentError(
                f"harmpi backend: all_reduce with {_op_name(kind)} of {t.dtype} is not "
                f"supported; floats take SUM, AVG, PRODUCT, MIN and MAX")
        # gathered in harmpi (exact), reduced in rank order: the same bits everywhere
        self._agree("all_reduce", t.dtype, t.numel() * t.element_size(), int(kind))
        if t.numel():
            gathered = api.allgather(t.reshape(1, -1).contiguous(), comm=self._harmpi_comm)
            t.copy_(reduce(gathered).view(t.shape))
        return _DoneWork([t]) if async_op else _DONE

    def _allreduce_sparse(self, t, opts):
        """A sparse COO SUM, as gloo computes it: every rank's coalesced indices
        and values gathered (MPI_Iallgatherv, under the deadline), summed,
        coalesced; the result replaces ``t`` (the same on every rank)."""
        kind = opts.reduceOp.op if isinstance(opts.reduceOp, dist.ReduceOp) else opts.reduceOp
        problem = None
        if t.layout != torch.sparse_coo:
            problem = f"{t.layout} tensors are not supported (sparse COO ones are, as in gloo)"
        elif kind != _RED.SUM:
            problem = f"sparse tensors take SUM only (as in gloo), not {_op_name(kind)}"
        elif t.device.type != "cpu":
            problem = f"tensor is on {t.device}; harmpi works on CPU tensors"
        sparse = t.coalesce() if problem is None else None
        sparse_dim = sparse.sparse_dim() if sparse is not None else 0
        what = "all_reduce (sparse)"
        self._agree(what, t.dtype, t.numel() * t.element_size(), sparse_dim * 64 + t.dim(),
                    problem)
        n, shape = self.size(), tuple(t.shape)
        mine = np.array([sparse._nnz(), *shape], np.int64)
        table = np.empty((n, len(mine)), np.int64)
        self._wait([self._mpi.Iallgather(mine, table)], what)
        differ = np.flatnonzero((table[:, 1:] != table[0, 1:]).any(axis=1))
        if differ.size:
            raise HarmpiMismatchError(
                f"{self._who()}: harmpi backend {what}: ranks disagree on the shape: "
                + "; ".join(f"world rank {self._world_rank(r)} passes {tuple(table[r, 1:])}"
                            for r in (0, *differ)) + "; no data moved")
        nnz = table[:, 0]
        dense_shape = shape[sparse_dim:]
        row_bytes = math.prod(dense_shape) * t.element_size()
        indices = torch.empty((int(nnz.sum()), sparse_dim), dtype=torch.int64)
        values = torch.empty((int(nnz.sum()), *dense_shape), dtype=t.dtype)
        reqs = []
        for mine_t, whole, per_row in ((sparse.indices().t().contiguous(), indices, sparse_dim * 8),
                                       (sparse.values().contiguous(), values, row_bytes)):
            counts = (nnz * per_row).tolist()
            displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()
            reqs.append(self._mpi.Iallgatherv(
                _bytes_of(mine_t) if mine_t.numel() else bytearray(0),
                [_bytes_of(whole) if whole.numel() else bytearray(0), (counts, displs),
                 MPI.BYTE]))
        self._wait(reqs, what)
        total = torch.sparse_coo_tensor(indices.t(), values, shape).coalesce()
        t.copy_(total)
        return _DoneWork([t])

    def _start(self, t, scale):
        """First half of an async all-reduce on one node (module docstring)."""
        from .torch import describe  # noqa: PLC0415 - torch is loaded by now

        addr, n, fmt = describe(_float_tensor(t, "all_reduce"), True)
        ctx = self._ctx
        if ctx.broken is not None:
            raise HarmpiError(f"harmpi context is unusable: {ctx.broken}")
        start, finish, _ = self._split
        rc = start(ctx.ctl, addr, n, fmt)
        if rc:
            ctx.raise_status(rc, addr, n, fmt, AUTO_CODE | fmt, "allreduce (async)")
        work = _SplitWork(self, finish, t, addr, n, fmt, scale)
        self._pending = work
        ctx.split_pending = work
        return work

    def allreduce_coalesced(self, tensors, opts=None):
        """One all_reduce per tensor, in order (any op and dtype all_reduce takes)."""
        self._settle()
        for t in tensors:
            self.allreduce([t], _reduce_opts(opts))
        return _DoneWork(tensors)

    # -- gathers -------------------------------------------------------------------

    def allgather(self, output_lists, input_tensors, opts=None):
        self._settle()
        outs = _one(output_lists, "all_gather")
        t = _one(input_tensors, "all_gather")
        if len(outs) != self.size():
            raise HarmpiArgumentError(f"harmpi backend: all_gather needs {self.size()} output "
                                      f"tensors, got {len(outs)}")
        if any(o.shape != t.shape for o in outs):
            return self._gather_uneven(t, outs)
        if t.dtype in _FLOATS:
            gathered = api.allgather(t.contiguous(), comm=self._harmpi_comm)
            for o, part in zip(outs, gathered.view(self.size(), *t.shape)):
                o.copy_(part)
            return _DoneWork(output_lists)
        _cpu(t, "all_gather")
        gathered = torch.empty((self.size(),) + tuple(t.shape), dtype=t.dtype)
        self._agree("all_gather", t.dtype, t.numel() * t.element_size())
        req = self._mpi.Iallgather(_bytes_of(t.contiguous()), _bytes_of(gathered))

        def finish(_statuses):
            for o, part in zip(outs, gathered):
                o.copy_(part)

        return self._run([req], finish, output_lists, "all_gather", _async(opts))

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        """all_gather of each input in turn: output_lists[r][k] gets rank r's input k."""
        self._settle()
        if len(output_lists) != self.size() or \
                any(len(outs) != len(input_tensors) for outs in output_lists):
            raise HarmpiArgumentError(
                f"harmpi backend: all_gather_coalesced needs {self.size()} output lists of "
                f"{len(input_tensors)} tensors")
        for k, t in enumerate(input_tensors):
            self.allgather([[outs[k] for outs in output_lists]], [t])
        return _DoneWork(output_lists)

    def _gather_uneven(self, t, outs):
        from . import logits  # noqa: PLC0415 - only for uneven vocabulary shards

        logits.gather_uneven(t, outs, self._harmpi_comm)
        return _DoneWork([outs])

    def all_gather_single(self, output, input, opts=None):
        self._settle()
        _contiguous_cpu(output, "all_gather_into_tensor")
        if input.numel() * self.size() != output.numel():
            raise HarmpiArgumentError(
                f"harmpi backend: all_gather_into_tensor: output has {output.numel()} elements, "
                f"expected {self.size()} x {input.numel()}")
        if input.dtype in _FLOATS:
            if output.dtype != input.dtype:
                raise HarmpiArgumentError("harmpi backend: all_gather_into_tensor: output and "
                                          "input dtypes differ")
            api.allgather(input.contiguous(), comm=self._harmpi_comm, out=output)
            return _DoneWork([output])
        _cpu(input, "all_gather_into_tensor")
        if output.dtype != input.dtype:
            raise HarmpiArgumentError("harmpi backend: all_gather_into_tensor: output and "
                                      "input dtypes differ")
        self._agree("all_gather_into_tensor", input.dtype, input.numel() * input.element_size())
        req = self._mpi.Iallgather(_bytes_of(input.contiguous()), _bytes_of(output))
        return self._run([req], None, [output], "all_gather_into_tensor", _async(opts))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self.all_gather_single(o, i, opts)
        return _DoneWork(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # -- reduce-scatter ----------------------------------------------------------------

    def reduce_scatter_single(self, output, input, opts=None):
        self._settle()
        _cpu(input, "reduce_scatter_tensor")
        _contiguous_cpu(output, "reduce_scatter_tensor")
        n = output.numel()
        if input.numel() != n * self.size() or output.dtype != input.dtype:
            raise HarmpiArgumentError(
                f"harmpi backend: reduce_scatter_tensor: input must have {self.size()} x "
                f"{n} elements of the output's dtype (got {input.numel()}, {input.dtype})")
        full = input.contiguous().clone()
        scratch = [full]
        self.allreduce(scratch, _reduce_opts(opts))
        r = self.rank()
        output.view(-1).copy_(full.view(-1)[r * n:(r + 1) * n])
        return _DoneWork([output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        out = _one(output_tensors, "reduce_scatter")
        inputs = _one(input_lists, "reduce_scatter")
        if len(inputs) != self.size():
            raise HarmpiArgumentError(f"harmpi backend: reduce_scatter needs {self.size()} "
                                      f"input tensors, got {len(inputs)}")
        flat = torch.cat([i.reshape(-1) for i in inputs])
        result = torch.empty(flat.numel() // self.size(), dtype=flat.dtype)
        self.reduce_scatter_single(result, flat, opts)
        out.copy_(result.view(out.shape))
        return _DoneWork([out])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self.reduce_scatter_single(o, i, opts)
        return _DoneWork(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- rooted collectives ----------------------------------------------------------------

    def broadcast(self, tensors, opts=None):
        self._settle()
        t = _cpu(_one(tensors, "broadcast"), "broadcast")
        root = opts.rootRank if opts is not None else 0
        self._agree("broadcast", t.dtype, t.numel() * t.element_size(), root)
        buf = t if t.is_contiguous() else t.contiguous()
        req = self._mpi.Ibcast(_bytes_of(buf), root=root)
        return self._run([req], _copy_back(buf, t), tensors, "broadcast", _async(opts))

    def scatter(self, output_tensors, input_lists, opts=None):
        self._settle()
        out = _cpu(_one(output_tensors, "scatter"), "scatter")
        root = opts.rootRank if opts is not None else 0
        nbytes = out.numel() * out.element_size()
        send, problem = None, None
        if self.rank() == root:
            inputs = _one(input_lists, "scatter")
            if len(inputs) != self.size() or any(i.numel() != out.numel() or
                                                 i.dtype != out.dtype for i in inputs):
                problem = f"the root needs {self.size()} input tensors of {out.numel()} " \
                          f"elements of {out.dtype}, like its output"
            elif nbytes:
                send = _bytes_of(torch.stack([i.reshape(-1) for i in inputs]))
        self._agree("scatter", out.dtype, nbytes, root, problem)
        buf = out if out.is_contiguous() else out.contiguous()
        recv = _bytes_of(buf)
        if self.rank() == root and not nbytes:
            send = recv
        req = self._mpi.Iscatter(send, recv, root=root)
        return self._run([req], _copy_back(buf, out), output_tensors, "scatter", _async(opts))

    def gather(self, output_lists, input_tensors, opts=None):
        self._settle()
        t = _cpu(_one(input_tensors, "gather"), "gather")
        root = opts.rootRank if opts is not None else 0
        outs, recv, problem = None, None, None
        if self.rank() == root:
            outs = _one(output_lists, "gather")
            if len(outs) != self.size() or any(o.numel() != t.numel() or o.dtype != t.dtype
                                               for o in outs):
                problem = f"the root needs {self.size()} output tensors of {t.numel()} " \
                          f"elements of {t.dtype}, like its input"
            else:
                whole = torch.empty((self.size(), t.numel()), dtype=t.dtype)
                recv = _bytes_of(whole)
        self._agree("gather", t.dtype, t.numel() * t.element_size(), root, problem)
        send = _bytes_of(t.contiguous())
        req = self._mpi.Igather(send, recv, root=root)

        def finish(_statuses):
            if outs is not None:
                for o, part in zip(outs, whole):
                    o.copy_(part.view(o.shape))

        return self._run([req], finish, output_lists, "gather", _async(opts))

    def reduce(self, tensors, opts=None):
        """Every rank reduces (harmpi's all-reduce for float sums); the root
        keeps the result, the others' tensors are left as they were."""
        self._settle()
        t = _cpu(_one(tensors, "reduce"), "reduce")
        root = opts.rootRank if opts is not None else 0
        target = t if self.rank() == root else t.clone()
        self.allreduce([target], _reduce_opts(opts))
        return _DoneWork(tensors)

    # -- all-to-all -----------------------------------------------------------------------

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """One tensor to and from each rank (sizes may differ between pairs)."""
        self._settle()
        n = self.size()
        if len(output_tensors) != n or len(input_tensors) != n:
            raise HarmpiArgumentError(f"harmpi backend: all_to_all needs {n} input and {n} "
                                      f"output tensors, got {len(input_tensors)} and "
                                      f"{len(output_tensors)}")
        dtype = input_tensors[0].dtype if input_tensors else torch.float32
        if any(x.dtype != dtype or x.device.type != "cpu"
               for x in list(input_tensors) + list(output_tensors)):
            raise HarmpiArgumentError("harmpi backend: all_to_all: every tensor must be a CPU "
                                      "tensor of one dtype")
        size = dtype.itemsize
        send_counts = [x.numel() * size for x in input_tensors]
        recv_counts = [x.numel() * size for x in output_tensors]
        sendbuf = torch.cat([x.reshape(-1) for x in input_tensors]) if n else None
        recvbuf = torch.empty(sum(recv_counts) // size, dtype=dtype)

        def finish(_statuses):
            offset = 0
            for o in output_tensors:
                k = o.numel()
                o.copy_(recvbuf[offset:offset + k].view(o.shape))
                offset += k

        return self._alltoallv("all_to_all", sendbuf, recvbuf, send_counts, recv_counts,
                               finish, output_tensors, _async(opts))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        """Rows of ``input`` (dim 0) to each rank: split evenly, or by the split sizes."""
        if self._pending is not None:
            self._settle()
        n = self._size
        _cpu(output, "all_to_all_single")
        _cpu(input, "all_to_all_single")
        if output.dtype != input.dtype:
            raise HarmpiArgumentError("harmpi backend: all_to_all_single: output and input "
                                      "dtypes differ")
        send_counts = _split_bytes(input, input_split_sizes, n, "input")
        recv_counts = _split_bytes(output, output_split_sizes, n, "output")
        src = input.contiguous()
        dst = output if output.is_contiguous() else output.contiguous()
        finish = _copy_back(dst, output)
        if input.dtype in _FLOATS:
            # harmpi's own all-to-all: rows through the node's slots, every
            # pair's count checked against its receiver's split size
            if not input_split_sizes and not output_split_sizes:
                api.alltoall(src, comm=self._harmpi_comm, out=dst)  # even: no count lists
            else:
                rows = list(input_split_sizes) or [input.size(0) // n] * n
                want = list(output_split_sizes) or [output.size(0) // n] * n
                api.alltoall(src, rows, comm=self._harmpi_comm, out=dst, recv_counts=want)
            if finish is not None:
                finish(None)
            return _DoneWork([output])
        if not input_split_sizes and not output_split_sizes:
            # even splits: one header agreement covers every pair
            nbytes = input.numel() * input.element_size()
            problem = None if nbytes == output.numel() * output.element_size() else \
                "input and output sizes differ (even splits)"
            self._agree("all_to_all_single", input.dtype, nbytes, 0, problem)
            req = self._mpi.Ialltoall(_buffer(src), _buffer(dst))
            return self._run([req], finish, [output], "all_to_all_single", _async(opts),
                             keep=(src, dst))
        return self._alltoallv("all_to_all_single", src, dst, send_counts, recv_counts,
                               finish, [output], _async(opts))

    alltoall_base = all_to_all_single

    def _alltoallv(self, what, src, dst, send_counts, recv_counts, finish, result, async_op):
        """Uneven all-to-all: the ranks agree on the call and dtype, then on
        every pair's byte count (what i sends to j is what j expects from i)."""
        n = self.size()
        # (the totals may differ between ranks: the pairs are checked below)
        self._agree(what, src.dtype if src is not None else None)
        mine = np.array(send_counts + recv_counts, np.int64)
        table = np.empty((n, 2 * n), np.int64)
        self._wait([self._mpi.Iallgather(mine, table)], what)
        sent, expected = table[:, :n], table[:, n:]
        if not np.array_equal(sent, expected.T):
            i, j = (int(v) for v in np.argwhere(sent != expected.T)[0])
            raise HarmpiMismatchError(
                f"{self._who()}: harmpi backend {what}: split sizes disagree: world rank "
                f"{self._world_rank(i)} sends {sent[i, j]} bytes to world rank "
                f"{self._world_rank(j)}, which expects {expected[j, i]}; no data moved")
        sdispl = np.concatenate([[0], np.cumsum(send_counts)[:-1]]).astype(np.int64)
        rdispl = np.concatenate([[0], np.cumsum(recv_counts)[:-1]]).astype(np.int64)
        empty = bytearray(0)
        sbuf = _buffer(src) if src is not None else empty
        rbuf = _buffer(dst)
        req = self._mpi.Ialltoallv([sbuf, (send_counts, sdispl.tolist()), MPI.BYTE],
                                   [rbuf, (recv_counts, rdispl.tolist()), MPI.BYTE])
        return self._run([req], finish, result, what, async_op, keep=(src, dst))

    # -- point to point ----------------------------------------------------------------------

    def send(self, tensors, dst, tag=0):
        t = _cpu(_one(tensors, "send"), "send")
        self._check_usable()
        buf = t.contiguous()
        req = self._p2p.Isend(_bytes_of(buf), dest=dst, tag=_user_tag(tag))
        return _MpiWork(self, [req], None, [buf], f"send to group rank {dst} (tag {tag})",
                        peer=dst)

    def recv(self, tensors, src, tag=0):
        return self._recv(tensors, src, tag, f"recv from group rank {src} (tag {tag})")

    def recv_anysource(self, tensors, tag=0):
        return self._recv(tensors, MPI.ANY_SOURCE, tag, f"recv from any rank (tag {tag})")

    def _recv(self, tensors, src, tag, what):
        t = _cpu(_one(tensors, "recv"), "recv")
        self._check_usable()
        buf = t if t.is_contiguous() else t.contiguous()
        nbytes = t.numel() * t.element_size()
        req = self._p2p.Irecv(_bytes_of(buf), source=src, tag=_user_tag(tag))
        copy = _copy_back(buf, t)

        def finish(statuses):
            got = statuses[0].Get_count(MPI.BYTE)
            if got != nbytes:
                raise HarmpiMismatchError(
                    f"{self._who()}: harmpi backend {what}: world rank "
                    f"{self._world_rank(statuses[0].Get_source())} sent {got} bytes, this "
                    f"rank's tensor holds {nbytes}")
            if copy is not None:
                copy(statuses)

        return _MpiWork(self, [req], finish, tensors, what,
                        peer=src if src != MPI.ANY_SOURCE else -1)

    # -- barriers ----------------------------------------------------------------------------

    def barrier(self, opts=None):
        self._settle()
        try:
            api.barrier(comm=self._harmpi_comm)
        except HarmpiTimeoutError as exc:
            # the words torch's callers (and its own tests) look for
            raise HarmpiTimeoutError(
                f"{self._who()}: harmpi backend barrier: timeout after "
                f"{self._ctx.config.timeout_s:g} s: {exc}", culprit=exc.culprit) from exc
        return _DoneWork()

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """Gloo's monitored barrier: group rank 0 hears from every rank within
        ``timeout`` (default: the group's deadline) and names the ranks that did
        not come (the first, or all with ``wait_all_ranks``), then releases them.
        The errors say what gloo's say ("Rank 1 failed to pass monitoredBarrier
        in 100 ms", "Rank 0 timed out in monitoredBarrier after 0 ms"), group
        ranks as gloo counts them, world ranks after. (torch's
        dist.monitored_barrier accepts gloo groups only; call this method on the
        group: ``group.monitored_barrier(timedelta, wait_all_ranks)``.)"""
        self._settle()
        self._check_usable()
        timeout_s = timeout.total_seconds() if timeout is not None else self._timeout_s
        ms = round(timeout_s * 1000)
        n, me = self.size(), self.rank()
        token = np.zeros(1, np.int64)
        if me != 0:
            reqs = [self._mpi.Isend(token, dest=0, tag=_MONITOR_TAG),
                    self._mpi.Irecv(np.empty(1, np.int64), source=0, tag=_MONITOR_TAG)]

            def unreleased(pending):
                if not _unfinished(pending):
                    return
                _cancel(pending)
                raise HarmpiTimeoutError(
                    f"Rank {me} successfully reached monitoredBarrier, but received errors "
                    f"while waiting for send/recv from rank 0 (harmpi backend, {self._who()}: "
                    f"group rank 0, world rank {self._world_rank(0)}, did not release it "
                    f"within {ms} ms). Please check rank 0 logs for faulty rank.",
                    culprit=self._world_rank(0))

            with self._interruptible("monitored_barrier", reqs, token):
                wait_requests(reqs, timeout_s, unreleased)
            return _DoneWork()
        inbox = np.empty((max(n - 1, 1), 1), np.int64)
        reqs = [self._mpi.Irecv(inbox[r - 1], source=r, tag=_MONITOR_TAG) for r in range(1, n)]

        def missing(pending):
            late = [i + 1 for i in _unfinished(pending)]
            if not late:
                return
            _cancel(pending)
            heard = [r for r in range(1, n) if r not in late]
            if timeout_s <= 0:
                raise HarmpiTimeoutError(
                    f"Rank {me} timed out in monitoredBarrier after {ms} ms (harmpi backend, "
                    f"{self._who()}). " + (f"Successfully processed ranks: "
                                           f"{', '.join(map(str, heard))}" if heard else
                                           "No ranks successfully processed in monitoredBarrier."),
                    culprit=self._world_rank(late[0]))
            named = late if wait_all_ranks else late[:1]
            ranks = ", ".join(map(str, named))
            world = ", ".join(str(self._world_rank(r)) for r in named)
            raise HarmpiTimeoutError(
                f"[Rank {me}]: Rank{'s' if len(named) > 1 else ''} {ranks} failed to pass "
                f"monitoredBarrier in {ms} ms (harmpi backend, {self._who()}: world "
                f"rank{'s' if len(named) > 1 else ''} {world})",
                culprit=self._world_rank(late[0]))

        with self._interruptible("monitored_barrier", reqs, inbox):
            wait_requests(reqs, timeout_s, missing)
        sends = [self._mpi.Isend(token, dest=r, tag=_MONITOR_TAG) for r in range(1, n)]
        with self._interruptible("monitored_barrier", sends, token):
            wait_requests(sends, timeout_s, lambda pending: self._timed_out(
                pending, "monitored_barrier (releasing the ranks)", None))
        return _DoneWork()

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
        its harmpi context (window, transports). The ranks first meet (a
        polled barrier under the deadline); a rank whose peers do not come
        leaves the context to MPI_Finalize, with a warning, instead of
        entering a collective free that would wait for them forever."""
        if self._closed:
            return
        self._closed = True
        try:
            self._settle()
        except HarmpiError as exc:
            log.warning("harmpi backend: destroying a group whose last call failed: %s", exc)
        healthy = self._broken is None and self._ctx.broken is None
        if healthy:
            try:
                arrive(self._mpi, self._timeout_s, "destroying a harmpi process group")
            except HarmpiTimeoutError as exc:
                log.warning("%s; its MPI communicator and harmpi context are left to "
                            "MPI_Finalize", exc)
                healthy = False
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


def _group_timeout(timeout):
    """Seconds of a timeout= given to init_process_group or new_group, or None
    when it is torch's default (given or not: torch passes its default for
    "not given"), which leaves the deadline to HARMPI_TIMEOUT_S."""
    if timeout is None or timeout == default_pg_timeout:
        return None
    return max(timeout.total_seconds(), 1e-3)  # gloo's 0 ms: every wait times out at once


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


def _world_ranks(comm):
    """COMM_WORLD rank of each rank of ``comm`` (errors name ranks users know)."""
    group, world = comm.Get_group(), _WORLD.Get_group()
    try:
        return MPI.Group.Translate_ranks(group, list(range(comm.Get_size())), world)
    finally:
        group.Free()
        world.Free()


def _native_sum():
    from . import native  # noqa: PLC0415 - imports harmpi._C (torch's C++ side)

    mod = native.load()
    return getattr(mod, "allreduce_sum", None) if mod is not None else None


def _reduce_opts(opts):
    out = dist.AllreduceOptions()
    out.reduceOp = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
    out.asyncOp = False
    return out


# -- creation -------------------------------------------------------------------------------

def _create(backend_opts, pg_options=None):
    """The creator torch calls (extended API) for every group of backend "harmpi"."""
    if _torch_version() < MIN_TORCH:
        raise HarmpiError(f"harmpi backend needs torch >= {'.'.join(map(str, MIN_TORCH))}; "
                          f"this is torch {torch.__version__}")
    if not MPI.Is_initialized():
        raise HarmpiError("harmpi backend: MPI is not initialised; run under mpirun")
    ranks = list(backend_opts.global_ranks_in_group)
    rank, size = backend_opts.group_rank, backend_opts.group_size
    timeout_s = _group_timeout(getattr(backend_opts, "timeout", None))
    if not ranks:  # the default group: torch's world must be MPI's
        if (rank, size) != (_WORLD.Get_rank(), _WORLD.Get_size()):
            raise HarmpiArgumentError(
                f"harmpi backend: torch says rank {rank} of {size}, MPI says rank "
                f"{_WORLD.Get_rank()} of {_WORLD.Get_size()}: the rank and world size given to "
                "init_process_group (or RANK/WORLD_SIZE) must match mpirun's, or be left out."
                + worldenv.torchrun_hint())
        return ProcessGroupHarmpi(_WORLD, rank, size, timeout_s)
    world = dist.distributed_c10d._get_default_group()
    if world.size() != _WORLD.Get_size():
        raise HarmpiArgumentError("harmpi backend: the default group does not span MPI's world")
    # MPI_Comm_create_group blocks until every member calls it: first make
    # sure (a polled meeting on the group's own store, under the deadline)
    # that they all came, so one that never does is named instead
    _members_arrive(backend_opts.store, rank, ranks,
                    timeout_s or Config.from_env().timeout_s)
    world_group = _WORLD.Get_group()
    members = world_group.Incl(ranks)
    try:
        comm = _WORLD.Create_group(members)
    finally:
        members.Free()
        world_group.Free()
    if comm.Get_rank() != rank:
        raise HarmpiError(f"harmpi backend: group rank {rank} is MPI rank {comm.Get_rank()}")
    return ProcessGroupHarmpi(comm, rank, size, timeout_s)


def _members_arrive(store, rank, ranks, timeout_s):
    """Every member of a new group has come to its creation in time, or
    HarmpiTimeoutError on every member (the store is the group's own: torch
    prefixes it with the group's unique name). Each member posts its arrival
    time (CLOCK_REALTIME) and counts itself in. A member that does not see
    all of them within ``timeout_s`` of its own arrival names the missing
    ones and raises. Once all have come, each member decides from the posted
    times alone, so all decide alike: a member that came more than
    LATE_FRACTION x ``timeout_s`` after the first fails everywhere, since the
    first may have given up by then (a late member used to go on into the
    blocking MPI_Comm_create_group alone and wait there forever)."""
    store.set(f"harmpi/arrived/{rank}", repr(time.time()))
    count = store.add("harmpi/arrived", 1)
    deadline = time.monotonic() + timeout_s
    pause = 1e-4
    while count < len(ranks):
        if time.monotonic() > deadline:
            late = [w for r, w in enumerate(ranks) if not store.check([f"harmpi/arrived/{r}"])]
            raise HarmpiTimeoutError(
                f"rank {_WORLD.Get_rank()}: harmpi backend: creating a process group of world "
                f"ranks {ranks}: world rank{'s' if len(late) > 1 else ''} "
                f"{', '.join(map(str, late))} did not come within {timeout_s:g} s (it failed "
                "or hangs, or did not call new_group; HARMPI_TIMEOUT_S or timeout= sets the "
                "deadline)", culprit=late[0] if late else -1)
        time.sleep(pause)
        pause = min(2 * pause, 0.01)
        count = store.add("harmpi/arrived", 0)
    stamps = [float(store.get(f"harmpi/arrived/{r}")) for r in range(len(ranks))]
    first = min(stamps)
    late = [(w, t - first) for w, t in zip(ranks, stamps) if t - first > LATE_FRACTION * timeout_s]
    if late:
        raise HarmpiTimeoutError(
            f"rank {_WORLD.Get_rank()}: harmpi backend: creating a process group of world ranks "
            f"{ranks}: " + ", ".join(f"world rank {w} came {d:.1f} s" for w, d in late)
            + f" after the first, past {LATE_FRACTION:g} x the {timeout_s:g} s deadline: the "
            "others may have given up (HARMPI_TIMEOUT_S or timeout= sets the deadline)",
            culprit=late[0][0])


# -- rendezvous over MPI ------------------------------------------------------------------------

def _query_int(query, name):
    values = parse_qs(query).get(name)
    return int(values[0]) if values else None


def _mpi_rendezvous(url, timeout=datetime.timedelta(minutes=30), **kwargs):
    """``init_method="mpi://"``: rank and world size from MPI, a TCPStore on
    rank 0 at a free port broadcast over MPI (no MASTER_ADDR/MASTER_PORT)."""
    query = urlparse(url).query
    rank, size = _WORLD.Get_rank(), _WORLD.Get_size()
    for name, mine, env in (("rank", rank, "RANK"), ("world_size", size, "WORLD_SIZE")):
        given = _query_int(query, name)
        if given == -1:  # torch's "not given"
            given = None
        if given is None and os.environ.get(env):
            given = int(os.environ[env])
        if given is not None and given != mine:
            raise HarmpiArgumentError(
                f"init_process_group: {name}={given} but MPI says {mine}; under mpirun leave "
                f"{name} out (harmpi takes it from MPI) or pass MPI's")
    # every MPI call here is non-blocking and polled under the deadline: a
    # rank that never comes (it failed before init_process_group and its
    # failure did not end the job) is named instead of hanging the others
    timeout_s = _group_timeout(timeout) or Config.from_env().timeout_s
    hosts = np.zeros((size, _NAME_BYTES), np.uint8)
    _rendezvous_wait(_WORLD.Iallgather(_name_bytes(socket.gethostname()), hosts), timeout_s,
                     "exchanging host names")
    where = np.zeros(_NAME_BYTES, np.uint8)
    if rank == 0:
        store = dist.TCPStore("0.0.0.0", 0, size, True, timeout=timeout,
                              wait_for_workers=False)
        addr = "127.0.0.1" if len({row.tobytes() for row in hosts}) == 1 else _host_address()
        where[:] = _name_bytes(f"{addr} {store.port}")
    _rendezvous_wait(_WORLD.Ibcast(where, root=0), timeout_s, "hearing the store's address")
    addr, port = where.tobytes().rstrip(b"\0").decode().split()
    where = (addr, int(port))
    if rank != 0:
        store = dist.TCPStore(addr, int(port), size, False, timeout=timeout)
    # every rank is connected before any goes on (a rank that fails right
    # after must not close the store under one still connecting)
    _rendezvous_wait(_WORLD.Ibarrier(), timeout_s, "waiting for every rank's store connection")
    log.debug("torch.distributed rendezvous over MPI: store at %s:%d", *where)
    yield (store, rank, size)
    raise RuntimeError("harmpi's MPI rendezvous cannot re-rendezvous")


#: bytes of a host name or an address in the rendezvous' fixed-size messages
_NAME_BYTES = 256


def _name_bytes(text):
    raw = text.encode()[:_NAME_BYTES]
    return np.frombuffer(raw.ljust(_NAME_BYTES, b"\0"), np.uint8).copy()


def _rendezvous_wait(req, timeout_s, step):
    def late(_pending):
        raise HarmpiTimeoutError(
            f"rank {_WORLD.Get_rank()}: init_process_group's rendezvous over MPI ({step}): "
            f"the other ranks did not arrive within {timeout_s:g} s (a rank failed or hangs "
            "before init_process_group; HARMPI_TIMEOUT_S or timeout= sets the deadline)")

    wait_requests([req], timeout_s, late)


def _host_address():
    from .transports.tcp import local_ipv4_addresses  # noqa: PLC0415

    addrs = local_ipv4_addresses()
    return addrs[0] if addrs else socket.gethostname()


#: the URL scheme of the MPI rendezvous: ``init_process_group(..., init_method="mpi://")``
RENDEZVOUS = "mpi"


def _install_rendezvous():
    """``mpi://`` with torch's public registry (once: torch refuses a scheme twice)."""
    from torch.distributed.rendezvous import register_rendezvous_handler  # noqa: PLC0415

    try:
        register_rendezvous_handler(RENDEZVOUS, _mpi_rendezvous)
    except RuntimeError:  # registered already (this module imported twice, under two names)
        log.debug("rendezvous scheme %s:// is registered already", RENDEZVOUS)


_registered = False


def register():
    """Register backend "harmpi" for CPU with torch.distributed (idempotent;
    importing this module calls it, and so does ``import harmpi`` when torch
    is imported already), the MPI rendezvous ``mpi://``, and the torch op
    ``torch.ops.harmpi.all_reduce_`` when the native module is built; under
    an MPI launcher, RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE where
    unset (harmpi.worldenv)."""
    global _registered
    if _registered:
        return
    _registered = True
    worldenv.export()
    if not dist.is_available():
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    _install_rendezvous()


register()  # importing this module is how a program asks for the backend
