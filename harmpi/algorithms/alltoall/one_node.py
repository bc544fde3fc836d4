"""All-to-all on one node: through the node's slots, compiled, in one call.

Rank r holds x_r, rows along the first dimension; ``send[r][j]`` of its
rows (in order) go to rank j. Afterwards rank j holds the rows every rank
sent it, rank 0's first. The counts may change on every call (a MoE decode
step routes each token anew): they travel with the data, in the same round.

Slot layout (every rank, both parities): a header of 2P words at byte 0
(P = ranks of the communicator): ``send[0..P)`` rows to each rank,
``expect[0..P)`` rows this rank expects from each rank (-1: any); then P
blocks of C bytes, block j carrying the next C bytes of the rows for rank j
(C = (slot - header) / P, a multiple of 64: plan.geometry).

Steps (one call; a second when the caller must first see the receive
counts to size its output: alltoall_start, then alltoall_finish):
  1. step 0: write header and the first C bytes of every segment for
     another rank into my slot; post (row bytes, kind) and publish; wait
     for the node; compare every rank's (row bytes, kind);
  2. read every header: my receive counts; every (sender, receiver) pair
     against the receiver's expectation (every rank checks every pair, so
     a disagreement is seen alike everywhere and every rank raises);
     K = steps needed for the longest segment, the same everywhere;
  3. copy my segment of each peer's block straight into my output (my own
     rows from x);
  4. steps 1..K-1: the next C bytes of every segment, the same flag round.

Where the node's ranks may read each other's memory (harmpi.node.cma), a
segment of CMA_MIN_NBYTES or more skips the slots: its receiver reads it
from the sender's x with one process_vm_readv right after step 0 (the
header carries the sender's pid and x's address), and the call ends with a
status round when any pair of the node went so (no rank returns while a
peer may still read its x). Sender and receiver both know the segment's
size after step 0, so they agree on its way; K counts the slot segments
only. 1 x 2 on the 2-vCPU AMD EPYC, 256 KiB per pair: through the slots
22-27 us when the two vCPUs share a cache, 130 when they do not (every
rewrite of a slot line the peer read waits for its invalidation).

Invariants: pure copies, so nothing is rounded; a slot is rewritten two
steps later, after its readers passed the next step's wait (harmpi.node).
The kernels that fill a slot and copy my own rows (fill_slot, own_rows)
serve the two-node all-to-all too, so both meet in the same flag rounds.

Cost: one flag round per C bytes of the longest segment; every byte is
copied twice (into my slot, out of the sender's slot), my own rows once.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types

from ... import node
from ...base.control import ARRAY as _ctl
from ...base.control import OK, control_at
from ...base.control import voidptr as _voidptr
from ...node.cma import CMA_MIN_NBYTES, read_peer
from .plan import (
    bad_pair_at,
    geometry,
    plan_words,
    prefix,
    recv,
    recv_off,
    send,
    send_off,
    spread_even_rows,
    steps_at,
)

__all__ = ["ALLTOALL_STEP", "ALLTOALL_START", "ALLTOALL_FINISH", "ALLTOALL_CFUNC",
           "alltoall_start", "alltoall_finish", "alltoall_step", "fill_slot", "write_header",
           "own_rows", "direct"]

_i64 = types.int64
#: witness of the flag rounds (harmpi.node compiles them per storage type; with
#: no data copied by the round itself, any of its types will do)
_W = np.empty(0, np.uint16)
_memcpy = node.memcpy
_slot_addr = node.parity_slot_addr
_parity = node.step_parity


@numba.njit(cache=True, nogil=True)
def direct(c, nbytes):
    """Whether a segment of ``nbytes`` goes by a direct read of the sender's
    x (harmpi.node.cma; one node whose ranks may read each other) rather
    than through the sender's slot: the same answer for its sender and its
    receiver, which both know its size after step 0."""
    return c.cma_pid != 0 and nbytes >= CMA_MIN_NBYTES


@numba.njit(cache=True, nogil=True)
def write_header(c, x_addr, plan, P):
    """Step 0's header in my slot of the next step: the plan's send and
    expect rows, my pid and x's address."""
    base = _slot_addr(c, c.steps & 1, c.local_rank)
    hdr = numba.carray(_voidptr(base), (2 * P + 2,), np.int64)
    for j in range(2 * P):  # (send, then expect: the plan's first 2P words)
        hdr[j] = plan[j]
    hdr[2 * P] = c.cma_pid
    hdr[2 * P + 1] = x_addr


@numba.njit(cache=True, nogil=True)
def fill_slot(c, x_addr, row_nb, plan, P, me, k, head, block, with_header):
    """My slot of the next step: (step 0: the header, with my pid and x's
    address after it, then) chunk k of every segment bound for another rank
    that goes through the slot."""
    base = _slot_addr(c, c.steps & 1, c.local_rank)
    counts = send(plan, P)
    if with_header:
        write_header(c, x_addr, plan, P)
    off = send_off(plan, P)
    lo = k * block
    for j in range(P):
        seg = counts[j] * row_nb
        if j != me and lo < seg and not direct(c, seg):
            node.publish_copy(c, base + head + j * block, x_addr + off[j] * row_nb + lo,
                              min(block, seg - lo))


@numba.njit(cache=True, nogil=True)
def _read_headers(c, plan, P, me, row_nb, block):
    """After step 0's flag round (P = L): receive counts and offsets, the
    pair check, and the number of steps."""
    parity = _parity(c)
    rows_in = recv(plan, P)
    longest = 0
    bad = -1
    for i in range(P):
        hdr = numba.carray(_voidptr(_slot_addr(c, parity, i)), (2 * P,), np.int64)
        rows_in[i] = hdr[me]
        for j in range(P):
            if j != i and hdr[j] > longest and not direct(c, hdr[j] * row_nb):
                longest = hdr[j]
            if bad < 0:
                want = numba.carray(_voidptr(_slot_addr(c, parity, j)), (2 * P,), np.int64)[P + i]
                if want >= 0 and want != hdr[j]:
                    bad = i * P + j
    prefix(rows_in, recv_off(plan, P), P)
    steps = 1
    if block > 0 and longest * row_nb > block:
        steps = (longest * row_nb + block - 1) // block
    plan[steps_at(P)] = steps
    plan[bad_pair_at(P)] = bad


@numba.njit(cache=True, nogil=True)
def _copy_out(c, out_addr, row_nb, plan, P, me, k, head, block):
    """Chunk k of every peer's segment for me, from its slot into out."""
    parity = _parity(c)
    rows_in = recv(plan, P)
    roff = recv_off(plan, P)
    lo = k * block
    for i in range(P):
        seg = rows_in[i] * row_nb
        if i != me and lo < seg and not direct(c, seg):
            _memcpy(out_addr + roff[i] * row_nb + lo,
                    _slot_addr(c, parity, i) + head + me * block, min(block, seg - lo))


@numba.njit(cache=True, nogil=True)
def _read_direct(c, out_addr, row_nb, plan, P, me):
    """Right after step 0's flag round (its headers still in the slots):
    every direct segment for me read from its sender's x into out (none
    when out_addr is 0). Returns (whether any pair of the node goes direct,
    whether a read failed)."""
    parity = _parity(c)
    roff = recv_off(plan, P)
    any_direct = False
    bad = False
    for i in range(P):
        hdr = numba.carray(_voidptr(_slot_addr(c, parity, i)), (2 * P + 2,), np.int64)
        src = 0
        for j in range(P):
            seg = hdr[j] * row_nb
            if j != i and direct(c, seg):
                any_direct = True
                if j == me and out_addr != 0 and not read_peer(
                        hdr[2 * P], out_addr + roff[i] * row_nb, hdr[2 * P + 1] + src, seg):
                    bad = True
            src += seg
    return any_direct, bad


@numba.njit(cache=True, nogil=True)
def own_rows(x_addr, out_addr, row_nb, plan, P, me):
    """My own rows, from x straight into out."""
    n = send(plan, P)[me] * row_nb
    if n > 0:
        _memcpy(out_addr + recv_off(plan, P)[me] * row_nb,
                x_addr + send_off(plan, P)[me] * row_nb, n)


_START_SIG = _i64(_ctl, types.intp, _i64, types.int64[::1], _i64)
_FINISH_SIG = _i64(_ctl, types.intp, types.intp, _i64, types.int64[::1], _i64)


@numba.njit(_START_SIG, cache=True, nogil=True)
def alltoall_start(ctl, x_addr, row_nb, plan, code):
    """Enter, step 0's flag round, the headers read (plan: recv, recv_off,
    steps, bad_pair). On OK the context stays entered until
    alltoall_finish; on failure it is left."""
    rc = node.enter(ctl)
    if rc != OK:
        return rc
    c = ctl[0]
    P, me = c.local_size, c.local_rank
    spread_even_rows(plan, P)
    total = prefix(send(plan, P), send_off(plan, P), P)
    if c.profile != 0:
        node.begin(ctl, total * row_nb, code)
    head, block = geometry(c.slot_nbytes, P)
    fill_slot(c, x_addr, row_nb, plan, P, me, 0, head, block, True)
    rc = node.stage_at(ctl, 0, 0, 0, 0, row_nb, code, _W, 0)
    if rc != OK:
        node.leave(ctl)
        return rc
    _read_headers(c, plan, P, me, row_nb, block)
    return OK


@numba.njit(_FINISH_SIG, cache=True, nogil=True)
def alltoall_finish(ctl, x_addr, out_addr, row_nb, plan, code):
    """The copies of step 0 and steps 1..K-1 (out_addr 0: take part without
    copying out, after a local error); leaves the context. A pair mismatch
    (seen by every rank) skips the rest everywhere."""
    c = ctl[0]
    P, me = c.local_size, c.local_rank
    rc = OK
    if plan[bad_pair_at(P)] < 0:
        head, block = geometry(c.slot_nbytes, P)
        if out_addr != 0:
            own_rows(x_addr, out_addr, row_nb, plan, P, me)
        any_direct, bad = _read_direct(c, out_addr, row_nb, plan, P, me)
        for k in range(plan[steps_at(P)]):
            if k > 0:
                fill_slot(c, x_addr, row_nb, plan, P, me, k, head, block, False)
                rc = node.stage_at(ctl, 0, 0, 0, 0, row_nb, code, _W, 0)
                if rc != OK:
                    break
            if out_addr != 0:
                _copy_out(c, out_addr, row_nb, plan, P, me, k, head, block)
        if any_direct and rc == OK:
            # no rank returns (its caller may then write or free x) while a
            # peer may still read its x; a failed read fails every rank
            rc = node.publish_wait_status(ctl, 1 if bad else 0)
    node.leave(ctl)
    return rc


@numba.njit(_FINISH_SIG, cache=True, nogil=True)
def alltoall_step(ctl, x_addr, out_addr, row_nb, plan, code):
    """The output already sized (an even split, or receive counts the caller
    knows): start and finish in one call."""
    rc = alltoall_start(ctl, x_addr, row_nb, plan, code)
    if rc != OK:
        return rc
    return alltoall_finish(ctl, x_addr, out_addr, row_nb, plan, code)


@numba.cfunc(_i64(_i64, _i64, _i64, _i64, _i64, _i64), cache=True, nogil=True)
def _alltoall_cfunc(ctl_addr, x_addr, out_addr, row_nb, plan_addr, code):
    """alltoall_step for C callers (harmpi/_native.cpp), which pass addresses."""
    ctl = control_at(ctl_addr)
    plan = numba.carray(_voidptr(plan_addr), (plan_words(ctl[0].local_size),), np.int64)
    return alltoall_step(ctl, x_addr, out_addr, row_nb, plan, code)


ALLTOALL_START = node.entry_point(alltoall_start, _START_SIG)
ALLTOALL_FINISH = node.entry_point(alltoall_finish, _FINISH_SIG)
ALLTOALL_STEP = node.entry_point(alltoall_step, _FINISH_SIG)
#: alltoall_step's C address (0 under NUMBA_DISABLE_JIT)
ALLTOALL_CFUNC = getattr(_alltoall_cfunc, "address", 0)
