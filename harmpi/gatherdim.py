"""``harmpi.allgather(x, dim)`` for a dim other than 0.

:func:`allgather_dim` serves ``harmpi.allgather(x, dim)`` for dim != 0.
When every dimension before ``dim`` has size 1 the layouts of the dim-0 and
the dim result coincide: the dim-0 allgather writes the result directly, at
its cost. Otherwise the allgather lands in a per-communicator scratch buffer
and one compiled strided copy (n * outer memcpy's of x.shape[dim] * inner
elements, outer/inner: the product of the dimensions before/after dim) moves
it into place: n * x.nbytes bytes more read and written, plus a few us of
Python around the collective (one rank, a (4, 1280) bf16 tensor, on a
loaded 2-core VM: dim 1 took 6-8 us more than dim 0, copy included).
"""

from __future__ import annotations

import math

import numpy as np

from .args import context, describe, shape_digest
from .base import dtypes
from .errors import HarmpiArgumentError
from .logits import PLANS_MAX, empty_like, gather_raw, state_of
from .node.rowcopy import copy_rows, make_plan

__all__ = ["normalize_dim", "allgather_dim"]


def normalize_dim(dim, ndim):
    """``dim`` as an index in [0, ndim) (negative counts from the end; a 0-d
    tensor counts as 1-d), or HarmpiArgumentError."""
    if isinstance(dim, bool) or not hasattr(dim, "__index__"):
        raise HarmpiArgumentError(f"dim must be an integer, got {dim!r}")
    d = dim.__index__()
    ndim = max(ndim, 1)
    if not -ndim <= d < ndim:
        raise HarmpiArgumentError(f"dim={d} is out of range for a {ndim}-d input "
                                  f"(expected {-ndim} <= dim < {ndim})")
    return d % ndim


def allgather_dim(x, dim, comm, dtype, out):
    """``harmpi.allgather(x, dim, ...)`` for a dim that is not dimension 0
    (harmpi.api's allgather takes that itself; see the module docstring)."""
    shape = tuple(x.shape) or (1,)
    d = normalize_dim(dim, len(shape))
    addr, count, fmt, is_torch = describe(x, dtype, False)
    ctx = context(comm)
    n = ctx.topo.size
    res_shape = shape[:d] + (shape[d] * n,) + shape[d + 1:]
    if out is None:
        out = empty_like(x, res_shape, is_torch)
    o_addr, _, o_fmt, o_torch = describe(out, dtype, True)
    if o_torch != is_torch or o_fmt != fmt or tuple(out.shape) != res_shape:
        raise HarmpiArgumentError(
            f"out must be a {'tensor' if is_torch else 'numpy array'} of x's dtype and shape "
            f"{res_shape} (x's shape with dim {d} times {n}); got {type(out).__name__} of shape "
            f"{tuple(out.shape)}" + ("" if o_fmt == fmt else " and another dtype"))
    digest = shape_digest((shape, d))
    outer = math.prod(shape[:d])
    if outer == 1 or count == 0:  # the dim-0 layout is the result's
        gather_raw(ctx, addr, o_addr, count, fmt, digest, "allgather")
        return out
    isz = dtypes.FORMATS[fmt].itemsize
    st = state_of(ctx)
    st.enter("allgather")
    try:
        buf = st.scratch(n * count * isz)
        gather_raw(ctx, addr, buf, count, fmt, digest, "allgather")
        copy_rows(buf, o_addr, outer, _dim_plan(st, count // outer * isz, outer, n))
    finally:
        st.lock.release()
    return out


def _dim_plan(st, seg, outer, n):
    """copy_rows arguments from n blocks of (outer, seg bytes) to (outer, n*seg)."""
    key = (seg, outer, n)
    plan = st.plans.get(key)
    if plan is None:
        if len(st.plans) > PLANS_MAX:
            st.plans.clear()
        plan = st.plans[key] = make_plan(seg, np.arange(n) * outer * seg, seg,
                                         np.arange(n) * seg, n * seg)
    return plan
