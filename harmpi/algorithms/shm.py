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
invalidation round trip (node.ring_pos).

Cost (L ranks, m bytes): one copy of m, one flag round (~0.1-1 us when ranks
own cores, a scheduler slice when oversubscribed), L*m bytes read and summed
per rank, L^2*m through the node's memory. In harmpi.algorithms.model:
F(L) + copy*m + sum*L*m + bus*L*(1+L)*m. Best where the flag round
dominates: auto switches to shm_rsag where the model's two costs cross,
lower as L grows (~11 KiB at 2 ranks, under 1 KiB at 16 with the built-in
constants).
"""

from __future__ import annotations

from .. import node

__all__ = ["ShmAllreduce"]

class ShmAllreduce:
    """Every rank sums every slot (forced ``shm``; auto runs the same compiled
    loop, node.one_node_step, with the size switch to reduce-scatter)."""

    name = "shm"
    needs = "one node"
    #: steps up to this size sum every slot; larger ones reduce-scatter
    small_max_nbytes = node.NEVER_RSAG

    def __init__(self, ctx):
        self.ctx = ctx

    def run(self, call):
        rc = node.shm_allreduce(self.ctx.ctl, call.addr, call.n, call.code, call.fmt,
                                self.small_max_nbytes, call.w)
        if rc:
            self.ctx.fail(rc, call)
