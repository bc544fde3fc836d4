"""Leader all-reduce: the general hierarchical path for any node shapes.

Used when nodes hold different numbers of ranks (3 ranks as 2+1), where
rails do not span every node. Only local rank 0 of each node (the leader)
talks across nodes; every node has one, so the leaders' rail always spans
all nodes.

Steps (per chunk of at most one slot of m elements):
  1. every rank copies x into its slot, posts (size, kind), publishes, waits
     for the node, checks (on disagreement the node still takes part in
     steps 3-4 with the poison tag, so every node fails, none waits);
  2. the leader sums the L slots in rank order into its own slot;
  3. the leaders all-reduce that node sum across the G nodes (recursive
     doubling in place in the leader's slot);
  4. every rank posts its status, publishes, waits (the leader arrives last);
  5. every rank copies the leader's slot into x.

Invariants: the node sum is computed once, the leaders' recursive doubling
gives every leader the same bits, and everyone copies the leader's slot:
bitwise identical everywhere.

Cost: m bytes * log2 G on the leader's link only (the other ranks' links sit
idle: that is why uniform nodes use har_latency / har_bandwidth instead),
L*m reads on the leader, two flag rounds, one copy-out per rank.
"""

from __future__ import annotations

from .. import node
from ..base.kind import rail_tag
from .base import chunks, rail_allreduce

__all__ = ["LeaderAllreduce"]


class LeaderAllreduce:
    name = "leader"
    needs = "any topology"

    def __init__(self, ctx):
        self.ctx = ctx
        self.G = ctx.topo.node_count
        self.g = ctx.topo.node_index
        self.is_leader = ctx.topo.local_rank == 0
        if self.is_leader and self.G > 1:
            self.transport = ctx.rail_transport()
            self.recv_buf = ctx.rail_recv_buffer()

    def run(self, call):
        ctx = self.ctx
        ctl = ctx.ctl
        tag = rail_tag(call.nbytes, call.code)
        for _start, addr, m in chunks(call, ctx.config.slot_nbytes // call.itemsize):
            local = ctx.stage_or_remember(call, addr, m)
            poisoned = local is not None
            if self.is_leader:
                if not poisoned:
                    node.sum_own_part(ctl, 0, m, call.fmt, call.w)
                if self.G > 1:
                    poisoned = rail_allreduce(self.transport, self.g, self.G,
                                              node.slot_addr(ctl, 0), m, call, self.recv_buf,
                                              tag, ctx.config.timeout_s, poisoned=poisoned,
                                              guard=ctx.guard)
            ctx.settle(call, poisoned, local)
            node.copy_slot(ctl, 0, addr, 0, m, call.w)
