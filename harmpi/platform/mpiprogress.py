"""Letting MPI make progress while harmpi waits in compiled code.

Why: a rank that has left an MPI call may still owe its peers work that
only happens inside MPI calls. Over Open MPI's TCP BTL, for example, an
eager send "completes" once it is queued in the process; the bytes go out
on a later MPI call. A rank that then sits in one of harmpi's compiled
waits (a node flag, a tcp socket) never makes that call, its peer never
leaves MPI_Allgather, and both sides time out (seen on two real hosts: the
test script's allgathers between collectives, about one run in four).

So every harmpi wait that has lasted 100 us also pokes MPI, about every
50 us while it yields and before each sleep in poll(2), by calling
``MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_SELF, &flag, &status)``
through its C address: it matches nothing of the application's and, in
every MPI we know, runs the progress engine.

A *hook* is four int64 words: the address of MPI_Iprobe (0: no hook), the
communicator handle, MPI_ANY_SOURCE, MPI_ANY_TAG. Compiled waits take the
hook's address and call ``sync.poke`` (which calls :func:`iprobe`).
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["hook_values", "new_hook", "iprobe", "iprobe_address"]

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)


@functools.lru_cache(maxsize=1)
def iprobe_address():
    """C address of MPI_Iprobe in the MPI library mpi4py loaded, or 0."""
    from mpi4py import MPI  # noqa: F401,PLC0415 - loads libmpi
    candidates = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                name = os.path.basename(path)
                if name.startswith(("libmpi.so", "libmpi_", "libmpich")) and path not in candidates:
                    candidates.append(path)
    except OSError:
        pass
    for path in candidates + [None]:
        try:
            fn = ctypes.CDLL(path).MPI_Iprobe
        except (OSError, AttributeError):
            continue
        return ctypes.cast(fn, ctypes.c_void_p).value or 0
    return 0


def hook_values():
    """This process's hook: (MPI_Iprobe's address, COMM_SELF's handle,
    ANY_SOURCE, ANY_TAG), the four words that sync.poke reads in order."""
    from mpi4py import MPI  # noqa: PLC0415
    return (iprobe_address(), MPI._handleof(MPI.COMM_SELF), MPI.ANY_SOURCE, MPI.ANY_TAG)


def new_hook(sigfd=-1):
    """A standalone hook for waits outside a control block: the four words
    of hook_values(), then the signal wakeup fd the waits read (-1: none)."""
    return np.array(hook_values() + (sigfd,), np.int64)


@intrinsic
def iprobe(typingctx, fn, comm, source, tag):
    """Call ``int fn(int source, int tag, MPI_Comm comm, int *flag, MPI_Status *st)``.
    The handle is passed as a 64-bit value: a pointer in Open MPI, an int in
    MPICH (on x86-64 and arm64 an int argument is the low half of the register)."""
    sig = types.int64(types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        fnp, comm_v, src, tg = args
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(_I32, [_I32, _I32, _I64, _I32.as_pointer(), i8p])
        flag = cgutils.alloca_once(builder, _I32)
        status = cgutils.alloca_once(builder, ir.ArrayType(_I64, 16))   # > any MPI_Status
        call = builder.call(builder.inttoptr(fnp, fnty.as_pointer()),
                            [builder.trunc(src, _I32), builder.trunc(tg, _I32), comm_v, flag,
                             builder.bitcast(status, i8p)])
        return builder.sext(call, _I64)

    return sig, codegen
