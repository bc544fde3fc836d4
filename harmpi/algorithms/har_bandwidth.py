"""HAR, bandwidth variant: shm reduce-scatter, rail all-reduce of one share, shm allgather.

For large tensors on G nodes of L ranks each (every node the same L).

Steps (per chunk of at most one slot of m elements):
  1. copy x into my slot, post (size, kind), publish, wait for the node, check;
  2. reduce-scatter in the node: local rank l sums share l (1/L of the
     chunk) of every slot into share l of its own slot;
  3. rail all-reduce of that share across the G nodes (recursive doubling,
     in place in the slot), so share l now holds the sum over all G*L ranks;
  4. post my status (did the rail step fail?), publish, wait for the node;
  5. allgather in the node: copy share j of slot j into x, for every j.

Invariants: each share's node sum is computed once per node, then the rail
all-reduce gives every node the same bits (commutative pair sums), then it
is only copied: bitwise identical everywhere. bf16 rounds once in the node
sum and log2 G times on the rail.

Cost: network bytes per rank ~(m/L)*log2 G (the L rails carry disjoint
shares in parallel) instead of m*log2 G; memory traffic ~3m per rank; two
flag rounds. Wins over har_latency once m/L on the wire outweighs the extra
flag round; never on one-rank nodes (m/L = m). harmpi.algorithms.model
prices both (rail latency, bytes per rail and per node link) and auto
switches at its crossover for L and G (har_latency_max_nbytes).
"""

from __future__ import annotations

from .. import node
from ..base.kind import rail_tag
from .base import RailAlgorithm, chunks, rail_allreduce

__all__ = ["HarBandwidthAllreduce"]


class HarBandwidthAllreduce(RailAlgorithm):
    name = "har_bandwidth"

    def run(self, call):
        ctx = self.ctx
        ctl = ctx.ctl
        tag = rail_tag(call.nbytes, call.code)
        for _start, addr, m in chunks(call, ctx.config.slot_nbytes // call.itemsize):
            local = ctx.stage_or_remember(call, addr, m)
            lo, hi = node.part_bounds(m, self.L, self.me, call.itemsize)
            if local is None:
                node.sum_own_part(ctl, lo, hi, call.fmt, call.w)
            share_addr = node.slot_addr(ctl, self.me) + lo * call.itemsize
            poisoned = rail_allreduce(self.transport, self.g, self.G, share_addr, hi - lo, call,
                                      self.recv_buf, tag, ctx.config.timeout_s,
                                      poisoned=local is not None, guard=ctx.guard)
            ctx.settle(call, poisoned, local)
            node.gather_parts(ctl, addr, m, call.w)
