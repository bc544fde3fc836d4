"""Compiled node-level steps of every algorithm: stage, publish, wait, sum, copy.

Every function here is ``@njit`` with ``cache=True``; the ones Python calls
have explicit signatures (one per storage type: uint16 for bf16/f16,
float32, float64, selected by a zero-length *witness* array of that type),
so they compile once per machine and load in milliseconds afterwards. They
receive raw addresses (``tensor.data_ptr()``) and the rank's control block
(harmpi.control), so the Python around a collective stays at one compiled
call.

Sequence protocol (every rank runs the same steps in the same order):

1. A collective is cut into *steps* of at most one slot. Step k uses slot
   parity p = k % 2 (``steps`` counts steps).
2. ``stage``: a rank writes its contribution into slot(p, me) and the
   step's meta (total bytes, kind word) into meta word pair p of its flag
   line, then publishes ``epoch + 1`` with a release store, then waits until
   every local flag >= that epoch, then compares every rank's meta with its
   own. A mismatch is seen identically by every rank, so every rank
   returns the same status and the counters stay aligned.
3. Multi-phase algorithms (reduce-scatter + allgather, leader) publish and
   wait once more per phase (``publish_wait``); every phase bumps the epoch.

Why two buffers are enough: rank r writes slot(p, r) again at step k+2
only after passing step k+1's first wait, which needs every rank to have
published step k+1's first phase, which each rank does only after it has
finished reading everything of step k. So no trailing barrier is needed.

        step k      step k+1      step k+2
  r0:  write p0 ... write p1 ...  write p0   (r0 passed k+1's wait)
  r1:  read  p0 ... (must finish reading p0 before publishing k+1)

Statuses (harmpi.control): OK; TIMEOUT (err_peer, err_a, err_b: the local
rank that did not publish, the epoch awaited, the value seen); MISMATCH
(err_*: the peer, its byte count and its kind); POISONED (a rank posted
that its part failed).

The entry points a context runs, all f(ctl, x_addr, n, fmt) -> status:
``one_node_step`` (auto on one node; ``ONE_NODE_CFUNC`` is the same for C
callers) and ``solo_step`` (a communicator of one rank).
"""

from __future__ import annotations

import platform

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from . import control, copytune, dtypes, kind, mpiprogress, profrec
from . import reduce as _reduce
from .control import ABANDONED, BUSY, INTERRUPTED, MISMATCH, OK, POISONED, TIMEOUT, WRONG_THREAD
from .shm import FLAG_LINE_NBYTES, STAMP_WORDS, W_CULPRIT, W_EPOCH, W_META, W_STATUS
from .sync import ABANDONED as FLAG_ABANDONED
from .sync import (
    WAIT_INTERRUPTED,
    WAIT_SPIN,
    compare_exchange,
    cpu_relax,
    fence,
    load_acquire,
    monotonic_ns,
    store_release,
    wait_flags_ge,
    wake_sleepers,
)

__all__ = ["init_control", "stage", "stage_meta", "publish_wait", "publish_wait_status",
           "sum_slots", "sum_own_part", "gather_parts", "shm_allreduce", "add_publish_sum",
           "part_bounds", "add_into", "copy_slot", "copy_blocks", "copy_bytes", "slot_addr",
           "next_slot_addr", "entry_point", "one_node_step", "solo_step",
           "gather_step", "ONE_NODE_STEP", "ONE_NODE_CFUNC", "SOLO_STEP", "GATHER_STEP",
           "STREAM_MIN_NBYTES", "NEVER_RSAG", "enter", "leave", "abandon",
           "interrupted", "peers_abandoned", "begin", "one_node_start", "one_node_finish",
           "ONE_NODE_START", "ONE_NODE_FINISH", "thread_self", "foreign_thread",
           # the steps other kernels build on (harmpi.algorithms)
           "memcpy", "parity_slot_addr", "step_parity", "publish_copy", "stage_at",
           "stage_post", "stage_check", "format_itemsize"]

_LINE = FLAG_LINE_NBYTES
_WORD = 8
#: partitions of reduce-scatter are multiples of this many bytes (cache lines)
PART_ALIGN_NBYTES = 64
#: small_max_nbytes that keeps every step on the sum-every-slot branch
NEVER_RSAG = 1 << 62
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
_BF16, _F16, _F32 = dtypes.BF16, dtypes.F16, dtypes.F32
_HOOK_OFFSET = control.HOOK_OFFSET
_WAIT_OFFSET = control.WAIT_OFFSET
_BUSY_OFFSET = control.offset("busy")
_voidptr = control.voidptr


def init_control(ctl, arena, spin_count: int, timeout_s: float, auto_code: int,
                 small_max_nbytes: int, stream_stores: str, sigfd: int = -1,
                 tune_state=None, wait_policy: int = WAIT_SPIN, spin_floor_ns: int = 0,
                 spin_cap_ns: int = 0) -> None:
    """Fill the node part of a control block (the rail part: har_latency).
    ``stream_stores``: "auto" (local rank 0 times the slot modes per size
    and picks, see copytune; ``tune_state`` is its int64[STATE_WORDS]
    array), "on", "off" or "flush". ``wait_policy`` (sync.WAIT_*) and the
    spin floor and cap of policy auto: how waits spin and sleep (harmpi.sync);
    an arena without sleeper lines always spins."""
    c = ctl[0]
    c["flags"] = arena.flags_addr
    c["slots"] = arena.slots_addr
    c["slot_nbytes"] = arena.slot_nbytes
    c["local_size"] = arena.local_size
    c["local_rank"] = arena.local_rank
    c["spin"] = spin_count
    c["timeout_ns"] = int(timeout_s * 1e9)
    c["auto_code"] = auto_code
    c["small_max_nbytes"] = small_max_nbytes
    # auto starts plain: paths that do not run the tuner (the hierarchical
    # ones) keep plain stores, and the tuner probes the others from there
    mode = {"on": copytune.MODE_STREAM, "flush": copytune.MODE_FLUSH}.get(stream_stores,
                                                                          copytune.MODE_PLAIN)
    c["mode"] = mode
    c["tune_table"] = arena.tune_addr
    c["stamps"] = getattr(arena, "stamps_addr", 0)
    c["tuning"] = 1 if stream_stores == "auto" and arena.local_size > 1 else 0
    if arena.local_rank == 0:
        c["tune_state"] = tune_state.ctypes.data
        copytune.init_state(tune_state, arena.tune_table(), mode)
    for name, value in zip(("hook_fn", "hook_comm", "hook_source", "hook_tag"),
                           mpiprogress.hook_values()):
        c[name] = value
    c["hook_sigfd"] = sigfd
    c["sleepers"] = getattr(arena, "sleepers_addr", 0)
    c["wait_policy"] = wait_policy
    c["wait_gap"] = 0
    c["wait_floor"] = spin_floor_ns
    c["wait_cap"] = spin_cap_ns


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
def _done_reading(c, addr, nbytes):
    """A rank has read another rank's slot bytes. In MODE_FLUSH it drops its
    cached copies now: when the owner rewrites those lines two steps later,
    each store would otherwise have to invalidate this core's copy first
    (measured here in a slow phase: rewriting 512 KB a peer had read took
    233 us instead of 13 us; with the reader's flush, 42 us plus 25 us of
    flushing)."""
    if c.mode == copytune.MODE_FLUSH and nbytes > 0:
        _flush_lines(addr, nbytes)


@numba.njit(cache=True, nogil=True)
def _streams(c, nbytes):
    """Whether nbytes for other local ranks go out with streaming stores."""
    return c.mode == copytune.MODE_STREAM and nbytes >= STREAM_MIN_NBYTES


@numba.njit(cache=True, nogil=True)
def publish_copy(c, dst_addr, src_addr, nbytes):
    """Copy data that other local ranks will read next: streaming or plain
    stores, as ``c.mode`` says (see _stream_copy and copytune)."""
    if _streams(c, nbytes):
        _stream_copy(dst_addr, src_addr, nbytes)
    elif nbytes > 0:
        memcpy(dst_addr, src_addr, nbytes)


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
            if fmt == _F16:
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
            if fmt == _F16:
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
            if fmt == _F16:
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
    storages = sorted({f.storage for f in dtypes.FORMATS}, key=lambda d: d.itemsize)
    return [ret(*[numba.from_dtype(t)[::1] if a == "W" else a for a in args]) for t in storages]


_i64 = types.int64
_ctl = control.ARRAY


@numba.njit(cache=True, nogil=True)
def _slots2d(c, parity, w):
    L = c.local_size
    elems = c.slot_nbytes // w.itemsize
    base = c.slots + parity * L * c.slot_nbytes
    return numba.carray(_voidptr(base), (L, elems), w.dtype)


@numba.njit(cache=True, nogil=True)
def step_parity(c):
    """Slot parity of the step in progress (stage() has counted it)."""
    return (c.steps - 1) & 1


@numba.njit(cache=True, nogil=True)
def part_bounds(m, L, j, itemsize):
    """[lo, hi) of rank j's share of m elements (cache-line aligned parts)."""
    align = PART_ALIGN_NBYTES // itemsize
    part = ((m + L - 1) // L + align - 1) // align * align
    lo = min(j * part, m)
    return lo, min(lo + part, m)


@numba.njit(cache=True, nogil=True)
def hook_addr(ctl):
    """Address of the control block's mpiprogress hook."""
    return ctl.ctypes.data + _HOOK_OFFSET


@numba.njit(cache=True, nogil=True)
def wait_addr(ctl):
    """Address of the control block's wait state (sync.WS_*)."""
    return ctl.ctypes.data + _WAIT_OFFSET


@numba.njit(cache=True, nogil=True)
def _flag_addr(c, j):
    return c.flags + j * _LINE + W_EPOCH * _WORD


@numba.njit(cache=True, nogil=True)
def _wake(c, j):
    """Wake the ranks asleep on local rank j's epoch word (after an exchange
    or a fence; one load when none sleeps)."""
    if c.sleepers != 0:
        wake_sleepers(c.sleepers + j * _LINE, _flag_addr(c, j))


@numba.njit(cache=True, nogil=True)
def _local_rank_of(c, j):
    """Communicator rank of local rank j (-1 if the table is not set)."""
    if c.local_ranks == 0:
        return -1
    return numba.carray(_voidptr(c.local_ranks), (c.local_size,), np.int64)[j]


@numba.njit(_i64(_ctl, _i64), cache=True, nogil=True)
def abandon(ctl, culprit):
    """Give up on the node's collective: close the native gate, refuse every
    later entry, and turn this rank's flag to ABANDONED (after posting
    ``culprit``, the communicator rank it waited for, -1 if unknown), so a
    peer waiting on it, or arriving late, fails at once instead of
    completing the step without it. Idempotent; returns ABANDONED."""
    c = ctl[0]
    c.gate = 0
    if c.abandoned == 0:
        c.abandoned = 1
        line = c.flags + c.local_rank * _LINE
        store_release(line + W_CULPRIT * _WORD, culprit)
        store_release(line + W_EPOCH * _WORD, FLAG_ABANDONED)
        fence()
        _wake(c, c.local_rank)
    return ABANDONED


#: culprit word of a rank that gave up because it was interrupted (SIGINT)
CULPRIT_INTERRUPTED = -2


@numba.njit(_i64(_ctl), cache=True, nogil=True)
def interrupted(ctl):
    """A SIGINT arrived during a wait: give up on the collective (peers fail
    at once) and return INTERRUPTED; Python raises KeyboardInterrupt."""
    c = ctl[0]
    c.err_peer = c.local_rank
    c.err_a = c.epoch
    c.err_b = CULPRIT_INTERRUPTED
    abandon(ctl, CULPRIT_INTERRUPTED)
    return INTERRUPTED


@numba.njit(cache=True, nogil=True)
def _abandoned_by(ctl, j, epoch):
    """Local rank j gave up: note who (err_peer), the step (err_a) and the
    rank it was waiting for (err_b), and give up too."""
    c = ctl[0]
    c.err_peer = j
    c.err_a = epoch
    c.err_b = load_acquire(c.flags + j * _LINE + W_CULPRIT * _WORD)
    abandon(ctl, c.err_b)
    return ABANDONED


@numba.njit(_i64(_ctl), cache=True, nogil=True)
def peers_abandoned(ctl):
    """OK, or ABANDONED (after giving up too) if a local rank's flag shows
    that it gave up. A rail algorithm asks before it sends: data this node
    sends after one of its ranks dropped the step would let the other nodes
    complete a step that rank abandoned (L acquire loads; no wait)."""
    c = ctl[0]
    for j in range(c.local_size):
        if j != c.local_rank and load_acquire(_flag_addr(c, j)) < 0:
            return _abandoned_by(ctl, j, c.epoch)
    return OK


@numba.njit(cache=True, nogil=True)
def _who_abandoned(c):
    """The local rank that gave up on this one: it abandons its own flag
    right after poisoning this rank's, so look for it a little while."""
    for _ in range(1 << 20):
        for j in range(c.local_size):
            if j != c.local_rank and load_acquire(_flag_addr(c, j)) < 0:
                return j
        cpu_relax()
    return c.local_rank


# -- profiling (harmpi.profile): arrival stamps beside the epochs -------------
#
# Only while the control block's ``profile`` word is non-zero. A rank's
# first publish of a collective posts its entry time in its stamp line
# (harmpi.shm), tagged with the epoch; after the wait for that epoch every
# rank reads every local rank's stamp, so each learns the first and the last
# arrival and who that was, without a message of its own. A later publish
# posts what ``prof_stamp`` then holds (the two-node step: the rail peer's
# arrival), or nothing.

@numba.njit(cache=True, nogil=True)
def _stamp_line(c, j, epoch):
    return c.stamps + j * _LINE + (epoch & 1) * STAMP_WORDS * _WORD


@numba.njit(cache=True, nogil=True)
def _post_stamp(c, epoch):
    line = _stamp_line(c, c.local_rank, epoch)
    store_release(line + _WORD, c.prof_stamp)
    store_release(line + 2 * _WORD, c.prof_who if c.prof_stamp != 0 else -1)
    store_release(line, epoch)
    c.prof_stamp = 0


@numba.njit(cache=True, nogil=True)
def heard(c, t, who):
    """Fold one rank's arrival time into the running collective's record."""
    if c.prof_arrivals == 0 or t < c.prof_first_ns:
        c.prof_first_ns = t
    if c.prof_arrivals == 0 or t > c.prof_last_ns:
        c.prof_last_ns = t
        c.prof_last_rank = who
    c.prof_arrivals += 1


@numba.njit(cache=True, nogil=True)
def _read_stamps(c, epoch):
    for j in range(c.local_size):
        line = _stamp_line(c, j, epoch)
        if load_acquire(line) == epoch:
            who = load_acquire(line + 2 * _WORD)
            if who >= 0:
                heard(c, load_acquire(line + _WORD), who)


@numba.njit(cache=True, nogil=True)
def format_itemsize(fmt):
    if fmt == _BF16 or fmt == _F16:
        return 2
    return 4 if fmt == _F32 else 8


@numba.njit(types.void(_ctl, _i64, _i64), cache=True, nogil=True)
def begin(ctl, nbytes, code):
    """Profiling: a collective of ``nbytes`` and kind ``code`` starts now
    (an entry calls it right after enter, only when ``profile`` is set)."""
    c = ctl[0]
    t = monotonic_ns()
    c.prof_enter_ns = t
    c.prof_nbytes = nbytes
    c.prof_code = code
    c.prof_stamp = t
    c.prof_who = _local_rank_of(c, c.local_rank)
    c.prof_first_ns = 0
    c.prof_last_ns = 0
    c.prof_last_rank = -1
    c.prof_arrivals = 0


@numba.njit(cache=True, nogil=True)
def _publish(ctl):
    """Publish the next epoch (the first half of publish_wait): OK, or
    ABANDONED if this context or a peer gave up on this rank."""
    c = ctl[0]
    if c.abandoned != 0:
        return ABANDONED
    epoch = c.epoch + 1
    if c.profile != 0:
        _post_stamp(c, epoch)
    if compare_exchange(_flag_addr(c, c.local_rank), c.epoch, epoch) != c.epoch:
        return _abandoned_by(ctl, _who_abandoned(c), epoch)  # a peer gave up on this rank
    c.epoch = epoch
    _wake(c, c.local_rank)
    return OK


@numba.njit(cache=True, nogil=True)
def _await(ctl):
    """Wait until every local rank has published this rank's epoch (the
    second half of publish_wait)."""
    c = ctl[0]
    epoch = c.epoch
    extended = False
    while True:
        j = wait_flags_ge(c.flags + W_EPOCH * _WORD, _LINE, c.local_size, epoch, c.spin,
                          c.timeout_ns, hook_addr(ctl), c.sleepers, wait_addr(ctl))
        if j == -1:
            if c.profile != 0:
                _read_stamps(c, epoch)
            return OK
        if j == WAIT_INTERRUPTED:
            return interrupted(ctl)
        if j <= -2:
            return _abandoned_by(ctl, -2 - j, epoch)
        seen = load_acquire(_flag_addr(c, j))
        if seen < 0:
            return _abandoned_by(ctl, j, epoch)
        if seen >= epoch:
            continue
        if seen > c.coll_epoch and not extended:
            # it is inside this collective, stuck on something else (a rail
            # peer, say): give it one more deadline to give up itself and
            # name the rank it waited for
            extended = True
            continue
        # blame the late rank (its culprit word), then take its flag from it
        late = _local_rank_of(c, j)
        store_release(c.flags + j * _LINE + W_CULPRIT * _WORD, late)
        if compare_exchange(_flag_addr(c, j), seen, FLAG_ABANDONED) == seen:
            _wake(c, j)
            c.err_peer = j
            c.err_a = epoch
            c.err_b = seen
            abandon(ctl, late)
            return TIMEOUT
        # the late rank published meanwhile: wait for it again


@numba.njit(_i64(_ctl), cache=True, nogil=True)
def publish_wait(ctl):
    """Publish the next epoch and wait until every local rank has published it.

    A wait that reaches the deadline turns the late rank's flag to ABANDONED
    with a compare-exchange, and a rank publishes with a compare-exchange
    too: whichever comes first wins, so either the late rank arrived in time
    (the step completes everywhere) or it finds its flag abandoned and fails
    (never completing a step its peers gave up on)."""
    status = _publish(ctl)
    if status != OK:
        return status
    return _await(ctl)


@numba.njit(cache=True, nogil=True)
def stage_post(ctl, x_addr, m, skip_lo, skip_hi, total_nbytes, code, w, pos):
    """The first half of stage_at: fill my slot, post the meta, publish."""
    c = ctl[0]
    parity = c.steps & 1
    c.steps += 1
    me = c.local_rank
    slots = _slots2d(c, parity, w)
    mine = slots[me].ctypes.data + pos
    if m > 0:
        isz = w.itemsize
        publish_copy(c, mine, x_addr, skip_lo * isz)
        publish_copy(c, mine + skip_hi * isz, x_addr + skip_hi * isz, (m - skip_hi) * isz)
    code = kind.with_ring(code, pos)
    meta = c.flags + me * _LINE + (W_META + 2 * parity) * _WORD
    store_release(meta, total_nbytes)
    store_release(meta + _WORD, code)
    return _publish(ctl)


@numba.njit(cache=True, nogil=True)
def stage_check(ctl, total_nbytes, code, pos):
    """The second half of stage_at: wait for every local rank, compare metas."""
    status = _await(ctl)
    if status != OK:
        return status
    c = ctl[0]
    parity = step_parity(c)
    code = kind.with_ring(code, pos)
    for j in range(c.local_size):
        peer_meta = c.flags + j * _LINE + (W_META + 2 * parity) * _WORD
        a = load_acquire(peer_meta)
        b = load_acquire(peer_meta + _WORD)
        if a != total_nbytes or b != code or b == kind.POISON:
            c.err_peer = j
            c.err_a = a
            c.err_b = kind.without_ring(b)
            # every local rank sees the mismatch in this step: all restart
            # the ring together (a mismatched step may have moved it apart)
            c.ring = 0
            return MISMATCH
    return OK


@numba.njit(cache=True, nogil=True)
def stage_at(ctl, x_addr, m, skip_lo, skip_hi, total_nbytes, code, w, pos):
    """stage(), except that x[:m] goes to slot(p, me) from byte ``pos`` (a
    multiple of 64, the same on every rank: it is posted in the kind word and
    checked with it) and x[skip_lo:skip_hi] is not copied (a share only this
    rank reads, straight from x)."""
    status = stage_post(ctl, x_addr, m, skip_lo, skip_hi, total_nbytes, code, w, pos)
    if status != OK:
        return status
    return stage_check(ctl, total_nbytes, code, pos)


@numba.njit(cache=True, nogil=True)
def _ring_pos(c, nbytes):
    """Where a small step of ``nbytes`` writes in its slot: just past the
    previous small step, wrapping to 0 when it would not fit. Why a ring: a
    slot line rewritten while another core still caches it (it read it two
    steps ago) costs the writer an invalidation round trip; walking the
    whole slot lets the readers' private caches drop each line before it
    is rewritten (measured here, 2 ranks, 10 KB: 3.3 us per all-reduce with
    the ring, 3.6-3.9 us without)."""
    pos = c.ring
    if pos + nbytes > c.slot_nbytes:
        pos = 0
    return pos


@numba.njit(_sigs(_i64, _ctl, types.intp, _i64, _i64, _i64, "W"), cache=True, nogil=True)
def stage(ctl, x_addr, m, total_nbytes, code, w):
    """Start a step: slot(p, me) = x[:m], post meta, publish, wait for all,
    check metas. Returns OK / TIMEOUT / MISMATCH."""
    return stage_at(ctl, x_addr, m, 0, 0, total_nbytes, code, w, 0)


@numba.njit(_sigs(_i64, _ctl, _i64, _i64, _i64, "W"), cache=True, nogil=True)
def stage_meta(ctl, m, total_nbytes, code, w):
    """stage() of an m-element step without the copy: the caller fills
    slot(p, me) itself before the step's next flag round."""
    return stage_at(ctl, 0, m, 0, m, total_nbytes, code, w, 0)


@numba.njit(_sigs(types.void, _ctl, types.intp, _i64, _i64, _i64, "W"), cache=True, nogil=True)
def sum_slots(ctl, out_addr, lo, hi, fmt, w):
    """out[0:hi-lo] = sum over local ranks, in rank order, of slot[lo:hi] (current step)."""
    if hi <= lo:
        return
    c = ctl[0]
    slots = _slots2d(c, step_parity(c), w)
    out = numba.carray(_voidptr(out_addr), (hi - lo,), w.dtype)
    _sum_rows(slots, lo, hi, out, 0, fmt)
    for j in range(c.local_size):
        if j != c.local_rank:
            _done_reading(c, slots[j, lo:hi].ctypes.data, (hi - lo) * w.itemsize)


@numba.njit(_sigs(types.void, _ctl, _i64, _i64, _i64, "W"), cache=True, nogil=True)
def sum_own_part(ctl, lo, hi, fmt, w):
    """Reduce-scatter step: slot(p, me)[lo:hi] = sum over ranks of slot[lo:hi]."""
    if hi <= lo:
        return
    c = ctl[0]
    slots = _slots2d(c, step_parity(c), w)
    _sum_rows(slots, lo, hi, slots[c.local_rank], lo, fmt)


@numba.njit(_sigs(types.void, _ctl, types.intp, _i64, "W"), cache=True, nogil=True)
def gather_parts(ctl, out_addr, m, w):
    """Allgather step: out[lo_j:hi_j] = slot(p, j)[lo_j:hi_j] for every local rank j."""
    if m <= 0:
        return
    c = ctl[0]
    slots = _slots2d(c, step_parity(c), w)
    L = c.local_size
    isz = w.itemsize
    for j in range(L):
        lo, hi = part_bounds(m, L, j, isz)
        if hi > lo:
            memcpy(out_addr + lo * isz, slots[j, lo:hi].ctypes.data, (hi - lo) * isz)


@numba.njit(cache=True, nogil=True)
def _reduce_scatter_allgather(ctl, x_addr, m, fmt, w):
    """After a stage that skipped my share: sum my share of every slot, with
    my own row read from x, into my slot (for the others) and into x (for
    me) in one pass; publish; copy the other ranks' shares into x."""
    c = ctl[0]
    L = c.local_size
    me = c.local_rank
    isz = w.itemsize
    lo, hi = part_bounds(m, L, me, isz)
    slots = _slots2d(c, step_parity(c), w)
    x = numba.carray(_voidptr(x_addr), (m,), w.dtype)
    if hi > lo:
        # one pass writes the share to my slot (for the others) and to x.
        # (Not x alone and then a streaming copy to the slot: with out and
        # out2 both x the kernel cannot rule out aliasing and runs ~6x slower.)
        _sum_rows_x(slots, lo, hi, me, x, slots[me], x, lo, fmt)
        for j in range(L):
            if j != me:
                _done_reading(c, slots[j, lo:hi].ctypes.data, (hi - lo) * isz)
    status = publish_wait(ctl)
    if status != OK:
        return status
    for j in range(L):
        if j != me:
            jlo, jhi = part_bounds(m, L, j, isz)
            if jhi > jlo:
                memcpy(x_addr + jlo * isz, slots[j, jlo:jhi].ctypes.data, (jhi - jlo) * isz)
                _done_reading(c, slots[j, jlo:jhi].ctypes.data, (jhi - jlo) * isz)
    return OK


@numba.njit(cache=True, nogil=True)
def _shm_chunk(ctl, addr, m, total, code, fmt, small, w):
    """One step of shm_allreduce over x[:m] at ``addr``."""
    c = ctl[0]
    isz = w.itemsize
    if small:
        pos = _ring_pos(c, m * isz)
        status = stage_at(ctl, addr, m, 0, 0, total, code, w, pos)
        if status != OK:
            return status
        lo = pos // isz
        sum_slots(ctl, addr, lo, lo + m, fmt, w)
        c.ring = pos + ((m * isz + 63) & ~63)
        return OK
    # my own share is read straight from x: do not copy it
    lo, hi = part_bounds(m, c.local_size, c.local_rank, isz)
    status = stage_at(ctl, addr, m, lo, hi, total, code, w, 0)
    if status != OK:
        return status
    return _reduce_scatter_allgather(ctl, addr, m, fmt, w)


@numba.njit(cache=True, nogil=True)
def _tune_state(c):
    """Local rank 0's tuner state (an empty view elsewhere)."""
    n = copytune.STATE_WORDS if c.tune_state != 0 else 0
    return numba.carray(_voidptr(c.tune_state), (n,), np.int64)


@numba.njit(_sigs(_i64, _ctl, types.intp, _i64, _i64, _i64, _i64, "W"), cache=True, nogil=True)
def shm_allreduce(ctl, x_addr, n, code, fmt, small_max_nbytes, w):
    """Whole single-node all-reduce of x[:n] in place, chunk by chunk.

    Steps of at most ``small_max_nbytes``: every rank sums all slots (L*m
    reads each), placed at the ring position (_ring_pos). Larger steps:
    reduce-scatter + allgather. A rank copies into its slot only the shares
    the others reduce, sums its own share with its own row read from x,
    writing the result to its slot and to x in one pass, publishes, and
    copies the other shares from their owners' slots: per rank (L-1)/L*m
    copied in, m read, 2m/L written, (L-1)/L*m copied out. Always at least
    one step, so a zero-size call still checks that every rank agrees.
    """
    c = ctl[0]
    isz = w.itemsize
    chunk = c.slot_nbytes // isz
    total = n * isz
    # the copy-mode tuner (copytune): every rank reads this size's mode,
    # local rank 0 also decides it and times its whole call
    leader = c.local_rank == 0
    if c.tuning != 0:
        c.mode = copytune.choose(_tune_state(c), c.tune_table, leader, True, total)
    timed = c.tuning != 0 and leader
    t0 = copytune.read_ticks() if timed else 0
    start = 0
    while True:
        m = min(chunk, n - start)
        small = m * isz <= small_max_nbytes or c.local_size == 1
        status = _shm_chunk(ctl, x_addr + start * isz, m, total, code, fmt, small, w)
        if status != OK:
            return status
        start += m
        if start >= n:
            if timed:
                copytune.record(_tune_state(c), total, copytune.read_ticks() - t0)
            return OK


@numba.njit(_i64(_ctl, _i64), cache=True, nogil=True)
def publish_wait_status(ctl, status):
    """Like publish_wait, but each rank also posts ``status`` (0 = fine) for
    the current step; returns POISONED on every rank if any rank posted
    non-zero (peer in err_peer, its status in err_a)."""
    c = ctl[0]
    word = (W_STATUS + step_parity(c)) * _WORD
    store_release(c.flags + c.local_rank * _LINE + word, status)
    rc = publish_wait(ctl)
    if rc != OK:
        return rc
    for j in range(c.local_size):
        s = load_acquire(c.flags + j * _LINE + word)
        if s != 0:
            c.err_peer = j
            c.err_a = s
            c.err_b = 0
            return POISONED
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
    slots = _slots2d(ctl[0], step_parity(ctl[0]), w)
    memcpy(out_addr, slots[j, lo:hi].ctypes.data, (hi - lo) * w.itemsize)


@numba.njit(cache=True, nogil=True)
def parity_slot_addr(c, parity, j):
    return c.slots + (parity * c.local_size + j) * c.slot_nbytes


@numba.njit(_i64(_ctl, _i64), cache=True, nogil=True)
def slot_addr(ctl, j):
    """Address of slot(p, j) of the current step."""
    return parity_slot_addr(ctl[0], step_parity(ctl[0]), j)


@numba.njit(_i64(_ctl, _i64), cache=True, nogil=True)
def next_slot_addr(ctl, j):
    """Address of slot(p, j) of the step that the next ``stage`` will start."""
    return parity_slot_addr(ctl[0], ctl[0].steps & 1, j)


@numba.njit(types.void(types.intp, types.intp, _i64), cache=True, nogil=True)
def copy_bytes(dst_addr, src_addr, nbytes):
    if nbytes <= 0:
        return
    memcpy(dst_addr, src_addr, nbytes)


@numba.njit(_sigs(types.void, _ctl, types.intp, _i64, _i64, _i64, "W"), cache=True, nogil=True)
def copy_blocks(ctl, out_addr, n, start, m, w):
    """Allgather copy-out: block g of slot(p, l) (m elements) goes to
    out[table[l, g]*n + start :][:m] for every local rank l and node g
    (the control block's gather table)."""
    if m <= 0:
        return
    c = ctl[0]
    L, G = c.local_size, c.gather_nodes
    table = numba.carray(_voidptr(c.gather_table), (L, G), np.int64)
    slots = _slots2d(c, step_parity(c), w)
    isz = w.itemsize
    for lr in range(L):
        for g in range(G):
            o = (table[lr, g] * n + start) * isz
            memcpy(out_addr + o, slots[lr, g * m:].ctypes.data, m * isz)


@numba.njit(cache=True, nogil=True)
def _gather_node(ctl, x_addr, out_addr, n, code, w):
    """One node's whole allgather, chunk by chunk (at least one step, so a
    zero-size call still checks agreement): my chunk into my next slot,
    post meta, publish, wait, then every rank's chunk from its slot to its
    block of out."""
    c = ctl[0]
    isz = w.itemsize
    chunk = max(1, c.slot_nbytes // isz)
    start = 0
    while True:
        m = min(chunk, n - start)
        copy_bytes(parity_slot_addr(c, c.steps & 1, c.local_rank), x_addr + start * isz, m * isz)
        rc = stage_at(ctl, 0, 0, 0, 0, n * isz, code, w, 0)
        if rc != OK:
            return rc
        copy_blocks(ctl, out_addr, n, start, m, w)
        start += m
        if start >= n:
            return OK


_GATHER_SIG = _i64(_ctl, types.intp, types.intp, _i64, _i64, _i64)


@intrinsic
def thread_self(typingctx):
    """libc ``pthread_self()``: the calling thread (what Python's
    threading.get_ident() returns on Linux); a register read, a few ns."""
    sig = types.int64()

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "pthread_self")
        return builder.call(fn, [])

    return sig, codegen


@numba.njit(types.boolean(_ctl), cache=True, nogil=True)
def foreign_thread(ctl):
    """Whether the calling thread is not the one that owns the context
    (control field ``owner``, set by harmpi.registry; 0: any thread)."""
    owner = ctl[0].owner
    return owner != 0 and owner != thread_self()


@numba.njit(_i64(_ctl), cache=True, nogil=True)
def enter(ctl):
    """Start of every entry: OK, or ABANDONED (this context gave up on a
    collective), or WRONG_THREAD (the caller is not the thread that made the
    context: ranks pair calls by order, not by thread, so a second thread's
    call could pair with another thread's on another rank), or BUSY (an
    async collective of this context is still open, or a thread got past the
    owner check by sharing its id: the flag rounds must not interleave).
    A thread-id compare and one uncontended compare-exchange."""
    if ctl[0].abandoned != 0:
        return ABANDONED
    if foreign_thread(ctl):
        return WRONG_THREAD
    if compare_exchange(ctl.ctypes.data + _BUSY_OFFSET, 0, 1) != 0:
        return BUSY
    ctl[0].coll_epoch = ctl[0].epoch
    return OK


@numba.njit(types.void(_ctl), cache=True, nogil=True)
def leave(ctl):
    if ctl[0].profile != 0:
        profrec.record(ctl)
    store_release(ctl.ctypes.data + _BUSY_OFFSET, 0)


@numba.njit(cache=True, nogil=True)
def _gather(ctl, x_addr, out_addr, n, fmt, digest):
    code = kind.allgather_code(fmt, digest)
    if fmt == _BF16 or fmt == _F16:
        return _gather_node(ctl, x_addr, out_addr, n, code, np.empty(0, np.uint16))
    if fmt == _F32:
        return _gather_node(ctl, x_addr, out_addr, n, code, np.empty(0, np.float32))
    return _gather_node(ctl, x_addr, out_addr, n, code, np.empty(0, np.float64))


@numba.njit(_GATHER_SIG, cache=True, nogil=True)
def gather_step(ctl, x_addr, out_addr, n, fmt, digest):
    """The one-node allgather entry: out = every local rank's x[:n] in
    communicator rank order."""
    rc = enter(ctl)
    if rc != OK:
        return rc
    if ctl[0].profile != 0:
        begin(ctl, n * format_itemsize(fmt), kind.allgather_code(fmt, digest))
    rc = _gather(ctl, x_addr, out_addr, n, fmt, digest)
    leave(ctl)
    return rc


@numba.njit(_sigs(_i64, _ctl, types.intp, types.intp, _i64, _i64, _i64, "W"),
            cache=True, nogil=True)
def add_publish_sum(ctl, x_addr, r_addr, m, status, fmt, w):
    """Tail of the hierarchical latency step in one call: with r_addr, my
    slot = x + r (the stage left the slot unfilled), unless status is
    non-zero; post ``status``, publish, wait, and if no rank failed, x[:m] =
    sum of the slots. Returns publish_wait_status's code."""
    c = ctl[0]
    if status == 0 and r_addr != 0 and m > 0:
        mine = parity_slot_addr(c, step_parity(c), c.local_rank)
        if _streams(c, m * w.itemsize):
            # sum into the private receive buffer, then stream it to the slot
            add_into(r_addr, x_addr, m, fmt, w)
            _stream_copy(mine, r_addr, m * w.itemsize)
        else:
            x = numba.carray(_voidptr(x_addr), (m,), w.dtype)
            r = numba.carray(_voidptr(r_addr), (m,), w.dtype)
            _sum2(x, r, numba.carray(_voidptr(mine), (m,), w.dtype), fmt)
    rc = publish_wait_status(ctl, status)
    if rc != OK:
        return rc
    sum_slots(ctl, x_addr, 0, m, fmt, w)
    return OK


# -- the entries a context runs: f(ctl, x_addr, n, fmt) -> status ------------

STEP_SIG = _i64(_ctl, types.intp, _i64, _i64)
CFUNC_SIG = _i64(_i64, _i64, _i64, _i64)


@numba.njit(cache=True, nogil=True)
def _one_node(ctl, x_addr, n, fmt):
    c = ctl[0]
    code = c.auto_code | fmt
    small = c.small_max_nbytes
    if fmt == _BF16 or fmt == _F16:
        return shm_allreduce(ctl, x_addr, n, code, fmt, small, np.empty(0, np.uint16))
    if fmt == _F32:
        return shm_allreduce(ctl, x_addr, n, code, fmt, small, np.empty(0, np.float32))
    return shm_allreduce(ctl, x_addr, n, code, fmt, small, np.empty(0, np.float64))


@numba.njit(STEP_SIG, cache=True, nogil=True)
def one_node_step(ctl, x_addr, n, fmt):
    """Auto all-reduce on one node: the kind and the size switch come from
    the control block, so a call passes four integers."""
    rc = enter(ctl)
    if rc != OK:
        return rc
    if ctl[0].profile != 0:
        begin(ctl, n * format_itemsize(fmt), ctl[0].auto_code | fmt)
    rc = _one_node(ctl, x_addr, n, fmt)
    leave(ctl)
    return rc


@numba.cfunc(CFUNC_SIG, cache=True, nogil=True)
def _one_node_cfunc(ctl_addr, x_addr, n, fmt):
    return one_node_step(control.control_at(ctl_addr), x_addr, n, fmt)


# -- split-phase one-node all-reduce: start publishes, finish completes ------
#
# An async all-reduce (torch's async_op=True) starts with one_node_start:
# this rank's data goes into its slot and its flag is published, so the
# peers can proceed, and the call returns while the caller computes.
# one_node_finish then waits for the peers, checks the metas and sums. The
# two halves are stage_at split at its wait (the same steps, flag rounds
# and checks as one_node_step, so a rank taking the blocking path meets a
# rank taking the split one). The context stays "busy" in between: another
# entry on it is refused until the finish. A call of more than one slot
# runs whole in the start (its later steps need the peers).

#: what a started split-phase all-reduce's finish does (control field "split")
SPLIT_NONE, SPLIT_DONE, SPLIT_SMALL, SPLIT_RSAG = 0, 1, 2, 3


@numba.njit(cache=True, nogil=True)
def _one_node_start(ctl, x_addr, n, fmt, w):
    c = ctl[0]
    isz = w.itemsize
    total = n * isz
    if total > c.slot_nbytes:
        c.split = SPLIT_DONE
        return _one_node(ctl, x_addr, n, fmt)
    code = c.auto_code | fmt
    if c.tuning != 0:  # read the tuner's mode; only blocking calls tune
        c.mode = copytune.choose(_tune_state(c), c.tune_table, False, False, total)
    if total <= c.small_max_nbytes or c.local_size == 1:
        pos = _ring_pos(c, total)
        c.split = SPLIT_SMALL
        c.split_pos = pos
        return stage_post(ctl, x_addr, n, 0, 0, total, code, w, pos)
    lo, hi = part_bounds(n, c.local_size, c.local_rank, isz)
    c.split = SPLIT_RSAG
    c.split_pos = 0
    return stage_post(ctl, x_addr, n, lo, hi, total, code, w, 0)


@numba.njit(cache=True, nogil=True)
def _one_node_finish(ctl, x_addr, n, fmt, w):
    c = ctl[0]
    split = c.split
    c.split = SPLIT_NONE
    if split == SPLIT_DONE:
        return OK
    isz = w.itemsize
    total = n * isz
    pos = c.split_pos
    status = stage_check(ctl, total, c.auto_code | fmt, pos)
    if status != OK:
        return status
    if split == SPLIT_SMALL:
        lo = pos // isz
        sum_slots(ctl, x_addr, lo, lo + n, fmt, w)
        c.ring = pos + ((total + 63) & ~63)
        return OK
    return _reduce_scatter_allgather(ctl, x_addr, n, fmt, w)


@numba.njit(STEP_SIG, cache=True, nogil=True)
def one_node_start(ctl, x_addr, n, fmt):
    """Start a split-phase auto all-reduce on one node (see above). On OK the
    context stays entered until one_node_finish; on failure it is left."""
    rc = enter(ctl)
    if rc != OK:
        return rc
    if ctl[0].profile != 0:
        begin(ctl, n * format_itemsize(fmt), ctl[0].auto_code | fmt)
    if fmt == _BF16 or fmt == _F16:
        rc = _one_node_start(ctl, x_addr, n, fmt, np.empty(0, np.uint16))
    elif fmt == _F32:
        rc = _one_node_start(ctl, x_addr, n, fmt, np.empty(0, np.float32))
    else:
        rc = _one_node_start(ctl, x_addr, n, fmt, np.empty(0, np.float64))
    if rc != OK:
        ctl[0].split = SPLIT_NONE
        leave(ctl)
    return rc


@numba.njit(STEP_SIG, cache=True, nogil=True)
def one_node_finish(ctl, x_addr, n, fmt):
    """Complete the all-reduce one_node_start started (same arguments)."""
    if fmt == _BF16 or fmt == _F16:
        rc = _one_node_finish(ctl, x_addr, n, fmt, np.empty(0, np.uint16))
    elif fmt == _F32:
        rc = _one_node_finish(ctl, x_addr, n, fmt, np.empty(0, np.float32))
    else:
        rc = _one_node_finish(ctl, x_addr, n, fmt, np.empty(0, np.float64))
    leave(ctl)
    return rc


@numba.njit(STEP_SIG, cache=True, nogil=True)
def solo_step(ctl, x_addr, n, fmt):
    """A communicator of one rank: the sum is x itself. (Refused to other
    threads like every entry, so a program behaves the same at any size.)"""
    if foreign_thread(ctl):
        return WRONG_THREAD
    if ctl[0].profile != 0:
        begin(ctl, n * format_itemsize(fmt), ctl[0].auto_code | fmt)
        profrec.record(ctl)
    return OK


@numba.cfunc(CFUNC_SIG, cache=True, nogil=True)
def _solo_cfunc(ctl_addr, x_addr, n, fmt):
    return solo_step(control.control_at(ctl_addr), x_addr, n, fmt)


def entry_point(dispatcher, sig):
    """The compiled function of ``dispatcher`` for ``sig``, callable without
    the dispatcher's per-call typing of every argument (~0.1 us saved on a
    hot path whose argument types are fixed). Under NUMBA_DISABLE_JIT it is
    the plain Python function."""
    get = getattr(dispatcher, "get_overload", None)
    return dispatcher if get is None else get(sig)


def _cfunc_address(cf):
    """A cfunc's C address (0 under NUMBA_DISABLE_JIT, where there is none)."""
    return getattr(cf, "address", 0)


ONE_NODE_STEP = entry_point(one_node_step, STEP_SIG)
ONE_NODE_CFUNC = _cfunc_address(_one_node_cfunc)
SOLO_STEP = entry_point(solo_step, STEP_SIG)
SOLO_CFUNC = _cfunc_address(_solo_cfunc)
GATHER_STEP = entry_point(gather_step, _GATHER_SIG)
ONE_NODE_START = entry_point(one_node_start, STEP_SIG)
ONE_NODE_FINISH = entry_point(one_node_finish, STEP_SIG)
