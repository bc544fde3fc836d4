"""Compiled sum kernels: add k equally long inputs into one output.

This module holds only compute: numpy and numba, no MPI, no torch. The
collectives call these kernels from their own compiled code (arrays built with
``numba.carray``) or from Python.

Dtypes and storage
------------------
========  ===========================  ===========  ============================
name      stored as                    accumulator  result rounding
========  ===========================  ===========  ============================
``bf16``  ``uint16`` (raw bfloat16)    float32      once, round-to-nearest-even
``f16``   ``uint16`` (raw IEEE binary16) float32    once, round-to-nearest-even
``f32``   ``float32``                  float32      every add (IEEE)
``f64``   ``float64``                  float64      every add (IEEE)
========  ===========================  ===========  ============================

bf16 and f16 travel as their raw 16-bit patterns because numba has no 16-bit
float type. They are widened to float32 exactly (f16 subnormals, infinities
and NaNs included) by bit manipulation, summed, and narrowed once.

Summation order
---------------
For every element i, ``sum_rows_<dt>`` computes::

    acc = x[0, i]; acc = acc + x[1, i]; ...; acc = acc + x[k-1, i]
    out[i] = round(acc)

in exactly this row order, each ``+`` rounding to the accumulator type. The
compiled code uses no fast-math, no reassociation and no FMA contraction, so
the result bits depend only on the inputs: every process that sums the same
rows gets the same bits, whichever process it is.

Rounding to bf16 / f16
----------------------
Round-to-nearest, ties-to-even, on the float32 accumulator; values beyond the
largest finite value round to +/-Inf exactly as IEEE 754 prescribes (bf16:
|acc| >= 2**128 * (1 - 2**-9); f16: |acc| >= 65520); results in the subnormal
range are rounded correctly (no flush to zero); signed zeros are kept. NaN
stays NaN and comes out quiet: bf16 keeps the sign and the top payload bits
and sets the quiet bit, f16 gives the canonical ``0x7E00`` with the sign.
Inf + (-Inf) is NaN. When several inputs of an element are NaN, which one's
sign and payload survive is left to the hardware (IEEE 754 does not say).

Error bound (bf16 and f16)
--------------------------
Let ``s*`` be the exact real sum of the k inputs of an element and ``s`` the
float32 accumulator. With unit roundoff u = 2**-24 of float32 and
gamma_m = m*u / (1 - m*u), the standard bound for recursive summation gives
(no float32 overflow assumed; float32 additions whose result is subnormal are
exact, so there is no underflow term)::

    |s - s*| <= gamma_{k-1} * sum_j |x_j|          (zero for k = 1)

The final rounding adds at most half a unit in the last place of the storage
type at s::

    |out - s| <= 0.5 * ulp_T(s)

    ulp_bf16(s) = 2**(e - 7)   with e = max(floor(log2|s|), -126)
    ulp_f16(s)  = 2**(e - 10)  with e = max(floor(log2|s|), -14)

so ``|out - s*| <= 0.5 * ulp_T(s) + gamma_{k-1} * sum_j |x_j|``. For k <= 4
the second term is below 3.0000003 * 2**-24 * sum_j |x_j|, i.e. at most
3 * 2**-16 (bf16) or 3 * 2**-13 (f16) of the half-ulp term when the inputs
share a sign. For k = 2 the float32 sum is exact whenever the exponents of the
two (normal) inputs differ by at most 15 (bf16) or 12 (f16); then ``out`` is
the correctly rounded exact sum. A k-input sum thus rounds to 16 bits once,
never k-1 times as pairwise bf16 additions would.

f32 and f64 sums are ordinary sequential IEEE sums: ``|out - s*| <=
gamma_{k-1} * sum_j |x_j|`` with u = 2**-24 or 2**-53.

Kernels
-------
``sum_rows_<dt>(src, lo, hi, out, out_lo)``
    ``src`` is a C-contiguous (k, n) array (k >= 1), ``out`` a C-contiguous
    1-d array. For i in [lo, hi): ``out[out_lo + i - lo] = round(sum_j
    src[j, i])``. ``out`` may be the very memory it reads, i.e. row j of
    ``src`` over the same range (``out`` is ``src[j]`` and ``out_lo == lo``);
    any other partial overlap of ``out`` with ``src`` is undefined.
``sum2_<dt>(a, b, out)``
    For i in [0, len(out)): ``out[i] = round(a[i] + b[i])`` (a first). ``a``
    and ``b`` must be at least ``len(out)`` long; ``out`` may be ``a`` or
    ``b`` (same start) but must not partially overlap them.

Both raise ValueError when a range falls outside an array (the indexing itself
is unchecked). ``SUM_ROWS`` and ``SUM2`` map dtype names to the kernels.
All kernels release the GIL, are compiled for the host CPU at import (explicit
signatures) and cached on disk (``cache=True``; numba honours
NUMBA_CACHE_DIR). ``warm_up()`` runs each once.

Implementation notes
--------------------
The element loops are written so LLVM vectorizes them. The inputs of a block
of elements are summed into a fixed-size float accumulator on the stack before
any output of that block is stored: this is what makes exact aliasing of
``out`` with an input row safe, and, because a stack buffer provably aliases
nothing, the vectorized loops need no runtime overlap checks (those checks
send an aliased call to the scalar loop, 10x slower). 16-bit data is read and
written as 32-bit words holding two elements (little-endian: element 2p in the
low half), so widening is one shift or one mask and narrowing one shift or
mask and an OR, without lane shuffles; an odd last element is done on its own.
These 32-bit views may be unaligned; they are typed as unaligned.
"""

import sys

import numba
import numpy as np
from numba import types

__all__ = [
    "SUM2",
    "SUM_ROWS",
    "sum2_bf16",
    "sum2_f16",
    "sum2_f32",
    "sum2_f64",
    "sum_rows_bf16",
    "sum_rows_f16",
    "sum_rows_f32",
    "sum_rows_f64",
    "warm_up",
]

if sys.byteorder != "little":  # the two-elements-per-word trick below
    raise ImportError("harmpi.reduce needs a little-endian CPU")

# Elements per block of the stack accumulator. 16-bit kernels count pairs.
_BLOCK_PAIRS = 128
_BLOCK_F32 = 256
_BLOCK_F64 = 256

_KERNEL_OPTIONS = dict(
    cache=True, nogil=True, fastmath=False, error_model="numpy", boundscheck=False
)
_INLINE = dict(inline="always")

_U16 = np.uint16
_U32 = np.uint32

_SIG_ROWS_U16 = "void(uint16[:, ::1], intp, intp, uint16[::1], intp)"
_SIG_ROWS_F32 = "void(float32[:, ::1], intp, intp, float32[::1], intp)"
_SIG_ROWS_F64 = "void(float64[:, ::1], intp, intp, float64[::1], intp)"
_SIG_SUM2_U16 = "void(uint16[::1], uint16[::1], uint16[::1])"
_SIG_SUM2_F32 = "void(float32[::1], float32[::1], float32[::1])"
_SIG_SUM2_F64 = "void(float64[::1], float64[::1], float64[::1])"


# ---------------------------------------------------------------------------
# Low-level primitives: bit casts, stack scratch, 32-bit pair views.
# Compiled: numba intrinsics. NUMBA_DISABLE_JIT=1: numpy equivalents.
# ---------------------------------------------------------------------------

if numba.config.DISABLE_JIT:

    def _f32_from_bits(u):
        return np.uint32(u).view(np.float32)

    def _f32_bits(x):
        return np.float32(x).view(np.uint32)

    def _scratch_pairs():
        return np.empty(_BLOCK_PAIRS, np.float32)

    def _scratch_f32():
        return np.empty(_BLOCK_F32, np.float32)

    def _scratch_f64():
        return np.empty(_BLOCK_F64, np.float64)

    def _view(arr, row, start, count):
        return (arr[row] if arr.ndim == 2 else arr)[start : start + count]

    def _view_pairs(arr, row, start, count):
        return _view(arr, row, start, 2 * count).view(np.uint32)

else:
    import llvmlite.ir as _llir
    from numba.extending import intrinsic as _intrinsic
    from numba.np.arrayobj import make_array as _make_array
    from numba.np.arrayobj import populate_array as _populate_array

    @_intrinsic
    def _f32_from_bits(typingctx, u):
        """The float32 whose bit pattern is the low 32 bits of integer u."""
        if not isinstance(u, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            v = args[0]
            if v.type.width > 32:
                v = builder.trunc(v, _llir.IntType(32))
            elif v.type.width < 32:
                v = builder.zext(v, _llir.IntType(32))
            return builder.bitcast(v, _llir.FloatType())

        return types.float32(u), codegen

    @_intrinsic
    def _f32_bits(typingctx, x):
        """The bit pattern of float32 x as uint32."""
        if x != types.float32:
            return None

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], _llir.IntType(32))

        return types.uint32(x), codegen

    def _make_scratch(nbtype, shape):
        """Intrinsic returning a C-contiguous array in the caller's stack frame.

        The buffer is one uninitialised alloca in the entry block (so one per
        call, not per loop trip), 64-byte aligned. It must not outlive the
        calling kernel.
        """
        arrty = types.Array(nbtype, len(shape), "C")
        itemsize = np.dtype(str(nbtype)).itemsize
        count = int(np.prod(shape))
        lanes = 64 // itemsize
        assert count % lanes == 0
        strides = [itemsize * int(np.prod(shape[d + 1 :])) for d in range(len(shape))]

        @_intrinsic
        def scratch(typingctx):
            def codegen(context, builder, sig, args):
                elty = context.get_value_type(nbtype)
                vecty = _llir.VectorType(elty, lanes)  # vector type: 64-byte alignment
                # Not cgutils.alloca_once: that zero-fills the buffer on every call.
                with builder.goto_entry_block():
                    raw = builder.alloca(_llir.ArrayType(vecty, count // lanes))
                data = builder.bitcast(raw, elty.as_pointer())
                ary = _make_array(arrty)(context, builder)
                intp = context.get_value_type(types.intp)
                _populate_array(
                    ary,
                    data=data,
                    shape=[_llir.Constant(intp, s) for s in shape],
                    strides=[_llir.Constant(intp, s) for s in strides],
                    itemsize=_llir.Constant(intp, itemsize),
                    meminfo=None,
                )
                return ary._getvalue()

            return arrty(), codegen

        return scratch

    _scratch_pairs = _make_scratch(types.float32, (_BLOCK_PAIRS,))
    _scratch_f32 = _make_scratch(types.float32, (_BLOCK_F32,))
    _scratch_f64 = _make_scratch(types.float64, (_BLOCK_F64,))

    def _make_view(pairs):
        """Intrinsic view(arr, row, start, count) of arr[row, start : start + count].

        arr is a C-contiguous 1-d array (row is ignored; pass 0) or 2-d array.
        With pairs=True, arr holds uint16 and the view is uint32 over
        2*count elements, typed unaligned. The view carries no reference
        (meminfo) to arr, so making one costs no atomic refcount update, and
        there is no bounds or negative-index handling: the caller checks.
        """

        @_intrinsic
        def view(typingctx, arr, row, start, count):
            if not (
                isinstance(arr, types.Array)
                and arr.layout == "C"
                and arr.ndim in (1, 2)
                and isinstance(row, types.Integer)
                and isinstance(start, types.Integer)
                and isinstance(count, types.Integer)
            ):
                return None
            if pairs:
                if arr.dtype != types.uint16:
                    return None
                retty = types.Array(types.uint32, 1, "C", aligned=False)
            else:
                retty = types.Array(arr.dtype, 1, "C")

            def codegen(context, builder, sig, args):
                arrty = sig.args[0]
                a = _make_array(arrty)(context, builder, args[0])
                intp = context.get_value_type(types.intp)
                row_v, start_v, count_v = (
                    context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], sig.args[1:])
                )
                offset = start_v
                if arrty.ndim == 2:
                    ncols = builder.extract_value(a.shape, 1)
                    offset = builder.add(builder.mul(row_v, ncols), start_v)
                first = builder.gep(a.data, [offset])
                if pairs:
                    first = builder.bitcast(first, _llir.IntType(32).as_pointer())
                itemsize = context.get_abi_sizeof(context.get_data_type(retty.dtype))
                ary = _make_array(retty)(context, builder)
                _populate_array(
                    ary,
                    data=first,
                    shape=[count_v],
                    strides=[_llir.Constant(intp, itemsize)],
                    itemsize=_llir.Constant(intp, itemsize),
                    meminfo=None,
                )
                return ary._getvalue()

            return retty(arr, row, start, count), codegen

        return view

    _view = _make_view(pairs=False)
    _view_pairs = _make_view(pairs=True)


# ---------------------------------------------------------------------------
# Scalar conversions. All integer work is wrapped in _U32(...) because numba
# widens uint32 arithmetic to 64 bits; the explicit truncation lets LLVM use
# 32-bit vector lanes and keeps the arithmetic modulo 2**32.
# ---------------------------------------------------------------------------


@numba.njit(**_INLINE)
def _bf16_round_hi(x):
    """float32 -> uint32 whose high half is bf16(x) rounded to nearest even.

    The low half is garbage. NaN: sign and top payload kept, quiet bit set (no
    rounding increment, which could carry a NaN into Inf).
    """
    b = _f32_bits(x)
    if x != x:
        return _U32(b | _U32(0x00400000))
    return _U32(b + _U32(_U32(0x7FFF) + ((b >> _U32(16)) & _U32(1))))


# f16 <-> f32 by integer and float32 arithmetic only (branch-free; after
# M. Maratyszcza's FP16 library). Widening is exact; narrowing relies on the
# float32 adder's round-to-nearest-even to round the mantissa.
_F16_EXP_OFFSET = _U32(0xE0 << 23)  # rebias exponent 15 -> 127, plus 112
_F16_EXP_SCALE = np.float32(2.0**-112)
_F16_MAGIC_MASK = _U32(126 << 23)  # float32 0.5
_F16_MAGIC_BIAS = np.float32(0.5)
_F16_DENORM_CUTOFF = _U32(1 << 27)  # (twice the) smallest normal f16, shifted
_F16_SCALE_TO_INF = np.float32(2.0**112)
_F16_SCALE_TO_ZERO = np.float32(2.0**-110)


@numba.njit(**_INLINE)
def _f16_hi_to_f32(w):
    """uint32 holding an f16 in its high half (low half zero) -> exact float32."""
    sign = w & _U32(0x80000000)
    two_w = _U32(w << _U32(1))  # drop the sign
    # Normal, Inf, NaN: rebias by moving the exponent field and scaling by
    # 2**-112 (exact; for Inf/NaN the exponent field is already all ones).
    normal = _f32_from_bits(_U32((two_w >> _U32(4)) + _F16_EXP_OFFSET)) * _F16_EXP_SCALE
    # Zero, subnormal: mantissa into a float32 in [0.5, 1), minus 0.5 (exact).
    subnormal = _f32_from_bits(_U32((two_w >> _U32(17)) | _F16_MAGIC_MASK)) - _F16_MAGIC_BIAS
    if two_w < _F16_DENORM_CUTOFF:
        mag = _f32_bits(subnormal)
    else:
        mag = _f32_bits(normal)
    return _f32_from_bits(_U32(sign | mag))


@numba.njit(**_INLINE)
def _f16_bits_lo(x):
    """float32 -> uint32 holding f16(x) (nearest even) in its low half, high half zero.

    Overflow gives Inf, subnormals round correctly, NaN gives 0x7E00 | sign.
    """
    # Scaling by 2**112 then 2**-110 overflows exactly the values that must
    # become Inf; the sum with the bias below rounds the mantissa to 10 bits
    # (or to the subnormal grid) in the float32 adder.
    base = (abs(x) * _F16_SCALE_TO_INF) * _F16_SCALE_TO_ZERO
    w = _f32_bits(x)
    shl1_w = _U32(w << _U32(1))
    sign = w & _U32(0x80000000)
    bias = shl1_w & _U32(0xFF000000)
    if bias < _U32(0x71000000):
        bias = _U32(0x71000000)
    base = _f32_from_bits(_U32((bias >> _U32(1)) + _U32(0x07800000))) + base
    bits = _f32_bits(base)
    exp_bits = (bits >> _U32(13)) & _U32(0x00007C00)
    mantissa_bits = bits & _U32(0x00000FFF)
    nonsign = _U32(exp_bits + mantissa_bits)
    if shl1_w > _U32(0xFF000000):  # NaN
        nonsign = _U32(0x7E00)
    return _U32((sign >> _U32(16)) | nonsign)


# Pair codecs: w is a uint32 word holding two 16-bit values (element 2p low,
# 2p+1 high). `f16` is a compile-time constant after inlining.


@numba.njit(**_INLINE)
def _dec_lo(w, f16):
    if f16:
        return _f16_hi_to_f32(_U32(w << _U32(16)))
    return _f32_from_bits(_U32(w << _U32(16)))


@numba.njit(**_INLINE)
def _dec_hi(w, f16):
    if f16:
        return _f16_hi_to_f32(_U32(w & _U32(0xFFFF0000)))
    return _f32_from_bits(_U32(w & _U32(0xFFFF0000)))


@numba.njit(**_INLINE)
def _enc_pair(x_lo, x_hi, f16):
    """Two float32 values -> one uint32 word of two rounded 16-bit values."""
    if f16:
        return _U32(_f16_bits_lo(x_lo) | _U32(_f16_bits_lo(x_hi) << _U32(16)))
    return _U32((_bf16_round_hi(x_lo) >> _U32(16)) | (_bf16_round_hi(x_hi) & _U32(0xFFFF0000)))


@numba.njit(**_INLINE)
def _dec_one(h, f16):
    """One raw 16-bit value -> float32."""
    return _dec_hi(_U32(_U32(h) << _U32(16)), f16)


@numba.njit(**_INLINE)
def _enc_one(x, f16):
    """float32 -> one raw 16-bit value."""
    if f16:
        return _U16(_f16_bits_lo(x))
    return _U16(_bf16_round_hi(x) >> _U32(16))


# ---------------------------------------------------------------------------
# Kernel bodies (inlined into the typed kernels below).
# ---------------------------------------------------------------------------


@numba.njit(**_INLINE)
def _check_rows(k, ncols, lo, hi, nout, out_lo):
    if k < 1:
        raise ValueError("sum_rows: src has no rows")
    if lo < 0 or hi < lo or hi > ncols:
        raise ValueError("sum_rows: need 0 <= lo <= hi <= src.shape[1]")
    if out_lo < 0 or out_lo > nout - (hi - lo):
        raise ValueError("sum_rows: out[out_lo : out_lo + hi - lo] is out of bounds")


@numba.njit(**_INLINE)
def _sum_rows_u16(src, lo, hi, out, out_lo, f16):
    k = src.shape[0]
    _check_rows(k, src.shape[1], lo, hi, out.shape[0], out_lo)
    n = hi - lo
    npairs = n // 2
    acc_lo = _scratch_pairs()  # even elements
    acc_hi = _scratch_pairs()  # odd elements
    for p0 in range(0, npairs, _BLOCK_PAIRS):
        m = min(_BLOCK_PAIRS, npairs - p0)
        s = lo + 2 * p0
        # Read every input of the block into acc (rows in order; the first
        # up to four fused in one pass), then store: out may be a row.
        r0 = _view_pairs(src, 0, s, m)
        if k == 1:
            for p in range(m):
                w0 = r0[p]
                acc_lo[p] = _dec_lo(w0, f16)
                acc_hi[p] = _dec_hi(w0, f16)
        elif k == 2:
            r1 = _view_pairs(src, 1, s, m)
            for p in range(m):
                w0 = r0[p]
                w1 = r1[p]
                acc_lo[p] = _dec_lo(w0, f16) + _dec_lo(w1, f16)
                acc_hi[p] = _dec_hi(w0, f16) + _dec_hi(w1, f16)
        elif k == 3:
            r1 = _view_pairs(src, 1, s, m)
            r2 = _view_pairs(src, 2, s, m)
            for p in range(m):
                w0 = r0[p]
                w1 = r1[p]
                w2 = r2[p]
                acc_lo[p] = _dec_lo(w0, f16) + _dec_lo(w1, f16) + _dec_lo(w2, f16)
                acc_hi[p] = _dec_hi(w0, f16) + _dec_hi(w1, f16) + _dec_hi(w2, f16)
        else:
            r1 = _view_pairs(src, 1, s, m)
            r2 = _view_pairs(src, 2, s, m)
            r3 = _view_pairs(src, 3, s, m)
            for p in range(m):
                w0 = r0[p]
                w1 = r1[p]
                w2 = r2[p]
                w3 = r3[p]
                acc_lo[p] = (
                    _dec_lo(w0, f16) + _dec_lo(w1, f16) + _dec_lo(w2, f16) + _dec_lo(w3, f16)
                )
                acc_hi[p] = (
                    _dec_hi(w0, f16) + _dec_hi(w1, f16) + _dec_hi(w2, f16) + _dec_hi(w3, f16)
                )
        for j in range(4, k):
            rj = _view_pairs(src, j, s, m)
            for p in range(m):
                w = rj[p]
                acc_lo[p] += _dec_lo(w, f16)
                acc_hi[p] += _dec_hi(w, f16)
        o = _view_pairs(out, 0, out_lo + 2 * p0, m)
        for p in range(m):
            o[p] = _enc_pair(acc_lo[p], acc_hi[p], f16)
    if n & 1:  # odd length: the last element on its own
        i = hi - 1
        x = _dec_one(src[0, i], f16)
        for j in range(1, k):
            x += _dec_one(src[j, i], f16)
        out[out_lo + n - 1] = _enc_one(x, f16)


@numba.njit(**_INLINE)
def _sum2_u16(a, b, out, f16):
    n = out.shape[0]
    if a.shape[0] < n or b.shape[0] < n:
        raise ValueError("sum2: a and b must be at least as long as out")
    npairs = n // 2
    acc_lo = _scratch_pairs()  # even elements
    acc_hi = _scratch_pairs()  # odd elements
    for p0 in range(0, npairs, _BLOCK_PAIRS):
        m = min(_BLOCK_PAIRS, npairs - p0)
        ra = _view_pairs(a, 0, 2 * p0, m)
        rb = _view_pairs(b, 0, 2 * p0, m)
        for p in range(m):
            wa = ra[p]
            wb = rb[p]
            acc_lo[p] = _dec_lo(wa, f16) + _dec_lo(wb, f16)
            acc_hi[p] = _dec_hi(wa, f16) + _dec_hi(wb, f16)
        o = _view_pairs(out, 0, 2 * p0, m)
        for p in range(m):
            o[p] = _enc_pair(acc_lo[p], acc_hi[p], f16)
    if n & 1:
        out[n - 1] = _enc_one(_dec_one(a[n - 1], f16) + _dec_one(b[n - 1], f16), f16)


@numba.njit(**_INLINE)
def _sum_rows_float(src, lo, hi, out, out_lo, acc):
    k = src.shape[0]
    _check_rows(k, src.shape[1], lo, hi, out.shape[0], out_lo)
    n = hi - lo
    nb = acc.shape[0]
    for b0 in range(0, n, nb):
        m = min(nb, n - b0)
        s = lo + b0
        r0 = _view(src, 0, s, m)
        if k == 1:
            for i in range(m):
                acc[i] = r0[i]
        elif k == 2:
            r1 = _view(src, 1, s, m)
            for i in range(m):
                acc[i] = r0[i] + r1[i]
        elif k == 3:
            r1 = _view(src, 1, s, m)
            r2 = _view(src, 2, s, m)
            for i in range(m):
                acc[i] = r0[i] + r1[i] + r2[i]
        else:
            r1 = _view(src, 1, s, m)
            r2 = _view(src, 2, s, m)
            r3 = _view(src, 3, s, m)
            for i in range(m):
                acc[i] = r0[i] + r1[i] + r2[i] + r3[i]
        for j in range(4, k):
            rj = _view(src, j, s, m)
            for i in range(m):
                acc[i] += rj[i]
        o = _view(out, 0, out_lo + b0, m)
        for i in range(m):
            o[i] = acc[i]


@numba.njit(**_INLINE)
def _sum2_float(a, b, out, acc):
    n = out.shape[0]
    if a.shape[0] < n or b.shape[0] < n:
        raise ValueError("sum2: a and b must be at least as long as out")
    nb = acc.shape[0]
    for b0 in range(0, n, nb):
        m = min(nb, n - b0)
        ra = _view(a, 0, b0, m)
        rb = _view(b, 0, b0, m)
        for i in range(m):
            acc[i] = ra[i] + rb[i]
        o = _view(out, 0, b0, m)
        for i in range(m):
            o[i] = acc[i]


# ---------------------------------------------------------------------------
# Public kernels.
# ---------------------------------------------------------------------------


@numba.njit(_SIG_ROWS_U16, **_KERNEL_OPTIONS)
def sum_rows_bf16(src, lo, hi, out, out_lo):
    """out[out_lo + i - lo] = bf16(sum_j f32(src[j, i])) for i in [lo, hi); uint16 bits."""
    _sum_rows_u16(src, lo, hi, out, out_lo, False)


@numba.njit(_SIG_ROWS_U16, **_KERNEL_OPTIONS)
def sum_rows_f16(src, lo, hi, out, out_lo):
    """out[out_lo + i - lo] = f16(sum_j f32(src[j, i])) for i in [lo, hi); uint16 bits."""
    _sum_rows_u16(src, lo, hi, out, out_lo, True)


@numba.njit(_SIG_ROWS_F32, **_KERNEL_OPTIONS)
def sum_rows_f32(src, lo, hi, out, out_lo):
    """out[out_lo + i - lo] = sum_j src[j, i] in float32, for i in [lo, hi)."""
    _sum_rows_float(src, lo, hi, out, out_lo, _scratch_f32())


@numba.njit(_SIG_ROWS_F64, **_KERNEL_OPTIONS)
def sum_rows_f64(src, lo, hi, out, out_lo):
    """out[out_lo + i - lo] = sum_j src[j, i] in float64, for i in [lo, hi)."""
    _sum_rows_float(src, lo, hi, out, out_lo, _scratch_f64())


@numba.njit(_SIG_SUM2_U16, **_KERNEL_OPTIONS)
def sum2_bf16(a, b, out):
    """out[i] = bf16(f32(a[i]) + f32(b[i])) for i < len(out); uint16 bits."""
    _sum2_u16(a, b, out, False)


@numba.njit(_SIG_SUM2_U16, **_KERNEL_OPTIONS)
def sum2_f16(a, b, out):
    """out[i] = f16(f32(a[i]) + f32(b[i])) for i < len(out); uint16 bits."""
    _sum2_u16(a, b, out, True)


@numba.njit(_SIG_SUM2_F32, **_KERNEL_OPTIONS)
def sum2_f32(a, b, out):
    """out[i] = a[i] + b[i] in float32 for i < len(out)."""
    _sum2_float(a, b, out, _scratch_f32())


@numba.njit(_SIG_SUM2_F64, **_KERNEL_OPTIONS)
def sum2_f64(a, b, out):
    """out[i] = a[i] + b[i] in float64 for i < len(out)."""
    _sum2_float(a, b, out, _scratch_f64())


SUM_ROWS = {
    "bf16": sum_rows_bf16,
    "f16": sum_rows_f16,
    "f32": sum_rows_f32,
    "f64": sum_rows_f64,
}

SUM2 = {
    "bf16": sum2_bf16,
    "f16": sum2_f16,
    "f32": sum2_f32,
    "f64": sum2_f64,
}

_STORAGE = {"bf16": np.uint16, "f16": np.uint16, "f32": np.float32, "f64": np.float64}


def warm_up():
    """Run every kernel once on a few elements.

    The explicit signatures already compile (or load from the on-disk cache)
    at import; this makes sure each one has run, so the first timed
    collective pays nothing.
    """
    for name, storage in _STORAGE.items():
        src = np.zeros((2, 3), storage)
        out = np.zeros(3, storage)
        SUM_ROWS[name](src, 0, 3, out, 0)
        SUM2[name](src[0], src[1], out)
