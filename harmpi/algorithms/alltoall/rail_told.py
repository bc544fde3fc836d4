"""The compiled rail all-to-all's told messages, and its wait that gives a peer time to tell.

A rank that gives up on a step before sending its rail message (a local
rank it waited for never came, a local rank gave up, a turn failed) sends
each rail peer still waiting for it a *told* message instead
(rail_message: TOLD_MAGIC, its culprit word, who gave up first), best
effort: the give-up's abandon notice or closed socket tells the peer
anyway, without the culprit. A rank waiting for a rail message
(``rail_wait``) waits past its deadline for such a message, until a later
time its caller sets (many_nodes_tcp: turn t until t + 2 deadlines after
its step began), so that every rank names the late rank rather than the
peer that gave up first.

Invariants: a told message has the tag POISON_TAG and TOLD_NBYTES bytes
starting with TOLD_MAGIC, which no step message starts with; receiving one
makes this rank give up too (node.abandon), posting the teller's culprit.

Cost: nothing while no rank gives up (one more word compared per wait).
"""

from __future__ import annotations

import numba
import numpy as np

from ... import node
from ...base.control import OK, RAIL_FAILED
from ...base.control import voidptr as _voidptr
from ...base.kind import POISON_TAG
from ...base.sync import monotonic_ns
from ...transports import sockio
from ..rail_turns import RAIL_ROWS, rail_outcome, rail_views
from .rail_message import TOLD_MAGIC, TOLD_NBYTES, TOLD_WORDS, told_words

__all__ = ["tell_rail_peer", "heard_told", "rail_wait"]

#: the extra wait's slices: between them it looks for a local rank that
#: gave up (its culprit word names the rank it waited for)
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
