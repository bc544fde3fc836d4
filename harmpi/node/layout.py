"""The node's part of the control block, and where a step's words and slots are.

``init_control`` fills the control block (harmpi.base.control) from the rank's
arena (harmpi.base.arena); the compiled helpers below turn its fields into
addresses: local rank j's flag line (epoch, meta, status and culprit words),
the two parities of slots, a rank's share of a reduce-scatter, and where a
small step writes in its slot (the ring).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types

from ..base import control, copytune
from ..base.arena import FLAG_LINE_NBYTES, W_EPOCH
from ..base.sync import WAIT_SPIN, wake_sleepers
from ..platform import mpiprogress

__all__ = ["init_control", "PART_ALIGN_NBYTES", "slots2d", "step_parity", "parity_slot_addr",
           "slot_addr", "next_slot_addr", "part_bounds", "ring_pos", "hook_addr", "wait_addr",
           "flag_addr", "wake", "local_rank_of"]

_LINE = FLAG_LINE_NBYTES
_WORD = 8
#: partitions of reduce-scatter are multiples of this many bytes (cache lines)
PART_ALIGN_NBYTES = 64
_HOOK_OFFSET = control.HOOK_OFFSET
_WAIT_OFFSET = control.WAIT_OFFSET
_voidptr = control.voidptr
_i64 = types.int64
_ctl = control.ARRAY


def init_control(ctl, arena, spin_count: int, timeout_s: float, auto_code: int,
                 small_max_nbytes: int, stream_stores: str, sigfd: int = -1,
                 tune_state=None, wait_policy: int = WAIT_SPIN, spin_floor_ns: int = 0,
                 spin_cap_ns: int = 0, yield_ns: int = 0) -> None:
    """Fill the node part of a control block (the rail part: har_latency).
    ``stream_stores``: "auto" (local rank 0 times the slot modes per size
    and picks, see copytune; ``tune_state`` is its int64[STATE_WORDS]
    array), "on", "off" or "flush". ``wait_policy`` (sync.WAIT_*) and the
    spin floor and cap of policy auto, and its yield window after the spin:
    how waits spin, yield and sleep (harmpi.base.sync);
    an arena without sleeper lines always spins."""
    c = ctl[0]
    c["flags"] = arena.flags_addr
    c["slots"] = arena.slots_addr
    c["slot_nbytes"] = arena.slot_nbytes
    c["local_size"] = arena.local_size
    c["local_rank"] = arena.local_rank
    c["spin"] = spin_count
    c["timeout_ns"] = int(timeout_s * 1e9)
    c["auto_code"] = auto_code
    c["small_max_nbytes"] = small_max_nbytes
    # auto starts plain: paths that do not run the tuner (the hierarchical
    # ones) keep plain stores, and the tuner probes the others from there
    mode = {"on": copytune.MODE_STREAM, "flush": copytune.MODE_FLUSH}.get(stream_stores,
                                                                          copytune.MODE_PLAIN)
    c["mode"] = mode
    c["tune_table"] = arena.tune_addr
    c["stamps"] = getattr(arena, "stamps_addr", 0)
    c["tuning"] = 1 if stream_stores == "auto" and arena.local_size > 1 else 0
    if arena.local_rank == 0:
        c["tune_state"] = tune_state.ctypes.data
        copytune.init_state(tune_state, arena.tune_table(), mode)
    for name, value in zip(("hook_fn", "hook_comm", "hook_source", "hook_tag"),
                           mpiprogress.hook_values()):
        c[name] = value
    c["hook_sigfd"] = sigfd
    c["sleepers"] = getattr(arena, "sleepers_addr", 0)
    c["wait_policy"] = wait_policy
    c["wait_gap"] = 0
    c["wait_floor"] = spin_floor_ns
    c["wait_cap"] = spin_cap_ns
    c["wait_yield"] = yield_ns


# -- slots ------------------------------------------------------------------------

@numba.njit(cache=True, nogil=True)
def slots2d(c, parity, w):
    """The L slots of one parity as an (L, slot elements) array of w's type."""
    L = c.local_size
    elems = c.slot_nbytes // w.itemsize
    base = c.slots + parity * L * c.slot_nbytes
    return numba.carray(_voidptr(base), (L, elems), w.dtype)


@numba.njit(cache=True, nogil=True)
def step_parity(c):
    """Slot parity of the step in progress (stage() has counted it)."""
    return (c.steps - 1) & 1


@numba.njit(cache=True, nogil=True)
def parity_slot_addr(c, parity, j):
    return c.slots + (parity * c.local_size + j) * c.slot_nbytes


@numba.njit(_i64(_ctl, _i64), cache=True, nogil=True)
def slot_addr(ctl, j):
    """Address of slot(p, j) of the current step."""
    return parity_slot_addr(ctl[0], step_parity(ctl[0]), j)


@numba.njit(_i64(_ctl, _i64), cache=True, nogil=True)
def next_slot_addr(ctl, j):
    """Address of slot(p, j) of the step that the next ``stage`` will start."""
    return parity_slot_addr(ctl[0], ctl[0].steps & 1, j)


@numba.njit(cache=True, nogil=True)
def part_bounds(m, L, j, itemsize):
    """[lo, hi) of rank j's share of m elements (cache-line aligned parts)."""
    align = PART_ALIGN_NBYTES // itemsize
    part = ((m + L - 1) // L + align - 1) // align * align
    lo = min(j * part, m)
    return lo, min(lo + part, m)


@numba.njit(cache=True, nogil=True)
def ring_pos(c, nbytes):
    """Where a small step of ``nbytes`` writes in its slot: just past the
    previous small step, wrapping to 0 when it would not fit. Why a ring: a
    slot line rewritten while another core still caches it (it read it two
    steps ago) costs the writer an invalidation round trip; walking the
    whole slot lets the readers' private caches drop each line before it
    is rewritten (measured here, 2 ranks, 10 KB: 3.3 us per all-reduce with
    the ring, 3.6-3.9 us without)."""
    pos = c.ring
    if pos + nbytes > c.slot_nbytes:
        pos = 0
    return pos


# -- the control block's own words, the flag lines ----------------------------------

@numba.njit(cache=True, nogil=True)
def hook_addr(ctl):
    """Address of the control block's mpiprogress hook."""
    return ctl.ctypes.data + _HOOK_OFFSET


@numba.njit(cache=True, nogil=True)
def wait_addr(ctl):
    """Address of the control block's wait state (sync.WS_*)."""
    return ctl.ctypes.data + _WAIT_OFFSET


@numba.njit(cache=True, nogil=True)
def flag_addr(c, j):
    """Address of local rank j's epoch word."""
    return c.flags + j * _LINE + W_EPOCH * _WORD


@numba.njit(cache=True, nogil=True)
def wake(c, j):
    """Wake the ranks asleep on local rank j's epoch word (after an exchange
    or a fence; one load when none sleeps)."""
    if c.sleepers != 0:
        wake_sleepers(c.sleepers + j * _LINE, flag_addr(c, j))


@numba.njit(cache=True, nogil=True)
def local_rank_of(c, j):
    """Communicator rank of local rank j (-1 if the table is not set)."""
    if c.local_ranks == 0:
        return -1
    return numba.carray(_voidptr(c.local_ranks), (c.local_size,), np.int64)[j]
