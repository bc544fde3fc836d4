"""The compiled half of harmpi.profile: one collective's record, and the
aggregates that keep a long run's memory bounded.

When profiling is on, the control block's ``profile`` word holds the
address of an int64 *state* array (laid out below); when it is 0 every
entry skips all of this after one load and one branch.

What a collective records (node.begin at the entry, node.leave at the exit,
and the flag rounds in between):

- its entry time (CLOCK_MONOTONIC, ns: one clock per host);
- the first and the last arrival among the ranks it heard from, and who
  arrived last. These come from the flags harmpi already exchanges: each
  rank posts its entry time beside the epoch word of its collective's first
  publish (the node's stamp lines, harmpi.base.arena), and after the first wait
  every rank reads its peers' stamps. Across two nodes the rail message's
  header carries its sender's give-up time (realtime), from which the
  peer's arrival follows; each rank posts it with its second publish, so
  after the second wait every rank knows every rank's arrival;
- its exit time, bytes and kind word (dtype, collective, forced algorithm).

State layout (int64 words; P = communicator size, R = ring records):

    [0, HDR)            header (H_* below)
    [HDR, +P)           last-arrival count per communicator rank
    [.., +P)            last-arrival delay per rank, ns (summed)
    [.., +NBUCKETS)     latency histogram, log2 buckets of 1/8 octave
    [.., +2*NCOLL)      calls and bytes per collective (kind.COLL_*)
    [.., +R*REC_WORDS)  the ring of the last R records (R_* below)
"""

from __future__ import annotations

import numba
import numpy as np

from ..base import control, kind
from ..base.sync import monotonic_ns

__all__ = ["HDR", "H_CAP", "H_WRITTEN", "H_SIZE", "H_CALLS", "H_BYTES", "H_WAIT_NS", "H_OWN_NS",
           "H_TOTAL_NS", "H_STRAGGLED", "REC_WORDS", "REC_FIELDS", "NBUCKETS", "SUBBUCKETS",
           "NCOLL", "layout", "new_state", "bucket_of", "bucket_value_ns", "record"]

(H_CAP, H_WRITTEN, H_SIZE, H_CALLS, H_BYTES, H_WAIT_NS, H_OWN_NS, H_TOTAL_NS,
 H_STRAGGLED) = range(9)
HDR = 16
#: one record: (field, meaning)
REC_FIELDS = (
    ("enter_ns", "entry time (monotonic, this host)"),
    ("first_ns", "first arrival heard of (0: none but this rank)"),
    ("last_ns", "last arrival heard of"),
    ("exit_ns", "exit time"),
    ("nbytes", "bytes of this rank's input"),
    ("code", "kind word (harmpi.base.kind: dtype, collective, forced algorithm)"),
    ("last_rank", "communicator rank that arrived last (-1: unknown)"),
    ("arrivals", "how many ranks' arrivals were heard of"),
)
REC_WORDS = len(REC_FIELDS)
(R_ENTER, R_FIRST, R_LAST, R_EXIT, R_NBYTES, R_CODE, R_LAST_RANK, R_ARRIVALS) = range(REC_WORDS)
SUBBUCKETS = 8
NBUCKETS = 48 * SUBBUCKETS
NCOLL = 4
_COLL_SHIFT = dict((f, shift) for f, shift, _ in kind.FIELDS)["coll"]
_COLL_MASK = 0xF
_voidptr = control.voidptr


def layout(size: int, records: int) -> dict:
    """Offsets of the state's parts for P = ``size``, R = ``records``."""
    count = HDR
    delay = count + size
    hist = delay + size
    coll = hist + NBUCKETS
    ring = coll + 2 * NCOLL
    return {"count": count, "delay": delay, "hist": hist, "coll": coll, "ring": ring,
            "words": ring + records * REC_WORDS}


def new_state(size: int, records: int) -> np.ndarray:
    """A zeroed state for P = ``size`` ranks and a ring of ``records``."""
    st = np.zeros(layout(size, records)["words"], np.int64)
    st[H_CAP] = records
    st[H_SIZE] = size
    return st


@numba.njit(cache=True, nogil=True)
def bucket_of(ns):
    """Histogram bucket of a latency: 1/8 octave (a bucket spans ~9%)."""
    if ns < 1:
        return 0
    b = 0
    v = ns
    while v >= 2:
        v >>= 1
        b += 1
    # the three bits below the leading one pick the sub-bucket
    frac = (ns << 3 >> b) & 7 if b < 60 else 0
    return min(b * SUBBUCKETS + frac, NBUCKETS - 1)


def bucket_value_ns(b: int) -> float:
    """The middle of bucket ``b``, in ns."""
    octave, frac = divmod(b, SUBBUCKETS)
    return 2.0 ** octave * (1 + (frac + 0.5) / SUBBUCKETS)


@numba.njit(cache=True, nogil=True)
def control_words(addr):
    """Words of the state at ``addr`` (its header says how big it is)."""
    head = numba.carray(_voidptr(addr), (HDR,), np.int64)
    return HDR + 2 * head[H_SIZE] + NBUCKETS + 2 * NCOLL + head[H_CAP] * REC_WORDS


@numba.njit(numba.types.void(control.ARRAY), cache=True, nogil=True)
def record(ctl):
    """The running collective ends: write its record into the ring and add
    it to the aggregates (called by node.leave when profiling is on)."""
    c = ctl[0]
    t_exit = monotonic_ns()
    n = control_words(c.profile)
    st = numba.carray(_voidptr(c.profile), (n,), np.int64)
    size = st[H_SIZE]
    cap = st[H_CAP]
    count = HDR
    delay = count + size
    hist = delay + size
    coll = hist + NBUCKETS
    ring = coll + 2 * NCOLL
    enter = c.prof_enter_ns
    last = c.prof_last_ns
    if last < enter or c.prof_arrivals < 2:
        last = enter
    st[H_CALLS] += 1
    st[H_BYTES] += c.prof_nbytes
    st[H_WAIT_NS] += last - enter
    st[H_OWN_NS] += t_exit - last
    st[H_TOTAL_NS] += t_exit - enter
    st[hist + bucket_of(t_exit - enter)] += 1
    k = (c.prof_code >> _COLL_SHIFT) & _COLL_MASK
    if k < NCOLL:
        st[coll + 2 * k] += 1
        st[coll + 2 * k + 1] += c.prof_nbytes
    who = c.prof_last_rank
    # the last arrival counts only where every rank was heard of (then every
    # rank holds the same view; a path that hears its own node only does not)
    if c.prof_arrivals == size and size >= 2 and 0 <= who < size:
        st[H_STRAGGLED] += 1
        st[count + who] += 1
        st[delay + who] += c.prof_last_ns - c.prof_first_ns
    if cap > 0:
        r = ring + (st[H_WRITTEN] % cap) * REC_WORDS
        st[r + R_ENTER] = enter
        st[r + R_FIRST] = c.prof_first_ns
        st[r + R_LAST] = c.prof_last_ns
        st[r + R_EXIT] = t_exit
        st[r + R_NBYTES] = c.prof_nbytes
        st[r + R_CODE] = c.prof_code
        st[r + R_LAST_RANK] = who
        st[r + R_ARRIVALS] = c.prof_arrivals
    st[H_WRITTEN] += 1
