"""The all-to-all over the tcp rail on G = 2^k > 2 nodes, compiled: a call per step and its copies.

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
their slots, node h's from its buffer.

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
t + 2 deadlines after its step began (two_nodes_tcp.rail_wait): a peer
stuck in an earlier turn gives up and tells first. A rank that never
arrives thus fails every other rank within G deadlines.

Cost per step: two flag rounds, G - 1 messages each way per rank, one
after the other (all rails in parallel); rows cross the network once. 4 x 1
on the 2-vCPU AMD EPYC, bf16, MPI over TCP: see the closing figures in
the README's all-to-all section. (Before: MPI_Ialltoallv after a gather of
every rank's counts, 2-3x MPI_Alltoall's time.)
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import register_jitable

from ... import node
from ...base.control import ARRAY as _ctl
from ...base.control import MISMATCH, OK, POISONED, RAIL_FAILED
from ...base.control import voidptr as _voidptr
from ...base.kind import POISON_TAG
from ...base.sync import monotonic_ns
from ...transports import sockio
from ..rail_turns import rail_views, select_peer
from .one_node import fill_slot, own_rows
from .plan import geometry, prefix, recv, recv_off
from .rail_message import local_out
from .two_nodes_tcp import heard_told, rail_wait, tell_rail_peer

__all__ = ["A2AG_ROUND", "A2AG_COPY", "partner", "msg_nbytes", "alltoall_compiled"]

_W = np.empty(0, np.uint16)  # (one_node's witness of the flag rounds)
_memcpy = node.memcpy
_slot_addr = node.parity_slot_addr
_parity = node.step_parity
_i64 = types.int64


def alltoall_compiled(node_count):
    """Whether G uniform nodes with a compiled rail take these steps: 2^k > 2."""
    return node_count > 2 and node_count & (node_count - 1) == 0


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
def head_nbytes(L, P):
    """Bytes of a step message's header (1 + 2 L P words), padded to 64."""
    return (8 * (1 + 2 * L * P) + 63) // 64 * 64


def msg_nbytes(slot_nbytes, G, L):
    """The largest step message (header and L chunks of a block): each
    node's receive buffer holds one."""
    P = G * L
    return head_nbytes(L, P) + L * geometry(slot_nbytes, P)[1]


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
def _pack(c, msg_addr, dest, L, g, ranks, row_nb, k, head, block, send_tab, expect_tab):
    """My message for rank ``dest`` (module docstring); returns its bytes."""
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
            _memcpy(msg_addr + pos, _slot_addr(c, parity, i) + head + dest * block, n)
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
def _verdict(send_tab, expect_tab, me, plan, row_nb, block):
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
    if block > 0 and longest * row_nb > block:
        steps = (longest * row_nb + block - 1) // block
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


_ROUND_SIG = _i64(_ctl, types.intp, _i64, types.int64[::1], _i64, _i64, types.int64[:, ::1],
                  types.int64[:, ::1], types.int64[:, ::1], _i64, types.intp, types.intp, _i64,
                  _i64, types.int64[::1])
_COPY_SIG = types.void(_ctl, types.intp, types.intp, _i64, types.int64[::1], _i64,
                       types.int64[:, ::1], _i64, types.intp, _i64)


@numba.njit(cache=True, nogil=True)
def _turn(ctl, t, k, row_nb, head, block, ranks, g, send_tab, expect_tab, msg_addr, bufs_addr,
          buf_cap, tag, poisoned, state, step_ns):
    """Turn t of step k (module docstring, 4): (status, poisoned). On a
    failure the peers of the later turns are told."""
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
                   send_tab, expect_tab)
        send_tag = tag
    ops, pollfds, scratch = rail_views(c)
    sockio.set_recv(ops, 0, c.rail_fd, recv_addr, buf_cap)
    # turn t waits until (t + 2) deadlines after the step began, so that a
    # peer stuck in an earlier turn on a late rank gives up and tells first
    now = monotonic_ns()
    until = step_ns + (t + 2) * c.timeout_ns
    # (the give-up time a receiver checks: the end of this rank's wait)
    sockio.set_send(ops, 1, c.rail_fd, msg_addr, nb, send_tag,
                    sockio.realtime_ns() + max(until - now, c.timeout_ns))
    if sockio.kick(ops, 2, scratch) != sockio.IO_OK:
        if not heard_told(ctl, ops, state, recv_addr):
            node.abandon(ctl, c.rail_peer)
        return _tell_from(ctl, RAIL_FAILED, msg_addr, G, g, t + 1), poisoned
    rc = rail_wait(ctl, ops, pollfds, scratch, state, recv_addr, until)
    if rc != OK:
        return _tell_from(ctl, rc, msg_addr, G, g, t + 1), poisoned
    got_nb, got_tag = ops[0, sockio.OP_HDR_N], ops[0, sockio.OP_HDR_TAG]
    if got_tag != tag or got_nb < head_nbytes(L, send_tab.shape[0]) or got_nb > buf_cap:
        return OK, True
    if k == 0 and not poisoned:
        _take_table(recv_addr, h, L, ranks, send_tab, expect_tab)
    return OK, poisoned


@numba.njit(cache=True, nogil=True)
def _turns(ctl, k, row_nb, head, block, ranks, g, send_tab, expect_tab, msg_addr, bufs_addr,
           buf_cap, tag, poisoned, state, step_ns):
    """Every turn of step k, in partner's order: (status, poisoned)."""
    G = ranks.shape[0]
    doubling = _doubling_turns(G)
    for t in range(G - 1):
        if t == doubling and poisoned:
            break   # (so is every other node: none takes another turn)
        rc, poisoned = _turn(ctl, t, k, row_nb, head, block, ranks, g, send_tab, expect_tab,
                             msg_addr, bufs_addr, buf_cap, tag, poisoned, state, step_ns)
        if rc != OK:
            return rc, poisoned
    return OK, poisoned


@numba.njit(_ROUND_SIG, cache=True, nogil=True)
def _a2ag_round(ctl, x_addr, row_nb, plan, code, k, send_tab, expect_tab, ranks, g, msg_addr,
                bufs_addr, buf_cap, tag, state):
    """Step k up to its status round. ``state`` (int64[7]) in: [steps (k >
    0)]; out: [steps, bad pair or -1, another step follows, the status
    word of a poisoned round, then 1 and the told message's culprit word
    and first giver when a rail peer told, else 0]. Returns OK, or the
    failed round's status (MISMATCH after this node's flag round
    disagreed keeps the node's verdict in err_*)."""
    c = ctl[0]
    L, me = c.local_size, c.local_rank
    G = ranks.shape[0]
    P = G * L
    rank = ranks[g, me]
    head, block = geometry(c.slot_nbytes, P)
    step_ns = monotonic_ns()
    state[4] = 0
    if k == 0:
        state[0], state[1] = 1, -1
    rc = node.peers_abandoned(ctl)
    if rc != OK:
        return _tell_from(ctl, rc, msg_addr, G, g, 0)
    fill_slot(c, x_addr, row_nb, plan, P, rank, k, head, block, k == 0)
    rc = node.stage_at(ctl, 0, 0, 0, 0, row_nb, code, _W, 0)
    if rc != OK and rc != MISMATCH:
        return _tell_from(ctl, rc, msg_addr, G, g, 0)
    local_bad = rc == MISMATCH
    if local_bad:
        node.keep_mismatch(c)
    elif k == 0:
        _local_table(c, ranks, g, P, L, send_tab, expect_tab)
    rc, poisoned = _turns(ctl, k, row_nb, head, block, ranks, g, send_tab, expect_tab, msg_addr,
                          bufs_addr, buf_cap, tag, local_bad, state, step_ns)
    if rc != OK:
        return rc
    if k == 0 and not poisoned:
        state[0], state[1] = _verdict(send_tab, expect_tab, rank, plan, row_nb, block)
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
    head, block = geometry(c.slot_nbytes, P)
    rows_in, roff = recv(plan, P), recv_off(plan, P)
    if k == 0:
        prefix(rows_in, roff, P)
        own_rows(x_addr, out_addr, row_nb, plan, P, rank)
    local_out(c, out_addr, L, g, ranks, rank, row_nb, k, head, block, rows_in, roff)
    for h in range(G):
        if h != g:
            _unpack(bufs_addr + h * buf_cap, out_addr, L, h, ranks, row_nb, k, block, rows_in,
                    roff)


A2AG_ROUND = node.entry_point(_a2ag_round, _ROUND_SIG)
A2AG_COPY = node.entry_point(_a2ag_copy, _COPY_SIG)
