"""The public collectives: argument checks, context lookup, algorithm dispatch.

Checks that need no communication (dtype, layout, writability, op,
algorithm name) run first on every rank and raise HarmpiArgumentError
before any data moves. Checks that need the other ranks (sizes and kinds
agree) ride along with the first publish of the collective and raise
HarmpiMismatchError on every rank, again before the caller's buffer is
written.
"""

from __future__ import annotations

import atexit
import logging
import sys
import zlib

import numpy as np
from mpi4py import MPI

from . import node
from .algorithms import ALGORITHM_IDS
from .algorithms.base import Call
from .algorithms.har_latency import TWO_NODE_TCP
from .config import ALGORITHMS, Config
from .context import AUTO_ALLREDUCE_CODE, COLL_ALLGATHER, COLL_ALLREDUCE, OP_SUM, Context
from .errors import HarmpiArgumentError, HarmpiError, HarmpiTimeoutError

__all__ = ["init", "finalize", "allreduce", "allgather", "barrier", "info"]

log = logging.getLogger("harmpi")

# numba has no float16 type: 16-bit arrays are addressed through a uint16 view
_NUMPY_KINDS = {
    np.dtype(np.float16): (node.FMT_F16, np.empty(0, np.uint16), 2),
    np.dtype(np.float32): (node.FMT_F32, np.empty(0, np.float32), 4),
    np.dtype(np.float64): (node.FMT_F64, np.empty(0, np.float64), 8),
}
_BF16 = (node.FMT_BF16, np.empty(0, np.uint16), 2)
_OPS = {"sum": OP_SUM}
_COMM_WORLD = MPI.COMM_WORLD


class _Contexts:
    """The one explicit piece of module state: contexts by communicator."""

    def __init__(self):
        self.by_comm = {}
        self.world = None           # fast path for comm=None
        self.torch = None           # harmpi.torch, once a tensor has been seen
        self.tensor_type = None     # torch.Tensor, likewise
        self.atexit_registered = False

    def get(self, comm):
        if comm is None:
            if self.world is None:
                self.world = self.create(MPI.COMM_WORLD)
            return self.world
        if not isinstance(comm, MPI.Comm):
            raise HarmpiArgumentError(f"comm must be an mpi4py communicator, got {type(comm).__name__}")
        ctx = self.by_comm.get(comm.handle)
        if ctx is None:
            ctx = self.create(comm)
        return ctx

    def create(self, comm, config=None):
        if not MPI.Is_initialized() or MPI.Is_finalized():
            raise HarmpiError("MPI is not initialised (or already finalised); import mpi4py's MPI "
                              "and run under mpirun")
        ctx = Context(comm, config or Config.from_env())
        self.by_comm[comm.handle] = ctx
        if comm == MPI.COMM_WORLD:
            self.world = ctx
            self.attach_native()
        if not self.atexit_registered:
            # Runs before mpi4py's own finalisation (atexit is last-in, first-out).
            atexit.register(self.free_at_exit)
            self.atexit_registered = True
        return ctx

    def free_at_exit(self):
        """Interpreter exit: free collectively, unless the exit is an uncaught
        exception. Then the peers may be stuck in a collective (or be gone),
        a collective free would wait for them, and the abort that
        ``python -m mpi4py`` is about to make reclaims everything anyway."""
        if getattr(sys, "last_value", None) is not None:
            log.debug("exiting on an uncaught exception: leaving teardown to MPI")
            return
        self.free_all()

    def attach_native(self):
        """Let harmpi.native serve harmpi.allreduce(t) for the world context,
        once torch is in use and the context is one auto node (it declines
        everything else, so the Python path stays the reference)."""
        global _NATIVE
        ctx = self.world
        if self.torch is None or ctx is None or ctx.broken is not None or not ctx.single_node_auto:
            return
        from . import native  # noqa: PLC0415 - imports torch's C++ side

        if native.attach(ctx.ctl):
            ctx.native_attached = True
            ctx.ctl[node.C_NATIVE] = 1
            _NATIVE = native.load().allreduce

    def free_all(self):
        global _NATIVE
        _NATIVE = None
        native = sys.modules.get("harmpi.native")
        if native is not None:  # also for a broken world context, which is not freed
            native.detach()
        if MPI.Is_finalized():
            self.by_comm.clear()
            self.world = None
            return
        # A context whose peers timed out cannot free collectively (a peer may
        # be gone); MPI_Finalize reclaims its window.
        for ctx in list(self.by_comm.values()):
            if ctx.broken is None:
                ctx.free()
        self.by_comm.clear()
        self.world = None


_CONTEXTS = _Contexts()
#: the native entry point's allreduce(t) while it serves the world context
_NATIVE = None
#: allgather: crc of a shape (part of the kind every rank checks), by shape
_SHAPE_DIGESTS = {}


def init(comm=None, config=None):
    """Set up harmpi for ``comm`` (default MPI.COMM_WORLD); collective, optional.

    The first collective on a communicator initialises it anyway; calling
    init() first keeps the set-up (window allocation, kernel loading) out of
    timed code. ``config``: a :class:`harmpi.Config` to use instead of the
    environment (only before the communicator's first use). Returns the
    context (see :func:`info` for what it knows).
    """
    if config is not None:
        if not isinstance(config, Config):
            raise HarmpiArgumentError(f"config must be a harmpi.Config, got {type(config).__name__}")
        key = MPI.COMM_WORLD if comm is None else comm
        existing = _CONTEXTS.by_comm.get(key.handle)
        if existing is not None and existing.broken is None:
            if existing.config != config:
                raise HarmpiArgumentError("this communicator is already initialised with another "
                                          "config; call harmpi.finalize() first")
            return existing
        return _CONTEXTS.create(key, config)
    return _CONTEXTS.get(comm)


def finalize():
    """Free every window, transport and communicator harmpi made (collective)."""
    _CONTEXTS.free_all()


def _context(comm):
    ctx = _CONTEXTS.world if comm is None else None
    if ctx is None:
        ctx = _CONTEXTS.get(comm)
    if ctx.broken is not None:
        raise HarmpiError(f"harmpi context is unusable: {ctx.broken}")
    return ctx


def _describe(x, dtype, writable):
    """(addr, n, fmt, witness, itemsize, is_torch) of x, or HarmpiArgumentError."""
    if type(x) is np.ndarray:
        kind = _NUMPY_KINDS.get(x.dtype)
        if dtype is not None:
            if dtype not in ("bf16", "bfloat16"):
                raise HarmpiArgumentError(f"dtype={dtype!r}: only 'bf16' may be given, for uint16 "
                                          "arrays holding bfloat16 bits")
            if x.dtype != np.uint16:
                raise HarmpiArgumentError(f"dtype='bf16' needs a uint16 array, got {x.dtype}")
            kind = _BF16
        elif kind is None and x.dtype.name == "bfloat16" and x.dtype.itemsize == 2:
            kind = _BF16  # ml_dtypes.bfloat16
        if kind is None:
            raise HarmpiArgumentError(
                f"unsupported array dtype {x.dtype}; harmpi reduces float16, float32, float64, "
                "and bfloat16 (torch.bfloat16 tensors, or uint16 arrays with dtype='bf16')")
        if not x.flags.c_contiguous:
            raise HarmpiArgumentError(
                f"array of shape {x.shape} is not C-contiguous; pass np.ascontiguousarray(x)")
        if writable and not x.flags.writeable:
            raise HarmpiArgumentError("array is read-only; the collective writes its result in "
                                      "place (pass a writable copy)")
        fmt, w, itemsize = kind
        flat = x.reshape(-1)
        if itemsize == 2:
            flat = flat.view(np.uint16)
        return node.address_of(flat), x.size, fmt, w, itemsize, False
    ht = _CONTEXTS.torch
    if ht is None:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(x, torch.Tensor):
            raise HarmpiArgumentError(
                f"expected a numpy array or a torch tensor, got {type(x).__name__}")
        from . import torch as ht  # noqa: PLC0415 - torch only once a tensor is seen
        _CONTEXTS.torch = ht
        _CONTEXTS.tensor_type = ht.Tensor
        _CONTEXTS.attach_native()
    if isinstance(x, ht.Tensor):
        if dtype is not None:
            raise HarmpiArgumentError("dtype= is only for numpy uint16 arrays; a tensor has its own")
        return ht.describe(x, writable)
    raise HarmpiArgumentError(
        f"expected a numpy array or a torch tensor, got {type(x).__name__}")


def _op_id(op):
    if op is MPI.SUM:
        return OP_SUM
    opid = _OPS.get(op) if isinstance(op, str) else None
    if opid is None:
        raise HarmpiArgumentError(f"op={op!r} is not supported; harmpi all-reduce sums (op='sum')")
    return opid


def allreduce(x, op="sum", comm=None, algorithm=None, dtype=None):
    """Sum ``x`` element-wise over every rank of ``comm``, in place; return ``x``.

    Before: rank r holds x_r (same shape and dtype on every rank).
    After:  every rank holds x_0 + x_1 + ... + x_{n-1}, bitwise identical.

    ``x``: contiguous, writable CPU torch tensor or numpy array of bfloat16,
    float16, float32 or float64 (for numpy bf16 pass a uint16 array and
    ``dtype="bf16"``); any shape, zero elements allowed. ``op``: "sum" (or
    MPI.SUM); anything else is rejected. ``comm``: an mpi4py communicator
    (default COMM_WORLD). ``algorithm``: None/"auto" or one of
    harmpi.ALGORITHMS (default HARMPI_ALGORITHM).

    bf16/f16 sums accumulate in float32 and round to nearest even once per
    stage (node sum, and each cross-node combine).
    """
    # Native entry point (harmpi.native): the same checks and kernel as the
    # fast path below, done in C++; it returns -1 for anything it declines.
    native = _NATIVE
    if native is not None and (comm is None or comm is _COMM_WORLD) and op == "sum" \
            and algorithm is None and dtype is None:
        rc = native(x)
        if rc == 0:
            return x
        if rc > 0:
            addr, n, fmt, w, itemsize, _ = _describe(x, None, True)
            _CONTEXTS.world.fail(rc, Call(addr, n, itemsize, fmt, w, fmt | AUTO_ALLREDUCE_CODE,
                                          "allreduce"))
    # Fast path for the decode loop's call: a CPU tensor, a communicator
    # already set up on one node, everything else default. The same checks
    # and kernel as below, minus ~1 us of generic dispatch.
    if type(x) is _CONTEXTS.tensor_type and op == "sum" and algorithm is None and dtype is None:
        # (mpi4py's .handle costs ~0.15 us: COMM_WORLD is known by identity)
        ctx = _CONTEXTS.world if comm is None or comm is _COMM_WORLD else \
            _CONTEXTS.by_comm.get(getattr(comm, "handle", None))
        if ctx is not None and ctx.broken is None:
            kind = _CONTEXTS.torch.KINDS.get(x.dtype)
            fast = ctx.single_node_auto or (
                ctx.two_node_fast is not None and kind is not None
                and x.numel() * kind[2] <= ctx.har_latency_max_nbytes)
            # (anything else, or a bad tensor: the generic path below decides and raises)
            if fast and kind is not None and x.is_contiguous() and x.is_cpu \
                    and not x.requires_grad:
                fmt = kind[0]
                if ctx.single_node_auto:
                    rc = node.FAST_ALLREDUCE(ctx.ctl, x.data_ptr(), x.numel(), fmt)
                    if rc:
                        ctx.fail(rc, Call(x.data_ptr(), x.numel(), kind[2], fmt, kind[1],
                                          fmt | AUTO_ALLREDUCE_CODE, "allreduce"))
                    return x
                algo = ctx.two_node_fast
                t = algo.transport
                rc = TWO_NODE_TCP(ctx.ctl, t.ops, t.pollfds, t.scratch, x.data_ptr(), x.numel(),
                                  fmt | AUTO_ALLREDUCE_CODE, fmt)
                if rc:
                    try:
                        algo.raise_for(rc, Call(x.data_ptr(), x.numel(), kind[2], fmt, kind[1],
                                                fmt | AUTO_ALLREDUCE_CODE, "allreduce"))
                    except HarmpiTimeoutError as exc:
                        ctx.broken = ctx.broken or str(exc)
                        raise
                return x
    opid = _op_id(op)
    addr, n, fmt, w, itemsize, _ = _describe(x, dtype, True)
    ctx = _context(comm)
    name = algorithm or ctx.config.algorithm
    if name != "auto" and name not in ALGORITHMS:
        raise HarmpiArgumentError(
            f"unknown algorithm {name!r}; choose 'auto' or one of {', '.join(ALGORITHMS)}")
    if ctx.topo.size == 1:
        return x
    algo = ctx.allreduce_algorithm(name, n * itemsize)
    code = fmt | (ALGORITHM_IDS[name] << 8) | (COLL_ALLREDUCE << 16) | (opid << 20)
    try:
        algo.run(Call(addr, n, itemsize, fmt, w, code, "allreduce"))
    except HarmpiTimeoutError as exc:
        ctx.broken = ctx.broken or str(exc)
        raise
    return x


def allgather(x, comm=None, dtype=None, out=None):
    """Concatenate every rank's ``x`` along the first dimension; return the result.

    Before: rank r holds x_r, shape (d0, d1, ...) on every rank.
    After:  every rank gets cat([x_0, ..., x_{n-1}]), shape (n*d0, d1, ...),
            in communicator rank order (a 0-d x counts as shape (1,)).
    ``x`` is only read. Same dtypes as :func:`allreduce`. ``out``: where to
    put the result instead of a new array/tensor (as torch's
    all_gather_into_tensor): same kind and dtype as ``x``, contiguous,
    writable, n times x's element count, any shape; it is returned.
    """
    # Fast path for a script's logits gather: CPU tensors into a given out,
    # the world communicator on one node. The same checks and compiled step
    # as below, minus the generic dispatch (~2 us).
    tt = _CONTEXTS.tensor_type
    if type(x) is tt and type(out) is tt and dtype is None and (comm is None or comm is _COMM_WORLD):
        ctx = _CONTEXTS.world
        if ctx is not None and ctx.broken is None and ctx.single_node_auto:
            entry = _CONTEXTS.torch.FAST_GATHER.get(x.dtype)
            n = x.numel()
            if (entry is not None and out.dtype is x.dtype and x.is_contiguous()
                    and out.is_contiguous() and x.is_cpu and out.is_cpu and not out.requires_grad
                    and out.numel() == n * ctx.topo.size):
                kernel, fmt, itemsize, w = entry
                digest = _SHAPE_DIGESTS.get(x.shape)
                if digest is None:
                    digest = _shape_digest(x.shape)
                code = fmt | (COLL_ALLGATHER << 16) | (digest << 24)
                rc = kernel(ctx.ctl, x.data_ptr(), out.data_ptr(), n, n * itemsize, code,
                            ctx.config.slot_nbytes // itemsize, ctx.allgather_algorithm().table, w)
                if rc:
                    ctx.fail(rc, Call(x.data_ptr(), n, itemsize, fmt, w, code, "allgather"))
                return out
    addr, n, fmt, w, itemsize, is_torch = _describe(x, dtype, False)
    ctx = _context(comm)
    size = ctx.topo.size
    if out is not None:
        out_addr, out_n, out_fmt, _, _, out_torch = _describe(out, dtype, True)
        if out_torch != is_torch or out_fmt != fmt or out_n != n * size:
            raise HarmpiArgumentError(
                f"out must be a {'tensor' if is_torch else 'numpy array'} of x's dtype with "
                f"{n * size} elements ({size} ranks x {n}); got {type(out).__name__} of "
                f"{out_n} elements" + ("" if out_fmt == fmt else " and another dtype"))
    elif is_torch:
        out = _CONTEXTS.torch.empty_like_gathered(x, size)
        out_addr = out.data_ptr()
    else:
        shape = x.shape or (1,)
        out = np.empty((shape[0] * size,) + shape[1:], dtype=x.dtype)
        out_addr = out.ctypes.data
    if size == 1:
        node.copy_bytes(out_addr, addr, n * itemsize)
        return out
    shape_digest = _SHAPE_DIGESTS.get(x.shape)
    if shape_digest is None:
        shape_digest = _shape_digest(x.shape)
    code = fmt | (COLL_ALLGATHER << 16) | (shape_digest << 24)
    try:
        ctx.allgather_algorithm().run(Call(addr, n, itemsize, fmt, w, code, "allgather"),
                                      out_addr)
    except HarmpiTimeoutError as exc:
        ctx.broken = ctx.broken or str(exc)
        raise
    return out


def _shape_digest(shape):
    """24-bit crc of a shape, part of the allgather kind every rank compares (cached)."""
    if len(_SHAPE_DIGESTS) > 1024:
        _SHAPE_DIGESTS.clear()
    digest = _SHAPE_DIGESTS[shape] = zlib.crc32(repr(tuple(shape)).encode()) & 0xFFFFFF
    return digest


def barrier(comm=None):
    """Wait until every rank of ``comm`` has called barrier (node flags + rail)."""
    ctx = _context(comm)
    if ctx.topo.size == 1:
        return
    allreduce(np.zeros(1, np.float32), comm=comm, algorithm="auto")


def info(comm=None):
    """What harmpi knows about ``comm``: topology, transport and thresholds (a dict)."""
    from . import __version__  # noqa: PLC0415 - the package imports this module
    ctx = _CONTEXTS.get(comm)
    topo = ctx.topo
    cfg = ctx.config
    return {
        "version": __version__,
        "mpi_library": MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip(),
        "mpi_thread_level": {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                             MPI.THREAD_SERIALIZED: "serialized",
                             MPI.THREAD_MULTIPLE: "multiple"}.get(MPI.Query_thread(), "?"),
        "ranks": topo.size,
        "nodes": topo.node_count,
        "ranks_per_node": list(topo.node_sizes),
        "virtual_nodes": topo.virtual,
        "node_index": topo.node_index,
        "local_rank": topo.local_rank,
        "hostname": topo.hostname,
        "transport": ctx.rail_transport().name if ctx.rail_transport() else "none",
        "transport_reason": ctx.transport_reason,
        "algorithm": cfg.algorithm,
        "thresholds": {"small_max_nbytes": cfg.small_max_nbytes,
                       "har_latency_max_nbytes": cfg.har_latency_max_nbytes,
                       "slot_nbytes": cfg.slot_nbytes},
        "spin_count": ctx.spin_count,
        "oversubscribed": ctx.oversubscribed,
        "timeout_s": cfg.timeout_s,
        "native": _native_status(ctx),
    }


def _native_status(ctx):
    if ctx.native_attached:
        return "serving harmpi.allreduce(t) for this context"
    native = sys.modules.get("harmpi.native")
    if native is None:
        return "not loaded (it loads with torch, for the world context on one node)"
    status = native.status()
    if status == "loaded":
        return ("loaded; not serving this context (it serves the world communicator on one "
                "node with algorithm auto)")
    return status
