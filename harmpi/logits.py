"""Vocabulary-sharded logits: uneven shards gathered along the last dimension
(allgather along any other dimension: harmpi.gatherdim).

gather_logits
-------------
Before: rank r holds shard_r of shape (*lead, w_r): the same lead shape and
        dtype everywhere, widths w_r that may differ (0 allowed).
After:  every rank holds cat([shard_0, ..., shard_{n-1}], dim=-1), shape
        (*lead, V) with V = w_0 + ... + w_{n-1}, bitwise identical on every rank.

Two routes (DESIGN.md, "The logits collective"):

``allgather``
    Each rank pads its rows to the widest shard (W = max w_r) in a scratch
    buffer, the hierarchical allgather (shm gather + one rail exchange) moves
    rows*W per rank, and one compiled copy places every rank's w_r columns at
    its offset. Pure copies: every value arrives with its bits, NaN payloads
    included. (Equal widths and one row: the allgather writes the result
    directly, no copy.)
``allreduce``
    Each rank writes its shard at its column offset into a full (*lead, V)
    tensor whose other columns hold **-0.0**, and the HAR all-reduce sums it.
    -0.0 is the additive identity of IEEE 754 (x + -0.0 == x for every x,
    -0.0 included; +0.0 would turn a -0.0 logit into +0.0), and every
    element has one non-(-0.0) input, so each partial sum, in any order and
    at any stage (bf16/f16 widened to float32 exactly and narrowed back), is
    that input: the result is exact, +-0.0, +-inf and subnormals included.
    Exception: a NaN stays a NaN, but comes out quiet and with its payload
    as harmpi.reduce leaves it (a signalling NaN's bits change); use the
    allgather route if NaN payloads matter. Moves rows*V per rank instead of
    rows*W, but runs the all-reduce's compiled entries.

Widths without a collective per call
------------------------------------
A rank learns the width table with one small harmpi allgather the first time
it sees a shard width, and keeps the table of the last exchange (one per
communicator). Later calls with the same width run only the data collective.
A rank whose width changed exchanges again; a rank that did not runs its
data collective, and the two collectives differ in kind, so harmpi's
per-call check raises HarmpiMismatchError on every rank. On top of that
every data collective carries a 24-bit digest of (lead shape, width table):
the allgather route in its kind word (compared on every rank before data
moves), the allreduce route as 3 small integers per rank appended to the
summed tensor (exact, every rank compares them with its own after the sum
and raises before returning). Disagreeing ranks therefore raise
HarmpiMismatchError on every rank; they never return wrong data.

Choosing a route (``route=None``)
--------------------------------
Config.logits_route (HARMPI_LOGITS_ROUTE): "allgather", "allreduce" or
"auto"; auto takes the allreduce route on several nodes when the full
result is at most Config.logits_allreduce_max_nbytes
(HARMPI_LOGITS_ALLREDUCE_MAX_BYTES, default 192 KiB), and the allgather
route otherwise. The route depends on the width table (the same on every
rank) and on the call's rows and dtype: ranks that disagree about the batch
*and* fall on both sides of the threshold run different collectives; every
rank still raises, but across nodes some may raise HarmpiTimeoutError
("gave up") rather than HarmpiMismatchError, and the context is unusable.
Pass ``route=`` to rule that out.

Measured (bench.logits, bf16, vocabulary split evenly, one 2-core VM shared
with other jobs, load 6-9; 5 runs of 200 interleaved iterations, the
slowest rank's median per run; median over the runs of the ratio
allreduce/allgather, its range, and the median times in us):

===========  =========  ====  ===============  ============  ============
config       result     rows  ratio (range)    allgather us  allreduce us
===========  =========  ====  ===============  ============  ============
1 node x 2   64 KiB     1     2.20 (1.9-15)    44            331
1 node x 2   128 KiB    2     1.72 (1.5-3.3)   50            87
1 node x 2   256 KiB    4     1.80 (1.1-3.0)   90            162
1 node x 2   297 KiB    1     1.54 (1.1-3.9)   92            118
1 node x 2   1.2 MiB    4     1.78 (1.5-2.7)   468           925
2 x 1, tcp   64 KiB     1     1.00 (0.95-1.8)  309           295
2 x 1, tcp   128 KiB    2     0.96 (0.81-1.0)  350           326
2 x 1, tcp   192 KiB    3     1.00 (0.98-1.1)  361           359
2 x 1, tcp   256 KiB    4     1.70 (0.36-1.7)  381           649
2 x 1, tcp   512 KiB    4     2.08 (1.9-2.2)   455           985
2 x 2, tcp   64 KiB     1     0.80 (0.74-1.1)  552           439
2 x 2, tcp   128 KiB    2     0.81 (0.77-1.3)  564           595
2 x 2, tcp   192 KiB    3     0.88 (0.84-1.4)  636           582
2 x 2, tcp   256 KiB    4     1.57 (1.4-1.6)   1121          1761
2 x 2, tcp   512 KiB    4     1.64 (1.5-1.9)   1027          1649
===========  =========  ====  ===============  ============  ============

(vocab 32768 for rows 1-4 up to 256 KiB, 65536 at 512 KiB, 152064 for
297 KiB and 1.2 MiB; 128 KiB with vocab 65536 x 1 row gave 1.99 / 0.97 /
0.90.) One node: the allgather route wins at every size (the compiled
gather moves w_r per rank; the all-reduce sums V). Across nodes the
all-reduce route is ahead by 10-20% on 2 x 2 and even on 2 x 1 up to
192 KiB, and 1.4-2.1x behind from 256 KiB on: there its tensor (result +
check tail) passes har_latency_max_nbytes (256 KiB) and leaves the compiled
two-node step for the Python har_bandwidth. Hence the default threshold,
192 KiB, the largest measured size at which it did not lose; with
HARMPI_HAR_LATENCY_MAX_BYTES changed, move it below that too.

"""

from __future__ import annotations

import math
import threading
import weakref
import zlib
from typing import Any, TypeVar

import numpy as np

from .args import context, describe, refuse
from .base import dtypes, kind
from .errors import HarmpiArgumentError, HarmpiError, HarmpiMismatchError
from .node.rowcopy import DST_OFF, DST_ROW, copy_rows, make_plan, pad_rows, same_bytes
from .runtime.context import AUTO_CODE

#: a CPU torch tensor or numpy array: one rank's vocabulary shard
Shard = TypeVar("Shard")

__all__ = ["ROUTES", "gather_logits", "gather_uneven", "reset_widths", "choose_route",
           "check_route", "negzero_bytes", "tail_patterns", "state_of", "gather_raw",
           "empty_like", "PLANS_MAX"]

#: the routes of gather_logits (Config.logits_route also takes "auto")
ROUTES = ("allgather", "allreduce")
#: small integers per rank appended to an allreduce route's tensor: the digest, a byte each
TAIL_PER_RANK = 3
_HINT = ("(gather_logits: every rank must pass its shard with the same leading shape and dtype, "
         "and the widths the ranks learned together; a rank whose width changed since its last "
         "call learns the widths again while the others do not: if the split changed on "
         "purpose, call harmpi.logits.reset_widths(comm) on every rank first)")
#: digest of the width exchange's allgather (its kind word differs from any data call's)
_WIDTHS_DIGEST = kind.shape_digest(("harmpi.logits", "widths"))
PLANS_MAX = 256


# -- pure helpers ---------------------------------------------------------------

def check_route(route):
    """HarmpiArgumentError unless ``route`` is None, "auto" or one of ROUTES."""
    if route is not None and route != "auto" and route not in ROUTES:
        raise HarmpiArgumentError(f"route={route!r}: choose None, 'auto' or one of "
                                  f"{', '.join(ROUTES)}")


def choose_route(route, config_route, node_count, nbytes, allreduce_max_nbytes):
    """The route of one call: ``route`` (per call) if given, else the
    configured one; "auto": allreduce on several nodes up to
    ``allreduce_max_nbytes`` of result (rows * V * itemsize), else allgather."""
    route = route or config_route
    if route == "auto":
        return "allreduce" if node_count > 1 and nbytes <= allreduce_max_nbytes else "allgather"
    check_route(route)
    return route


def negzero_bytes(itemsize, count):
    """uint8 array of ``count`` negative zeros of an ``itemsize``-byte float
    (little-endian: only the sign bit of the top byte is set)."""
    a = np.zeros((count, itemsize), np.uint8)
    a[:, itemsize - 1] = 0x80
    return a.reshape(-1)


def _encode(values, fmt):
    """Storage bytes of small non-negative integers in format ``fmt``."""
    f = dtypes.FORMATS[fmt]
    v = np.asarray(values, np.float64)
    if fmt == dtypes.BF16:
        bits = (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    elif fmt == dtypes.F16:
        bits = v.astype(np.float16).view(np.uint16)
    else:
        bits = v.astype(f.storage)
    return np.ascontiguousarray(bits).view(np.uint8).reshape(-1)


def tail_patterns(digest, rank, nranks, fmt):
    """(mine, expected) uint8 arrays of the allreduce route's check tail:
    TAIL_PER_RANK elements per rank. ``mine`` holds the bytes of ``digest``
    (as small integers) in this rank's elements and -0.0 elsewhere;
    ``expected`` is what the sum holds when every rank passed ``digest``."""
    isz = dtypes.FORMATS[fmt].itemsize
    digits = [(digest >> (8 * k)) & 0xFF for k in range(TAIL_PER_RANK)]
    one = _encode(digits, fmt)
    mine = negzero_bytes(isz, TAIL_PER_RANK * nranks)
    span = TAIL_PER_RANK * isz
    mine[rank * span:(rank + 1) * span] = one
    return mine, np.tile(one, nranks)


def _digest(*parts):
    return zlib.crc32(repr(parts).encode()) & 0xFFFFFF


# -- per-communicator state -----------------------------------------------------

class _Table:
    """The vocabulary widths of every rank (learned together, or given)."""

    def __init__(self, widths, rank):
        self.widths = tuple(int(w) for w in widths)
        self.rank = rank
        self.mine = self.widths[rank]
        self.total = sum(self.widths)
        self.wmax = max(self.widths)
        self.offsets = tuple(int(o) for o in np.cumsum((0,) + self.widths[:-1]))
        self.uniform = all(w == self.wmax for w in self.widths)
        self._cache = {}

    def cached(self, key, make):
        value = self._cache.get(key)
        if value is None:
            if len(self._cache) > PLANS_MAX:
                self._cache.clear()
            value = self._cache[key] = make()
        return value

    def digest(self, lead):
        return self.cached(("digest", lead), lambda: _digest("logits", lead, self.widths))

    def tails(self, lead, fmt):
        return self.cached(("tails", lead, fmt), lambda: tail_patterns(
            self.digest(lead), self.rank, len(self.widths), fmt))

    def plan(self, rows, isz):
        """(pad, assemble) copy_rows arguments of the allgather route: the
        pad copies my rows into W-wide rows; the assembly reads rank r's
        block (rows x W) and writes its w_r columns at its offset of a
        (rows, V) result."""
        def make():
            n, w, W, V = len(self.widths), self.mine, self.wmax, self.total
            widths = np.array(self.widths, np.int64)
            pad = make_plan(w * isz, 0, w * isz, 0, W * isz)
            assemble = make_plan(widths * isz, np.arange(n) * rows * W * isz, W * isz,
                                 np.array(self.offsets) * isz, V * isz)
            return pad, assemble
        return self.cached(("plan", rows, isz), make)


class _State:
    """What gather_logits and allgather_dim keep per context: the width table
    of the last exchange, a scratch buffer, a -0.0 pattern, copy plans."""

    def __init__(self):
        self.lock = threading.Lock()
        self.table = None
        self.tables = {}
        self.plans = {}
        self._scratch = np.empty(0, np.uint8)
        self._negzero = {}

    def scratch(self, nbytes):
        """Address of at least ``nbytes`` scratch bytes (64-byte aligned)."""
        if self._scratch.nbytes < nbytes + 64:
            self._scratch = np.empty(max(nbytes + 64, 2 * self._scratch.nbytes), np.uint8)
        addr = self._scratch.ctypes.data
        return addr + (-addr) % 64

    def negzero(self, itemsize, count):
        """Address of at least ``count`` -0.0 elements of ``itemsize`` bytes."""
        pat = self._negzero.get(itemsize)
        if pat is None or pat.nbytes < count * itemsize:
            pat = self._negzero[itemsize] = negzero_bytes(itemsize, max(count, 1024))
        return pat.ctypes.data

    def uneven_table(self, widths, rank):
        table = self.tables.get(widths)
        if table is None:
            if len(self.tables) > PLANS_MAX:
                self.tables.clear()
            table = self.tables[widths] = _Table(widths, rank)
        return table

    def enter(self, what):
        if not self.lock.acquire(blocking=False):
            raise HarmpiError(f"{what}: another thread is inside a gather on this communicator; "
                              "call harmpi's collectives on one communicator from one thread at a "
                              "time")


#: per-context state; a context that is freed and collected takes its entry along
_STATES = weakref.WeakKeyDictionary()


def state_of(ctx):
    st = _STATES.get(ctx)
    if st is None:
        st = _STATES[ctx] = _State()
    return st


# -- the collectives underneath ---------------------------------------------------

def gather_raw(ctx, src, dst, n, fmt, digest, op):
    """The context's allgather entry on raw addresses (n elements per rank)."""
    try:
        rc = ctx.gather(ctx.ctl, src, dst, n, fmt, digest)
        if rc:
            ctx.raise_status(rc, src, n, fmt, kind.encode(fmt=fmt, coll=kind.COLL_ALLGATHER,
                                                          digest=digest), op)
    except KeyboardInterrupt:
        ctx.interrupted()
        raise


def _allreduce_raw(ctx, addr, n, fmt, op):
    """The context's all-reduce entry on raw addresses."""
    try:
        rc = ctx.entry(ctx.ctl, addr, n, fmt)
        if rc:
            ctx.raise_status(rc, addr, n, fmt, AUTO_CODE | fmt, op)
    except KeyboardInterrupt:
        ctx.interrupted()
        raise


def _exchange_widths(ctx, width, route):
    """The width table of every rank, by the collective ``route`` runs: an
    allgather of one int64 per rank, or an all-reduce of n float64 (this
    rank's width at its index, -0.0 elsewhere: the sum is exact). Ranks that
    did not lose their table run that route's data collective meanwhile:
    the same collective, another size, so harmpi's check raises
    HarmpiMismatchError on every rank (a mix of an allgather and an
    all-reduce across nodes would leave some ranks with a timeout instead)."""
    n, rank = ctx.topo.size, ctx.topo.rank
    op = "gather_logits (width exchange)"
    if route == "allreduce":
        vec = np.full(n, -0.0)
        vec[rank] = width
        _allreduce_raw(ctx, vec.ctypes.data, n, dtypes.F64, op)
        return _Table(vec.astype(np.int64).tolist(), rank)
    mine = np.array([width], np.int64)
    widths = np.empty(n, np.int64)
    # raw int64 bits travel as f64 elements: the allgather only copies
    gather_raw(ctx, mine.ctypes.data, widths.ctypes.data, 1, dtypes.F64, _WIDTHS_DIGEST, op)
    return _Table(widths.tolist(), rank)


def _allgather_route(ctx, st, table, src, rows, lead, fmt, isz, dst, assemble_dst):
    """Rows of every rank's shard into ``dst`` (assemble_dst: (destination
    offsets, row strides) of a copy_rows plan, or None: ``dst`` is a
    (rows, V) result that the allgather may write directly)."""
    n, W = len(table.widths), table.wmax
    digest = table.digest(lead)
    if assemble_dst is None and rows == 1 and table.uniform:
        gather_raw(ctx, src, dst, W, fmt, digest, "gather_logits")
        return
    pad, assemble = table.plan(rows, isz)
    block = rows * W * isz
    buf = st.scratch(block * (n + 1))
    gathered = buf + block
    if table.mine != W:  # pad my rows to W (the pad columns are never read)
        copy_rows(src, buf, rows, pad)
        src = buf
    if assemble_dst is not None:
        assemble = assemble.copy()
        assemble[DST_OFF], assemble[DST_ROW] = assemble_dst
    gather_raw(ctx, src, gathered, rows * W, fmt, digest, "gather_logits")
    copy_rows(gathered, dst, rows, assemble)


def _allreduce_route(ctx, st, table, src, rows, lead, fmt, isz, full):
    """Sum the -0.0-padded (rows, V) tensor plus the check tail at ``full``;
    HarmpiMismatchError on every rank if the tails disagree."""
    n, V = len(table.widths), table.total
    mine, expected = table.tails(lead, fmt)
    tail_n = TAIL_PER_RANK * n
    pad_rows(full, src, st.negzero(isz, V), rows, V * isz, table.offsets[table.rank] * isz,
             table.mine * isz, mine.ctypes.data, mine.nbytes)
    count = rows * V + tail_n
    _allreduce_raw(ctx, full, count, fmt, "gather_logits")
    if not same_bytes(full + rows * V * isz, expected.ctypes.data, expected.nbytes):
        raise HarmpiMismatchError(
            f"rank {ctx.topo.rank}: gather_logits: ranks disagree about the shards' widths or "
            f"leading shape (this rank: widths {list(table.widths)}, shape {lead} + (width,)). "
            "Every rank must pass its shard with the same leading shape and learn the same widths")


def _check_shard(shard):
    addr, count, fmt, is_torch = describe(shard, None, False)
    shape = tuple(shard.shape)
    if not shape:
        raise HarmpiArgumentError("a 0-d shard has no vocabulary dimension; pass shape "
                                  "(..., width)")
    return addr, fmt, is_torch, shape


def empty_like(like, shape, is_torch):
    return like.new_empty(shape) if is_torch else np.empty(shape, like.dtype)


def _addr(x, is_torch):
    return x.data_ptr() if is_torch else x.ctypes.data


# -- public ---------------------------------------------------------------------

def gather_logits(shard: Shard, comm: Any = None, route: str | None = None) -> Shard:
    """Concatenate every rank's vocabulary shard along the last dimension.

    Before: rank r holds ``shard`` of shape (*lead, w_r): same lead shape and
            dtype on every rank, widths that may differ (0 allowed).
    After:  every rank gets cat([shard_0, ..., shard_{n-1}], dim=-1), shape
            (*lead, sum of w_r), in communicator rank order, bitwise identical
            everywhere and exact (values are copied, never changed; see the
            module docstring for NaN payloads on the allreduce route).

    ``shard``: contiguous CPU tensor or numpy array of bfloat16, float16,
    float32 or float64; it is only read. ``route``: None (Config.logits_route,
    default auto), "auto", "allgather" or "allreduce". The first call, and a
    call after this rank's width changed, learns every rank's width with one
    small collective first; other calls run one collective. Ranks that disagree about
    the widths or the leading shape raise HarmpiMismatchError on every rank.
    On the allreduce route the result is a view of a slightly longer buffer
    (the check tail, 3 elements per rank, follows it); it is contiguous.
    """
    try:
        addr, fmt, is_torch, shape = _check_shard(shard)
        ctx = context(comm)
        check_route(route)
    except HarmpiArgumentError as exc:
        refuse(comm, kind.COLL_ALLGATHER, exc)  # the peers may be in the call: tell them
        raise
    cfg = ctx.config
    st = state_of(ctx)
    st.enter("gather_logits")
    try:
        return _gather_logits(ctx, st, cfg, shard, addr, fmt, is_torch, shape, route)
    except HarmpiMismatchError as exc:
        raise HarmpiMismatchError(f"{exc} {_HINT}") from exc
    finally:
        st.lock.release()


def _gather_logits(ctx, st, cfg, shard, addr, fmt, is_torch, shape, route):
    """gather_logits under the context's lock: widths, route, collective."""
    lead = shape[:-1]
    rows, isz = math.prod(lead), dtypes.FORMATS[fmt].itemsize
    table = st.table
    if table is None or table.mine != shape[-1]:
        # by the collective the other ranks run if they kept the table (they
        # all hold the same one: each exchange completes on every rank or on
        # none, and a failed one keeps the old table)
        old_nbytes = rows * table.total * isz if table is not None else 1 << 62
        table = st.table = _exchange_widths(ctx, shape[-1], choose_route(
            route, cfg.logits_route, ctx.topo.node_count, old_nbytes,
            cfg.logits_allreduce_max_nbytes))
    V = table.total
    chosen = choose_route(route, cfg.logits_route, ctx.topo.node_count, rows * V * isz,
                          cfg.logits_allreduce_max_nbytes)
    if chosen == "allgather":
        out = empty_like(shard, lead + (V,), is_torch)
        _allgather_route(ctx, st, table, addr, rows, lead, fmt, isz, _addr(out, is_torch),
                         None)
        return out
    full = empty_like(shard, (rows * V + TAIL_PER_RANK * len(table.widths),), is_torch)
    _allreduce_route(ctx, st, table, addr, rows, lead, fmt, isz, _addr(full, is_torch))
    return full[:rows * V].reshape(lead + (V,))


def reset_widths(comm: Any = None) -> None:
    """Forget the width table this rank learned on ``comm`` (local, no
    communication). For a vocabulary split changed on purpose: call it on
    every rank, and the next gather_logits learns the widths again on every
    rank (a rank whose width did not change would otherwise keep its table,
    and the call would raise HarmpiMismatchError)."""
    st = _STATES.get(context(comm))
    if st is not None:
        st.table = None


def gather_uneven(t: Shard, outs: list[Shard], comm: Any = None,
                  route: str | None = None) -> list[Shard]:
    """``outs[r][...] = t of rank r`` for every rank r; return ``outs``.

    The torch.distributed ``all_gather(tensor_list, t)`` of shards whose last
    dimension differs between ranks. Before: rank r holds ``t`` of shape
    (*lead, w_r) and a list ``outs`` of n contiguous, writable tensors (or
    arrays) of t's kind and dtype, outs[q] of shape (*lead, w_q). After:
    outs[q] holds rank q's ``t`` on every rank, bitwise. The widths come from
    ``outs`` (no exchange); ranks whose lists disagree raise
    HarmpiMismatchError on every rank. ``route`` as in :func:`gather_logits`.
    """
    try:
        ctx, addr, fmt, shape, addrs, widths = _uneven_args(t, outs, comm, route)
    except HarmpiArgumentError as exc:
        refuse(comm, kind.COLL_ALLGATHER, exc)  # the peers may be in the call: tell them
        raise
    rank, lead, n = ctx.topo.rank, shape[:-1], ctx.topo.size
    st = state_of(ctx)
    st.enter("gather_uneven")
    try:
        table = st.uneven_table(tuple(widths), rank)
        rows, V = math.prod(lead), table.total
        isz = dtypes.FORMATS[fmt].itemsize
        cfg = ctx.config
        chosen = choose_route(route, cfg.logits_route, ctx.topo.node_count, rows * V * isz,
                              cfg.logits_allreduce_max_nbytes)
        dst_off, dst_row = np.array(addrs, np.int64), np.array(widths, np.int64) * isz
        if chosen == "allgather":
            _allgather_route(ctx, st, table, addr, rows, lead, fmt, isz, 0, (dst_off, dst_row))
            return outs
        full = st.scratch((rows * V + TAIL_PER_RANK * n) * isz)
        _allreduce_route(ctx, st, table, addr, rows, lead, fmt, isz, full)
        copy_rows(full, 0, rows, make_plan(dst_row, np.array(table.offsets) * isz, V * isz,
                                           dst_off, dst_row))
        return outs
    finally:
        st.lock.release()


def _uneven_args(t, outs, comm, route):
    """gather_uneven's checks, before anything moves: (ctx, t's address,
    format, shape, the outputs' addresses, their widths)."""
    addr, fmt, is_torch, shape = _check_shard(t)
    ctx = context(comm)
    n, rank = ctx.topo.size, ctx.topo.rank
    lead = shape[:-1]
    if not isinstance(outs, (list, tuple)) or len(outs) != n:
        got = f"{len(outs)}" if isinstance(outs, (list, tuple)) else type(outs).__name__
        raise HarmpiArgumentError(f"outs must be a list of {n} tensors (one per rank), got {got}")
    addrs, widths = [], []
    for q, o in enumerate(outs):
        o_addr, _, o_fmt, o_torch = describe(o, None, True)
        o_shape = tuple(o.shape)
        if o_torch != is_torch or o_fmt != fmt or o_shape[:-1] != lead or not o_shape:
            raise HarmpiArgumentError(
                f"outs[{q}] must be a {'tensor' if is_torch else 'numpy array'} of t's dtype and "
                f"shape {lead} + (width,); got {type(o).__name__} of shape {o_shape}")
        addrs.append(o_addr)
        widths.append(o_shape[-1])
    if widths[rank] != shape[-1]:
        raise HarmpiArgumentError(f"outs[{rank}] (this rank's) has width {widths[rank]} but t has "
                                  f"{shape[-1]}")
    check_route(route)
    return ctx, addr, fmt, shape, addrs, widths
