"""The all-to-all's per-call plan and its slot geometry, read through named fields.

The plan is one int64 array of ``plan_words(P)`` words (P = ranks of the
communicator), reused by every call of a context (one call at a time).
Fields, in order (PLAN_FIELDS):

=========  =====  ==============================================  ==========
field      words  meaning                                         written by
=========  =====  ==============================================  ==========
send       P      rows this rank sends each rank                  the caller
expect     P      rows this rank expects from each rank (-1: any) the caller
recv       P      rows this rank receives from each rank          the step
send_off   P      row offset in x of the rows for each rank       the step
recv_off   P      row offset in out of the rows from each rank    the step
steps      1      steps the longest segment needs (one node)      the step
bad_pair   1      sender * P + receiver of the first pair whose   the step
                  count is not what its receiver expects, or -1
even_rows  1      rows for every rank (an even split), or -1:     the caller
                  send and expect hold the counts
=========  =====  ==============================================  ==========

Steps (every implementation): 1. the caller fills send/expect, or
even_rows; 2. ``spread_even_rows`` turns even_rows into send and expect;
3. ``prefix`` turns counts into offsets; 4. the step fills recv, recv_off,
steps and bad_pair.

Invariants: the layout is shared with C++ (harmpi/_native.cpp reads
even_rows and bad_pair at 5P + 2 and 5P + 1 and sizes the plan 5P + 3), so
a field is added at the end, here and there. The accessors are plain
Python functions that numba compiles into its kernels too
(``register_jitable``): one definition for both, no dispatch from Python.

Cost: the accessors are O(1) (a view or an index); ``prefix`` is O(P).
"""

from __future__ import annotations

import numba
import numpy as np
from numba.extending import register_jitable

from ...errors import HarmpiMismatchError

__all__ = ["PLAN_FIELDS", "plan_words", "new_plan", "send", "expect", "recv", "send_off",
           "recv_off", "steps_at", "bad_pair_at", "even_rows_at", "spread_even_rows",
           "prefix", "geometry", "pair_mismatch", "pair_error"]

#: (field, words) in order: "P" for one word per rank of the communicator
PLAN_FIELDS = (("send", "P"), ("expect", "P"), ("recv", "P"), ("send_off", "P"),
               ("recv_off", "P"), ("steps", 1), ("bad_pair", 1), ("even_rows", 1))
#: the per-rank fields come first, then the one-word fields
_PER_RANK = 5


@register_jitable
def plan_words(P):
    return _PER_RANK * P + 3


def new_plan(P):
    return np.zeros(plan_words(P), np.int64)


@register_jitable
def send(plan, P):
    """Rows this rank sends each rank (a view)."""
    return plan[0:P]


@register_jitable
def expect(plan, P):
    """Rows this rank expects from each rank, -1: any (a view)."""
    return plan[P:2 * P]


@register_jitable
def recv(plan, P):
    """Rows this rank receives from each rank (a view)."""
    return plan[2 * P:3 * P]


@register_jitable
def send_off(plan, P):
    """Row offset in x of the rows for each rank (a view)."""
    return plan[3 * P:4 * P]


@register_jitable
def recv_off(plan, P):
    """Row offset in out of the rows from each rank (a view)."""
    return plan[4 * P:5 * P]


@register_jitable
def steps_at(P):
    """Index of the steps word."""
    return _PER_RANK * P


@register_jitable
def bad_pair_at(P):
    """Index of the bad_pair word (sender * P + receiver, or -1)."""
    return _PER_RANK * P + 1


@register_jitable
def even_rows_at(P):
    """Index of the even_rows word (rows for every rank, or -1)."""
    return _PER_RANK * P + 2


@register_jitable
def spread_even_rows(plan, P):
    """send = expect = even_rows for every rank, if the caller asked for an
    even split (send_counts=None)."""
    rows = plan[even_rows_at(P)]
    if rows >= 0:
        send(plan, P)[:] = rows
        expect(plan, P)[:] = rows


@numba.njit(cache=True, nogil=True)
def prefix(counts, out, P):
    """out[j] = counts[0] + ... + counts[j - 1]; returns the total."""
    total = 0
    for j in range(P):
        out[j] = total
        total += counts[j]
    return total


@register_jitable
def geometry(slot_nbytes, P):
    """(header bytes, block bytes) of a slot shared by P destinations: a
    header of 2P + 2 words (send, expect; the sender's pid and x address),
    then P blocks of 64-byte multiples."""
    head = (16 * P + 16 + 63) // 64 * 64
    block = (slot_nbytes - head) // P // 64 * 64
    return head, block


def pair_mismatch(plan, P):
    """(sender, receiver) of the first pair whose count differs from the
    receiver's expectation, from the plan's bad_pair word, or None."""
    bad = int(plan[bad_pair_at(P)])
    return None if bad < 0 else divmod(bad, P)


def pair_error(rank, what, sender, receiver):
    return HarmpiMismatchError(
        f"rank {rank}: {what}: split sizes disagree: rank {sender} sends rank {receiver} a "
        f"number of rows other than rank {receiver} expects (its recv_counts / output split "
        "sizes; ranks of the communicator). This rank's output is not written (every rank "
        "that raises this leaves its output unwritten).")
