"""The sum kernels: block loops shared by the typed kernels, and the kernels.

The contract (dtypes, summation order, rounding, error bounds, signatures)
is harmpi.reduce's docstring.

Implementation notes
--------------------
The element loops are written so that LLVM vectorizes them. A block of up to
256 elements (256 pairs for bf16) of every input is summed into a float
accumulator on the stack before any output of that block is stored. That is
what makes ``out`` aliasing an input safe, and since a stack buffer provably
aliases nothing, the vector loops need no runtime overlap checks (which would
send the aliased case to the scalar loop, ~10x slower). bf16 (and f16 on the
bit-level path) is read and written as 32-bit words of two elements (little
endian: element 2p in the low half), so widening is one shift or mask and
narrowing needs no lane shuffles; an odd last element is summed on its own.
These word views may be unaligned and are typed so. Views and scratch carry
no reference count, so a call makes no atomic operations per block.
``sum_rows_x`` is the same block loop; its row views pick ``x`` or ``src[j]``
by a pointer select inside the view intrinsic (an njit helper returning
either view would cost two atomic reference count updates per view, which
made the kernel ~50% slower), and each block's results go to ``out`` and
``out2`` from one loop (two stores per element: ~5-10% on large messages).
"""

import numba
import numpy as np

from ..base import dtypes
from .convert import dec_hi, dec_lo, dec_one, enc_one, enc_pair
from .primitives import (
    BLOCK,
    HARDWARE_F16,
    narrow_like,
    row_view,
    row_view_pairs,
    scratch_acc,
    scratch_f32,
    view,
    view_pairs,
    widen,
)

__all__ = ["SUM2", "SUM_ROWS", "SUM_ROWS_X", "sum2_bf16", "sum2_f16", "sum2_f32", "sum2_f64",
           "sum_rows_bf16", "sum_rows_f16", "sum_rows_f32", "sum_rows_f64", "sum_rows_x_bf16",
           "sum_rows_x_f16", "sum_rows_x_f32", "sum_rows_x_f64", "warm_up"]

_KERNEL_OPTIONS = dict(
    cache=True, nogil=True, fastmath=False, error_model="numpy", boundscheck=False
)

_SIG_ROWS_U16 = "void(uint16[:, ::1], intp, intp, uint16[::1], intp)"
_SIG_ROWS_F32 = "void(float32[:, ::1], intp, intp, float32[::1], intp)"
_SIG_ROWS_F64 = "void(float64[:, ::1], intp, intp, float64[::1], intp)"
_SIG_ROWS_X_U16 = (
    "void(uint16[:, ::1], intp, intp, intp, uint16[::1], uint16[::1], uint16[::1], intp)"
)
_SIG_ROWS_X_F32 = (
    "void(float32[:, ::1], intp, intp, intp, float32[::1], float32[::1], float32[::1], intp)"
)
_SIG_ROWS_X_F64 = (
    "void(float64[:, ::1], intp, intp, intp, float64[::1], float64[::1], float64[::1], intp)"
)
_SIG_SUM2_U16 = "void(uint16[::1], uint16[::1], uint16[::1])"
_SIG_SUM2_F32 = "void(float32[::1], float32[::1], float32[::1])"
_SIG_SUM2_F64 = "void(float64[::1], float64[::1], float64[::1])"


# ---------------------------------------------------------------------------
# Kernel bodies, shared by the typed kernels below.
# ---------------------------------------------------------------------------


@numba.njit
def _check_rows(k, ncols, lo, hi, nout, out_lo):
    if k < 1:
        raise ValueError("sum_rows: src has no rows")
    if lo < 0 or hi < lo or hi > ncols:
        raise ValueError("sum_rows: need 0 <= lo <= hi <= src.shape[1]")
    if out_lo < 0 or out_lo > nout - (hi - lo):
        raise ValueError("sum_rows: out[out_lo : out_lo + hi - lo] is out of bounds")


@numba.njit
def _sum2_pairs(a, b, out, f16):
    n = out.shape[0]
    if a.shape[0] < n or b.shape[0] < n:
        raise ValueError("sum2: a and b must be at least as long as out")
    npairs = n // 2
    acc_lo = scratch_f32()  # even elements
    acc_hi = scratch_f32()  # odd elements
    for p0 in range(0, npairs, BLOCK):
        m = min(BLOCK, npairs - p0)
        ra = view_pairs(a, 0, 2 * p0, m)
        rb = view_pairs(b, 0, 2 * p0, m)
        for p in range(m):
            wa = ra[p]
            wb = rb[p]
            acc_lo[p] = dec_lo(wa, f16) + dec_lo(wb, f16)
            acc_hi[p] = dec_hi(wa, f16) + dec_hi(wb, f16)
        o = view_pairs(out, 0, 2 * p0, m)
        for p in range(m):
            o[p] = enc_pair(acc_lo[p], acc_hi[p], f16)
    if n & 1:
        out[n - 1] = enc_one(dec_one(a[n - 1], f16) + dec_one(b[n - 1], f16), f16)


@numba.njit
def _sum2_plain(a, b, out):
    n = out.shape[0]
    if a.shape[0] < n or b.shape[0] < n:
        raise ValueError("sum2: a and b must be at least as long as out")
    acc = scratch_acc(out)
    for b0 in range(0, n, BLOCK):
        m = min(BLOCK, n - b0)
        ra = view(a, 0, b0, m)
        rb = view(b, 0, b0, m)
        for i in range(m):
            acc[i] = widen(ra[i]) + widen(rb[i])
        o = view(out, 0, b0, m)
        for i in range(m):
            o[i] = narrow_like(acc[i], out)


# One body per storage layout serves both kernel families: sum_rows passes
# me = -1 (no row is substituted, x is never read, one store per block);
# sum_rows_x passes 0 <= me < k (row me is read from x, and each block's
# result is stored to out and out2).


@numba.njit
def _check_me(me, k):
    # me < 0 means "no substitution" inside the shared bodies, so the public
    # sum_rows_x kernels reject it before reaching them
    if me < 0 or me >= k:
        raise ValueError("sum_rows_x: need 0 <= me < src.shape[0]")


@numba.njit
def _check_rows_x(k, ncols, lo, hi, me, nx, nout, nout2, out_lo):
    if k < 1:
        raise ValueError("sum_rows_x: src has no rows")
    if lo < 0 or hi < lo or hi > ncols:
        raise ValueError("sum_rows_x: need 0 <= lo <= hi <= src.shape[1]")
    if hi > nx:
        raise ValueError("sum_rows_x: x is shorter than hi")
    if out_lo < 0 or out_lo > nout - (hi - lo):
        raise ValueError("sum_rows_x: out[out_lo : out_lo + hi - lo] is out of bounds")
    if out_lo > nout2 - (hi - lo):
        raise ValueError("sum_rows_x: out2[out_lo : out_lo + hi - lo] is out of bounds")


@numba.njit
def _check_args(src, lo, hi, me, x, out, out2, out_lo):
    """The bounds checks of a row sum: sum_rows (me < 0) or sum_rows_x."""
    if me < 0:
        _check_rows(src.shape[0], src.shape[1], lo, hi, out.shape[0], out_lo)
    else:
        _check_rows_x(src.shape[0], src.shape[1], lo, hi, me, x.shape[0], out.shape[0],
                      out2.shape[0], out_lo)


@numba.njit
def _rows_pairs(src, lo, hi, me, x, out, out2, out_lo, f16):  # noqa: C901 - one vector loop per row count 1-4; a helper per case would take the arrays by reference (refcounts per block)
    """The row sum for 16-bit values read and written two per uint32 word."""
    k = src.shape[0]
    _check_args(src, lo, hi, me, x, out, out2, out_lo)
    n = hi - lo
    npairs = n // 2
    acc_lo = scratch_f32()  # even elements
    acc_hi = scratch_f32()  # odd elements
    for p0 in range(0, npairs, BLOCK):
        m = min(BLOCK, npairs - p0)
        s = lo + 2 * p0
        # Every input of the block into acc, then the stores: out may be a
        # row of src and out2 may be x.
        r0 = row_view_pairs(src, x, me, 0, s, m)
        if k == 1:
            for p in range(m):
                w0 = r0[p]
                acc_lo[p] = dec_lo(w0, f16)
                acc_hi[p] = dec_hi(w0, f16)
        elif k == 2:
            r1 = row_view_pairs(src, x, me, 1, s, m)
            for p in range(m):
                w0 = r0[p]
                w1 = r1[p]
                acc_lo[p] = dec_lo(w0, f16) + dec_lo(w1, f16)
                acc_hi[p] = dec_hi(w0, f16) + dec_hi(w1, f16)
        elif k == 3:
            r1 = row_view_pairs(src, x, me, 1, s, m)
            r2 = row_view_pairs(src, x, me, 2, s, m)
            for p in range(m):
                w0 = r0[p]
                w1 = r1[p]
                w2 = r2[p]
                acc_lo[p] = dec_lo(w0, f16) + dec_lo(w1, f16) + dec_lo(w2, f16)
                acc_hi[p] = dec_hi(w0, f16) + dec_hi(w1, f16) + dec_hi(w2, f16)
        else:
            r1 = row_view_pairs(src, x, me, 1, s, m)
            r2 = row_view_pairs(src, x, me, 2, s, m)
            r3 = row_view_pairs(src, x, me, 3, s, m)
            for p in range(m):
                w0 = r0[p]
                w1 = r1[p]
                w2 = r2[p]
                w3 = r3[p]
                acc_lo[p] = (
                    dec_lo(w0, f16) + dec_lo(w1, f16) + dec_lo(w2, f16) + dec_lo(w3, f16)
                )
                acc_hi[p] = (
                    dec_hi(w0, f16) + dec_hi(w1, f16) + dec_hi(w2, f16) + dec_hi(w3, f16)
                )
        for j in range(4, k):
            rj = row_view_pairs(src, x, me, j, s, m)
            for p in range(m):
                w = rj[p]
                acc_lo[p] += dec_lo(w, f16)
                acc_hi[p] += dec_hi(w, f16)
        o = view_pairs(out, 0, out_lo + 2 * p0, m)
        if me < 0:
            for p in range(m):
                o[p] = enc_pair(acc_lo[p], acc_hi[p], f16)
        else:
            o2 = view_pairs(out2, 0, out_lo + 2 * p0, m)
            for p in range(m):
                w = enc_pair(acc_lo[p], acc_hi[p], f16)
                o[p] = w
                o2[p] = w
    if n & 1:  # odd length: the last element on its own
        i = hi - 1
        v = dec_one(x[i] if me == 0 else src[0, i], f16)
        for j in range(1, k):
            v += dec_one(x[i] if j == me else src[j, i], f16)
        h = enc_one(v, f16)
        out[out_lo + n - 1] = h
        if me >= 0:
            out2[out_lo + n - 1] = h


@numba.njit
def _rows_plain(src, lo, hi, me, x, out, out2, out_lo):  # noqa: C901 - one vector loop per row count 1-4; a helper per case would take the arrays by reference (refcounts per block)
    """The row sum for one stored value per element: float32, float64, and
    f16 with hardware conversions."""
    k = src.shape[0]
    _check_args(src, lo, hi, me, x, out, out2, out_lo)
    n = hi - lo
    acc = scratch_acc(src)
    for b0 in range(0, n, BLOCK):
        m = min(BLOCK, n - b0)
        s = lo + b0
        # Every input of the block into acc, then the stores: out may be a
        # row of src and out2 may be x.
        r0 = row_view(src, x, me, 0, s, m)
        if k == 1:
            for i in range(m):
                acc[i] = widen(r0[i])
        elif k == 2:
            r1 = row_view(src, x, me, 1, s, m)
            for i in range(m):
                acc[i] = widen(r0[i]) + widen(r1[i])
        elif k == 3:
            r1 = row_view(src, x, me, 1, s, m)
            r2 = row_view(src, x, me, 2, s, m)
            for i in range(m):
                acc[i] = widen(r0[i]) + widen(r1[i]) + widen(r2[i])
        else:
            r1 = row_view(src, x, me, 1, s, m)
            r2 = row_view(src, x, me, 2, s, m)
            r3 = row_view(src, x, me, 3, s, m)
            for i in range(m):
                acc[i] = widen(r0[i]) + widen(r1[i]) + widen(r2[i]) + widen(r3[i])
        for j in range(4, k):
            rj = row_view(src, x, me, j, s, m)
            for i in range(m):
                acc[i] += widen(rj[i])
        o = view(out, 0, out_lo + b0, m)
        if me < 0:
            for i in range(m):
                o[i] = narrow_like(acc[i], out)
        else:
            o2 = view(out2, 0, out_lo + b0, m)
            for i in range(m):
                v = narrow_like(acc[i], out)
                o[i] = v
                o2[i] = v


@numba.njit
def _sum_rows_pairs(src, lo, hi, out, out_lo, f16):
    _rows_pairs(src, lo, hi, -1, out, out, out, out_lo, f16)


@numba.njit
def _sum_rows_x_pairs(src, lo, hi, me, x, out, out2, out_lo, f16):
    _check_me(me, src.shape[0])
    _rows_pairs(src, lo, hi, me, x, out, out2, out_lo, f16)


@numba.njit
def _sum_rows_plain(src, lo, hi, out, out_lo):
    _rows_plain(src, lo, hi, -1, out, out, out, out_lo)


@numba.njit
def _sum_rows_x_plain(src, lo, hi, me, x, out, out2, out_lo):
    _check_me(me, src.shape[0])
    _rows_plain(src, lo, hi, me, x, out, out2, out_lo)


@numba.njit
def _sum_rows_f16_bits(src, lo, hi, out, out_lo):
    _sum_rows_pairs(src, lo, hi, out, out_lo, True)


@numba.njit
def _sum2_f16_bits(a, b, out):
    _sum2_pairs(a, b, out, True)


@numba.njit
def _sum_rows_x_f16_bits(src, lo, hi, me, x, out, out2, out_lo):
    _sum_rows_x_pairs(src, lo, hi, me, x, out, out2, out_lo, True)


# Chosen here rather than by a branch in the kernels, so that no half-precision
# instruction is ever generated for a target without them.
_sum_rows_f16_body = _sum_rows_plain if HARDWARE_F16 else _sum_rows_f16_bits
_sum_rows_x_f16_body = _sum_rows_x_plain if HARDWARE_F16 else _sum_rows_x_f16_bits
_sum2_f16_body = _sum2_plain if HARDWARE_F16 else _sum2_f16_bits


# ---------------------------------------------------------------------------
# Public kernels.
# ---------------------------------------------------------------------------


@numba.njit(_SIG_ROWS_U16, **_KERNEL_OPTIONS)
def sum_rows_bf16(src, lo, hi, out, out_lo):
    """out[out_lo + i - lo] = bf16(sum_j f32(src[j, i])) for i in [lo, hi); uint16 bits."""
    _sum_rows_pairs(src, lo, hi, out, out_lo, False)


@numba.njit(_SIG_ROWS_U16, **_KERNEL_OPTIONS)
def sum_rows_f16(src, lo, hi, out, out_lo):
    """out[out_lo + i - lo] = f16(sum_j f32(src[j, i])) for i in [lo, hi); uint16 bits."""
    _sum_rows_f16_body(src, lo, hi, out, out_lo)


@numba.njit(_SIG_ROWS_F32, **_KERNEL_OPTIONS)
def sum_rows_f32(src, lo, hi, out, out_lo):
    """out[out_lo + i - lo] = sum_j src[j, i] in float32, for i in [lo, hi)."""
    _sum_rows_plain(src, lo, hi, out, out_lo)


@numba.njit(_SIG_ROWS_F64, **_KERNEL_OPTIONS)
def sum_rows_f64(src, lo, hi, out, out_lo):
    """out[out_lo + i - lo] = sum_j src[j, i] in float64, for i in [lo, hi)."""
    _sum_rows_plain(src, lo, hi, out, out_lo)


@numba.njit(_SIG_ROWS_X_U16, **_KERNEL_OPTIONS)
def sum_rows_x_bf16(src, lo, hi, me, x, out, out2, out_lo):
    """sum_rows_bf16 with row me read from x; the result to out and out2."""
    _sum_rows_x_pairs(src, lo, hi, me, x, out, out2, out_lo, False)


@numba.njit(_SIG_ROWS_X_U16, **_KERNEL_OPTIONS)
def sum_rows_x_f16(src, lo, hi, me, x, out, out2, out_lo):
    """sum_rows_f16 with row me read from x; the result to out and out2."""
    _sum_rows_x_f16_body(src, lo, hi, me, x, out, out2, out_lo)


@numba.njit(_SIG_ROWS_X_F32, **_KERNEL_OPTIONS)
def sum_rows_x_f32(src, lo, hi, me, x, out, out2, out_lo):
    """sum_rows_f32 with row me read from x; the result to out and out2."""
    _sum_rows_x_plain(src, lo, hi, me, x, out, out2, out_lo)


@numba.njit(_SIG_ROWS_X_F64, **_KERNEL_OPTIONS)
def sum_rows_x_f64(src, lo, hi, me, x, out, out2, out_lo):
    """sum_rows_f64 with row me read from x; the result to out and out2."""
    _sum_rows_x_plain(src, lo, hi, me, x, out, out2, out_lo)


@numba.njit(_SIG_SUM2_U16, **_KERNEL_OPTIONS)
def sum2_bf16(a, b, out):
    """out[i] = bf16(f32(a[i]) + f32(b[i])) for i < len(out); uint16 bits."""
    _sum2_pairs(a, b, out, False)


@numba.njit(_SIG_SUM2_U16, **_KERNEL_OPTIONS)
def sum2_f16(a, b, out):
    """out[i] = f16(f32(a[i]) + f32(b[i])) for i < len(out); uint16 bits."""
    _sum2_f16_body(a, b, out)


@numba.njit(_SIG_SUM2_F32, **_KERNEL_OPTIONS)
def sum2_f32(a, b, out):
    """out[i] = a[i] + b[i] in float32 for i < len(out)."""
    _sum2_plain(a, b, out)


@numba.njit(_SIG_SUM2_F64, **_KERNEL_OPTIONS)
def sum2_f64(a, b, out):
    """out[i] = a[i] + b[i] in float64 for i < len(out)."""
    _sum2_plain(a, b, out)


SUM_ROWS = {
    "bf16": sum_rows_bf16,
    "f16": sum_rows_f16,
    "f32": sum_rows_f32,
    "f64": sum_rows_f64,
}

SUM_ROWS_X = {
    "bf16": sum_rows_x_bf16,
    "f16": sum_rows_x_f16,
    "f32": sum_rows_x_f32,
    "f64": sum_rows_x_f64,
}

SUM2 = {
    "bf16": sum2_bf16,
    "f16": sum2_f16,
    "f32": sum2_f32,
    "f64": sum2_f64,
}

def warm_up():
    """Run every kernel once on a few elements.

    The explicit signatures already compile (or load from the on-disk cache)
    at import; this makes sure each one has run, so the first timed
    collective pays nothing.
    """
    for f in dtypes.FORMATS:
        name = f.name
        src = np.zeros((2, 3), f.storage)
        out = np.zeros(3, f.storage)
        SUM_ROWS[name](src, 0, 3, out, 0)
        SUM_ROWS_X[name](src, 0, 3, 1, out.copy(), out, out.copy(), 0)
        SUM2[name](src[0], src[1], out)
