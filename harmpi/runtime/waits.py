"""How a context's waits spin, yield and sleep (HARMPI_WAIT, HARMPI_SPIN_COUNT).

A wait first spins (cheapest wake-up, but it holds the core), then, with
policy auto, may yield the core for a while, then sleeps on a futex. How
long each phase lasts depends on whether the ranks of this machine
outnumber its cores: then a spinning waiter holds the core its peer needs
to arrive. The compiled waits read the plan from the control block
(harmpi.node.init_control); the cross-node transports get their own poll
count (a poll is a system call).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from mpi4py import MPI

from ..base import control, sync
from ..base.topology import allgather_polled
from ..platform import schedslice
from ..platform.machine import boot_id

__all__ = ["WaitPlan", "plan", "busy_look", "oversubscribed", "describe", "SPIN_COUNT",
           "OVERSUBSCRIBED_SPIN_COUNT", "SPIN_FLOOR_NS", "SPIN_CAP_NS", "OVERSUBSCRIBED_SPIN_NS",
           "OVERSUBSCRIBED_YIELD_NS", "RAIL_SPIN_AUTO", "RAIL_SPIN_SLEEP"]

#: wait "spin": spin count of waits when every rank owns a core (~1 ms of polling)
SPIN_COUNT = 20000
#: wait "spin": spins before yielding when ranks outnumber cores (a spinning
#: waiter would hold the core its peer needs to arrive)
OVERSUBSCRIBED_SPIN_COUNT = 64
#: wait "auto", every rank with a core: a wait spins at least the floor and at
#: most the cap (ns) before it sleeps, twice the recent mean wait in between
#: (harmpi.base.sync): waking a sleeper costs tens of microseconds
SPIN_FLOOR_NS, SPIN_CAP_NS = 30_000, 300_000
#: wait "auto", ranks outnumber cores: a spinning waiter holds the core its
#: peer needs to arrive, so it spins only a few microseconds
OVERSUBSCRIBED_SPIN_NS = 3_000
#: wait "auto", ranks outnumber cores: after that spin, a wait polls with
#: sched_yield for this long before it sleeps (harmpi.base.sync: the yield window;
#: the core goes to a sibling rank, with no cross-CPU wake-up per step)
OVERSUBSCRIBED_YIELD_NS = 200_000
#: polls of a cross-node transport before it sleeps, wait "auto" (a poll is a
#: system call, ~1 us) and "sleep"
RAIL_SPIN_AUTO, RAIL_SPIN_SLEEP = 32, 1


@dataclasses.dataclass(frozen=True)
class WaitPlan:
    """The waits of one context, as the control block and transports take them."""

    #: sync.WAIT_SPIN / WAIT_AUTO / WAIT_SLEEP
    policy: int
    #: wait "spin": polls before yielding
    spin_count: int
    #: wait "auto": spin between floor and cap (ns), then yield this long (ns)
    floor_ns: int
    cap_ns: int
    yield_ns: int
    #: polls of a cross-node transport before it yields or sleeps
    transport_spin_count: int


def plan(config, crowded: bool) -> WaitPlan:
    """The waits for ``config`` (HARMPI_WAIT, HARMPI_SPIN_COUNT), ``crowded``:
    whether the ranks of this machine outnumber its cores (:func:`oversubscribed`)."""
    spin = config.spin_count
    if spin is None:
        spin = OVERSUBSCRIBED_SPIN_COUNT if crowded else SPIN_COUNT
    policy = sync.WAIT_POLICIES[config.wait] if sync.HAS_FUTEX else sync.WAIT_SPIN
    floor = cap = OVERSUBSCRIBED_SPIN_NS
    if not crowded:
        floor, cap = SPIN_FLOOR_NS, SPIN_CAP_NS
    # only auto yields (sleep means no spin at all; spin has its own loop)
    yield_ns = OVERSUBSCRIBED_YIELD_NS if crowded and policy == sync.WAIT_AUTO else 0
    # A transport poll (MPI_Testall, ~0.7 us) costs ~50 spin-loop pauses:
    # poll proportionally fewer times before yielding (or sleeping).
    rail_spin = max(1, spin // 64)
    if policy == sync.WAIT_AUTO:
        rail_spin = min(rail_spin, RAIL_SPIN_AUTO)
    elif policy == sync.WAIT_SLEEP:
        rail_spin = RAIL_SPIN_SLEEP
    return WaitPlan(policy, spin, floor, cap, yield_ns, rail_spin)


def busy_look(ctl, policy):
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


def _cpus_allowed():
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def oversubscribed(comm, timeout_s):
    """Whether the ranks on this physical machine outnumber its cores.
    Ranks count together by the kernel's boot id (so "hosts" that are
    containers or network namespaces of one machine count together),
    against the union of their allowed CPUs (each rank may be bound to one)."""
    mine = (boot_id() or MPI.Get_processor_name(), frozenset(_cpus_allowed()))
    every = allgather_polled(comm, mine, timeout_s, "counting the ranks on this machine")
    same = [cpus for key, cpus in every if key == mine[0]]
    return len(same) > len(frozenset().union(*same))


def describe(ctl, waits: WaitPlan, sched_slice) -> str:
    """How a context's waits spin and sleep (info()["wait"])."""
    c = ctl[0]
    if waits.policy == sync.WAIT_SPIN:
        why = "" if sync.HAS_FUTEX else " (no futex on this platform)"
        return f"spin: {waits.spin_count} polls, then yield{why}{_slice_note(sched_slice)}"
    if waits.policy == sync.WAIT_SLEEP:
        return "sleep: futex at once" + _slice_note(sched_slice)
    now = max(0, sync.spin_budget(ctl.ctypes.data + control.WAIT_OFFSET))
    yields = f", yield {c['wait_yield'] // 1000} us" if c["wait_yield"] else ""
    busy = ""
    if c["wait_busy_fd"]:
        window = max(c["wait_yield"], sync.BUSY_YIELD_NS)
        busy = f"; on a busy host none, yield {window // 1000} us" + \
            (", as now" if c["wait_busy"] >= sync.BUSY_SCORE else "")
    return (f"auto: spin {c['wait_floor'] // 1000}-{c['wait_cap'] // 1000} us "
            f"(now {now // 1000} us{busy}){yields}, then futex{_slice_note(sched_slice)}")


def _slice_note(s) -> str:
    if isinstance(s, int):
        # (the thread's first request stands for its later contexts)
        return f"; scheduler slice {schedslice.held_us(s)} us"
    return f"; own scheduler slice: {s}" if s else ""
