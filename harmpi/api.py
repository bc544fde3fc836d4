"""The public collectives: check the arguments, then call the context's entry.

Checks that need no communication (dtype, layout, writability, op,
algorithm name) run first on every rank and raise HarmpiArgumentError
before any data moves. Checks that need the other ranks (sizes and kinds
agree) ride along with the first publish of the collective and raise
HarmpiMismatchError on every rank, again before the caller's buffer is
written. Everything after the checks is one call of the entry the context
picked when it was made (harmpi.context); a non-zero status it returns
becomes an exception in Context.fail.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading

import numpy as np
from mpi4py import MPI

from . import dtypes, kind
from .config import Config
from .context import AUTO_CODE, Context
from .errors import HarmpiArgumentError, HarmpiError

__all__ = ["init", "finalize", "allreduce", "allgather", "barrier", "info"]

log = logging.getLogger("harmpi")

_COMM_WORLD = MPI.COMM_WORLD
_BF16_NAMES = ("bf16", "bfloat16")


class _State:
    """The one explicit piece of module state: the contexts, and the native
    entry point while it serves the world context.

    A context hangs on its communicator as an MPI attribute (MPI's own
    answer for per-communicator state): freeing the communicator runs the
    attribute's delete callback, which frees the context, and a later
    communicator that reuses the freed handle starts without one. The world
    context is also kept here for the hot path. An attribute on COMM_SELF
    tells when MPI_Finalize starts (MPI deletes COMM_SELF's attributes
    first); a fork handler tells a child that it is not its parent's rank.
    """

    def __init__(self):
        self.contexts = []          # every live context, in creation order
        self.world = None
        self.torch = None           # harmpi.torch, once a tensor has been seen
        self.native = None          # harmpi.native's allreduce(t), while it serves
        self.keyval = None
        self.closed = None          # why no collective may run any more (finalize, fork)
        self.sigfd = -1             # read end of Python's signal wakeup fd, if harmpi set it

    def get(self, comm):
        if comm is None or comm is _COMM_WORLD:
            return self.world or self.create(_COMM_WORLD)
        if not isinstance(comm, MPI.Comm):
            raise HarmpiArgumentError(
                f"comm must be an mpi4py communicator, got {type(comm).__name__}")
        ctx = comm.Get_attr(self.keyval) if self.keyval is not None else None
        return ctx or self.create(comm)

    def lookup(self, comm):
        """The live context of ``comm`` (None if it has none)."""
        if comm is _COMM_WORLD:
            return self.world
        return comm.Get_attr(self.keyval) if self.keyval is not None else None

    def create(self, comm, config=None):
        if self.closed is not None:
            raise HarmpiError(f"harmpi cannot start a collective: {self.closed}")
        if not MPI.Is_initialized() or MPI.Is_finalized():
            raise HarmpiError("MPI is not initialised (or already finalised); import mpi4py's MPI "
                              "and run under mpirun")
        if self.keyval is None:
            self._install_hooks()
        ctx = Context(comm, config or Config.from_env(), self.sigfd)
        self.contexts.append(ctx)
        if comm == _COMM_WORLD:
            self.world = ctx
            self.attach_native()
        else:
            comm.Set_attr(self.keyval, ctx)
        return ctx

    def _install_hooks(self):
        self.keyval = MPI.Comm.Create_keyval(delete_fn=self._on_comm_free)
        finalize_key = MPI.Comm.Create_keyval(delete_fn=self._on_mpi_finalize)
        MPI.COMM_SELF.Set_attr(finalize_key, True)
        os.register_at_fork(after_in_child=self._after_fork)
        self.sigfd = _watch_sigint()
        # runs before mpi4py's own MPI_Finalize (atexit is last-in, first-out)
        atexit.register(self.at_exit)

    def _on_comm_free(self, comm, keyval, ctx):
        """MPI_Comm_free of a communicator with a context, or harmpi.finalize()
        (collective, like the context's own free)."""
        self.forget(ctx)
        if ctx.broken is None and not MPI.Is_finalized():
            ctx.free()

    def _on_mpi_finalize(self, comm, keyval, value):
        self.close("MPI has been finalized (MPI.Finalize() or interpreter exit)")

    def _after_fork(self):
        self.close(f"this process was forked (pid {os.getpid()}) from a rank after harmpi "
                   "was set up; a child is not its parent's rank and cannot take part in its "
                   "collectives")

    def close(self, why):
        """No collective may run any more: every context refuses (its gate
        closes, so the native entry point declines too)."""
        self.closed = why
        self.native = None
        for ctx in self.contexts:
            ctx.broken = ctx.broken or why
        native = sys.modules.get("harmpi.native")
        if native is not None:
            native.detach()

    def forget(self, ctx):
        if ctx in self.contexts:
            self.contexts.remove(ctx)
        if ctx is self.world:
            self.world = None
            self.native = None
            native = sys.modules.get("harmpi.native")
            if native is not None:
                native.detach()

    def at_exit(self):
        """Interpreter exit: no collective. A peer may be gone, stuck, or
        exiting on a failure this rank never saw; a collective free would
        then hang the job. MPI_Finalize reclaims the windows (nothing stays
        in /dev/shm); the sockets close with the process."""
        for ctx in self.contexts:
            ctx.close_transports()
        self.close("the interpreter is exiting")

    def attach_native(self):
        """Let harmpi.native serve harmpi.allreduce(t) for the world context,
        once torch is in use and the context's default entry is compiled."""
        ctx = self.world
        if self.torch is None or ctx is None or ctx.broken is not None:
            return
        if not ctx.entry_cfunc or not ctx.config.native:
            return
        from . import native  # noqa: PLC0415 - imports torch's C++ side

        self.native = native.attach(ctx)

    def free_all(self):
        """harmpi.finalize(): free every healthy context (collective)."""
        contexts, self.contexts = self.contexts, []
        world, self.world = self.world, None
        self.native = None
        native = sys.modules.get("harmpi.native")
        if native is not None:  # also for a broken world context, which is not freed
            native.detach()
        if MPI.Is_finalized():
            return
        for ctx in contexts:
            if ctx is not world:
                # the attribute's delete callback frees the context
                ctx.comm.Delete_attr(self.keyval)
            elif ctx.broken is None:
                # A context whose peers failed cannot free collectively (a
                # peer may be gone); MPI_Finalize reclaims its window.
                ctx.free()


def _watch_sigint():
    """Make Python's signal handler also write each signal's number to a
    pipe that harmpi's compiled waits read (sync.sigint_arrived), so Ctrl-C
    ends a wait within ~1 ms instead of at its deadline. Only from the main
    thread, and only if nobody else (asyncio, say) uses the wakeup fd;
    otherwise -1, and a wait notices Ctrl-C at its deadline."""
    if threading.current_thread() is not threading.main_thread():
        return -1
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    if old != -1:  # someone else's: give it back
        signal.set_wakeup_fd(old)
        os.close(r)
        os.close(w)
        log.debug("signal wakeup fd in use: Ctrl-C ends a harmpi wait at its deadline")
        return -1
    return r


_STATE = _State()


def init(comm=None, config=None):
    """Set up harmpi for ``comm`` (default MPI.COMM_WORLD); collective, optional.

    The first collective on a communicator initialises it anyway; calling
    init() first keeps the set-up (window allocation, kernel loading) out of
    timed code. ``config``: a :class:`harmpi.Config` to use instead of the
    environment (only before the communicator's first use). Returns the
    context (see :func:`info` for what it knows).
    """
    if config is None:
        return _STATE.get(comm)
    if not isinstance(config, Config):
        raise HarmpiArgumentError(f"config must be a harmpi.Config, got {type(config).__name__}")
    comm = _COMM_WORLD if comm is None else comm
    existing = _STATE.lookup(comm)
    if existing is None or existing.broken is not None:
        return _STATE.create(comm, config)
    if existing.config != config:
        raise HarmpiArgumentError("this communicator is already initialised with another "
                                  "config; call harmpi.finalize() first")
    return existing


def finalize():
    """Free every window, transport and communicator harmpi made (collective)."""
    _STATE.free_all()


def _context(comm):
    ctx = _STATE.get(comm)
    if ctx.broken is not None:
        raise HarmpiError(f"harmpi context is unusable: {ctx.broken}")
    return ctx


def _describe_array(x, dtype, writable):
    """(addr, n, fmt) of a numpy array, or HarmpiArgumentError."""
    if dtype is None:
        f = dtypes.by_numpy_dtype(x.dtype)
    elif dtype not in _BF16_NAMES:
        raise HarmpiArgumentError(f"dtype={dtype!r}: only 'bf16' may be given, for uint16 "
                                  "arrays holding bfloat16 bits")
    elif x.dtype != np.uint16:
        raise HarmpiArgumentError(f"dtype='bf16' needs a uint16 array, got {x.dtype}")
    else:
        f = dtypes.FORMATS[dtypes.BF16]
    if f is None:
        raise HarmpiArgumentError(
            f"unsupported array dtype {x.dtype}; harmpi reduces float16, float32, float64, "
            "and bfloat16 (torch.bfloat16 tensors, or uint16 arrays with dtype='bf16')")
    if not x.flags.c_contiguous:
        raise HarmpiArgumentError(
            f"array of shape {x.shape} is not C-contiguous; pass np.ascontiguousarray(x)")
    if writable and not x.flags.writeable:
        raise HarmpiArgumentError("array is read-only; the collective writes its result in "
                                  "place (pass a writable copy)")
    return x.ctypes.data, x.size, f.id


def _torch_module(x):
    """harmpi.torch if ``x`` is a torch tensor (imported on first sight), else None."""
    ht = _STATE.torch
    if ht is None:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(x, torch.Tensor):
            return None
        from . import torch as ht  # noqa: PLC0415 - torch only once a tensor is seen
        _STATE.torch = ht
        _STATE.attach_native()
    return ht if isinstance(x, ht.Tensor) else None


def _describe(x, dtype, writable):
    """(addr, n, fmt, is_torch) of x, or HarmpiArgumentError."""
    if type(x) is np.ndarray:
        return (*_describe_array(x, dtype, writable), False)
    ht = _torch_module(x)
    if ht is None:
        raise HarmpiArgumentError(
            f"expected a numpy array or a torch tensor, got {type(x).__name__}")
    if dtype is not None:
        raise HarmpiArgumentError("dtype= is only for numpy uint16 arrays; a tensor has its own")
    return (*ht.describe(x, writable), True)


def _check_op(op):
    if op != "sum" and op is not MPI.SUM:
        raise HarmpiArgumentError(f"op={op!r} is not supported; harmpi all-reduce sums (op='sum')")


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
    native = _STATE.native
    if native is not None and algorithm is None and (comm is None or comm is _COMM_WORLD) \
            and dtype is None and op == "sum":
        # the world context's default entry, called from C++ after the same
        # tensor checks (harmpi.native); -1: not a tensor it takes, go on
        rc = native(x)
        if rc == 0:
            return x
        if rc > 0:
            _native_failed(x, rc)
    _check_op(op)
    addr, n, fmt, _ = _describe(x, dtype, True)
    ctx = _context(comm)
    entry = ctx.entry if algorithm is None else ctx.entry_for(algorithm)
    rc = entry(ctx.ctl, addr, n, fmt)
    if rc:
        ctx.raise_status(rc, addr, n, fmt, AUTO_CODE | fmt, "allreduce")
    return x


def _native_failed(x, rc):
    addr, n, fmt, _ = _describe(x, None, True)
    _STATE.world.raise_status(rc, addr, n, fmt, AUTO_CODE | fmt, "allreduce")


def _gather_out(x, out, n, fmt, is_torch, nranks, dtype):
    """(out, its address): ``out`` checked, or a new array/tensor."""
    if out is None:
        if is_torch:
            out = _STATE.torch.empty_like_gathered(x, nranks)
        else:
            shape = x.shape or (1,)
            out = np.empty((shape[0] * nranks,) + shape[1:], dtype=x.dtype)
    out_addr, out_n, out_fmt, out_torch = _describe(out, dtype, True)
    if out_torch != is_torch or out_fmt != fmt or out_n != n * nranks:
        raise HarmpiArgumentError(
            f"out must be a {'tensor' if is_torch else 'numpy array'} of x's dtype with "
            f"{n * nranks} elements ({nranks} ranks x {n}); got {type(out).__name__} of "
            f"{out_n} elements" + ("" if out_fmt == fmt else " and another dtype"))
    return out, out_addr


_SHAPE_DIGESTS = {}


def _shape_digest(shape):
    """kind.shape_digest, cached (a decode loop gathers the same shapes)."""
    digest = _SHAPE_DIGESTS.get(shape)
    if digest is None:
        if len(_SHAPE_DIGESTS) > 1024:
            _SHAPE_DIGESTS.clear()
        digest = _SHAPE_DIGESTS[shape] = kind.shape_digest(shape)
    return digest


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
    addr, n, fmt, is_torch = _describe(x, dtype, False)
    ctx = _context(comm)
    out, out_addr = _gather_out(x, out, n, fmt, is_torch, ctx.topo.size, dtype)
    digest = _shape_digest(x.shape)
    rc = ctx.gather(ctx.ctl, addr, out_addr, n, fmt, digest)
    if rc:
        ctx.raise_status(rc, addr, n, fmt, kind.encode(fmt=fmt, coll=kind.COLL_ALLGATHER,
                                                        digest=digest), "allgather")
    return out


def barrier(comm=None):
    """Wait until every rank of ``comm`` has called barrier (node flags + rail)."""
    allreduce(np.zeros(1, np.float32), comm=comm, algorithm="auto")


_THREAD_LEVELS = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                  MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}


def info(comm=None):
    """What harmpi knows about ``comm``: topology, transport and thresholds (a dict)."""
    from . import __version__  # noqa: PLC0415 - the package imports this module
    ctx = _STATE.get(comm)
    topo = ctx.topo
    cfg = ctx.config
    transport = ctx.rail_transport()
    return {
        "version": __version__,
        "mpi_library": MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip(),
        "mpi_thread_level": _THREAD_LEVELS.get(MPI.Query_thread(), "?"),
        "ranks": topo.size,
        "nodes": topo.node_count,
        "ranks_per_node": list(topo.node_sizes),
        "virtual_nodes": topo.virtual,
        "node_index": topo.node_index,
        "local_rank": topo.local_rank,
        "hostname": topo.hostname,
        "transport": transport.name if transport else "none",
        "transport_reason": ctx.transport_reason,
        "algorithm": cfg.algorithm,
        "entry": _entry_name(ctx.entry),
        "thresholds": {"small_max_nbytes": cfg.small_max_nbytes,
                       "har_latency_max_nbytes": cfg.har_latency_max_nbytes,
                       "slot_nbytes": cfg.slot_nbytes},
        "spin_count": ctx.spin_count,
        "stream_stores": cfg.stream_stores,
        "oversubscribed": ctx.oversubscribed,
        "timeout_s": cfg.timeout_s,
        "native": _native_status(ctx),
    }


def _entry_name(entry):
    name = getattr(entry, "name", None) or getattr(entry, "__name__", None)
    return name or type(entry).__name__


def _native_status(ctx):
    if not ctx.config.native:
        return "off (HARMPI_NATIVE=0 or Config(native=False))"
    if ctx is _STATE.world and _STATE.native is not None:
        return "serving harmpi.allreduce(t) for this context"
    native = sys.modules.get("harmpi.native")
    if native is None:
        return "not loaded (it loads with torch, for the world context)"
    status = native.status()
    if status == "loaded":
        return ("loaded; not serving this context (it serves the world communicator's "
                "compiled entry)")
    return status
