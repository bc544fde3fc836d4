"""Flag publication and waiting: the only code that touches sequence flags.

Ranks of one node talk through 64-byte flag lines in the shared arena. A
rank *publishes* by a release store of a sequence number into its own line
and *waits* by acquire loads of its peers' lines. Release/acquire pairs make
every payload byte written before the publish visible to a peer that has seen
the new sequence number.

Why intrinsics: numba (LLVM) treats a plain load in a loop as loop-invariant
and hoists it, so ``while flags[i] < s: pass`` spins forever. The loads and
stores below are LLVM atomic instructions, which cannot be hoisted.

Backoff: a wait polls with ``pause`` for ``spin_count`` iterations (cheap and
fastest when every rank owns a core), then calls ``sched_yield`` so that an
oversubscribed peer (4 ranks on 2 cores) gets the core it needs to arrive,
and after ``SLEEP_AFTER_NS`` of yielding it sleeps 50 us per poll so a long
wait does not burn a core. While it yields it also lets MPI progress (see
mpiprogress: a peer may be stuck in an MPI call that needs this rank's
progress). Every wait has a deadline; on expiry it returns
the index of the flag that never reached the target instead of raising, and
the caller (which knows ranks and sequence numbers) raises a clear error.

All helpers are numba intrinsics or ``@njit`` functions callable from other
compiled code; they refer to libc symbols by name, so callers stay cacheable.
"""

from __future__ import annotations

import platform

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .mpiprogress import iprobe

__all__ = ["load_acquire", "store_release", "compare_exchange", "ABANDONED", "cpu_relax",
           "sched_yield", "monotonic_ns", "realtime_ns", "sleep_us", "wait_flags_ge", "poke",
           "sigint_arrived", "WAIT_INTERRUPTED", "SLEEP_AFTER_NS", "POKE_AFTER_NS"]

#: the flag value of a rank that gave up on a collective (flags are epochs >= 0
#: otherwise): every wait on it, and every later publish over it, fails at once
ABANDONED = -1
#: after this long yielding, a waiter sleeps between polls
SLEEP_AFTER_NS = 20_000_000
#: after this long waiting, a waiter also lets MPI progress (mpiprogress);
#: a collective that completes sooner never pays for it
POKE_AFTER_NS = 100_000

_I64 = ir.IntType(64)
_I32 = ir.IntType(32)


@intrinsic
def load_acquire(typingctx, addr):
    """int64 load with acquire ordering from the integer address ``addr``."""
    sig = types.int64(types.intp)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], _I64.as_pointer())
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


@intrinsic
def compare_exchange(typingctx, addr, expected, value):
    """Atomically: if the int64 at ``addr`` equals ``expected``, store ``value``
    (acquire-release). Returns the value found, so the exchange happened iff
    it equals ``expected``."""
    sig = types.int64(types.intp, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], _I64.as_pointer())
        pair = builder.cmpxchg(ptr, args[1], args[2], "acq_rel", "acquire")
        return builder.extract_value(pair, 0)

    return sig, codegen


@intrinsic
def store_release(typingctx, addr, value):
    """int64 store with release ordering to the integer address ``addr``."""
    sig = types.void(types.intp, types.int64)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], _I64.as_pointer())
        builder.store_atomic(args[1], ptr, "release", 8)
        return context.get_dummy_value()

    return sig, codegen


_MACHINE = platform.machine().lower()
# numba's code emitter has no inline-asm parser, so the hint is the LLVM
# target intrinsic that lowers to the instruction.
if _MACHINE in ("x86_64", "amd64", "i686", "x86"):
    _RELAX = ("llvm.x86.sse2.pause", ())
elif _MACHINE in ("aarch64", "arm64"):
    _RELAX = ("llvm.aarch64.hint", (1,))  # hint #1 == yield
else:  # no hint known: the atomic load alone keeps the loop honest
    _RELAX = None


@intrinsic
def cpu_relax(typingctx):
    """Spin-loop hint (x86 ``pause``, arm ``yield``)."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        if _RELAX is not None:
            name, consts = _RELAX
            fnty = ir.FunctionType(ir.VoidType(), [_I32] * len(consts))
            fn = cgutils.get_or_insert_function(builder.module, fnty, name)
            builder.call(fn, [ir.Constant(_I32, c) for c in consts])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def sched_yield(typingctx):
    """libc ``sched_yield()``: give the core to another runnable process."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, []),
                                            "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def sleep_us(typingctx, usec):
    """libc ``usleep(usec)``."""
    sig = types.void(types.int64)

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [_I32]),
                                            "usleep")
        builder.call(fn, [builder.trunc(args[0], _I32)])
        return context.get_dummy_value()

    return sig, codegen


def _clock_ns(clock_id, doc):
    """An intrinsic f() -> int64: libc ``clock_gettime(clock_id)`` in nanoseconds."""
    @intrinsic
    def clock(typingctx):
        sig = types.int64()

        def codegen(context, builder, signature, args):
            ts_ty = ir.ArrayType(_I64, 2)  # struct timespec on 64-bit Linux
            ts = cgutils.alloca_once(builder, ts_ty)
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_I32, [_I32, ts_ty.as_pointer()]),
                "clock_gettime")
            builder.call(fn, [ir.Constant(_I32, clock_id), ts])
            sec = builder.load(cgutils.gep(builder, ts, 0, 0))
            nsec = builder.load(cgutils.gep(builder, ts, 0, 1))
            return builder.add(builder.mul(sec, ir.Constant(_I64, 1_000_000_000)), nsec)

        return sig, codegen

    clock.__doc__ = doc
    return clock


monotonic_ns = _clock_ns(1, "CLOCK_MONOTONIC in nanoseconds.")
#: comparable across hosts (to NTP's accuracy), for deadlines that travel in messages
realtime_ns = _clock_ns(0, "CLOCK_REALTIME in nanoseconds.")


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


@numba.njit(types.int64(types.intp, types.intp, types.int64, types.int64, types.int64, types.int64,
                        types.int64), cache=True, nogil=True)
def wait_flags_ge(base_addr, stride, count, target, spin_count, timeout_ns, hook_addr):
    """Wait until the int64 at ``base_addr + j*stride`` is >= ``target`` for
    every j in [0, count). Returns -1 once all are; ``-2 - j`` as soon as
    flag j is negative (ABANDONED: that rank gave up on the collective);
    WAIT_INTERRUPTED when a SIGINT arrives (looked at every 32 polls once
    the wait yields: within ~1 ms); or the first j still below ``target``
    when ``timeout_ns`` elapsed since the wait started yielding (spinning is
    bounded, so the deadline is exact to ~spin time). After POKE_AFTER_NS it
    lets MPI progress every 32 polls (``hook_addr``: an mpiprogress hook and
    the wakeup fd, 0 for none).
    """
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
