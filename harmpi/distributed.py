"""torch.distributed backend "harmpi": existing torch code runs on harmpi with one word changed.

    import harmpi                                   # registers the backend
    import torch.distributed as dist
    dist.init_process_group("harmpi")               # under mpirun: no MASTER_ADDR needed
    dist.all_reduce(t)                              # harmpi's all-reduce

How it plugs in. torch lets a backend be a ``dist.ProcessGroup`` subclass
written in Python: the creator given to ``dist.Backend.register_backend``
returns :class:`ProcessGroupHarmpi`, and torch uses it as the group itself.
torch's Python collectives (``dist.all_reduce``...) call its methods
directly; its C++ side (functional collectives, DTensor) reaches the same
methods through torch's trampoline class. Each group is one MPI
communicator and one harmpi context: the default group is MPI.COMM_WORLD
(shared with ``harmpi.allreduce``, so the two may be mixed in program
order), a ``new_group`` gets a communicator of its own ranks (a TP group
inside a larger world, a group spanning virtual nodes).

Rank and world size come from MPI. Under an MPI launcher without
MASTER_ADDR, ``init_process_group`` (any backend) rendezvouses over MPI:
rank 0 starts a TCPStore on a free port and broadcasts its address, so
gloo groups can be made beside harmpi ones in the same job. A rank or
world size given by the caller (or by RANK/WORLD_SIZE) must match MPI's.

What each call does (``t``: a CPU tensor of bf16, f16, f32 or f64):

=========================  ==================================================
all_reduce SUM             harmpi's all-reduce, in place (the hot path: the
                           native entry on the default group)
all_reduce AVG             the sum, then divided by the group size (bf16/f16:
                           two roundings)
all_reduce MAX / MIN       allgather, then max/min over ranks (exact)
all_gather(_single)        harmpi's hierarchical allgather (exact); outputs of
                           uneven sizes along the last dimension: gather_logits'
                           route (harmpi.logits)
reduce_scatter_single      all-reduce of a copy, then this rank's block
broadcast, scatter         MPI_Bcast / MPI_Scatter of the bytes (exact, any dtype)
barrier                    harmpi's barrier
=========================  ==================================================

Every other op, dtype or reduction raises ``HarmpiArgumentError`` naming
what is supported, before any data moves.

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

Versions: written against torch 2.13's ``ProcessGroup`` Python API and
checked there; the creator refuses torch older than 2.6 with a clear
error (``MIN_TORCH``).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from urllib.parse import parse_qs, urlparse

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.futures import Future

from . import api
from .context import AUTO_CODE
from .errors import HarmpiArgumentError, HarmpiError
from .registry import STATE

__all__ = ["BACKEND", "MIN_TORCH", "ProcessGroupHarmpi", "register"]

log = logging.getLogger("harmpi")

BACKEND = "harmpi"
#: oldest torch whose ProcessGroup Python API this module relies on
MIN_TORCH = (2, 6)

_WORLD = MPI.COMM_WORLD
_FLOATS = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32",
           torch.float64: "f64"}
_RED = dist.ReduceOp.RedOpType
_SUPPORTED_OPS = "SUM, AVG, MAX and MIN"
_SUM = dist.ReduceOp.SUM
_AVG = dist.ReduceOp.AVG
_SYNC_SUM = dist.AllreduceOptions()
_SYNC_SUM.asyncOp = False


def _torch_version():
    parts = torch.__version__.split("+")[0].split(".")
    return tuple(int(p) if p.isdigit() else 0 for p in parts[:2])


# -- work objects -------------------------------------------------------------

class _DoneWork(dist._Work):
    """A collective that completed before its call returned."""

    def __init__(self, result=None):
        super().__init__()
        self._result = result

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def result(self):
        return self._result

    def get_future(self):
        fut = Future()
        fut.set_result(self._result)
        return fut


#: what a synchronous call returns (dist.all_reduce only waits on it)
_DONE = _DoneWork()


class _SplitWork(dist._Work):
    """A started split-phase all-reduce; wait() completes it (once)."""

    def __init__(self, pg, finish, tensor, addr, n, fmt, scale):
        super().__init__()
        self._pg = pg
        self._finish = finish
        self._tensor = tensor      # keeps the memory alive until the finish
        self._args = (addr, n, fmt)
        self._scale = scale
        self._error = None
        self._done = False

    def _complete(self):
        if self._done:
            if self._error is not None:
                raise self._error
            return
        self._done = True
        pg = self._pg
        if pg._pending is self:
            pg._pending = None
        ctx = pg._ctx
        ctx.split_pending = None
        addr, n, fmt = self._args
        rc = self._finish(ctx.ctl, addr, n, fmt)
        if rc:
            try:
                ctx.raise_status(rc, addr, n, fmt, AUTO_CODE | fmt, "allreduce (async)")
            except HarmpiError as exc:
                self._error = exc
                raise
        if self._scale is not None:
            self._tensor.div_(self._scale)

    def wait(self, timeout=None):
        self._complete()
        return True

    def is_completed(self):
        return self._done

    def is_success(self):
        return self._done and self._error is None

    def exception(self):
        return self._error

    def result(self):
        return [self._tensor]

    def get_future(self):
        # the second half runs in the caller's thread: completing the
        # future means finishing the collective
        self._complete()
        fut = Future()
        fut.set_result([self._tensor])
        return fut


# -- the process group ----------------------------------------------------------

def _one(tensors, what):
    if len(tensors) != 1:
        raise HarmpiArgumentError(
            f"harmpi backend: {what} takes one tensor per rank (got {len(tensors)}); "
            "harmpi serves one CPU device per process")
    return tensors[0]


def _float_tensor(t, what):
    if t.dtype not in _FLOATS:
        raise HarmpiArgumentError(
            f"harmpi backend: {what} of {t.dtype} is not supported; it reduces and gathers "
            "torch.bfloat16, float16, float32 and float64 (use a gloo group, "
            "dist.new_group(backend='gloo'), for other dtypes)")
    if t.device.type != "cpu":
        raise HarmpiArgumentError(f"harmpi backend: {what}: tensor is on {t.device}; harmpi "
                                  "works on CPU tensors")
    return t


def _contiguous_cpu(t, what):
    if t.device.type != "cpu":
        raise HarmpiArgumentError(f"harmpi backend: {what}: tensor is on {t.device}; harmpi "
                                  "works on CPU tensors")
    if not t.is_contiguous():
        raise HarmpiArgumentError(f"harmpi backend: {what}: tensor of shape {tuple(t.shape)} is "
                                  "not contiguous")
    return t


def _bytes_of(t):
    """The tensor's memory as a writable numpy byte view (any dtype, no copy)."""
    return t.view(-1).view(torch.uint8).numpy() if t.numel() else bytearray(0)


class ProcessGroupHarmpi(dist.ProcessGroup):
    """One torch process group over one MPI communicator (see the module docstring)."""

    def __init__(self, comm, rank, size):
        super().__init__(rank, size)
        self._comm = comm
        self._default = comm is _WORLD
        #: what harmpi's API takes as this group's communicator
        self._harmpi_comm = None if self._default else comm
        self._ctx = STATE.get(self._harmpi_comm)
        self._pending = None
        self._group_name = ""
        self._group_desc = ""
        #: (start, finish, max bytes) of the context's split-phase all-reduce, or None
        self._split = self._ctx.split
        #: harmpi._C.allreduce_sum on the default group, when the native part is built
        self._native_sum = _native_sum() if self._default else None

    # -- identity ------------------------------------------------------------

    def getBackendName(self):
        return BACKEND

    @property
    def comm(self):
        """The MPI communicator of this group."""
        return self._comm

    def _set_group_name(self, name):
        self._group_name = name

    def getGroupName(self):
        return self._group_name

    @property
    def group_name(self):
        return self._group_name

    def _set_group_desc(self, desc):
        self._group_desc = desc

    def getGroupDesc(self):
        return self._group_desc

    @property
    def group_desc(self):
        return self._group_desc

    def __repr__(self):
        return f"ProcessGroupHarmpi(rank={self.rank()}, size={self.size()}, " \
               f"name={self._group_name!r})"

    # -- helpers ---------------------------------------------------------------

    def _settle(self):
        """Complete a started collective before anything else runs on this group."""
        work = self._pending
        if work is not None:
            work.wait()

    # -- all-reduce --------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        # the hot path (dist.all_reduce(t) on the default group): as few
        # attribute reads as possible, then the native entry (~0.1 us)
        if self._native_sum is not None and STATE.native is not None \
                and self._pending is None:
            # C++ reads opts and runs the world entry (harmpi/_native.cpp):
            # reading opts.reduceOp from Python alone costs ~0.35 us
            rc = self._native_sum(tensors, _SYNC_SUM if opts is None else opts)
            if rc == 0:
                return _DONE
            if rc > 0:
                api._native_failed(tensors[0], rc)
        if self._pending is not None:
            self._settle()
        if len(tensors) != 1:
            _one(tensors, "all_reduce")
        t = tensors[0]
        if opts is None:
            opts = _SYNC_SUM
        if opts.asyncOp:
            return self._allreduce_async(t, opts)
        if opts.reduceOp == _SUM:
            native = STATE.native
            if native is not None and self._default:
                rc = native(t)
                if rc == 0:
                    return _DONE
                if rc > 0:
                    api._native_failed(t, rc)
            api.allreduce(_float_tensor(t, "all_reduce"), comm=self._harmpi_comm)
            return _DONE
        return self._allreduce_other(t, opts.reduceOp, False)

    def _allreduce_async(self, t, opts):
        op = opts.reduceOp
        split = self._split
        if split is not None and (op == _SUM or op == _AVG) \
                and t.numel() * t.element_size() <= split[2]:
            return self._start(t, None if op == _SUM else self.size())
        if op == _SUM:
            api.allreduce(_float_tensor(t, "all_reduce"), comm=self._harmpi_comm)
            return _DoneWork([t])
        return self._allreduce_other(t, op, True)

    def _allreduce_other(self, t, op, async_op):
        _float_tensor(t, "all_reduce")
        kind = op.op if isinstance(op, dist.ReduceOp) else op
        if kind == _RED.AVG:
            api.allreduce(t, comm=self._harmpi_comm)
            t.div_(self.size())
        elif kind in (_RED.MAX, _RED.MIN):
            gathered = api.allgather(t.reshape(1, -1), comm=self._harmpi_comm)
            red = gathered.amax(dim=0) if kind == _RED.MAX else gathered.amin(dim=0)
            t.copy_(red.view(t.shape))
        else:
            raise HarmpiArgumentError(
                f"harmpi backend: all_reduce with {getattr(kind, 'name', kind)} is not supported; "
                "it supports "
                f"{_SUPPORTED_OPS}")
        return _DoneWork([t]) if async_op else _DONE

    def _start(self, t, scale):
        """First half of an async all-reduce on one node (module docstring)."""
        from .torch import describe  # noqa: PLC0415 - torch is loaded by now

        addr, n, fmt = describe(_float_tensor(t, "all_reduce"), True)
        ctx = self._ctx
        if ctx.broken is not None:
            raise HarmpiError(f"harmpi context is unusable: {ctx.broken}")
        start, finish, _ = self._split
        rc = start(ctx.ctl, addr, n, fmt)
        if rc:
            ctx.raise_status(rc, addr, n, fmt, AUTO_CODE | fmt, "allreduce (async)")
        work = _SplitWork(self, finish, t, addr, n, fmt, scale)
        self._pending = work
        ctx.split_pending = work
        return work

    def allreduce_coalesced(self, tensors, opts=None):
        self._settle()
        if opts is not None and opts.reduceOp != _SUM:
            raise HarmpiArgumentError("harmpi backend: all_reduce_coalesced sums only (SUM)")
        for t in tensors:
            api.allreduce(_float_tensor(t, "all_reduce_coalesced"),
                          comm=self._harmpi_comm)
        return _DoneWork(tensors)

    # -- gathers -------------------------------------------------------------------

    def allgather(self, output_lists, input_tensors, opts=None):
        self._settle()
        outs = _one(output_lists, "all_gather")
        t = _one(input_tensors, "all_gather")
        if len(outs) != self.size():
            raise HarmpiArgumentError(f"harmpi backend: all_gather needs {self.size()} output "
                                      f"tensors, got {len(outs)}")
        if any(o.shape != t.shape for o in outs):
            return self._gather_uneven(t, outs)
        if t.dtype in _FLOATS:
            gathered = api.allgather(t.contiguous(), comm=self._harmpi_comm)
            for o, part in zip(outs, gathered.view(self.size(), *t.shape)):
                o.copy_(part)
        else:
            gathered = torch.empty((self.size(),) + tuple(t.shape), dtype=t.dtype)
            self._comm.Allgather(_bytes_of(t.contiguous()), _bytes_of(gathered))
            for o, part in zip(outs, gathered):
                o.copy_(part)
        return _DoneWork(output_lists)

    def _gather_uneven(self, t, outs):
        from . import logits  # noqa: PLC0415 - only for uneven vocabulary shards

        logits.gather_uneven(t, outs, self._harmpi_comm)
        return _DoneWork([outs])

    def all_gather_single(self, output, input, opts=None):
        self._settle()
        _contiguous_cpu(output, "all_gather_into_tensor")
        if input.numel() * self.size() != output.numel():
            raise HarmpiArgumentError(
                f"harmpi backend: all_gather_into_tensor: output has {output.numel()} elements, "
                f"expected {self.size()} x {input.numel()}")
        if input.dtype in _FLOATS:
            if output.dtype != input.dtype:
                raise HarmpiArgumentError("harmpi backend: all_gather_into_tensor: output and "
                                          "input dtypes differ")
            api.allgather(input.contiguous(), comm=self._harmpi_comm, out=output)
        else:
            self._comm.Allgather(_bytes_of(input.contiguous()), _bytes_of(output))
        return _DoneWork([output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self.all_gather_single(o, i, opts)
        return _DoneWork(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # -- reduce-scatter ----------------------------------------------------------------

    def reduce_scatter_single(self, output, input, opts=None):
        self._settle()
        _float_tensor(input, "reduce_scatter_tensor")
        _contiguous_cpu(output, "reduce_scatter_tensor")
        n = output.numel()
        if input.numel() != n * self.size() or output.dtype != input.dtype:
            raise HarmpiArgumentError(
                f"harmpi backend: reduce_scatter_tensor: input must have {self.size()} x "
                f"{n} elements of the output's dtype (got {input.numel()}, {input.dtype})")
        full = input.contiguous().clone()
        scratch = [full]
        self.allreduce(scratch, _reduce_opts(opts))
        r = self.rank()
        output.view(-1).copy_(full.view(-1)[r * n:(r + 1) * n])
        return _DoneWork([output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        out = _one(output_tensors, "reduce_scatter")
        inputs = _one(input_lists, "reduce_scatter")
        if len(inputs) != self.size():
            raise HarmpiArgumentError(f"harmpi backend: reduce_scatter needs {self.size()} "
                                      f"input tensors, got {len(inputs)}")
        flat = torch.cat([i.reshape(-1) for i in inputs])
        result = torch.empty(flat.numel() // self.size(), dtype=flat.dtype)
        self.reduce_scatter_single(result, flat, opts)
        out.copy_(result.view(out.shape))
        return _DoneWork([out])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self.reduce_scatter_single(o, i, opts)
        return _DoneWork(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- rooted byte movers --------------------------------------------------------------

    def broadcast(self, tensors, opts=None):
        self._settle()
        t = _contiguous_cpu(_one(tensors, "broadcast"), "broadcast")
        root = opts.rootRank if opts is not None else 0
        self._comm.Bcast(_bytes_of(t), root=root)
        return _DoneWork(tensors)

    def scatter(self, output_tensors, input_lists, opts=None):
        self._settle()
        out = _contiguous_cpu(_one(output_tensors, "scatter"), "scatter")
        root = opts.rootRank if opts is not None else 0
        send = None
        if self.rank() == root:
            inputs = _one(input_lists, "scatter")
            if len(inputs) != self.size() or any(i.numel() != out.numel() or
                                                 i.dtype != out.dtype for i in inputs):
                raise HarmpiArgumentError(
                    f"harmpi backend: scatter needs {self.size()} input tensors shaped like the "
                    "output")
            send = _bytes_of(torch.stack([i.reshape(-1) for i in inputs]))
        self._comm.Scatter(send, _bytes_of(out), root=root)
        return _DoneWork(output_tensors)

    # -- barrier -----------------------------------------------------------------------------

    def barrier(self, opts=None):
        self._settle()
        api.barrier(comm=self._harmpi_comm)
        return _DoneWork()

    # -- what harmpi does not do --------------------------------------------------------------

    def _unsupported(self, what):
        raise HarmpiArgumentError(
            f"harmpi backend: {what} is not supported. It serves all_reduce ({_SUPPORTED_OPS}), "
            "all_gather, all_gather_into_tensor, reduce_scatter_tensor, broadcast, scatter and "
            "barrier; make a gloo group beside it for the rest: dist.new_group(backend='gloo')")

    def send(self, tensors, dst, tag=0):
        self._unsupported("send")

    def recv(self, tensors, src, tag=0):
        self._unsupported("recv")

    def recv_anysource(self, tensors, tag=0):
        self._unsupported("recv")

    def alltoall(self, *args, **kwargs):
        self._unsupported("all_to_all")

    def all_to_all_single(self, *args, **kwargs):
        self._unsupported("all_to_all_single")

    alltoall_base = all_to_all_single

    def gather(self, *args, **kwargs):
        self._unsupported("gather")

    def reduce(self, *args, **kwargs):
        self._unsupported("reduce")


def _native_sum():
    from . import native  # noqa: PLC0415 - imports harmpi._C (torch's C++ side)

    mod = native.load()
    return getattr(mod, "allreduce_sum", None) if mod is not None else None


def _reduce_opts(opts):
    out = dist.AllreduceOptions()
    out.reduceOp = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
    out.asyncOp = False
    return out


# -- creation -------------------------------------------------------------------------------

def _create(backend_opts, pg_options=None):
    """The creator torch calls (extended API) for every group of backend "harmpi"."""
    if _torch_version() < MIN_TORCH:
        raise HarmpiError(f"harmpi backend needs torch >= {'.'.join(map(str, MIN_TORCH))}; "
                          f"this is torch {torch.__version__}")
    if not MPI.Is_initialized():
        raise HarmpiError("harmpi backend: MPI is not initialised; run under mpirun")
    ranks = list(backend_opts.global_ranks_in_group)
    rank, size = backend_opts.group_rank, backend_opts.group_size
    if not ranks:  # the default group: torch's world must be MPI's
        if (rank, size) != (_WORLD.Get_rank(), _WORLD.Get_size()):
            raise HarmpiArgumentError(
                f"harmpi backend: torch says rank {rank} of {size}, MPI says rank "
                f"{_WORLD.Get_rank()} of {_WORLD.Get_size()}: the rank and world size given to "
                "init_process_group (or RANK/WORLD_SIZE) must match mpirun's, or be left out")
        return ProcessGroupHarmpi(_WORLD, rank, size)
    world = dist.distributed_c10d._get_default_group()
    if world.size() != _WORLD.Get_size():
        raise HarmpiArgumentError("harmpi backend: the default group does not span MPI's world")
    comm = _WORLD.Create_group(_WORLD.Get_group().Incl(ranks))
    if comm.Get_rank() != rank:
        raise HarmpiError(f"harmpi backend: group rank {rank} is MPI rank {comm.Get_rank()}")
    return ProcessGroupHarmpi(comm, rank, size)


# -- rendezvous over MPI ------------------------------------------------------------------------

def _mpi_launched():
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK",
                                         "PMI_SIZE", "MPI_LOCALNRANKS"))


def _query_int(query, name):
    values = parse_qs(query).get(name)
    return int(values[0]) if values else None


def _mpi_rendezvous(url, timeout=datetime.timedelta(minutes=30), **kwargs):
    """env:// without MASTER_ADDR under an MPI launcher: rank and world size
    from MPI, a TCPStore on rank 0 at a free port broadcast over MPI."""
    query = urlparse(url).query
    rank, size = _WORLD.Get_rank(), _WORLD.Get_size()
    for name, mine, env in (("rank", rank, "RANK"), ("world_size", size, "WORLD_SIZE")):
        given = _query_int(query, name)
        if given == -1:  # torch's "not given"
            given = None
        if given is None and os.environ.get(env):
            given = int(os.environ[env])
        if given is not None and given != mine:
            raise HarmpiArgumentError(
                f"init_process_group: {name}={given} but MPI says {mine}; under mpirun leave "
                f"{name} out (harmpi takes it from MPI) or pass MPI's")
    hosts = _WORLD.allgather(socket.gethostname())
    if rank == 0:
        store = dist.TCPStore("0.0.0.0", 0, size, True, timeout=timeout,
                              wait_for_workers=False)
        addr = "127.0.0.1" if len(set(hosts)) == 1 else _host_address()
        where = _WORLD.bcast((addr, store.port), root=0)
    else:
        where = _WORLD.bcast(None, root=0)
        store = dist.TCPStore(where[0], where[1], size, False, timeout=timeout)
    # every rank is connected before any goes on (a rank that fails right
    # after must not close the store under one still connecting)
    _WORLD.Barrier()
    log.debug("torch.distributed rendezvous over MPI: store at %s:%d", *where)
    yield (store, rank, size)
    raise RuntimeError("harmpi's MPI rendezvous cannot re-rendezvous")


def _host_address():
    from .transports.tcp import local_ipv4_addresses  # noqa: PLC0415

    addrs = local_ipv4_addresses()
    return addrs[0] if addrs else socket.gethostname()


def _install_rendezvous():
    import importlib  # noqa: PLC0415

    # (torch.distributed's attribute "rendezvous" is the function, not the module)
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    handlers = getattr(rdzv, "_rendezvous_handlers", None)
    if handlers is None or "env" not in handlers or getattr(handlers["env"], "_harmpi", False):
        return
    original = handlers["env"]

    def env_or_mpi(url, **kwargs):
        if "MASTER_ADDR" not in os.environ and _mpi_launched():
            return _mpi_rendezvous(url, **kwargs)
        return original(url, **kwargs)

    env_or_mpi._harmpi = True
    handlers["env"] = env_or_mpi


_registered = False


def register():
    """Register backend "harmpi" for CPU with torch.distributed (idempotent;
    ``import harmpi`` calls it when torch is importable), the MPI
    rendezvous, and the torch op ``torch.ops.harmpi.all_reduce_`` when the
    native module is built."""
    global _registered
    if _registered:
        return
    _registered = True
    if not dist.is_available():
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    _install_rendezvous()
