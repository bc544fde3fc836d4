"""The collectives of backend "harmpi" that MPI carries: sparse all_reduce,
broadcast, scatter, gather, point to point and the monitored barrier; and
the barrier (harmpi's own, an all-reduce of one float32).

Each goes over the group's private duplicates of its communicator with
MPI's non-blocking calls, the ranks agreeing on sizes and dtypes first
(GroupChannel._agree), every wait under the group's deadline.
:class:`harmpi.distributed.group.ProcessGroupHarmpi` is this class plus
harmpi's own collectives.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from .. import api
from ..errors import HarmpiError, HarmpiMismatchError, HarmpiTimeoutError
from .channel import GroupChannel
from .tables import MONITOR_TAG, RED, op_name
from .tensors import bytes_of, copy_back, cpu_tensor, is_async, one_tensor, user_tag
from .waits import cancel, unfinished, wait_requests
from .work import DoneWork, MpiWork

__all__ = ["MpiCollectives"]


class MpiCollectives(GroupChannel):
    """The MPI-carried collectives of a group (see the module docstring)."""

    # -- all-reduce of sparse tensors ----------------------------------------------------

    def _allreduce_sparse(self, t, opts):
        """A sparse COO SUM, as gloo computes it: every rank's coalesced indices
        and values gathered (MPI_Iallgatherv, under the deadline), summed,
        coalesced; the result replaces ``t`` (the same on every rank)."""
        kind = opts.reduceOp.op if isinstance(opts.reduceOp, dist.ReduceOp) else opts.reduceOp
        problem = None
        if t.layout != torch.sparse_coo:
            problem = f"{t.layout} tensors are not supported (sparse COO ones are, as in gloo)"
        elif kind != RED.SUM:
            problem = f"sparse tensors take SUM only (as in gloo), not {op_name(kind)}"
        elif t.device.type != "cpu":
            problem = f"tensor is on {t.device}; harmpi works on CPU tensors"
        sparse = t.coalesce() if problem is None else None
        sparse_dim = sparse.sparse_dim() if sparse is not None else 0
        what = "all_reduce (sparse)"
        self._agree(what, t.dtype, t.numel() * t.element_size(), sparse_dim * 64 + t.dim(),
                    problem)
        n, shape = self.size(), tuple(t.shape)
        mine = np.array([sparse._nnz(), *shape], np.int64)
        table = np.empty((n, len(mine)), np.int64)
        self._wait([self._mpi.Iallgather(mine, table)], what)
        differ = np.flatnonzero((table[:, 1:] != table[0, 1:]).any(axis=1))
        if differ.size:
            raise HarmpiMismatchError(
                f"{self._who()}: harmpi backend {what}: ranks disagree on the shape: "
                + "; ".join(f"world rank {self._world_rank(r)} passes {tuple(table[r, 1:])}"
                            for r in (0, *differ)) + "; no data moved")
        nnz = table[:, 0]
        dense_shape = shape[sparse_dim:]
        row_bytes = math.prod(dense_shape) * t.element_size()
        indices = torch.empty((int(nnz.sum()), sparse_dim), dtype=torch.int64)
        values = torch.empty((int(nnz.sum()), *dense_shape), dtype=t.dtype)
        reqs = []
        for mine_t, whole, per_row in ((sparse.indices().t().contiguous(), indices, sparse_dim * 8),
                                       (sparse.values().contiguous(), values, row_bytes)):
            counts = (nnz * per_row).tolist()
            displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()
            reqs.append(self._mpi.Iallgatherv(
                bytes_of(mine_t) if mine_t.numel() else bytearray(0),
                [bytes_of(whole) if whole.numel() else bytearray(0), (counts, displs),
                 MPI.BYTE]))
        self._wait(reqs, what)
        total = torch.sparse_coo_tensor(indices.t(), values, shape).coalesce()
        t.copy_(total)
        return DoneWork([t])

    # -- rooted collectives ----------------------------------------------------------------

    def broadcast(self, tensors, opts=None):
        self._settle()
        t = cpu_tensor(one_tensor(tensors, "broadcast"), "broadcast")
        root = opts.rootRank if opts is not None else 0
        self._agree("broadcast", t.dtype, t.numel() * t.element_size(), root)
        buf = t if t.is_contiguous() else t.contiguous()
        req = self._mpi.Ibcast(bytes_of(buf), root=root)
        return self._run([req], copy_back(buf, t), tensors, "broadcast", is_async(opts))

    def scatter(self, output_tensors, input_lists, opts=None):
        self._settle()
        out = cpu_tensor(one_tensor(output_tensors, "scatter"), "scatter")
        root = opts.rootRank if opts is not None else 0
        nbytes = out.numel() * out.element_size()
        send, problem = None, None
        if self.rank() == root:
            inputs = one_tensor(input_lists, "scatter")
            if len(inputs) != self.size() or any(i.numel() != out.numel() or
                                                 i.dtype != out.dtype for i in inputs):
                problem = f"the root needs {self.size()} input tensors of {out.numel()} " \
                          f"elements of {out.dtype}, like its output"
            elif nbytes:
                send = bytes_of(torch.stack([i.reshape(-1) for i in inputs]))
        self._agree("scatter", out.dtype, nbytes, root, problem)
        buf = out if out.is_contiguous() else out.contiguous()
        recv = bytes_of(buf)
        if self.rank() == root and not nbytes:
            send = recv
        req = self._mpi.Iscatter(send, recv, root=root)
        return self._run([req], copy_back(buf, out), output_tensors, "scatter", is_async(opts))

    def gather(self, output_lists, input_tensors, opts=None):
        self._settle()
        t = cpu_tensor(one_tensor(input_tensors, "gather"), "gather")
        root = opts.rootRank if opts is not None else 0
        outs, recv, problem = None, None, None
        if self.rank() == root:
            outs = one_tensor(output_lists, "gather")
            if len(outs) != self.size() or any(o.numel() != t.numel() or o.dtype != t.dtype
                                               for o in outs):
                problem = f"the root needs {self.size()} output tensors of {t.numel()} " \
                          f"elements of {t.dtype}, like its input"
            else:
                whole = torch.empty((self.size(), t.numel()), dtype=t.dtype)
                recv = bytes_of(whole)
        self._agree("gather", t.dtype, t.numel() * t.element_size(), root, problem)
        send = bytes_of(t.contiguous())
        req = self._mpi.Igather(send, recv, root=root)

        def finish(_statuses):
            if outs is not None:
                for o, part in zip(outs, whole):
                    o.copy_(part.view(o.shape))

        return self._run([req], finish, output_lists, "gather", is_async(opts))

    # -- point to point ----------------------------------------------------------------------

    def send(self, tensors, dst, tag=0):
        t = cpu_tensor(one_tensor(tensors, "send"), "send")
        self._check_usable()
        buf = t.contiguous()
        req = self._p2p.Isend(bytes_of(buf), dest=dst, tag=user_tag(tag))
        return MpiWork(self, [req], None, [buf], f"send to group rank {dst} (tag {tag})",
                        peer=dst)

    def recv(self, tensors, src, tag=0):
        return self._recv(tensors, src, tag, f"recv from group rank {src} (tag {tag})")

    def recv_anysource(self, tensors, tag=0):
        return self._recv(tensors, MPI.ANY_SOURCE, tag, f"recv from any rank (tag {tag})")

    def _recv(self, tensors, src, tag, what):
        t = cpu_tensor(one_tensor(tensors, "recv"), "recv")
        self._check_usable()
        buf = t if t.is_contiguous() else t.contiguous()
        nbytes = t.numel() * t.element_size()
        req = self._p2p.Irecv(bytes_of(buf), source=src, tag=user_tag(tag))
        copy = copy_back(buf, t)

        def finish(statuses):
            got = statuses[0].Get_count(MPI.BYTE)
            if got != nbytes:
                raise HarmpiMismatchError(
                    f"{self._who()}: harmpi backend {what}: world rank "
                    f"{self._world_rank(statuses[0].Get_source())} sent {got} bytes, this "
                    f"rank's tensor holds {nbytes}")
            if copy is not None:
                copy(statuses)

        return MpiWork(self, [req], finish, tensors, what,
                        peer=src if src != MPI.ANY_SOURCE else -1, nbytes=nbytes)

    # -- barriers ----------------------------------------------------------------------------

    def barrier(self, opts=None):
        self._settle()
        started = time.monotonic()
        try:
            api.barrier(comm=self._harmpi_comm)
        except HarmpiError as exc:
            # harmpi's barrier is an all-reduce of one float32: its error
            # speaks of one, so say which call it was; "timeout after" (the
            # words torch's callers and its own tests look for) only when
            # this rank did wait that long, not for a failure it met at once
            timeout_s = self._ctx.config.timeout_s
            waited_s = time.monotonic() - started
            timed_out = isinstance(exc, HarmpiTimeoutError) and waited_s >= timeout_s
            raise type(exc)(
                f"{self._who()}: harmpi backend barrier (an all-reduce of one float32): "
                + (f"timeout after {timeout_s:g} s: " if timed_out else
                   f"failed after {waited_s:.3f} s: ") + str(exc),
                culprit=exc.culprit) from exc
        return DoneWork()

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """Gloo's monitored barrier: group rank 0 hears from every rank within
        ``timeout`` (default: the group's deadline) and names the ranks that did
        not come (the first, or all with ``wait_all_ranks``), then releases them.
        The errors say what gloo's say ("Rank 1 failed to pass monitoredBarrier
        in 100 ms", "Rank 0 timed out in monitoredBarrier after 0 ms"), group
        ranks as gloo counts them, world ranks after. (torch's
        dist.monitored_barrier accepts gloo groups only; call this method on the
        group: ``group.monitored_barrier(timedelta, wait_all_ranks)``.)"""
        self._settle()
        self._check_usable()
        timeout_s = timeout.total_seconds() if timeout is not None else self._timeout_s
        ms = round(timeout_s * 1000)
        n, me = self.size(), self.rank()
        token = np.zeros(1, np.int64)
        if me != 0:
            reqs = [self._mpi.Isend(token, dest=0, tag=MONITOR_TAG),
                    self._mpi.Irecv(np.empty(1, np.int64), source=0, tag=MONITOR_TAG)]

            def unreleased(pending):
                if not unfinished(pending):
                    return
                cancel(pending)
                raise HarmpiTimeoutError(
                    f"Rank {me} successfully reached monitoredBarrier, but received errors "
                    f"while waiting for send/recv from rank 0 (harmpi backend, {self._who()}: "
                    f"group rank 0, world rank {self._world_rank(0)}, did not release it "
                    f"within {ms} ms). Please check rank 0 logs for faulty rank.",
                    culprit=self._world_rank(0))

            with self._interruptible("monitored_barrier", reqs, token):
                wait_requests(reqs, timeout_s, unreleased)
            return DoneWork()
        inbox = np.empty((max(n - 1, 1), 1), np.int64)
        reqs = [self._mpi.Irecv(inbox[r - 1], source=r, tag=MONITOR_TAG) for r in range(1, n)]

        def missing(pending):
            late = [i + 1 for i in unfinished(pending)]
            if not late:
                return
            cancel(pending)
            heard = [r for r in range(1, n) if r not in late]
            if timeout_s <= 0:
                raise HarmpiTimeoutError(
                    f"Rank {me} timed out in monitoredBarrier after {ms} ms (harmpi backend, "
                    f"{self._who()}). " + (f"Successfully processed ranks: "
                                           f"{', '.join(map(str, heard))}" if heard else
                                           "No ranks successfully processed in monitoredBarrier."),
                    culprit=self._world_rank(late[0]))
            named = late if wait_all_ranks else late[:1]
            ranks = ", ".join(map(str, named))
            world = ", ".join(str(self._world_rank(r)) for r in named)
            raise HarmpiTimeoutError(
                f"[Rank {me}]: Rank{'s' if len(named) > 1 else ''} {ranks} failed to pass "
                f"monitoredBarrier in {ms} ms (harmpi backend, {self._who()}: world "
                f"rank{'s' if len(named) > 1 else ''} {world})",
                culprit=self._world_rank(late[0]))

        with self._interruptible("monitored_barrier", reqs, inbox):
            wait_requests(reqs, timeout_s, missing)
        sends = [self._mpi.Isend(token, dest=r, tag=MONITOR_TAG) for r in range(1, n)]
        with self._interruptible("monitored_barrier", sends, token):
            wait_requests(sends, timeout_s, lambda pending: self._timed_out(
                pending, "monitored_barrier (releasing the ranks)", None))
        return DoneWork()
