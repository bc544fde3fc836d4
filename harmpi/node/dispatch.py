"""The dtype dispatch of the node's steps, resolved at compile time.

A step is compiled once per storage type (uint16 for bf16/f16, float32,
float64), selected by a zero-length *witness* array ``w`` of that type;
``sigs`` lists one signature per storage type. Inside, ``sum_rows``,
``sum_rows_x`` and ``sum2`` pick the harmpi.reduce kernel of the array's
type (and, on uint16, of ``fmt``: bf16 or f16), so a step has no dtype
branch at run time beyond that one word.
"""

from __future__ import annotations

import numba
from numba import types
from numba.extending import overload

from .. import reduce as _reduce
from ..base import dtypes

__all__ = ["sigs", "sum_rows", "sum_rows_x", "sum2", "format_itemsize"]

_BF16, _F16, _F32 = dtypes.BF16, dtypes.F16, dtypes.F32


def sigs(ret, *args):
    """One signature per storage type; ``W`` in args stands for the witness array."""
    storages = sorted({f.storage for f in dtypes.FORMATS}, key=lambda d: d.itemsize)
    return [ret(*[numba.from_dtype(t)[::1] if a == "W" else a for a in args]) for t in storages]


def sum_rows(src, lo, hi, out, out_lo, fmt):  # pragma: no cover - typing stub
    """out[out_lo:][:hi-lo] = sum of src's rows over [lo, hi) (reduce.sum_rows_*)."""
    raise NotImplementedError("compiled-only dispatch")


def sum_rows_x(src, lo, hi, me, x, out, out2, out_lo, fmt):  # pragma: no cover - stub
    """sum_rows with row ``me`` read from x, the result to out and out2 (reduce.sum_rows_x_*)."""
    raise NotImplementedError("compiled-only dispatch")


def sum2(a, b, out, fmt):  # pragma: no cover - typing stub
    """out = a + b (reduce.sum2_*)."""
    raise NotImplementedError("compiled-only dispatch")


@overload(sum_rows)
def _ov_sum_rows(src, lo, hi, out, out_lo, fmt):
    if src.dtype == types.uint16:
        def impl(src, lo, hi, out, out_lo, fmt):
            if fmt == _F16:
                _reduce.sum_rows_f16(src, lo, hi, out, out_lo)
            else:
                _reduce.sum_rows_bf16(src, lo, hi, out, out_lo)
        return impl
    if src.dtype == types.float32:
        return lambda src, lo, hi, out, out_lo, fmt: _reduce.sum_rows_f32(src, lo, hi, out, out_lo)
    if src.dtype == types.float64:
        return lambda src, lo, hi, out, out_lo, fmt: _reduce.sum_rows_f64(src, lo, hi, out, out_lo)


@overload(sum_rows_x)
def _ov_sum_rows_x(src, lo, hi, me, x, out, out2, out_lo, fmt):
    if src.dtype == types.uint16:
        def impl(src, lo, hi, me, x, out, out2, out_lo, fmt):
            if fmt == _F16:
                _reduce.sum_rows_x_f16(src, lo, hi, me, x, out, out2, out_lo)
            else:
                _reduce.sum_rows_x_bf16(src, lo, hi, me, x, out, out2, out_lo)
        return impl
    if src.dtype == types.float32:
        return lambda src, lo, hi, me, x, out, out2, out_lo, fmt: _reduce.sum_rows_x_f32(
            src, lo, hi, me, x, out, out2, out_lo)
    if src.dtype == types.float64:
        return lambda src, lo, hi, me, x, out, out2, out_lo, fmt: _reduce.sum_rows_x_f64(
            src, lo, hi, me, x, out, out2, out_lo)


@overload(sum2)
def _ov_sum2(a, b, out, fmt):
    if a.dtype == types.uint16:
        def impl(a, b, out, fmt):
            if fmt == _F16:
                _reduce.sum2_f16(a, b, out)
            else:
                _reduce.sum2_bf16(a, b, out)
        return impl
    if a.dtype == types.float32:
        return lambda a, b, out, fmt: _reduce.sum2_f32(a, b, out)
    if a.dtype == types.float64:
        return lambda a, b, out, fmt: _reduce.sum2_f64(a, b, out)


@numba.njit(cache=True, nogil=True)
def format_itemsize(fmt):
    if fmt == _BF16 or fmt == _F16:
        return 2
    return 4 if fmt == _F32 else 8
