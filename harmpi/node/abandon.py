"""Giving up on a node's collective: the ABANDONED flag and the culprit word.

A rank that gives up (a deadline passed, a peer failed, SIGINT) turns its
own flag to ABANDONED after posting the communicator rank it waited for
(its culprit word), so a peer waiting on it, or arriving late, fails at once
instead of completing the step without it; and its context refuses every
later entry. A rank that finds a peer's flag ABANDONED reads the culprit
and gives up too, so every rank of the node reports the same cause.
"""

from __future__ import annotations

import numba
from numba import types

from ..base import control
from ..base.arena import FLAG_LINE_NBYTES, W_CULPRIT, W_EPOCH
from ..base.control import ABANDONED, INTERRUPTED, OK
from ..base.sync import ABANDONED as FLAG_ABANDONED
from ..base.sync import cpu_relax, fence, load_acquire, store_release
from .layout import flag_addr, wake

__all__ = ["abandon", "CULPRIT_INTERRUPTED", "CULPRIT_REFUSED", "CULPRIT_DISAGREED",
           "interrupted", "abandoned_by",
           "peers_abandoned", "who_abandoned"]

_LINE = FLAG_LINE_NBYTES
_WORD = 8
_i64 = types.int64
_ctl = control.ARRAY

#: culprit word of a rank that gave up because it was interrupted (SIGINT)
CULPRIT_INTERRUPTED = -2
#: culprit word of a rank that gave up after refusing its own arguments
#: (its refusal met a real call across nodes: harmpi.runtime.context.Context.refuse)
CULPRIT_REFUSED = -3
#: culprit word of a rank that gave up after the ranks disagreed in a way
#: that may have left step counters apart (harmpi.runtime.context.Context.fail)
CULPRIT_DISAGREED = -4


@numba.njit(_i64(_ctl, _i64), cache=True, nogil=True)
def abandon(ctl, culprit):
    """Give up on the node's collective: close the native gate, refuse every
    later entry, and turn this rank's flag to ABANDONED (after posting
    ``culprit``, the communicator rank it waited for, -1 if unknown), so a
    peer waiting on it, or arriving late, fails at once instead of
    completing the step without it. Idempotent; returns ABANDONED."""
    c = ctl[0]
    c.gate = 0
    if c.abandoned == 0:
        c.abandoned = 1
        line = c.flags + c.local_rank * _LINE
        store_release(line + W_CULPRIT * _WORD, culprit)
        store_release(line + W_EPOCH * _WORD, FLAG_ABANDONED)
        fence()
        wake(c, c.local_rank)
    return ABANDONED


@numba.njit(_i64(_ctl), cache=True, nogil=True)
def interrupted(ctl):
    """A SIGINT arrived during a wait: give up on the collective (peers fail
    at once) and return INTERRUPTED; Python raises KeyboardInterrupt."""
    c = ctl[0]
    c.err_peer = c.local_rank
    c.err_a = c.epoch
    c.err_b = CULPRIT_INTERRUPTED
    abandon(ctl, CULPRIT_INTERRUPTED)
    return INTERRUPTED


@numba.njit(cache=True, nogil=True)
def abandoned_by(ctl, j, epoch):
    """Local rank j gave up: note who (err_peer), the step (err_a) and the
    rank it was waiting for (err_b), and give up too."""
    c = ctl[0]
    c.err_peer = j
    c.err_a = epoch
    c.err_b = load_acquire(c.flags + j * _LINE + W_CULPRIT * _WORD)
    abandon(ctl, c.err_b)
    return ABANDONED


@numba.njit(_i64(_ctl), cache=True, nogil=True)
def peers_abandoned(ctl):
    """OK, or ABANDONED (after giving up too) if a local rank's flag shows
    that it gave up. A rail algorithm asks before it sends: data this node
    sends after one of its ranks dropped the step would let the other nodes
    complete a step that rank abandoned (L acquire loads; no wait)."""
    c = ctl[0]
    for j in range(c.local_size):
        if j != c.local_rank and load_acquire(flag_addr(c, j)) < 0:
            return abandoned_by(ctl, j, c.epoch)
    return OK


@numba.njit(cache=True, nogil=True)
def who_abandoned(c):
    """The local rank that gave up on this one: it abandons its own flag
    right after poisoning this rank's, so look for it a little while."""
    for _ in range(1 << 20):
        for j in range(c.local_size):
            if j != c.local_rank and load_acquire(flag_addr(c, j)) < 0:
                return j
        cpu_relax()
    return c.local_rank
