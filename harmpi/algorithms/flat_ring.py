"""Flat ring all-reduce over the transport: the topology-blind baseline.

What Gloo and NCCL-style rings do, kept so benchmarks can show what the
hierarchy buys. It ignores shared memory: every hop goes through the
transport, even between ranks of one node.

Steps (N ranks in a ring, per chunk of at most one slot, on a private copy
of the chunk that is copied back at the end; the chunk is cut into N
cache-line-aligned shares):
  1. reduce-scatter, N-1 rounds: in round s rank r sends share (r - s) to
     r+1, receives share (r - s - 1) from r-1 and adds it into its copy;
     afterwards rank r holds the full sum of share (r + 1);
  2. allgather, N-1 rounds: in round s rank r sends share (r + 1 - s) to
     r+1 and receives share (r - s) from r-1 straight into x.

Invariants: each share is summed along one path and then only copied, so
every rank ends with the same bits.

Cost: 2(N-1) serial network rounds of m/N bytes: latency ~2(N-1) message
times, the reason a flat ring loses at decode sizes. A bf16 share rounds
N-1 times on its way round the ring (once per add).

A size or kind mismatch is flagged by tags (see harmpi.transports.base);
a poisoned rank forwards POISON_TAG so every rank raises.
"""

from __future__ import annotations

import numpy as np

from .. import node
from ..base.kind import POISON_TAG, rail_tag
from .base import chunks, mismatch_error, recv_check

__all__ = ["FlatRingAllreduce"]


class FlatRingAllreduce:
    name = "flat_ring"
    needs = "any topology"

    def __init__(self, ctx):
        self.ctx = ctx
        self.transport = ctx.world_transport()
        self.N = ctx.topo.size
        self.r = ctx.topo.rank
        self.recv_buf = ctx.rail_recv_buffer()
        self.recv_addr = self.recv_buf.ctypes.data
        # the ring works on a copy, so a mismatch found mid-ring leaves the
        # caller's tensor untouched
        self.work = np.empty(ctx.config.slot_nbytes, dtype=np.uint8)
        self.work_addr = self.work.ctypes.data

    def run(self, call):
        ctx = self.ctx
        N, r = self.N, self.r
        if N == 1:
            return
        isz = call.itemsize
        tag = rail_tag(call.nbytes, call.code)
        right, left = (r + 1) % N, (r - 1) % N
        timeout_s = ctx.config.timeout_s
        poisoned = False
        for _start, addr, m in chunks(call, ctx.config.slot_nbytes // isz):
            base = self.work_addr
            node.copy_bytes(base, addr, m * isz)
            bounds = [node.part_bounds(m, N, j, isz) for j in range(N)]

            def share(j):
                lo, hi = bounds[j % N]
                return base + lo * isz, hi - lo

            for s in range(N - 1):
                ctx.guard(call)
                s_addr, s_n = share(r - s)
                d_addr, d_n = share(r - s - 1)
                got, = self.transport.complete(self.transport.post(
                    [(right, ctx.view(s_addr, s_n * isz), POISON_TAG if poisoned else tag)],
                    # the whole buffer: a mismatched peer's share must not truncate
                    [(left, self.recv_buf)]), timeout_s, call)
                if recv_check(got, d_n * isz, tag):
                    poisoned = True
                elif not poisoned:
                    node.add_into(d_addr, self.recv_addr, d_n, call.fmt, call.w)
            for s in range(N - 1):
                ctx.guard(call)
                s_addr, s_n = share(r + 1 - s)
                d_addr, d_n = share(r - s)
                got, = self.transport.complete(self.transport.post(
                    [(right, ctx.view(s_addr, s_n * isz), POISON_TAG if poisoned else tag)],
                    # once poisoned, a peer's share may not fit: land it aside
                    [(left, self.recv_buf if poisoned
                      else ctx.view(d_addr, d_n * isz))]), timeout_s, call)
                poisoned = poisoned or recv_check(got, d_n * isz, tag)
            if poisoned:
                # Every rank is poisoned by now: a size or kind mismatch shows
                # in the first round's tags, and the poison tag then travels
                # the whole ring within the first chunk's 2(N-1) rounds.
                raise mismatch_error(r, call, "seen on the flat ring")
            node.copy_bytes(addr, base, m * isz)
