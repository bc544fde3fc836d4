"""The two-node all-to-all over tcp, compiled: one call per step, one for its copies.

The same flag rounds and messages as HierAlltoall.run's Python loop
(harmpi.algorithms.alltoall.two_nodes), so the two can meet, over the rail
socket, sockio rows and receive buffer the two-node all-reduce keeps in the
control block (rail_* fields; har_latency's rows: row 0 receives, row 1
sends). A2A2_ROUND, step k:
  1. a local rank that gave up earlier: send the rail peer a told message
     (rail_message) instead of a step message, and give up;
  2. fill my slot (one_node.fill_slot), one flag round (MISMATCH: keep the
     node's verdict, send the poison tag so the other node fails too);
  3. step 0: read every local header (counts, recv, the local pair check);
  4. pack my message for the rail peer and post the exchange;
  5. wait for it (rail_wait: one more deadline, so that a peer that gave up
     first can tell why); check its tag and, on step 0, its header;
  6. a status round on the node.
A2A2_COPY, step k: my own rows (step 0), the local senders' chunks from
their slots, the other node's from the rail message.

Invariants: a rank that gives up before its message tells its rail peer
(best effort; the give-up's closed socket tells it anyway), so every rank
of both nodes names the late rank; a failed round leaves the context
abandoned, as the all-reduce's compiled step does.

Cost: per step two flag rounds, one message each way on the rail, two
compiled calls (~100 us of Python saved against the Python loop).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types

from ... import node
from ...base.control import ARRAY as _ctl
from ...base.control import MISMATCH, OK, POISONED, RAIL_FAILED
from ...base.control import voidptr as _voidptr
from ...base.kind import POISON_TAG
from ...base.sync import monotonic_ns
from ...transports import sockio
from ..rail_turns import RAIL_ROWS, rail_outcome, rail_views
from .one_node import fill_slot, own_rows
from .plan import expect, geometry, prefix, recv, recv_off
from .rail_message import (
    RAIL_COUNTS_BAD,
    RAIL_TAG_BAD,
    TOLD_MAGIC,
    TOLD_NBYTES,
    TOLD_WORDS,
    local_out,
    msg_head_nbytes,
    pack_message,
    scan_headers,
    take_header,
    told_words,
    unpack_message,
)

__all__ = ["A2A2_ROUND", "A2A2_COPY", "RAIL_ROWS", "tell_rail_peer", "heard_told", "rail_wait"]

_i64 = types.int64
_W = np.empty(0, np.uint16)  # (one_node's witness of the flag rounds)
#: the extra deadline's wait, in slices: between them it looks for a local
#: rank that gave up (its culprit word names the rank it waited for)
_EXTRA_SLICE_NS = 10_000_000


@numba.njit(cache=True, nogil=True)
def tell_rail_peer(ctl, rc, msg_addr):
    """Send the rail peer the told message of status ``rc`` (in msg_addr)
    from sockio row 0; returns rc. Best effort: a send that cannot start
    now is left to the give-up's closed socket (no notice follows a half-sent
    message)."""
    c = ctl[0]
    told_words(c, rc, numba.carray(_voidptr(msg_addr), (TOLD_WORDS,), np.int64))
    ops, _pollfds, scratch = rail_views(c)
    sockio.set_send(ops, 0, c.rail_fd, msg_addr, TOLD_NBYTES, POISON_TAG,
                    sockio.realtime_ns() + c.timeout_ns)
    sockio.kick(ops, 1, scratch)
    return rc


@numba.njit(cache=True, nogil=True)
def heard_told(ctl, ops, state, recv_addr):
    """Whether receive row 0 got a told message (into ``recv_addr``): then
    give up, posting its culprit (or, if that is no rank, the rank that gave
    up first), with state[4:7] = (1, culprit word, that rank)."""
    if (ops[0, sockio.OP_DONE] < sockio.HEADER_NBYTES + TOLD_NBYTES
            or ops[0, sockio.OP_HDR_TAG] != POISON_TAG or ops[0, sockio.OP_HDR_N] != TOLD_NBYTES):
        return False
    words = numba.carray(_voidptr(recv_addr), (TOLD_WORDS,), np.int64)
    if words[0] != TOLD_MAGIC:
        return False
    state[4], state[5], state[6] = 1, words[1], words[2]
    node.abandon(ctl, words[1] if words[1] >= 0 else words[2])
    return True


@numba.njit(cache=True, nogil=True)
def rail_wait(ctl, ops, pollfds, scratch, state, recv_addr, until_ns):
    """har_latency.rail_complete, with more time for a rail peer that gives
    up and tells (ended early by a local rank that gave up): until
    ``until_ns`` (monotonic; 0: one more deadline). Returns OK or the status
    of a step this rank gives up on; RAIL_FAILED with state[4] = 1 after a
    told message into ``recv_addr`` (heard_told)."""
    c = ctl[0]
    io = sockio.progress(ops, RAIL_ROWS, c.rail_spin, c.timeout_ns, pollfds, scratch,
                         node.hook_addr(ctl), c.wait_yield, node.wait_addr(ctl))
    end = until_ns if until_ns > 0 else monotonic_ns() + c.timeout_ns
    while io == sockio.IO_TIMEOUT:
        left = end - monotonic_ns()
        if left <= 0:
            break
        rc = node.peers_abandoned(ctl)
        if rc != OK:
            return rc
        io = sockio.progress(ops, RAIL_ROWS, 0, min(left, _EXTRA_SLICE_NS), pollfds, scratch,
                             node.hook_addr(ctl), 0, node.wait_addr(ctl))
    if heard_told(ctl, ops, state, recv_addr):
        return RAIL_FAILED
    return rail_outcome(ctl, ops, io)


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
        return tell_rail_peer(ctl, rc, msg_addr)
    fill_slot(c, x_addr, row_nb, plan, P, rank, k, head, block, k == 0)
    rc = node.stage_at(ctl, 0, 0, 0, 0, row_nb, code, _W, 0)
    if rc != OK and rc != MISMATCH:
        return tell_rail_peer(ctl, rc, msg_addr)
    local_bad = rc == MISMATCH
    if local_bad:
        node.keep_mismatch(c)
    rows_in = recv(plan, P)
    if k == 0 and not local_bad:
        state[0], state[1] = scan_headers(c, counts, ranks, g, P, L, rank, rows_in)
    more = 1 if (not local_bad and state[0] * row_nb > (k + 1) * block) else 0
    ops, pollfds, scratch = rail_views(c)
    nb = 0
    send_tag = POISON_TAG
    if not local_bad:
        nb = pack_message(c, msg_addr, 1 - g, L, me, ranks, row_nb, k, head, block, counts,
                          expect(plan, P), more)
        send_tag = tag
    sockio.set_recv(ops, 0, c.rail_fd, c.rail_recv, c.rail_recv_cap)
    # (the give-up time a receiver checks: this rank's wait, with its extra deadline)
    sockio.set_send(ops, 1, c.rail_fd, msg_addr, nb, send_tag,
                    sockio.realtime_ns() + 2 * c.timeout_ns)
    if sockio.kick(ops, RAIL_ROWS, scratch) != sockio.IO_OK:
        if heard_told(ctl, ops, state, c.rail_recv):
            return RAIL_FAILED
        node.abandon(ctl, c.rail_peer)
        return RAIL_FAILED
    rc = rail_wait(ctl, ops, pollfds, scratch, state, c.rail_recv, 0)
    if rc != OK:
        return rc
    got_nb, got_tag = ops[0, sockio.OP_HDR_N], ops[0, sockio.OP_HDR_TAG]
    msg_head = msg_head_nbytes(L)
    status = 0
    theirs_more = 0
    if got_tag != tag or got_nb < msg_head or got_nb > c.rail_recv_cap:
        status = RAIL_TAG_BAD
    elif not local_bad:
        inbox = numba.carray(_voidptr(c.rail_recv), (msg_head,), np.uint8)
        theirs_more, bad = take_header(inbox, 1 - g, L, me, ranks, plan, counts, rows_in, k == 0)
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
        return node.settle_mismatch(c)
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
    rows_in, roff = recv(plan, P), recv_off(plan, P)
    if k == 0:
        prefix(rows_in, roff, P)
        own_rows(x_addr, out_addr, row_nb, plan, P, rank)
    local_out(c, out_addr, L, g, ranks, rank, row_nb, k, head, block, rows_in, roff)
    unpack_message(c.rail_recv, out_addr, L, 1 - g, ranks, row_nb, k, block, rows_in, roff)


A2A2_ROUND = node.entry_point(_a2a2_round, _ROUND_SIG)
A2A2_COPY = node.entry_point(_a2a2_copy, _COPY_SIG)
