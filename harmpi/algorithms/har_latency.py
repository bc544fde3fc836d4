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
slot (G = 2); two flag rounds; L*m bytes read in the final sum. Network bytes per rank ~m*log2 G: right for small m,
wasteful for large m (see har_bandwidth).
"""

from __future__ import annotations

from .. import node
from ..transports import tag_for
from .base import RailAlgorithm, chunks, rail_allreduce, recv_check

__all__ = ["HarLatencyAllreduce"]


class HarLatencyAllreduce(RailAlgorithm):
    name = "har_latency"

    def run(self, call):
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
