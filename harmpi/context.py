"""One harmpi context per communicator: topology, arena, transports, algorithms.

Creating a context is collective over its communicator (it splits
communicators and allocates the shared window); so is freeing it.
"""

from __future__ import annotations

import logging
import os

import numpy as np
from mpi4py import MPI

from . import node, transports
from .algorithms import ALGORITHM_IDS, ALLREDUCE, HierAllgather
from .algorithms.shm import ShmAllreduce
from .config import Config
from .errors import HarmpiArgumentError, HarmpiError, HarmpiMismatchError, HarmpiTimeoutError
from .shm import Arena
from .topology import discover

__all__ = ["Context"]

log = logging.getLogger("harmpi")

#: ids carried in the meta code (see algorithms.base.Call)
OP_SUM = 1
COLL_ALLREDUCE, COLL_ALLGATHER = 1, 2
#: meta code of an "auto" all-reduce, without its dtype bits
AUTO_ALLREDUCE_CODE = (ALGORITHM_IDS["auto"] << 8) | (COLL_ALLREDUCE << 16) | (OP_SUM << 20)

#: spins before yielding when ranks outnumber cores (a spinning waiter would
#: hold the core its peer needs to arrive)
OVERSUBSCRIBED_SPIN_COUNT = 64


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


class Context:
    """Everything harmpi keeps for one communicator."""

    def __init__(self, comm, config: Config | None = None):
        self.config = config or Config.from_env()
        self.comm = comm
        self.topo, self.node_comm, self.rail_comm = discover(comm, self.config.ranks_per_node)
        # Ranks of the node share the host's cores: decide spin vs yield from
        # how many of them there are (HARMPI_SPIN_COUNT overrides).
        # Count ranks per physical machine (the kernel's boot id, so that
        # "hosts" that are containers or network namespaces of one machine
        # count together) against the union of their allowed CPUs (each rank
        # may be bound to one core).
        mine = (_boot_id() or MPI.Get_processor_name(), frozenset(_cpus_allowed()))
        same = [cpus for key, cpus in comm.allgather(mine) if key == mine[0]]
        self.oversubscribed = len(same) > len(frozenset().union(*same))
        spin = self.config.spin_count
        if "HARMPI_SPIN_COUNT" not in os.environ and self.oversubscribed:
            spin = OVERSUBSCRIBED_SPIN_COUNT
        self.spin_count = spin
        # A transport poll (MPI_Testall, ~0.7 us) costs ~50 spin-loop pauses:
        # poll proportionally fewer times before yielding.
        self.transport_spin_count = max(1, spin // 64)
        self.arena = Arena(self.node_comm, self.config.slot_nbytes)
        self.ctl = node.new_ctl(self.arena, spin, self.config.timeout_s, AUTO_ALLREDUCE_CODE,
                                self.config.small_max_nbytes, self.config.stream_stores)
        self._broken = None
        #: whether harmpi.native serves this context (the API attaches it)
        self.native_attached = False
        #: auto on one node with peers: the API may call the shm kernel directly
        self.single_node_auto = (self.topo.node_count == 1 and self.topo.size > 1
                                 and self.config.algorithm == "auto")
        self._logged = set()
        self._allreduce = {}
        self._allgather = None
        self._rail_transport = None
        self._world_transport = None
        self._recv_buf = None
        if self.topo.node_count > 1:
            self._rail_transport, self.transport_reason = transports.select(
                self.config.transport, self.rail_comm, self.transport_spin_count,
                self.config.timeout_s)
            self.log_once(f"cross-node transport: {self._rail_transport.name} "
                          f"({self.transport_reason})")
        else:
            self.transport_reason = "one node: no cross-node transport needed"
        #: auto on two equal nodes over tcp: the API may run the compiled
        #: two-node step directly for sizes up to har_latency_max (else None)
        self.two_node_fast = None
        if (self.topo.node_count == 2 and self.topo.uniform and self.config.algorithm == "auto"
                and isinstance(self._rail_transport, transports.TcpTransport)):
            self.two_node_fast = self.allreduce_algorithm("har_latency", 0)
        self.har_latency_max_nbytes = self.config.har_latency_max_nbytes

    @property
    def broken(self):
        """None, or why this context can no longer be used."""
        return self._broken

    @broken.setter
    def broken(self, why):
        self._broken = why
        if why is not None:
            # close the native entry point's gate: the Python path raises
            self.ctl[node.C_NATIVE] = 0

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

    # -- choosing and running ----------------------------------------------

    def allreduce_algorithm(self, name, nbytes):
        """The algorithm object for ``name`` ("auto" resolves by size and topology)."""
        if name == "auto":
            topo = self.topo
            if topo.node_count == 1:
                name = "auto_shm"
            elif not topo.uniform:
                self.log_once(f"allreduce: nodes hold {list(topo.node_sizes)} ranks (uneven); "
                              "using the leader algorithm")
                name = "leader"
            elif nbytes <= self.config.har_latency_max_nbytes:
                name = "har_latency"
            else:
                name = "har_bandwidth"
        algo = self._allreduce.get(name)
        if algo is None:
            algo = self._allreduce[name] = self._make(name)
        return algo

    def _make(self, name):
        if name == "auto_shm":
            algo = ShmAllreduce(self)
            algo.small_max_nbytes = self.config.small_max_nbytes
            return algo
        cls = ALLREDUCE[name]
        if name in ("shm", "shm_rsag") and self.topo.node_count > 1:
            raise HarmpiArgumentError(
                f"algorithm {name!r} works inside one node; this job spans "
                f"{self.topo.node_count} nodes. Use 'auto', 'har_latency', 'har_bandwidth' "
                "or 'leader'.")
        return cls(self)

    def allgather_algorithm(self):
        if self._allgather is None:
            self._allgather = HierAllgather(self)
        return self._allgather

    def stage_or_remember(self, call, addr, m, copy=True):
        """node.stage of one chunk (``copy=False``: only the meta check, the
        caller fills its slot later). A timeout raises at once; a
        disagreement inside the node is returned (else None): the algorithm
        then finishes its cross-node exchanges poisoned, so the other nodes
        fail too instead of waiting for this one, and raises in :meth:`settle`."""
        if copy:
            rc = node.stage(self.ctl, addr, m, call.nbytes, call.code, call.fmt, call.w)
        else:
            rc = node.stage_meta(self.ctl, m, call.nbytes, call.code, call.fmt, call.w)
        if rc == node.TIMEOUT:
            self.fail(rc, call)
        return self.error_state() if rc else None

    def settle(self, call, poisoned, local):
        """Post whether this rank's cross-node step failed, flag round, and
        raise on every rank if any rank of the node failed."""
        rc = node.publish_wait_status(self.ctl, 1 if poisoned else 0)
        if local is not None:
            self.fail(node.MISMATCH, call, state=local)
        if rc:
            self.fail(rc, call, after_rail=True)

    def error_state(self):
        """The (peer, a, b) a failed compiled step left in ctl."""
        ctl = self.ctl
        return int(ctl[node.C_ERR_PEER]), int(ctl[node.C_ERR_A]), int(ctl[node.C_ERR_B])

    def fail(self, rc, call, rail_poison=False, after_rail=False, state=None):
        """Turn a compiled step's status into the right exception.

        ``state``: an earlier :meth:`error_state`, when the algorithm went on
        (in poisoned mode) after the failing step so its peers fail too.
        """
        topo = self.topo
        who = f"rank {topo.rank} (node {topo.node_index}, local rank {topo.local_rank})"
        peer, a, b = state or self.error_state()
        peer_rank = topo.node_ranks[topo.node_index][peer]
        if rc == node.TIMEOUT:
            self.broken = (f"{who}: {call}: local rank {peer} (rank {peer_rank}) did not publish "
                           f"step {a} within {self.config.timeout_s:g} s; its flag shows {b}")
            raise HarmpiTimeoutError(
                self.broken + ". It crashed, hangs, or never called this collective "
                "(HARMPI_TIMEOUT_S sets the deadline); this context is unusable now.")
        if rc == node.MISMATCH:
            if rail_poison or after_rail or b == node.POISON_CODE:
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
        (The API detaches harmpi.native first: _Contexts.free_all.)"""
        self.native_attached = False
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
