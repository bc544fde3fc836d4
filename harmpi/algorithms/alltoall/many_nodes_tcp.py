"""The all-to-all over the tcp rail on G = 2^k nodes (two included), compiled.

G nodes of L ranks (P = G L), numbered in any order (``ranks``: [g, l] ->
rank); rank (g, l)'s rail peers are (h, l) on every other node h, reached
through the sockets the compiled all-reduce keeps in the control block
(rail_fds, rail_world; harmpi.algorithms.rail_turns). A2AG_ROUND, step k:
  1. a local rank that gave up earlier: tell every rail peer (a told
     message, rail_message) and give up;
  2. fill my slot (one_node.fill_slot), one flag round (MISMATCH: this
     node is poisoned);
  3. step 0: every local header's send and expect rows into the count
     table (send_tab / expect_tab, [P, P]);
  4. G - 1 turns, one per other node h, in the order of ``partner``: the
     doubling partners g ^ 1, g ^ 2, ..., g ^ G/2 first, then g ^ m for the
     other masks m. A turn sends (h, l) my message and receives its
     message into node h's own buffer. A message: a header of 1 + 2 L P
     words padded to 64 bytes (word 0 is 0; on step 0 node g's L send rows
     then its L expect rows), then chunk k of every local rank's block for
     (h, l), read from their slots, in local-rank order. On step 0 the
     header's rows go into the table;
  5. a status round on the node;
  6. step 0: every (sender, receiver) pair of the full table checked in the
     same order on every rank (the first bad one fails every rank alike,
     none goes on), the receive counts, and the steps K for the longest
     segment (every rank computes the same K).
A2AG_COPY, step k: my own rows (step 0), the local senders' chunks from
their slots, node h's from its buffer. One-rank nodes (L = 1): step 0's
slot holds the header alone and its messages at most FIRST_NBYTES a pair,
packed from x; the later steps skip the slot and the flag round, and each
turn sends the next DIRECT_SLOTS slots' worth of my segment for h straight
from x and receives h's for me straight into out (_direct_turn). A2AG_RUN
(A2AG_CFUNC for C callers) runs every step and its copies in one call
when out is sized before the call (an even split, or recv_counts).

Why every rank sees the same verdict: after step 0's turns every rank
holds every rank's send and expect rows (each node sent its rows to every
other node), so the pair check needs no further round. A message whose tag
differs (another kind, row size or collective), or a node whose flag round
disagreed, poisons a node: it sends POISON_TAG and an empty message on its
remaining doubling turns. The doubling turns are the all-reduce's (and the
2^k allgather's) partners in the same order (rail_turns.rail_doubling),
so after them a node is unpoisoned only if every node of its 2b-node
subcube agreed: either every node is poisoned, and all stop there (an
all-reduce or allgather a refusing rank runs takes no further turn), or
every tag agrees and the other turns run. No output is written before
step 0's status round and the verdict.

A late rank: its node's ranks time out in their flag round and tell every
rail peer (the told message replaces their step messages); a rank whose
turn fails tells the peers of its remaining turns the same way, so the
ranks that wait on them name the late rank. For that turn t waits until
t + 2 deadlines after its step began (rail_told.rail_wait): a peer
stuck in an earlier turn gives up and tells first. A rank that never
arrives thus fails every other rank within G deadlines.

Cost per step: two flag rounds, G - 1 messages each way per rank, one
after the other (all rails in parallel); rows cross the network once.
Copies a byte: into my slot, into the message, out of the buffer; on
one-rank nodes none past step 0's FIRST_NBYTES a pair. An output sized
from the expected counts takes one compiled call (A2AG_RUN; from C++,
A2AG_CFUNC) instead of two a step from Python (~25 us of Python a call on
the 2-vCPU AMD EPYC). There, bf16, make bench-host (MPI over TCP), harmpi
/ MPI_Alltoall us at 2 KiB, 64 KiB, 1 MiB, 4 MiB a rank: 2 x 1 11 / 29,
30 / 112, 805 / 733, 3541 / 2280; 4 x 1 64 / 138, 152 / 405, 2308 /
2304, 15355 / 10828. Before (MPI_Ialltoallv after a gather of every
rank's counts on 4 x 1; two_nodes' steps on 2 x 1) 4 x 1 was 2.3-3.6x
MPI's time up to 64 KiB, 2 x 1 1.0-2.9x.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import register_jitable

from ... import node
from ...base.control import ARRAY as _ctl
from ...base.control import MISMATCH, OK, POISONED, RAIL_FAILED, control_at
from ...base.control import voidptr as _voidptr
from ...base.kind import POISON_TAG, rail_tag
from ...base.sync import monotonic_ns
from ...transports import sockio
from ..rail_turns import disagreed_then_left, rail_views, select_peer
from .one_node import fill_slot, own_rows, write_header
from .plan import (
    bad_pair_at,
    even_rows_at,
    geometry,
    plan_words,
    prefix,
    recv,
    recv_off,
    send,
    send_off,
    spread_even_rows,
)
from .rail_message import TOLD_NBYTES, local_out
from .rail_told import heard_told, rail_wait, tell_rail_peer

__all__ = ["A2AG_ROUND", "A2AG_COPY", "A2AG_RUN", "A2AG_CFUNC", "ARGS_WORDS", "STATE_WORDS",
           "partner", "msg_nbytes", "alltoall_compiled"]

_W = np.empty(0, np.uint16)  # (one_node's witness of the flag rounds)
_memcpy = node.memcpy
_slot_addr = node.parity_slot_addr
_parity = node.step_parity
_i64 = types.int64


#: one-rank nodes: after step 0 the rest of every segment moves straight
#: from the sender's x into the receiver's out, at most this many slots'
#: bytes per pair and step (4 MiB with the default slot: a turn well inside
#: any deadline)
DIRECT_SLOTS = 4
#: one-rank nodes: the most step 0 moves per pair through the messages (two
#: copies a byte, with the counts); past it one step more saves both
FIRST_NBYTES = 64 << 10


def alltoall_compiled(node_count):
    """Whether G uniform nodes with a compiled rail take these steps: 2^k >= 2."""
    return node_count >= 2 and node_count & (node_count - 1) == 0


@register_jitable
def partner(G, g, t):
    """Node g's partner in turn t (0 .. G - 2): g ^ 1, g ^ 2, ..., g ^ G/2
    (the doubling turns), then g ^ m for every other mask m in increasing
    order. Every node's turn t pairs it with a node whose turn t pairs
    back (the map g -> g ^ m is its own inverse)."""
    d = 0
    b = 1
    while b < G:
        if t == d:
            return g ^ b
        d += 1
        b <<= 1
    i = t - d
    m = 3
    while True:
        if m & (m - 1):
            if i == 0:
                return g ^ m
            i -= 1
        m += 1


@register_jitable
def _doubling_turns(G):
    d = 0
    while (1 << d) < G:
        d += 1
    return d


@register_jitable
def blocks(slot_nbytes, P, L):
    """(slot header bytes, bytes of a segment step 0 moves): a slot's block
    (plan.geometry), at most FIRST_NBYTES on one-rank nodes, whose later
    steps need no copy."""
    head, block = geometry(slot_nbytes, P)
    if L == 1:
        block = min(block, FIRST_NBYTES)
    return head, block


@register_jitable
def span(k, block, L, slot_nbytes):
    """(first byte, bytes) of step k's chunk of a segment: a slot's block per
    step, except on one-rank nodes (L = 1), whose steps after the first move
    DIRECT_SLOTS slots' bytes each, straight from x into out."""
    if k == 0 or L != 1:
        return k * block, block
    most = DIRECT_SLOTS * slot_nbytes
    return block + (k - 1) * most, most


@register_jitable
def head_nbytes(L, P):
    """Bytes of a step message's header (1 + 2 L P words), padded to 64."""
    return (8 * (1 + 2 * L * P) + 63) // 64 * 64


def msg_nbytes(slot_nbytes, G, L):
    """The largest step message (header and L chunks of a block): each
    node's receive buffer holds one."""
    P = G * L
    return head_nbytes(L, P) + L * blocks(slot_nbytes, P, L)[1]


@numba.njit(cache=True, nogil=True)
def _local_table(c, ranks, g, P, L, send_tab, expect_tab):
    """After step 0's flag round: every local header's send and expect rows."""
    parity = _parity(c)
    for i in range(L):
        hdr = numba.carray(_voidptr(_slot_addr(c, parity, i)), (2 * P,), np.int64)
        src = ranks[g, i]
        for j in range(P):
            send_tab[src, j] = hdr[j]
            expect_tab[src, j] = hdr[P + j]


@numba.njit(cache=True, nogil=True)
def _pack(c, msg_addr, dest, L, g, ranks, row_nb, k, head, block, send_tab, expect_tab, x_addr,
          plan):
    """My message for rank ``dest`` (module docstring); returns its bytes.
    One-rank nodes pack step 0's chunk from x (the slot holds no data)."""
    P = send_tab.shape[0]
    words = numba.carray(_voidptr(msg_addr), (1 + 2 * L * P,), np.int64)
    words[0] = 0
    if k == 0:
        for i in range(L):
            src = ranks[g, i]
            for j in range(P):
                words[1 + i * P + j] = send_tab[src, j]
                words[1 + (L + i) * P + j] = expect_tab[src, j]
    pos = head_nbytes(L, P)
    parity = _parity(c)
    lo = k * block
    for i in range(L):
        seg = send_tab[ranks[g, i], dest] * row_nb
        if lo < seg:
            n = min(block, seg - lo)
            src = _slot_addr(c, parity, i) + head + dest * block
            if L == 1:
                src = x_addr + send_off(plan, send_tab.shape[0])[dest] * row_nb + lo
            _memcpy(msg_addr + pos, src, n)
            pos += n
    return pos


@numba.njit(cache=True, nogil=True)
def _take_table(msg_addr, h, L, ranks, send_tab, expect_tab):
    """Node h's send and expect rows, from the header of its step-0 message."""
    P = send_tab.shape[0]
    words = numba.carray(_voidptr(msg_addr), (1 + 2 * L * P,), np.int64)
    for i in range(L):
        src = ranks[h, i]
        for j in range(P):
            send_tab[src, j] = words[1 + i * P + j]
            expect_tab[src, j] = words[1 + (L + i) * P + j]


@numba.njit(cache=True, nogil=True)
def _verdict(send_tab, expect_tab, me, plan, row_nb, block, L, slot_nbytes):
    """From the full table: (steps, the first (sender * P + receiver) whose
    count is not what the receiver expects, or -1); my receive counts into
    the plan. The same order on every rank, so the same answer."""
    P = send_tab.shape[0]
    bad = -1
    longest = 0
    for i in range(P):
        for j in range(P):
            sent = send_tab[i, j]
            if i != j and sent > longest:
                longest = sent   # (own rows never pass through a slot)
            want = expect_tab[j, i]
            if bad < 0 and want >= 0 and want != sent:
                bad = i * P + j
    rows_in = recv(plan, P)
    for i in range(P):
        rows_in[i] = send_tab[i, me]
    steps = 1
    nb = longest * row_nb
    if nb > block and L == 1:
        most = span(1, block, L, slot_nbytes)[1]
        steps = 1 + (nb - block + most - 1) // most
    elif block > 0 and nb > block:
        steps = (nb + block - 1) // block
    return steps, bad


@numba.njit(cache=True, nogil=True)
def _tell_from(ctl, rc, msg_addr, G, g, t):
    """Tell the rail peers of turns t .. G - 2 that this rank gives up with
    status ``rc`` (best effort, as tell_rail_peer); returns rc. The current
    peer and the op rows stay those of the turn this rank failed in (its
    error names the peer and reports the rows)."""
    c = ctl[0]
    fd, peer = c.rail_fd, c.rail_peer
    ops = rail_views(c)[0]
    kept = ops.copy()
    for u in range(t, G - 1):
        select_peer(c, partner(G, g, u))
        tell_rail_peer(ctl, rc, msg_addr)
    c.rail_fd, c.rail_peer = fd, peer
    ops[:, :] = kept
    return rc


_ROUND_SIG = _i64(_ctl, types.intp, types.intp, _i64, types.int64[::1], _i64, _i64,
                  types.int64[:, ::1], types.int64[:, ::1], types.int64[:, ::1], _i64, types.intp,
                  types.intp, _i64, _i64, types.int64[::1])
_COPY_SIG = types.void(_ctl, types.intp, types.intp, _i64, types.int64[::1], _i64,
                       types.int64[:, ::1], _i64, types.intp, _i64)


@numba.njit(cache=True, nogil=True)
def _exchange(ctl, t, step_ns, msg_addr, send_addr, send_nb, send_tag, recv_addr, recv_cap,
              told_addr, state):
    """Post turn t's exchange with the current rail peer and wait for it:
    OK, or the status this rank gives up with (the peers of the later turns
    told). Turn t waits until t + 2 deadlines after its step began, so that
    a peer stuck in an earlier turn on a late rank gives up and tells
    first. A told message is looked for at ``told_addr``."""
    c = ctl[0]
    G, g = c.rail_nodes, c.rail_node
    state[7] = t
    ops, pollfds, scratch = rail_views(c)
    sockio.set_recv(ops, 0, c.rail_fd, recv_addr, recv_cap)
    now = monotonic_ns()
    until = step_ns + (t + 2) * c.timeout_ns
    # (the give-up time a receiver checks: the end of this rank's wait)
    sockio.set_send(ops, 1, c.rail_fd, send_addr, send_nb, send_tag,
                    sockio.realtime_ns() + max(until - now, c.timeout_ns))
    if sockio.kick(ops, 2, scratch) != sockio.IO_OK:
        if disagreed_then_left(ops):
            return OK   # (the peer ran another call: the turn's check says so)
        if not heard_told(ctl, ops, state, told_addr):
            node.abandon(ctl, c.rail_peer)
        return _tell_from(ctl, RAIL_FAILED, msg_addr, G, g, t + 1)
    rc = rail_wait(ctl, ops, pollfds, scratch, state, told_addr, until)
    if rc != OK:
        return _tell_from(ctl, rc, msg_addr, G, g, t + 1)
    return OK


@numba.njit(cache=True, nogil=True)
def _turn(ctl, t, k, x_addr, row_nb, plan, head, block, ranks, g, send_tab, expect_tab,
          msg_addr, bufs_addr, buf_cap, tag, poisoned, state, step_ns):
    """Turn t of a step through the messages (module docstring, 4): (status,
    poisoned)."""
    c = ctl[0]
    G, L = ranks.shape[0], c.local_size
    h = partner(G, g, t)
    select_peer(c, h)
    rc = node.peers_abandoned(ctl)
    if rc != OK:
        return _tell_from(ctl, rc, msg_addr, G, g, t), poisoned
    recv_addr = bufs_addr + h * buf_cap
    nb = 0
    send_tag = POISON_TAG
    if not poisoned:
        nb = _pack(c, msg_addr, ranks[h, c.local_rank], L, g, ranks, row_nb, k, head, block,
                   send_tab, expect_tab, x_addr, plan)
        send_tag = tag
    rc = _exchange(ctl, t, step_ns, msg_addr, msg_addr, nb, send_tag, recv_addr, buf_cap,
                   recv_addr, state)
    if rc != OK:
        return rc, poisoned
    ops = rail_views(c)[0]
    got_nb, got_tag = ops[0, sockio.OP_HDR_N], ops[0, sockio.OP_HDR_TAG]
    if got_tag != tag or got_nb < head_nbytes(L, send_tab.shape[0]) or got_nb > buf_cap:
        return OK, True
    if k == 0 and not poisoned:
        _take_table(recv_addr, h, L, ranks, send_tab, expect_tab)
    return OK, poisoned


@numba.njit(cache=True, nogil=True)
def _direct_turn(ctl, t, k, x_addr, out_addr, row_nb, plan, block, ranks, g, send_tab,
                 msg_addr, bufs_addr, buf_cap, tag, state, step_ns):
    """Turn t of a later step on one-rank nodes: step k's chunk of my
    segment for the partner straight from x, its chunk for me straight into
    out (a chunk shorter than a told message lands in the partner's buffer
    first). Returns (status, whether the message disagreed)."""
    c = ctl[0]
    G = ranks.shape[0]
    P = send_tab.shape[0]
    h = partner(G, g, t)
    select_peer(c, h)
    rc = node.peers_abandoned(ctl)
    if rc != OK:
        return _tell_from(ctl, rc, msg_addr, G, g, t), False
    me, peer = ranks[g, 0], ranks[h, 0]
    lo, most = span(k, block, 1, c.slot_nbytes)
    n_out = max(0, min(most, send_tab[me, peer] * row_nb - lo))
    n_in = max(0, min(most, send_tab[peer, me] * row_nb - lo))
    into = out_addr + recv_off(plan, P)[peer] * row_nb + lo
    recv_addr = into if n_in >= TOLD_NBYTES else bufs_addr + h * buf_cap
    rc = _exchange(ctl, t, step_ns, msg_addr, x_addr + send_off(plan, P)[peer] * row_nb + lo,
                   n_out, tag, recv_addr, n_in, recv_addr, state)
    if rc != OK:
        return rc, False
    ops = rail_views(c)[0]
    if ops[0, sockio.OP_HDR_TAG] != tag or ops[0, sockio.OP_HDR_N] != n_in:
        return OK, True
    if recv_addr != into:
        _memcpy(into, recv_addr, n_in)
    return OK, False


@numba.njit(cache=True, nogil=True)
def _turns(ctl, k, x_addr, out_addr, row_nb, plan, head, block, ranks, g, send_tab, expect_tab,
           msg_addr, bufs_addr, buf_cap, tag, poisoned, state, step_ns):
    """Every turn of step k, in partner's order: (status, poisoned)."""
    G = ranks.shape[0]
    doubling = _doubling_turns(G)
    direct = k > 0 and ctl[0].local_size == 1
    for t in range(G - 1):
        if t == doubling and poisoned:
            break   # (so is every other node: none takes another turn)
        if direct:
            rc, bad = _direct_turn(ctl, t, k, x_addr, out_addr, row_nb, plan, block, ranks, g,
                                   send_tab, msg_addr, bufs_addr, buf_cap, tag, state, step_ns)
            poisoned = poisoned or bad
        else:
            rc, poisoned = _turn(ctl, t, k, x_addr, row_nb, plan, head, block, ranks, g,
                                 send_tab, expect_tab, msg_addr, bufs_addr, buf_cap, tag,
                                 poisoned, state, step_ns)
        if rc != OK:
            return rc, poisoned
    return OK, poisoned


@numba.njit(cache=True, nogil=True)
def _node_round(ctl, x_addr, row_nb, plan, code, k, ranks, g, send_tab, expect_tab):
    """Steps 2-3 of the module docstring: my slot, the flag round, and on
    step 0 the node's rows of the table. OK, MISMATCH (the node's verdict
    kept) or the status this rank gives up with."""
    c = ctl[0]
    L, G = c.local_size, ranks.shape[0]
    P = G * L
    head, block = blocks(c.slot_nbytes, P, L)
    if L == 1:   # (step 0's data goes from x into the messages)
        write_header(c, x_addr, plan, P)
    else:
        fill_slot(c, x_addr, row_nb, plan, P, ranks[g, c.local_rank], k, head, block, k == 0)
    rc = node.stage_at(ctl, 0, 0, 0, 0, row_nb, code, _W, 0)
    if rc == MISMATCH:
        node.keep_mismatch(c)
    elif rc == OK and k == 0:
        _local_table(c, ranks, g, P, L, send_tab, expect_tab)
    return rc


@numba.njit(_ROUND_SIG, cache=True, nogil=True)
def _a2ag_round(ctl, x_addr, out_addr, row_nb, plan, code, k, send_tab, expect_tab, ranks, g,
                msg_addr, bufs_addr, buf_cap, tag, state):
    """Step k up to its status round (out_addr: where a later step on
    one-rank nodes receives; 0 on step 0). ``state`` (int64[STATE_WORDS])
    in: [steps (k > 0)]; out: [steps, bad pair or -1, another step follows,
    the status word of a poisoned round, then 1 and the told message's
    culprit word and first giver when a rail peer told, else 0; the last
    turn begun]. Returns OK, or the failed round's status (MISMATCH after
    this node's flag round disagreed keeps the node's verdict in err_*)."""
    c = ctl[0]
    L, me = c.local_size, c.local_rank
    G = ranks.shape[0]
    P = G * L
    rank = ranks[g, me]
    head, block = blocks(c.slot_nbytes, P, L)
    step_ns = monotonic_ns()
    state[4] = 0
    if k == 0:
        state[0], state[1] = 1, -1
    rc = node.peers_abandoned(ctl)
    if rc != OK:
        return _tell_from(ctl, rc, msg_addr, G, g, 0)
    local_bad = False
    if k == 0 or L > 1:   # (one-rank nodes: the later steps need no slot)
        rc = _node_round(ctl, x_addr, row_nb, plan, code, k, ranks, g, send_tab, expect_tab)
        if rc != OK and rc != MISMATCH:
            return _tell_from(ctl, rc, msg_addr, G, g, 0)
        local_bad = rc == MISMATCH
    rc, poisoned = _turns(ctl, k, x_addr, out_addr, row_nb, plan, head, block, ranks, g, send_tab,
                          expect_tab, msg_addr, bufs_addr, buf_cap, tag, local_bad, state,
                          step_ns)
    if rc != OK:
        return rc
    if k == 0 and not poisoned:
        state[0], state[1] = _verdict(send_tab, expect_tab, rank, plan, row_nb, block, L,
                                      c.slot_nbytes)
    state[2] = 1 if (not poisoned and state[1] < 0 and state[0] > k + 1) else 0
    rc = node.publish_wait_status(ctl, 1 if poisoned else 0)
    state[3] = c.err_a if rc == POISONED else 0
    if rc != OK and rc != POISONED:
        return rc
    if local_bad:
        return node.settle_mismatch(c)
    return rc


@numba.njit(cache=True, nogil=True)
def _unpack(msg_addr, out_addr, L, h, ranks, row_nb, k, block, rows_in, roff):
    """Chunk k of every segment in node h's message into out."""
    pos = msg_addr + head_nbytes(L, rows_in.shape[0])
    lo = k * block
    for i in range(L):
        src = ranks[h, i]
        seg = rows_in[src] * row_nb
        if lo < seg:
            n = min(block, seg - lo)
            _memcpy(out_addr + roff[src] * row_nb + lo, pos, n)
            pos += n


@numba.njit(_COPY_SIG, cache=True, nogil=True)
def _a2ag_copy(ctl, x_addr, out_addr, row_nb, plan, k, ranks, g, bufs_addr, buf_cap):
    """Step k's copies into out: my own rows (step 0), the local senders'
    chunks from their slots, every other node's from its buffer."""
    c = ctl[0]
    L, me = c.local_size, c.local_rank
    G = ranks.shape[0]
    P = G * L
    rank = ranks[g, me]
    head, block = blocks(c.slot_nbytes, P, L)
    rows_in, roff = recv(plan, P), recv_off(plan, P)
    if k == 0:
        prefix(rows_in, roff, P)
        own_rows(x_addr, out_addr, row_nb, plan, P, rank)
    elif L == 1:
        return   # (its later steps received straight into out)
    local_out(c, out_addr, L, g, ranks, rank, row_nb, k, head, block, rows_in, roff)
    for h in range(G):
        if h != g:
            _unpack(bufs_addr + h * buf_cap, out_addr, L, h, ranks, row_nb, k, block, rows_in,
                    roff)


#: words of a round's state (_a2ag_round)
STATE_WORDS = 8
#: the words at the control block's a2a_args (HierAlltoall writes them): the
#: addresses of send_tab and expect_tab (int64[P, P]), ranks (int64[G, L]),
#: the state (int64[7]), my message and the nodes' buffers; G, g, and the
#: buffers' stride
(A_SEND, A_EXPECT, A_RANKS, A_STATE, A_MSG, A_BUFS, A_G, A_NODE, A_CAP) = range(9)
ARGS_WORDS = 9


@numba.njit(cache=True, nogil=True)
def _run(ctl, x_addr, out_addr, row_nb, plan, code):
    """Every step of a call whose output is already sized (an even split,
    or the counts this rank expects: out has their rows when every pair
    agrees, which the verdict checks): OK with the plan's bad_pair set, or
    the failed round's status."""
    c = ctl[0]
    a = numba.carray(_voidptr(c.a2a_args), (ARGS_WORDS,), np.int64)
    G, g, cap = a[A_G], a[A_NODE], a[A_CAP]
    L = c.local_size
    P = G * L
    send_tab = numba.carray(_voidptr(a[A_SEND]), (P, P), np.int64)
    expect_tab = numba.carray(_voidptr(a[A_EXPECT]), (P, P), np.int64)
    ranks = numba.carray(_voidptr(a[A_RANKS]), (G, L), np.int64)
    state = numba.carray(_voidptr(a[A_STATE]), (STATE_WORDS,), np.int64)
    spread_even_rows(plan, P)
    prefix(send(plan, P), send_off(plan, P), P)
    tag = rail_tag(row_nb, code)
    k = 0
    while True:
        rc = _a2ag_round(ctl, x_addr, out_addr if k > 0 else 0, row_nb, plan, code, k, send_tab,
                         expect_tab, ranks, g, a[A_MSG], a[A_BUFS], cap, tag, state)
        if rc != OK:
            return rc
        if k == 0:
            plan[bad_pair_at(P)] = state[1]
            if state[1] >= 0:
                return OK   # (every rank saw it; none writes its output)
        _a2ag_copy(ctl, x_addr, out_addr, row_nb, plan, k, ranks, g, a[A_BUFS], cap)
        k += 1
        if state[2] == 0:
            return OK


@numba.cfunc(_i64(_i64, _i64, _i64, _i64, _i64, _i64), cache=True, nogil=True)
def _a2ag_cfunc(ctl_addr, x_addr, out_addr, row_nb, plan_addr, code):
    """A whole even all-to-all for C callers (harmpi/_native.cpp, as
    one_node's ALLTOALL_CFUNC): enter, every step, leave."""
    ctl = control_at(ctl_addr)
    rc = node.enter(ctl)
    if rc != OK:
        return rc
    c = ctl[0]
    G = numba.carray(_voidptr(c.a2a_args), (ARGS_WORDS,), np.int64)[A_G]
    P = G * c.local_size
    plan = numba.carray(_voidptr(plan_addr), (plan_words(P),), np.int64)
    if c.profile != 0:
        node.begin(ctl, plan[even_rows_at(P)] * P * row_nb, code)
    rc = _run(ctl, x_addr, out_addr, row_nb, plan, code)
    node.leave(ctl)
    return rc


_RUN_SIG = _i64(_ctl, types.intp, types.intp, _i64, types.int64[::1], _i64)


@numba.njit(_RUN_SIG, cache=True, nogil=True)
def _a2ag_run(ctl, x_addr, out_addr, row_nb, plan, code):
    """_run for Python callers inside an entered context (an output sized
    from the counts this rank expects)."""
    return _run(ctl, x_addr, out_addr, row_nb, plan, code)


A2AG_RUN = node.entry_point(_a2ag_run, _RUN_SIG)
A2AG_ROUND = node.entry_point(_a2ag_round, _ROUND_SIG)
A2AG_COPY = node.entry_point(_a2ag_copy, _COPY_SIG)
#: _a2ag_cfunc's C address (0 under NUMBA_DISABLE_JIT)
A2AG_CFUNC = getattr(_a2ag_cfunc, "address", 0)
