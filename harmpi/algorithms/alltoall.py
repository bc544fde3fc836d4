"""All-to-all through the node's slots, one rail exchange per remote node.

Rank r holds x_r, rows along the first dimension; ``send[r][j]`` of its
rows (in order) go to rank j. Afterwards rank j holds the rows every rank
sent it, rank 0's first. The counts may change on every call (a MoE decode
step routes each token anew): they travel with the data, in the same round.

Slot layout (every rank, both parities): a header of 2P words at byte 0
(P = ranks of the communicator): ``send[0..P)`` rows to each rank,
``expect[0..P)`` rows this rank expects from each rank (-1: any); then P
blocks of C bytes, block j carrying the next C bytes of the rows for rank j
(C = (slot - header) / P, a multiple of 64).

One node (compiled, one call; a second when the caller must first see the
receive counts to size its output):
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
Invariants: pure copies, so nothing is rounded; a slot is rewritten two
steps later, after its readers passed the next step's wait (harmpi.node).
Cost: one flag round per C bytes of the longest segment; every byte is
copied twice (into my slot, out of the sender's slot), my own rows once.

Two nodes (G = 2 nodes of L ranks; compiled over tcp, else Python around
compiled copies; three or more nodes, or nodes of different sizes, take
MpiAlltoall: a polled MPI_Ialltoallv after a check of every pair on every
rank, since here a pair that disagrees is seen by its two nodes only): rank
(g, l)'s rail peers are ranks (g', l). Per step:
  1. as above: header and blocks into my slot, one flag round;
  2. for each other node g', pack one message for (g', l): a header
     (does node g have more steps, and the rows each local rank sends
     (g', l); my expectations from each rank of g'), then the chunk of
     every local rank's block for (g', l), read from their slots;
  3. one rail exchange with every other node at once (all in flight);
     the message from g' carries exactly the rows node g' sends me;
  4. a status round on the node (a rail that failed or saw a peer that
     disagrees makes every rank of the node fail);
  5. copy out: local senders from their slots, remote senders from the
     messages, my own rows from x.
  Node g's "more" flag reaches every rank of every node, so all ranks run
  the same number of steps. Both ends of a rail check the counts that
  cross it against the receiver's expectation.
  A late rank: its node's ranks time out in step 1, before their messages,
  while their rail peers wait in step 3. So a rank that gives up before
  its message sends a *told* message instead (the rank it waited for), and
  a rail wait gives its peer one more deadline to send it: every rank of
  both nodes names the late rank, as the all-reduce's ranks do.
Cost per step: two flag rounds and one message to each other node per
rank (G - 1 per rank, all rails in parallel): rows cross the network once.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types

from .. import node
from ..base import kind
from ..base.arena import FLAG_LINE_NBYTES, W_CULPRIT
from ..base.control import (
    ABANDONED,
    MISMATCH,
    OK,
    POISONED,
    RAIL_FAILED,
    RAIL_LATE,
    RAIL_TIMEOUT,
    control_at,
)
from ..base.control import ARRAY as _ctl
from ..base.control import voidptr as _voidptr
from ..base.kind import POISON_TAG, rail_tag
from ..base.sync import load_acquire, monotonic_ns
from ..errors import HarmpiError, HarmpiMismatchError, HarmpiTimeoutError, HarmpiTransportError
from ..transports import sockio
from .har_latency import rail_views

__all__ = ["PLAN_FIELDS", "plan_words", "geometry", "ALLTOALL_STEP", "ALLTOALL_START", "warm_up",
           "ALLTOALL_FINISH", "ALLTOALL_CFUNC", "HierAlltoall", "new_plan", "pair_mismatch"]

_i64 = types.int64
#: witness of the flag rounds (harmpi.node compiles them per storage type; with
#: no data copied by the round itself, any of its types will do)
_W = np.empty(0, np.uint16)
_memcpy = node.memcpy
_slot_addr = node.parity_slot_addr
_parity = node.step_parity
_publish_copy = node.publish_copy

#: the per-call plan, an int64 array of plan_words(P): (field, words) in order.
#: The caller fills send/expect (or asks for an even split); the step fills
#: the rest. Reused by every call of a context (one call at a time).
PLAN_FIELDS = (("send", "P"), ("expect", "P"), ("recv", "P"), ("send_off", "P"),
               ("recv_off", "P"), ("steps", 1), ("bad_pair", 1), ("even_rows", 1))


@numba.njit(cache=True, nogil=True)
def plan_words(P):
    return 5 * P + 3


def new_plan(P):
    return np.zeros(plan_words(P), np.int64)


@numba.njit(cache=True, nogil=True)
def geometry(slot_nbytes, P):
    """(header bytes, block bytes) of a slot shared by P destinations."""
    head = (16 * P + 63) // 64 * 64
    block = (slot_nbytes - head) // P // 64 * 64
    return head, block


def pair_mismatch(plan, P):
    """(sender, receiver) of the first pair whose count differs from the
    receiver's expectation, from the plan's bad_pair word, or None."""
    bad = int(plan[5 * P + 1])
    return None if bad < 0 else divmod(bad, P)


@numba.njit(cache=True, nogil=True)
def _prefix(counts, out, P):
    total = 0
    for j in range(P):
        out[j] = total
        total += counts[j]
    return total


@numba.njit(cache=True, nogil=True)
def _fill(c, x_addr, row_nb, plan, P, me, k, head, block, with_header):
    """My slot of the next step: (step 0: the header, then) chunk k of every
    segment bound for another rank."""
    base = _slot_addr(c, c.steps & 1, c.local_rank)
    send = plan[0:P]
    if with_header:
        hdr = numba.carray(_voidptr(base), (2 * P,), np.int64)
        for j in range(2 * P):
            hdr[j] = plan[j]
    off = plan[3 * P:4 * P]
    lo = k * block
    for j in range(P):
        seg = send[j] * row_nb
        if j != me and lo < seg:
            _publish_copy(c, base + head + j * block, x_addr + off[j] * row_nb + lo,
                          min(block, seg - lo))


@numba.njit(cache=True, nogil=True)
def _read_headers(c, plan, P, me, row_nb, block):
    """After step 0's flag round (one node, P = L): receive counts and
    offsets, the pair check, and the number of steps."""
    parity = _parity(c)
    recv = plan[2 * P:3 * P]
    longest = 0
    bad = -1
    for i in range(P):
        hdr = numba.carray(_voidptr(_slot_addr(c, parity, i)), (2 * P,), np.int64)
        recv[i] = hdr[me]
        for j in range(P):
            if j != i and hdr[j] > longest:
                longest = hdr[j]
            if bad < 0:
                want = numba.carray(_voidptr(_slot_addr(c, parity, j)), (2 * P,), np.int64)[P + i]
                if want >= 0 and want != hdr[j]:
                    bad = i * P + j
    _prefix(recv, plan[4 * P:5 * P], P)
    steps = 1
    if block > 0 and longest * row_nb > block:
        steps = (longest * row_nb + block - 1) // block
    plan[5 * P] = steps
    plan[5 * P + 1] = bad


@numba.njit(cache=True, nogil=True)
def _copy_out(c, out_addr, row_nb, plan, P, me, k, head, block):
    """Chunk k of every peer's segment for me, from its slot into out."""
    parity = _parity(c)
    recv = plan[2 * P:3 * P]
    roff = plan[4 * P:5 * P]
    lo = k * block
    for i in range(P):
        seg = recv[i] * row_nb
        if i != me and lo < seg:
            _memcpy(out_addr + roff[i] * row_nb + lo,
                    _slot_addr(c, parity, i) + head + me * block, min(block, seg - lo))


@numba.njit(cache=True, nogil=True)
def _own_rows(x_addr, out_addr, row_nb, plan, P, me):
    n = plan[me] * row_nb
    if n > 0:
        _memcpy(out_addr + plan[4 * P + me] * row_nb, x_addr + plan[3 * P + me] * row_nb, n)


@numba.njit(cache=True, nogil=True)
def _even(plan, P):
    """send = expect = even_rows for every rank (send_counts=None)."""
    rows = plan[5 * P + 2]
    for j in range(P):
        plan[j] = rows
        plan[P + j] = rows


_START_SIG = _i64(_ctl, types.intp, _i64, types.int64[::1], _i64)
_FINISH_SIG = _i64(_ctl, types.intp, types.intp, _i64, types.int64[::1], _i64)


@numba.njit(_START_SIG, cache=True, nogil=True)
def alltoall_start(ctl, x_addr, row_nb, plan, code):
    """One node: enter, step 0's flag round, the headers read (plan: recv,
    recv_off, steps, bad_pair). On OK the context stays entered until
    alltoall_finish; on failure it is left."""
    rc = node.enter(ctl)
    if rc != OK:
        return rc
    c = ctl[0]
    P, me = c.local_size, c.local_rank
    if plan[5 * P + 2] >= 0:
        _even(plan, P)
    total = _prefix(plan[0:P], plan[3 * P:4 * P], P)
    if c.profile != 0:
        node.begin(ctl, total * row_nb, code)
    head, block = geometry(c.slot_nbytes, P)
    _fill(c, x_addr, row_nb, plan, P, me, 0, head, block, True)
    rc = node.stage_at(ctl, 0, 0, 0, 0, row_nb, code, _W, 0)
    if rc != OK:
        node.leave(ctl)
        return rc
    _read_headers(c, plan, P, me, row_nb, block)
    return OK


@numba.njit(_FINISH_SIG, cache=True, nogil=True)
def alltoall_finish(ctl, x_addr, out_addr, row_nb, plan, code):
    """One node: the copies of step 0 and steps 1..K-1 (out_addr 0: take
    part without copying out, after a local error); leaves the context.
    A pair mismatch (seen by every rank) skips the rest everywhere."""
    c = ctl[0]
    P, me = c.local_size, c.local_rank
    rc = OK
    if plan[5 * P + 1] < 0:
        head, block = geometry(c.slot_nbytes, P)
        if out_addr != 0:
            _own_rows(x_addr, out_addr, row_nb, plan, P, me)
        for k in range(plan[5 * P]):
            if k > 0:
                _fill(c, x_addr, row_nb, plan, P, me, k, head, block, False)
                rc = node.stage_at(ctl, 0, 0, 0, 0, row_nb, code, _W, 0)
                if rc != OK:
                    break
            if out_addr != 0:
                _copy_out(c, out_addr, row_nb, plan, P, me, k, head, block)
    node.leave(ctl)
    return rc


@numba.njit(_FINISH_SIG, cache=True, nogil=True)
def alltoall_step(ctl, x_addr, out_addr, row_nb, plan, code):
    """One node, the output already sized (an even split, or receive counts
    the caller knows): start and finish in one call."""
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


# -- several nodes -----------------------------------------------------------

#: the status a rank posts in the node's status round after the rail exchange
RAIL_TAG_BAD, RAIL_COUNTS_BAD = 1, 2


@numba.njit(cache=True, nogil=True)
def _pack(c, msg_addr, g2, L, lr, ranks, row_nb, k, head, block, counts, mine_expect, more):
    """The message for rank (g2, lr): [more, rows each local rank sends it,
    my expectations from each rank of g2] then, for each local rank i, chunk
    k of its block for (g2, lr), read from its slot. Returns its bytes.
    ``counts``: int64[L, P] every local header's send row; ``ranks``:
    int64[G, L] communicator rank of (node, local rank)."""
    dest = ranks[g2, lr]
    words = numba.carray(_voidptr(msg_addr), (2 * L + 1,), np.int64)
    words[0] = more
    for i in range(L):
        words[1 + i] = counts[i, dest]
        words[1 + L + i] = mine_expect[ranks[g2, i]]
    pos = (8 * (2 * L + 1) + 63) // 64 * 64
    parity = _parity(c)
    lo = k * block
    for i in range(L):
        seg = counts[i, dest] * row_nb
        if lo < seg:
            n = min(block, seg - lo)
            _memcpy(msg_addr + pos, _slot_addr(c, parity, i) + head + dest * block, n)
            pos += n
    return pos


@numba.njit(cache=True, nogil=True)
def _unpack(msg_addr, out_addr, L, g2, ranks, row_nb, k, block, recv, roff):
    """Copy chunk k of every segment in the message from node g2 into out."""
    pos = (8 * (2 * L + 1) + 63) // 64 * 64
    lo = k * block
    for i in range(L):
        src = ranks[g2, i]
        seg = recv[src] * row_nb
        if lo < seg:
            n = min(block, seg - lo)
            _memcpy(out_addr + roff[src] * row_nb + lo, msg_addr + pos, n)
            pos += n
    return pos


@numba.njit(cache=True, nogil=True)
def _local_out(c, out_addr, L, g, ranks, me, row_nb, k, head, block, recv, roff):
    parity = _parity(c)
    lo = k * block
    for i in range(L):
        src = ranks[g, i]
        seg = recv[src] * row_nb
        if src != me and lo < seg:
            _memcpy(out_addr + roff[src] * row_nb + lo,
                    _slot_addr(c, parity, i) + head + me * block, min(block, seg - lo))


@numba.njit(cache=True, nogil=True)
def _take_header(msg, p, L, lr, ranks, plan, counts, recv, first):
    """The header of the message from rank (p, lr): (node p has more steps,
    whether a count crossing this rail differs from its receiver's
    expectation). On the first step the rows node p sends me go into recv.
    Both ends of the rail check the same pairs: what p's ranks send me
    against my expectation, what my node's ranks send (p, lr) against its."""
    words = msg[:8 * (2 * L + 1)].view(np.int64)
    bad = False
    if first:
        P = recv.shape[0]
        for i in range(L):
            src = ranks[p, i]
            recv[src] = words[1 + i]
            mine = plan[P + src]
            if mine >= 0 and mine != words[1 + i]:
                bad = True
            theirs = words[1 + L + i]  # what (p, lr) expects from my local rank i
            if theirs >= 0 and theirs != counts[i, ranks[p, lr]]:
                bad = True
    return words[0], bad


@numba.njit(cache=True, nogil=True)
def _scan_headers(c, counts, ranks, g, P, L, me, recv):
    """After step 0's flag round (several nodes): every local header's send
    row into counts[L, P], the rows each local rank sends me into recv;
    returns (the longest segment that passes through a slot, in rows; the
    first local (sender * P + receiver) whose count is not what the
    receiver expects, or -1)."""
    parity = _parity(c)
    longest = 0
    for i in range(L):
        hdr = numba.carray(_voidptr(_slot_addr(c, parity, i)), (2 * P,), np.int64)
        for j in range(P):
            counts[i, j] = hdr[j]
            if j != ranks[g, i] and hdr[j] > longest:
                longest = hdr[j]  # (own rows never pass through a slot)
        recv[ranks[g, i]] = hdr[me]
    for j in range(L):
        want = numba.carray(_voidptr(_slot_addr(c, parity, j)), (2 * P,), np.int64)
        for i in range(L):
            expect = want[P + ranks[g, i]]
            if expect >= 0 and expect != counts[i, ranks[g, j]]:
                return longest, ranks[g, i] * P + ranks[g, j]
    return longest, -1


# -- two nodes over tcp, compiled ----------------------------------------------
#
# The same flag rounds and messages as HierAlltoall.run's Python loop (so
# the two can meet), over the rail socket, sockio rows and receive buffer
# the two-node all-reduce keeps in the control block (rail_* fields): per
# step one call does the node round, the exchange and the status round, and
# one more the copies, instead of ~100 us of Python.

_RAIL_ROWS = 2  # (har_latency's rows: row 0 receives, row 1 sends)


# -- a rank that gave up before its rail message ---------------------------------
#
# Its rail peer waits for that message while it waits, in its node's flag
# round, for a rank that never came: it sends the rank it waited for in a
# told message (tag POISON_TAG) in place of its part, and the peer's rail
# wait lasts one more deadline, so that the told message reaches it first.

#: a told message's int64 words: TOLD_MAGIC, the culprit word the sender
#: posted (harmpi.node.abandon), the rank of its node that gave up first
TOLD_WORDS = 3
TOLD_NBYTES = 8 * TOLD_WORDS
#: a step message's first word is 0 or 1 (node g has more steps), never this
TOLD_MAGIC = 0x48524D5054454C4C
#: the extra deadline's wait, in slices: between them it looks for a local
#: rank that gave up (its culprit word names the rank it waited for)
_EXTRA_SLICE_NS = 10_000_000


@numba.njit(cache=True, nogil=True)
def _told_words(c, rc, words):
    """The told message of a step this rank gave up with status ``rc``:
    its own culprit word, and who gave up first (the local rank whose flag
    it found abandoned, else itself)."""
    words[0] = TOLD_MAGIC
    words[1] = load_acquire(c.flags + c.local_rank * FLAG_LINE_NBYTES + W_CULPRIT * 8)
    words[2] = node.local_rank_of(c, c.err_peer if rc == ABANDONED else c.local_rank)


@numba.njit(cache=True, nogil=True)
def _tell_rail_peer(ctl, rc, msg_addr):
    """Send the rail peer the told message of status ``rc`` (in msg_addr)
    from sockio row 0; returns rc. Best effort: a send that cannot start
    now is left to the give-up's closed socket (no notice follows a half-sent
    message)."""
    c = ctl[0]
    _told_words(c, rc, numba.carray(_voidptr(msg_addr), (TOLD_WORDS,), np.int64))
    ops, _pollfds, scratch = rail_views(c)
    sockio.set_send(ops, 0, c.rail_fd, msg_addr, TOLD_NBYTES, POISON_TAG,
                    sockio.realtime_ns() + c.timeout_ns)
    sockio.kick(ops, 1, scratch)
    return rc


@numba.njit(cache=True, nogil=True)
def _heard_told(ctl, ops, state):
    """Whether receive row 0 got a told message (into rail_recv): then give
    up, posting its culprit (or, if that is no rank, the rank that gave up
    first), with state[4:7] = (1, culprit word, that rank)."""
    c = ctl[0]
    if (ops[0, sockio.OP_DONE] < sockio.HEADER_NBYTES + TOLD_NBYTES
            or ops[0, sockio.OP_HDR_TAG] != POISON_TAG or ops[0, sockio.OP_HDR_N] != TOLD_NBYTES):
        return False
    words = numba.carray(_voidptr(c.rail_recv), (TOLD_WORDS,), np.int64)
    if words[0] != TOLD_MAGIC:
        return False
    state[4], state[5], state[6] = 1, words[1], words[2]
    node.abandon(ctl, words[1] if words[1] >= 0 else words[2])
    return True


@numba.njit(cache=True, nogil=True)
def _rail_wait(ctl, ops, pollfds, scratch, state):
    """har_latency.rail_complete, with one more deadline for a rail peer that
    gives up and tells (ended early by a local rank that gave up). Returns
    OK or the status of a step this rank gives up on; RAIL_FAILED with
    state[4] = 1 after a told message (_heard_told)."""
    c = ctl[0]
    io = sockio.progress(ops, _RAIL_ROWS, c.rail_spin, c.timeout_ns, pollfds, scratch,
                         node.hook_addr(ctl), c.wait_yield, node.wait_addr(ctl))
    end = monotonic_ns() + c.timeout_ns
    while io == sockio.IO_TIMEOUT:
        left = end - monotonic_ns()
        if left <= 0:
            break
        rc = node.peers_abandoned(ctl)
        if rc != OK:
            return rc
        io = sockio.progress(ops, _RAIL_ROWS, 0, min(left, _EXTRA_SLICE_NS), pollfds, scratch,
                             node.hook_addr(ctl), 0, node.wait_addr(ctl))
    if _heard_told(ctl, ops, state):
        return RAIL_FAILED
    if io == sockio.IO_INTERRUPTED:
        return node.interrupted(ctl)
    if io != sockio.IO_OK:
        node.abandon(ctl, c.rail_peer)
        return RAIL_TIMEOUT if io == sockio.IO_TIMEOUT else RAIL_FAILED
    if sockio.realtime_ns() > ops[0, sockio.OP_HDR_DL]:
        node.abandon(ctl, c.rail_peer)  # (see rail_complete)
        return RAIL_LATE
    return OK


_ROUND_SIG = _i64(_ctl, types.intp, _i64, types.int64[::1], _i64, _i64, types.int64[:, ::1],
                  types.int64[:, ::1], _i64, types.intp, _i64, types.int64[::1])
_COPY_SIG = types.void(_ctl, types.intp, types.intp, _i64, types.int64[::1], _i64,
                       types.int64[:, ::1], _i64)


@numba.njit(_ROUND_SIG, cache=True, nogil=True)
def _a2a2_round(ctl, x_addr, row_nb, plan, code, k, counts, ranks, g, msg_addr, tag, state):  # noqa: C901 - one compiled step: its branches are the round's outcomes, taken in the order every rank takes them
    """Step k of the two-node all-to-all up to its status round. ``state``
    (int64[7]) in: [longest rows through a slot (k > 0)]; out: [longest,
    bad local pair or -1, any node has more steps, the rail's status, then
    1 and the told message's culprit word and first giver when the rail
    peer told, else 0]. Returns OK, or the failed round's status (MISMATCH
    after a poisoned exchange keeps the node's verdict in err_*)."""
    c = ctl[0]
    L, me = c.local_size, c.local_rank
    P = ranks.shape[0] * L
    rank = ranks[g, me]
    head, block = geometry(c.slot_nbytes, P)
    state[4] = 0
    rc = node.peers_abandoned(ctl)
    if rc != OK:
        return _tell_rail_peer(ctl, rc, msg_addr)
    _fill(c, x_addr, row_nb, plan, P, rank, k, head, block, k == 0)
    rc = node.stage_at(ctl, 0, 0, 0, 0, row_nb, code, _W, 0)
    if rc != OK and rc != MISMATCH:
        return _tell_rail_peer(ctl, rc, msg_addr)
    local_bad = rc == MISMATCH
    if local_bad:
        c.saved_peer, c.saved_a, c.saved_b = c.err_peer, c.err_a, c.err_b
    recv = plan[2 * P:3 * P]
    if k == 0 and not local_bad:
        state[0], state[1] = _scan_headers(c, counts, ranks, g, P, L, rank, recv)
    more = 1 if (not local_bad and state[0] * row_nb > (k + 1) * block) else 0
    ops, pollfds, scratch = rail_views(c)
    nb = 0
    send_tag = POISON_TAG
    if not local_bad:
        nb = _pack(c, msg_addr, 1 - g, L, me, ranks, row_nb, k, head, block, counts,
                   plan[P:2 * P], more)
        send_tag = tag
    sockio.set_recv(ops, 0, c.rail_fd, c.rail_recv, c.rail_recv_cap)
    # (the give-up time a receiver checks: this rank's wait, with its extra deadline)
    sockio.set_send(ops, 1, c.rail_fd, msg_addr, nb, send_tag,
                    sockio.realtime_ns() + 2 * c.timeout_ns)
    if sockio.kick(ops, _RAIL_ROWS, scratch) != sockio.IO_OK:
        if _heard_told(ctl, ops, state):
            return RAIL_FAILED
        node.abandon(ctl, c.rail_peer)
        return RAIL_FAILED
    rc = _rail_wait(ctl, ops, pollfds, scratch, state)
    if rc != OK:
        return rc
    got_nb, got_tag = ops[0, sockio.OP_HDR_N], ops[0, sockio.OP_HDR_TAG]
    msg_head = (8 * (2 * L + 1) + 63) // 64 * 64
    status = 0
    theirs_more = 0
    if got_tag != tag or got_nb < msg_head or got_nb > c.rail_recv_cap:
        status = RAIL_TAG_BAD
    elif not local_bad:
        inbox = numba.carray(_voidptr(c.rail_recv), (msg_head,), np.uint8)
        theirs_more, bad = _take_header(inbox, 1 - g, L, me, ranks, plan, counts, recv, k == 0)
        if bad:
            status = RAIL_COUNTS_BAD
    if local_bad:
        status = RAIL_TAG_BAD
    state[2] = 1 if (more or theirs_more) else 0
    rc = node.publish_wait_status(ctl, status)
    state[3] = c.err_a if rc == POISONED else 0
    if rc != OK and rc != POISONED:
        return rc
    if local_bad:
        c.err_peer, c.err_a, c.err_b = c.saved_peer, c.saved_a, c.saved_b
        return MISMATCH
    return rc


@numba.njit(_COPY_SIG, cache=True, nogil=True)
def _a2a2_copy(ctl, x_addr, out_addr, row_nb, plan, k, ranks, g):
    """Step k's copies into out: my own rows (step 0), the local senders'
    chunks from their slots, the other node's from the rail message."""
    c = ctl[0]
    L, me = c.local_size, c.local_rank
    P = ranks.shape[0] * L
    rank = ranks[g, me]
    head, block = geometry(c.slot_nbytes, P)
    recv, roff = plan[2 * P:3 * P], plan[4 * P:5 * P]
    if k == 0:
        _prefix(recv, roff, P)
        _own_rows(x_addr, out_addr, row_nb, plan, P, rank)
    _local_out(c, out_addr, L, g, ranks, rank, row_nb, k, head, block, recv, roff)
    _unpack(c.rail_recv, out_addr, L, 1 - g, ranks, row_nb, k, block, recv, roff)


A2A2_ROUND = node.entry_point(_a2a2_round, _ROUND_SIG)
A2A2_COPY = node.entry_point(_a2a2_copy, _COPY_SIG)


class HierAlltoall:
    """The several-node all-to-all (module docstring), as a context's entry.
    Every node holds L ranks (the context offers MPI_Alltoallv otherwise);
    they may be numbered in any order (``ranks``)."""

    name = "hier_alltoall"

    def __init__(self, ctx):
        self.ctx = ctx
        topo = ctx.topo
        self.G, self.g, self.L, self.l = (topo.node_count, topo.node_index, topo.local_size,
                                          topo.local_rank)
        self.P = self.G * self.L
        self.ranks = np.array(topo.node_ranks, np.int64)  # [g, l] -> rank
        self.me = topo.rank
        self.transport = ctx.rail_transport()
        self.head, self.block = geometry(ctx.config.slot_nbytes, self.P)
        self.msg_head = (8 * (2 * self.L + 1) + 63) // 64 * 64
        cap = self.msg_head + self.L * self.block
        self.peers = [p for p in range(self.G) if p != self.g]
        self.send_bufs = {p: np.empty(cap, np.uint8) for p in self.peers}
        self.recv_bufs = {p: np.empty(cap, np.uint8) for p in self.peers}
        self.recv = np.zeros(self.P, np.int64)
        self.counts = np.zeros((self.L, self.P), np.int64)
        #: two nodes over tcp: the steps run compiled, on the rail the
        #: two-node all-reduce set up in the control block (its rows too)
        har2 = ctx.har2()
        self.compiled = har2 is not None and har2.compiled
        self.state = np.zeros(7, np.int64)
        self.roff = np.zeros(self.P, np.int64)
        #: the told message this rank sends when it gives up before its rail
        #: message (the Python path), and the sends posted, kept to their end
        self.told = np.zeros(TOLD_WORDS, np.int64)
        self.told_sent = []

    def run(self, call, row_nb, plan, make_out):
        """The whole collective (``call``: x and the kind word); ``make_out(
        total_rows)`` -> (out, address) once the receive counts are known.
        Returns out."""
        if self.compiled:
            return self._run_compiled(call, row_nb, plan, make_out)
        ctx, ctl, P, L, g, me = self.ctx, self.ctx.ctl, self.P, self.L, self.g, self.me
        x_addr, code = call.addr, call.code
        self._send_offsets(plan)
        tag = rail_tag(row_nb, code)
        out = out_addr = failed = None
        k = 0
        while True:
            _fill(ctl[0], x_addr, row_nb, plan, P, me, k, self.head, self.block, k == 0)
            rc = node.stage_meta(ctl, 0, row_nb, code, _W)
            if rc not in (OK, MISMATCH):
                self._tell_peers(rc)
                ctx.fail(rc, call)  # a timeout or a peer that gave up: no going on
            local = ctx.error_state() if rc else None
            if k == 0 and local is None:
                counts = self.counts
                longest, bad = _scan_headers(ctl[0], counts, self.ranks, g, P, L, me, self.recv)
                longest *= row_nb
            more = int(local is None and longest > (k + 1) * self.block)
            status, anyone_more = self._exchange(call, k, row_nb, tag, plan, counts if
                                                 local is None else None, more)
            # every rank of the node fails alike: a disagreement here, or on a rail
            rc = node.publish_wait_status(ctl, status)
            ctx.settle_status(rc if rc != POISONED else OK, call, local)
            if rc == POISONED:
                raise self._rail_mismatch(call, int(ctl[0]["err_a"]), int(ctl[0]["err_peer"]))
            if k == 0:
                failed, out, out_addr = self._after_first_step(call, row_nb, plan, bad, make_out)
            if failed is None:
                self._copy_out(out_addr, row_nb, k)
            k += 1
            if not anyone_more:
                if failed is not None:
                    raise failed
                return out

    def _run_compiled(self, call, row_nb, plan, make_out):
        """run() on two nodes over tcp: per step one compiled call for the
        rounds and the exchange (A2A2_ROUND), one for the copies."""
        ctx, ctl, P, state = self.ctx, self.ctx.ctl, self.P, self.state
        self._send_offsets(plan)
        tag = rail_tag(row_nb, call.code)
        send = self.send_bufs[self.peers[0]]
        out = out_addr = failed = None
        k = 0
        while True:
            rc = A2A2_ROUND(ctl, call.addr, row_nb, plan, call.code, k, self.counts, self.ranks,
                            self.g, send.ctypes.data, tag, state)
            if rc:
                self._round_failed(call, rc)
            if k == 0:
                if state[1] >= 0:  # (see run())
                    failed = pair_error(ctx.topo.rank, call.op, *divmod(int(state[1]), P))
                else:
                    out, out_addr = make_out(int(plan[2 * P:3 * P].sum()))
            if failed is None:
                A2A2_COPY(ctl, call.addr, out_addr, row_nb, plan, k, self.ranks, self.g)
            k += 1
            if not state[2]:
                if failed is not None:
                    raise failed
                return out

    def _round_failed(self, call, rc):
        """Raise for A2A2_ROUND's failed status ``rc``."""
        ctx, state = self.ctx, self.state
        if rc == POISONED:
            raise self._rail_mismatch(call, int(state[3]), int(ctx.ctl[0]["err_peer"]))
        if rc == RAIL_FAILED and state[4]:
            raise self._told_error(call, int(state[5]), int(state[6]))
        if rc == RAIL_TIMEOUT:  # (after the extra deadline: say how long it waited)
            peer = self.peers[0]
            self.transport.raise_timeout(_RAIL_ROWS, 1, (peer, peer), 2 * ctx.config.timeout_s,
                                         call, ops=ctx.har2().ops)
        ctx.fail(rc, call)

    def _send_offsets(self, plan):
        """The plan's send counts (one count for every rank if the plan
        says so) and their offsets."""
        P = self.P
        if plan[5 * P + 2] >= 0:
            plan[:P] = plan[P:2 * P] = plan[5 * P + 2]
        _prefix(plan[:P], plan[3 * P:4 * P], P)

    def _after_first_step(self, call, row_nb, plan, bad, make_out):
        """Step 0 has read every rank's counts: (the error to raise once every
        step has run, out, its address). A bad pair (``bad`` >= 0) is seen
        by the node's ranks only, not by the other nodes: run every step
        (without copying out), then raise. Else out is made, the plan gets
        the receive counts and offsets, and this rank's own rows are copied."""
        P = self.P
        if bad >= 0:
            return pair_error(self.ctx.topo.rank, call.op, *divmod(int(bad), P)), None, None
        total = _prefix(self.recv, self.roff, P)
        out, out_addr = make_out(int(total))
        plan[2 * P:3 * P] = self.recv
        plan[4 * P:5 * P] = self.roff
        _own_rows(call.addr, out_addr, row_nb, plan, P, self.me)
        return None, out, out_addr

    def _copy_out(self, out_addr, row_nb, k):
        """Step k's rows into out: this node's from the slots, the other
        nodes' from their messages."""
        _local_out(self.ctx.ctl[0], out_addr, self.L, self.g, self.ranks, self.me, row_nb, k,
                   self.head, self.block, self.recv, self.roff)
        for p in self.peers:
            _unpack(self.recv_bufs[p].ctypes.data, out_addr, self.L, p, self.ranks, row_nb, k,
                    self.block, self.recv, self.roff)

    def _exchange(self, call, k, row_nb, tag, plan, counts, more):
        """Step k's rail exchange with every other node: (status to post,
        whether any node has more steps). ``counts`` None: this node
        disagreed in its flag round; the peers get the poison tag, so that
        they fail too, and their messages are still received (the rails
        stay clean for the next call)."""
        ctx, P, L = self.ctx, self.P, self.L
        rc = node.peers_abandoned(ctx.ctl)  # (ctx.guard, telling the rail peers first)
        if rc != OK:
            self._tell_peers(rc)
            ctx.fail(rc, call)
        sends, recvs = [], []
        for p in self.peers:
            if counts is None:
                sends.append((p, np.empty(0, np.uint8), POISON_TAG))
            else:
                nb = _pack(ctx.ctl[0], self.send_bufs[p].ctypes.data, p, L, self.l, self.ranks,
                           row_nb, k, self.head, self.block, counts, plan[P:2 * P], more)
                sends.append((p, self.send_bufs[p][:nb], tag))
            recvs.append((p, self.recv_bufs[p]))
            self.recv_bufs[p][:8] = 0  # (no told magic left from an earlier step)
        pending = self.transport.post(sends, recvs)
        try:
            # one more deadline: a peer that gave up first tells why (_tell_peers)
            got = self.transport.complete(pending, 2 * ctx.config.timeout_s, call)
        except (HarmpiTimeoutError, HarmpiTransportError) as exc:
            # (its notice may end this wait before its told message is looked at)
            told = self._told_in(call, self.peers)
            if told is None:
                raise
            raise told from exc
        told = self._told_in(call, [p for p, (nb, t) in zip(self.peers, got)
                                    if t == POISON_TAG and nb == TOLD_NBYTES])
        if told is not None:
            raise told
        status, anyone_more = 0, more
        for p, (nb, t) in zip(self.peers, got):
            if t != tag or nb < self.msg_head:
                status = RAIL_TAG_BAD
                continue
            theirs_more, bad = _take_header(self.recv_bufs[p], p, L, self.l, self.ranks, plan,
                                            counts if counts is not None else self.counts,
                                            self.recv, k == 0 and counts is not None)
            anyone_more |= theirs_more
            if bad:
                status = status or RAIL_COUNTS_BAD
        return status, anyone_more

    def _tell_peers(self, rc):
        """This rank gives up on the step (status ``rc``) before its rail
        messages: send each rail peer the told message instead (best effort:
        the give-up that follows tells them anyway, without the culprit)."""
        _told_words(self.ctx.ctl[0], rc, self.told)
        for p in self.peers:
            try:
                self.told_sent.append(self.transport.post([(p, self.told.view(np.uint8),
                                                            POISON_TAG)], []))
            except HarmpiError:
                return

    def _told_in(self, call, peers):
        """The error for a told message in the receive buffer of one of
        ``peers``, else None. The culprit this rank's give-up posts is the
        rank the teller waited for, or the rank that gave up first if that
        is not a rank (an interrupt, a refusal)."""
        for p in peers:
            words = self.recv_bufs[p][:TOLD_NBYTES].view(np.int64)
            if words[0] == TOLD_MAGIC:
                return self._told_error(call, int(words[1]), int(words[2]), p)
        return None

    def _told_error(self, call, culprit, giver, p=None):
        """A rail peer (of node ``p``) told this rank that ``giver`` gave up
        first, waiting for ``culprit`` (its culprit word)."""
        topo = self.ctx.topo
        peer = self.ranks[self.peers[0] if p is None else p, self.l]
        if culprit >= 0:
            why = f"rank {giver} gave up waiting for rank {culprit}: it did not arrive in time"
        elif culprit == node.CULPRIT_INTERRUPTED:
            why = f"rank {giver} was interrupted (SIGINT) while it waited"
        elif culprit == node.CULPRIT_REFUSED:
            why = (f"rank {giver} refused its own arguments to this call (its "
                   "HarmpiArgumentError says why) while a peer made it for real")
        elif culprit == node.CULPRIT_DISAGREED:
            why = (f"rank {giver} saw the ranks disagree (another size, dtype, op, collective "
                   "or algorithm) and gave up")
        else:
            why = f"rank {giver} gave up (its transport failed, it timed out or was interrupted)"
        text = (f"rank {topo.rank} (node {topo.node_index}, local rank {topo.local_rank}): "
                f"{call}: {why}; its rail peer rank {peer} told this rank so instead of "
                "sending its part. No rank completes this collective")
        if culprit in (node.CULPRIT_REFUSED, node.CULPRIT_DISAGREED):
            err = HarmpiMismatchError(
                f"{text}; this context is unusable now (the ranks' step counters may differ). "
                "Every rank must make the same calls, with the same sizes and dtypes, in the "
                "same order.", culprit=giver)
            err.unclean = True  # (the context gives up: its peers are mid-collective)
            return err
        return HarmpiTimeoutError(f"{text} (HARMPI_TIMEOUT_S sets the deadline); this context "
                                  "is unusable now.", culprit=culprit if culprit >= 0 else giver)

    def _rail_mismatch(self, call, status, peer):
        topo = self.ctx.topo
        if status == RAIL_COUNTS_BAD:
            why = ("split sizes disagree: the rows a rank of another node sends differ from "
                   "what its receiver expects (recv_counts / output split sizes)")
        else:
            why = ("a rank of another node passed rows of another size or dtype, or refused "
                   "its own arguments")
        return HarmpiMismatchError(
            f"rank {topo.rank} (node {topo.node_index}, local rank {topo.local_rank}): "
            f"{call.op}: ranks disagree: {why} (seen by local rank {peer}). This rank's output "
            "is not complete (every rank that raises this leaves its output unwritten); every "
            "rank must pass the same row shape and dtype, and counts that match what their "
            "receivers expect.")


def pair_error(rank, what, sender, receiver):
    return HarmpiMismatchError(
        f"rank {rank}: {what}: split sizes disagree: rank {sender} sends rank {receiver} a "
        f"number of rows other than rank {receiver} expects (its recv_counts / output split "
        "sizes; ranks of the communicator). This rank's output is not written (every rank "
        "that raises this leaves its output unwritten).")


#: the row bytes a refusal posts in MpiAlltoall's first exchange (no call has them)
REFUSED_ROW_NBYTES = -1


class MpiAlltoall:
    """Nodes of different sizes (rails do not span every node): a polled
    MPI_Ialltoallv on harmpi's duplicate of the communicator, after a polled
    exchange of (row bytes, kind) and arrival times and one of the counts
    (every rank checks every pair, as on one node). The data moves through
    private buffers: a request given up on may still complete later, and
    must not touch the caller's memory then."""

    name = "mpi_alltoallv"

    def __init__(self, ctx):
        self.ctx = ctx
        sizes = list(ctx.topo.node_sizes)
        why = (f"nodes hold {sizes} ranks (uneven), so rails do not span every node"
               if not ctx.topo.uniform else f"{len(sizes)} nodes (a pair that disagrees must "
               "fail on every node, which one rail exchange cannot tell)")
        ctx.log_once(f"alltoall: {why}; using MPI_Ialltoallv on the communicator")

    def refuse(self):
        """This rank refused its own arguments to an all-to-all (harmpi.api.refuse):
        take part in the first exchange of the call its peers may be in, with
        row bytes REFUSED_ROW_NBYTES, so they fail it at once, naming this
        rank. Returns whether every rank refused (the context goes on)."""
        from ..base.topology import check_arrivals, gather_records  # noqa: PLC0415

        ctx = self.ctx
        comm, timeout_s = ctx.setup_comm, ctx.config.timeout_s
        label = "refused alltoall (MPI_Alltoallv for uneven nodes)"
        code = kind.refusal_code(kind.COLL_ALLTOALL, 0)
        stamps, kinds = gather_records(comm, timeout_s, label,
                                       (("call", f"{REFUSED_ROW_NBYTES} {code}"),))
        check_arrivals(comm, stamps, timeout_s, label)
        return all(k == kinds[0] for k in kinds)

    def run(self, call, row_nb, plan, make_out):
        from mpi4py import MPI  # noqa: PLC0415

        from ..base.topology import check_arrivals, gather_records, wait_polled  # noqa: PLC0415
        from .base import mismatch_error  # noqa: PLC0415

        ctx = self.ctx
        comm, timeout_s, P = ctx.setup_comm, ctx.config.timeout_s, ctx.topo.size
        me, x_addr, code, what = ctx.topo.rank, call.addr, call.code, call.op
        if plan[5 * P + 2] >= 0:
            plan[:P] = plan[P:2 * P] = plan[5 * P + 2]
        label = f"{what} (MPI_Alltoallv for uneven nodes)"
        stamps, kinds = gather_records(comm, timeout_s, label, (("call", f"{row_nb} {code}"),))
        check_arrivals(comm, stamps, timeout_s, label)
        if any(k != kinds[0] for k in kinds):
            shown = [tuple(int(v) for v in k.split("=", 1)[1].split()) for k in kinds]
            refused = [r for r, k in enumerate(shown) if k[0] == REFUSED_ROW_NBYTES]
            if refused:
                raise mismatch_error(me, what, f"rank {refused[0]} refused its own arguments to "
                                     "this call (its HarmpiArgumentError says why)")
            raise mismatch_error(me, what, f"(row bytes, kind) by rank: {shown}")
        pairs = np.ascontiguousarray(np.stack([plan[:P], plan[P:2 * P]], axis=1))  # [dest, 2]
        got = np.empty_like(pairs)  # [src, 2]: (rows src sends me, rows src expects from me)
        req = comm.Ialltoall([pairs, MPI.INT64_T], [got, MPI.INT64_T])
        wait_polled(comm, req, timeout_s, label, (pairs, got))
        recv = got[:, 0].copy()
        # a pair is checked at both ends: my sends against the receivers' wishes,
        # what I receive against mine, then every rank learns of any bad pair
        bad_send = [j for j in range(P) if got[j, 1] >= 0 and got[j, 1] != plan[j]]
        bad_recv = [i for i in range(P) if plan[P + i] >= 0 and plan[P + i] != recv[i]]
        mine_bad = np.array([bad_send[0] if bad_send else -1,
                             bad_recv[0] if bad_recv else -1], np.int64)
        every = np.empty((P, 2), np.int64)
        req = comm.Iallgather([mine_bad, MPI.INT64_T], [every, MPI.INT64_T])
        wait_polled(comm, req, timeout_s, label, (mine_bad, every))
        for r in range(P):
            if every[r, 0] >= 0:
                raise pair_error(me, what, r, int(every[r, 0]))
            if every[r, 1] >= 0:
                raise pair_error(me, what, int(every[r, 1]), r)
        send_rows = plan[:P]
        send = np.frombuffer(self.ctx.view(x_addr, int(send_rows.sum()) * row_nb),
                             np.uint8).copy()
        rbuf = np.empty(int(recv.sum()) * row_nb, np.uint8)
        sdispl = np.concatenate(([0], np.cumsum(send_rows)[:-1])) * row_nb
        rdispl = np.concatenate(([0], np.cumsum(recv)[:-1])) * row_nb
        req = comm.Ialltoallv([send, (send_rows * row_nb, sdispl), MPI.BYTE],
                              [rbuf, (recv * row_nb, rdispl), MPI.BYTE])
        wait_polled(comm, req, timeout_s, label, (send, rbuf))
        plan[2 * P:3 * P] = recv
        out, out_addr = make_out(int(recv.sum()))
        node.copy_bytes(out_addr, rbuf.ctypes.data, rbuf.nbytes)
        return out


def warm_up():
    """Compile the kernels HierAlltoall calls from Python (typed at their
    first call) with the types it passes, on scratch memory: harmpi's
    precompile runs this, so a job's first multi-node all-to-all does not."""
    from ..base import control  # noqa: PLC0415

    P, L, slot = 2, 1, 4096
    scratch = np.zeros(2 * slot, np.uint8)
    ctl = control.new()
    c = ctl[0]
    c["slots"], c["slot_nbytes"], c["local_size"], c["steps"] = scratch.ctypes.data, slot, L, 1
    plan = new_plan(P)
    plan[:P] = 1
    head, block = geometry(slot, P)
    x, out = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
    _fill(ctl[0], x.ctypes.data, 8, plan, P, 0, 0, head, block, True)
    ranks = np.arange(P, dtype=np.int64).reshape(P, L)
    counts = np.ones((L, P), np.int64)
    msg = np.zeros(slot, np.uint8)
    _pack(ctl[0], msg.ctypes.data, 1, L, 0, ranks, 8, 0, head, block, counts, plan[P:2 * P], 0)
    recv, roff = np.zeros(P, np.int64), np.zeros(P, np.int64)
    _unpack(msg.ctypes.data, out.ctypes.data, L, 1, ranks, 8, 0, block, recv, roff)
    _local_out(ctl[0], out.ctypes.data, L, 0, ranks, 0, 8, 0, head, block, recv, roff)
    _own_rows(x.ctypes.data, out.ctypes.data, 8, plan, P, 0)
    _scan_headers(ctl[0], counts, ranks, 0, P, L, 0, recv)
    _take_header(msg, 1, L, 0, ranks, plan, counts, recv, True)
    _prefix(plan[:P], plan[3 * P:4 * P], P)
    _prefix(recv, roff, P)
    flags = np.zeros(FLAG_LINE_NBYTES * L // 8, np.int64)
    c["flags"] = flags.ctypes.data
    _told_words(ctl[0], OK, np.zeros(TOLD_WORDS, np.int64))
