"""One harmpi context per communicator: topology, arena, transports, entries.

Creating a context is collective over its communicator (it splits
communicators, allocates the shared window and connects the rails); so is
freeing it. When it is made, the context picks its *entries*, the one
thing a collective calls after its arguments are checked:

=========================================  ====================================
topology and settings                      allreduce entry
=========================================  ====================================
one rank                                   node.SOLO_STEP (compiled)
one node, algorithm auto                   node.ONE_NODE_STEP (compiled)
two equal nodes over tcp, algorithm auto   har_latency.HAR2_STEP (compiled) up
                                           to har_latency_max, PyStep above
anything else, or a forced algorithm       PyStep (the algorithm objects)
=========================================  ====================================

Every entry is ``entry(ctl, x_addr, n, fmt) -> status``; the compiled ones
also have a C address (``entry_cfunc``, 0 for the others) that the native
module calls. The allgather entry is ``gather(ctl, x_addr, out_addr, n,
fmt, digest) -> status``. A non-zero status becomes an exception in one
place, :meth:`Context.fail`, which also marks the context unusable when the
failure may have left peers behind (timeouts, transport errors).
"""

from __future__ import annotations

import logging
import os

import numpy as np
from mpi4py import MPI

from . import control, dtypes, kind, node, transports
from .algorithms import ALGORITHM_IDS, ALLREDUCE, HierAllgather
from .algorithms.base import Call
from .algorithms.har_latency import HAR2_STEP
from .config import Config
from .control import MISMATCH, POISONED, RAIL_FAILED, RAIL_TIMEOUT, RAISED, TIMEOUT
from .errors import (
    HarmpiArgumentError,
    HarmpiError,
    HarmpiMismatchError,
    HarmpiTimeoutError,
    HarmpiTransportError,
)
from .shm import Arena
from .topology import discover

__all__ = ["Context", "AUTO_CODE"]

log = logging.getLogger("harmpi")

#: kind word of an auto all-reduce, without its format
AUTO_CODE = kind.encode(op=kind.OP_SUM, coll=kind.COLL_ALLREDUCE, algo=ALGORITHM_IDS["auto"])

#: spin count of waits when every rank owns a core: ~1 ms of polling
SPIN_COUNT = 20000
#: spins before yielding when ranks outnumber cores (a spinning waiter would
#: hold the core its peer needs to arrive)
OVERSUBSCRIBED_SPIN_COUNT = 64

_ITEMSIZE = tuple(f.itemsize for f in dtypes.FORMATS)


def _boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _cpus_allowed():
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def _oversubscribed(comm):
    """Whether the ranks on this physical machine outnumber its cores.
    Ranks count together by the kernel's boot id (so "hosts" that are
    containers or network namespaces of one machine count together),
    against the union of their allowed CPUs (each rank may be bound to one)."""
    mine = (_boot_id() or MPI.Get_processor_name(), frozenset(_cpus_allowed()))
    same = [cpus for key, cpus in comm.allgather(mine) if key == mine[0]]
    return len(same) > len(frozenset().union(*same))


class PyStep:
    """An all-reduce algorithm written in Python, behind the entry signature.
    ``name``: a forced algorithm, or "auto" (chosen per call by size)."""

    def __init__(self, ctx, name):
        self.ctx = ctx
        self.name = name
        self.code = kind.encode(op=kind.OP_SUM, coll=kind.COLL_ALLREDUCE,
                                algo=ALGORITHM_IDS[name])

    def __call__(self, ctl, x_addr, n, fmt):
        call = Call(x_addr, n, fmt, self.code | fmt, "allreduce")
        algo = self.ctx.allreduce_algorithm(self.name, call.nbytes)
        return self.ctx.run_python(algo.run, call)


class SizeSwitch:
    """A compiled entry up to ``max_nbytes``, another entry above."""

    def __init__(self, small, max_nbytes, large):
        self.small, self.max_nbytes, self.large = small, max_nbytes, large

    def __call__(self, ctl, x_addr, n, fmt):
        if n * _ITEMSIZE[fmt] <= self.max_nbytes:
            return self.small(ctl, x_addr, n, fmt)
        return self.large(ctl, x_addr, n, fmt)


class Context:
    """Everything harmpi keeps for one communicator."""

    def __init__(self, comm, config: Config | None = None):
        self.config = config or Config.from_env()
        self.comm = comm
        self.topo, self.node_comm, self.rail_comm = discover(comm, self.config.ranks_per_node)
        self.oversubscribed = _oversubscribed(comm)
        spin = self.config.spin_count
        if spin is None:
            spin = OVERSUBSCRIBED_SPIN_COUNT if self.oversubscribed else SPIN_COUNT
        self.spin_count = spin
        # A transport poll (MPI_Testall, ~0.7 us) costs ~50 spin-loop pauses:
        # poll proportionally fewer times before yielding.
        self.transport_spin_count = max(1, spin // 64)
        self.arena = Arena(self.node_comm, self.config.slot_nbytes)
        self.ctl = control.new()
        node.init_control(self.ctl, self.arena, spin, self.config.timeout_s, AUTO_CODE,
                          self.config.small_max_nbytes, self.config.stream_stores)
        self._broken = None
        #: the exception a Python entry caught, until fail() raises it
        self.pending_error = None
        self._logged = set()
        self._algorithms = {}
        self._entries = {}
        self._world_transport = None
        self._recv_buf = None
        self._rail_transport = None
        self.transport_reason = "one node: no cross-node transport needed"
        if self.topo.node_count > 1:
            self._rail_transport, self.transport_reason = transports.select(
                self.config.transport, self.rail_comm, self.transport_spin_count,
                self.config.timeout_s)
            self.log_once(f"cross-node transport: {self._rail_transport.name} "
                          f"({self.transport_reason})")
        self._har2 = None
        self.entry, self.entry_cfunc = self._default_entry()
        self.gather = self._gather_entry()

    # -- entries --------------------------------------------------------------

    def _default_entry(self):
        """(entry, C address or 0) of an all-reduce with every argument at its default."""
        auto, auto_cfunc = self._auto_entry()
        self._entries["auto"] = auto
        if self.config.algorithm == "auto":
            return auto, auto_cfunc
        return self.entry_for(self.config.algorithm), 0

    def _auto_entry(self):
        """(entry, C address or 0) of algorithm "auto" on this topology."""
        topo = self.topo
        if topo.size == 1:
            return node.SOLO_STEP, node.SOLO_CFUNC
        if topo.node_count == 1:
            return node.ONE_NODE_STEP, node.ONE_NODE_CFUNC
        python = PyStep(self, "auto")
        if (topo.node_count == 2 and topo.uniform
                and isinstance(self._rail_transport, transports.TcpTransport)):
            self._har2 = self._algorithm("har_latency")
            return SizeSwitch(HAR2_STEP, self.config.har_latency_max_nbytes, python), 0
        return python, 0

    def entry_for(self, name):
        """The entry of algorithm ``name`` ("auto": the default one); a
        forced algorithm runs as a :class:`PyStep`."""
        entry = self._entries.get(name)
        if entry is None:
            if name not in ALLREDUCE:
                raise HarmpiArgumentError(
                    f"unknown algorithm {name!r}; choose 'auto' or one of {', '.join(ALLREDUCE)}")
            entry = node.SOLO_STEP if self.topo.size == 1 else PyStep(self, name)
            self._entries[name] = entry
        return entry

    def _gather_entry(self):
        if self.topo.node_count == 1 and self.topo.uniform:
            self._gather_table = HierAllgather(self).table  # kept alive: ctl holds its address
            return node.GATHER_STEP
        return HierAllgather(self)

    def run_python(self, fn, *args):
        """Run a Python algorithm as an entry: its HarmpiError becomes the
        status RAISED (fail() raises it again)."""
        try:
            fn(*args)
        except HarmpiError as exc:
            self.pending_error = exc
            return RAISED
        return 0

    @property
    def broken(self):
        """None, or why this context can no longer be used."""
        return self._broken

    @broken.setter
    def broken(self, why):
        self._broken = why
        if why is not None:
            # close the native entry point's gate: the Python path raises
            self.ctl[0]["gate"] = 0

    # -- pieces the algorithms ask for --------------------------------------

    def rail_transport(self):
        return self._rail_transport

    def world_transport(self):
        if self._world_transport is None:
            self._world_transport, _ = transports.select(self.config.transport, self.comm,
                                                         self.transport_spin_count,
                                                         self.config.timeout_s)
        return self._world_transport

    def rail_recv_buffer(self):
        if self._recv_buf is None:
            self._recv_buf = np.empty(self.config.slot_nbytes, dtype=np.uint8)
        return self._recv_buf

    @staticmethod
    def view(addr, nbytes):
        """A writable buffer over raw memory, for the transports."""
        return MPI.buffer.fromaddress(addr, nbytes) if nbytes else np.empty(0, np.uint8)

    def require_uniform(self, name):
        if not self.topo.uniform:
            raise HarmpiArgumentError(
                f"algorithm {name!r} needs every node to hold the same number of ranks; "
                f"nodes hold {list(self.topo.node_sizes)}. Use 'leader' or 'auto'.")
        if self.topo.node_count < 2:
            raise HarmpiArgumentError(
                f"algorithm {name!r} is a multi-node algorithm and this job runs on one node; "
                "use 'shm', 'shm_rsag' or 'auto' (or set HARMPI_RANKS_PER_NODE to split the host)")

    def log_once(self, message):
        if message not in self._logged:
            self._logged.add(message)
            if self.topo.rank == 0:
                log.info(message)
            else:
                log.debug(message)

    def allreduce_algorithm(self, name, nbytes):
        """The algorithm object for ``name`` ("auto" resolves by size and topology)."""
        if name == "auto":  # several nodes (one node: the compiled entry)
            topo = self.topo
            if not topo.uniform:
                self.log_once(f"allreduce: nodes hold {list(topo.node_sizes)} ranks (uneven); "
                              "using the leader algorithm")
                name = "leader"
            elif nbytes <= self.config.har_latency_max_nbytes:
                name = "har_latency"
            else:
                name = "har_bandwidth"
        return self._algorithm(name)

    def _algorithm(self, name):
        algo = self._algorithms.get(name)
        if algo is None:
            if name in ("shm", "shm_rsag") and self.topo.node_count > 1:
                raise HarmpiArgumentError(
                    f"algorithm {name!r} works inside one node; this job spans "
                    f"{self.topo.node_count} nodes. Use 'auto', 'har_latency', 'har_bandwidth' "
                    "or 'leader'.")
            algo = self._algorithms[name] = ALLREDUCE[name](self)
        return algo

    def stage_or_remember(self, call, addr, m, copy=True):
        """node.stage of one chunk (``copy=False``: only the meta check, the
        caller fills its slot later). A timeout raises at once; a
        disagreement inside the node is returned (else None): the algorithm
        then finishes its cross-node exchanges poisoned, so the other nodes
        fail too instead of waiting for this one, and raises in :meth:`settle`."""
        if copy:
            rc = node.stage(self.ctl, addr, m, call.nbytes, call.code, call.w)
        else:
            rc = node.stage_meta(self.ctl, m, call.nbytes, call.code, call.w)
        if rc == TIMEOUT:
            self.fail(rc, call)
        return self.error_state() if rc else None

    def settle(self, call, poisoned, local):
        """Post whether this rank's cross-node step failed, flag round, and
        raise on every rank if any rank of the node failed."""
        rc = node.publish_wait_status(self.ctl, 1 if poisoned else 0)
        if local is not None:
            self.fail(MISMATCH, call, state=local)
        if rc:
            self.fail(rc, call)

    def error_state(self):
        """The (peer, a, b) a failed compiled step left in the control block."""
        c = self.ctl[0]
        return int(c["err_peer"]), int(c["err_a"]), int(c["err_b"])

    # -- failures -----------------------------------------------------------

    def fail(self, rc, call, state=None):
        """Raise the exception for a step's status ``rc``; a timeout or a
        transport error also marks this context unusable (peers may have
        been left mid-collective). ``state``: an earlier :meth:`error_state`,
        when the algorithm went on (poisoned) after the failing step so its
        peers fail too."""
        try:
            self._raise(rc, call, state)
        except (HarmpiTimeoutError, HarmpiTransportError) as exc:
            self.broken = self.broken or str(exc)
            raise

    def raise_status(self, rc, x_addr, n, fmt, code, op):
        """fail() for a status returned by an entry (the API's one error path)."""
        self.fail(rc, Call(x_addr, n, fmt, code, op))

    def _raise(self, rc, call, state):
        if rc == RAISED:
            exc, self.pending_error = self.pending_error, None
            raise exc
        if rc in (RAIL_TIMEOUT, RAIL_FAILED) and self._har2 is not None:
            self._har2.raise_rail(rc, call)
        topo = self.topo
        who = f"rank {topo.rank} (node {topo.node_index}, local rank {topo.local_rank})"
        peer, a, b = state or self.error_state()
        peer_rank = topo.node_ranks[topo.node_index][peer]
        if rc == TIMEOUT:
            raise HarmpiTimeoutError(
                f"{who}: {call}: local rank {peer} (rank {peer_rank}) did not publish step {a} "
                f"within {self.config.timeout_s:g} s; its flag shows {b}. It crashed, hangs, or "
                "never called this collective (HARMPI_TIMEOUT_S sets the deadline); this "
                "context is unusable now.")
        if rc in (MISMATCH, POISONED):
            if rc == POISONED or b == kind.POISON:
                detail = ("the cross-node exchange saw a peer node pass a different size, dtype, "
                          "op or algorithm")
            else:
                detail = (f"this rank passes {call.nbytes} bytes (kind {call.describe_code()}), "
                          f"local rank {peer} (rank {peer_rank}) passes {a} bytes "
                          f"(kind {call.describe_code(b)})")
            raise HarmpiMismatchError(
                f"{who}: {call}: ranks disagree: {detail}. Every rank must pass a tensor of the "
                "same size and dtype, with the same op and algorithm, in the same order.")
        raise HarmpiError(f"{who}: {call}: unexpected step status {rc}")

    # -- teardown -----------------------------------------------------------

    def free(self):
        """Release the window, transports and communicators (collective).
        (The API detaches harmpi.native first.)"""
        for t in (self._rail_transport, self._world_transport):
            if t is not None:
                t.close()
        self._rail_transport = self._world_transport = None
        if not self.arena.freed:
            self.arena.free()
        for c in (self.node_comm, self.rail_comm):
            if c is not None and c != MPI.COMM_NULL:
                c.Free()
        self.node_comm = self.rail_comm = None
        self.broken = "finalized"
