"""The machine's primitives the waits are made of: atomics, clocks, futex, yield.

numba (LLVM) treats a plain load in a loop as loop-invariant and hoists it,
so ``while flags[i] < s: pass`` spins forever. The loads and stores below
are LLVM atomic instructions, which cannot be hoisted; a release store
paired with an acquire load makes every byte written before the store
visible to the thread that loads the new value. The rest are one
instruction or one system call each (pause, sched_yield, nanosleep,
clock_gettime, futex), as numba intrinsics callable from compiled code;
they refer to libc symbols by name, so callers stay cacheable. The waits
built from them are harmpi.base.sync's.
"""

from __future__ import annotations

import platform
import sys

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["load_acquire", "load_seq_cst", "store_release", "compare_exchange", "fetch_add",
           "fence", "cpu_relax", "sched_yield", "sleep_us", "monotonic_ns", "realtime_ns",
           "HAS_FUTEX", "LOW32_OFFSET", "futex_wait", "futex_wake"]

_I64 = ir.IntType(64)
_I32 = ir.IntType(32)


def _atomic_load(ordering, doc):
    """An intrinsic f(addr) -> int64: an atomic load with ``ordering`` from
    the integer address ``addr``."""
    @intrinsic
    def load(typingctx, addr):
        sig = types.int64(types.intp)

        def codegen(context, builder, signature, args):
            ptr = builder.inttoptr(args[0], _I64.as_pointer())
            return builder.load_atomic(ptr, ordering, 8)

        return sig, codegen

    load.__doc__ = doc
    return load


load_acquire = _atomic_load("acquire", "int64 load with acquire ordering from ``addr``.")
#: pairs with the sleeper's announce and the publisher's exchange (a plain load on x86)
load_seq_cst = _atomic_load("seq_cst", "int64 load, sequentially consistent, from ``addr``.")


@intrinsic
def compare_exchange(typingctx, addr, expected, value):
    """Atomically: if the int64 at ``addr`` equals ``expected``, store ``value``
    (sequentially consistent: a publish by exchange pairs with a sleeper's
    announce, see the module docstring). Returns the value found, so the
    exchange happened iff it equals ``expected``."""
    sig = types.int64(types.intp, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], _I64.as_pointer())
        pair = builder.cmpxchg(ptr, args[1], args[2], "seq_cst", "seq_cst")
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


@intrinsic
def fetch_add(typingctx, addr, delta):
    """Atomically add ``delta`` to the int64 at ``addr`` (sequentially
    consistent); returns the previous value."""
    sig = types.int64(types.intp, types.int64)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], _I64.as_pointer())
        return builder.atomic_rmw("add", ptr, args[1], "seq_cst")

    return sig, codegen


@intrinsic
def fence(typingctx):
    """A sequentially consistent fence (for the rare stores that are not
    exchanges: abandonment)."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
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

# futex(2) by number through libc's syscall(); no number known: no futex,
# and every wait spins (WAIT_SPIN) whatever the setting says
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221,
              "ppc64": 221, "s390x": 238, "riscv64": 98}.get(_MACHINE, 0)
HAS_FUTEX = _SYS_FUTEX != 0 and sys.platform.startswith("linux")
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not the _PRIVATE ones: waiters are other processes
#: the 32-bit futex word inside an int64 flag: its low half
LOW32_OFFSET = 0 if sys.byteorder == "little" else 4


def _syscall_fn(builder):
    fnty = ir.FunctionType(_I64, [_I64], var_arg=True)
    return cgutils.get_or_insert_function(builder.module, fnty, "syscall")


@intrinsic
def futex_wait(typingctx, addr, expected, timeout_ns):
    """FUTEX_WAIT on the 32-bit word at ``addr``: sleep while it holds
    ``expected`` (its low 32 bits), for at most ``timeout_ns``, until a
    FUTEX_WAKE on it or a signal. Returns the syscall's result (0 woken,
    -1 otherwise: changed, timed out, interrupted); callers look again."""
    sig = types.int64(types.intp, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        ts = cgutils.alloca_once(builder, ir.ArrayType(_I64, 2))  # struct timespec
        billion = ir.Constant(_I64, 1_000_000_000)
        builder.store(builder.sdiv(args[2], billion), cgutils.gep(builder, ts, 0, 0))
        builder.store(builder.srem(args[2], billion), cgutils.gep(builder, ts, 0, 1))
        fn = _syscall_fn(builder)
        return builder.call(fn, [ir.Constant(_I64, _SYS_FUTEX), args[0],
                                 ir.Constant(_I32, _FUTEX_WAIT), builder.trunc(args[1], _I32),
                                 builder.ptrtoint(ts, _I64), ir.Constant(_I64, 0),
                                 ir.Constant(_I32, 0)])

    return sig, codegen


@intrinsic
def futex_wake(typingctx, addr):
    """FUTEX_WAKE every sleeper on the 32-bit word at ``addr``."""
    sig = types.int64(types.intp)

    def codegen(context, builder, signature, args):
        fn = _syscall_fn(builder)
        return builder.call(fn, [ir.Constant(_I64, _SYS_FUTEX), args[0],
                                 ir.Constant(_I32, _FUTEX_WAKE), ir.Constant(_I32, 0x7FFFFFFF),
                                 ir.Constant(_I64, 0), ir.Constant(_I64, 0),
                                 ir.Constant(_I32, 0)])

    return sig, codegen
#: comparable across hosts (to NTP's accuracy), for deadlines that travel in messages
realtime_ns = _clock_ns(0, "CLOCK_REALTIME in nanoseconds.")
