"""Configuration read from the environment, once, into an immutable object.

Every knob has a default that suits an inference box; each can be overridden
by an environment variable so that launch scripts need no code changes.

=========================  =========  ==========================================
variable                   default    meaning
=========================  =========  ==========================================
HARMPI_TIMEOUT_S           60         deadline of every wait on a peer, seconds
HARMPI_WAIT                auto       how a rank waits for its peers: "auto"
                                      spins for a budget learned from recent
                                      waits, then sleeps until the peer wakes
                                      it (futex); "sleep" sleeps at once;
                                      "spin" polls and yields (cores reserved
                                      for the ranks, nothing else running)
HARMPI_SPIN_COUNT          (auto)     HARMPI_WAIT=spin: busy-poll iterations
                                      before yielding; auto: 20000, or 64 when
                                      ranks outnumber cores
HARMPI_SCHED_SLICE_US      (auto)     the scheduler slice (µs) asked for on the
                                      thread that runs the collectives, so a
                                      woken rank preempts other work at once
                                      (Linux 6.12+; harmpi.platform.schedslice); auto:
                                      100, 0: the thread's own slice
HARMPI_SLOT_BYTES          1048576    bytes per rank per buffer in the node arena;
                                      larger tensors are processed in chunks
HARMPI_SMALL_MAX_BYTES     (model)    up to this size on one node every rank sums
                                      all slots; above it, reduce-scatter+allgather;
                                      unset: where the cost model says the two
                                      cross for the node's L (harmpi.algorithms.model)
HARMPI_HAR_LATENCY_MAX_BYTES (model)  up to this size across nodes the full tensor
                                      crosses the rail; above it, only 1/L of it;
                                      unset: the cost model's crossover for L, N
HARMPI_MODEL_FILE          (cache)    the cost model's constants (python -m
                                      harmpi.tune writes them); default: the
                                      per-user, per-host file of
                                      harmpi.algorithms.model_file
HARMPI_ALGORITHM           auto       force an all-reduce algorithm by name
HARMPI_TRANSPORT           auto       cross-node transport: auto, tcp, mpi or verbs
HARMPI_RANKS_PER_NODE      (unset)    split each host into virtual nodes of k
                                      consecutive ranks (testing multi-node paths)
HARMPI_STREAM_STORES       auto       how data moves through the shared slots:
                                      "on" (streaming stores), "off" (plain),
                                      "flush" (plain, readers flush what they
                                      read), "auto" (measured per size, see
                                      copytune)
HARMPI_NATIVE              1          0: harmpi.allreduce(t) never takes the
                                      native entry point (harmpi.native)
HARMPI_LOGITS_ROUTE        auto       gather_logits: "allgather", "allreduce"
                                      or "auto" (by topology and size, below)
HARMPI_LOGITS_ALLREDUCE_MAX_BYTES     auto: on several nodes, results up to
                           196608     this size take the allreduce route
                                      (measured: harmpi.logits)
HARMPI_ABORT_ON_EXCEPTION  1          under an MPI launcher, an uncaught exception
                                      on one rank ends the whole job (MPI_Abort,
                                      harmpi.failfast); 0: the old behaviour
HARMPI_PROFILE             0          1: profile every collective (harmpi.profile);
                                      rank 0 prints the summary at finalize
HARMPI_PROFILE_RECORDS     16384      profiling: the ring of records kept per
                                      rank (older calls only in the aggregates)
HARMPI_TRACE               (unset)    profiling: write a Chrome trace to this
                                      file at finalize (turns profiling on)
HARMPI_IB_DEVICE           (first)    verbs transport: RDMA device name; a comma
                                      list gives local rank l entry l % len
HARMPI_IB_PORT             (first     verbs transport: port number (comma list
                           ACTIVE)    per local rank as above)
HARMPI_IB_GID_INDEX        (RoCE v2)  verbs transport: GID index (comma list per
                                      local rank); default: a RoCE v2 GID where
                                      the link layer is Ethernet, none (LID) on
                                      InfiniBand
=========================  =========  ==========================================
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os

from .errors import HarmpiArgumentError

__all__ = ["Config", "ALGORITHMS", "ALGORITHM_IDS", "ALGORITHM_NAMES", "TRANSPORTS"]

#: All-reduce algorithms by name. "auto" picks among them by size and topology.
ALGORITHMS = ("shm", "shm_rsag", "har_latency", "har_bandwidth", "leader", "flat_ring")
#: small integers carried in the meta code (harmpi.base.kind), so ranks that forced
#: different algorithms are told so instead of deadlocking (harmpi.algorithms
#: checks that its ALLREDUCE table lists ALGORITHMS in this order)
ALGORITHM_IDS = {"auto": 0, **{name: i + 1 for i, name in enumerate(ALGORITHMS)}}
ALGORITHM_NAMES = {i: name for name, i in ALGORITHM_IDS.items()}
TRANSPORTS = ("auto", "tcp", "mpi", "verbs")
STREAM_STORES = ("auto", "on", "off", "flush")
LOGITS_ROUTES = ("auto", "allgather", "allreduce")
WAITS = ("auto", "sleep", "spin")
#: the longest deadline accepted (a year; the compiled waits count nanoseconds in an int64)
MAX_TIMEOUT_S = 365 * 86400.0
_SWITCH = {"on": True, "1": True, "yes": True, "true": True,
           "off": False, "0": False, "no": False, "false": False}


def _int(env, name, default, minimum):
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(float(raw)) if "e" in raw.lower() else int(raw, 0)
    except ValueError:
        raise HarmpiArgumentError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise HarmpiArgumentError(f"{name}={value} must be >= {minimum}")
    return value


def _timeout(env, name, default):
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise HarmpiArgumentError(f"{name}={raw!r} is not a number of seconds") from None
    return check_timeout(value, f"{name}={raw.strip()!r}")


def check_timeout(value, what):
    """``value`` if it is a usable deadline in seconds, else a
    HarmpiArgumentError naming ``what`` (the variable or field and its value).
    Every wait of harmpi has a deadline: there is no "never"."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise HarmpiArgumentError(f"{what}: the deadline must be a number of seconds, "
                                  f"got {type(value).__name__}")
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise HarmpiArgumentError(
            f"{what}: the deadline must be a finite number of seconds > 0 and <= "
            f"{MAX_TIMEOUT_S:g} (one year); every harmpi wait has a deadline, so there is "
            "no infinite one: pick a large finite value instead")
    return float(value)


def _list(env, name, conv, minimum=None):
    """A comma list (per local rank) of ``conv`` values; () when unset."""
    raw = (env.get(name) or "").strip()
    if not raw:
        return ()
    out = []
    for item in raw.split(","):
        item = item.strip()
        try:
            value = conv(item)
        except ValueError:
            raise HarmpiArgumentError(f"{name}={raw!r}: {item!r} is not valid") from None
        if minimum is not None and value < minimum:
            raise HarmpiArgumentError(f"{name}={raw!r}: {value} must be >= {minimum}")
        out.append(value)
    return tuple(out)


def _check_switch(name, value):
    """An auto switch: a number of bytes >= 0, or None (the cost model's)."""
    if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool)
                              or value < 0):
        raise HarmpiArgumentError(f"{name}={value!r}: a number of bytes >= 0, or None "
                                  "(unset: the cost model chooses)")


def _or_model(nbytes):
    """A switch's value as ranks compare it: unset means the cost model's
    (every rank then takes rank 0's model: harmpi.runtime.context)."""
    return "unset (cost model)" if nbytes is None else nbytes


def _switch(env, name, default):
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = _SWITCH.get(raw.strip().lower())
    if value is None:
        raise HarmpiArgumentError(f"{name}={raw!r}: choose on or off")
    return value


@dataclasses.dataclass(frozen=True)
class Config:
    """Tunables of one harmpi context (see the module docstring)."""

    timeout_s: float = 60.0
    #: how waits spin and sleep: auto, sleep or spin (harmpi.base.sync)
    wait: str = "auto"
    #: wait "spin": None: 20000, or 64 when ranks outnumber cores (harmpi.runtime.context)
    spin_count: int | None = None
    #: the collectives' thread's scheduler slice (µs): None auto (100), 0 off
    #: (harmpi.platform.schedslice)
    sched_slice_us: int | None = None
    slot_nbytes: int = 1 << 20
    #: one node: shm up to this size, shm_rsag above; None: the cost model's
    #: crossover for the context's topology (harmpi.runtime.context)
    small_max_nbytes: int | None = None
    #: equal nodes: har_latency up to this size, har_bandwidth above; None: the model's
    har_latency_max_nbytes: int | None = None
    #: the cost model's constants file (None: the per-user, per-host default;
    #: harmpi.algorithms.model_file); read by rank 0 of each communicator
    model_file: str | None = None
    algorithm: str = "auto"
    transport: str = "auto"
    ranks_per_node: int | None = None
    stream_stores: str = "auto"
    native: bool = True
    #: gather_logits route: auto, allgather or allreduce (harmpi.logits)
    logits_route: str = "auto"
    #: auto on several nodes: the allreduce route up to this many result bytes
    logits_allreduce_max_nbytes: int = 192 << 10
    #: under a launcher, an uncaught exception aborts the job (harmpi.failfast;
    #: read at import, and from the world context's config when it fails)
    abort_on_exception: bool = True
    #: profile every collective from the context's creation (harmpi.profile)
    profile: bool = False
    #: records kept per rank while profiling (a ring; the rest is aggregated)
    profile_records: int = 16384
    #: a file to write the profile's Chrome trace to at finalize (None: none)
    trace: str | None = None
    #: verbs transport: device, port and GID index, per local rank (an entry
    #: each, cycled); empty: first device with an ACTIVE port, RoCE v2 GID
    ib_devices: tuple = ()
    ib_ports: tuple = ()
    ib_gid_indexes: tuple = ()

    def __post_init__(self):
        check_timeout(self.timeout_s, f"timeout_s={self.timeout_s!r}")
        if self.algorithm != "auto" and self.algorithm not in ALGORITHMS:
            raise HarmpiArgumentError(
                f"HARMPI_ALGORITHM (Config.algorithm)={self.algorithm!r}: unknown algorithm; "
                f"choose auto or one of {', '.join(ALGORITHMS)}")
        if self.transport not in TRANSPORTS:
            raise HarmpiArgumentError(
                f"HARMPI_TRANSPORT (Config.transport)={self.transport!r}: unknown transport; "
                f"choose one of {', '.join(TRANSPORTS)}")
        if self.stream_stores not in STREAM_STORES:
            raise HarmpiArgumentError(
                f"HARMPI_STREAM_STORES={self.stream_stores!r}: choose one of "
                f"{', '.join(STREAM_STORES)}")
        if self.logits_route not in LOGITS_ROUTES:
            raise HarmpiArgumentError(
                f"HARMPI_LOGITS_ROUTE={self.logits_route!r}: choose one of "
                f"{', '.join(LOGITS_ROUTES)}")
        if self.wait not in WAITS:
            raise HarmpiArgumentError(
                f"HARMPI_WAIT={self.wait!r}: choose one of {', '.join(WAITS)}")
        if self.spin_count is not None and self.spin_count < 0:
            raise HarmpiArgumentError(f"HARMPI_SPIN_COUNT (Config.spin_count)={self.spin_count} "
                                      "must be >= 0 (or None: auto)")
        if self.sched_slice_us is not None and self.sched_slice_us != 0 and not (
                100 <= self.sched_slice_us <= 100_000):
            raise HarmpiArgumentError(
                f"HARMPI_SCHED_SLICE_US (Config.sched_slice_us)={self.sched_slice_us}: the "
                "kernel takes a slice of 100 to 100000 us; 0 keeps the thread's own, "
                "auto (None) asks for 100")
        _check_switch("HARMPI_SMALL_MAX_BYTES (Config.small_max_nbytes)", self.small_max_nbytes)
        _check_switch("HARMPI_HAR_LATENCY_MAX_BYTES (Config.har_latency_max_nbytes)",
                      self.har_latency_max_nbytes)
        if self.slot_nbytes % 64:
            raise HarmpiArgumentError(
                f"HARMPI_SLOT_BYTES (Config.slot_nbytes)={self.slot_nbytes}: the slot size "
                "must be a multiple of 64 bytes")

    def must_match(self) -> tuple:
        """(variable, value) of the settings every rank of a communicator
        must share, compared when a context is set up (topology.agree: a
        difference fails at once on every rank, naming the variable and each
        rank's value). They decide the topology, the transport, the arena's
        layout and which algorithm each call takes (ranks that differ would
        pair different steps, or hang in MPI with raw errors), and whether
        the set-up and the finalize run a profile's collective steps (ranks
        that differ used to wait out the deadline in them, unnamed). Only
        whether HARMPI_TRACE is set must match: rank 0 writes the trace."""
        profiling = "on" if self.profile or self.trace else "off"
        return (("HARMPI_RANKS_PER_NODE", self.ranks_per_node or "unset"),
                ("HARMPI_TRANSPORT", self.transport),
                ("HARMPI_ALGORITHM", self.algorithm),
                ("HARMPI_SLOT_BYTES", self.slot_nbytes),
                ("HARMPI_SMALL_MAX_BYTES", _or_model(self.small_max_nbytes)),
                ("HARMPI_HAR_LATENCY_MAX_BYTES", _or_model(self.har_latency_max_nbytes)),
                ("HARMPI_LOGITS_ROUTE", self.logits_route),
                ("HARMPI_LOGITS_ALLREDUCE_MAX_BYTES", self.logits_allreduce_max_nbytes),
                ("HARMPI_PROFILE or HARMPI_TRACE (profiling)", profiling),
                ("HARMPI_TRACE", "set" if self.trace else "unset"))

    @classmethod
    def from_env(cls, env=None) -> "Config":
        env = os.environ if env is None else env
        rpn = env.get("HARMPI_RANKS_PER_NODE")
        return cls(
            timeout_s=_timeout(env, "HARMPI_TIMEOUT_S", cls.timeout_s),
            wait=(env.get("HARMPI_WAIT") or "auto").strip().lower(),
            spin_count=_int(env, "HARMPI_SPIN_COUNT", cls.spin_count, 0),
            sched_slice_us=None if (env.get("HARMPI_SCHED_SLICE_US") or "auto").strip().lower()
            == "auto" else _int(env, "HARMPI_SCHED_SLICE_US", None, 0),
            slot_nbytes=_int(env, "HARMPI_SLOT_BYTES", cls.slot_nbytes, 64),
            small_max_nbytes=_int(env, "HARMPI_SMALL_MAX_BYTES", None, 0),
            har_latency_max_nbytes=_int(env, "HARMPI_HAR_LATENCY_MAX_BYTES", None, 0),
            model_file=(env.get("HARMPI_MODEL_FILE") or "").strip() or None,
            algorithm=(env.get("HARMPI_ALGORITHM") or "auto").strip().lower(),
            transport=(env.get("HARMPI_TRANSPORT") or "auto").strip().lower(),
            ranks_per_node=None if rpn in (None, "") else _int(env, "HARMPI_RANKS_PER_NODE", 0, 1),
            stream_stores=(env.get("HARMPI_STREAM_STORES") or "auto").strip().lower(),
            native=_switch(env, "HARMPI_NATIVE", cls.native),
            logits_route=(env.get("HARMPI_LOGITS_ROUTE") or "auto").strip().lower(),
            logits_allreduce_max_nbytes=_int(env, "HARMPI_LOGITS_ALLREDUCE_MAX_BYTES",
                                             cls.logits_allreduce_max_nbytes, 0),
            abort_on_exception=_switch(env, "HARMPI_ABORT_ON_EXCEPTION", cls.abort_on_exception),
            profile=_switch(env, "HARMPI_PROFILE", cls.profile),
            profile_records=_int(env, "HARMPI_PROFILE_RECORDS", cls.profile_records, 0),
            trace=env.get("HARMPI_TRACE") or None,
            ib_devices=_list(env, "HARMPI_IB_DEVICE", str),
            ib_ports=_list(env, "HARMPI_IB_PORT", int, 1),
            ib_gid_indexes=_list(env, "HARMPI_IB_GID_INDEX", int, 0),
        )
