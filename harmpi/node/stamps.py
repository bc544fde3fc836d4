"""Profiling (harmpi.profile): arrival stamps beside the epochs.

Only while the control block's ``profile`` word is non-zero. ``begin``
(called by an entry right after ``enter``) notes the collective's size,
kind and entry time. A rank's first publish of a collective posts its entry
time in its stamp line (harmpi.base.arena), tagged with the epoch; after the wait
for that epoch every rank reads every local rank's stamp, so each learns the
first and the last arrival and who that was, without a message of its own.
A later publish posts what ``prof_stamp`` then holds (the two-node step:
the rail peer's arrival), or nothing.
"""

from __future__ import annotations

import numba
from numba import types

from ..base import control
from ..base.arena import FLAG_LINE_NBYTES, STAMP_WORDS
from ..base.sync import load_acquire, monotonic_ns, store_release
from .layout import local_rank_of

__all__ = ["begin", "post_stamp", "read_stamps", "heard"]

_LINE = FLAG_LINE_NBYTES
_WORD = 8
_i64 = types.int64
_ctl = control.ARRAY


@numba.njit(cache=True, nogil=True)
def _stamp_line(c, j, epoch):
    return c.stamps + j * _LINE + (epoch & 1) * STAMP_WORDS * _WORD


@numba.njit(cache=True, nogil=True)
def post_stamp(c, epoch):
    """Post this rank's arrival stamp for ``epoch`` (before publishing it)."""
    line = _stamp_line(c, c.local_rank, epoch)
    store_release(line + _WORD, c.prof_stamp)
    store_release(line + 2 * _WORD, c.prof_who if c.prof_stamp != 0 else -1)
    store_release(line, epoch)
    c.prof_stamp = 0


@numba.njit(cache=True, nogil=True)
def heard(c, t, who):
    """Fold one rank's arrival time into the running collective's record."""
    if c.prof_arrivals == 0 or t < c.prof_first_ns:
        c.prof_first_ns = t
    if c.prof_arrivals == 0 or t > c.prof_last_ns:
        c.prof_last_ns = t
        c.prof_last_rank = who
    c.prof_arrivals += 1


@numba.njit(cache=True, nogil=True)
def read_stamps(c, epoch):
    """Fold every local rank's stamp of ``epoch`` in (after the wait for it)."""
    for j in range(c.local_size):
        line = _stamp_line(c, j, epoch)
        if load_acquire(line) == epoch:
            who = load_acquire(line + 2 * _WORD)
            if who >= 0:
                heard(c, load_acquire(line + _WORD), who)


@numba.njit(types.void(_ctl, _i64, _i64), cache=True, nogil=True)
def begin(ctl, nbytes, code):
    """Profiling: a collective of ``nbytes`` and kind ``code`` starts now
    (an entry calls it right after enter, only when ``profile`` is set)."""
    c = ctl[0]
    t = monotonic_ns()
    c.prof_enter_ns = t
    c.prof_nbytes = nbytes
    c.prof_code = code
    c.prof_stamp = t
    c.prof_who = local_rank_of(c, c.local_rank)
    c.prof_first_ns = 0
    c.prof_last_ns = 0
    c.prof_last_rank = -1
    c.prof_arrivals = 0
