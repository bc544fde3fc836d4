"""Single-node all-reduce, small messages: every rank sums every slot.

Steps (per chunk of at most one slot; see harmpi.node for the protocol):
  1. copy x into my slot of this step's parity at the ring position (just
     past the previous small step's bytes, wrapping at the slot's end), post
     (size, kind, position), publish;
  2. wait until every local rank has published this step; check that sizes,
     kinds and positions agree;
  3. sum the L slots (at that position) in rank order into x.

Invariants: all ranks read the same L inputs in the same order with the same
kernel, so outputs are bitwise identical; no trailing barrier (slots are
double-buffered by step parity). Every rank holds the same ring position: all
advance it by the same step sizes, and a mismatch, which every rank detects
in the same step, sends all back to 0. The ring exists for speed only: a line
written again soon after another core read it costs the writer an
invalidation round trip (node._ring_pos).

Cost (L ranks, m bytes): one copy of m, one flag round (~0.1-1 us when ranks
own cores, a scheduler slice when oversubscribed), L*m bytes read for the
sum. Best up to ~64 KiB, where the flag round dominates; beyond that the
L*m reads lose to reduce-scatter + allgather (shm_rsag).
"""

from __future__ import annotations

from .. import node

__all__ = ["ShmAllreduce"]

#: threshold meaning "never switch to reduce-scatter inside the kernel"
ALWAYS = 1 << 62


class ShmAllreduce:
    """Every rank sums every slot; ``small_max_nbytes`` lets the same compiled
    loop switch to reduce-scatter + allgather for large steps (used by auto)."""

    name = "shm"
    needs = "one node"

    def __init__(self, ctx):
        self.ctx = ctx
        self.small_max_nbytes = ALWAYS

    def run(self, call):
        rc = node.shm_allreduce(self.ctx.ctl, call.addr, call.n, call.code, call.fmt,
                                self.small_max_nbytes // call.itemsize, call.w)
        if rc:
            self.ctx.fail(rc, call)
