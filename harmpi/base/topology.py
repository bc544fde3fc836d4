"""Who is where: nodes, local ranks and rails, discovered once per communicator.

A *node* is the set of ranks that can share memory: MPI's
``COMM_TYPE_SHARED`` split. ``HARMPI_RANKS_PER_NODE=k`` cuts every such node
into *virtual nodes* of k consecutive local ranks, so a single host can
exercise every multi-node path. Nodes are numbered by their lowest rank.

A *rail* is the set of ranks with the same local rank on every node; the
cross-node step of the hierarchical algorithms runs on rails. On uneven nodes
(3 ranks as 2+1) some rails do not reach every node; algorithms that need
full rails check :attr:`Topology.uniform`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import time

import numpy as np
from mpi4py import MPI

from ..errors import HarmpiArgumentError, HarmpiMismatchError, HarmpiTimeoutError

__all__ = ["Topology", "discover", "arrive", "agree", "vote", "gather_records", "check_arrivals",
           "wait_polled", "allgather_polled", "barrier_polled", "dup_polled", "world_ranks",
           "LATE_FRACTION", "HOT_SPIN_S"]


#: bytes per rank in a set-up agreement: the arrival stamp, then the settings
_RECORD_NBYTES = 1024
#: an arrival later than this fraction of the deadline after the first one
#: fails on every rank (see :func:`agree`)
LATE_FRACTION = 0.75
#: wait_polled tests back to back this long before it starts to sleep
POLL_SPIN_S = 200e-6
#: and this long for a collective of the hot path (spin_s=HOT_SPIN_S): 4
#: virtual nodes x 1 on 2 vCPUs, MpiAlltoall (two polled collectives a
#: call), osu_alltoall medians, two runs each: at 200 us 4 KiB 677-685 us,
#: 64 KiB 1159-1163; at 1 ms 495-656, 844-849 (MPI_Alltoall 183-250,
#: 408-428); 5 ms no better. Not for set-up collectives: 1 ms there made
#: the oversubscribed MPI test jobs ~10% slower
HOT_SPIN_S = 1e-3
#: agreements this process gave up on: MPI may still complete them (a late
#: peer's contribution), so their buffers must outlive the request
_STRANDED = []


def arrive(comm, timeout_s, what):
    """Wait, with a deadline, until every rank of ``comm`` has reached this
    point, so that the blocking collectives of a set-up that follow cannot
    hang on a rank that never comes, or came too late (see :func:`agree`):
    that rank is reported as a HarmpiTimeoutError on every rank instead."""
    agree(comm, timeout_s, what)


def agree(comm, timeout_s, what, settings=()):
    """Check, with a deadline, that every rank of ``comm`` has arrived in
    time and holds the same ``settings`` ((variable, value) pairs that must
    match on every rank); collective. One MPI_Iallgather, polled.

    Why arrival stamps: a rank that gives up on a non-blocking collective
    cannot withdraw its part, so a rank that comes after that deadline still
    completes it, and would then go on alone into the blocking set-up calls
    that follow (MPI_Comm_split_type, ...) and hang there. So each rank also
    posts its arrival time (CLOCK_REALTIME), and the verdict comes from the
    gathered data alone, the same on every rank that gets it: ranks that
    arrived more than LATE_FRACTION * ``timeout_s`` after the first fail on
    every rank (HarmpiTimeoutError naming them), while a rank that is on
    time waits the whole ``timeout_s``, so it gets the data before it gives
    up unless MPI takes longer than the rest of the deadline to deliver it.

    Settings that differ raise HarmpiMismatchError on every rank, naming
    each variable and each rank's value."""
    if comm.Get_size() == 1:
        return
    stamps_ns, texts = gather_records(comm, timeout_s, what, settings)
    check_arrivals(comm, stamps_ns, timeout_s, what)
    _check_settings(comm, texts, what)


def vote(comm, timeout_s, what, healthy):
    """Whether every rank of ``comm`` may go on to a collective step that
    blocks (MPI_Win_free): ``(True, "")``, or ``(False, why)``; collective,
    one polled MPI_Iallgather (as :func:`agree`) of each rank's arrival
    time and ``healthy`` flag. The verdict comes from the gathered data
    alone (yes only if every rank is healthy and all arrived within
    LATE_FRACTION x ``timeout_s`` of the first), so every rank that gets
    the data decides the same; a rank that does not get it within
    ``timeout_s`` says no. A rank whose peers are all on time gets the data
    with at least a quarter of the deadline to spare, so a yes on one rank
    and a timeout on another needs MPI to take that long to deliver it."""
    if comm.Get_size() == 1:
        return healthy, "" if healthy else "broken on this rank"
    try:
        stamps_ns, texts = gather_records(comm, timeout_s, what,
                                           (("state", "healthy" if healthy else "broken"),))
        check_arrivals(comm, stamps_ns, timeout_s, what)
    except HarmpiTimeoutError as exc:
        return False, str(exc)
    broken = [r for r, t in enumerate(texts) if t != "state=healthy"]
    if broken:
        return False, (f"rank {comm.Get_rank()} of a communicator of {comm.Get_size()}: {what}: "
                       f"broken on rank{'s' if len(broken) > 1 else ''} "
                       f"{', '.join(map(str, broken[:16]))}{' ...' if len(broken) > 16 else ''} "
                       "(a failure there that the others may not have seen)")
    return True, ""


def gather_records(comm, timeout_s, what, settings):
    """(arrival stamps in ns, settings texts) of every rank: one polled
    MPI_Iallgather under ``timeout_s`` (HarmpiTimeoutError past it)."""
    size = comm.Get_size()
    mine = np.zeros(_RECORD_NBYTES, np.uint8)
    text = "\n".join(f"{name}={value}" for name, value in settings).encode()
    if len(text) > _RECORD_NBYTES - 8:
        raise HarmpiArgumentError(f"{what}: settings too long to agree on ({len(text)} bytes)")
    mine[8:8 + len(text)] = np.frombuffer(text, np.uint8)
    table = np.zeros((size, _RECORD_NBYTES), np.uint8)
    mine[:8].view(np.int64)[0] = time.time_ns()
    req = comm.Iallgather([mine, MPI.BYTE], [table, MPI.BYTE])
    wait_polled(comm, req, timeout_s, what, (mine, table))
    return (table[:, :8].copy().view(np.int64)[:, 0],
            [bytes(row[8:]).rstrip(b"\0").decode() for row in table])


def wait_polled(comm, req, timeout_s, what, buffers, spin_s=POLL_SPIN_S):
    """Poll the non-blocking collective ``req`` on ``comm`` until it
    completes, or raise HarmpiTimeoutError after ``timeout_s``. A request
    given up on stays with MPI (a late peer may still complete it), so it
    and its ``buffers`` are kept alive here, never handed back to a caller."""
    deadline = time.monotonic() + timeout_s
    # the first spin_s: MPI_Test back to back (giving the core away
    # between tests, for ranks that share it), then sleeps that double: a
    # sleep costs ~60 us here, which a collective of the hot path (the
    # all-to-all of more than two nodes) would otherwise pay every call
    spin_until = time.perf_counter() + spin_s
    pause = 1e-5
    while not req.Test():
        if time.perf_counter() < spin_until:
            os.sched_yield()
            continue
        if time.monotonic() > deadline:
            _STRANDED.append((req, buffers))
            raise HarmpiTimeoutError(
                f"rank {comm.Get_rank()} of a communicator of {comm.Get_size()}: {what}: the "
                f"other ranks did not arrive within {timeout_s:g} s (a rank never called the "
                "same harmpi collective, or called it with another algorithm; HARMPI_TIMEOUT_S "
                "sets the deadline)")
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)


# Set-up collectives that poll. A set-up's collectives are non-blocking ones
# polled with MPI_Test (and a sleep that releases the GIL) wherever MPI has a
# non-blocking form; only the communicator splits and the shared window
# block, and those release the GIL while they wait. Why: two threads of a
# rank setting up two communicators at once, across nodes, deadlocked until
# their deadline (2 virtual nodes x 2, about one run in five under load):
# faulthandler showed each node leader with one thread in the tcp rail's
# blocking comm.allgather and the other in its comm.allreduce, and mpi4py
# (4.1.2) holds the GIL while an object allreduce waits (measured: a main
# thread that sleeps 0.2 s in a loop did not run for the 2 s a peer took
# to arrive; allgather, bcast, barrier and Split release it). So the
# allreduce on rail A blocked its rank's thread on rail B, whose peer rank
# waited likewise: a cycle across ranks. A polled wait never holds the GIL
# and gives a rank that never comes a deadline instead of a hang.


def allgather_polled(comm, obj, timeout_s, what):
    """``comm.allgather(obj)`` (any picklable object) as two polled
    non-blocking collectives: the sizes, then the pickles."""
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    size = comm.Get_size()
    if size == 1:
        return [obj]
    mine = np.array([data.size], np.int64)
    counts = np.zeros(size, np.int64)
    req = comm.Iallgather([mine, MPI.INT64_T], [counts, MPI.INT64_T])
    wait_polled(comm, req, timeout_s, what, (mine, counts))
    ends = np.cumsum(counts)
    starts = ends - counts
    every = np.empty(max(1, int(ends[-1])), np.uint8)
    req = comm.Iallgatherv([data, MPI.BYTE],
                           [every, ([int(c) for c in counts], [int(d) for d in starts]), MPI.BYTE])
    wait_polled(comm, req, timeout_s, what, (data, every))
    return [pickle.loads(every[a:b].tobytes()) for a, b in zip(starts, ends)]  # noqa: S301 - peers' own


def barrier_polled(comm, timeout_s, what):
    """``comm.Barrier()`` as a polled MPI_Ibarrier."""
    if comm.Get_size() > 1:
        wait_polled(comm, comm.Ibarrier(), timeout_s, what, ())


def dup_polled(comm, timeout_s, what):
    """``comm.Dup()`` as a polled MPI_Comm_idup."""
    new, req = comm.Idup()
    wait_polled(comm, req, timeout_s, what, (new,))
    return new


def check_arrivals(comm, stamps_ns, timeout_s, what):
    first = int(stamps_ns.min())
    limit = LATE_FRACTION * timeout_s
    late = [r for r, t in enumerate(stamps_ns) if (int(t) - first) / 1e9 > limit]
    if late:
        shown = ", ".join(f"rank {r} by {(int(stamps_ns[r]) - first) / 1e9:.3g} s" for r in late)
        raise HarmpiTimeoutError(
            f"rank {comm.Get_rank()} of a communicator of {comm.Get_size()}: {what}: ranks "
            f"came too late ({shown} after the first; more than {limit:.3g} s = "
            f"{LATE_FRACTION:g} x the {timeout_s:g} s deadline): the first ranks may have "
            "given up already, so no rank sets this up (HARMPI_TIMEOUT_S sets the deadline)",
            culprit=late[0])


def _check_settings(comm, texts, what):
    tables = [dict(line.split("=", 1) for line in t.splitlines() if "=" in line) for t in texts]
    names = sorted(set().union(*tables))
    differ = []
    for name in names:
        values = [t.get(name, "(not sent)") for t in tables]
        if len(set(values)) > 1:
            by_value = {}
            for r, v in enumerate(values):
                by_value.setdefault(v, []).append(r)
            shown = "; ".join(f"{v!r} on rank{'s' if len(rs) > 1 else ''} "
                              f"{', '.join(map(str, rs[:8]))}{' ...' if len(rs) > 8 else ''}"
                              for v, rs in by_value.items())
            differ.append(f"{name}: {shown}")
    if differ:
        raise HarmpiMismatchError(
            f"rank {comm.Get_rank()} of a communicator of {comm.Get_size()}: {what}: settings "
            f"that must be the same on every rank differ: {' | '.join(differ)}. Set them alike "
            "on every rank (mpirun -x NAME exports a variable to every rank)")


@dataclasses.dataclass(frozen=True)
class Topology:
    """Immutable placement facts of one rank within one communicator."""

    rank: int                 #: rank in the communicator
    size: int                 #: size of the communicator
    node_index: int           #: 0 .. node_count-1, nodes ordered by lowest rank
    node_count: int
    local_rank: int           #: rank inside the node
    local_size: int           #: ranks on this node
    node_ranks: tuple         #: node_ranks[g][l] = communicator rank of local rank l of node g
    virtual: bool             #: nodes were cut by HARMPI_RANKS_PER_NODE
    hostname: str

    @functools.cached_property
    def node_sizes(self) -> tuple:
        return tuple(len(r) for r in self.node_ranks)

    @functools.cached_property
    def uniform(self) -> bool:
        """Every node has the same number of ranks (so every rail spans all nodes)."""
        return len(set(self.node_sizes)) == 1

    @property
    def is_leader(self) -> bool:
        return self.local_rank == 0


def world_ranks(comm, ranks=None):
    """The COMM_WORLD rank of each of ``ranks`` (default: every rank) of
    ``comm``, for errors that name ranks users know. The two groups it asks
    MPI for are freed again: a group never freed outlives its communicator
    (the tcp rail leaked its rail communicator's group this way, one per
    multi-node context: issue 35, finding 9)."""
    ranks = list(range(comm.Get_size())) if ranks is None else list(ranks)
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return MPI.Group.Translate_ranks(group, ranks, world)
    finally:
        group.Free()
        world.Free()


def discover(comm, ranks_per_node, timeout_s):
    """Return ``(topology, node_comm, rail_comm)`` for ``comm``; collective over ``comm``.

    ``node_comm`` holds the ranks of this (possibly virtual) node ordered by
    rank; ``rail_comm`` holds the ranks with this local rank, ordered by node.
    Its gathers poll under ``timeout_s``; the splits block (MPI has no
    non-blocking split).
    """
    if ranks_per_node is not None and ranks_per_node < 1:
        raise HarmpiArgumentError(f"ranks per node must be >= 1, got {ranks_per_node}")
    rank = comm.Get_rank()
    host_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    virtual = False
    if ranks_per_node is not None and ranks_per_node < host_comm.Get_size():
        node_comm = host_comm.Split(host_comm.Get_rank() // ranks_per_node, key=rank)
        host_comm.Free()
        virtual = True
    else:
        node_comm = host_comm
    local_rank = node_comm.Get_rank()
    members = tuple(allgather_polled(node_comm, rank, timeout_s, "finding this node's ranks"))
    # Every rank learns every node's member list; node order = lowest rank.
    all_members = allgather_polled(comm, members, timeout_s, "finding every node's ranks")
    node_ranks = tuple(sorted(set(all_members), key=lambda m: m[0]))
    node_index = node_ranks.index(members)
    rail_comm = comm.Split(local_rank, key=node_index)
    topo = Topology(
        rank=rank, size=comm.Get_size(), node_index=node_index, node_count=len(node_ranks),
        local_rank=local_rank, local_size=node_comm.Get_size(), node_ranks=node_ranks,
        virtual=virtual, hostname=MPI.Get_processor_name(),
    )
    return topo, node_comm, rail_comm
