"""The allgather on two nodes over the tcp rail, compiled: one call per allgather.

The same steps, messages and flag rounds as HierAllgather.run's Python
loop at G = 2 (harmpi.algorithms.allgather's docstring), so a rank on
either path meets the other: per chunk of at most half a slot, post the
exchange with the rail peer (receive its chunk into block g' of my next
slot, with room to the slot's end so that a larger message from a peer
that disagrees is seen by its count and tag, not cut; send my chunk from
the caller's buffer), copy my chunk into block g meanwhile, complete the
exchange, one flag round (a message that disagreed posts POISON, so the
whole node fails alike), then every rank copies every block to out. The
rail is har_latency's (its socket, op rows and buffers in the control
block), so a context whose all-reduce runs compiled on two nodes gathers
compiled too. 2 x 1 bf16 on the 2-vCPU AMD EPYC, MPI over TCP: the Python
loop took 3.0-3.5x MPI's time up to 16 KiB.
"""

from __future__ import annotations

import numba
import numpy as np

from .. import node
from ..base import dtypes, kind
from ..base.control import OK, POISONED
from .rail_turns import got, post_exchange, rail_complete, rail_views

__all__ = ["GATHER2_STEP", "gather2_step"]


@numba.njit(cache=True, nogil=True)
def _gather2(ctl, x_addr, out_addr, n, code, w):
    c = ctl[0]
    isz = w.itemsize
    total = n * isz
    tag = kind.rail_tag(total, code)
    ops, pollfds, scratch = rail_views(c)
    g = c.rail_node
    p = 1 - g
    chunk = max(1, c.slot_nbytes // 2 // isz)
    start = 0
    while True:
        m = min(chunk, n - start)
        nb = m * isz
        src = x_addr + start * isz
        slot = node.next_slot_addr(ctl, c.local_rank)
        rc = post_exchange(ctl, ops, scratch, slot + p * nb, c.slot_nbytes - p * nb, src, nb, tag)
        if rc != OK:
            return rc
        node.copy_bytes(slot + g * nb, src, nb)
        rc = rail_complete(ctl, ops, pollfds, scratch)
        if rc != OK:
            return rc
        poisoned = not got(ops, nb, tag)
        rc = node.stage(ctl, 0, 0, total, kind.POISON if poisoned else code, w)
        if rc != OK:
            return POISONED if poisoned else rc
        node.copy_blocks(ctl, out_addr, n, start, m, w)
        start += m
        if start >= n:
            return OK


@numba.njit(node.GATHER_SIG, cache=True, nogil=True)
def gather2_step(ctl, x_addr, out_addr, n, fmt, digest):
    """The two-node allgather entry (node.GATHER_STEP's signature): out =
    every rank's x[:n] in communicator rank order."""
    rc = node.enter(ctl)
    if rc != OK:
        return rc
    code = kind.allgather_code(fmt, digest)
    if ctl[0].profile != 0:
        node.begin(ctl, n * node.format_itemsize(fmt), code)
    if fmt == dtypes.BF16 or fmt == dtypes.F16:
        rc = _gather2(ctl, x_addr, out_addr, n, code, np.empty(0, np.uint16))
    elif fmt == dtypes.F32:
        rc = _gather2(ctl, x_addr, out_addr, n, code, np.empty(0, np.float32))
    else:
        rc = _gather2(ctl, x_addr, out_addr, n, code, np.empty(0, np.float64))
    node.leave(ctl)
    return rc


GATHER2_STEP = node.entry_point(gather2_step, node.GATHER_SIG)
