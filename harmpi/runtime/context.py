"""One harmpi context per communicator: topology, arena, transports, entries.

Creating a context is collective over its communicator (it splits
communicators, allocates the shared window and connects the rails); so is
freeing it. When it is made, the context picks its *entries*, the one
thing a collective calls after its arguments are checked (harmpi.runtime.entries).
A non-zero status becomes an exception in one place, :meth:`Context.fail`
(harmpi.runtime.failures), which also marks the context unusable when the
failure may have left peers behind (timeouts, transport errors). How its
waits spin and sleep: harmpi.runtime.waits; Ctrl-C during its set-up:
harmpi.runtime.signals.
"""

from __future__ import annotations

import logging
import os

import numpy as np
from mpi4py import MPI

from .. import node, transports
from ..algorithms import ALGORITHM_IDS, ALLREDUCE, HierAllgather
from ..algorithms.alltoall import MpiAlltoall
from ..algorithms.base import Call
from ..base import control, copytune, dtypes, kind, sync
from ..base.arena import Arena
from ..base.control import MISMATCH, OK, POISONED, RAISED
from ..base.topology import agree, discover, dup_polled
from ..config import Config
from ..errors import HarmpiArgumentError, HarmpiError, HarmpiMismatchError
from ..platform import schedslice
from . import entries, failures, switches, waits
from .signals import HeldSigint, drain_wakeup

__all__ = ["Context", "AUTO_CODE"]

log = logging.getLogger("harmpi")

#: kind word of an auto all-reduce, without its format
AUTO_CODE = kind.encode(op=kind.OP_SUM, coll=kind.COLL_ALLREDUCE, algo=ALGORITHM_IDS["auto"])


class Context:
    """Everything harmpi keeps for one communicator."""

    #: name of the thread that made it, the only one whose calls run (harmpi.runtime.owner)
    owner_name = None

    def __init__(self, comm, config: Config | None = None, sigfd: int = -1):
        self.config = config or Config.from_env()
        self.comm = comm
        # one polled agreement before anything depends on the settings or on
        # every rank being here (a late rank fails here, not in a blocking split)
        # (Config.must_match: the settings that decide the topology, the
        # transport, the arena's layout, each call's algorithm and whether a
        # profile starts; ranks that differ would pair different steps)
        agree(comm, self.config.timeout_s, "setting up harmpi on this communicator",
              self.config.must_match())
        # the blocking calls of the set-up (splits, the window, the rails):
        # every rank is here now, so they complete unless one rank leaves
        # half-way; Ctrl-C waits for their end instead of making it leave
        # (the registry delivers it once the context is registered)
        self.held_sigint = HeldSigint(sigfd)
        with self.held_sigint:
            self._set_up(comm, sigfd)

    def _set_up(self, comm, sigfd):
        timeout_s = self.config.timeout_s
        self.topo, self.node_comm, self.rail_comm = discover(comm, self.config.ranks_per_node,
                                                             timeout_s)
        # set-ups made later, inside a call (the flat ring's transport), run on
        # harmpi's own duplicate: a rank that gives up on one leaves its pending
        # request there, where no other collective (the user's) can meet it
        self.setup_comm = dup_polled(comm, timeout_s, "setting up harmpi (its own "
                                     "communicator)") if self.topo.size > 1 else comm
        #: auto's size switches: the user's, else the cost model's for this
        #: topology (harmpi.runtime.switches; info()["model"])
        self.switches = switches.resolve(self.setup_comm, self.topo, self.config, timeout_s)
        self.thresholds = self.switches.thresholds
        self.oversubscribed = waits.oversubscribed(self.setup_comm, timeout_s)
        self.waits = w = waits.plan(self.config, self.oversubscribed)
        self.spin_count, self.wait_policy = w.spin_count, w.policy
        self.transport_spin_count = w.transport_spin_count
        self.arena = Arena(self.node_comm, self.config.slot_nbytes, timeout_s)
        self.ctl = control.new()
        self._tune_state = np.zeros(copytune.STATE_WORDS, np.int64)  # read by local rank 0
        node.init_control(self.ctl, self.arena, w.spin_count, self.config.timeout_s, AUTO_CODE,
                          self.thresholds.small_max_nbytes, self.config.stream_stores, sigfd,
                          self._tune_state, w.policy, w.floor_ns, w.cap_ns, w.yield_ns)
        self.sched_slice = None
        self._busy_fd, self._busy_buf = waits.busy_look(self.ctl, self.wait_policy)
        self.sigfd = sigfd
        # the compiled waits name late ranks by communicator rank
        self._local_ranks = np.array(self.topo.node_ranks[self.topo.node_index], np.int64)
        self.ctl[0]["local_ranks"] = self._local_ranks.ctypes.data
        self.ctl[0]["rail_peer"] = -1
        self._broken = None
        self._gave_up = False  # the transports were told (give_up)
        self._refusing = False  # inside refuse(): a give-up names the refusal
        #: the exception a Python entry caught, until fail() raises it
        self.pending_error = None
        #: a started split-phase all-reduce (harmpi.distributed's async work)
        self.split_pending = None
        self._logged = set()
        self._algorithms = {}
        self._entries = {}
        self._world_transport = None
        self._recv_buf = None
        self._rail_transport = None
        self.transport_reason = "one node: no cross-node transport needed"
        if self.topo.node_count > 1:
            self._rail_transport, self.transport_reason = self._open_transport(self.rail_comm)
            transports.announce(self._rail_transport.name, self.transport_reason,
                                self.topo.rank)
            # the Python rail steps call these from Python: load their
            # compiled forms now (numba's cache), not in the first collective
            kind.rail_tag(0, 0)
            node.part_bounds(0, 1, 0, 1)
            self.rail_recv_buffer()  # (its pages mapped here too)
        # numba's typing of an array argument imports numpy.ma at the first
        # call from Python (a Python entry's node.enter): import it now
        import numpy.ma  # noqa: F401, PLC0415 - a first-call cost paid in the set-up
        self._har2 = None
        self.entry, self.entry_cfunc = self._default_entry()
        self.gather, self._gather_table = entries.gather_entry(self)
        #: all-to-all: None on one node (the compiled steps of
        #: harmpi.algorithms.alltoall), else the algorithm object
        self.alltoall = entries.alltoall_entry(self)
        #: the profile HARMPI_PROFILE / HARMPI_TRACE started (harmpi.profile)
        self.profile = None
        if self.config.profile or self.config.trace:
            from ..record.breakdown import Profile  # noqa: PLC0415 - only when profiling

            self.profile = Profile(self, trace=self.config.trace).start()
        # last (nothing after it can fail): a short scheduler slice for this
        # thread, so a woken wait preempts whatever took the core
        # (harmpi.platform.schedslice); given back in free()
        us = self.config.sched_slice_us
        self.sched_slice = schedslice.hold(schedslice.DEFAULT_US if us is None else us) \
            if us != 0 else "off (HARMPI_SCHED_SLICE_US=0)"

    # -- entries --------------------------------------------------------------

    def _default_entry(self):
        """(entry, C address or 0) of an all-reduce with every argument at its default."""
        auto = entries.auto_entry(self)
        #: (start, finish, max bytes) of the split-phase all-reduce (async
        #: calls, harmpi.node), or None: this topology or algorithm has none
        self.split = auto.split
        if auto.har2:
            self._har2 = self._algorithm("har_latency")
        self._entries["auto"] = auto.entry
        if self.config.algorithm == "auto":
            return auto.entry, auto.cfunc
        self.split = None
        return self.entry_for(self.config.algorithm), 0

    def entry_for(self, name):
        """The entry of algorithm ``name`` ("auto": the default one); a
        forced algorithm runs as an entries.PythonEntry."""
        entry = self._entries.get(name)
        if entry is None:
            entry = self._entries[name] = entries.forced_entry(self, name)
        return entry

    def run_python(self, fn, *args):
        """Run a Python algorithm as an entry: refused like a compiled entry
        (node.enter), and its HarmpiError becomes the status RAISED (fail()
        raises it again)."""
        rc = node.enter(self.ctl)
        if rc != OK:
            return rc
        if self.ctl[0]["profile"]:
            call = args[0]
            node.begin(self.ctl, call.nbytes, call.code)
        try:
            fn(*args)
        except HarmpiError as exc:
            self.pending_error = exc
            return RAISED
        except KeyboardInterrupt:
            # Ctrl-C in Python code (the mpi transport's wait, say): give up
            # on the step here too, as a compiled wait does (node.interrupted),
            # so the peers fail at once and this rank's next call is refused
            self.pending_error = None
            return node.interrupted(self.ctl)
        finally:
            node.leave(self.ctl)
        return OK

    def interrupted(self):
        """Python raised KeyboardInterrupt around an entry (its signal
        handler runs when the compiled wait returns, possibly before the
        step's status reaches :meth:`fail`): if the step gave up
        (node.interrupted), finish giving up, so the rail peers are told;
        a step that completed leaves the context as it is.

        The signal is delivered now, so the byte it wrote into the wakeup
        pipe goes too. A compiled wait reads it, but a Python-level one (the
        mpi and verbs rails, the Python algorithms) is woken by Python's
        handler and leaves it, and the next compiled wait on any
        communicator would then see an interrupt that did not happen."""
        drain_wakeup(self.sigfd)
        if self.ctl[0]["abandoned"] and not self._gave_up:
            self.give_up(self.broken or "interrupted (SIGINT) in a collective",
                          node.CULPRIT_INTERRUPTED)

    def guard(self, call):
        """Raise (giving up) if a rank of this node gave up on the
        collective: called before each send to another node."""
        rc = node.peers_abandoned(self.ctl)
        if rc != OK:
            self.fail(rc, call)

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

    def wait_description(self) -> str:
        """How this context's waits spin and sleep (info()["wait"])."""
        return waits.describe(self.ctl, self.waits, self.sched_slice)

    # -- pieces the algorithms ask for --------------------------------------

    def har2(self):
        """The compiled rail all-reduce's algorithm (har_latency on two or
        more uniform nodes of a tcp rail; its rail is in the control block),
        or None on other topologies."""
        return self._har2

    def rail_transport(self):
        return self._rail_transport

    def world_transport(self):
        if self._world_transport is None:
            # a set-up inside a call (the flat ring's): its blocking calls
            # too hold Ctrl-C until every rank is through them, as the
            # context's own set-up does; the interrupt comes right after
            held = HeldSigint(self.sigfd)
            with held:
                self._world_transport, _ = self._open_transport(self.setup_comm)
            held.deliver()
        return self._world_transport

    def _open_transport(self, comm):
        """(transport, reason) over ``comm``, waiting as this context's waits do
        (naps past the spin budget unless HARMPI_WAIT=spin) and, over tcp,
        woken by Ctrl-C."""
        transport, reason = transports.select(self.config.transport, comm,
                                              self.transport_spin_count, self.config.timeout_s,
                                              self.config, self.topo.local_rank)
        transport.naps = self.wait_policy != sync.WAIT_SPIN
        transport.yield_ns = int(self.ctl[0]["wait_yield"])  # 0 unless auto, oversubscribed
        transport.wait_state = self.ctl.ctypes.data + control.WAIT_OFFSET
        transport.watch_signals(self.sigfd)
        return transport, reason

    def rail_recv_buffer(self):
        if self._recv_buf is None:
            # written now: its pages are mapped in the set-up, not in the first call
            self._recv_buf = np.empty(self.config.slot_nbytes, dtype=np.uint8)
            self._recv_buf.fill(0)
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
            elif nbytes <= self.thresholds.har_latency_max_nbytes:
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

    def _refused_in_mpi(self, coll):
        """The algorithm whose peers meet in MPI on the set-up communicator,
        not in the flags, for a refused ``coll`` (its refuse()), or None: the
        all-to-all MpiAlltoall runs, the allgather on uneven nodes."""
        if coll == kind.COLL_ALLTOALL and isinstance(self.alltoall, MpiAlltoall):
            return self.alltoall
        if coll == kind.COLL_ALLGATHER and isinstance(self.gather, HierAllgather) \
                and not self.gather.uniform:
            return self.gather
        return None

    def refuse(self, coll):
        """This rank refused its own arguments to a ``coll`` call
        (kind.COLL_*), before moving anything; its peers may be in that call.
        Take part in it anyway, as a one-element auto all-reduce of kind
        kind.refusal_code: a peer that called for real fails its call at its
        first flag round or rail exchange (a disagreement, naming this rank),
        and no rank's next call pairs with another's current one. Returns
        None when every rank refused (each raises its own error; the context
        goes on), else the error this part ended with; fail() decided, as
        for any disagreement, whether the context stays usable."""
        if self.topo.size == 1 or self.broken is not None:
            return None
        in_mpi = self._refused_in_mpi(coll)
        if in_mpi is not None:
            try:
                if in_mpi.refuse():
                    return None
            except HarmpiError as exc:
                return exc
            return HarmpiMismatchError("a peer made the call for real: it fails there")
        c = self.ctl[0]
        auto = int(c["auto_code"])
        code = kind.refusal_code(coll, auto)
        buf = np.zeros(1, np.float64)
        c["auto_code"] = code
        try:
            rc = self._entries["auto"](self.ctl, buf.ctypes.data, 1, dtypes.F64)
        except KeyboardInterrupt:
            self.interrupted()
            raise
        finally:
            c["auto_code"] = auto
        if rc == OK:
            return None
        self._refusing = True  # a give-up now tells the peers why (give_up)
        try:
            self.fail(rc, Call(buf.ctypes.data, 1, dtypes.F64, code | dtypes.F64,
                               f"refusal of {kind.COLL_NAMES.get(coll, 'a collective')}"))
        except HarmpiError as exc:
            if self.topo.node_count > 2 and not self._gave_up:
                # on three or more nodes this part met only its own partners
                # (recursive doubling): a peer whose real call waits for this
                # rank elsewhere (an allgather's exchange with every node)
                # must hear of it now, not at its deadline
                self.give_up(str(exc))
            return exc
        finally:
            self._refusing = False
        return None

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
        if rc not in (OK, MISMATCH):  # timed out, or a peer gave up: no going on
            self.fail(rc, call)
        return self.error_state() if rc else None

    def settle(self, call, poisoned, local):
        """Post whether this rank's cross-node step failed, flag round, and
        raise on every rank if any rank of the node failed."""
        rc = node.publish_wait_status(self.ctl, 1 if poisoned else 0)
        self.settle_status(rc, call, local)

    def settle_status(self, rc, call, local):
        """Raise for the last flag round of a step: its own failure first (a
        wait that failed leaves no step to report on), then the node's
        disagreement found earlier (``local``), then a peer's posted failure."""
        if rc not in (OK, POISONED):
            self.fail(rc, call)
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
        """Raise the exception for a step's status ``rc`` (failures.fail:
        giving up where the failure leaves peers behind). ``state``: an
        earlier :meth:`error_state`, when the algorithm went on poisoned."""
        failures.fail(self, rc, call, state)

    def setup_failed(self, call, exc):
        """A set-up inside ``call`` failed on this rank: give up (every peer
        still in the call fails at once; this rank's later calls are refused)."""
        self.give_up(f"{call}: its set-up failed on this rank: {exc or type(exc).__name__}",
                      getattr(exc, "culprit", -1))

    def give_up(self, why, culprit=-1):
        """Give up on the collective in progress: the node's peers (node.abandon)
        and the rail peers learn at once; the context is unusable."""
        if culprit == -1 and self._refusing:
            culprit = node.CULPRIT_REFUSED
        node.abandon(self.ctl, culprit)
        self.broken = self.broken or why
        self._gave_up = True
        # the rail peers learn at once: a notice after any data this rank
        # sent (so a peer that gets the data fails too), or a closed socket
        har2 = self._algorithms.get("har_latency")
        extra_ops = [har2.ops] if har2 is not None and har2.compiled else []
        for t in (self._rail_transport, self._world_transport):
            if t is not None:
                t.give_up(extra_ops)

    def close_transports(self):
        """Close the tcp rails (a local act, no collective); the mpi
        transport's communicator is left to MPI_Finalize."""
        for t in (self._rail_transport, self._world_transport):
            if t is not None:
                t.close_local()

    def raise_status(self, rc, x_addr, n, fmt, code, op):
        """fail() for a status returned by an entry (the API's one error path)."""
        self.fail(rc, Call(x_addr, n, fmt, code, op))

    # -- teardown -----------------------------------------------------------

    def _release_thread_waits(self):
        """What the waits hold outside MPI, for free() and leak(): their
        /proc/loadavg (they stop looking) and the thread's scheduler slice."""
        if self._busy_fd is not None:
            self.ctl[0]["wait_busy_fd"] = 0
            os.close(self._busy_fd)
            self._busy_fd = None
        schedslice.release(self.sched_slice)
        self.sched_slice = None

    def leak(self, why):
        """Give the context up without a collective (the ranks did not agree
        to free it, registry.release): close the tcp rails, leave the window
        and communicators to MPI_Finalize."""
        self.close_transports()
        self._release_thread_waits()
        self.broken = f"freed without a collective free ({why})"
        self.ctl[0]["abandoned"] = 1

    def free(self):
        """Release the window, transports and communicators (collective).
        (The API detaches harmpi.native first.)"""
        if self.profile is not None and self.broken is None:
            from ..record.breakdown import finish  # noqa: PLC0415

            finish(self.profile)
            self.profile = None
        for t in (self._rail_transport, self._world_transport):
            if t is not None:
                t.close()
        self._rail_transport = self._world_transport = None
        if not self.arena.freed:
            self.arena.free()
        for c in (self.node_comm, self.rail_comm,
                  self.setup_comm if self.setup_comm is not self.comm else None):
            if c is not None and c != MPI.COMM_NULL:
                c.Free()
        self.node_comm = self.rail_comm = self.setup_comm = None
        self._release_thread_waits()
        self.broken = "finalized"
