"""The allgather over the tcp rail, compiled, on 2^k nodes: one call per allgather.

Steps (G = 2^k uniform nodes of L ranks; per chunk of at most slot/G
elements of x, so that the G blocks of a chunk fit one slot, block h at
h * chunk bytes):
  1. turn b = 1: post the exchange with rail peer g ^ 1 (receive its block
     into block g ^ 1 of my next slot, send my block from the caller's
     buffer), copy my block into block g of the slot meanwhile, complete;
  2. turns b = 2, 4, ..., G/2 (recursive doubling): send the b blocks of
     my subcube (blocks lo .. lo + b - 1, lo = g rounded down to a multiple
     of b, contiguous in the slot) to g ^ b and receive its subcube's b
     blocks into their place, so after turn b every node holds the 2b blocks
     of its 2b-node subcube;
  3. one flag round (a message that disagreed posts POISON, so the whole
     node fails alike), then every rank copies block g' of slot l' to the
     output block of the rank that is local rank l' of node g'.

Every receive has room to the slot's end, so a larger message from a peer
that disagrees is seen by its count and tag, not cut. At G = 2 these are
HierAllgather.run's messages and flag rounds exactly (its Python loop sends
each rail peer this rank's own block, all at once): the paths meet. For
G > 2 the compiled turns are the only path a tcp rail takes (every rank
picks by the same topology), so their messages need not match the loop's.

Why a disagreement never yields data: every message's tag folds in the
call's total bytes and kind; a node that sees a message disagree is
poisoned, sends POISON_TAG for the rest of the chunk's turns (partners in
the same order g ^ 1, g ^ 2, ... as rail_turns.rail_doubling, the
all-reduce's, so an allgather that meets an all-reduce is seen the same
way) and posts POISON in the flag round. After turn b a node is unpoisoned
only if all 2b nodes of its subcube agreed, so after the last turn either
every node is poisoned or all agree, and no output is written before the
flag round.

Cost per rank and chunk of m bytes: log2 G messages, (G - 1) m bytes sent
and received, one copy-in of m, one flag round, a copy-out of G L m bytes
(the Python loop: G - 1 messages in one round, the same bytes, with the
interpreter's cost per message). 2 x 1 bf16 on the 2-vCPU AMD EPYC, MPI
over TCP: the Python loop took 3.0-3.5x MPI's time up to 16 KiB, and 4 x 1
2.6-4x.
"""

from __future__ import annotations

import numba
import numpy as np

from .. import node
from ..base import dtypes, kind
from ..base.control import OK, POISONED
from .rail_turns import got, post_exchange, rail_complete, rail_turn, rail_views, select_peer

__all__ = ["GATHER_TCP_STEP", "gather_tcp_step", "gathers_compiled"]


def gathers_compiled(node_count):
    """Whether an allgather over ``node_count`` uniform nodes with a
    compiled rail runs these steps: 2^k nodes, k >= 1."""
    return node_count >= 2 and node_count & (node_count - 1) == 0


@numba.njit(cache=True, nogil=True)
def _first_turn(ctl, ops, pollfds, scratch, slot, src, nb, tag):
    """Turn b = 1, with the copy of this rank's block into the slot
    between posting and completing it."""
    c = ctl[0]
    g = c.rail_node
    p = g ^ 1
    select_peer(c, p)
    rc = post_exchange(ctl, ops, scratch, slot + p * nb, c.slot_nbytes - p * nb, src, nb, tag)
    if rc != OK:
        return rc
    node.copy_bytes(slot + g * nb, src, nb)
    return rail_complete(ctl, ops, pollfds, scratch)


@numba.njit(cache=True, nogil=True)
def _chunk_turns(ctl, ops, pollfds, scratch, slot, src, nb, tag):
    """Every turn of one chunk (module docstring): (status, poisoned)."""
    c = ctl[0]
    G, g = c.rail_nodes, c.rail_node
    rc = _first_turn(ctl, ops, pollfds, scratch, slot, src, nb, tag)
    if rc != OK:
        return rc, False
    poisoned = not got(ops, nb, tag)
    b = 2
    while b < G:
        lo = (g // b) * b
        theirs = ((g ^ b) // b) * b
        rc = rail_turn(ctl, ops, pollfds, scratch, g ^ b, slot + lo * nb, b * nb,
                       kind.POISON_TAG if poisoned else tag, slot + theirs * nb,
                       c.slot_nbytes - theirs * nb)
        if rc != OK:
            return rc, poisoned
        poisoned = poisoned or not got(ops, b * nb, tag)
        b <<= 1
    return OK, poisoned


@numba.njit(cache=True, nogil=True)
def _gather(ctl, x_addr, out_addr, n, code, w):
    c = ctl[0]
    isz = w.itemsize
    total = n * isz
    tag = kind.rail_tag(total, code)
    ops, pollfds, scratch = rail_views(c)
    chunk = max(1, c.slot_nbytes // c.rail_nodes // isz)
    start = 0
    while True:
        m = min(chunk, n - start)
        nb = m * isz
        slot = node.next_slot_addr(ctl, c.local_rank)
        rc, poisoned = _chunk_turns(ctl, ops, pollfds, scratch, slot, x_addr + start * isz, nb,
                                    tag)
        if rc != OK:
            return rc
        rc = node.stage(ctl, 0, 0, total, kind.POISON if poisoned else code, w)
        if rc != OK:
            return POISONED if poisoned else rc
        node.copy_blocks(ctl, out_addr, n, start, m, w)
        start += m
        if start >= n:
            return OK


@numba.njit(node.GATHER_SIG, cache=True, nogil=True)
def gather_tcp_step(ctl, x_addr, out_addr, n, fmt, digest):
    """The rail allgather entry (node.GATHER_STEP's signature): out = every
    rank's x[:n] in communicator rank order."""
    rc = node.enter(ctl)
    if rc != OK:
        return rc
    code = kind.allgather_code(fmt, digest)
    if ctl[0].profile != 0:
        node.begin(ctl, n * node.format_itemsize(fmt), code)
    if fmt == dtypes.BF16 or fmt == dtypes.F16:
        rc = _gather(ctl, x_addr, out_addr, n, code, np.empty(0, np.uint16))
    elif fmt == dtypes.F32:
        rc = _gather(ctl, x_addr, out_addr, n, code, np.empty(0, np.float32))
    else:
        rc = _gather(ctl, x_addr, out_addr, n, code, np.empty(0, np.float64))
    node.leave(ctl)
    return rc


GATHER_TCP_STEP = node.entry_point(gather_tcp_step, node.GATHER_SIG)
