"""HAR, latency variant: one rail exchange of the full tensor, then shm.

The published hierarchical all-reduce for decode-sized tensors (G nodes of
L ranks, every node the same L; rank (g, l) is local rank l of node g).

Steps (per chunk of at most one slot of m elements):
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
  5. every rank sums the L slots in rank order into x.

No root, no relay, no broadcast: each rank's only network step is its own
rail exchange, and all L rails run in parallel.

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
har_bandwidth). With G = 2 over the tcp transport, steps 1-5 run as one
compiled call (no Python between them).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types

from .. import node
from ..node import (C_ERR2_A, C_ERR2_B, C_ERR2_PEER, C_ERR_A, C_ERR_B, C_ERR_PEER, C_RAIL_FD,
                    C_RAIL_RECV, C_RAIL_RECV_CAP, C_RAIL_SPIN, C_SLOT_NBYTES, C_TIMEOUT_NS)
from ..transports import MAX_TAG, TcpTransport, tag_for
from ..transports import sockio
from .base import RailAlgorithm, chunks, rail_allreduce, recv_check

__all__ = ["HarLatencyAllreduce", "TWO_NODE_TCP"]

# -- two nodes over the tcp transport: the whole step in one compiled call ----
#
# Same steps, messages and flag rounds as the Python loop below (so a rank
# on either path meets its peers), without ~15 us of Python per call: post
# the exchange (header + x straight from the caller's buffer), stage the
# metas only, complete the exchange (sleeping in poll(2) when there is
# nothing to do), then add + publish + sum.

#: return codes of har2_tcp besides node.OK
H2_NODE_TIMEOUT, H2_LOCAL_MISMATCH, H2_RAIL_TIMEOUT, H2_IO_FAILED = 11, 12, 13, 14
H2_AFTER_TIMEOUT, H2_AFTER_MISMATCH = 15, 16


@numba.njit(cache=True, nogil=True)
def _tag(nbytes, code):
    """transports.tag_for, compiled (int64 wrap-around keeps the low 32 bits exact)."""
    h = (nbytes * 0x9E3779B1 + code * 0x85EBCA77) & 0xFFFFFFFF
    return 1 + h % MAX_TAG


@numba.njit(cache=True, nogil=True)
def _har2_tcp(ctl, ops, pollfds, scratch, x_addr, n, code, fmt, w):
    isz = w.itemsize
    total = n * isz
    tag = _tag(total, code)
    chunk = ctl[C_SLOT_NBYTES] // isz
    fd = ctl[C_RAIL_FD]
    recv_addr = ctl[C_RAIL_RECV]
    start = 0
    while True:
        m = min(chunk, n - start)
        addr = x_addr + start * isz
        sockio.set_recv(ops, 0, fd, recv_addr, ctl[C_RAIL_RECV_CAP])
        sockio.set_send(ops, 1, fd, addr, m * isz, tag)
        if sockio.kick(ops, 2, scratch) != sockio.IO_OK:
            return H2_IO_FAILED
        rc = node.stage_meta(ctl, m, total, code, fmt, w)
        if rc == node.TIMEOUT:
            return H2_NODE_TIMEOUT
        local_bad = rc == node.MISMATCH
        if local_bad:
            ctl[C_ERR2_PEER] = ctl[C_ERR_PEER]
            ctl[C_ERR2_A] = ctl[C_ERR_A]
            ctl[C_ERR2_B] = ctl[C_ERR_B]
        io = sockio.progress(ops, 2, ctl[C_RAIL_SPIN], ctl[C_TIMEOUT_NS], pollfds, scratch,
                             node.hook_addr(ctl))
        if io == sockio.IO_TIMEOUT:
            return H2_RAIL_TIMEOUT
        if io != sockio.IO_OK:
            return H2_IO_FAILED
        rail_bad = ops[0, sockio.OP_HDR_N] != m * isz or ops[0, sockio.OP_HDR_TAG] != tag
        status = 1 if (local_bad or rail_bad) else 0
        rc = node.add_publish_sum(ctl, addr, recv_addr, m, status, fmt, w)
        if local_bad:
            return H2_LOCAL_MISMATCH
        if rc == node.TIMEOUT:
            return H2_AFTER_TIMEOUT
        if rc != node.OK:
            return H2_AFTER_MISMATCH
        start += m
        if start >= n:
            return node.OK


_H2_SIG = types.int64(types.int64[::1], types.int64[:, ::1], types.int32[:, ::1],
                      types.int64[::1], types.intp, types.int64, types.int64, types.int64)


@numba.njit(_H2_SIG, cache=True, nogil=True)
def _har2_tcp_step(ctl, ops, pollfds, scratch, x_addr, n, code, fmt):
    """_har2_tcp for the storage format ``fmt`` (one compiled entry point)."""
    if fmt == node.FMT_BF16 or fmt == node.FMT_F16:
        return _har2_tcp(ctl, ops, pollfds, scratch, x_addr, n, code, fmt, np.empty(0, np.uint16))
    if fmt == node.FMT_F32:
        return _har2_tcp(ctl, ops, pollfds, scratch, x_addr, n, code, fmt, np.empty(0, np.float32))
    return _har2_tcp(ctl, ops, pollfds, scratch, x_addr, n, code, fmt, np.empty(0, np.float64))


#: the compiled two-node step f(ctl, ops, pollfds, scratch, x_addr, n, code, fmt)
TWO_NODE_TCP = node.entry_point(_har2_tcp_step, _H2_SIG)


class HarLatencyAllreduce(RailAlgorithm):
    name = "har_latency"

    def __init__(self, ctx):
        super().__init__(ctx)
        #: two nodes over tcp: the compiled step (else None: the Python loop)
        self.compiled = None
        if self.G == 2 and isinstance(self.transport, TcpTransport):
            t = self.transport
            ctl = ctx.ctl
            ctl[C_RAIL_FD] = t.fd(1 - self.g)
            ctl[C_RAIL_RECV] = self.recv_addr
            ctl[C_RAIL_RECV_CAP] = self.recv_buf.nbytes
            ctl[C_RAIL_SPIN] = t.spin_count
            self.compiled = TWO_NODE_TCP

    def run(self, call):
        if self.compiled is not None:
            t = self.transport
            rc = self.compiled(self.ctx.ctl, t.ops, t.pollfds, t.scratch, call.addr, call.n,
                               call.code, call.fmt)
            if rc:
                self.raise_for(rc, call)
            return
        ctx = self.ctx
        ctl = ctx.ctl
        isz = call.itemsize
        tag = tag_for(call.nbytes, call.code)
        timeout_s = ctx.config.timeout_s
        for _start, addr, m in chunks(call, ctx.config.slot_nbytes // isz):
            pending = None
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
                                          tag, timeout_s, poisoned=local is not None)
                r_addr = 0
            # add the peer's tensor, flag round, sum: one compiled call
            rc2 = node.add_publish_sum(ctl, addr, r_addr, m, 1 if poisoned else 0, call.fmt,
                                       call.w)
            if local is not None:
                ctx.fail(node.MISMATCH, call, state=local)
            if rc2:
                ctx.fail(rc2, call, after_rail=True)

    def raise_for(self, rc, call):
        """The exception for a failed compiled two-node step."""
        ctx = self.ctx
        t = self.transport
        peer = 1 - self.g
        if rc == H2_NODE_TIMEOUT or rc == H2_AFTER_TIMEOUT:
            ctx.fail(node.TIMEOUT, call)
        if rc == H2_LOCAL_MISMATCH:
            ctl = ctx.ctl
            ctx.fail(node.MISMATCH, call,
                     state=(int(ctl[C_ERR2_PEER]), int(ctl[C_ERR2_A]), int(ctl[C_ERR2_B])))
        if rc == H2_AFTER_MISMATCH:
            ctx.fail(node.MISMATCH, call, after_rail=True)
        if rc == H2_RAIL_TIMEOUT:
            t.raise_timeout(2, 1, (peer, peer), ctx.config.timeout_s, call)
        t.raise_failed((peer, peer), call)
