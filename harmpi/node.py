"""Compiled node-level steps of every algorithm: stage, publish, wait, sum, copy.

Each function here is ``@njit`` with explicit signatures (one per storage
type: uint16 for bf16/f16, float32, float64) and ``cache=True``, so they
compile once per machine and load in milliseconds afterwards. They receive
raw addresses (``tensor.data_ptr()``) and a small int64 control array
``ctl`` that holds the arena geometry and this rank's counters, so the
Python around a collective stays at one or two compiled calls.

Sequence protocol (every rank runs the same steps in the same order):

1. A collective is cut into *steps* of at most one slot. Step k uses slot
   parity p = k % 2 (``ctl[C_STEPS]`` counts steps).
2. ``stage``: a rank writes its contribution into slot(p, me) and the
   step's meta (total bytes, kind code) into meta word pair p of its flag
   line, then publishes ``epoch + 1`` with a release store, then waits until
   every local flag >= that epoch, then compares every rank's meta with its
   own. A mismatch is seen identically by every rank, so every rank
   returns the same error and the counters stay aligned.
3. Multi-phase algorithms (reduce-scatter + allgather, leader) publish and
   wait once more per phase (``publish_wait``); every phase bumps the epoch.

Why two buffers are enough: rank r writes slot(p, r) again at step k+2
only after passing step k+1's first wait, which needs every rank to have
published step k+1's first phase, which each rank does only after it has
finished reading everything of step k. So no trailing barrier is needed.

        step k      step k+1      step k+2
  r0:  write p0 ... write p1 ...  write p0   (r0 passed k+1's wait)
  r1:  read  p0 ... (must finish reading p0 before publishing k+1)

Return codes: OK, TIMEOUT (ctl[C_ERR_*] hold local peer, the epoch awaited
and the value seen), MISMATCH (ctl[C_ERR_*] hold the peer and its meta).
"""

from __future__ import annotations

import platform

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from . import copytune, mpiprogress
from . import reduce as _reduce
from .shm import FLAG_LINE_NBYTES, W_EPOCH, W_META, W_STATUS
from .sync import load_acquire, store_release, wait_flags_ge

__all__ = ["new_ctl", "stage", "stage_meta", "publish_wait", "publish_wait_status", "sum_slots",
           "sum_own_part", "gather_parts", "shm_allreduce", "add_publish_sum", "part_bounds",
           "add_into", "copy_slot", "copy_blocks", "copy_bytes", "slot_addr", "next_slot_addr",
           "address_of", "entry_point", "fast_allreduce", "FAST_ALLREDUCE", "OK", "TIMEOUT", "MISMATCH", "POISON_CODE",
           "FMT_BF16", "FMT_F16", "FMT_F32", "FMT_F64"]

OK, TIMEOUT, MISMATCH = 0, 1, 2
#: meta code of a rank whose part of the collective already failed (every rank then fails)
POISON_CODE = -1
FMT_BF16, FMT_F16, FMT_F32, FMT_F64 = 0, 1, 2, 3

# ctl layout (int64 words)
C_EPOCH, C_STEPS, C_FLAGS, C_SLOTS, C_SLOT_NBYTES, C_L, C_ME, C_SPIN, C_TIMEOUT_NS = range(9)
C_ERR_PEER, C_ERR_A, C_ERR_B = 9, 10, 11
C_FAST_CODE, C_SMALL_MAX_NBYTES = 12, 13
#: slot mode of the current call (copytune.MODE_*), the shared mode table's
#: address, and whether this rank runs the tuner's choice (0: fixed mode)
C_STREAM, C_TUNE_TABLE, C_TUNING = 14, 15, 16
#: two-node compiled rail step (algorithms.har_latency): the rail socket,
#: receive buffer and its size, transport spin passes; and the error state
#: of a failed stage kept while the step goes on (poisoned) to its end
C_RAIL_FD, C_RAIL_RECV, C_RAIL_RECV_CAP, C_RAIL_SPIN = 17, 18, 19, 20
C_ERR2_PEER, C_ERR2_A, C_ERR2_B = 21, 22, 23
#: an mpiprogress hook (4 words), poked by waits that stopped spinning
C_HOOK = 24
#: where this rank's next small all-reduce step writes in its slot (bytes;
#: see _ring_pos). Every local rank holds the same value: each advances it
#: by the same step sizes and resets it on a mismatch, which every rank sees
C_RING = 28
#: 1 while harmpi's native entry point may run this context (harmpi.native)
C_NATIVE = 29
#: rank 0's tuner state (copytune.STATE_WORDS) follows the header
C_TUNE_STATE = 32
C_LEN = C_TUNE_STATE + copytune.STATE_WORDS

_LINE = FLAG_LINE_NBYTES
_WORD = 8
#: partitions of reduce-scatter are multiples of this many bytes (cache lines)
PART_ALIGN_NBYTES = 64
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def new_ctl(arena, spin_count: int, timeout_s: float, fast_code: int = 0,
            small_max_nbytes: int = 0, stream_stores: str = "auto") -> np.ndarray:
    """The control array of one rank; ``stream_stores``: "auto" (local rank
    0 measures and picks per size, see copytune), "on", "off" or "flush"."""
    ctl = np.zeros(C_LEN, dtype=np.int64)
    ctl[C_FAST_CODE] = fast_code
    ctl[C_SMALL_MAX_NBYTES] = small_max_nbytes
    ctl[C_FLAGS] = arena.flags_addr
    ctl[C_SLOTS] = arena.slots_addr
    ctl[C_SLOT_NBYTES] = arena.slot_nbytes
    ctl[C_L] = arena.local_size
    ctl[C_ME] = arena.local_rank
    ctl[C_SPIN] = spin_count
    ctl[C_TIMEOUT_NS] = int(timeout_s * 1e9)
    ctl[C_TUNE_TABLE] = arena.tune_addr
    # auto starts plain: paths that do not run the tuner (the hierarchical
    # ones) keep plain stores, and the tuner probes the others from there
    mode = {"on": copytune.MODE_STREAM, "flush": copytune.MODE_FLUSH}.get(stream_stores,
                                                                          copytune.MODE_PLAIN)
    ctl[C_STREAM] = mode
    ctl[C_TUNING] = 1 if stream_stores == "auto" and arena.local_size > 1 else 0
    mpiprogress.fill_hook(ctl[C_HOOK:C_HOOK + mpiprogress.HOOK_WORDS])
    if arena.local_rank == 0:
        copytune.init_state(ctl[C_TUNE_STATE:], arena.tune_table(), mode)
    return ctl


@intrinsic
def _voidptr(typingctx, addr):
    sig = types.voidptr(types.intp)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

    return sig, codegen


@intrinsic
def _memcpy(typingctx, dst_addr, src_addr, nbytes):
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


#: below this many bytes a streaming copy is a plain copy (the fence and
#: the trip through memory cost more than they save)
STREAM_MIN_NBYTES = 4096

_STREAM_FENCE = "llvm.x86.sse.sfence" if _X86 else None


@intrinsic
def _stream_copy(typingctx, dst_addr, src_addr, nbytes):
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


_FLUSH_LINE = "llvm.x86.clflushopt" if _X86 else None


@intrinsic
def _flush_lines(typingctx, addr, nbytes):
    """clflushopt every cache line of [addr, addr + nbytes): drop this
    rank's copies of lines another rank will write next (see _done_reading).
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
def _done_reading(ctl, addr, nbytes):
    """A rank has read another rank's slot bytes. In MODE_FLUSH it drops its
    cached copies now: when the owner rewrites those lines two steps later,
    each store would otherwise have to invalidate this core's copy first
    (measured here in a slow phase: rewriting 512 KB a peer had read took
    233 us instead of 13 us; with the reader's flush, 42 us plus 25 us of
    flushing)."""
    if ctl[C_STREAM] == copytune.MODE_FLUSH and nbytes > 0:
        _flush_lines(addr, nbytes)


@numba.njit(cache=True, nogil=True)
def _streams(ctl, nbytes):
    """Whether nbytes for other local ranks go out with streaming stores."""
    return ctl[C_STREAM] == copytune.MODE_STREAM and nbytes >= STREAM_MIN_NBYTES


@numba.njit(cache=True, nogil=True)
def _publish_copy(ctl, dst_addr, src_addr, nbytes):
    """Copy data that other local ranks will read next: streaming or plain
    stores, as ctl[C_STREAM] says (see _stream_copy and copytune)."""
    if _streams(ctl, nbytes):
        _stream_copy(dst_addr, src_addr, nbytes)
    elif nbytes > 0:
        _memcpy(dst_addr, src_addr, nbytes)


# -- dtype dispatch resolved at compile time --------------------------------

def _sum_rows(src, lo, hi, out, out_lo, fmt):  # pragma: no cover - typing stub
    raise NotImplementedError("compiled-only dispatch")


def _sum_rows_x(src, lo, hi, me, x, out, out2, out_lo, fmt):  # pragma: no cover - stub
    raise NotImplementedError("compiled-only dispatch")


def _sum2(a, b, out, fmt):  # pragma: no cover - typing stub
    raise NotImplementedError("compiled-only dispatch")


@overload(_sum_rows)
def _ov_sum_rows(src, lo, hi, out, out_lo, fmt):
    if src.dtype == types.uint16:
        def impl(src, lo, hi, out, out_lo, fmt):
            if fmt == FMT_F16:
                _reduce.sum_rows_f16(src, lo, hi, out, out_lo)
            else:
                _reduce.sum_rows_bf16(src, lo, hi, out, out_lo)
        return impl
    if src.dtype == types.float32:
        return lambda src, lo, hi, out, out_lo, fmt: _reduce.sum_rows_f32(src, lo, hi, out, out_lo)
    if src.dtype == types.float64:
        return lambda src, lo, hi, out, out_lo, fmt: _reduce.sum_rows_f64(src, lo, hi, out, out_lo)


@overload(_sum_rows_x)
def _ov_sum_rows_x(src, lo, hi, me, x, out, out2, out_lo, fmt):
    if src.dtype == types.uint16:
        def impl(src, lo, hi, me, x, out, out2, out_lo, fmt):
            if fmt == FMT_F16:
                _reduce.sum_rows_x_f16(src, lo, hi, me, x, out, out2, out_lo)
            else:
                _reduce.sum_rows_x_bf16(src, lo, hi, me, x, out, out2, out_lo)
        return impl
    if src.dtype == types.float32:
        return lambda src, lo, hi, me, x, out, out2, out_lo, fmt: _reduce.sum_rows_x_f32(
            src, lo, hi, me, x, out, out2, out_lo)
    if src.dtype == types.float64:
        return lambda src, lo, hi, me, x, out, out2, out_lo, fmt: _reduce.sum_rows_x_f64(
            src, lo, hi, me, x, out, out2, out_lo)


@overload(_sum2)
def _ov_sum2(a, b, out, fmt):
    if a.dtype == types.uint16:
        def impl(a, b, out, fmt):
            if fmt == FMT_F16:
                _reduce.sum2_f16(a, b, out)
            else:
                _reduce.sum2_bf16(a, b, out)
        return impl
    if a.dtype == types.float32:
        return lambda a, b, out, fmt: _reduce.sum2_f32(a, b, out)
    if a.dtype == types.float64:
        return lambda a, b, out, fmt: _reduce.sum2_f64(a, b, out)


def _sigs(ret, *args):
    """One signature per storage type; ``W`` in args stands for the witness array."""
    out = []
    for t in (types.uint16, types.float32, types.float64):
        out.append(ret(*[t[::1] if a == "W" else a for a in args]))
    return out


_i64 = types.int64
_ctl = types.int64[::1]


@numba.njit(cache=True, nogil=True)
def _slots2d(ctl, parity, w):
    L = ctl[C_L]
    elems = ctl[C_SLOT_NBYTES] // w.itemsize
    base = ctl[C_SLOTS] + parity * L * ctl[C_SLOT_NBYTES]
    return numba.carray(_voidptr(base), (L, elems), w.dtype)


@numba.njit(cache=True, nogil=True)
def part_bounds(m, L, j, itemsize):
    """[lo, hi) of rank j's share of m elements (cache-line aligned parts)."""
    align = PART_ALIGN_NBYTES // itemsize
    part = ((m + L - 1) // L + align - 1) // align * align
    lo = min(j * part, m)
    return lo, min(lo + part, m)


@numba.njit(cache=True, nogil=True)
def hook_addr(ctl):
    """Address of ctl's mpiprogress hook."""
    return ctl.ctypes.data + C_HOOK * 8


@numba.njit(_i64(_ctl), cache=True, nogil=True)
def publish_wait(ctl):
    """Publish the next epoch and wait until every local rank has published it."""
    epoch = ctl[C_EPOCH] + 1
    ctl[C_EPOCH] = epoch
    flags = ctl[C_FLAGS]
    store_release(flags + ctl[C_ME] * _LINE + W_EPOCH * _WORD, epoch)
    j = wait_flags_ge(flags + W_EPOCH * _WORD, _LINE, ctl[C_L], epoch, ctl[C_SPIN],
                      ctl[C_TIMEOUT_NS], hook_addr(ctl))
    if j >= 0:
        ctl[C_ERR_PEER] = j
        ctl[C_ERR_A] = epoch
        ctl[C_ERR_B] = load_acquire(flags + j * _LINE + W_EPOCH * _WORD)
        return TIMEOUT
    return OK


@numba.njit(cache=True, nogil=True)
def _stage_at(ctl, x_addr, m, skip_lo, skip_hi, total_nbytes, code, fmt, w, pos):
    """stage(), except that x[:m] goes to slot(p, me) from byte ``pos`` (a
    multiple of 64, the same on every rank: it is posted with the meta and
    checked like it) and x[skip_lo:skip_hi] is not copied (a share only this
    rank reads, straight from x)."""
    parity = ctl[C_STEPS] & 1
    ctl[C_STEPS] += 1
    me = ctl[C_ME]
    slots = _slots2d(ctl, parity, w)
    mine = slots[me].ctypes.data + pos
    if m > 0:
        isz = w.itemsize
        _publish_copy(ctl, mine, x_addr, skip_lo * isz)
        _publish_copy(ctl, mine + skip_hi * isz, x_addr + skip_hi * isz, (m - skip_hi) * isz)
    # codes use the low 32 bits; the high ones carry pos (in 64-byte lines)
    if code != POISON_CODE:
        code = code | ((pos >> 6) << 32)
    line = ctl[C_FLAGS] + me * _LINE
    meta = line + (W_META + 2 * parity) * _WORD
    store_release(meta, total_nbytes)
    store_release(meta + _WORD, code)
    status = publish_wait(ctl)
    if status != OK:
        return status
    for j in range(ctl[C_L]):
        peer_meta = ctl[C_FLAGS] + j * _LINE + (W_META + 2 * parity) * _WORD
        a = load_acquire(peer_meta)
        b = load_acquire(peer_meta + _WORD)
        if a != total_nbytes or b != code or b == POISON_CODE:
            ctl[C_ERR_PEER] = j
            ctl[C_ERR_A] = a
            # report the peer's code without the ring bits this rank posted
            # (allgather codes use bits above 32 for a shape digest: pos 0)
            ctl[C_ERR_B] = b if b == POISON_CODE else b ^ ((pos >> 6) << 32)
            # every local rank sees the mismatch in this step: all restart
            # the ring together (a mismatched step may have moved it apart)
            ctl[C_RING] = 0
            return MISMATCH
    return OK


@numba.njit(cache=True, nogil=True)
def _stage(ctl, x_addr, m, skip_lo, skip_hi, total_nbytes, code, fmt, w):
    """_stage_at at the start of the slot."""
    return _stage_at(ctl, x_addr, m, skip_lo, skip_hi, total_nbytes, code, fmt, w, 0)


@numba.njit(cache=True, nogil=True)
def _ring_pos(ctl, nbytes):
    """Where a small step of ``nbytes`` writes in its slot: just past the
    previous small step, wrapping to 0 when it would not fit. Why a ring: a
    slot line rewritten while another core still caches it (it read it two
    steps ago) costs the writer an invalidation round trip; walking the
    whole slot lets the readers' private caches drop each line before it
    is rewritten (measured here, 2 ranks, 10 KB: 0.45-0.6 us to fill the
    slot instead of 0.9 us; a 128 KB ring gained nothing)."""
    pos = ctl[C_RING]
    if pos + nbytes > ctl[C_SLOT_NBYTES]:
        pos = 0
    return pos


@numba.njit(cache=True, nogil=True)
def _ring_advance(ctl, pos, nbytes):
    ctl[C_RING] = pos + ((nbytes + 63) & ~63)


@numba.njit(_sigs(_i64, _ctl, types.intp, _i64, _i64, _i64, _i64, "W"),
            cache=True, nogil=True)
def stage(ctl, x_addr, m, total_nbytes, code, fmt, w):
    """Start a step: slot(p, me) = x[:m], post meta, publish, wait for all,
    check metas. Returns OK / TIMEOUT / MISMATCH."""
    return _stage(ctl, x_addr, m, 0, 0, total_nbytes, code, fmt, w)


@numba.njit(_sigs(_i64, _ctl, _i64, _i64, _i64, _i64, "W"), cache=True, nogil=True)
def stage_meta(ctl, m, total_nbytes, code, fmt, w):
    """stage() of an m-element step without the copy: the caller fills
    slot(p, me) itself before the step's next flag round."""
    return _stage(ctl, 0, m, 0, m, total_nbytes, code, fmt, w)


@numba.njit(_sigs(types.void, _ctl, types.intp, _i64, _i64, _i64, "W"), cache=True, nogil=True)
def sum_slots(ctl, out_addr, lo, hi, fmt, w):
    """out[0:hi-lo] = sum over local ranks, in rank order, of slot[lo:hi] (current step)."""
    if hi <= lo:
        return
    slots = _slots2d(ctl, (ctl[C_STEPS] - 1) & 1, w)
    out = numba.carray(_voidptr(out_addr), (hi - lo,), w.dtype)
    _sum_rows(slots, lo, hi, out, 0, fmt)
    me = ctl[C_ME]
    for j in range(ctl[C_L]):
        if j != me:
            _done_reading(ctl, slots[j, lo:hi].ctypes.data, (hi - lo) * w.itemsize)


@numba.njit(_sigs(types.void, _ctl, _i64, _i64, _i64, "W"), cache=True, nogil=True)
def sum_own_part(ctl, lo, hi, fmt, w):
    """Reduce-scatter step: slot(p, me)[lo:hi] = sum over ranks of slot[lo:hi]."""
    if hi <= lo:
        return
    slots = _slots2d(ctl, (ctl[C_STEPS] - 1) & 1, w)
    _sum_rows(slots, lo, hi, slots[ctl[C_ME]], lo, fmt)


@numba.njit(_sigs(types.void, _ctl, types.intp, _i64, "W"), cache=True, nogil=True)
def gather_parts(ctl, out_addr, m, w):
    """Allgather step: out[lo_j:hi_j] = slot(p, j)[lo_j:hi_j] for every local rank j."""
    if m <= 0:
        return
    slots = _slots2d(ctl, (ctl[C_STEPS] - 1) & 1, w)
    L = ctl[C_L]
    isz = w.itemsize
    for j in range(L):
        lo, hi = part_bounds(m, L, j, isz)
        if hi > lo:
            _memcpy(out_addr + lo * isz, slots[j, lo:hi].ctypes.data, (hi - lo) * isz)


@numba.njit(cache=True, nogil=True)
def _reduce_scatter_allgather(ctl, x_addr, m, fmt, w):
    """After a stage that skipped my share: sum my share of every slot, with
    my own row read from x, into my slot (for the others) and into x (for
    me) in one pass; publish; copy the other ranks' shares into x."""
    L = ctl[C_L]
    me = ctl[C_ME]
    isz = w.itemsize
    lo, hi = part_bounds(m, L, me, isz)
    slots = _slots2d(ctl, (ctl[C_STEPS] - 1) & 1, w)
    x = numba.carray(_voidptr(x_addr), (m,), w.dtype)
    if hi > lo:
        # one pass writes the share to my slot (for the others) and to x.
        # (Not x alone and then a streaming copy to the slot: with out and
        # out2 both x the kernel cannot rule out aliasing and runs ~6x slower.)
        _sum_rows_x(slots, lo, hi, me, x, slots[me], x, lo, fmt)
        for j in range(L):
            if j != me:
                _done_reading(ctl, slots[j, lo:hi].ctypes.data, (hi - lo) * isz)
    status = publish_wait(ctl)
    if status != OK:
        return status
    for j in range(L):
        if j != me:
            jlo, jhi = part_bounds(m, L, j, isz)
            if jhi > jlo:
                _memcpy(x_addr + jlo * isz, slots[j, jlo:jhi].ctypes.data, (jhi - jlo) * isz)
                _done_reading(ctl, slots[j, jlo:jhi].ctypes.data, (jhi - jlo) * isz)
    return OK


@numba.njit(_sigs(_i64, _ctl, types.intp, _i64, _i64, _i64, _i64, "W"), cache=True, nogil=True)
def shm_allreduce(ctl, x_addr, n, code, fmt, small_max_elems, w):
    """Whole single-node all-reduce of x[:n] in place, chunk by chunk.

    Steps of at most ``small_max_elems`` elements: every rank sums all slots
    (L*m reads each), placed at the ring position (_ring_pos). Larger steps: reduce-scatter + allgather. A rank copies
    into its slot only the shares the others reduce, sums its own share with
    its own row read from x, writing the result to its slot and to x in one
    pass, publishes, and copies the other shares from their owners' slots:
    per rank (L-1)/L*m copied in, m read, 2m/L written, (L-1)/L*m copied
    out. Always at least one step, so a zero-size call still checks that
    every rank agrees.
    """
    chunk = ctl[C_SLOT_NBYTES] // w.itemsize
    total = n * w.itemsize
    L = ctl[C_L]
    tuning = ctl[C_TUNING] != 0
    timed = tuning and ctl[C_ME] == 0
    if tuning:
        ctl[C_STREAM] = copytune.choose(ctl[C_TUNE_STATE:], ctl[C_TUNE_TABLE], ctl[C_ME] == 0,
                                        True, total)
    t0 = copytune.read_ticks() if timed else 0
    start = 0
    while True:
        m = min(chunk, n - start)
        addr = x_addr + start * w.itemsize
        small = m <= small_max_elems or L == 1
        pos = _ring_pos(ctl, m * w.itemsize) if small else 0
        if small:
            status = _stage_at(ctl, addr, m, 0, 0, total, code, fmt, w, pos)
        else:
            # my own share is read straight from x: do not copy it
            lo, hi = part_bounds(m, L, ctl[C_ME], w.itemsize)
            status = _stage(ctl, addr, m, lo, hi, total, code, fmt, w)
        if status != OK:
            return status
        if small:
            lo = pos // w.itemsize
            sum_slots(ctl, addr, lo, lo + m, fmt, w)
            _ring_advance(ctl, pos, m * w.itemsize)
        else:
            status = _reduce_scatter_allgather(ctl, addr, m, fmt, w)
            if status != OK:
                return status
        start += m
        if start >= n:
            if timed:
                copytune.record(ctl[C_TUNE_STATE:], total, copytune.read_ticks() - t0)
            return OK


@numba.njit(_i64(_ctl, _i64), cache=True, nogil=True)
def publish_wait_status(ctl, status):
    """Like publish_wait, but each rank also posts ``status`` (0 = fine) for
    the current step; returns MISMATCH on every rank if any rank posted
    non-zero (peer in ctl[C_ERR_PEER], its status in ctl[C_ERR_A])."""
    parity = (ctl[C_STEPS] - 1) & 1
    word = (W_STATUS + parity) * _WORD
    store_release(ctl[C_FLAGS] + ctl[C_ME] * _LINE + word, status)
    rc = publish_wait(ctl)
    if rc != OK:
        return rc
    for j in range(ctl[C_L]):
        s = load_acquire(ctl[C_FLAGS] + j * _LINE + word)
        if s != 0:
            ctl[C_ERR_PEER] = j
            ctl[C_ERR_A] = s
            ctl[C_ERR_B] = 0
            return MISMATCH
    return OK


@numba.njit(_sigs(types.void, types.intp, types.intp, _i64, _i64, "W"), cache=True, nogil=True)
def add_into(a_addr, b_addr, m, fmt, w):
    """a[:m] = a[:m] + b[:m] (one rounding to the storage type)."""
    if m <= 0:
        return
    a = numba.carray(_voidptr(a_addr), (m,), w.dtype)
    b = numba.carray(_voidptr(b_addr), (m,), w.dtype)
    _sum2(a, b, a, fmt)


@numba.njit(_sigs(types.void, _ctl, _i64, types.intp, _i64, _i64, "W"), cache=True, nogil=True)
def copy_slot(ctl, j, out_addr, lo, hi, w):
    """out[0:hi-lo] = slot(p, j)[lo:hi] for the current step."""
    if hi <= lo:
        return
    slots = _slots2d(ctl, (ctl[C_STEPS] - 1) & 1, w)
    _memcpy(out_addr, slots[j, lo:hi].ctypes.data, (hi - lo) * w.itemsize)


@numba.njit(_i64(_ctl, _i64), cache=True, nogil=True)
def slot_addr(ctl, j):
    """Address of slot(p, j) of the current step."""
    L = ctl[C_L]
    parity = (ctl[C_STEPS] - 1) & 1
    return ctl[C_SLOTS] + (parity * L + j) * ctl[C_SLOT_NBYTES]


@numba.njit(_i64(_ctl, _i64), cache=True, nogil=True)
def next_slot_addr(ctl, j):
    """Address of slot(p, j) of the step that the next ``stage`` will start."""
    L = ctl[C_L]
    parity = ctl[C_STEPS] & 1
    return ctl[C_SLOTS] + (parity * L + j) * ctl[C_SLOT_NBYTES]


@numba.njit(types.void(types.intp, types.intp, _i64), cache=True, nogil=True)
def copy_bytes(dst_addr, src_addr, nbytes):
    if nbytes <= 0:
        return
    _memcpy(dst_addr, src_addr, nbytes)


@numba.njit(_sigs(types.void, _ctl, types.intp, _i64, _i64, _i64, types.int64[:, ::1], "W"),
            cache=True, nogil=True)
def copy_blocks(ctl, out_addr, n, start, m, table, w):
    """Allgather copy-out: block g of slot(p, l) (m elements) goes to
    out[table[l, g]*n + start :][:m] for every local rank l and node g."""
    if m <= 0:
        return
    L, G = table.shape[0], table.shape[1]
    slots = _slots2d(ctl, (ctl[C_STEPS] - 1) & 1, w)
    isz = w.itemsize
    for l in range(L):
        for g in range(G):
            o = (table[l, g] * n + start) * isz
            _memcpy(out_addr + o, slots[l, g * m:].ctypes.data, m * isz)


_AG_SIGS = _sigs(_i64, _ctl, types.intp, types.intp, _i64, _i64, _i64, _i64,
                 types.int64[:, ::1], "W")


@numba.njit(_AG_SIGS, cache=True, nogil=True)
def allgather_node(ctl, x_addr, out_addr, n, total_nbytes, code, chunk, table, w):
    """One node's whole allgather in one call, chunk by chunk (at least one
    step, so a zero-size call still checks agreement): my chunk into my next
    slot, post meta, publish, wait, then every rank's chunk from its slot to
    its block of out (table[l, 0]: communicator rank of local rank l)."""
    isz = w.itemsize
    fmt = code & 0xFF
    start = 0
    while True:
        m = min(chunk, n - start)
        copy_bytes(next_slot_addr(ctl, ctl[C_ME]), x_addr + start * isz, m * isz)
        rc = _stage(ctl, 0, 0, 0, 0, total_nbytes, code, fmt, w)
        if rc != OK:
            return rc
        copy_blocks(ctl, out_addr, n, start, m, table, w)
        start += m
        if start >= n:
            return OK


def _allgather_entries():
    return {np.dtype(np.uint16): entry_point(allgather_node, _AG_SIGS[0]),
            np.dtype(np.float32): entry_point(allgather_node, _AG_SIGS[1]),
            np.dtype(np.float64): entry_point(allgather_node, _AG_SIGS[2])}


@numba.njit(cache=True, nogil=True)
def address_of(a):
    """Data address of a 1-d array (5x cheaper than ``a.ctypes.data`` in Python)."""
    return a.ctypes.data


@numba.njit(cache=True, nogil=True)
def _my_slot(ctl):
    L = ctl[C_L]
    return ctl[C_SLOTS] + (((ctl[C_STEPS] - 1) & 1) * L + ctl[C_ME]) * ctl[C_SLOT_NBYTES]


@numba.njit(_sigs(_i64, _ctl, types.intp, types.intp, _i64, _i64, _i64, "W"),
            cache=True, nogil=True)
def add_publish_sum(ctl, x_addr, r_addr, m, status, fmt, w):
    """Tail of the hierarchical latency step in one call: with r_addr, my
    slot = x + r (the stage left the slot unfilled), unless status is
    non-zero; post ``status``, publish, wait, and if no rank failed, x[:m] =
    sum of the slots. Returns publish_wait_status's code."""
    if status == 0 and r_addr != 0 and m > 0:
        if _streams(ctl, m * w.itemsize):
            # sum into the private receive buffer, then stream it to the slot
            add_into(r_addr, x_addr, m, fmt, w)
            _stream_copy(_my_slot(ctl), r_addr, m * w.itemsize)
        else:
            x = numba.carray(_voidptr(x_addr), (m,), w.dtype)
            r = numba.carray(_voidptr(r_addr), (m,), w.dtype)
            _sum2(x, r, numba.carray(_voidptr(_my_slot(ctl)), (m,), w.dtype), fmt)
    rc = publish_wait_status(ctl, status)
    if rc != OK:
        return rc
    sum_slots(ctl, x_addr, 0, m, fmt, w)
    return OK


# The API's fast path: one kernel for every storage format, with everything
# but the tensor's address, length and format already in ctl (C_FAST_CODE:
# the meta code of an auto all-reduce without its dtype bits;
# C_SMALL_MAX_NBYTES: the size switch), so the call passes four integers.
_FAST_SIG = _i64(_ctl, types.intp, _i64, _i64)


@numba.njit(_FAST_SIG, cache=True, nogil=True)
def fast_allreduce(ctl, x_addr, n, fmt):
    code = ctl[C_FAST_CODE] | fmt
    small = ctl[C_SMALL_MAX_NBYTES]
    if fmt == FMT_BF16 or fmt == FMT_F16:
        return shm_allreduce(ctl, x_addr, n, code, fmt, small // 2, np.empty(0, np.uint16))
    if fmt == FMT_F32:
        return shm_allreduce(ctl, x_addr, n, code, fmt, small // 4, np.empty(0, np.float32))
    return shm_allreduce(ctl, x_addr, n, code, fmt, small // 8, np.empty(0, np.float64))


def entry_point(dispatcher, sig):
    """The compiled function of ``dispatcher`` for ``sig``, callable without
    the dispatcher's per-call typing of every argument (~0.1 us saved on a
    hot path whose argument types are fixed). Under NUMBA_DISABLE_JIT it is
    the plain Python function."""
    get = getattr(dispatcher, "get_overload", None)
    return dispatcher if get is None else get(sig)


#: the fast-path kernel f(ctl, x_addr, n, fmt), as a compiled entry point
FAST_ALLREDUCE = entry_point(fast_allreduce, _FAST_SIG)


#: allgather_node's compiled entry point by witness dtype (the API's fast path)
ALLGATHER_NODE = _allgather_entries()
