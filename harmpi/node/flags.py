"""The flag protocol: publish an epoch, wait for every local rank, check metas.

Sequence protocol (every rank runs the same steps in the same order):

1. A collective is cut into *steps* of at most one slot. Step k uses slot
   parity p = k % 2 (``steps`` counts steps).
2. ``stage``: a rank writes its contribution into slot(p, me) and the
   step's meta (total bytes, kind word) into meta word pair p of its flag
   line, then publishes ``epoch + 1`` with a release store, then waits until
   every local flag >= that epoch, then compares every rank's meta with its
   own. A mismatch is seen identically by every rank, so every rank
   returns the same status and the counters stay aligned.
3. Multi-phase algorithms (reduce-scatter + allgather, leader) publish and
   wait once more per phase (``publish_wait``); every phase bumps the epoch.

Why two buffers are enough: rank r writes slot(p, r) again at step k+2
only after passing step k+1's first wait, which needs every rank to have
published step k+1's first phase, which each rank does only after it has
finished reading everything of step k. So no trailing barrier is needed.

        step k      step k+1      step k+2
  r0:  write p0 ... write p1 ...  write p0   (r0 passed k+1's wait)
  r1:  read  p0 ... (must finish reading p0 before publishing k+1)

Statuses (harmpi.base.control): OK; TIMEOUT (err_peer, err_a, err_b: the local
rank that did not publish, the epoch awaited, the value seen); MISMATCH
(err_*: the peer, its byte count and its kind); POISONED (a rank posted
that its part failed); ABANDONED and INTERRUPTED (harmpi.node.abandon).
"""

from __future__ import annotations

import numba
from numba import types

from ..base import control, kind
from ..base.arena import FLAG_LINE_NBYTES, W_CULPRIT, W_EPOCH, W_META, W_STATUS
from ..base.control import ABANDONED, MISMATCH, OK, POISONED, TIMEOUT
from ..base.sync import ABANDONED as FLAG_ABANDONED
from ..base.sync import (
    WAIT_INTERRUPTED,
    compare_exchange,
    load_acquire,
    store_release,
    wait_flags_ge,
)
from .abandon import abandon, abandoned_by, interrupted, who_abandoned
from .copy import publish_copy
from .dispatch import sigs
from .layout import flag_addr, hook_addr, local_rank_of, slots2d, step_parity, wait_addr, wake
from .stamps import post_stamp, read_stamps

__all__ = ["ENTERED_BASE", "publish_wait", "publish_wait_status", "stage", "stage_meta", "stage_at",
           "stage_post", "stage_check", "keep_mismatch", "settle_mismatch"]

_LINE = FLAG_LINE_NBYTES
_WORD = 8

#: what a rank's culprit word holds while it has not given up: ENTERED_BASE
#: minus the epoch at which it entered its current collective (entries.enter),
#: so a peer's wait can tell a rank inside this collective that has not
#: published yet (stuck on its rail, say) from one that never came
ENTERED_BASE = -(1 << 40)
_i64 = types.int64
_ctl = control.ARRAY


@numba.njit(cache=True, nogil=True)
def _publish(ctl):
    """Publish the next epoch (the first half of publish_wait): OK, or
    ABANDONED if this context or a peer gave up on this rank."""
    c = ctl[0]
    if c.abandoned != 0:
        return ABANDONED
    epoch = c.epoch + 1
    if c.profile != 0:
        post_stamp(c, epoch)
    if compare_exchange(flag_addr(c, c.local_rank), c.epoch, epoch) != c.epoch:
        return abandoned_by(ctl, who_abandoned(c), epoch)  # a peer gave up on this rank
    c.epoch = epoch
    wake(c, c.local_rank)
    return OK


@numba.njit(cache=True, nogil=True)
def _await(ctl):
    """Wait until every local rank has published this rank's epoch (the
    second half of publish_wait)."""
    c = ctl[0]
    epoch = c.epoch
    extended = False
    while True:
        j = wait_flags_ge(c.flags + W_EPOCH * _WORD, _LINE, c.local_size, epoch, c.spin,
                          c.timeout_ns, hook_addr(ctl), c.sleepers, wait_addr(ctl))
        if j == -1:
            if c.profile != 0:
                read_stamps(c, epoch)
            return OK
        if j == WAIT_INTERRUPTED:
            return interrupted(ctl)
        if j <= -2:
            return abandoned_by(ctl, -2 - j, epoch)
        seen = load_acquire(flag_addr(c, j))
        if seen < 0:
            return abandoned_by(ctl, j, epoch)
        if seen >= epoch:
            continue
        inside = seen > c.coll_epoch or load_acquire(
            c.flags + j * _LINE + W_CULPRIT * _WORD) == ENTERED_BASE - c.coll_epoch
        if inside and not extended:
            # it is inside this collective (it published in it, or entered
            # it), stuck on something else (a rail peer, say): give it one
            # more deadline to give up itself and name the rank it waited for
            extended = True
            continue
        # blame the late rank (its culprit word), then take its flag from it
        late = local_rank_of(c, j)
        store_release(c.flags + j * _LINE + W_CULPRIT * _WORD, late)
        if compare_exchange(flag_addr(c, j), seen, FLAG_ABANDONED) == seen:
            wake(c, j)
            c.err_peer = j
            c.err_a = epoch
            c.err_b = seen
            abandon(ctl, late)
            return TIMEOUT
        # the late rank published meanwhile: wait for it again


@numba.njit(_i64(_ctl), cache=True, nogil=True)
def publish_wait(ctl):
    """Publish the next epoch and wait until every local rank has published it.

    A wait that reaches the deadline turns the late rank's flag to ABANDONED
    with a compare-exchange, and a rank publishes with a compare-exchange
    too: whichever comes first wins, so either the late rank arrived in time
    (the step completes everywhere) or it finds its flag abandoned and fails
    (never completing a step its peers gave up on)."""
    status = _publish(ctl)
    if status != OK:
        return status
    return _await(ctl)


@numba.njit(cache=True, nogil=True)
def stage_post(ctl, x_addr, m, skip_lo, skip_hi, total_nbytes, code, w, pos):
    """The first half of stage_at: fill my slot, post the meta, publish."""
    c = ctl[0]
    parity = c.steps & 1
    c.steps += 1
    me = c.local_rank
    slots = slots2d(c, parity, w)
    mine = slots[me].ctypes.data + pos
    if m > 0:
        isz = w.itemsize
        publish_copy(c, mine, x_addr, skip_lo * isz)
        publish_copy(c, mine + skip_hi * isz, x_addr + skip_hi * isz, (m - skip_hi) * isz)
    code = kind.with_ring(code, pos)
    meta = c.flags + me * _LINE + (W_META + 2 * parity) * _WORD
    store_release(meta, total_nbytes)
    store_release(meta + _WORD, code)
    return _publish(ctl)


@numba.njit(cache=True, nogil=True)
def stage_check(ctl, total_nbytes, code, pos):
    """The second half of stage_at: wait for every local rank, compare metas."""
    status = _await(ctl)
    if status != OK:
        return status
    c = ctl[0]
    parity = step_parity(c)
    code = kind.with_ring(code, pos)
    for j in range(c.local_size):
        peer_meta = c.flags + j * _LINE + (W_META + 2 * parity) * _WORD
        a = load_acquire(peer_meta)
        b = load_acquire(peer_meta + _WORD)
        if a != total_nbytes or b != code or b == kind.POISON:
            c.err_peer = j
            c.err_a = a
            c.err_b = kind.without_ring(b)
            # every local rank sees the mismatch in this step: all restart
            # the ring together (a mismatched step may have moved it apart)
            c.ring = 0
            return MISMATCH
    return OK


@numba.njit(cache=True, nogil=True)
def stage_at(ctl, x_addr, m, skip_lo, skip_hi, total_nbytes, code, w, pos):
    """stage(), except that x[:m] goes to slot(p, me) from byte ``pos`` (a
    multiple of 64, the same on every rank: it is posted in the kind word and
    checked with it) and x[skip_lo:skip_hi] is not copied (a share only this
    rank reads, straight from x)."""
    status = stage_post(ctl, x_addr, m, skip_lo, skip_hi, total_nbytes, code, w, pos)
    if status != OK:
        return status
    return stage_check(ctl, total_nbytes, code, pos)


@numba.njit(sigs(_i64, _ctl, types.intp, _i64, _i64, _i64, "W"), cache=True, nogil=True)
def stage(ctl, x_addr, m, total_nbytes, code, w):
    """Start a step: slot(p, me) = x[:m], post meta, publish, wait for all,
    check metas. Returns OK / TIMEOUT / MISMATCH."""
    return stage_at(ctl, x_addr, m, 0, 0, total_nbytes, code, w, 0)


@numba.njit(sigs(_i64, _ctl, _i64, _i64, _i64, "W"), cache=True, nogil=True)
def stage_meta(ctl, m, total_nbytes, code, w):
    """stage() of an m-element step without the copy: the caller fills
    slot(p, me) itself before the step's next flag round."""
    return stage_at(ctl, 0, m, 0, m, total_nbytes, code, w, 0)


@numba.njit(_i64(_ctl, _i64), cache=True, nogil=True)
def publish_wait_status(ctl, status):
    """Like publish_wait, but each rank also posts ``status`` (0 = fine) for
    the current step; returns POISONED on every rank if any rank posted
    non-zero (peer in err_peer, its status in err_a)."""
    c = ctl[0]
    word = (W_STATUS + step_parity(c)) * _WORD
    store_release(c.flags + c.local_rank * _LINE + word, status)
    rc = publish_wait(ctl)
    if rc != OK:
        return rc
    for j in range(c.local_size):
        s = load_acquire(c.flags + j * _LINE + word)
        if s != 0:
            c.err_peer = j
            c.err_a = s
            c.err_b = 0
            return POISONED
    return OK


@numba.njit(cache=True, nogil=True)
def keep_mismatch(c):
    """Keep the node's MISMATCH verdict (err_peer, err_a, err_b) aside while
    a step that found it goes on, poisoned, through its rail exchange and
    status round (which may overwrite err_*)."""
    c.saved_peer, c.saved_a, c.saved_b = c.err_peer, c.err_a, c.err_b


@numba.njit(cache=True, nogil=True)
def settle_mismatch(c):
    """The end of such a step: the kept verdict back in err_*; MISMATCH."""
    c.err_peer, c.err_a, c.err_b = c.saved_peer, c.saved_a, c.saved_b
    return MISMATCH
