"""Compiled turns of the tcp rail: one exchange with one rail peer, and the
G-node schedules har_latency's compiled steps build from them.

A *turn* posts one exchange with one rail peer (row 0 of the op table
receives, row 1 sends; either may be absent) and completes it in
sockio.progress, sleeping in poll(2) past the spin budget. Every send
checks first that no local rank gave up (a node one of whose ranks left
sends nothing the other nodes could complete a step with; the rail peer
learns from the abandon notice), and every failed or late turn abandons
the peer (rail_outcome). The control block holds the socket and rank of the
current peer (rail_fd, rail_peer) and, for G > 2, every node's
(rail_fds, rail_world), which a turn switches between.

Schedules over G nodes (rank g of its rail, the same local rank on every
node, m elements in place at ``slot``):

``rail_doubling`` (any G; P the largest power of two <= G): the extra nodes
  g >= P hand their tensor to node g - P first and get the total back last;
  in between log2 P turns exchange the whole tensor with g ^ k (k = 1, 2,
  ..., P/2) and add it. The same messages as the Python
  harmpi.algorithms.base.rail_allreduce, so either path meets the other.
  Cost per rank: log2 P messages of m bytes, log2 P adds of m.

``rail_halving`` (G a power of two, one rank per node, large m): recursive
  halving, then recursive doubling of the owned pieces. Turn b (b = 1, 2,
  ..., G/2) splits the segment this node still sums in two halves, sends
  the half its partner g ^ b keeps and adds the partner's copy of the half
  it keeps (the first turn reads x, later ones the slot); after log2 G turns
  node g owns 1/G of the tensor, summed over every node. Then the same
  partners in the reverse order swap owned pieces, x[mine] out and theirs
  straight into x, until every node holds all of it. Cost per rank: 2 m
  (G-1)/G bytes sent in 2 log2 G messages, m (G-1)/G elements added, no
  copy of the whole tensor (against log2 G * m bytes and adds for
  doubling): the schedule for large tensors. 4 virtual nodes x 1, 2-vCPU
  Xeon, bf16 medians: 1 MB 938-970 us (doubling 1684; MPI over TCP 751-923
  in the same runs), 4 MB 3902-3928 (MPI 4579-4882).

``rail_rsag2`` (two nodes of one rank, more than one step of m): each step
  is a reduce-scatter + allgather over the rail, node 0 owning the first
  half of the step, node 1 the rest: send the peer's half of x and receive
  the peer's copy of mine; x[my half] += it; send my summed half and
  receive the peer's summed half straight into x. The second exchange of
  step k rides in the same round as the first of step k+1 (S + 1 rounds for
  S steps instead of 2S; each round has at most one step, 512 KiB, in flight
  each way). Each end moves the same bytes as in one exchange of the step
  but adds half of them and copies none. 2 x 1 bf16 medians on the 2-vCPU
  Xeon, 1 MB: two plain exchanges 285-340 us, these steps unpipelined
  238-285, MPI over TCP 340-390.

Why a disagreement never yields data: the tag of every message folds in the
call's total bytes and kind, and a node whose message or whose partner's
message disagrees is *poisoned*: it goes on with the same turns but sends
POISON_TAG and adds nothing. Both schedules start with log2 P turns with the
same partners in the same order (g ^ 1, g ^ 2, ...), and after turn b a node
is unpoisoned only if every node of its 2b-node subcube agreed with it; so
after those turns either every node of the cube is poisoned or they all
agree, whichever schedule each picked (they pick by the step's size, which
agreeing nodes share). rail_halving therefore skips its second half when
poisoned (so does every other node), and its second half, which writes x,
runs only where every node agreed. rail_rsag2's first round carries the
first message each way, whose tag tells either node of any disagreement
(as it would a peer that took one plain exchange); neither then sends more.
x is not written before that; a failure
(a deadline, a lost peer, Ctrl-C) in the second half raises with x partly
written: an error, never a silent result.
"""

from __future__ import annotations

import numba
import numpy as np

from .. import node
from ..base import control, kind
from ..base.control import OK, RAIL_FAILED, RAIL_LATE, RAIL_TIMEOUT
from ..base.kind import ABANDON_TAG
from ..transports import sockio

__all__ = ["RAIL_ROWS", "PIPE_ROWS", "HALVING_MIN_NBYTES", "rail_rsag2", "rail_views",
           "rail_outcome", "disagreed_then_left", "rail_complete", "post_exchange", "select_peer",
           "rail_turn", "got", "fold_in", "rail_doubling", "rail_halving", "use_halving"]

_voidptr = control.voidptr

#: op table rows of a rail exchange: 0 receives, 1 sends
RAIL_ROWS = 2
#: rows of rail_rsag2's rounds (two exchanges at once: 0/2 receive, 1/3 send);
#: the control block's table and poll set have this many
PIPE_ROWS = 4

#: one-rank nodes, G a power of two > 2: a step larger than this halves
#: (rail_halving) instead of doubling. 4 x 1 on the 2-vCPU Xeon: at 1 MB
#: halving 938-970 us against doubling's 1684; doubling's log2 G whole-tensor
#: messages stay cheaper for small steps, where a turn's latency dominates
HALVING_MIN_NBYTES = 256 << 10


@numba.njit(cache=True, nogil=True)
def rail_views(c):
    """The op table, poll set and scratch of the control block's rail."""
    ops = numba.carray(_voidptr(c.rail_ops), (RAIL_ROWS, sockio.OP_WORDS), np.int64)
    pollfds = numba.carray(_voidptr(c.rail_pollfds), (RAIL_ROWS, 2), np.int32)
    scratch = numba.carray(_voidptr(c.rail_scratch), (c.rail_scratch_len,), np.int64)
    return ops, pollfds, scratch


@numba.njit(cache=True, nogil=True)
def disagreed_then_left(ops):
    """The peer's whole message came, then its abandon notice, and its tag
    is not the one this rank posted with its own part: the two ran
    different calls, and the peer already failed its side. The step fails
    here as the disagreement it is (the caller's check of the message),
    not as a peer that gave up, so both ends raise the same error: with two
    compiled ends, a peer's give-up after a disagreement between
    collectives (failures.mismatch_is_clean) could reach the socket before
    this rank read the message. This rank's own part need not have gone:
    a peer that left first may have closed its socket before it was sent
    (the receive row, first in the op table, fails before the send starts)."""
    return (ops[0, sockio.OP_STATE] == sockio.ST_FAILED
            and ops[0, sockio.OP_ERRNO] == sockio.ERR_ABANDONED
            and ops[0, sockio.OP_HDR_TAG] != ABANDON_TAG
            and ops[0, sockio.OP_DONE] == sockio.HEADER_NBYTES + ops[0, sockio.OP_HDR_N]
            and ops[1, sockio.OP_KIND] == sockio.KIND_SEND
            and ops[0, sockio.OP_HDR_TAG] != ops[1, sockio.OP_HDR_TAG])


@numba.njit(cache=True, nogil=True)
def rail_outcome(ctl, ops, io):
    """The status of a rail exchange that sockio.progress ended with ``io``
    (rail_complete's, and the two-node all-to-all's longer wait): OK, or
    the status of a step this rank gives up on (its rail peer is told by
    the abandon)."""
    c = ctl[0]
    if io == sockio.IO_INTERRUPTED:
        return node.interrupted(ctl)
    if io != sockio.IO_OK and disagreed_then_left(ops):
        return OK   # (the caller's check of the message fails the step)
    if io != sockio.IO_OK:
        node.abandon(ctl, c.rail_peer)
        return RAIL_TIMEOUT if io == sockio.IO_TIMEOUT else RAIL_FAILED
    if sockio.realtime_ns() > ops[0, sockio.OP_HDR_DL]:
        # the peer's message is older than its deadline: it gave up on this
        # step (or is about to), so this rank must not complete it
        node.abandon(ctl, c.rail_peer)
        return RAIL_LATE
    return OK


@numba.njit(cache=True, nogil=True)
def rail_complete(ctl, ops, pollfds, scratch):
    """Wait for the posted exchange with the rail peer: OK, or the status
    of a step this rank gives up on (its rail peer is told by the abandon)."""
    c = ctl[0]
    io = sockio.progress(ops, RAIL_ROWS, c.rail_spin, c.timeout_ns, pollfds, scratch,
                         node.hook_addr(ctl), c.wait_yield, node.wait_addr(ctl))
    return rail_outcome(ctl, ops, io)


@numba.njit(cache=True, nogil=True)
def post_exchange(ctl, ops, scratch, recv_addr, recv_cap, send_addr, send_nbytes, tag):
    """Post an exchange with the current rail peer (rail_fd): receive into
    ``recv_addr`` (none when ``recv_cap`` < 0), send ``send_nbytes`` at
    ``send_addr`` with ``tag`` (none when ``send_nbytes`` < 0), and start
    both. OK, or the status of a step this rank gives up on."""
    c = ctl[0]
    if send_nbytes >= 0:
        # no data leaves this node once one of its ranks gave up (Context.guard)
        rc = node.peers_abandoned(ctl)
        if rc != OK:
            return rc
    if recv_cap >= 0:
        sockio.set_recv(ops, 0, c.rail_fd, recv_addr, recv_cap)
    else:   # (a far deadline: rail_outcome reads row 0's)
        ops[0, sockio.OP_STATE] = sockio.ST_DONE
        ops[0, sockio.OP_HDR_DL] = 1 << 62
    if send_nbytes >= 0:
        sockio.set_send(ops, 1, c.rail_fd, send_addr, send_nbytes, tag,
                        sockio.realtime_ns() + c.timeout_ns)
    else:   # (no kind: a send row left from an earlier exchange is not this one's)
        ops[1, sockio.OP_STATE] = sockio.ST_DONE
        ops[1, sockio.OP_KIND] = -1
    if sockio.kick(ops, RAIL_ROWS, scratch) != sockio.IO_OK:
        if disagreed_then_left(ops):
            return OK   # (the caller's check of the message fails the step)
        node.abandon(ctl, c.rail_peer)
        return RAIL_FAILED
    return OK


@numba.njit(cache=True, nogil=True)
def select_peer(c, h):
    """Make node h's rail peer the current one (rail_fd, rail_peer)."""
    fds = numba.carray(_voidptr(c.rail_fds), (c.rail_nodes,), np.int64)
    world = numba.carray(_voidptr(c.rail_world), (c.rail_nodes,), np.int64)
    c.rail_fd = fds[h]
    c.rail_peer = world[h]


@numba.njit(cache=True, nogil=True)
def rail_turn(ctl, ops, pollfds, scratch, h, send_addr, send_nbytes, send_tag, recv_addr,
              recv_cap):
    """One turn with node h's rail peer: post_exchange, then rail_complete
    (on failure the peer is in rail_peer)."""
    select_peer(ctl[0], h)
    rc = post_exchange(ctl, ops, scratch, recv_addr, recv_cap, send_addr, send_nbytes, send_tag)
    if rc != OK:
        return rc
    return rail_complete(ctl, ops, pollfds, scratch)


@numba.njit(cache=True, nogil=True)
def got(ops, nbytes, tag, row=0):
    """The message received in ``row`` is the expected one (bytes and tag)."""
    return ops[row, sockio.OP_HDR_N] == nbytes and ops[row, sockio.OP_HDR_TAG] == tag


@numba.njit(cache=True, nogil=True)
def fold_in(c, ops, slot, m, tag, poisoned, fmt, w):
    """After a turn that received: slot += the peer's message unless either
    side is poisoned; returns the new poisoned flag."""
    if not got(ops, m * w.itemsize, tag):
        return True
    if not poisoned:
        node.add_into(slot, c.rail_recv, m, fmt, w)
    return poisoned


@numba.njit(cache=True, nogil=True)
def _recv_turn(ctl, ops, pollfds, scratch, h):
    """A turn that only receives, into the rail receive buffer."""
    c = ctl[0]
    return rail_turn(ctl, ops, pollfds, scratch, h, 0, -1, 0, c.rail_recv, c.rail_recv_cap)


@numba.njit(cache=True, nogil=True)
def rail_doubling(ctl, ops, pollfds, scratch, slot, m, tag, poisoned, fmt, w):
    """Recursive doubling over the G rail peers of this rank, in place at
    ``slot`` (module docstring). Returns (status, poisoned)."""
    c = ctl[0]
    G, g = c.rail_nodes, c.rail_node
    nbytes = m * w.itemsize
    P = 1
    while P * 2 <= G:
        P *= 2
    if g >= P:   # extra node: hand x to the partner, get the total back
        rc = rail_turn(ctl, ops, pollfds, scratch, g - P, slot, nbytes,
                       kind.POISON_TAG if poisoned else tag, 0, -1)
        if rc == OK:
            rc = _recv_turn(ctl, ops, pollfds, scratch, g - P)
        if rc != OK or poisoned or not got(ops, nbytes, tag):
            return rc, True
        node.memcpy(slot, c.rail_recv, nbytes)
        return OK, False
    if g < G - P:   # take the extra node's part first
        rc = _recv_turn(ctl, ops, pollfds, scratch, g + P)
        if rc != OK:
            return rc, poisoned
        poisoned = fold_in(c, ops, slot, m, tag, poisoned, fmt, w)
    k = 1
    while k < P:
        rc = rail_turn(ctl, ops, pollfds, scratch, g ^ k, slot, nbytes,
                       kind.POISON_TAG if poisoned else tag, c.rail_recv, c.rail_recv_cap)
        if rc != OK:
            return rc, poisoned
        poisoned = fold_in(c, ops, slot, m, tag, poisoned, fmt, w)
        k <<= 1
    rc = OK
    if g < G - P:   # and send it the total
        rc = rail_turn(ctl, ops, pollfds, scratch, g + P, slot, nbytes,
                       kind.POISON_TAG if poisoned else tag, 0, -1)
    return rc, poisoned


@numba.njit(cache=True, nogil=True)
def use_halving(c, nbytes):
    """Whether an ``nbytes`` step of this rank's all-reduce halves: one rank
    per node, G a power of two above 2, more than HALVING_MIN_NBYTES."""
    G = c.rail_nodes
    return (c.local_size == 1 and G > 2 and (G & (G - 1)) == 0
            and nbytes > HALVING_MIN_NBYTES)


@numba.njit(cache=True, nogil=True)
def _segment(g, m, limit):
    """(first element, count) of the part of an m-element step node g still
    sums after the halving turns b = 1, 2, ... below ``limit``."""
    lo, cnt = 0, m
    b = 1
    while b < limit:
        h = cnt // 2
        if g & b:
            lo, cnt = lo + h, cnt - h
        else:
            cnt = h
        b <<= 1
    return lo, cnt


@numba.njit(cache=True, nogil=True)
def rail_halving(ctl, ops, pollfds, scratch, x_addr, slot, m, tag, fmt, w):
    """Recursive halving, then doubling of the owned pieces (module
    docstring), over x[:m] at ``x_addr`` with the partial sums in ``slot``.
    Returns (status, bad): bad when a disagreement was seen (x untouched if
    in the first half, which is where agreeing nodes can see one)."""
    c = ctl[0]
    G, g = c.rail_nodes, c.rail_node
    isz = w.itemsize
    poisoned = False
    src = x_addr    # the first turn reads x, the later ones the slot
    b = 1
    while b < G:
        lo, cnt = _segment(g, m, b)
        keep, keep_n = _segment(g, m, b << 1)
        give = lo + keep_n if keep == lo else lo
        give_n = cnt - keep_n
        rc = rail_turn(ctl, ops, pollfds, scratch, g ^ b, src + give * isz, give_n * isz,
                       kind.POISON_TAG if poisoned else tag, c.rail_recv, c.rail_recv_cap)
        if rc != OK:
            return rc, poisoned
        if not got(ops, keep_n * isz, tag):
            poisoned = True
        if not poisoned:
            node.add_to(slot + keep * isz, src + keep * isz, c.rail_recv, keep_n, fmt, w)
        src = slot
        b <<= 1
    if poisoned:    # (so is every node of the cube: none goes on)
        return OK, True
    lo, cnt = _segment(g, m, G)
    node.memcpy(x_addr + lo * isz, slot + lo * isz, cnt * isz)
    b = G >> 1
    while b >= 1:
        lo, cnt = _segment(g, m, b << 1)
        theirs, theirs_n = _segment(g ^ b, m, b << 1)
        rc = rail_turn(ctl, ops, pollfds, scratch, g ^ b, x_addr + lo * isz, cnt * isz, tag,
                       x_addr + theirs * isz, theirs_n * isz)
        if rc != OK:
            return rc, False
        if not got(ops, theirs_n * isz, tag):
            return OK, True
        b >>= 1
    return OK, False


@numba.njit(cache=True, nogil=True)
def _halves(c, m):
    """(first element, count) of this rank's half of an m-element step and
    of its rail peer's: node 0 owns x[:m // 2], node 1 the rest."""
    h = m // 2
    if c.rail_node == 0:
        return 0, h, h, m - h
    return h, m - h, 0, h


@numba.njit(cache=True, nogil=True)
def _pipe_views(c):
    ops = numba.carray(_voidptr(c.rail_ops), (PIPE_ROWS, sockio.OP_WORDS), np.int64)
    pollfds = numba.carray(_voidptr(c.rail_pollfds), (PIPE_ROWS, 2), np.int32)
    return ops, pollfds


@numba.njit(cache=True, nogil=True)
def _idle(ops, i):
    """Row i (and its send, i + 1) has nothing to do this round."""
    ops[i, sockio.OP_STATE] = sockio.ST_DONE
    ops[i, sockio.OP_HDR_DL] = 1 << 62
    ops[i + 1, sockio.OP_STATE] = sockio.ST_DONE
    ops[i + 1, sockio.OP_KIND] = -1


@numba.njit(cache=True, nogil=True)
def _post_round(c, ops, x_addr, start, m, prev, prev_m, tag, isz):
    """Rows of one rail_rsag2 round: the first exchange of the step at
    ``start`` (rows 0/1, none when m = 0) and the second of the step at
    ``prev`` (rows 2/3, none when prev < 0); on the wire, both ways, the
    first before the second."""
    fd = c.rail_fd
    give_up = sockio.realtime_ns() + c.timeout_ns
    _mine, _mine_n, theirs, theirs_n = _halves(c, m)
    if m > 0:
        sockio.set_recv(ops, 0, fd, c.rail_recv, c.rail_recv_cap)
        sockio.set_send(ops, 1, fd, x_addr + (start + theirs) * isz, theirs_n * isz, tag,
                        give_up)
    else:
        _idle(ops, 0)
    p_mine, p_mine_n, p_theirs, p_theirs_n = _halves(c, prev_m)
    if prev >= 0:
        sockio.set_recv(ops, 2, fd, x_addr + (prev + p_theirs) * isz, p_theirs_n * isz)
        sockio.set_send(ops, 3, fd, x_addr + (prev + p_mine) * isz, p_mine_n * isz, tag,
                        give_up)
    else:
        _idle(ops, 2)


@numba.njit(cache=True, nogil=True)
def _run_round(ctl, ops, pollfds, scratch):
    """Start and complete a posted round: OK or the status of a step this
    rank gives up on (rail_outcome, for both receive rows)."""
    c = ctl[0]
    if sockio.kick(ops, PIPE_ROWS, scratch) != sockio.IO_OK:
        node.abandon(ctl, c.rail_peer)
        return RAIL_FAILED
    io = sockio.progress(ops, PIPE_ROWS, c.rail_spin, c.timeout_ns, pollfds, scratch,
                         node.hook_addr(ctl), c.wait_yield, node.wait_addr(ctl))
    rc = rail_outcome(ctl, ops, io)
    if rc == OK and sockio.realtime_ns() > ops[2, sockio.OP_HDR_DL]:
        node.abandon(ctl, c.rail_peer)   # (rail_outcome read row 0's)
        rc = RAIL_LATE
    return rc


@numba.njit(cache=True, nogil=True)
def rail_rsag2(ctl, x_addr, n, chunk, tag, fmt, w):
    """The pipelined two-node reduce-scatter + allgather steps over x[:n]
    in steps of ``chunk`` elements (module docstring). Returns (status, bad,
    first): bad when a message disagreed, first the peer's give-up time of
    the first round (profiling)."""
    c = ctl[0]
    isz = w.itemsize
    ops, pollfds = _pipe_views(c)
    _ops2, _pollfds2, scratch = rail_views(c)
    first = 0
    start, prev, prev_m = 0, -1, 0
    while True:
        m = min(chunk, n - start)
        rc = node.peers_abandoned(ctl)
        if rc != OK:
            return rc, False, first
        _post_round(c, ops, x_addr, start, m, prev, prev_m, tag, isz)
        rc = _run_round(ctl, ops, pollfds, scratch)
        if rc != OK:
            return rc, False, first
        if prev < 0:
            first = ops[0, sockio.OP_HDR_DL]
        mine, mine_n, _theirs, _theirs_n = _halves(c, m)
        _p_mine, _p_mine_n, _p_theirs, p_theirs_n = _halves(c, prev_m)
        if (m > 0 and not got(ops, mine_n * isz, tag)) or (
                prev >= 0 and not got(ops, p_theirs_n * isz, tag, 2)):
            return OK, True, first
        if m == 0:
            return OK, False, first
        node.add_into(x_addr + (start + mine) * isz, c.rail_recv, mine_n, fmt, w)
        prev, prev_m = start, m
        start += m
