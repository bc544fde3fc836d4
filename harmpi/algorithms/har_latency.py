"""HAR, latency variant: one rail exchange of the full tensor, then shm.

The published hierarchical all-reduce for decode-sized tensors (G nodes of
L ranks, every node the same L; rank (g, l) is local rank l of node g).

Steps (per chunk of m elements, at most rail_chunk_nbytes: one slot, and
no more than 512 KiB, where one exchange of the tcp rail is fastest per byte):
  1. G = 2: post the rail exchange first — receive from, and send x to, the
     rail peer (same local rank on the other node), straight from the
     caller's buffer — so the network works while the node does step 2;
  2. (G > 2: copy x into my slot;) post (size, kind), publish, wait for
     the node, check that every local rank passes the same size and kind;
  3. G = 2: complete the exchange; my slot = x + the peer's tensor;
     G > 2: recursive doubling over the rail, in place in my slot (log2 G
     exchanges; ranks beyond the largest power of two fold in first and
     get the result last);
  4. post my status (did the exchange disagree?), publish, wait for the node;
  5. every rank sums the L slots in rank order into x (L = 1 and G = 2: x +=
     the peer's tensor, after the flag round, without the slot).

No root, no relay, no broadcast: each rank's only network step is its own
rail exchange, and all L rails run in parallel.

Large tensors, two nodes of one rank each over the tcp rail (a tensor of
more than one rail step): reduce-scatter + allgather steps over the rail,
pipelined (rail_turns.rail_rsag2): each end sends the same bytes as in
plain exchanges but adds half of them and copies none. A disagreement shows
in the first round's headers on both nodes (the tag folds in the call's
bytes and kind) before x is written; a later failure (a deadline, a lost
peer, Ctrl-C) raises with x partly summed: an error, never a silent result.

Large tensors, 2^k > 2 nodes of one rank each over the tcp rail (a step of
more than 256 KiB): recursive halving, then recursive doubling of the owned
pieces, in the slot and then straight into x (rail_turns.rail_halving: 2m
(G-1)/G bytes sent per rank instead of m log2 G; 4 x 1, 1 MB bf16 on the
2-vCPU Xeon ~950 us against 1684 doubling).

Invariants: after step 3 the slot of local rank l holds the same bits on
every node (a + b == b + a in IEEE arithmetic, also after rounding to bf16,
and recursive doubling combines identical pairs), so step 5 yields the same
bits everywhere. The caller's x is only read until step 5, so any
disagreement (found in step 2 inside the node or in step 3 across nodes)
fails every rank with x untouched. Steps 2 and 4 are shared with
har_bandwidth and leader, so ranks that picked different algorithms from
different sizes still meet in the same flag rounds and fail cleanly.
A bf16 result rounds once per rail combine and once in the node sum.

Cost: per rank, log2 G messages of m bytes (1 for two nodes), overlapped
with the first flag round; one add pass and one copy of m bytes into the
slot (G = 2); two flag rounds; L*m bytes read in the final sum. Network
bytes per rank ~m*log2 G: right for small m, wasteful for large m (see
har_bandwidth). Over the tcp transport, steps 1-5 run as one compiled call
(no Python between them) at any G: for G > 2 the recursive doubling turns
through the rail peers' sockets (rail_turns.rail_doubling, the same messages
as algorithms.base.rail_allreduce). 4 virtual nodes x 1 rank on the 2-vCPU
Xeon, 10 KB bf16: 123 us as Python steps, 30 compiled (MPI over TCP 56-70).
"""

from __future__ import annotations

import numba
import numpy as np

from .. import node
from ..base import control, dtypes, kind
from ..base.control import MISMATCH, OK, POISONED, RAIL_LATE, RAIL_TIMEOUT
from ..errors import HarmpiTimeoutError
from ..transports import sockio
from .base import RailAlgorithm, chunks, rail_allreduce, recv_check
from .rail_turns import (
    PIPE_ROWS,
    got,
    post_exchange,
    rail_complete,
    rail_doubling,
    rail_halving,
    rail_rsag2,
    rail_views,
    use_halving,
)

__all__ = ["HarLatencyAllreduce", "RAIL_CHUNK_NBYTES", "rail_chunk_nbytes", "HAR2_STEP",
           "HAR2_START", "HAR2_FINISH"]

# -- two nodes over the tcp transport: the whole step in one compiled call ----
#
# Same steps, messages and flag rounds as the Python loop below (so a rank
# on either path meets its peers), without ~15 us of Python per call: post
# the exchange (header + x straight from the caller's buffer), stage the
# metas only, complete the exchange (sleeping in poll(2) when there is
# nothing to do), then add + publish + sum. Its socket, buffers and sockio
# rows are in the control block (rail_* fields).

_voidptr = control.voidptr

#: the most one rail exchange carries (the slot size where that is smaller):
#: a larger tensor goes in steps of this size. On the 2-vCPU Xeon, 2 x 1
#: over the tcp rail, bf16 medians: 1 MB in one exchange 630-640 us, in two
#: of 512 KiB 350-400 (MPI over TCP 410-460 in the same runs), 512 KiB alone
#: 190: past ~512 KiB in flight each way the loopback path slows per byte
#: (a plain socket exchange does not: 87/216/463 us for 0.5/1/2 MB in 256 KiB
#: sends, so the cost is in what the step holds at once, not in the wire)
RAIL_CHUNK_NBYTES = 512 << 10


def rail_chunk_nbytes(slot_nbytes):
    """Bytes per rail exchange step for contexts of slot size ``slot_nbytes``."""
    return min(slot_nbytes, RAIL_CHUNK_NBYTES)


@numba.njit(cache=True, nogil=True)
def _har2_post(ctl, ops, scratch, addr, m, total, code, tag, w):
    """First half of a step: post the exchange, post the meta, publish."""
    c = ctl[0]
    # (a local rank that gave up on an earlier step leaves this node out of
    # every later one: post_exchange sends nothing then)
    rc = post_exchange(ctl, ops, scratch, c.rail_recv, c.rail_recv_cap, addr, m * w.itemsize, tag)
    if rc != OK:
        return rc
    return node.stage_post(ctl, 0, m, 0, m, total, code, w, 0)


@numba.njit(cache=True, nogil=True)
def _peer_arrived(c, give_up_rt):
    """Profiling, first step of a collective: the rail peer sent its part at
    its give-up time minus the timeout (its realtime clock, which is
    ``prof_rt_skew_ns`` ahead of this rank's). This rank posts that time, on
    its own monotonic clock, with its next publish, so every local rank hears
    of every rank of the other node too. (Assumes the peer's timeout equals
    this rank's; the clock error is harmpi.profile's offset bound.)"""
    sent_rt = give_up_rt - c.timeout_ns - c.prof_rt_skew_ns
    c.prof_stamp = sent_rt - c.prof_rt_mono_ns
    c.prof_who = c.rail_peer
    # (this rank folds it in when it reads its own stamp line after the wait)


@numba.njit(cache=True, nogil=True)
def _har2_complete(ctl, ops, pollfds, scratch, addr, m, total, code, tag, fmt, w):
    """Second half: wait for the node and the exchange, add, publish, sum."""
    c = ctl[0]
    nbytes = m * w.itemsize
    rc = node.stage_check(ctl, total, code, 0)
    if rc != OK and rc != MISMATCH:
        return rc
    local_bad = rc == MISMATCH
    if local_bad:  # keep the node's verdict while the step ends poisoned
        node.keep_mismatch(c)
    rc = rail_complete(ctl, ops, pollfds, scratch)
    if rc != OK:
        return rc
    rail_bad = not got(ops, nbytes, tag)
    if c.profile != 0 and c.epoch == c.coll_epoch + 1:
        _peer_arrived(c, ops[0, sockio.OP_HDR_DL])
    status = 1 if (local_bad or rail_bad) else 0
    rc = node.add_publish_sum(ctl, addr, c.rail_recv, m, status, fmt, w)
    if rc != OK and rc != POISONED:
        return rc
    if local_bad:
        return node.settle_mismatch(c)
    return rc


@numba.njit(cache=True, nogil=True)
def _own_meta_round(ctl, m, total, code, w):
    """The meta round of a step on a one-rank node whose slot this rank
    never fills (the rail steps write x and the slot themselves): post the
    meta, publish, wait; only its own meta to check, so never a mismatch."""
    rc = node.stage_post(ctl, 0, m, 0, m, total, code, w, 0)
    if rc != OK:
        return rc
    return node.stage_check(ctl, total, code, 0)


@numba.njit(cache=True, nogil=True)
def _rsag2(ctl, x_addr, n, chunk, total, code, tag, fmt, w):
    """x[:n] past one rail step with one rank per node: the meta round (its
    own meta only), rail_turns.rail_rsag2's steps, the status round."""
    c = ctl[0]
    rc = _own_meta_round(ctl, n, total, code, w)
    if rc != OK:
        return rc
    rc, bad, first = rail_rsag2(ctl, x_addr, n, chunk, tag, fmt, w)
    if rc != OK:
        return rc
    if c.profile != 0 and c.epoch == c.coll_epoch + 1 and first != 0:
        _peer_arrived(c, first)
    return node.publish_wait_status(ctl, 1 if bad else 0)


@numba.njit(cache=True, nogil=True)
def _halving_chunk(ctl, ops, pollfds, scratch, addr, m, total, code, tag, fmt, w):
    """One large step over x[:m] on 2^k > 2 nodes of one rank: the meta
    round (its own meta only), rail_halving in my slot and x, the status
    round."""
    rc = _own_meta_round(ctl, m, total, code, w)
    if rc != OK:
        return rc
    rc, bad = rail_halving(ctl, ops, pollfds, scratch, addr,
                           node.slot_addr(ctl, ctl[0].local_rank), m, tag, fmt, w)
    if rc != OK:
        return rc
    return node.publish_wait_status(ctl, 1 if bad else 0)


@numba.njit(cache=True, nogil=True)
def _harG_chunk(ctl, ops, pollfds, scratch, addr, m, total, code, tag, fmt, w):
    """One step over x[:m] on more than two nodes: x into my slot, the
    node's metas checked, recursive doubling over the rail in my slot, then
    the status round and the node sum (steps 2-5 of the module docstring)."""
    c = ctl[0]
    if use_halving(c, m * w.itemsize):
        return _halving_chunk(ctl, ops, pollfds, scratch, addr, m, total, code, tag, fmt, w)
    rc = node.stage_post(ctl, addr, m, 0, 0, total, code, w, 0)
    if rc != OK:
        return rc
    rc = node.stage_check(ctl, total, code, 0)
    if rc != OK and rc != MISMATCH:
        return rc
    local_bad = rc == MISMATCH
    if local_bad:  # keep the node's verdict while the step ends poisoned
        node.keep_mismatch(c)
    rc, poisoned = rail_doubling(ctl, ops, pollfds, scratch, node.slot_addr(ctl, c.local_rank),
                                  m, tag, local_bad, fmt, w)
    if rc != OK:
        return rc
    rc = node.add_publish_sum(ctl, addr, 0, m, 1 if poisoned else 0, fmt, w)
    if rc != OK and rc != POISONED:
        return rc
    if local_bad:
        return node.settle_mismatch(c)
    return rc


@numba.njit(cache=True, nogil=True)
def _har2_chunk(ctl, ops, pollfds, scratch, addr, m, total, code, tag, fmt, w):
    """One step of the two-node exchange over x[:m] at ``addr``."""
    rc = _har2_post(ctl, ops, scratch, addr, m, total, code, tag, w)
    if rc != OK:
        return rc
    return _har2_complete(ctl, ops, pollfds, scratch, addr, m, total, code, tag, fmt, w)


@numba.njit(cache=True, nogil=True)
def _har2(ctl, x_addr, n, code, fmt, w):
    c = ctl[0]
    isz = w.itemsize
    total = n * isz
    tag = kind.rail_tag(total, code)
    ops, pollfds, scratch = rail_views(c)
    chunk = min(c.slot_nbytes, RAIL_CHUNK_NBYTES) // isz
    if c.rail_nodes == 2 and c.local_size == 1 and n > chunk:
        return _rsag2(ctl, x_addr, n, chunk, total, code, tag, fmt, w)
    start = 0
    while True:
        m = min(chunk, n - start)
        if c.rail_nodes > 2:
            rc = _harG_chunk(ctl, ops, pollfds, scratch, x_addr + start * isz, m, total, code,
                             tag, fmt, w)
        else:
            rc = _har2_chunk(ctl, ops, pollfds, scratch, x_addr + start * isz, m, total, code,
                             tag, fmt, w)
        if rc != OK:
            return rc
        start += m
        if start >= n:
            return OK


_RUN_SIG = numba.types.int64(control.ARRAY, numba.types.intp, numba.types.int64,
                             numba.types.int64, numba.types.int64)


@numba.njit(_RUN_SIG, cache=True, nogil=True)
def har2_run(ctl, x_addr, n, code, fmt):
    """The two-node step of x[:n] with kind ``code``, for any storage format."""
    if fmt == dtypes.BF16 or fmt == dtypes.F16:
        return _har2(ctl, x_addr, n, code, fmt, np.empty(0, np.uint16))
    if fmt == dtypes.F32:
        return _har2(ctl, x_addr, n, code, fmt, np.empty(0, np.float32))
    return _har2(ctl, x_addr, n, code, fmt, np.empty(0, np.float64))


@numba.njit(node.STEP_SIG, cache=True, nogil=True)
def har2_step(ctl, x_addr, n, fmt):
    """The entry of auto on two equal nodes over tcp (up to har_latency_max)."""
    rc = node.enter(ctl)
    if rc != OK:
        return rc
    if ctl[0].profile != 0:
        node.begin(ctl, n * node.format_itemsize(fmt), ctl[0].auto_code | fmt)
    rc = har2_run(ctl, x_addr, n, ctl[0].auto_code | fmt, fmt)
    node.leave(ctl)
    return rc


@numba.njit(cache=True, nogil=True)
def _har2_start(ctl, x_addr, n, fmt, w):
    c = ctl[0]
    total = n * w.itemsize
    code = c.auto_code | fmt
    ops, _pollfds, scratch = rail_views(c)
    return _har2_post(ctl, ops, scratch, x_addr, n, total, code, kind.rail_tag(total, code), w)


@numba.njit(cache=True, nogil=True)
def _har2_finish(ctl, x_addr, n, fmt, w):
    c = ctl[0]
    total = n * w.itemsize
    code = c.auto_code | fmt
    ops, pollfds, scratch = rail_views(c)
    return _har2_complete(ctl, ops, pollfds, scratch, x_addr, n, total, code,
                          kind.rail_tag(total, code), fmt, w)


@numba.njit(node.STEP_SIG, cache=True, nogil=True)
def har2_start(ctl, x_addr, n, fmt):
    """Split-phase two-node step, first half (harmpi.node's split-phase
    comment): post the rail exchange, post the meta, publish, return. Only
    for a call of one rail step at most (rail_chunk_nbytes; the caller
    checks). On OK the context stays entered until har2_finish; on failure
    it is left."""
    rc = node.enter(ctl)
    if rc != OK:
        return rc
    if ctl[0].profile != 0:
        node.begin(ctl, n * node.format_itemsize(fmt), ctl[0].auto_code | fmt)
    if fmt == dtypes.BF16 or fmt == dtypes.F16:
        rc = _har2_start(ctl, x_addr, n, fmt, np.empty(0, np.uint16))
    elif fmt == dtypes.F32:
        rc = _har2_start(ctl, x_addr, n, fmt, np.empty(0, np.float32))
    else:
        rc = _har2_start(ctl, x_addr, n, fmt, np.empty(0, np.float64))
    if rc != OK:
        node.leave(ctl)
    return rc


@numba.njit(node.STEP_SIG, cache=True, nogil=True)
def har2_finish(ctl, x_addr, n, fmt):
    """Second half of har2_start's step: the node wait, the exchange, the sum."""
    if fmt == dtypes.BF16 or fmt == dtypes.F16:
        rc = _har2_finish(ctl, x_addr, n, fmt, np.empty(0, np.uint16))
    elif fmt == dtypes.F32:
        rc = _har2_finish(ctl, x_addr, n, fmt, np.empty(0, np.float32))
    else:
        rc = _har2_finish(ctl, x_addr, n, fmt, np.empty(0, np.float64))
    node.leave(ctl)
    return rc


#: compiled entry points: f(ctl, x_addr, n, fmt) and f(ctl, x_addr, n, code, fmt)
HAR2_STEP = node.entry_point(har2_step, node.STEP_SIG)
HAR2_START = node.entry_point(har2_start, node.STEP_SIG)
HAR2_FINISH = node.entry_point(har2_finish, node.STEP_SIG)
_HAR2_RUN = node.entry_point(har2_run, _RUN_SIG)


class HarLatencyAllreduce(RailAlgorithm):
    name = "har_latency"

    def __init__(self, ctx):
        super().__init__(ctx)
        #: two nodes over a rail compiled steps drive (tcp): the step runs
        #: compiled (else the Python loop)
        self.compiled = self.G >= 2 and self.transport.compiled_rail
        if self.compiled:
            t = self.transport
            # rows of its own: the transport's may be reallocated by its other users
            # (PIPE_ROWS: rail_rsag2 runs two exchanges per round; rows not
            # posted read as done in a timeout's report)
            self.ops = sockio.new_ops(PIPE_ROWS)
            self.ops[:, sockio.OP_STATE] = sockio.ST_DONE
            self.pollfds = sockio.new_pollfds(PIPE_ROWS)
            self.scratch = sockio.new_scratch()
            #: per node, the socket to its rail peer and that peer's rank (the
            #: control block points at both; G > 2 turns through them)
            self.fds = np.array([t.fd(h) if h != self.g else -1 for h in range(self.G)],
                                np.int64)
            self.world = np.array([ctx.topo.node_ranks[h][self.me] for h in range(self.G)],
                                  np.int64)
            c = ctx.ctl[0]
            c["rail_nodes"] = self.G
            c["rail_fds"] = self.fds.ctypes.data
            c["rail_world"] = self.world.ctypes.data
            c["rail_fd"] = self.fds[1 - self.g] if self.G == 2 else -1
            c["rail_peer"] = self.world[1 - self.g] if self.G == 2 else -1
            c["rail_recv"] = self.recv_addr
            c["rail_recv_cap"] = self.recv_buf.nbytes
            c["rail_spin"] = t.spin_count
            c["rail_ops"] = self.ops.ctypes.data
            c["rail_pollfds"] = self.pollfds.ctypes.data
            c["rail_scratch"] = self.scratch.ctypes.data
            c["rail_scratch_len"] = self.scratch.size
            c["rail_node"] = self.g

    def run(self, call):
        if self.compiled:
            rc = _HAR2_RUN(self.ctx.ctl, call.addr, call.n, call.code, call.fmt)
            if rc:
                self.ctx.fail(rc, call)
            return
        ctx = self.ctx
        ctl = ctx.ctl
        isz = call.itemsize
        tag = kind.rail_tag(call.nbytes, call.code)
        timeout_s = ctx.config.timeout_s
        for _start, addr, m in chunks(call, rail_chunk_nbytes(ctx.config.slot_nbytes) // isz):
            pending = None
            ctx.guard(call)
            if self.G == 2:
                # the whole receive buffer: a larger tensor from a mismatched
                # peer is then seen by its count, not a truncation error
                pending = self.transport.post_exchange(1 - self.g, ctx.view(addr, m * isz), tag,
                                                       self.recv_buf)
            # two nodes: my slot gets x + peer in one pass after the
            # exchange (add_publish_sum), so the stage only checks metas
            local = ctx.stage_or_remember(call, addr, m, copy=pending is None)
            if pending is not None:
                got, = self.transport.complete(pending, timeout_s, call)
                poisoned = local is not None or recv_check(got, m * isz, tag)
                r_addr = self.recv_addr
            else:
                poisoned = rail_allreduce(self.transport, self.g, self.G,
                                          node.slot_addr(ctl, self.me), m, call, self.recv_buf,
                                          tag, timeout_s, poisoned=local is not None,
                                          guard=ctx.guard)
                r_addr = 0
            # add the peer's tensor, flag round, sum: one compiled call
            rc2 = node.add_publish_sum(ctl, addr, r_addr, m, 1 if poisoned else 0, call.fmt,
                                       call.w)
            ctx.settle_status(rc2, call, local)

    def raise_rail(self, rc, call):
        """The exception for a compiled step's RAIL_TIMEOUT, RAIL_FAILED or RAIL_LATE."""
        # the node whose rail peer the step was waiting for (G > 2: the turn's)
        peer = int(np.flatnonzero(self.world == self.ctx.ctl[0]["rail_peer"])[0])
        t = self.transport
        if rc == RAIL_LATE:
            raise HarmpiTimeoutError(
                f"rank {self.ctx.topo.rank}: {call}: rail peer rank "
                f"{self.ctx.topo.node_ranks[peer][self.me]} sent its part more than "
                f"{self.ctx.config.timeout_s:g} s ago and has given up on this collective: this "
                "rank arrived after its deadline (HARMPI_TIMEOUT_S sets it)")
        if rc == RAIL_TIMEOUT:
            t.raise_timeout(PIPE_ROWS, (peer,) * PIPE_ROWS, self.ctx.config.timeout_s, call,
                            ops=self.ops)
        t.raise_failed((peer,) * PIPE_ROWS, call, ops=self.ops)
