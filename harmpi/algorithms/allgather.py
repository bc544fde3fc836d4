"""Hierarchical allgather: shm gather plus one rail exchange.

Every rank contributes x (same shape everywhere); every rank receives the
concatenation, in communicator rank order, along the first dimension.

Steps (G nodes of L ranks, per chunk of at most slot/G elements of x):
  1. post the rail exchange: receive the chunk of each rail peer (same
     local rank, node g') straight into block g' of my next slot, send my
     chunk to every rail peer from the caller's buffer (G-1 messages each
     way, all in flight at once: one exchange round, not log G);
  2. while that flies, copy my own chunk into block g (my node) of my slot;
  3. complete the exchange, post (size, kind), publish, wait for the node;
  4. every rank copies block g' of slot l' to the output block of the rank
     that is local rank l' of node g', for all (g', l').

Invariants: pure copies, so every rank holds the same bytes. Writing into
the next step's slot before publishing is safe: that slot was last read two
steps ago, and this rank has passed the previous step's wait.

Cost: per rank (G-1) messages of m bytes on its own rail (all rails in
parallel), one copy-in, one flag round, and a copy-out of G*L*m bytes.

Uneven nodes (rails that miss some node) take a polled MPI_Iallgather on
harmpi's duplicate of the communicator instead; that choice is logged once.
"""

from __future__ import annotations

import logging

import numpy as np
from mpi4py import MPI

from .. import node
from ..base import kind
from ..base.control import POISONED
from ..base.kind import rail_tag
from ..base.topology import check_arrivals, gather_records, wait_polled
from .base import Call, chunks, mismatch_error, recv_check

__all__ = ["HierAllgather", "gather_table", "REFUSED_NBYTES"]

#: the bytes a refusal posts in the uneven allgather's first exchange (no call has them)
REFUSED_NBYTES = -1

log = logging.getLogger(__name__)


class HierAllgather:
    name = "hier_allgather"

    def __init__(self, ctx):
        self.ctx = ctx
        topo = ctx.topo
        self.G, self.g, self.L = topo.node_count, topo.node_index, topo.local_size
        self.uniform = topo.uniform
        if not self.uniform:
            ctx.log_once(f"allgather: nodes hold {list(topo.node_sizes)} ranks (uneven), so rails "
                         "do not span every node; using MPI_Iallgather on the communicator")
            return
        self.transport = ctx.rail_transport() if self.G > 1 else None
        self.table = gather_table(ctx)

    def __call__(self, ctl, x_addr, out_addr, n, fmt, digest):
        """The context's allgather entry (same signature as node.GATHER_STEP)."""
        return self.ctx.run_python(self.run, Call(x_addr, n, fmt, kind.encode(
            fmt=fmt, coll=kind.COLL_ALLGATHER, digest=digest), "allgather"), out_addr)

    def run(self, call, out_addr):
        ctx = self.ctx
        isz = call.itemsize
        if not self.uniform:
            self._run_uneven(call, out_addr)
            return
        ctl = ctx.ctl
        G, g = self.G, self.g
        tag = rail_tag(call.nbytes, call.code)
        for start, src, m in chunks(call, max(1, ctx.config.slot_nbytes // G // isz)):
            nb = m * isz
            slot = node.next_slot_addr(ctl, ctx.topo.local_rank)
            pending = None
            if G > 1:
                ctx.guard(call)
                peers = [p for p in range(G) if p != g]
                pending = self.transport.post(
                    [(p, ctx.view(src, nb), tag) for p in peers],
                    # capacity to the end of the slot, so that a peer passing a
                    # larger tensor is caught by count and tag, not truncation
                    [(p, ctx.view(slot + p * nb, ctx.config.slot_nbytes - p * nb))
                     for p in peers])
            node.copy_bytes(slot + g * nb, src, nb)
            poisoned = False
            if pending is not None:
                for got in self.transport.complete(pending, ctx.config.timeout_s, call):
                    poisoned = poisoned or recv_check(got, nb, tag)
            code = kind.POISON if poisoned else call.code
            rc = node.stage(ctl, 0, 0, call.nbytes, code, call.w)
            if rc:
                ctx.fail(POISONED if poisoned else rc, call)
            node.copy_blocks(ctl, out_addr, call.n, start, m, call.w)


    def refuse(self):
        """Uneven nodes: this rank refused its own arguments to an allgather
        (harmpi.api.refuse): take part in the first exchange of the call its
        peers may be in, with REFUSED_NBYTES bytes, so they fail it at once,
        naming this rank. Returns whether every rank refused."""
        ctx = self.ctx
        comm, timeout_s = ctx.setup_comm, ctx.config.timeout_s
        label = "refused allgather (MPI_Allgather for uneven nodes)"
        code = kind.refusal_code(kind.COLL_ALLGATHER, 0)
        stamps, kinds = gather_records(comm, timeout_s, label,
                                       (("call", f"{REFUSED_NBYTES} {code}"),))
        check_arrivals(comm, stamps, timeout_s, label)
        return all(k == kinds[0] for k in kinds)

    def _run_uneven(self, call, out_addr):
        """MPI_Iallgather on harmpi's own duplicate (no user collective can
        meet it), polled under the deadline; before it, a polled exchange
        of (bytes, kind) and arrival times: MPI_Allgather itself cannot tell
        that ranks passed different shapes, and a rank far too late fails
        on every rank (topology.agree). The data moves through private
        buffers: a request given up on may still complete later, and must
        not write into (or read from) the caller's memory then."""
        ctx = self.ctx
        comm, timeout_s = ctx.setup_comm, ctx.config.timeout_s
        what = f"{call} (MPI_Allgather for uneven nodes)"
        stamps, kinds = gather_records(comm, timeout_s, what,
                                       (("call", f"{call.nbytes} {call.code}"),))
        check_arrivals(comm, stamps, timeout_s, what)
        if any(k != kinds[0] for k in kinds):
            shown = [tuple(int(v) for v in k.split("=", 1)[1].split()) for k in kinds]
            refused = [r for r, k in enumerate(shown) if k[0] == REFUSED_NBYTES]
            if refused:
                raise mismatch_error(ctx.topo.rank, call, f"rank {refused[0]} refused its own "
                                     "arguments to this call (its HarmpiArgumentError says why)")
            raise mismatch_error(ctx.topo.rank, call, f"(bytes, kind) by rank: {shown}")
        nbytes, size = call.nbytes, ctx.topo.size
        send = np.frombuffer(ctx.view(call.addr, nbytes), np.uint8).copy()
        recv = np.empty(nbytes * size, np.uint8)
        req = comm.Iallgather([send, MPI.BYTE], [recv, MPI.BYTE])
        wait_polled(comm, req, timeout_s, what, (send, recv))
        node.copy_bytes(out_addr, recv.ctypes.data, recv.nbytes)


def gather_table(ctx):
    """int64[L, G]: communicator rank of local rank l on node g; its address
    goes into the control block (node.copy_blocks reads it there). Uneven
    nodes have no table (None)."""
    topo = ctx.topo
    if not topo.uniform:
        return None
    table = np.array([[topo.node_ranks[g][lr] for g in range(topo.node_count)]
                      for lr in range(topo.local_size)], dtype=np.int64)
    c = ctx.ctl[0]
    c["gather_table"] = table.ctypes.data
    c["gather_nodes"] = topo.node_count
    return table

