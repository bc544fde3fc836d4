"""The all-to-all for nodes of different sizes, or more than two: a polled MPI_Ialltoallv.

Used when rails do not span every node (nodes of different sizes), or on
three or more nodes, where a pair that disagrees would be seen by its two
nodes only. Steps, on harmpi's duplicate of the communicator, every wait
polled under the context's deadline (harmpi.base.topology):
  1. gather every rank's (row bytes, kind) and arrival time; any
     difference fails every rank alike (a refusal shows as row bytes
     REFUSED_ROW_NBYTES and is named);
  2. MPI_Ialltoall of (rows I send you, rows I expect from you);
  3. each rank checks the pairs it is an end of, then MPI_Iallgather of
     the first bad pair each rank saw: every rank raises for the same pair;
  4. MPI_Ialltoallv of the rows, through private buffers;
  5. copy the received rows into the caller's output.

Invariants: the caller's memory is touched only after every request
completed (a request given up on may still complete later, and must not
write into it then); every rank sees every pair's verdict.

Cost: three small collectives before the data, the data once through
MPI (plus one copy in, one copy out): no shared-memory slots.
"""

from __future__ import annotations

import numpy as np

from ... import node
from ...base import kind
from .plan import expect, pair_error, recv, send, spread_even_rows

__all__ = ["MpiAlltoall", "REFUSED_ROW_NBYTES"]

#: the row bytes a refusal posts in MpiAlltoall's first exchange (no call has them)
REFUSED_ROW_NBYTES = -1


class MpiAlltoall:
    """Nodes of different sizes (rails do not span every node): a polled
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
               if not ctx.topo.uniform else f"{len(sizes)} nodes (a pair that disagrees must "
               "fail on every node, which one rail exchange cannot tell)")
        ctx.log_once(f"alltoall: {why}; using MPI_Ialltoallv on the communicator")

    def refuse(self):
        """This rank refused its own arguments to an all-to-all (harmpi.api.refuse):
        take part in the first exchange of the call its peers may be in, with
        row bytes REFUSED_ROW_NBYTES, so they fail it at once, naming this
        rank. Returns whether every rank refused (the context goes on)."""
        from ...base.topology import check_arrivals, gather_records  # noqa: PLC0415

        ctx = self.ctx
        comm, timeout_s = ctx.setup_comm, ctx.config.timeout_s
        label = "refused alltoall (MPI_Alltoallv for uneven nodes)"
        code = kind.refusal_code(kind.COLL_ALLTOALL, 0)
        stamps, kinds = gather_records(comm, timeout_s, label,
                                       (("call", f"{REFUSED_ROW_NBYTES} {code}"),))
        check_arrivals(comm, stamps, timeout_s, label)
        return all(k == kinds[0] for k in kinds)

    def run(self, call, row_nb, plan, make_out):
        from mpi4py import MPI  # noqa: PLC0415

        from ...base.topology import check_arrivals, gather_records, wait_polled  # noqa: PLC0415
        from ..base import mismatch_error  # noqa: PLC0415

        ctx = self.ctx
        comm, timeout_s, P = ctx.setup_comm, ctx.config.timeout_s, ctx.topo.size
        me, x_addr, code, what = ctx.topo.rank, call.addr, call.code, call.op
        spread_even_rows(plan, P)
        sends, wants = send(plan, P), expect(plan, P)
        label = f"{what} (MPI_Alltoallv for uneven nodes)"
        stamps, kinds = gather_records(comm, timeout_s, label, (("call", f"{row_nb} {code}"),))
        check_arrivals(comm, stamps, timeout_s, label)
        if any(k != kinds[0] for k in kinds):
            shown = [tuple(int(v) for v in k.split("=", 1)[1].split()) for k in kinds]
            refused = [r for r, k in enumerate(shown) if k[0] == REFUSED_ROW_NBYTES]
            if refused:
                raise mismatch_error(me, what, f"rank {refused[0]} refused its own arguments to "
                                     "this call (its HarmpiArgumentError says why)")
            raise mismatch_error(me, what, f"(row bytes, kind) by rank: {shown}")
        pairs = np.ascontiguousarray(np.stack([sends, wants], axis=1))  # [dest, 2]
        got = np.empty_like(pairs)  # [src, 2]: (rows src sends me, rows src expects from me)
        req = comm.Ialltoall([pairs, MPI.INT64_T], [got, MPI.INT64_T])
        wait_polled(comm, req, timeout_s, label, (pairs, got))
        rows_in = got[:, 0].copy()
        # a pair is checked at both ends: my sends against the receivers' wishes,
        # what I receive against mine, then every rank learns of any bad pair
        bad_send = [j for j in range(P) if got[j, 1] >= 0 and got[j, 1] != sends[j]]
        bad_recv = [i for i in range(P) if wants[i] >= 0 and wants[i] != rows_in[i]]
        mine_bad = np.array([bad_send[0] if bad_send else -1,
                             bad_recv[0] if bad_recv else -1], np.int64)
        every = np.empty((P, 2), np.int64)
        req = comm.Iallgather([mine_bad, MPI.INT64_T], [every, MPI.INT64_T])
        wait_polled(comm, req, timeout_s, label, (mine_bad, every))
        for r in range(P):
            if every[r, 0] >= 0:
                raise pair_error(me, what, r, int(every[r, 0]))
            if every[r, 1] >= 0:
                raise pair_error(me, what, int(every[r, 1]), r)
        sbuf = np.frombuffer(self.ctx.view(x_addr, int(sends.sum()) * row_nb), np.uint8).copy()
        rbuf = np.empty(int(rows_in.sum()) * row_nb, np.uint8)
        sdispl = np.concatenate(([0], np.cumsum(sends)[:-1])) * row_nb
        rdispl = np.concatenate(([0], np.cumsum(rows_in)[:-1])) * row_nb
        req = comm.Ialltoallv([sbuf, (sends * row_nb, sdispl), MPI.BYTE],
                              [rbuf, (rows_in * row_nb, rdispl), MPI.BYTE])
        wait_polled(comm, req, timeout_s, label, (sbuf, rbuf))
        recv(plan, P)[:] = rows_in
        out, out_addr = make_out(int(rows_in.sum()))
        node.copy_bytes(out_addr, rbuf.ctypes.data, rbuf.nbytes)
        return out


