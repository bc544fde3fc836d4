"""HAR, latency variant: one rail exchange of the full tensor, then shm.

The published hierarchical all-reduce for decode-sized tensors (G nodes of
L ranks, every node the same L; rank (g, l) is local rank l of node g).

Steps (per chunk of at most one slot of m elements):
  1. post the rail exchange first: receive from and send x to the rail
     peer (same local rank on the other node) — straight from the caller's
     buffer, no copy;
  2. G = 2: when it completes, my slot = x + received, in one fused pass
     (the "copy into the slot" and the cross-node add are the same pass);
     G > 2: recursive doubling over the rail in place on x (log2 G
     exchanges; ranks beyond the largest power of two fold in first and get
     the result last), then x is copied into my slot;
  3. post (size, kind), publish, wait for the node, check;
  4. every rank sums the L slots in rank order into x.

No root, no relay, no broadcast: each rank's only network step is its own
rail exchange, all rails in parallel.

Invariants: after step 2 the slot of local rank l holds the same bits on
every node (a + b == b + a in IEEE arithmetic, also after rounding to bf16,
and recursive doubling combines identical pairs), so step 4 yields the same
bits everywhere. A bf16 result has rounded log2 G times on the rail and once
in the node sum.

Cost: per rank, log2 G messages of m bytes (1 for two nodes) + one fused
pass over m + one flag round + L*m reads. Network bytes per rank ~m*log2 G:
fine for small m, wasteful for large m (see har_bandwidth).
"""

from __future__ import annotations

from .. import node
from ..transports import tag_for
from .base import rail_allreduce, recv_check

__all__ = ["HarLatencyAllreduce"]


class HarLatencyAllreduce:
    name = "har_latency"
    needs = "every node with the same number of ranks"

    def __init__(self, ctx):
        ctx.require_uniform(self.name)
        self.ctx = ctx
        self.transport = ctx.rail_transport()
        self.G = ctx.topo.node_count
        self.g = ctx.topo.node_index
        self.recv_buf = ctx.rail_recv_buffer()
        self.recv_addr = self.recv_buf.ctypes.data

    def run(self, call):
        ctx = self.ctx
        chunk = ctx.config.slot_nbytes // call.itemsize
        tag = tag_for(call.nbytes, call.code)
        start = 0
        while True:
            m = min(chunk, call.n - start)
            addr = call.addr + start * call.itemsize
            poisoned = False
            if self.G == 2:
                peer = 1 - self.g
                data = ctx.view(addr, m * call.itemsize)
                got, = self.transport.complete(
                    self.transport.post([(peer, data, tag)],
                                        [(peer, self.recv_buf)]),
                    ctx.config.timeout_s, call)
                poisoned = recv_check(got, m * call.itemsize, tag)
                r_addr = 0 if poisoned else self.recv_addr
            else:
                poisoned = rail_allreduce(self.transport, self.g, self.G, addr, m, call,
                                          self.recv_buf, tag, ctx.config.timeout_s)
                r_addr = 0
            code = node.POISON_CODE if poisoned else call.code
            rc = node.stage(ctx.ctl, addr, r_addr, m, call.nbytes, code, call.fmt, call.w)
            if rc:
                ctx.fail(rc, call, rail_poison=poisoned)
            node.sum_slots(ctx.ctl, addr, 0, m, call.fmt, call.w)
            start += m
            if start >= call.n:
                return

