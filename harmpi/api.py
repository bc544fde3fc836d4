"""The public collectives: check the arguments, then call the context's entry.

Checks that need no communication (dtype, layout, writability, op,
algorithm name) run first on every rank and raise HarmpiArgumentError
before any data moves. Checks that need the other ranks (sizes and kinds
agree) ride along with the first publish of the collective and raise
HarmpiMismatchError on every rank, again before the caller's buffer is
written. Everything after the checks is one call of the entry the context
picked when it was made (harmpi.runtime.context); a non-zero status it returns
becomes an exception in Context.fail.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from mpi4py import MPI

from .algorithms import alltoall as _a2a
from .algorithms.alltoall import plan as _plan
from .algorithms.base import Call
from .args import check_op as _check_op
from .args import context as _context
from .args import describe as _describe
from .args import refuse
from .args import shape_digest as _shape_digest
from .base import dtypes, kind
from .config import Config
from .errors import HarmpiArgumentError
from .gatherdim import allgather_dim, normalize_dim
from .logits import gather_logits
from .runtime import native as _native_module  # (a local "native" is the served operator)
from .runtime import switches
from .runtime.context import AUTO_CODE
from .runtime.registry import STATE
from .version import __version__

if TYPE_CHECKING:
    from .runtime.context import Context

#: a contiguous CPU torch tensor or numpy array (the collectives' buffers)
Buffer = TypeVar("Buffer")

__all__ = ["init", "finalize", "allreduce", "allgather", "alltoall", "barrier", "info",
           "gather_logits"]

log = logging.getLogger("harmpi")

_COMM_WORLD = MPI.COMM_WORLD


_STATE = STATE


def init(comm: MPI.Comm | None = None, config: Config | None = None) -> Context:
    """Set up harmpi for ``comm`` (default MPI.COMM_WORLD); collective, optional.

    The first collective on a communicator initialises it anyway; calling
    init() first keeps the set-up (window allocation, kernel loading) out of
    timed code. The calling thread becomes the one whose collectives run on
    ``comm`` (see :func:`allreduce`). ``config``: a :class:`harmpi.Config` to use instead of the
    environment (only before the communicator's first use). Returns the
    context (see :func:`info` for what it knows).
    """
    _STATE.check_open()
    if config is None:
        return _STATE.get(comm)
    if not isinstance(config, Config):
        raise HarmpiArgumentError(f"config must be a harmpi.Config, got {type(config).__name__}")
    comm = _COMM_WORLD if comm is None else comm
    if comm is not _COMM_WORLD:
        _STATE.check_comm(comm)
    existing = _STATE.lookup(comm)
    if existing is None or existing.broken is not None:
        return _STATE.create(comm, config)
    if existing.config != config:
        raise HarmpiArgumentError("this communicator is already initialised with another "
                                  "config; call harmpi.finalize() first")
    return existing


def finalize() -> None:
    """Free every window, transport and communicator harmpi made (collective).
    Call it before MPI.Finalize(); after it, it raises HarmpiError like every
    other harmpi call (MPI has reclaimed harmpi's windows by then)."""
    if MPI.Is_finalized():
        _STATE.check_open()
    _STATE.free_all()


def allreduce(x: Buffer, op: Any = "sum", comm: MPI.Comm | None = None,
              algorithm: str | None = None, dtype: str | None = None) -> Buffer:
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

    Threads: the collectives of ``comm`` belong to the thread that set it up
    (its first harmpi call or :func:`init`), the same thread on every rank
    (checked by name at set-up); a call from another thread raises
    HarmpiError at once, before anything moves (harmpi.runtime.owner). Give a
    thread of its own a communicator of its own (``comm.Dup()``).
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
            native_failed(x, rc)
    try:
        _check_op(op)
        addr, n, fmt, _ = _describe(x, dtype, True)
        ctx = _context(comm)
        entry = ctx.entry if algorithm is None else ctx.entry_for(algorithm)
    except HarmpiArgumentError as exc:
        refuse(comm, kind.COLL_ALLREDUCE, exc)
        raise
    try:
        rc = entry(ctx.ctl, addr, n, fmt)
        if rc:
            ctx.raise_status(rc, addr, n, fmt, AUTO_CODE | fmt, "allreduce")
    except KeyboardInterrupt:
        ctx.interrupted()
        raise
    return x


def native_failed(x, rc):
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


def allgather(x: Buffer, dim: int = 0, comm: MPI.Comm | None = None, dtype: str | None = None,
              out: Buffer | None = None) -> Buffer:
    """Concatenate every rank's ``x`` along dimension ``dim``; return the result.

    Before: rank r holds x_r, shape (d0, d1, ...) on every rank.
    After:  every rank gets cat([x_0, ..., x_{n-1}], dim), shape (n*d0, d1, ...)
            for dim=0, in communicator rank order (a 0-d x counts as shape (1,)).
    ``x`` is only read. Same dtypes as :func:`allreduce`. ``dim``: any
    dimension, negative counts from the end; out of range raises
    HarmpiArgumentError before anything moves. ``out``: where to put the
    result instead of a new array/tensor: same kind and dtype as ``x``,
    contiguous, writable; for dim=0 n times x's element count in any shape
    (as torch's all_gather_into_tensor), otherwise exactly the result's shape;
    it is returned.

    Cost: dim=0, and any dim after dimensions of size 1 only, is the
    allgather itself. Otherwise the allgather lands in a scratch buffer and
    one compiled strided copy puts it in place: n * x.nbytes more bytes read
    and written, plus a few us of Python (harmpi.gatherdim.allgather_dim).
    """
    native = _STATE.native_allgather
    if native is not None and not dim and dim is not None and dtype is None \
            and (comm is None or comm is _COMM_WORLD):
        # dim 0 of a tensor on the world context (one node), into a new
        # tensor or ``out``, checked and run from C++ (harmpi.native); an
        # int: not a call it takes (-1), or a failure
        got = native(x, out)
        if type(got) is not int:
            return got if out is None else out
        if got != -1:
            _native_allgather_failed(x, got)
    # (0 and False: the dim-0 path, no more Python on it; a dim that names
    # dimension 0 too, -1 of a 1-d x, joins it)
    try:
        if (dim or dim is None) and normalize_dim(dim, len(x.shape)):
            return allgather_dim(x, dim, comm, dtype, out)
        addr, n, fmt, is_torch = _describe(x, dtype, False)
        ctx = _context(comm)
        out, out_addr = _gather_out(x, out, n, fmt, is_torch, ctx.topo.size, dtype)
        digest = _shape_digest(x.shape)
    except HarmpiArgumentError as exc:
        refuse(comm, kind.COLL_ALLGATHER, exc)
        raise
    try:
        rc = ctx.gather(ctx.ctl, addr, out_addr, n, fmt, digest)
        if rc:
            ctx.raise_status(rc, addr, n, fmt, kind.encode(fmt=fmt, coll=kind.COLL_ALLGATHER,
                                                            digest=digest), "allgather")
    except KeyboardInterrupt:
        ctx.interrupted()
        raise
    return out


def alltoall(x: Buffer, send_counts: Any = None, comm: MPI.Comm | None = None,
             out: Buffer | None = None, recv_counts: Any = None,
             dtype: str | None = None) -> Buffer | tuple[Buffer, Any]:
    """Send rows of ``x`` to every rank of ``comm`` and receive theirs.

    Before: rank r holds x_r; its rows (dim 0), in order, are cut into
            segments, segment j (``send_counts[j]`` rows) for rank j.
    After:  rank j holds the segments every rank cut for it, concatenated in
            rank order (rank 0's first), shape (received rows, *x.shape[1:]).

    ``send_counts`` None: an even split (x.shape[0] a multiple of the number
    of ranks); the result has x's shape and is returned alone. Otherwise a
    sequence of one count per rank (ints >= 0, summing to x.shape[0]; a
    list, numpy array or tensor) and ``(out, recv_counts)`` is returned,
    ``recv_counts`` the list of rows received from each rank: the counts
    travel with the data, so a MoE step that routes tokens anew needs no
    count exchange of its own. ``recv_counts``: the counts this rank expects
    (as torch's ``output_split_sizes``); a rank that sends another number of
    rows fails the call with HarmpiMismatchError on every rank of the nodes
    involved, before any output is written. ``out``: where to put the
    result: same kind and dtype as ``x``, contiguous, writable, not
    overlapping ``x``, exactly the received element count.
    ``x`` is only read; every x.shape[1:] and dtype must agree across ranks
    (else HarmpiMismatchError on every rank). Same dtypes as :func:`allreduce`
    (raw bytes are moved: nothing is rounded).

    Cost (harmpi.algorithms.alltoall): one node, one flag round per slot's
    worth of the longest segment, one compiled call (two when the output's
    size must be learned first); several nodes, one message per other node
    on each rank's rail plus two flag rounds.
    """
    native = _STATE.native_alltoall
    if native is not None and send_counts is None and out is None and recv_counts is None \
            and (comm is None or comm is _COMM_WORLD) and dtype is None:
        # an even split of a tensor on the world context, checked and run from
        # C++ (harmpi.native); an int: not a call it takes (-1), or a failure
        got = native(x)
        if type(got) is not int:
            return got
        if got != -1:
            _native_alltoall_failed(x, got)
    try:
        addr, n, fmt, is_torch = _describe(x, dtype, False)
        rows, row_n, row_nb, code = _a2a_kind(x.shape, fmt)
        ctx = _context(comm)
        P = ctx.topo.size
        # the call's own scratch (a context's shared one could be overwritten by a
        # second thread's call before the step refuses it)
        plan = _a2a.new_plan(P)
        expect_total = _fill_plan(plan, P, rows, send_counts, recv_counts)
    except HarmpiArgumentError as exc:
        refuse(comm, kind.COLL_ALLTOALL, exc)
        raise

    def make_out(total_rows):
        return _rows_out(x, out, total_rows, row_n, fmt, is_torch, dtype, addr, n)

    result = _alltoall_run(ctx, plan, P, addr, row_n, row_nb, fmt, code, expect_total, make_out)
    if send_counts is None:
        return result
    return result, _plan.recv(plan, P).tolist()


def _alltoall_run(ctx, plan, P, addr, row_n, row_nb, fmt, code, expect_total, make_out):
    """The all-to-all's entry, by topology and by what the output's size needs."""
    try:
        if ctx.alltoall is not None and expect_total is not None:
            # several nodes, the output's size known: made first, then filled
            try:
                result, out_addr = make_out(expect_total)
            except HarmpiArgumentError as exc:
                refuse(ctx.comm, kind.COLL_ALLTOALL, exc)
                raise
            rc = ctx.run_python(lambda call: ctx.alltoall.run_sized(call, row_nb, plan, out_addr),
                                Call(addr, row_n, fmt, code, "alltoall"))
            if rc:
                ctx.raise_status(rc, addr, row_n, fmt, code, "alltoall")
        elif ctx.alltoall is not None:  # several nodes: the Python algorithm
            got = []
            rc = ctx.run_python(lambda call: got.append(ctx.alltoall.run(call, row_nb, plan,
                                                                         make_out)),
                                Call(addr, row_n, fmt, code, "alltoall"))
            if rc:
                ctx.raise_status(rc, addr, row_n, fmt, code, "alltoall")
            result = got[0]
        elif expect_total is not None:  # the output's size is known: one call
            try:
                result, out_addr = make_out(expect_total)
            except HarmpiArgumentError as exc:
                refuse(ctx.comm, kind.COLL_ALLTOALL, exc)
                raise
            rc = _a2a.ALLTOALL_STEP(ctx.ctl, addr, out_addr, row_nb, plan, code)
            _a2a_status(ctx, rc, plan, P, addr, row_n, fmt, code)
        else:
            result = _start_finish(ctx, plan, P, addr, row_nb, row_n, fmt, code, make_out)
    except KeyboardInterrupt:
        ctx.interrupted()
        raise
    return result


def _native_allgather_failed(x, rc):
    addr, n, fmt, _ = _describe(x, None, False)
    code = kind.encode(fmt=fmt, coll=kind.COLL_ALLGATHER, digest=_shape_digest(x.shape))
    _STATE.world.raise_status(rc, addr, n, fmt, code, "allgather")


def _native_alltoall_failed(x, rc):
    addr, n, fmt, _ = _describe(x, None, False)
    _, row_n, _, code = _a2a_kind(x.shape, fmt)
    ctx = _STATE.world
    if rc <= _NATIVE_BAD_PAIR_BASE:
        raise _a2a.pair_error(ctx.topo.rank, "alltoall",
                              *divmod(_NATIVE_BAD_PAIR_BASE - rc, ctx.topo.size))
    if ctx.alltoall is not None:  # (several nodes: the algorithm says what failed)
        rc = ctx.alltoall.native_failed(Call(addr, row_n, fmt, code, "alltoall"), rc)
    ctx.raise_status(rc, addr, row_n, fmt, code, "alltoall")


#: harmpi._C.alltoall returns this minus the first bad (sender * n + receiver)
#: pair when a rank split unevenly (_native.cpp)
_NATIVE_BAD_PAIR_BASE = -4

_A2A_KINDS = {}


def _a2a_kind(shape, fmt):
    """(rows, elements per row, bytes per row, kind word) of an all-to-all
    of ``shape`` in format ``fmt`` (cached: a decode loop repeats its shapes)."""
    key = (shape, fmt)
    got = _A2A_KINDS.get(key)
    if got is None:
        if not shape:
            raise HarmpiArgumentError("alltoall needs rows: x has no dimensions "
                                      "(pass x.reshape(1))")
        row_n = 1
        for d in shape[1:]:
            row_n *= d
        code = kind.encode(fmt=fmt, coll=kind.COLL_ALLTOALL,
                           digest=kind.shape_digest(tuple(shape[1:])))
        if len(_A2A_KINDS) > 1024:
            _A2A_KINDS.clear()
        got = _A2A_KINDS[key] = (shape[0], row_n, row_n * dtypes.FORMATS[fmt].itemsize, code)
    return got


def _fill_plan(plan, P, rows, send_counts, recv_counts):
    """Checked counts into the plan; returns the rows this rank will receive
    if it is known before the exchange (else None)."""
    if send_counts is None:
        if rows % P:
            raise HarmpiArgumentError(
                f"alltoall without send_counts splits x evenly: x.shape[0]={rows} is not a "
                f"multiple of the {P} ranks (pass send_counts)")
        if recv_counts is not None:
            raise HarmpiArgumentError("recv_counts is only for calls with send_counts")
        plan[_plan.even_rows_at(P)] = rows // P
        return rows
    plan[_plan.even_rows_at(P)] = -1
    _plan.send(plan, P)[:] = _counts(send_counts, P, "send_counts")
    total = int(_plan.send(plan, P).sum())
    if total != rows:
        raise HarmpiArgumentError(f"send_counts sum to {total} rows, x has {rows}")
    if recv_counts is None:
        _plan.expect(plan, P)[:] = -1
        return None
    _plan.expect(plan, P)[:] = _counts(recv_counts, P, "recv_counts")
    return int(_plan.expect(plan, P).sum())


def _counts(counts, P, name):
    try:
        values = np.asarray(counts.tolist() if hasattr(counts, "tolist") else counts)
    except (TypeError, ValueError):
        values = None
    if values is None or values.ndim != 1 or values.dtype.kind not in "iu" or len(values) != P:
        raise HarmpiArgumentError(f"{name} must be {P} integers (one per rank), got {counts!r}")
    if (values < 0).any():
        raise HarmpiArgumentError(f"{name} must be >= 0, got {values.tolist()}")
    if (values > _COUNT_MAX).any():
        # (larger counts overflow the sums and sizes derived from them)
        raise HarmpiArgumentError(f"{name} must be at most 2**48 rows each, got "
                                  f"{values.tolist()}")
    return values


#: the most rows one count may name (2**48: far beyond any memory, and the
#: sums of a communicator's counts times a row's bytes stay within int64)
_COUNT_MAX = 1 << 48


def _rows_out(x, out, total_rows, row_n, fmt, is_torch, dtype, x_addr, x_n):
    """(out, its address) for ``total_rows`` rows of x's row shape."""
    if out is None:
        if is_torch:
            out = _STATE.torch.empty_rows(x, total_rows)
        else:
            out = np.empty((total_rows,) + x.shape[1:], dtype=x.dtype)
    out_addr, out_n, out_fmt, out_torch = _describe(out, dtype, True)
    want = total_rows * row_n
    if out_torch != is_torch or out_fmt != fmt or out_n != want:
        raise HarmpiArgumentError(
            f"out must be a {'tensor' if is_torch else 'numpy array'} of x's dtype with {want} "
            f"elements ({total_rows} rows received); got {type(out).__name__} of {out_n} "
            "elements" + ("" if out_fmt == fmt else " and another dtype"))
    isz = dtypes.FORMATS[fmt].itemsize
    if want and x_n and out_addr < x_addr + x_n * isz and x_addr < out_addr + want * isz:
        raise HarmpiArgumentError("out overlaps x; alltoall needs a separate output")
    return out, out_addr


def _start_finish(ctx, plan, P, addr, row_nb, row_n, fmt, code, make_out):
    """One node, the output sized from the exchanged counts: start, make
    out, finish (which takes part without copying if making out failed)."""
    rc = _a2a.ALLTOALL_START(ctx.ctl, addr, row_nb, plan, code)
    if rc:
        ctx.raise_status(rc, addr, row_n, fmt, code, "alltoall")
    result, out_addr = None, 0
    try:
        if plan[_plan.bad_pair_at(P)] < 0:
            result, out_addr = make_out(int(_plan.recv(plan, P).sum()))
    except BaseException:
        # the peers are inside the steps that remain: take part, then raise
        rc = _a2a.ALLTOALL_FINISH(ctx.ctl, addr, 0, row_nb, plan, code)
        if rc:
            ctx.raise_status(rc, addr, row_n, fmt, code, "alltoall")
        raise
    rc = _a2a.ALLTOALL_FINISH(ctx.ctl, addr, out_addr, row_nb, plan, code)
    _a2a_status(ctx, rc, plan, P, addr, row_n, fmt, code)
    return result


def _a2a_status(ctx, rc, plan, P, addr, row_n, fmt, code):
    if rc:
        ctx.raise_status(rc, addr, row_n, fmt, code, "alltoall")
    bad = _a2a.pair_mismatch(plan, P)
    if bad is not None:
        raise _a2a.pair_error(ctx.topo.rank, "alltoall", *bad)


def barrier(comm: MPI.Comm | None = None) -> None:
    """Wait until every rank of ``comm`` has called barrier (node flags + rail)."""
    allreduce(np.zeros(1, np.float32), comm=comm, algorithm="auto")


_THREAD_LEVELS = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                  MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}


def info(comm: MPI.Comm | None = None) -> dict[str, Any]:
    """What harmpi knows about ``comm``: topology, transport and thresholds (a dict).

    ``"thresholds"`` holds the switches auto runs with; ``"model"`` the cost
    model behind them: its constants, their source (a file or the built-in
    defaults), which switches it set (``switches_set_by``; a set
    HARMPI_SMALL_MAX_BYTES / HARMPI_HAR_LATENCY_MAX_BYTES overrides it) and
    auto's choice per size from 2 KiB to 4 MiB on this topology."""
    _STATE.check_open()  # (a context made before MPI_Finalize is still known)
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
        "thresholds": {"small_max_nbytes": ctx.thresholds.small_max_nbytes,
                       "har_latency_max_nbytes": ctx.thresholds.har_latency_max_nbytes,
                       "slot_nbytes": cfg.slot_nbytes,
                       "logits_allreduce_max_nbytes": cfg.logits_allreduce_max_nbytes},
        "model": switches.describe(ctx.switches),
        "logits_route": cfg.logits_route,
        "spin_count": ctx.spin_count,
        "wait": ctx.wait_description(),
        "stream_stores": cfg.stream_stores,
        "oversubscribed": ctx.oversubscribed,
        "timeout_s": cfg.timeout_s,
        "native": _native_status(ctx),
        "allgather": ctx.cma_note,
    }


def _entry_name(entry):
    name = getattr(entry, "name", None) or getattr(entry, "__name__", None)
    return name or type(entry).__name__


def _native_status(ctx):
    if not ctx.config.native:
        return "off (HARMPI_NATIVE=0 or Config(native=False))"
    if ctx is _STATE.world and _STATE.native is not None:
        return "serving harmpi.allreduce(t) for this context"
    if ctx is _STATE.world and _STATE.native_alltoall is not None:
        return ("harmpi.alltoall(t) (an even split) served for this context; "
                "harmpi.allreduce(t) takes its Python path (several nodes)")
    status = _native_module.status()
    if status == "loaded":
        return ("loaded; not serving this context (it serves the world communicator's "
                "compiled entry)")
    return status


# the torch operators' Python path (harmpi.native sits below this module)
_native_module.use_python_path(allreduce, native_failed)
