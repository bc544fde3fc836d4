"""The collectives of backend "harmpi": :class:`ProcessGroupHarmpi`, the
``dist.ProcessGroup`` torch uses as the group itself (its state, MPI
channel and lifetime: :class:`harmpi.distributed.channel.GroupChannel`).

What each call does (``t``: a CPU tensor of bf16, f16, f32 or f64):

=========================  ==================================================
all_reduce SUM             harmpi's all-reduce, in place (the hot path: the
                           native entry on the default group, the group's
                           context's compiled entry called directly on
                           the others; nothing is cached per call)
all_reduce AVG             the sum, then divided by the group size (bf16/f16:
                           two roundings)
all_reduce other ops,      every rank's bytes gathered in harmpi, folded in
integer and bool dtypes    rank order with torch's op of the dtype (exact;
                           integers wrap as torch's; never MPI's ops)
all_gather(_single)        harmpi's hierarchical allgather (exact); outputs of
                           uneven sizes along the last dimension: gather_logits'
                           route (harmpi.logits; other dtypes as raw bytes)
all_to_all_single          harmpi's all-to-all (other dtypes as raw bytes)
reduce_scatter(_single)    all-reduce of a copy, then this rank's block (blocks
                           of any size in the list form)
broadcast, scatter         MPI_Bcast / MPI_Scatter of the bytes (exact, any dtype)
barrier                    harmpi's barrier
sparse all_reduce SUM      as gloo: every rank's coalesced indices and values
                           gathered (MPI_Iallgatherv), summed, coalesced
=========================  ==================================================

The rest of what gloo serves on CPU (gather, all_to_all of tensor lists,
point to point, monitored_barrier, other dtypes' gathers; the ones that are
MPI calls of their own are harmpi.distributed.mpicolls') goes
over private duplicates of the group's communicator with MPI's
non-blocking calls, the ranks agreeing on sizes and dtypes first. What
none of these serve raises ``HarmpiArgumentError`` naming what is
supported, before any data moves.

Deadlines. Every wait is bounded: the ``timeout=`` given to
``init_process_group`` or ``new_group`` (as gloo honours it), else
HARMPI_TIMEOUT_S (torch passes its 30-minute default when none is given,
and that value means "not given" here). The MPI rendezvous and a group's
creation (the members meet on the group's store before
MPI_Comm_create_group) are bounded by the same deadline.

Async. ``async_op=True`` all-reduce (SUM or AVG) is split in two compiled
halves where the context's default all-reduce has them (Context.split): on
one node (harmpi.node.one_node_start / one_node_finish) the call copies
this rank's tensor into its slot, publishes it and returns; on two nodes
over tcp up to har_latency_max (har_latency.har2_start / har2_finish) it
also posts the rail exchange, so the network carries the tensor while the
caller computes. ``wait()`` (or ``get_future()``) waits for the peers and
sums. The peers need nothing more from this rank in between, so the
caller's compute overlaps every rank's arrival and the exchange. A group holds at most one started
collective: any later call on the group completes it first, in order, as
MPI orders collectives on one communicator. Other async calls complete
before they return (their work object is already done). While a torch
group's all-reduce is started, ``harmpi.allreduce`` on the same
communicator is refused with a clear error; ``wait()`` first.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from .. import api
from ..base.kind import COLL_ALLGATHER, COLL_ALLREDUCE, COLL_ALLTOALL
from ..errors import HarmpiArgumentError, HarmpiError, HarmpiMismatchError
from ..runtime.context import AUTO_CODE
from ..runtime.registry import STATE
from ..runtime.torchbuf import describe
from .mpicolls import MpiCollectives
from .tables import (
    AVG,
    CALLS,
    DTYPE_BY_CODE,
    FLOATS,
    RED,
    STRIDED,
    SUM,
    SYNC_SUM,
    dtype_code,
    fold_of,
    op_name,
    reduce_opts,
)
from .tensors import (
    RowUnits,
    as_units,
    bytes_of,
    columns,
    contiguous_cpu,
    cpu_tensor,
    float_tensor,
    is_async,
    last_units,
    mpi_buffer,
    one_tensor,
    split_bytes,
)
from .work import DONE, DoneWork, SplitWork

__all__ = ["ProcessGroupHarmpi"]


class ProcessGroupHarmpi(MpiCollectives):
    """One torch process group over one MPI communicator (see the module docstring)."""

    # -- all-reduce --------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        # the hot path, dist.all_reduce(t) as a synchronous SUM: as few
        # Python steps as possible before the context's compiled entry
        if self._pending is None:
            native = self._native_sum
            if native is not None:
                # the default group: C++ reads opts and runs the world entry
                # (harmpi/_native.cpp; -1 when no world context is served or
                # the tensor is not one it takes, -2 for anything but a
                # synchronous SUM): reading opts.reduceOp from Python alone
                # costs ~0.35 us
                rc = native(tensors, SYNC_SUM if opts is None else opts)
                if rc == 0:
                    return DONE
                if rc > 0:
                    api.native_failed(tensors[0], rc)
            elif len(tensors) == 1 and (opts is None or (not is_async(opts)
                                                         and opts.reduceOp == SUM)):
                # any other group: its context's entry, called here
                t = tensors[0]
                if t.dtype in FLOATS and t.is_cpu and t.layout is STRIDED:
                    self._sum(t)
                    return DONE
        else:
            self._settle()
        return self._allreduce(tensors, opts)

    def _allreduce(self, tensors, opts):
        """all_reduce past the hot path: a pending collective settled, or a
        call the hot path does not take (async, sparse, another op or dtype)."""
        if len(tensors) != 1:
            self._one_tensor(tensors, "all_reduce", COLL_ALLREDUCE)
        t = tensors[0]
        if opts is None:
            opts = SYNC_SUM
        if t.layout != STRIDED:
            return self._allreduce_sparse(t, opts)
        if is_async(opts):
            return self._allreduce_async(t, opts)
        if opts.reduceOp == SUM:
            native = STATE.native
            if native is not None and self._default:
                rc = native(t)
                if rc == 0:
                    return DONE
                if rc > 0:
                    api.native_failed(t, rc)
            if t.dtype in FLOATS and t.device.type == "cpu":
                api.allreduce(t, comm=self._harmpi_comm)
                return DONE
        return self._allreduce_other(t, opts.reduceOp, False)

    def _sum(self, t):
        """harmpi's all-reduce of the float CPU tensor ``t`` on this group's
        context: what harmpi.allreduce(t, comm=...) does on its Python path
        (the same checks and errors, the same entry), without looking the
        context up again. A context that broke or was freed since the group
        was made leaves the call to harmpi.allreduce, which raises (or, for
        the world after harmpi.finalize(), makes a new context)."""
        ctx = self._ctx
        if ctx.broken is not None:
            api.allreduce(t, comm=self._harmpi_comm)
            return
        addr, n, fmt = describe(t, True)
        try:
            rc = ctx.entry(ctx.ctl, addr, n, fmt)
            if rc:
                ctx.raise_status(rc, addr, n, fmt, AUTO_CODE | fmt, "allreduce")
        except KeyboardInterrupt:
            ctx.interrupted()
            raise

    def _allreduce_async(self, t, opts):
        op = opts.reduceOp
        split = self._split
        if split is not None and (op == SUM or op == AVG) and t.dtype in FLOATS \
                and t.numel() * t.element_size() <= split[2]:
            return self._start(t, None if op == SUM else self.size())
        if op == SUM and t.dtype in FLOATS and t.device.type == "cpu":
            api.allreduce(t, comm=self._harmpi_comm)
            return DoneWork([t])
        return self._allreduce_other(t, op, True)

    def _allreduce_other(self, t, op, async_op):
        """all_reduce beyond harmpi's sums: exact, the same bits on every rank."""
        kind = op.op if isinstance(op, dist.ReduceOp) else op
        try:
            if t.device.type != "cpu":
                raise HarmpiArgumentError(f"harmpi backend: all_reduce: tensor is on "
                                          f"{t.device}; harmpi works on CPU tensors")
            if kind == RED.PREMUL_SUM:
                raise HarmpiArgumentError("harmpi backend: all_reduce with PREMUL_SUM is not "
                                          "supported (gloo lacks it too); scale, then SUM")
            average = kind == RED.AVG and t.dtype in FLOATS
            fold = None if average else fold_of(t.dtype, kind)
            if fold is None and not average:
                raise HarmpiArgumentError(
                    f"harmpi backend: all_reduce with {op_name(kind)} of {t.dtype} is not "
                    "supported; integer and bool tensors take SUM, PRODUCT, MIN, MAX, BAND, "
                    "BOR and BXOR, floats SUM, AVG, PRODUCT, MIN and MAX")
        except HarmpiArgumentError as exc:
            self._refuse(COLL_ALLREDUCE, exc)
        if average:
            api.allreduce(t, comm=self._harmpi_comm)
            t.div_(self.size())
            return DoneWork([t]) if async_op else DONE
        self._fold(t, kind, fold)
        return DoneWork([t]) if async_op else DONE

    def _fold(self, t, kind, fold):
        """all_reduce by gathering: every rank's bytes, behind a header of
        (call, dtype, op, elements), through harmpi's allgather on this
        group's context, then folded with ``fold`` in rank order, so every
        rank computes the same bits (and integers wrap as torch's do). Going
        through harmpi's context, a rank that calls this while a peer sums
        floats there fails at once on both (the collectives' kind words
        differ), where an MPI reduction would wait for the deadline."""
        n, nbytes = self.size(), t.numel() * t.element_size()
        header = torch.tensor([CALLS["all_reduce"], dtype_code(t.dtype), int(kind), t.numel()],
                              dtype=torch.int64)
        try:
            gathered = api.allgather(as_units(header.view(torch.uint8), t),
                                     comm=self._harmpi_comm)
        except HarmpiMismatchError as exc:
            raise HarmpiMismatchError(
                f"{exc} (harmpi backend all_reduce {op_name(kind)} of {t.numel()} elements of "
                f"{t.dtype} on {self._who()}: harmpi gathers them as {nbytes} raw bytes behind a "
                "32-byte header, the 'bf16' units above; a peer that differs there passed "
                "another size or dtype, or called another collective)",
                culprit=exc.culprit) from exc
        rows = gathered.view(n, -1).view(torch.uint8)
        headers = columns(rows, 0, header.nbytes, torch.int64)
        if not torch.equal(headers, header.expand(n, -1)):
            raise HarmpiMismatchError(
                f"{self._who()}: harmpi backend all_reduce: ranks disagree: "
                + "; ".join(self._describe_fold(r, headers[r]) for r in range(n)
                            if r == 0 or not torch.equal(headers[r], headers[0]))
                + ". Every rank must pass a tensor of the same size and dtype, with the same "
                "op; no rank's tensor was written.")
        if not nbytes:
            return
        parts = columns(rows, header.nbytes, header.nbytes + nbytes, t.dtype)
        acc = parts[0]
        for r in range(1, n):
            acc = fold(acc, parts[r])
        t.copy_(acc.view(t.shape))

    def _describe_fold(self, r, header):
        _, code, kind, count = (int(v) for v in header)
        dtype = DTYPE_BY_CODE.get(code, f"dtype #{code}")
        return f"world rank {self._world_rank(r)} passes {count} elements of {dtype} " \
               f"({op_name(RED(kind)) if 0 <= kind < 16 else kind})"

    def _start(self, t, scale):
        """First half of an async all-reduce on one node (module docstring)."""
        addr, n, fmt = describe(float_tensor(t, "all_reduce"), True)
        ctx = self._ctx
        if ctx.broken is not None:
            raise HarmpiError(f"harmpi context is unusable: {ctx.broken}")
        start, finish, _ = self._split
        rc = start(ctx.ctl, addr, n, fmt)
        if rc:
            ctx.raise_status(rc, addr, n, fmt, AUTO_CODE | fmt, "allreduce (async)")
        work = SplitWork(self, finish, t, addr, n, fmt, scale)
        self._pending = work
        ctx.split_pending = work
        return work

    def allreduce_coalesced(self, tensors, opts=None):
        """One all_reduce per tensor, in order (any op and dtype all_reduce takes)."""
        self._settle()
        for t in tensors:
            self.allreduce([t], reduce_opts(opts))
        return DoneWork(tensors)

    # -- gathers -------------------------------------------------------------------

    def allgather(self, output_lists, input_tensors, opts=None):
        self._settle()
        outs = self._one_tensor(output_lists, "all_gather", COLL_ALLGATHER)
        t = self._one_tensor(input_tensors, "all_gather", COLL_ALLGATHER)
        if len(outs) != self.size():
            self._refuse(COLL_ALLGATHER, HarmpiArgumentError(
                f"harmpi backend: all_gather needs {self.size()} output tensors, got "
                f"{len(outs)}"))
        if any(o.shape != t.shape for o in outs):
            return self._gather_uneven(t, outs)
        if t.dtype in FLOATS:
            gathered = api.allgather(t.contiguous(), comm=self._harmpi_comm)
            for o, part in zip(outs, gathered.view(self.size(), *t.shape)):
                o.copy_(part)
            return DoneWork(output_lists)
        cpu_tensor(t, "all_gather")
        gathered = torch.empty((self.size(),) + tuple(t.shape), dtype=t.dtype)
        self._agree("all_gather", t.dtype, t.numel() * t.element_size())
        req = self._mpi.Iallgather(bytes_of(t.contiguous()), bytes_of(gathered))

        def finish(_statuses):
            for o, part in zip(outs, gathered):
                o.copy_(part)

        return self._run([req], finish, output_lists, "all_gather", is_async(opts))

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        """all_gather of each input in turn: output_lists[r][k] gets rank r's input k."""
        self._settle()
        if len(output_lists) != self.size() or \
                any(len(outs) != len(input_tensors) for outs in output_lists):
            raise HarmpiArgumentError(
                f"harmpi backend: all_gather_coalesced needs {self.size()} output lists of "
                f"{len(input_tensors)} tensors")
        for k, t in enumerate(input_tensors):
            self.allgather([[outs[k] for outs in output_lists]], [t])
        return DoneWork(output_lists)

    def _gather_uneven(self, t, outs):
        """all_gather of shards whose last dimension differs between ranks:
        harmpi.logits.gather_uneven; other dtypes than harmpi's floats as
        the raw bytes of that dimension, in 16-bit units (tensors.last_units)."""
        from .. import logits  # noqa: PLC0415 - only for uneven vocabulary shards

        if t.dtype in FLOATS:
            logits.gather_uneven(t, outs, self._harmpi_comm)
            return DoneWork([outs])
        for q, o in enumerate(outs):
            if o.dtype != t.dtype or o.dim() != t.dim() or o.dim() == 0:
                raise HarmpiArgumentError(
                    f"harmpi backend: all_gather: output {q} is {o.dtype} of shape "
                    f"{tuple(o.shape)}, the input {t.dtype} of shape {tuple(t.shape)}; outputs "
                    "that differ from the input in size must have its dtype and differ in the "
                    "last dimension only")
        scratch = [last_units(o, False) for o in outs]
        logits.gather_uneven(last_units(t, True), scratch, self._harmpi_comm)
        for o, units in zip(outs, scratch):
            raw = units.view(torch.uint8)[..., :o.shape[-1] * o.element_size()]
            if raw.data_ptr() != o.data_ptr() or not o.is_contiguous():
                o.copy_(raw.contiguous().view(o.dtype))
        return DoneWork([outs])

    def all_gather_single(self, output, input, opts=None):
        self._settle()
        try:
            contiguous_cpu(output, "all_gather_into_tensor")
            if input.numel() * self.size() != output.numel():
                raise HarmpiArgumentError(
                    f"harmpi backend: all_gather_into_tensor: output has {output.numel()} "
                    f"elements, expected {self.size()} x {input.numel()}")
            if input.dtype in FLOATS and output.dtype != input.dtype:
                raise HarmpiArgumentError("harmpi backend: all_gather_into_tensor: output and "
                                          "input dtypes differ")
        except HarmpiArgumentError as exc:
            self._refuse(COLL_ALLGATHER, exc)
        if input.dtype in FLOATS:
            api.allgather(input.contiguous(), comm=self._harmpi_comm, out=output)
            return DoneWork([output])
        cpu_tensor(input, "all_gather_into_tensor")
        if output.dtype != input.dtype:
            raise HarmpiArgumentError("harmpi backend: all_gather_into_tensor: output and "
                                      "input dtypes differ")
        self._agree("all_gather_into_tensor", input.dtype, input.numel() * input.element_size())
        req = self._mpi.Iallgather(bytes_of(input.contiguous()), bytes_of(output))
        return self._run([req], None, [output], "all_gather_into_tensor", is_async(opts))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self.all_gather_single(o, i, opts)
        return DoneWork(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # -- reduce-scatter ----------------------------------------------------------------

    def reduce_scatter_single(self, output, input, opts=None):
        """Before: rank r holds ``input`` of n x k elements. After: rank r's
        ``output`` (k elements) holds block r of the reduction of every
        rank's input."""
        self._settle()
        what = "reduce_scatter_tensor"
        k = output.numel()
        try:
            cpu_tensor(input, what)
            contiguous_cpu(output, what)
            if input.numel() != k * self.size() or output.dtype != input.dtype:
                raise HarmpiArgumentError(
                    f"harmpi backend: {what}: input must have {self.size()} x {k} elements of "
                    f"the output's dtype (got {input.numel()}, {input.dtype})")
        except HarmpiArgumentError as exc:
            self._refuse(COLL_ALLREDUCE, exc)
        self._reduce_block(output, input.reshape(-1).clone(), self.rank() * k, opts)
        return DoneWork([output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        """Before: rank r holds inputs[0..n-1] (block j's size the same on
        every rank; blocks may differ in size, or be empty). After: rank
        r's output holds the reduction of every rank's inputs[r]."""
        self._settle()
        what = "reduce_scatter"
        out = cpu_tensor(one_tensor(output_tensors, what), what)
        inputs = one_tensor(input_lists, what)
        n, r = self.size(), self.rank()
        if len(inputs) != n:
            raise HarmpiArgumentError(f"harmpi backend: {what} needs {n} input tensors, got "
                                      f"{len(inputs)}")
        for j, x in enumerate(inputs):
            cpu_tensor(x, what)
            if x.dtype != out.dtype:
                raise HarmpiArgumentError(
                    f"harmpi backend: {what}: input {j} is {x.dtype}, the output {out.dtype}; "
                    "every tensor must have one dtype")
        if inputs[r].numel() != out.numel():
            raise HarmpiArgumentError(
                f"harmpi backend: {what}: this rank's output has {out.numel()} elements, its "
                f"block (input {r}) {inputs[r].numel()}; they must be equal")
        # the blocks one after another: block j starts where the ones before end
        offset = sum(x.numel() for x in inputs[:r])
        self._reduce_block(out, torch.cat([x.reshape(-1) for x in inputs]), offset, opts)
        return DoneWork([out])

    def _reduce_block(self, out, full, offset, opts):
        """``out`` = elements offset.. of the all_reduce of ``full`` (1-d, this
        call's own copy; with opts' op): every rank reduces every block and
        keeps its own."""
        self.allreduce([full], reduce_opts(opts))
        out.copy_(full[offset:offset + out.numel()].view(out.shape))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self.reduce_scatter_single(o, i, opts)
        return DoneWork(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- rooted collectives ----------------------------------------------------------------

    def reduce(self, tensors, opts=None):
        """Every rank reduces (harmpi's all-reduce for float sums); the root
        keeps the result, the others' tensors are left as they were."""
        self._settle()
        t = cpu_tensor(one_tensor(tensors, "reduce"), "reduce")
        root = opts.rootRank if opts is not None else 0
        target = t if self.rank() == root else t.clone()
        self.allreduce([target], reduce_opts(opts))
        return DoneWork(tensors)

    # -- all-to-all -----------------------------------------------------------------------

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """One tensor to and from each rank (sizes may differ between pairs)."""
        self._settle()
        n = self.size()
        if len(output_tensors) != n or len(input_tensors) != n:
            raise HarmpiArgumentError(f"harmpi backend: all_to_all needs {n} input and {n} "
                                      f"output tensors, got {len(input_tensors)} and "
                                      f"{len(output_tensors)}")
        dtype = input_tensors[0].dtype if input_tensors else torch.float32
        if any(x.dtype != dtype or x.device.type != "cpu"
               for x in list(input_tensors) + list(output_tensors)):
            raise HarmpiArgumentError("harmpi backend: all_to_all: every tensor must be a CPU "
                                      "tensor of one dtype")
        size = dtype.itemsize
        send_counts = [x.numel() * size for x in input_tensors]
        recv_counts = [x.numel() * size for x in output_tensors]
        sendbuf = torch.cat([x.reshape(-1) for x in input_tensors]) if n else None
        recvbuf = torch.empty(sum(recv_counts) // size, dtype=dtype)

        def finish(_statuses):
            offset = 0
            for o in output_tensors:
                k = o.numel()
                o.copy_(recvbuf[offset:offset + k].view(o.shape))
                offset += k

        return self._alltoallv("all_to_all", sendbuf, recvbuf, send_counts, recv_counts,
                               finish, output_tensors, is_async(opts))

    def _refuse(self, coll, exc):
        """Raise ``exc``: a check of this rank's arguments to a call on the
        group's harmpi context failed before anything moved. The peers may be
        in the call, so they are told first (harmpi.api.refuse) and fail it
        too, at once."""
        api.refuse(self._harmpi_comm, coll, exc)
        raise exc

    def _one_tensor(self, tensors, what, coll):
        """one_tensor(tensors, what), refused as :meth:`_refuse` says."""
        try:
            return one_tensor(tensors, what)
        except HarmpiArgumentError as exc:
            self._refuse(coll, exc)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        """Rows of ``input`` (dim 0) to each rank: split evenly, or by the split sizes."""
        if self._pending is not None:
            self._settle()
        n = self._size
        try:
            cpu_tensor(output, "all_to_all_single")
            cpu_tensor(input, "all_to_all_single")
            if output.dtype != input.dtype:
                raise HarmpiArgumentError("harmpi backend: all_to_all_single: output and input "
                                          "dtypes differ")
            split_bytes(input, input_split_sizes, n, "input")
            split_bytes(output, output_split_sizes, n, "output")
        except HarmpiArgumentError as exc:
            self._refuse(COLL_ALLTOALL, exc)
        src = input.contiguous()
        dst = output if output.is_contiguous() else output.contiguous()
        # every dtype through harmpi's own all-to-all: rows through the
        # node's slots, every pair's count checked against its receiver's
        # split size; other dtypes than harmpi's floats as raw bytes
        # (tensors.RowUnits), so a float on one rank and an int on another
        # fail at once on both (the collectives' kind words differ)
        units = None if input.dtype in FLOATS else RowUnits(src, dst, dtype_code(input.dtype))
        x, out = (src, dst) if units is None else (units.src, units.dst)
        if not input_split_sizes and not output_split_sizes:
            rows = want = None
        else:
            rows = list(input_split_sizes) or [input.size(0) // n] * n
            want = list(output_split_sizes) or [output.size(0) // n] * n
        try:
            if rows is None:
                api.alltoall(x, comm=self._harmpi_comm, out=out)  # even: no count lists
            else:
                api.alltoall(x, rows, comm=self._harmpi_comm, out=out, recv_counts=want)
        except HarmpiMismatchError as exc:
            raise HarmpiMismatchError(
                f"{exc} (harmpi backend all_to_all_single of {input.dtype} on {self._who()}"
                + ("" if rows is None else
                   f": this rank sends {rows} rows and expects {want}, its input and output "
                   "split sizes")
                + "; the backend moves dtypes other than harmpi's floats as raw bytes, the "
                "'bf16' units above)", culprit=exc.culprit) from exc
        if units is not None:
            units.finish()
        if dst is not output:
            output.copy_(dst)
        return DoneWork([output])

    alltoall_base = all_to_all_single

    def _alltoallv(self, what, src, dst, send_counts, recv_counts, finish, result, async_op):
        """Uneven all-to-all: the ranks agree on the call and dtype, then on
        every pair's byte count (what i sends to j is what j expects from i)."""
        n = self.size()
        # (the totals may differ between ranks: the pairs are checked below)
        self._agree(what, src.dtype if src is not None else None)
        mine = np.array(send_counts + recv_counts, np.int64)
        table = np.empty((n, 2 * n), np.int64)
        self._wait([self._mpi.Iallgather(mine, table)], what)
        sent, expected = table[:, :n], table[:, n:]
        if not np.array_equal(sent, expected.T):
            i, j = (int(v) for v in np.argwhere(sent != expected.T)[0])
            raise HarmpiMismatchError(
                f"{self._who()}: harmpi backend {what}: split sizes disagree: world rank "
                f"{self._world_rank(i)} sends {sent[i, j]} bytes to world rank "
                f"{self._world_rank(j)}, which expects {expected[j, i]}; no data moved")
        sdispl = np.concatenate([[0], np.cumsum(send_counts)[:-1]]).astype(np.int64)
        rdispl = np.concatenate([[0], np.cumsum(recv_counts)[:-1]]).astype(np.int64)
        empty = bytearray(0)
        sbuf = mpi_buffer(src) if src is not None else empty
        rbuf = mpi_buffer(dst)
        req = self._mpi.Ialltoallv([sbuf, (send_counts, sdispl.tolist()), MPI.BYTE],
                                   [rbuf, (recv_counts, rdispl.tolist()), MPI.BYTE])
        return self._run([req], finish, result, what, async_op, keep=(src, dst))
