"""Flag publication and waiting: the only code that touches sequence flags.

Ranks of one node talk through 64-byte flag lines in the shared arena. A
rank *publishes* by a release store of a sequence number into its own line
and *waits* by acquire loads of its peers' lines. Release/acquire pairs make
every payload byte written before the publish visible to a peer that has seen
the new sequence number.

The loads, stores, clocks and futex calls the waits are made of are
harmpi.base.atomics' (re-exported here: the steps import them with the waits).

Waiting (the policy is a context's ``wait`` setting, HARMPI_WAIT):

- ``auto`` (default) and ``sleep``: spin on the flag for a budget, then
  sleep in the kernel on a futex on the flag word itself, woken by the
  publisher. ``sleep`` has no budget; ``auto`` learns it per context from
  recent wait times (twice their running mean, kept within [floor, cap];
  the floor alone once waits run past the cap, since spinning then only
  steals the core a late peer needs). The context picks floor and cap:
  tens to hundreds of microseconds when every rank has a core, a few
  microseconds when ranks outnumber cores. In that case (the host's cores
  are shared by the job's own ranks) the spin is followed by a *yield
  window*: polls with ``sched_yield`` hand the core straight to a sibling
  rank that has work, the peer being waited for most often, where a futex
  sleep would need the publisher's wake-up to cross to another CPU (an
  inter-processor interrupt, costly in a virtual machine) on every step.
  Only waits that outlast the window sleep. On a *busy host* (more tasks
  runnable than it has CPUs, steadily: host_busy) ``auto`` does not spin at
  all: a spinning waiter would only take the core from a task that needs
  it, often the peer it waits for, and burn the share of CPU time the
  scheduler then takes back from its own compute. It goes straight to a
  yield window (BUSY_YIELD_NS, or the context's own if longer), then
  sleeps. A yielding rank stays runnable, and with the thread's short
  scheduler slice (harmpi.platform.schedslice) each yield puts it back only that
  slice, so it runs again as soon as the task it let in has had a turn;
  a woken sleeper runs at once for the same reason.
- ``spin``: poll with ``pause`` for ``spin_count`` iterations, then
  ``sched_yield``, and after ``SLEEP_AFTER_NS`` of yielding sleep 50 us per
  poll: the fastest when every rank owns a core and nothing else runs.

No lost wake-up (the announce protocol): a sleeper increments the
*sleepers* word of the flag it waits on, then loads the flag again, and
only if it is still short calls FUTEX_WAIT with the value it saw (the
kernel refuses to sleep if the word changed meanwhile). A publisher stores
its flag, then loads its sleepers word and calls FUTEX_WAKE only if it is
non-zero. Both pairs are sequentially consistent (a locked instruction and
a plain load on x86), so either the sleeper sees the new flag or the
publisher sees the sleeper: the fast path of a publish is one extra load.
A futex sleep is bounded (``SLEEP_SLICE_NS``): every slice the waiter also
looks for SIGINT (a signal also ends the sleep at once), its deadline and
abandonment, and lets MPI progress (see mpiprogress: a peer may be stuck in
an MPI call that needs this rank's progress).

Every wait has a deadline; on expiry it returns the index of the flag that
never reached the target instead of raising, and the caller (which knows
ranks and sequence numbers) raises a clear error.

All helpers are numba intrinsics or ``@njit`` functions callable from other
compiled code; they refer to libc symbols by name, so callers stay cacheable.
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..platform.mpiprogress import iprobe
from .atomics import (
    HAS_FUTEX,
    LOW32_OFFSET,
    compare_exchange,
    cpu_relax,
    fence,
    fetch_add,
    futex_wait,
    futex_wake,
    load_acquire,
    load_seq_cst,
    monotonic_ns,
    realtime_ns,
    sched_yield,
    sleep_us,
    store_release,
)

__all__ = ["load_acquire", "store_release", "compare_exchange", "ABANDONED", "cpu_relax",
           "sched_yield", "monotonic_ns", "realtime_ns", "sleep_us", "wait_flags_ge", "poke",
           "sigint_arrived", "WAIT_INTERRUPTED", "SLEEP_AFTER_NS", "POKE_AFTER_NS",
           "SLEEP_POKE_NS",
           "load_seq_cst", "fetch_add", "fence", "futex_wait", "futex_wake", "wake_sleepers",
           "HAS_FUTEX", "WAIT_SPIN", "WAIT_AUTO", "WAIT_SLEEP", "WAIT_POLICIES", "WS_WORDS",
           "SLEEP_SLICE_NS", "WS_YIELD", "spin_budget", "learn_gap", "host_busy", "runnable_tasks",
           "WS_BUSY_FD", "WS_BUSY_BUF", "WS_BUSY_CPUS", "WS_BUSY_AT", "WS_BUSY", "BUSY_LOOK_NS",
           "BUSY_SCORE", "BUSY_YIELD_NS", "busy_window"]

#: the flag value of a rank that gave up on a collective (flags are epochs >= 0
#: otherwise): every wait on it, and every later publish over it, fails at once
ABANDONED = -1
#: after this long yielding, a waiter sleeps between polls
SLEEP_AFTER_NS = 20_000_000
#: after this long waiting, a waiter also lets MPI progress (mpiprogress);
#: a collective that completes sooner never pays for it
POKE_AFTER_NS = 100_000
#: a sleeping wait (and the tcp rail's) lets MPI progress only this often:
#: Open MPI's progress calls sched_yield when it finds nothing to do (with
#: mpi_yield_when_idle, which it turns on itself when oversubscribed), and
#: Linux's EEVDF scheduler moves a yielding task's virtual time on by a
#: slice, which the rank pays back in its compute while other jobs run. The
#: rare peer that needs this rank's MPI progress waits at most this long
#: more.
SLEEP_POKE_NS = 10_000_000

#: longest futex sleep between looks at SIGINT, the deadline and MPI
#: progress; ten times that once a wait has lasted LONG_WAIT_NS (a late peer:
#: each look costs a few system calls)
SLEEP_SLICE_NS = 1_000_000
LONG_WAIT_NS = 20_000_000

#: wait policies (Config.wait, HARMPI_WAIT)
WAIT_SPIN, WAIT_AUTO, WAIT_SLEEP = 0, 1, 2
WAIT_POLICIES = {"spin": WAIT_SPIN, "auto": WAIT_AUTO, "sleep": WAIT_SLEEP}
#: a wait state: int64 words [policy, learned wait (ns), floor (ns), cap (ns),
#: sleep slice (ns; 0: SLEEP_SLICE_NS), sleeps that ran a whole slice,
#: yield window (ns polled with sched_yield between the spin and the sleep),
#: the busy-host look (see host_busy): /proc/loadavg's fd + 1 (0: no look),
#: a 64-byte buffer's address, the host's CPUs, when it last looked (ns), the
#: running score (0-1024)]
(WS_POLICY, WS_GAP, WS_FLOOR, WS_CAP, WS_SLICE, WS_EXPIRED, WS_YIELD, WS_BUSY_FD, WS_BUSY_BUF,
 WS_BUSY_CPUS, WS_BUSY_AT, WS_BUSY) = range(12)
WS_WORDS = 12
#: how often a wait may look at the host's run queue (harmpi.base.sync.host_busy)
BUSY_LOOK_NS = 10_000_000
#: the score (of 1024) from which the host counts as busy
BUSY_SCORE = 512
#: on a busy host a wait yields at least this long before it sleeps
BUSY_YIELD_NS = 50_000

_I64 = ir.IntType(64)
_I32 = ir.IntType(32)


@intrinsic
def _read_byte(typingctx, fd):
    """libc ``read(fd, &b, 1)``: the byte read, or -1 (nothing to read, or an error)."""
    sig = types.int64(types.int64)

    def codegen(context, builder, signature, args):
        byte = cgutils.alloca_once(builder, ir.IntType(8))
        fnty = ir.FunctionType(_I64, [_I32, ir.IntType(8).as_pointer(), _I64])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "read")
        n = builder.call(fn, [builder.trunc(args[0], _I32), byte, ir.Constant(_I64, 1)])
        got = builder.zext(builder.load(byte), _I64)
        return builder.select(builder.icmp_signed("==", n, ir.Constant(_I64, 1)), got,
                              ir.Constant(_I64, -1))

    return sig, codegen


@intrinsic
def _pread0(typingctx, fd, addr, nbytes):
    """libc ``pread(fd, addr, nbytes, 0)``: bytes read, or -1."""
    sig = types.int64(types.int64, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(_I64, [_I32, ir.IntType(8).as_pointer(), _I64, _I64])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "pread")
        ptr = builder.inttoptr(args[1], ir.IntType(8).as_pointer())
        return builder.call(fn, [builder.trunc(args[0], _I32), ptr, args[2],
                                 ir.Constant(_I64, 0)])

    return sig, codegen


@intrinsic
def _load_u8(typingctx, addr):
    """The byte at ``addr`` (a plain load: the buffer is this thread's)."""
    sig = types.int64(types.intp)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(8).as_pointer())
        return builder.zext(builder.load(ptr), _I64)

    return sig, codegen


@numba.njit(types.int64(types.int64, types.intp), cache=True, nogil=True)
def runnable_tasks(fd, buf_addr):
    """The tasks runnable on the host right now, from /proc/loadavg open at
    ``fd`` (its fourth field, "running/total"), read into the 64 bytes at
    ``buf_addr``; -1 when it cannot be read."""
    n = _pread0(fd, buf_addr, 63)
    if n <= 0:
        return -1
    slash = -1
    for i in range(n):
        if _load_u8(buf_addr + i) == 47:  # '/'
            slash = i
            break
    if slash <= 0:
        return -1
    value = 0
    scale = 1
    i = slash - 1
    while i >= 0:
        c = _load_u8(buf_addr + i)
        if c < 48 or c > 57:
            break
        value += (c - 48) * scale
        scale *= 10
        i -= 1
    return value if scale > 1 else -1


@numba.njit(types.boolean(types.intp, types.int64), cache=True, nogil=True)
def host_busy(state_addr, now):
    """Whether more tasks want this host's CPUs than it has: then a
    spinning waiter only takes a core from a task that needs it (most often
    the peer it waits for, or the work beside the job), so waits do not
    spin (they yield, then sleep: wait_flags_ge). At most every
    BUSY_LOOK_NS a wait that found its flag short reads the run queue's
    length (/proc/loadavg, one pread); a running score (weight 1/4 per
    look) says busy from BUSY_SCORE, so a task that runs for a moment does
    not turn the spin off, while a steady load does within a few looks."""
    fd1 = load_acquire(state_addr + 8 * WS_BUSY_FD)
    if fd1 == 0:
        return False
    if now - load_acquire(state_addr + 8 * WS_BUSY_AT) >= BUSY_LOOK_NS:
        store_release(state_addr + 8 * WS_BUSY_AT, now)
        r = runnable_tasks(fd1 - 1, load_acquire(state_addr + 8 * WS_BUSY_BUF))
        if r >= 0:
            score = load_acquire(state_addr + 8 * WS_BUSY)
            hit = 1024 if r > load_acquire(state_addr + 8 * WS_BUSY_CPUS) else 0
            store_release(state_addr + 8 * WS_BUSY, score + ((hit - score) >> 2))
    return load_acquire(state_addr + 8 * WS_BUSY) >= BUSY_SCORE


@numba.njit(types.int64(types.intp, types.int64, types.int64), cache=True, nogil=True)
def busy_window(state_addr, now, yield_ns):
    """For a wait about to spin: -1 on a quiet host (spin as set), else the
    yield window to take instead of spinning (``yield_ns``, at least
    BUSY_YIELD_NS). The rule of the node's waits and of the tcp rail's."""
    if state_addr == 0 or not host_busy(state_addr, now):
        return -1
    return max(yield_ns, BUSY_YIELD_NS)


#: signal number of SIGINT (Ctrl-C) as Python's wakeup fd reports it
_SIGINT = 2
#: wait_flags_ge's return value when a SIGINT arrived while it waited
WAIT_INTERRUPTED = -(1 << 40)


@numba.njit(types.boolean(types.int64), cache=True, nogil=True)
def sigint_arrived(hook_addr):
    """Whether a SIGINT arrived since the last look: Python's signal
    handler writes each signal's number to the wakeup fd harmpi installed
    (hook word 4, -1 for none; see harmpi.api), which is drained here.
    Python still raises KeyboardInterrupt itself once the wait returns."""
    if hook_addr == 0:
        return False
    fd = load_acquire(hook_addr + 32)
    if fd < 0:
        return False
    hit = False
    while True:
        b = _read_byte(fd)
        if b < 0:
            return hit
        if b == _SIGINT:
            hit = True


@numba.njit(types.void(types.int64), cache=True, nogil=True)
def poke(hook_addr):
    """Run MPI's progress engine once through the mpiprogress hook at
    ``hook_addr`` (0, or a hook without MPI_Iprobe's address: nothing)."""
    if hook_addr != 0:
        fn = load_acquire(hook_addr)
        if fn != 0:
            iprobe(fn, load_acquire(hook_addr + 8), load_acquire(hook_addr + 16),
                   load_acquire(hook_addr + 24))


@numba.njit(types.void(types.intp, types.intp), cache=True, nogil=True)
def wake_sleepers(sleepers_addr, flag_addr):
    """After a store to the flag at ``flag_addr`` by exchange (or after a
    fence): wake whoever sleeps on it. One load when nobody does."""
    if sleepers_addr != 0 and load_seq_cst(sleepers_addr) != 0:
        futex_wake(flag_addr + LOW32_OFFSET)


@numba.njit(types.int64(types.intp), cache=True, nogil=True)
def spin_budget(state_addr):
    """How long a wait of the policy at ``state_addr`` spins before it
    sleeps (ns); -1: spin the old way (WAIT_SPIN, or no futex here)."""
    if state_addr == 0:
        return -1
    policy = load_acquire(state_addr + 8 * WS_POLICY)
    if policy == WAIT_SLEEP:
        return 0
    if policy != WAIT_AUTO:
        return -1
    gap = load_acquire(state_addr + 8 * WS_GAP)
    floor = load_acquire(state_addr + 8 * WS_FLOOR)
    cap = load_acquire(state_addr + 8 * WS_CAP)
    if gap > cap:
        return floor  # waits outlast any spin worth paying for
    return min(cap, max(floor, 2 * gap))


@numba.njit(types.void(types.intp, types.int64), cache=True, nogil=True)
def learn_gap(state_addr, waited_ns):
    """Fold one wait's length into the running mean (weight 1/8); a wait
    counts at most four caps, so one very late peer is forgotten after a
    dozen quick waits."""
    if state_addr == 0:
        return
    cap = load_acquire(state_addr + 8 * WS_CAP)
    w = min(waited_ns, 4 * cap)
    gap = load_acquire(state_addr + 8 * WS_GAP)
    store_release(state_addr + 8 * WS_GAP, gap + ((w - gap) >> 3))


@numba.njit(types.int64(types.intp, types.intp, types.int64, types.int64, types.int64, types.int64,
                        types.int64), cache=True, nogil=True)
def _wait_spinning(base_addr, stride, count, target, spin_count, timeout_ns, hook_addr):  # noqa: C901 - the spin loop: its branches are the wait phases (spin, yield, poke, deadline, sleep)
    """wait_flags_ge under WAIT_SPIN: ``spin_count`` pause polls, then
    sched_yield, then 50 us sleeps after SLEEP_AFTER_NS; the deadline
    counts from the first yield (spinning is bounded)."""
    polls = 0
    started = 0
    for j in range(count):
        addr = base_addr + j * stride
        while True:
            v = load_acquire(addr)
            if v >= target:
                break
            if v < 0:
                return -2 - j
            polls += 1
            if polls <= spin_count:
                cpu_relax()
                continue
            if started == 0:
                started = monotonic_ns()
            sched_yield()
            if (polls & 31) == 0:
                if sigint_arrived(hook_addr):
                    return WAIT_INTERRUPTED
                waited = monotonic_ns() - started
                if waited > POKE_AFTER_NS:
                    poke(hook_addr)
                if waited > timeout_ns:
                    return j
                if waited > SLEEP_AFTER_NS:
                    sleep_us(50)
    return -1


@numba.njit(types.int64(types.intp, types.intp, types.int64, types.int64, types.int64, types.int64,
                        types.int64, types.intp, types.intp), cache=True, nogil=True)
def wait_flags_ge(base_addr, stride, count, target, spin_count, timeout_ns, hook_addr,  # noqa: C901 - the spin-then-sleep loop: its branches are the wait phases, one look per poll
                  sleepers_addr, state_addr):
    """Wait until the int64 at ``base_addr + j*stride`` is >= ``target`` for
    every j in [0, count). Returns -1 once all are; ``-2 - j`` as soon as
    flag j is negative (ABANDONED: that rank gave up on the collective);
    WAIT_INTERRUPTED when a SIGINT arrives; or the first j still below
    ``target`` when ``timeout_ns`` elapsed. ``hook_addr``: an mpiprogress
    hook and the wakeup fd (0 for none), MPI progress every SLEEP_POKE_NS
    (POKE_AFTER_NS when spinning).

    ``sleepers_addr``: the sleepers word of flag 0 (flag j's is at
    ``sleepers_addr + j*stride``; 0: no sleeping, the WAIT_SPIN loop);
    ``state_addr``: the wait state (WS_*). The deadline counts from the
    first look that found a flag short.
    """
    budget = spin_budget(state_addr) if sleepers_addr != 0 and HAS_FUTEX else -1
    if budget < 0:
        return _wait_spinning(base_addr, stride, count, target, spin_count, timeout_ns,
                              hook_addr)
    started = 0
    now = 0
    last_poke = 0
    polls = 0
    slice_ns = load_acquire(state_addr + 8 * WS_SLICE)
    if slice_ns <= 0:
        slice_ns = SLEEP_SLICE_NS
    yield_ns = load_acquire(state_addr + 8 * WS_YIELD) if budget > 0 else 0
    for j in range(count):
        addr = base_addr + j * stride
        while True:
            v = load_acquire(addr)
            if v >= target:
                break
            if v < 0:
                return -2 - j
            if started == 0:
                started = monotonic_ns()
                now = started
                last_poke = started
                if budget > 0:
                    # a busy host: no spin; yield (the rank stays runnable,
                    # and its short slice lets it back in soon), then sleep
                    busy = busy_window(state_addr, started, yield_ns)
                    if busy >= 0:
                        budget, yield_ns = 0, busy
            polls += 1
            if now - started < budget:
                cpu_relax()
                if (polls & 15) == 0:
                    now = monotonic_ns()
                continue
            if now - started < budget + yield_ns:
                # the yield window: the core goes to whoever else runs here
                sched_yield()
                now = monotonic_ns()
                if (polls & 31) == 0:
                    if sigint_arrived(hook_addr):
                        return WAIT_INTERRUPTED
                    if now - started > timeout_ns:
                        return j
                continue
            now = monotonic_ns()
            waited = now - started
            if sigint_arrived(hook_addr):
                return WAIT_INTERRUPTED
            if now - last_poke > SLEEP_POKE_NS:
                poke(hook_addr)
                last_poke = now
            if waited > timeout_ns:
                return j
            # announce, look again, sleep only on the value seen (see the
            # module docstring: no wake-up is lost between look and sleep)
            sleepers = sleepers_addr + j * stride
            fetch_add(sleepers, 1)
            v = load_seq_cst(addr)
            if 0 <= v < target:
                nap = slice_ns if waited < LONG_WAIT_NS else 10 * slice_ns
                nap = min(nap, timeout_ns - waited + 1)
                futex_wait(addr + LOW32_OFFSET, v, nap)
                if monotonic_ns() - now >= nap:  # not woken: counted for tests
                    store_release(state_addr + 8 * WS_EXPIRED,
                                  load_acquire(state_addr + 8 * WS_EXPIRED) + 1)
            fetch_add(sleepers, -1)
            now = monotonic_ns()
    # (policy sleep learns too, unused: one policy read per wait, not two)
    learn_gap(state_addr, 0 if started == 0 else monotonic_ns() - started)
    return -1
