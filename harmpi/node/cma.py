"""Cross-memory attach: read a local peer's memory in one copy.

``process_vm_readv(2)`` copies from another process's address space into
this one's, inside the kernel: one copy, against two through a shared slot
(the peer's copy in, this rank's copy out). Open MPI's vader/sm BTL reads
large messages the same way (its smsc/cma component), which is why its
one-node allgather of large tensors costs one copy per byte.

It needs the kernel's permission to trace the peer (same user; Yama's
ptrace_scope 0, or 1 with the peer a descendant; no seccomp filter that
refuses the call, as some container runtimes install). A context finds out
at set-up (``probe``): every local rank reads a word of every other one;
unless every read on the node succeeds, no rank of the node uses it (the
choice must be the same on every local rank, since it decides the steps).

The single-copy allgather (``steps.gather_node``) posts (pid, address of x)
in its slot, does the usual flag round (sizes and kinds checked first),
reads every peer's x into out straight from the peer, then a second flag
round: no rank returns, and lets its caller write x, while another still
reads it. A read that fails poisons the step on every rank (an error, not
a short result).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..base.topology import allgather_polled

__all__ = ["vm_read", "read_peer", "probe", "CMA_MIN_NBYTES"]

#: the one-node allgather reads peers directly from this many bytes per rank
#: (below, the syscall and the second flag round cost more than the copy
#: they save)
CMA_MIN_NBYTES = 32 << 10

_I64 = ir.IntType(64)
_I32 = ir.IntType(32)
_I8P = ir.IntType(8).as_pointer()


@intrinsic
def vm_read(typingctx, pid, dst_addr, src_addr, nbytes):
    """process_vm_readv(pid, {dst, nbytes}, 1, {src, nbytes}, 1, 0): bytes
    read (possibly fewer), or -1."""
    sig = types.int64(types.int64, types.intp, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        iov_t = ir.LiteralStructType([_I8P, _I64])
        local = cgutils.alloca_once(builder, iov_t)
        remote = cgutils.alloca_once(builder, iov_t)
        builder.store(builder.inttoptr(args[1], _I8P), cgutils.gep(builder, local, 0, 0))
        builder.store(args[3], cgutils.gep(builder, local, 0, 1))
        builder.store(builder.inttoptr(args[2], _I8P), cgutils.gep(builder, remote, 0, 0))
        builder.store(args[3], cgutils.gep(builder, remote, 0, 1))
        fnty = ir.FunctionType(_I64, [_I32, iov_t.as_pointer(), _I64, iov_t.as_pointer(), _I64,
                                      _I64])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "process_vm_readv")
        one = ir.Constant(_I64, 1)
        return builder.call(fn, [builder.trunc(args[0], _I32), local, one, remote, one,
                                 ir.Constant(_I64, 0)])

    return sig, codegen


@numba.njit(cache=True, nogil=True)
def read_peer(pid, dst_addr, src_addr, nbytes):
    """Copy ``nbytes`` at ``src_addr`` in process ``pid`` to ``dst_addr``
    here (a short read goes on from where it stopped). True when all came."""
    done = 0
    while done < nbytes:
        r = vm_read(pid, dst_addr + done, src_addr + done, nbytes - done)
        if r <= 0:
            return False
        done += r
    return True


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _read_word(libc, pid, addr):
    """One int64 at ``addr`` in process ``pid``, or None."""
    out = ctypes.c_int64(0)
    local = _Iovec(ctypes.addressof(out), 8)
    remote = _Iovec(addr, 8)
    n = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return out.value if n == 8 else None


def probe(node_comm, timeout_s) -> tuple[bool, str]:
    """Whether every local rank can read every other one's memory: (ok, why
    not). Collective over the node's communicator; the same answer on every
    local rank."""
    if node_comm.Get_size() == 1:
        return False, "one rank on the node"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.process_vm_readv  # noqa: B018 - present in glibc since 2.15
    except (OSError, AttributeError):
        libc = None
    me = node_comm.Get_rank()
    word = np.array([0x6861726D7069 ^ (me + 1)], np.int64)   # a value only this rank holds
    every = allgather_polled(node_comm, (os.getpid(), word.ctypes.data), timeout_s,
                             "probing cross-memory reads on the node")
    mine = "ok"
    if libc is None:
        mine = "no process_vm_readv in this C library"
    else:
        for j, (pid, addr) in enumerate(every):
            if j != me and _read_word(libc, pid, addr) != 0x6861726D7069 ^ (j + 1):
                mine = f"process_vm_readv of local rank {j} failed: " + \
                    os.strerror(ctypes.get_errno() or 1)
                break
    # (word stays alive until every rank has read it: this gather waits for all)
    verdicts = allgather_polled(node_comm, mine, timeout_s, "probing cross-memory reads")
    bad = [v for v in verdicts if v != "ok"]
    return (not bad), (bad[0] if bad else "")
