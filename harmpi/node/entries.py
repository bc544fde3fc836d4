"""The entries a context runs, and the enter/leave every entry starts and ends with.

All are f(ctl, x_addr, n, fmt) -> status (``STEP_SIG``; the allgather's
also takes out_addr and the shape digest): ``one_node_step`` (auto on one
node; ``ONE_NODE_CFUNC`` is the same for C callers), its split-phase halves
``one_node_start`` / ``one_node_finish``, ``gather_step`` (the one-node
allgather) and ``solo_step`` (a communicator of one rank). The upper-case
names are the compiled functions themselves (``entry_point``), called
without the dispatcher's per-call typing.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..base import control, copytune, dtypes, kind
from ..base.arena import FLAG_LINE_NBYTES, W_CULPRIT
from ..base.control import ABANDONED, BUSY, OK, WRONG_THREAD
from ..base.sync import compare_exchange, store_release
from ..record import recorder
from .dispatch import format_itemsize
from .flags import ENTERED_BASE, stage_check, stage_post
from .layout import part_bounds, ring_pos
from .stamps import begin
from .steps import gather_node, reduce_scatter_allgather, shm_allreduce, sum_slots, tune_state

__all__ = ["thread_self", "foreign_thread", "enter", "leave", "gather_step", "one_node_step",
           "one_node_start", "one_node_finish", "solo_step", "entry_point", "STEP_SIG",
           "CFUNC_SIG", "SPLIT_NONE", "SPLIT_DONE", "SPLIT_SMALL", "SPLIT_RSAG", "ONE_NODE_STEP",
           "ONE_NODE_CFUNC", "SOLO_STEP", "SOLO_CFUNC", "GATHER_SIG", "GATHER_STEP", "GATHER_CFUNC",
           "ONE_NODE_START", "ONE_NODE_FINISH"]

_BF16, _F16, _F32 = dtypes.BF16, dtypes.F16, dtypes.F32
_BUSY_OFFSET = control.offset("busy")
_i64 = types.int64
_ctl = control.ARRAY
STEP_SIG = _i64(_ctl, types.intp, _i64, _i64)
CFUNC_SIG = _i64(_i64, _i64, _i64, _i64)
GATHER_SIG = _i64(_ctl, types.intp, types.intp, _i64, _i64, _i64)


@intrinsic
def thread_self(typingctx):
    """libc ``pthread_self()``: the calling thread (what Python's
    threading.get_ident() returns on Linux); a register read, a few ns."""
    sig = types.int64()

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "pthread_self")
        return builder.call(fn, [])

    return sig, codegen


@numba.njit(types.boolean(_ctl), cache=True, nogil=True)
def foreign_thread(ctl):
    """Whether the calling thread is not the one that owns the context
    (control field ``owner``, set by harmpi.runtime.registry; 0: any thread)."""
    owner = ctl[0].owner
    return owner != 0 and owner != thread_self()


@numba.njit(_i64(_ctl), cache=True, nogil=True)
def enter(ctl):
    """Start of every entry: OK, or ABANDONED (this context gave up on a
    collective), or WRONG_THREAD (the caller is not the thread that made the
    context: ranks pair calls by order, not by thread, so a second thread's
    call could pair with another thread's on another rank), or BUSY (an
    async collective of this context is still open, or a thread got past the
    owner check by sharing its id: the flag rounds must not interleave).
    A thread-id compare and one uncontended compare-exchange."""
    if ctl[0].abandoned != 0:
        return ABANDONED
    if foreign_thread(ctl):
        return WRONG_THREAD
    if compare_exchange(ctl.ctypes.data + _BUSY_OFFSET, 0, 1) != 0:
        return BUSY
    c = ctl[0]
    c.coll_epoch = c.epoch
    # the culprit word says "inside the collective that starts at this epoch"
    # until this rank gives up (flags.ENTERED_BASE): a peer waiting for this
    # rank's publish then gives it one more deadline to name whom it waits for
    store_release(c.flags + c.local_rank * FLAG_LINE_NBYTES + W_CULPRIT * 8,
                  ENTERED_BASE - c.coll_epoch)
    return OK


@numba.njit(types.void(_ctl), cache=True, nogil=True)
def leave(ctl):
    if ctl[0].profile != 0:
        recorder.record(ctl)
    store_release(ctl.ctypes.data + _BUSY_OFFSET, 0)


# -- the one-node allgather ---------------------------------------------------------

@numba.njit(cache=True, nogil=True)
def _gather(ctl, x_addr, out_addr, n, fmt, digest):
    code = kind.allgather_code(fmt, digest)
    if fmt == _BF16 or fmt == _F16:
        return gather_node(ctl, x_addr, out_addr, n, code, np.empty(0, np.uint16))
    if fmt == _F32:
        return gather_node(ctl, x_addr, out_addr, n, code, np.empty(0, np.float32))
    return gather_node(ctl, x_addr, out_addr, n, code, np.empty(0, np.float64))


@numba.njit(GATHER_SIG, cache=True, nogil=True)
def gather_step(ctl, x_addr, out_addr, n, fmt, digest):
    """The one-node allgather entry: out = every local rank's x[:n] in
    communicator rank order."""
    rc = enter(ctl)
    if rc != OK:
        return rc
    if ctl[0].profile != 0:
        begin(ctl, n * format_itemsize(fmt), kind.allgather_code(fmt, digest))
    rc = _gather(ctl, x_addr, out_addr, n, fmt, digest)
    leave(ctl)
    return rc


@numba.cfunc(_i64(_i64, _i64, _i64, _i64, _i64, _i64), cache=True, nogil=True)
def _gather_cfunc(ctl_addr, x_addr, out_addr, n, fmt, digest):
    """gather_step for C callers (harmpi/_native.cpp), which pass addresses."""
    return gather_step(control.control_at(ctl_addr), x_addr, out_addr, n, fmt, digest)


# -- the one-node all-reduce: f(ctl, x_addr, n, fmt) -> status --------------------

@numba.njit(cache=True, nogil=True)
def _one_node(ctl, x_addr, n, fmt):
    c = ctl[0]
    code = c.auto_code | fmt
    small = c.small_max_nbytes
    if fmt == _BF16 or fmt == _F16:
        return shm_allreduce(ctl, x_addr, n, code, fmt, small, np.empty(0, np.uint16))
    if fmt == _F32:
        return shm_allreduce(ctl, x_addr, n, code, fmt, small, np.empty(0, np.float32))
    return shm_allreduce(ctl, x_addr, n, code, fmt, small, np.empty(0, np.float64))


@numba.njit(STEP_SIG, cache=True, nogil=True)
def one_node_step(ctl, x_addr, n, fmt):
    """Auto all-reduce on one node: the kind and the size switch come from
    the control block, so a call passes four integers."""
    rc = enter(ctl)
    if rc != OK:
        return rc
    if ctl[0].profile != 0:
        begin(ctl, n * format_itemsize(fmt), ctl[0].auto_code | fmt)
    rc = _one_node(ctl, x_addr, n, fmt)
    leave(ctl)
    return rc


@numba.cfunc(CFUNC_SIG, cache=True, nogil=True)
def _one_node_cfunc(ctl_addr, x_addr, n, fmt):
    return one_node_step(control.control_at(ctl_addr), x_addr, n, fmt)


# -- split-phase one-node all-reduce: start publishes, finish completes ------
#
# An async all-reduce (torch's async_op=True) starts with one_node_start:
# this rank's data goes into its slot and its flag is published, so the
# peers can proceed, and the call returns while the caller computes.
# one_node_finish then waits for the peers, checks the metas and sums. The
# two halves are stage_at split at its wait (the same steps, flag rounds
# and checks as one_node_step, so a rank taking the blocking path meets a
# rank taking the split one). The context stays "busy" in between: another
# entry on it is refused until the finish. A call of more than one slot
# runs whole in the start (its later steps need the peers).

#: what a started split-phase all-reduce's finish does (control field "split")
SPLIT_NONE, SPLIT_DONE, SPLIT_SMALL, SPLIT_RSAG = 0, 1, 2, 3


@numba.njit(cache=True, nogil=True)
def _one_node_start(ctl, x_addr, n, fmt, w):
    c = ctl[0]
    isz = w.itemsize
    total = n * isz
    if total > c.slot_nbytes:
        c.split = SPLIT_DONE
        return _one_node(ctl, x_addr, n, fmt)
    code = c.auto_code | fmt
    if c.tuning != 0:  # read the tuner's mode; only blocking calls tune
        c.mode = copytune.choose(tune_state(c), c.tune_table, False, False, total)
    if total <= c.small_max_nbytes or c.local_size == 1:
        pos = ring_pos(c, total)
        c.split = SPLIT_SMALL
        c.split_pos = pos
        return stage_post(ctl, x_addr, n, 0, 0, total, code, w, pos)
    lo, hi = part_bounds(n, c.local_size, c.local_rank, isz)
    c.split = SPLIT_RSAG
    c.split_pos = 0
    return stage_post(ctl, x_addr, n, lo, hi, total, code, w, 0)


@numba.njit(cache=True, nogil=True)
def _one_node_finish(ctl, x_addr, n, fmt, w):
    c = ctl[0]
    split = c.split
    c.split = SPLIT_NONE
    if split == SPLIT_DONE:
        return OK
    isz = w.itemsize
    total = n * isz
    pos = c.split_pos
    status = stage_check(ctl, total, c.auto_code | fmt, pos)
    if status != OK:
        return status
    if split == SPLIT_SMALL:
        lo = pos // isz
        sum_slots(ctl, x_addr, lo, lo + n, fmt, w)
        c.ring = pos + ((total + 63) & ~63)
        return OK
    return reduce_scatter_allgather(ctl, x_addr, n, fmt, w)


@numba.njit(STEP_SIG, cache=True, nogil=True)
def one_node_start(ctl, x_addr, n, fmt):
    """Start a split-phase auto all-reduce on one node (see above). On OK the
    context stays entered until one_node_finish; on failure it is left."""
    rc = enter(ctl)
    if rc != OK:
        return rc
    if ctl[0].profile != 0:
        begin(ctl, n * format_itemsize(fmt), ctl[0].auto_code | fmt)
    if fmt == _BF16 or fmt == _F16:
        rc = _one_node_start(ctl, x_addr, n, fmt, np.empty(0, np.uint16))
    elif fmt == _F32:
        rc = _one_node_start(ctl, x_addr, n, fmt, np.empty(0, np.float32))
    else:
        rc = _one_node_start(ctl, x_addr, n, fmt, np.empty(0, np.float64))
    if rc != OK:
        ctl[0].split = SPLIT_NONE
        leave(ctl)
    return rc


@numba.njit(STEP_SIG, cache=True, nogil=True)
def one_node_finish(ctl, x_addr, n, fmt):
    """Complete the all-reduce one_node_start started (same arguments)."""
    if fmt == _BF16 or fmt == _F16:
        rc = _one_node_finish(ctl, x_addr, n, fmt, np.empty(0, np.uint16))
    elif fmt == _F32:
        rc = _one_node_finish(ctl, x_addr, n, fmt, np.empty(0, np.float32))
    else:
        rc = _one_node_finish(ctl, x_addr, n, fmt, np.empty(0, np.float64))
    leave(ctl)
    return rc


@numba.njit(STEP_SIG, cache=True, nogil=True)
def solo_step(ctl, x_addr, n, fmt):
    """A communicator of one rank: the sum is x itself. (Refused to other
    threads like every entry, so a program behaves the same at any size.)"""
    if foreign_thread(ctl):
        return WRONG_THREAD
    if ctl[0].profile != 0:
        begin(ctl, n * format_itemsize(fmt), ctl[0].auto_code | fmt)
        recorder.record(ctl)
    return OK


@numba.cfunc(CFUNC_SIG, cache=True, nogil=True)
def _solo_cfunc(ctl_addr, x_addr, n, fmt):
    return solo_step(control.control_at(ctl_addr), x_addr, n, fmt)


def entry_point(dispatcher, sig):
    """The compiled function of ``dispatcher`` for ``sig``, callable without
    the dispatcher's per-call typing of every argument (~0.1 us saved on a
    hot path whose argument types are fixed). Under NUMBA_DISABLE_JIT it is
    the plain Python function."""
    get = getattr(dispatcher, "get_overload", None)
    return dispatcher if get is None else get(sig)


def _cfunc_address(cf):
    """A cfunc's C address (0 under NUMBA_DISABLE_JIT, where there is none)."""
    return getattr(cf, "address", 0)


ONE_NODE_STEP = entry_point(one_node_step, STEP_SIG)
ONE_NODE_CFUNC = _cfunc_address(_one_node_cfunc)
SOLO_STEP = entry_point(solo_step, STEP_SIG)
SOLO_CFUNC = _cfunc_address(_solo_cfunc)
GATHER_STEP = entry_point(gather_step, GATHER_SIG)
GATHER_CFUNC = _cfunc_address(_gather_cfunc)
ONE_NODE_START = entry_point(one_node_start, STEP_SIG)
ONE_NODE_FINISH = entry_point(one_node_finish, STEP_SIG)
