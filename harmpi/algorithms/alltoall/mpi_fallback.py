"""The all-to-all the rails do not serve: a polled MPI_Ialltoallv.

Used when rails do not span every node (nodes of different sizes), and on
more than two nodes where many_nodes_tcp does not run (a node count that
is no power of two, or a rail other than compiled tcp): there a pair that
disagrees would be seen by its two nodes only. Steps, on harmpi's
duplicate of the communicator, every wait polled under the context's
deadline (harmpi.base.topology):
  1. MPI_Iallgather of every rank's record: arrival time, (row bytes,
     kind), the rows it sends each rank and the rows it expects from each;
     a late rank, or any difference in (row bytes, kind), fails every rank
     alike (a refusal shows as row bytes REFUSED_ROW_NBYTES and is named);
     every rank checks every pair against its receiver's expectation, so
     every rank raises for the same first bad pair;
  2. MPI_Ialltoallv of the rows, through private buffers;
  3. copy the received rows into the caller's output.

Invariants: the caller's memory is touched only after every request
completed (a request given up on may still complete later, and must not
write into it then); every rank sees every pair's verdict.

Cost: one small collective (P (2P + 3) words gathered) before the data,
the data once through MPI (plus one copy in, one copy out): no
shared-memory slots. It was three collectives (the records, an
MPI_Ialltoall of the counts, an MPI_Iallgather of the verdicts): 4 virtual
nodes x 1 on the 2-vCPU AMD EPYC, 2-16 KiB, 10-11x MPI_Alltoall's time.
"""

from __future__ import annotations

import time

import numpy as np

from ... import node
from ...base import kind
from .plan import expect, pair_error, recv, send, spread_even_rows

__all__ = ["MpiAlltoall", "REFUSED_ROW_NBYTES"]

#: the row bytes a refusal posts in MpiAlltoall's first exchange (no call has them)
REFUSED_ROW_NBYTES = -1


class MpiAlltoall:
    """Nodes of different sizes, or node counts no rail serves (module
    docstring): a polled
    MPI_Ialltoallv on harmpi's duplicate of the communicator, after a polled
    exchange of (row bytes, kind) and arrival times and one of the counts
    (every rank checks every pair, as on one node). The data moves through
    private buffers: a request given up on may still complete later, and
    must not touch the caller's memory then."""

    name = "mpi_alltoallv"

    def __init__(self, ctx):
        self.ctx = ctx
        sizes = list(ctx.topo.node_sizes)
        why = (f"nodes hold {sizes} ranks (uneven), so rails do not span every node"
               if not ctx.topo.uniform else f"{len(sizes)} nodes, not 2^k over the compiled "
               "tcp rail (a pair that disagrees must fail on every node, which one rail "
               "exchange cannot tell)")
        ctx.log_once(f"alltoall: {why}; using MPI_Ialltoallv on the communicator")

    def _records(self, row_nb, code, sends, wants, label):
        """Step 1: every rank's record ([rank, 3 + 2P] int64: arrival time,
        row bytes, kind, sends, wants), after the arrival check."""
        from mpi4py import MPI  # noqa: PLC0415

        from ...base.topology import HOT_SPIN_S, check_arrivals, wait_polled  # noqa: PLC0415

        ctx = self.ctx
        comm, timeout_s, P = ctx.setup_comm, ctx.config.timeout_s, ctx.topo.size
        mine = np.zeros(3 + 2 * P, np.int64)
        mine[1], mine[2] = row_nb, code
        mine[3:3 + P], mine[3 + P:] = sends, wants
        table = np.zeros((P, 3 + 2 * P), np.int64)
        mine[0] = time.time_ns()
        req = comm.Iallgather([mine, MPI.INT64_T], [table, MPI.INT64_T])
        wait_polled(comm, req, timeout_s, label, (mine, table), HOT_SPIN_S)
        check_arrivals(comm, table[:, 0], timeout_s, label)
        return table

    def refuse(self):
        """This rank refused its own arguments to an all-to-all (harmpi.api.refuse):
        take part in the first exchange of the call its peers may be in, with
        row bytes REFUSED_ROW_NBYTES, so they fail it at once, naming this
        rank. Returns whether every rank refused (the context goes on)."""
        P = self.ctx.topo.size
        code = kind.refusal_code(kind.COLL_ALLTOALL, 0)
        table = self._records(REFUSED_ROW_NBYTES, code, np.zeros(P, np.int64),
                              np.full(P, -1, np.int64),
                              "refused alltoall (MPI_Alltoallv for uneven nodes)")
        return bool(np.all(table[:, 1:3] == table[0, 1:3]))

    def run_sized(self, call, row_nb, plan, out_addr):
        """run() into an output already sized from the counts this rank
        expects (every pair is checked against them first)."""
        self.run(call, row_nb, plan, lambda _total: (None, out_addr))

    def run(self, call, row_nb, plan, make_out):
        from mpi4py import MPI  # noqa: PLC0415

        from ...base.topology import HOT_SPIN_S, wait_polled  # noqa: PLC0415
        from ..base import mismatch_error  # noqa: PLC0415

        ctx = self.ctx
        comm, timeout_s, P = ctx.setup_comm, ctx.config.timeout_s, ctx.topo.size
        me, x_addr, code, what = ctx.topo.rank, call.addr, call.code, call.op
        spread_even_rows(plan, P)
        sends, wants = send(plan, P), expect(plan, P)
        label = f"{what} (MPI_Alltoallv for uneven nodes)"
        table = self._records(row_nb, code, sends, wants, label)
        kinds = table[:, 1:3]
        if np.any(kinds != kinds[0]):
            shown = [tuple(int(v) for v in k) for k in kinds]
            refused = [r for r, k in enumerate(shown) if k[0] == REFUSED_ROW_NBYTES]
            if refused:
                raise mismatch_error(me, what, f"rank {refused[0]} refused its own arguments to "
                                     "this call (its HarmpiArgumentError says why)")
            raise mismatch_error(me, what, f"(row bytes, kind) by rank: {shown}")
        sent = table[:, 3:3 + P]      # [sender, receiver]: rows sent
        wanted = table[:, 3 + P:]     # [receiver, sender]: rows expected (-1: any)
        # every pair checked on every rank, in the same order: the same verdict
        for r in range(P):
            bad_send = [j for j in range(P) if 0 <= wanted[j, r] != sent[r, j]]
            if bad_send:
                raise pair_error(me, what, r, bad_send[0])
            bad_recv = [i for i in range(P) if 0 <= wanted[r, i] != sent[i, r]]
            if bad_recv:
                raise pair_error(me, what, bad_recv[0], r)
        rows_in = sent[:, me].copy()
        sbuf = np.frombuffer(self.ctx.view(x_addr, int(sends.sum()) * row_nb), np.uint8).copy()
        rbuf = np.empty(int(rows_in.sum()) * row_nb, np.uint8)
        sdispl = np.concatenate(([0], np.cumsum(sends)[:-1])) * row_nb
        rdispl = np.concatenate(([0], np.cumsum(rows_in)[:-1])) * row_nb
        req = comm.Ialltoallv([sbuf, (sends * row_nb, sdispl), MPI.BYTE],
                              [rbuf, (rows_in * row_nb, rdispl), MPI.BYTE])
        wait_polled(comm, req, timeout_s, label, (sbuf, rbuf), HOT_SPIN_S)
        recv(plan, P)[:] = rows_in
        out, out_addr = make_out(int(rows_in.sum()))
        node.copy_bytes(out_addr, rbuf.ctypes.data, rbuf.nbytes)
        return out
