"""The node's data steps: sum, share and gather the slots of a step.

Each runs after a stage (harmpi.node.flags) has filled and checked the
step's slots, on the slots of that step's parity, and reads them only
until the step's next flag round. ``shm_allreduce`` and ``gather_node``
chain stages and steps into a whole single-node all-reduce and allgather,
chunk by chunk.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types

from ..base import control, copytune
from ..base.control import OK
from .cma import CMA_MIN_NBYTES, read_peer
from .copy import copy_bytes, done_reading, memcpy, stream_copy, streams
from .dispatch import sigs, sum2, sum_rows, sum_rows_x
from .flags import publish_wait, publish_wait_status, stage_at
from .layout import parity_slot_addr, part_bounds, ring_pos, slots2d, step_parity

__all__ = ["sum_slots", "sum_own_part", "gather_parts", "reduce_scatter_allgather",
           "tune_state", "shm_allreduce", "add_into", "copy_slot", "copy_blocks", "gather_node",
           "add_publish_sum", "NEVER_RSAG"]

_i64 = types.int64
_ctl = control.ARRAY
_voidptr = control.voidptr
#: small_max_nbytes that keeps every step on the sum-every-slot branch
NEVER_RSAG = 1 << 62


@numba.njit(sigs(types.void, _ctl, types.intp, _i64, _i64, _i64, "W"), cache=True, nogil=True)
def sum_slots(ctl, out_addr, lo, hi, fmt, w):
    """out[0:hi-lo] = sum over local ranks, in rank order, of slot[lo:hi] (current step)."""
    if hi <= lo:
        return
    c = ctl[0]
    slots = slots2d(c, step_parity(c), w)
    out = numba.carray(_voidptr(out_addr), (hi - lo,), w.dtype)
    sum_rows(slots, lo, hi, out, 0, fmt)
    for j in range(c.local_size):
        if j != c.local_rank:
            done_reading(c, slots[j, lo:hi].ctypes.data, (hi - lo) * w.itemsize)


@numba.njit(sigs(types.void, _ctl, _i64, _i64, _i64, "W"), cache=True, nogil=True)
def sum_own_part(ctl, lo, hi, fmt, w):
    """Reduce-scatter step: slot(p, me)[lo:hi] = sum over ranks of slot[lo:hi]."""
    if hi <= lo:
        return
    c = ctl[0]
    slots = slots2d(c, step_parity(c), w)
    sum_rows(slots, lo, hi, slots[c.local_rank], lo, fmt)


@numba.njit(sigs(types.void, _ctl, types.intp, _i64, "W"), cache=True, nogil=True)
def gather_parts(ctl, out_addr, m, w):
    """Allgather step: out[lo_j:hi_j] = slot(p, j)[lo_j:hi_j] for every local rank j."""
    if m <= 0:
        return
    c = ctl[0]
    slots = slots2d(c, step_parity(c), w)
    L = c.local_size
    isz = w.itemsize
    for j in range(L):
        lo, hi = part_bounds(m, L, j, isz)
        if hi > lo:
            memcpy(out_addr + lo * isz, slots[j, lo:hi].ctypes.data, (hi - lo) * isz)


@numba.njit(cache=True, nogil=True)
def reduce_scatter_allgather(ctl, x_addr, m, fmt, w):
    """After a stage that skipped my share: sum my share of every slot, with
    my own row read from x, into my slot (for the others) and into x (for
    me) in one pass; publish; copy the other ranks' shares into x."""
    c = ctl[0]
    L = c.local_size
    me = c.local_rank
    isz = w.itemsize
    lo, hi = part_bounds(m, L, me, isz)
    slots = slots2d(c, step_parity(c), w)
    x = numba.carray(_voidptr(x_addr), (m,), w.dtype)
    if hi > lo:
        # one pass writes the share to my slot (for the others) and to x.
        # (Not x alone and then a streaming copy to the slot: with out and
        # out2 both x the kernel cannot rule out aliasing and runs ~6x slower.)
        sum_rows_x(slots, lo, hi, me, x, slots[me], x, lo, fmt)
        for j in range(L):
            if j != me:
                done_reading(c, slots[j, lo:hi].ctypes.data, (hi - lo) * isz)
    status = publish_wait(ctl)
    if status != OK:
        return status
    for j in range(L):
        if j != me:
            jlo, jhi = part_bounds(m, L, j, isz)
            if jhi > jlo:
                memcpy(x_addr + jlo * isz, slots[j, jlo:jhi].ctypes.data, (jhi - jlo) * isz)
                done_reading(c, slots[j, jlo:jhi].ctypes.data, (jhi - jlo) * isz)
    return OK


@numba.njit(cache=True, nogil=True)
def _shm_chunk(ctl, addr, m, total, code, fmt, small, w):
    """One step of shm_allreduce over x[:m] at ``addr``."""
    c = ctl[0]
    isz = w.itemsize
    if small:
        pos = ring_pos(c, m * isz)
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
    return reduce_scatter_allgather(ctl, addr, m, fmt, w)


@numba.njit(cache=True, nogil=True)
def tune_state(c):
    """Local rank 0's tuner state (an empty view elsewhere)."""
    n = copytune.STATE_WORDS if c.tune_state != 0 else 0
    return numba.carray(_voidptr(c.tune_state), (n,), np.int64)


@numba.njit(sigs(_i64, _ctl, types.intp, _i64, _i64, _i64, _i64, "W"), cache=True, nogil=True)
def shm_allreduce(ctl, x_addr, n, code, fmt, small_max_nbytes, w):
    """Whole single-node all-reduce of x[:n] in place, chunk by chunk.

    Steps of at most ``small_max_nbytes``: every rank sums all slots (L*m
    reads each), placed at the ring position (ring_pos). Larger steps:
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
        c.mode = copytune.choose(tune_state(c), c.tune_table, leader, True, total)
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
                copytune.record(tune_state(c), total, copytune.read_ticks() - t0)
            return OK


@numba.njit(sigs(types.void, types.intp, types.intp, _i64, _i64, "W"), cache=True, nogil=True)
def add_into(a_addr, b_addr, m, fmt, w):
    """a[:m] = a[:m] + b[:m] (one rounding to the storage type)."""
    if m <= 0:
        return
    a = numba.carray(_voidptr(a_addr), (m,), w.dtype)
    b = numba.carray(_voidptr(b_addr), (m,), w.dtype)
    sum2(a, b, a, fmt)


@numba.njit(cache=True, nogil=True)
def add_to(out_addr, a_addr, b_addr, m, fmt, w):
    """out[:m] = a[:m] + b[:m] (one rounding; out may be a or b)."""
    if m <= 0:
        return
    a = numba.carray(_voidptr(a_addr), (m,), w.dtype)
    b = numba.carray(_voidptr(b_addr), (m,), w.dtype)
    out = numba.carray(_voidptr(out_addr), (m,), w.dtype)
    sum2(a, b, out, fmt)


@numba.njit(sigs(types.void, _ctl, _i64, types.intp, _i64, _i64, "W"), cache=True, nogil=True)
def copy_slot(ctl, j, out_addr, lo, hi, w):
    """out[0:hi-lo] = slot(p, j)[lo:hi] for the current step."""
    if hi <= lo:
        return
    slots = slots2d(ctl[0], step_parity(ctl[0]), w)
    memcpy(out_addr, slots[j, lo:hi].ctypes.data, (hi - lo) * w.itemsize)


@numba.njit(sigs(types.void, _ctl, types.intp, _i64, _i64, _i64, "W"), cache=True, nogil=True)
def copy_blocks(ctl, out_addr, n, start, m, w):
    """Allgather copy-out: block g of slot(p, l) (m elements) goes to
    out[table[l, g]*n + start :][:m] for every local rank l and node g
    (the control block's gather table)."""
    if m <= 0:
        return
    c = ctl[0]
    L, G = c.local_size, c.gather_nodes
    table = numba.carray(_voidptr(c.gather_table), (L, G), np.int64)
    slots = slots2d(c, step_parity(c), w)
    isz = w.itemsize
    for lr in range(L):
        for g in range(G):
            o = (table[lr, g] * n + start) * isz
            memcpy(out_addr + o, slots[lr, g * m:].ctypes.data, m * isz)


@numba.njit(cache=True, nogil=True)
def _gather_direct(ctl, x_addr, out_addr, n, code, w):
    """The single-copy one-node allgather (harmpi.node.cma): (pid, address
    of x) in my slot, one flag round, every peer's x read straight into
    its block of out, mine copied, then a status round (no rank returns
    while a peer may still read its x)."""
    c = ctl[0]
    nbytes = n * w.itemsize
    mine = numba.carray(_voidptr(parity_slot_addr(c, c.steps & 1, c.local_rank)), (2,), np.int64)
    mine[0] = c.cma_pid
    mine[1] = x_addr
    rc = stage_at(ctl, 0, 0, 0, 0, nbytes, code, w, 0)
    if rc != OK:
        return rc
    table = numba.carray(_voidptr(c.gather_table), (c.local_size, c.gather_nodes), np.int64)
    bad = 0
    for j in range(c.local_size):
        o = table[j, 0] * nbytes
        if j == c.local_rank:
            memcpy(out_addr + o, x_addr, nbytes)
            continue
        theirs = numba.carray(_voidptr(parity_slot_addr(c, step_parity(c), j)), (2,), np.int64)
        if not read_peer(theirs[0], out_addr + o, theirs[1], nbytes):
            bad = 1
    return publish_wait_status(ctl, bad)


@numba.njit(cache=True, nogil=True)
def gather_node(ctl, x_addr, out_addr, n, code, w):
    """One node's whole allgather, chunk by chunk (at least one step, so a
    zero-size call still checks agreement): my chunk into my next slot,
    post meta, publish, wait, then every rank's chunk from its slot to its
    block of out. From CMA_MIN_NBYTES per rank where local ranks may read
    each other (cma_pid set), in one step reading the peers directly."""
    c = ctl[0]
    isz = w.itemsize
    if c.cma_pid != 0 and c.gather_nodes == 1 and n * isz >= CMA_MIN_NBYTES:
        return _gather_direct(ctl, x_addr, out_addr, n, code, w)
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


@numba.njit(sigs(_i64, _ctl, types.intp, types.intp, _i64, _i64, _i64, "W"),
            cache=True, nogil=True)
def add_publish_sum(ctl, x_addr, r_addr, m, status, fmt, w):
    """Tail of the hierarchical latency step in one call: with r_addr, my
    slot = x + r (the stage left the slot unfilled), unless status is
    non-zero; post ``status``, publish, wait, and if no rank failed, x[:m] =
    sum of the slots. Returns publish_wait_status's code."""
    c = ctl[0]
    if c.local_size == 1 and r_addr != 0:
        # one rank per node: x[:m] += r in place, after the (local) flag round,
        # so a failed step leaves x untouched. The slot and the 1-row sum
        # would only copy the same bits twice (2 x m bytes more at 1 MB).
        rc = publish_wait_status(ctl, status)
        if rc != OK:
            return rc
        if m > 0:
            add_into(x_addr, r_addr, m, fmt, w)
        return OK
    if status == 0 and r_addr != 0 and m > 0:
        mine = parity_slot_addr(c, step_parity(c), c.local_rank)
        if streams(c, m * w.itemsize):
            # sum into the private receive buffer, then stream it to the slot
            add_into(r_addr, x_addr, m, fmt, w)
            stream_copy(mine, r_addr, m * w.itemsize)
        else:
            x = numba.carray(_voidptr(x_addr), (m,), w.dtype)
            r = numba.carray(_voidptr(r_addr), (m,), w.dtype)
            sum2(x, r, numba.carray(_voidptr(mine), (m,), w.dtype), fmt)
    rc = publish_wait_status(ctl, status)
    if rc != OK:
        return rc
    sum_slots(ctl, x_addr, 0, m, fmt, w)
    return OK
