"""The two-node all-to-all's rail messages: a step's message, and the told message.

Two nodes of L ranks (P = 2L); rank (g, l)'s rail peer is (g', l).

A step message from rank (g, l) to (g', l) (pack_message):
  1. a header of 2L + 1 int64 words, padded to 64 bytes (msg_head_nbytes):
     [more: node g has more steps (0 or 1), the rows each local rank i of
     g sends (g', l), the rows (g, l) expects from each rank i of g'];
  2. for each local rank i of g, chunk k of its slot block for (g', l),
     read from its slot, back to back (empty chunks take no bytes).
The receiver (take_header) checks, on step 0, both directions of its rail:
what g' sends it against its own expectations, what g sends (g', l)
against (g', l)'s. The two ends of a rail thus see the same verdict.

A told message (TOLD_WORDS words, tag POISON_TAG) replaces the step
message of a rank that gave up before sending it: [TOLD_MAGIC, the culprit
word it posted (harmpi.node.abandon), the local rank that gave up first].
A step message's first word is 0 or 1, never TOLD_MAGIC.

Invariants: the header is read only after the rail exchange completed;
message bytes past the header follow the order of the local ranks, so
the receiver knows every chunk's place from the counts alone.

Cost: 8(2L + 1) header bytes (rounded to 64) plus the data, per rail
per step; packing reads each slot once (one copy), unpacking writes each
row into out once.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.extending import register_jitable

from ... import node
from ...base.arena import FLAG_LINE_NBYTES, W_CULPRIT
from ...base.control import ABANDONED
from ...base.control import voidptr as _voidptr
from ...base.sync import load_acquire
from .plan import expect

__all__ = ["RAIL_TAG_BAD", "RAIL_COUNTS_BAD", "TOLD_WORDS", "TOLD_NBYTES", "TOLD_MAGIC",
           "msg_head_nbytes", "pack_message", "unpack_message", "local_out", "take_header",
           "scan_headers", "told_words"]

#: the status a rank posts in the node's status round after the rail exchange
RAIL_TAG_BAD, RAIL_COUNTS_BAD = 1, 2

#: a told message's int64 words: TOLD_MAGIC, the culprit word the sender
#: posted (harmpi.node.abandon), the rank of its node that gave up first
TOLD_WORDS = 3
TOLD_NBYTES = 8 * TOLD_WORDS
#: a step message's first word is 0 or 1 (node g has more steps), never this
TOLD_MAGIC = 0x48524D5054454C4C

_memcpy = node.memcpy
_slot_addr = node.parity_slot_addr
_parity = node.step_parity


@register_jitable
def _head_words(L):
    """A step message's header words: more, then L counts, then L expectations."""
    return 2 * L + 1


@register_jitable
def msg_head_nbytes(L):
    """Bytes of a step message's header, padded to 64 (the data starts there)."""
    return (8 * _head_words(L) + 63) // 64 * 64


@numba.njit(cache=True, nogil=True)
def pack_message(c, msg_addr, g2, L, lr, ranks, row_nb, k, head, block, counts, mine_expect,
                 more):
    """The message for rank (g2, lr) (module docstring); returns its bytes.
    ``counts``: int64[L, P] every local header's send row; ``ranks``:
    int64[G, L] communicator rank of (node, local rank)."""
    dest = ranks[g2, lr]
    words = numba.carray(_voidptr(msg_addr), (_head_words(L),), np.int64)
    words[0] = more
    for i in range(L):
        words[1 + i] = counts[i, dest]
        words[1 + L + i] = mine_expect[ranks[g2, i]]
    pos = msg_head_nbytes(L)
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
def unpack_message(msg_addr, out_addr, L, g2, ranks, row_nb, k, block, recv, roff):
    """Copy chunk k of every segment in the message from node g2 into out."""
    pos = msg_head_nbytes(L)
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
def local_out(c, out_addr, L, g, ranks, me, row_nb, k, head, block, recv, roff):
    """Chunk k of every segment a rank of my node sends me, from its slot."""
    parity = _parity(c)
    lo = k * block
    for i in range(L):
        src = ranks[g, i]
        seg = recv[src] * row_nb
        if src != me and lo < seg:
            _memcpy(out_addr + roff[src] * row_nb + lo,
                    _slot_addr(c, parity, i) + head + me * block, min(block, seg - lo))


@numba.njit(cache=True, nogil=True)
def take_header(msg, p, L, lr, ranks, plan, counts, recv, first):
    """The header of the message from rank (p, lr): (node p has more steps,
    whether a count crossing this rail differs from its receiver's
    expectation). On the first step the rows node p sends me go into recv.
    Both ends of the rail check the same pairs: what p's ranks send me
    against my expectation, what my node's ranks send (p, lr) against its."""
    words = msg[:8 * _head_words(L)].view(np.int64)
    bad = False
    if first:
        P = recv.shape[0]
        for i in range(L):
            src = ranks[p, i]
            recv[src] = words[1 + i]
            mine = expect(plan, P)[src]
            if mine >= 0 and mine != words[1 + i]:
                bad = True
            theirs = words[1 + L + i]  # what (p, lr) expects from my local rank i
            if theirs >= 0 and theirs != counts[i, ranks[p, lr]]:
                bad = True
    return words[0], bad


@numba.njit(cache=True, nogil=True)
def scan_headers(c, counts, ranks, g, P, L, me, recv):
    """After step 0's flag round: every local header's send row into
    counts[L, P], the rows each local rank sends me into recv; returns (the
    longest segment that passes through a slot, in rows; the first local
    (sender * P + receiver) whose count is not what the receiver expects,
    or -1)."""
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
            wanted = want[P + ranks[g, i]]  # (the header's expect row)
            if wanted >= 0 and wanted != counts[i, ranks[g, j]]:
                return longest, ranks[g, i] * P + ranks[g, j]
    return longest, -1


@numba.njit(cache=True, nogil=True)
def told_words(c, rc, words):
    """The told message of a step this rank gave up with status ``rc``:
    its own culprit word, and who gave up first (the local rank whose flag
    it found abandoned, else itself)."""
    words[0] = TOLD_MAGIC
    words[1] = load_acquire(c.flags + c.local_rank * FLAG_LINE_NBYTES + W_CULPRIT * 8)
    words[2] = node.local_rank_of(c, c.err_peer if rc == ABANDONED else c.local_rank)
