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

import contextlib
import logging
import os
import signal
import threading

import numpy as np
from mpi4py import MPI

from . import control, copytune, dtypes, kind, node, owner, schedslice, sync, transports
from .algorithms import ALGORITHM_IDS, ALLREDUCE, HierAllgather
from .algorithms.alltoall import HierAlltoall, MpiAlltoall
from .algorithms.base import Call
from .algorithms.har_latency import HAR2_FINISH, HAR2_START, HAR2_STEP
from .config import Config
from .control import (
    ABANDONED,
    BUSY,
    INTERRUPTED,
    MISMATCH,
    OK,
    POISONED,
    RAIL_FAILED,
    RAIL_LATE,
    RAIL_TIMEOUT,
    RAISED,
    TIMEOUT,
    WRONG_THREAD,
)
from .errors import (
    HarmpiArgumentError,
    HarmpiError,
    HarmpiMismatchError,
    HarmpiTimeoutError,
    HarmpiTransportError,
)
from .shm import W_META, Arena
from .topology import agree, discover

__all__ = ["Context", "AUTO_CODE", "HeldSigint"]

log = logging.getLogger("harmpi")

#: kind word of an auto all-reduce, without its format
AUTO_CODE = kind.encode(op=kind.OP_SUM, coll=kind.COLL_ALLREDUCE, algo=ALGORITHM_IDS["auto"])

#: wait "spin": spin count of waits when every rank owns a core (~1 ms of polling)
SPIN_COUNT = 20000
#: wait "spin": spins before yielding when ranks outnumber cores (a spinning
#: waiter would hold the core its peer needs to arrive)
OVERSUBSCRIBED_SPIN_COUNT = 64
#: wait "auto", every rank with a core: a wait spins at least the floor and at
#: most the cap (ns) before it sleeps, twice the recent mean wait in between
#: (harmpi.sync): waking a sleeper costs tens of microseconds
SPIN_FLOOR_NS, SPIN_CAP_NS = 30_000, 300_000
#: wait "auto", ranks outnumber cores: a spinning waiter holds the core its
#: peer needs to arrive, so it spins only a few microseconds
OVERSUBSCRIBED_SPIN_NS = 3_000
#: wait "auto", ranks outnumber cores: after that spin, a wait polls with
#: sched_yield for this long before it sleeps (harmpi.sync: the yield window;
#: the core goes to a sibling rank, with no cross-CPU wake-up per step)
OVERSUBSCRIBED_YIELD_NS = 200_000
#: polls of a cross-node transport before it sleeps, wait "auto" (a poll is a
#: system call, ~1 us) and "sleep"
RAIL_SPIN_AUTO, RAIL_SPIN_SLEEP = 32, 1

_ITEMSIZE = tuple(f.itemsize for f in dtypes.FORMATS)


def _busy_look(ctl, policy):
    """(fd, buffer) for the waits' look at the host's run queue (policy
    auto: sync.host_busy), set in the control block; (None, None) when
    /proc/loadavg cannot be opened (the waits then never look)."""
    if policy != sync.WAIT_AUTO:
        return None, None
    try:
        fd = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None, None
    buf = np.zeros(64, np.uint8)
    c = ctl[0]
    c["wait_busy_buf"] = buf.ctypes.data
    c["wait_busy_cpus"] = os.cpu_count() or 1
    c["wait_busy_fd"] = fd + 1
    return fd, buf


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


def _must_match(config):
    """The settings every rank of a communicator must share (Config.must_match):
    they decide the topology, the transport, the arena's layout, which
    algorithm each call takes and whether a profile starts (ranks that
    differ would pair different steps, or hang in MPI with raw errors)."""
    return config.must_match()


class PyStep:
    """An all-reduce algorithm written in Python, behind the entry signature.
    ``name``: a forced algorithm, or "auto" (chosen per call by size)."""

    def __init__(self, ctx, name):
        self.ctx = ctx
        self.name = name
        self.code = kind.encode(op=kind.OP_SUM, coll=kind.COLL_ALLREDUCE,
                                algo=ALGORITHM_IDS[name])

    def __call__(self, ctl, x_addr, n, fmt):
        # auto's kind comes from the control block, as the compiled entries'
        # does (a refusal runs this entry with its own: Context.refuse)
        code = int(ctl[0]["auto_code"]) if self.name == "auto" else self.code
        call = Call(x_addr, n, fmt, code | fmt, "allreduce")
        try:
            algo = self.ctx.allreduce_algorithm(self.name, call.nbytes)
        except HarmpiArgumentError:
            raise  # decided by the topology, the same on every rank; nothing moved
        except (HarmpiError, KeyboardInterrupt) as exc:
            # a set-up inside the call (the flat ring's transport) failed on
            # this rank: its peers may be inside this call, so they must fail
            # too, not pair their step with this rank's next call
            self.ctx.setup_failed(call, exc)
            raise
        return self.ctx.run_python(algo.run, call)


class SizeSwitch:
    """A compiled entry up to ``max_nbytes``, another entry above."""

    def __init__(self, small, max_nbytes, large):
        self.small, self.max_nbytes, self.large = small, max_nbytes, large

    def __call__(self, ctl, x_addr, n, fmt):
        if n * _ITEMSIZE[fmt] <= self.max_nbytes:
            return self.small(ctl, x_addr, n, fmt)
        return self.large(ctl, x_addr, n, fmt)


def drain_wakeup(sigfd):
    """Read harmpi's signal wakeup pipe (non-blocking) empty: the signals
    its bytes stand for have been handled (-1: no pipe)."""
    if sigfd >= 0:
        with contextlib.suppress(OSError):  # BlockingIOError once empty
            while os.read(sigfd, 64):
                pass


class HeldSigint:
    """Hold Ctrl-C over a section that every rank must finish together (the
    blocking MPI calls of a set-up: a rank that left one half-way would hang
    its peers in theirs). Inside, Python's SIGINT handler is one that notes
    the signal; on leaving, the old handler is back and the byte the signal
    left in harmpi's wakeup pipe is drained (the next wait must not be
    interrupted by it); :meth:`deliver` then runs the old handler
    (KeyboardInterrupt) where the caller is ready for it. Only in the main
    thread (where Python runs signal handlers) and over a Python-level
    handler; otherwise nothing is held."""

    def __init__(self, sigfd):
        self.sigfd = sigfd
        self.old = None
        self.got = []

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            old = signal.getsignal(signal.SIGINT)
            if callable(old):
                self.old = old
                signal.signal(signal.SIGINT, lambda signum, frame: self.got.append(frame))
        return self

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
            if self.got:
                drain_wakeup(self.sigfd)
        return False

    def deliver(self):
        """Run the old handler if a SIGINT came while held (once)."""
        if self.got and self.old is not None:
            frame, self.got = self.got[0], []
            self.old(signal.SIGINT, frame)


class Context:
    """Everything harmpi keeps for one communicator."""

    #: name of the thread that made it, the only one whose calls run (harmpi.owner)
    owner_name = None

    def __init__(self, comm, config: Config | None = None, sigfd: int = -1):
        self.config = config or Config.from_env()
        self.comm = comm
        # one polled agreement before anything depends on the settings or on
        # every rank being here (a late rank fails here, not in a blocking split)
        agree(comm, self.config.timeout_s, "setting up harmpi on this communicator",
              _must_match(self.config))
        # the blocking calls of the set-up (splits, the window, the rails):
        # every rank is here now, so they complete unless one rank leaves
        # half-way; Ctrl-C waits for their end instead of making it leave
        # (the registry delivers it once the context is registered)
        self.held_sigint = HeldSigint(sigfd)
        with self.held_sigint:
            self._set_up(comm, sigfd)

    def _set_up(self, comm, sigfd):
        self.topo, self.node_comm, self.rail_comm = discover(comm, self.config.ranks_per_node)
        # set-ups made later, inside a call (the flat ring's transport), run on
        # harmpi's own duplicate: a rank that gives up on one leaves its pending
        # request there, where no other collective (the user's) can meet it
        self.setup_comm = comm.Dup() if self.topo.size > 1 else comm
        self.oversubscribed = _oversubscribed(comm)
        spin = self.config.spin_count
        if spin is None:
            spin = OVERSUBSCRIBED_SPIN_COUNT if self.oversubscribed else SPIN_COUNT
        self.spin_count = spin
        self.wait_policy = sync.WAIT_POLICIES[self.config.wait] if sync.HAS_FUTEX \
            else sync.WAIT_SPIN
        if self.oversubscribed:
            floor = cap = OVERSUBSCRIBED_SPIN_NS
        else:
            floor, cap = SPIN_FLOOR_NS, SPIN_CAP_NS
        # only auto yields (sleep means no spin at all; spin has its own loop)
        yield_ns = OVERSUBSCRIBED_YIELD_NS \
            if self.oversubscribed and self.wait_policy == sync.WAIT_AUTO else 0
        # A transport poll (MPI_Testall, ~0.7 us) costs ~50 spin-loop pauses:
        # poll proportionally fewer times before yielding (or sleeping).
        self.transport_spin_count = max(1, spin // 64)
        if self.wait_policy == sync.WAIT_AUTO:
            self.transport_spin_count = min(self.transport_spin_count, RAIL_SPIN_AUTO)
        elif self.wait_policy == sync.WAIT_SLEEP:
            self.transport_spin_count = RAIL_SPIN_SLEEP
        self.arena = Arena(self.node_comm, self.config.slot_nbytes)
        self.ctl = control.new()
        self._tune_state = np.zeros(copytune.STATE_WORDS, np.int64)  # read by local rank 0
        node.init_control(self.ctl, self.arena, spin, self.config.timeout_s, AUTO_CODE,
                          self.config.small_max_nbytes, self.config.stream_stores, sigfd,
                          self._tune_state, self.wait_policy, floor, cap, yield_ns)
        self.sched_slice = None
        self._busy_fd, self._busy_buf = _busy_look(self.ctl, self.wait_policy)
        self.sigfd = sigfd
        # the compiled waits name late ranks by communicator rank
        self._local_ranks = np.array(self.topo.node_ranks[self.topo.node_index], np.int64)
        self.ctl[0]["local_ranks"] = self._local_ranks.ctypes.data
        self.ctl[0]["rail_peer"] = -1
        self._broken = None
        self._gave_up = False  # the transports were told (_give_up)
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
        self._har2 = None
        self.entry, self.entry_cfunc = self._default_entry()
        self.gather = self._gather_entry()
        #: all-to-all: None on one node (the compiled steps of
        #: harmpi.algorithms.alltoall), else the algorithm object
        self.alltoall = self._alltoall_entry()
        #: the profile HARMPI_PROFILE / HARMPI_TRACE started (harmpi.profile)
        self.profile = None
        if self.config.profile or self.config.trace:
            from .profiling import Profile  # noqa: PLC0415 - only when profiling

            self.profile = Profile(self, trace=self.config.trace).start()
        # last (nothing after it can fail): a short scheduler slice for this
        # thread, so a woken wait preempts whatever took the core
        # (harmpi.schedslice); given back in free()
        us = self.config.sched_slice_us
        self.sched_slice = schedslice.hold(schedslice.DEFAULT_US if us is None else us) \
            if us != 0 else "off (HARMPI_SCHED_SLICE_US=0)"

    # -- entries --------------------------------------------------------------

    def _default_entry(self):
        """(entry, C address or 0) of an all-reduce with every argument at its default."""
        auto, auto_cfunc = self._auto_entry()
        self._entries["auto"] = auto
        if self.config.algorithm == "auto":
            return auto, auto_cfunc
        self.split = None
        return self.entry_for(self.config.algorithm), 0

    def _auto_entry(self):
        """(entry, C address or 0) of algorithm "auto" on this topology."""
        topo = self.topo
        #: (start, finish, max bytes) of the split-phase all-reduce (async
        #: calls, harmpi.node), or None: this topology has none
        self.split = None
        if topo.size == 1:
            return node.SOLO_STEP, node.SOLO_CFUNC
        if topo.node_count == 1:
            self.split = (node.ONE_NODE_START, node.ONE_NODE_FINISH, 1 << 62)
            return node.ONE_NODE_STEP, node.ONE_NODE_CFUNC
        python = PyStep(self, "auto")
        if (topo.node_count == 2 and topo.uniform
                and isinstance(self._rail_transport, transports.TcpTransport)):
            self._har2 = self._algorithm("har_latency")
            self.split = (HAR2_START, HAR2_FINISH,
                          min(self.config.har_latency_max_nbytes, self.config.slot_nbytes))
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

    def _alltoall_entry(self):
        if self.topo.node_count == 1:
            return None
        # on three or more nodes a disagreeing pair is seen by its two nodes
        # only; MPI_Ialltoallv's path checks every pair on every rank
        if self.topo.uniform and self.topo.node_count == 2:
            return HierAlltoall(self)
        return MpiAlltoall(self)

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
            self._give_up(self.broken or "interrupted (SIGINT) in a collective",
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
        c = self.ctl[0]
        if self.wait_policy == sync.WAIT_SPIN:
            why = "" if sync.HAS_FUTEX else " (no futex on this platform)"
            return f"spin: {self.spin_count} polls, then yield{why}{self._slice_note()}"
        if self.wait_policy == sync.WAIT_SLEEP:
            return "sleep: futex at once" + self._slice_note()
        now = max(0, sync.spin_budget(self.ctl.ctypes.data + control.WAIT_OFFSET))
        yields = f", yield {c['wait_yield'] // 1000} us" if c["wait_yield"] else ""
        busy = ""
        if c["wait_busy_fd"]:
            window = max(c["wait_yield"], sync.BUSY_YIELD_NS)
            busy = f"; on a busy host none, yield {window // 1000} us" + \
                (", as now" if c["wait_busy"] >= sync.BUSY_SCORE else "")
        return (f"auto: spin {c['wait_floor'] // 1000}-{c['wait_cap'] // 1000} us "
                f"(now {now // 1000} us{busy}){yields}, then futex{self._slice_note()}")

    def _slice_note(self) -> str:
        s = self.sched_slice
        if isinstance(s, int):
            # (the thread's first request stands for its later contexts)
            return f"; scheduler slice {schedslice.held_us(s)} us"
        return f"; own scheduler slice: {s}" if s else ""

    # -- pieces the algorithms ask for --------------------------------------

    def har2(self):
        """The compiled two-node all-reduce's algorithm (its rail is in the
        control block), or None on other topologies."""
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
        if isinstance(transport, transports.TcpTransport):
            transport.watch_signals(self.sigfd)
        return transport, reason

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
        if coll == kind.COLL_ALLTOALL and isinstance(self.alltoall, MpiAlltoall):
            # its peers meet in MPI on the set-up communicator, not in the flags
            try:
                if self.alltoall.refuse():
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
        self._refusing = True  # a give-up now tells the peers why (_give_up)
        try:
            self.fail(rc, Call(buf.ctypes.data, 1, dtypes.F64, code | dtypes.F64,
                               f"refusal of {kind.COLL_NAMES.get(coll, 'a collective')}"))
        except HarmpiError as exc:
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
        """Raise the exception for a step's status ``rc``. ``state``: an
        earlier :meth:`error_state`, when the algorithm went on (poisoned)
        after the failing step so its peers fail too.

        What the failure leaves behind decides what happens to the context:
        a timeout, a transport error, an interruption or a peer that gave up
        leave peers mid-collective, so this rank gives up on the node's
        flags too (node.abandon: every peer then fails at once) and the
        context is unusable. A disagreement is only survivable where every
        rank stops at the same flag round (see :meth:`_mismatch_is_clean`);
        anywhere else the step counters may now differ between ranks, so
        the context is unusable on every rank that raises."""
        try:
            self._raise(rc, call, state)
        except HarmpiMismatchError as exc:
            if rc == ABANDONED:  # a peer gave up after a disagreement (_abandoned_error)
                self._give_up(str(exc))
            elif not self._mismatch_is_clean(rc) or getattr(exc, "unclean", False):
                self._give_up(f"{exc} (after a disagreement across nodes or between "
                              "algorithms, the ranks' step counters may differ)",
                              node.CULPRIT_DISAGREED)
            raise
        except (HarmpiTimeoutError, HarmpiTransportError, KeyboardInterrupt) as exc:
            self._give_up(str(exc) or type(exc).__name__, getattr(exc, "culprit", -1))
            raise
        except HarmpiError as exc:
            if rc == ABANDONED:
                self._give_up(str(exc))
            raise

    def setup_failed(self, call, exc):
        """A set-up inside ``call`` failed on this rank: give up (every peer
        still in the call fails at once; this rank's later calls are refused)."""
        self._give_up(f"{call}: its set-up failed on this rank: {exc or type(exc).__name__}",
                      getattr(exc, "culprit", -1))

    def _give_up(self, why, culprit=-1):
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
            if isinstance(t, transports.TcpTransport):
                t.give_up(extra_ops)
            elif isinstance(t, (transports.MpiTransport, transports.VerbsTransport)):
                t.give_up()

    def close_transports(self):
        """Close the tcp rails (a local act, no collective); the mpi
        transport's communicator is left to MPI_Finalize."""
        for t in (self._rail_transport, self._world_transport):
            if isinstance(t, transports.TcpTransport):
                t.close()

    def _mismatch_is_clean(self, rc):
        """After a disagreement: may this context go on? Yes if every rank
        of this node ran the same collective with the same algorithm in the
        failed step (sizes or dtypes differed): then every one of them took
        the same failure path through the same flag rounds, and the node's
        step counters still agree; likewise on one node for any mix of the
        steps that stop at their first round. Otherwise ranks that ran
        different algorithms or collectives may have left after different
        rounds: the counters may differ, and only an unusable context is safe. (A disagreement a
        Python algorithm raised itself, RAISED, comes from exchanges every
        rank finishes: the flat ring, or uneven nodes' allgather check.)"""
        if rc == RAISED:
            return True
        parity = (int(self.ctl[0]["steps"]) - 1) & 1
        kinds = {int(line[W_META + 2 * parity + 1]) for line in self.arena.flags()}
        # (the kind POISON is posted only by an allgather whose rail exchange
        # disagreed: its rank ran an allgather)
        runs = {(f["coll"], f["algo"]) if f else (kind.COLL_ALLGATHER, 0)
                for f in map(kind.decode, kinds)}
        if len(runs) == 1:
            return True
        # On one node, the compiled steps (an auto, shm or shm_rsag
        # all-reduce, an allgather, an all-to-all) all leave at the first flag round of a
        # disagreement: a mix of them still stops every rank in that round.
        return self.topo.node_count == 1 and runs <= self._first_round_exits

    @property
    def _first_round_exits(self):
        ids = [ALGORITHM_IDS[n] for n in ("auto", "shm", "shm_rsag")]
        return ({(kind.COLL_ALLREDUCE, i) for i in ids}
                | {(kind.COLL_ALLGATHER, 0), (kind.COLL_ALLTOALL, 0)})

    def raise_status(self, rc, x_addr, n, fmt, code, op):
        """fail() for a status returned by an entry (the API's one error path)."""
        self.fail(rc, Call(x_addr, n, fmt, code, op))

    def _who(self):
        topo = self.topo
        return f"rank {topo.rank} (node {topo.node_index}, local rank {topo.local_rank})"

    def _raise(self, rc, call, state):
        if rc == RAISED:
            exc, self.pending_error = self.pending_error, None
            raise exc
        if rc in (RAIL_TIMEOUT, RAIL_FAILED, RAIL_LATE) and self._har2 is not None:
            self._har2.raise_rail(rc, call)
        if rc == BUSY and self.split_pending is not None:
            raise HarmpiError(
                f"{self._who()}: {call}: an async torch.distributed collective on this "
                "communicator was started and not yet waited for; call its work's wait() "
                "first (collectives on one communicator complete in order)")
        if rc == BUSY:
            raise HarmpiError(
                f"{self._who()}: {call}: another thread is inside a collective on this "
                "communicator; call harmpi's collectives on one communicator from one thread "
                "at a time (or give each thread its own communicator)")
        if rc == WRONG_THREAD:
            ended = self.ctl[0]["owner"] == owner.ENDED
            raise HarmpiError(f"{self._who()}: {call}: {owner.refusal(self.owner_name, ended)}")
        if rc == INTERRUPTED:
            raise KeyboardInterrupt(f"{self._who()}: {call}: interrupted while waiting; this "
                                    "context is unusable now")
        peer, a, b = state or self.error_state()
        if rc == ABANDONED:
            raise self._abandoned_error(call, peer, a, b)
        if rc == TIMEOUT:
            raise HarmpiTimeoutError(
                f"{self._who()}: {call}: local rank {peer} (rank {self._rank_of(peer)}) did not "
                f"publish step {a} within {self.config.timeout_s:g} s; its flag shows {b}. It "
                "crashed, hangs, or never called this collective (HARMPI_TIMEOUT_S sets the "
                "deadline); this context is unusable now.")
        if rc in (MISMATCH, POISONED):
            raise self._mismatch_error(call, rc, peer, a, b)
        raise HarmpiError(f"{self._who()}: {call}: unexpected step status {rc}")

    def _rank_of(self, local_rank):
        return self.topo.node_ranks[self.topo.node_index][local_rank]

    def _abandoned_error(self, call, peer, epoch, culprit):
        if self.broken is not None:  # refused at the entry: an earlier failure
            return HarmpiError(f"harmpi context is unusable: {self.broken}")
        gave_up = f"local rank {peer} (rank {self._rank_of(peer)})"
        if culprit == node.CULPRIT_INTERRUPTED:
            why = ("this rank was interrupted (SIGINT) while it waited" if peer ==
                   self.topo.local_rank else f"{gave_up} was interrupted (SIGINT) while it waited")
        elif culprit in (node.CULPRIT_REFUSED, node.CULPRIT_DISAGREED):
            # not a late rank: the ranks disagreed, and that rank said so at once
            why = (f"{gave_up} refused its own arguments to this call (its HarmpiArgumentError "
                   "says why) while a peer made it for real"
                   if culprit == node.CULPRIT_REFUSED else
                   f"{gave_up} saw the ranks disagree (another size, dtype, op, collective or "
                   "algorithm) and gave up")
            return HarmpiMismatchError(
                f"{self._who()}: {call}: step {epoch}: {why}. No rank completes this "
                "collective; this context is unusable now (the ranks' step counters may "
                "differ). Every rank must make the same calls, with the same sizes and dtypes, "
                "in the same order.")
        elif culprit == self.topo.rank:
            why = f"{gave_up} gave up waiting for this rank: it arrived after the deadline"
        elif culprit == self._rank_of(peer):
            why = f"{gave_up} did not arrive in time, and a peer gave up on it"
        elif culprit >= 0:
            why = f"{gave_up} gave up waiting for rank {culprit}"
        else:
            why = f"{gave_up} gave up (its transport failed, it timed out or was interrupted)"
        return HarmpiTimeoutError(f"{self._who()}: {call}: step {epoch}: {why}. No rank "
                                  "completes this collective (HARMPI_TIMEOUT_S sets the "
                                  "deadline); this context is unusable now.")

    def _mismatch_error(self, call, rc, peer, a, b):
        refused = None if rc == POISONED else kind.refused_coll(b)
        if refused is not None:
            return HarmpiMismatchError(
                f"{self._who()}: {call}: local rank {peer} (rank {self._rank_of(peer)}) refused "
                f"its own arguments to {refused} in this call (its HarmpiArgumentError says "
                "why), so no rank completes it. Every rank must make the same calls with "
                "arguments that pass the checks, in the same order.")
        if rc == POISONED or b == kind.POISON:
            detail = ("the cross-node exchange saw a peer node pass a different size, dtype, "
                      "op or algorithm, or refuse its own arguments")
        else:
            detail = (f"this rank passes {call.nbytes} bytes (kind {call.describe_code()}), "
                      f"local rank {peer} (rank {self._rank_of(peer)}) passes {a} bytes "
                      f"(kind {call.describe_code(b)})")
        return HarmpiMismatchError(
            f"{self._who()}: {call}: ranks disagree: {detail}. Every rank must pass a tensor "
            "of the same size and dtype, with the same op and algorithm, in the same order.")

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
            from .profiling import finish  # noqa: PLC0415

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
