"""Copy intrinsics: plain, streaming and flushing copies between raw addresses.

How a rank fills shared memory another core reads next is chosen per size
by harmpi.base.copytune and held in the control block's ``mode``: plain stores,
streaming (non-temporal) stores, or plain stores with the readers flushing
what they read (``done_reading``). Everything here is compiled; the
intrinsics emit the LLVM instructions directly.
"""

from __future__ import annotations

import platform

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..base import copytune

__all__ = ["memcpy", "stream_copy", "done_reading", "streams", "publish_copy", "copy_bytes",
           "STREAM_MIN_NBYTES"]

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")

#: below this many bytes a streaming copy is a plain copy (the fence and
#: the trip through memory cost more than they save)
STREAM_MIN_NBYTES = 4096

_STREAM_FENCE = "llvm.x86.sse.sfence" if _X86 else None
_FLUSH_LINE = "llvm.x86.clflushopt" if _X86 else None


@intrinsic
def memcpy(typingctx, dst_addr, src_addr, nbytes):
    """llvm.memcpy between raw addresses (numba's slice assignment is an
    element loop that LLVM does not turn into a vector copy)."""
    sig = types.void(types.intp, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        i8p = context.get_value_type(types.voidptr)
        dst = builder.inttoptr(args[0], i8p)
        src = builder.inttoptr(args[1], i8p)
        cgutils.raw_memcpy(builder, dst, src, args[2], 1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def stream_copy(typingctx, dst_addr, src_addr, nbytes):
    """Copy ``nbytes`` into shared memory that *another core* reads next,
    with non-temporal (streaming) stores for the 64-byte-aligned body, then
    a store fence.

    Why: a plain copy leaves the lines Modified in this core's private
    cache, and the reader then pulls each one with a cache-to-cache
    transfer. On this kind of VM (vCPUs on different core complexes) that
    streams at ~4-5 GB/s; streaming stores send the lines to memory, where
    the reader's prefetchers fetch them 2-3x faster (10 KB: 2.5 -> ~1 us;
    64 KB: 25 -> ~10 us, measured). The fence orders the weakly-ordered
    streaming stores before the release store that publishes them (on x86
    a release store alone does not).
    """
    sig = types.void(types.intp, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        i8p = ir.IntType(8).as_pointer()
        vty = ir.VectorType(i64, 8)
        dst, src, n = args
        c64 = ir.Constant(i64, 64)
        # head: up to the first 64-byte boundary of dst (plain copy)
        head = builder.and_(builder.sub(ir.Constant(i64, 0), dst), ir.Constant(i64, 63))
        head = builder.select(builder.icmp_unsigned("<", n, head), n, head)
        cgutils.raw_memcpy(builder, builder.inttoptr(dst, i8p), builder.inttoptr(src, i8p),
                           head, 1)
        body_dst = builder.add(dst, head)
        body_src = builder.add(src, head)
        rest = builder.sub(n, head)
        nvec = builder.udiv(rest, c64)
        nt = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        with cgutils.for_range(builder, nvec) as loop:
            off = builder.mul(loop.index, c64)
            v = builder.load(builder.inttoptr(builder.add(body_src, off), vty.as_pointer()),
                             align=1)
            st = builder.store(v, builder.inttoptr(builder.add(body_dst, off),
                                                   vty.as_pointer()), align=64)
            st.set_metadata("nontemporal", nt)
        done = builder.mul(nvec, c64)
        cgutils.raw_memcpy(builder, builder.inttoptr(builder.add(body_dst, done), i8p),
                           builder.inttoptr(builder.add(body_src, done), i8p),
                           builder.sub(rest, done), 1)
        if _STREAM_FENCE is not None:
            fn = cgutils.get_or_insert_function(builder.module,
                                                ir.FunctionType(ir.VoidType(), []),
                                                _STREAM_FENCE)
            builder.call(fn, [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _flush_lines(typingctx, addr, nbytes):
    """clflushopt every cache line of [addr, addr + nbytes): drop this
    rank's copies of lines another rank will write next (see done_reading).
    A no-op where the instruction is unknown."""
    sig = types.void(types.intp, types.int64)

    def codegen(context, builder, signature, args):
        if _FLUSH_LINE is None:
            return context.get_dummy_value()
        i64 = ir.IntType(64)
        i8p = ir.IntType(8).as_pointer()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p]),
                                            _FLUSH_LINE)
        start = builder.and_(args[0], ir.Constant(i64, ~63))
        end = builder.add(args[0], args[1])
        count = builder.udiv(builder.add(builder.sub(end, start), ir.Constant(i64, 63)),
                             ir.Constant(i64, 64))
        with cgutils.for_range(builder, count) as loop:
            line = builder.add(start, builder.mul(loop.index, ir.Constant(i64, 64)))
            builder.call(fn, [builder.inttoptr(line, i8p)])
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(cache=True, nogil=True)
def done_reading(c, addr, nbytes):
    """A rank has read another rank's slot bytes. In MODE_FLUSH it drops its
    cached copies now: when the owner rewrites those lines two steps later,
    each store would otherwise have to invalidate this core's copy first
    (measured here in a slow phase: rewriting 512 KB a peer had read took
    233 us instead of 13 us; with the reader's flush, 42 us plus 25 us of
    flushing)."""
    if c.mode == copytune.MODE_FLUSH and nbytes > 0:
        _flush_lines(addr, nbytes)


@numba.njit(cache=True, nogil=True)
def streams(c, nbytes):
    """Whether nbytes for other local ranks go out with streaming stores."""
    return c.mode == copytune.MODE_STREAM and nbytes >= STREAM_MIN_NBYTES


@numba.njit(cache=True, nogil=True)
def publish_copy(c, dst_addr, src_addr, nbytes):
    """Copy data that other local ranks will read next: streaming or plain
    stores, as ``c.mode`` says (see stream_copy and copytune)."""
    if streams(c, nbytes):
        stream_copy(dst_addr, src_addr, nbytes)
    elif nbytes > 0:
        memcpy(dst_addr, src_addr, nbytes)


@numba.njit(types.void(types.intp, types.intp, types.int64), cache=True, nogil=True)
def copy_bytes(dst_addr, src_addr, nbytes):
    if nbytes <= 0:
        return
    memcpy(dst_addr, src_addr, nbytes)
