"""Compiled sum kernels: add k equally long inputs into one output.

This module holds only compute (numpy and numba; no MPI, no torch). The
collectives call these kernels from their own compiled code, on arrays made
with ``numba.carray``, or from Python.

Dtypes and storage
------------------
======  ================================  ===========  ==========================
name    stored as                         accumulator  result rounding
======  ================================  ===========  ==========================
bf16    uint16 (raw bfloat16 bits)        float32      once, to nearest even
f16     uint16 (raw IEEE binary16 bits)   float32      once, to nearest even
f32     float32                           float32      each add (IEEE)
f64     float64                           float64      each add (IEEE)
======  ================================  ===========  ==========================

bf16 and f16 travel as raw 16-bit patterns because numba has no 16-bit float
type. They are widened to float32 exactly (subnormals, infinities and NaNs
included), summed in float32, and narrowed once. bf16 conversions are bit
manipulation. f16 uses the CPU's conversion instructions where the target has
them (x86-64 F16C, AArch64; see ``HARDWARE_F16``) and otherwise an equivalent
bit-level path; both are exact and round to nearest even, and they differ only
in NaN payloads (below).

Summation order
---------------
For every element i, ``sum_rows_<dt>`` computes::

    acc = x[0, i]; acc = acc + x[1, i]; ...; acc = acc + x[k-1, i]
    out[i] = round(acc)

in exactly this row order, each ``+`` rounding to the accumulator type. The
kernels are compiled without fast-math (no reassociation, no FMA
contraction), so the result depends only on the inputs and the row order:
every process that sums the same rows gets the same bits (NaN payloads aside,
see below). This assumes the default floating-point environment; a thread
that enabled flush-to-zero / denormals-are-zero (for example through
``torch.set_flush_denormal(True)``) loses float32/float64 and bf16 subnormals
(f16 values are all normal float32 numbers, so f16 sums are unaffected).

Rounding to bf16 / f16
----------------------
Round to nearest, ties to even, from the float32 accumulator. Values beyond
the largest finite value round to +/-Inf exactly as IEEE 754 prescribes (bf16:
|acc| >= 2**128 * (1 - 2**-9); f16: |acc| >= 65520); results in the subnormal
range are rounded correctly, never flushed; signed zeros are kept
(-0 + -0 = -0, -0 + 0 = +0). Inf + (-Inf) is NaN. NaN stays NaN and comes out
quiet, with its sign: bf16 keeps the top payload bits and sets the quiet bit;
f16 gives ``0x7E00 | sign`` on the bit-level path and keeps the top payload
bits with hardware conversions. When several inputs of an element are NaN,
which one's sign and payload survive is left to the hardware and the compiler
(IEEE 754 does not say); the result is a NaN in every case.

Error bound (bf16 and f16)
--------------------------
Let s* be the exact real sum of the k inputs of an element and s the float32
accumulator. With u = 2**-24 (float32 unit roundoff) and
gamma_m = m*u / (1 - m*u), recursive summation gives (no float32 overflow
assumed; a float32 addition with a subnormal result is exact, so there is no
underflow term)::

    |s - s*| <= gamma_{k-1} * sum_j |x_j|             (0 for k = 1)

and the single final rounding to the storage type T adds at most half a unit
in the last place of T at s::

    |out - s| <= ulp_T(s) / 2,
    ulp_bf16(s) = 2**(e - 7),  ulp_f16(s) = 2**(e - 10),
    e = max(floor(log2 |s|), -126 for bf16, -14 for f16)

so ``|out - s*| <= ulp_T(s) / 2 + gamma_{k-1} * sum_j |x_j|``. For k <= 4 and
inputs of one sign the float32 term is at most 3 * 2**-15 (bf16) or
3 * 2**-12 (f16) of the half-ulp term: the sum is rounded to 16 bits once,
not k - 1 times as pairwise 16-bit additions would. For k = 2 the float32 sum
is exact whenever the two (normal) inputs' exponents differ by at most 15
(bf16) or 12 (f16); ``out`` is then the correctly rounded exact sum.

f32 and f64 sums are ordinary sequential IEEE sums:
``|out - s*| <= gamma_{k-1} * sum_j |x_j|`` with u = 2**-24 or 2**-53.

Kernels
-------
``sum_rows_<dt>(src, lo, hi, out, out_lo)``
    ``src``: C-contiguous (k, n) array, k >= 1; ``out``: C-contiguous 1-d
    array. For i in [lo, hi): ``out[out_lo + i - lo] = round(sum_j src[j, i])``.
    ``out`` may be the memory it reads, row j of ``src`` over the same range
    (``out`` is ``src[j]`` and ``out_lo == lo``); any other overlap of ``out``
    with ``src`` gives undefined results.
``sum_rows_x_<dt>(src, lo, hi, me, x, out, out2, out_lo)``
    The reduce-scatter variant, where this rank's own row is private: the
    same sum as ``sum_rows_<dt>`` on a copy of ``src`` whose row ``me`` is
    ``x`` (``x[i]`` pairs with ``src[j, i]``; row order, accumulation and
    rounding unchanged, so the bits are the same), written to both
    ``out[out_lo + i - lo]`` and ``out2[out_lo + i - lo]`` for i in
    [lo, hi). ``0 <= me < k`` and ``len(x) >= hi``; ``src[me]`` itself is
    not read. Allowed overlaps, with ``out_lo == lo``: ``out`` may be a row
    of ``src`` (typically ``src[me]``) and ``out2`` may be ``x`` (the sum
    overwrites the input in place), both at once; ``out`` and ``out2`` must
    not overlap each other unless they are the same array. Any other
    overlap gives undefined results.
``sum2_<dt>(a, b, out)``
    For i in [0, len(out)): ``out[i] = round(a[i] + b[i])``. ``a`` and ``b``
    must be at least ``len(out)`` long. ``out`` may be ``a`` or ``b`` (same
    start), nothing else that overlaps them.

``<dt>`` is bf16, f16 (both on uint16 arrays), f32 or f64; ``SUM_ROWS``,
``SUM_ROWS_X`` and ``SUM2`` map these names to the kernels. Each kernel has exactly one
signature (mutable, C-contiguous, aligned arrays of the storage type; intp
indices), compiled for the host CPU at import or loaded from numba's on-disk
cache (``cache=True``; NUMBA_CACHE_DIR is honoured). Other argument types
raise TypeError. Ranges outside the arrays raise ValueError; the element
accesses themselves are unchecked. The kernels release the GIL.
``warm_up()`` runs each kernel once.

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


import sys

import numba
import numpy as np
from numba import types

from . import dtypes

__all__ = [
    "HARDWARE_F16",
    "SUM2",
    "SUM_ROWS",
    "SUM_ROWS_X",
    "sum2_bf16",
    "sum2_f16",
    "sum2_f32",
    "sum2_f64",
    "sum_rows_bf16",
    "sum_rows_f16",
    "sum_rows_f32",
    "sum_rows_f64",
    "sum_rows_x_bf16",
    "sum_rows_x_f16",
    "sum_rows_x_f32",
    "sum_rows_x_f64",
    "warm_up",
]

if sys.byteorder != "little":  # the two-elements-per-word trick below
    raise ImportError("harmpi.reduce needs a little-endian CPU")

# Elements per block of the stack accumulator (pairs on the 32-bit word path).
_BLOCK = 256

_KERNEL_OPTIONS = dict(
    cache=True, nogil=True, fastmath=False, error_model="numpy", boundscheck=False
)

_U16 = np.uint16
_U32 = np.uint32


def _target_has_f16_conversions():
    """Whether the code numba generates may convert f16 <-> f32 in hardware.

    x86-64 with F16C (vcvtph2ps / vcvtps2ph) and AArch64 (fcvt) do. Follows
    NUMBA_CPU_FEATURES when set, as numba does. Pure-Python mode
    (NUMBA_DISABLE_JIT=1) uses the portable bit-level path.
    """
    if numba.config.DISABLE_JIT:
        return False
    import llvmlite.binding as llb

    triple = llb.get_process_triple()
    if triple.startswith(("aarch64", "arm64")):
        return True
    if not triple.startswith("x86_64"):
        return False
    features = numba.config.CPU_FEATURES  # what numba itself targets
    if features is None:
        features = llb.get_host_cpu_features().flatten()
    return "+f16c" in features.split(",")


# f16 conversions in hardware (exact and round-to-nearest-even like the bit
# path; they differ only in NaN payloads). Fixed at import; the on-disk cache
# is per CPU model and feature set, so cached code always matches this.
HARDWARE_F16 = _target_has_f16_conversions()

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
# Low-level primitives: bit casts, stack scratch, 32-bit pair views.
# Compiled: numba intrinsics. NUMBA_DISABLE_JIT=1: numpy equivalents.
# ---------------------------------------------------------------------------

if numba.config.DISABLE_JIT:

    def _f32_from_bits(u):
        return np.uint32(u).view(np.float32)

    def _f32_bits(x):
        return np.float32(x).view(np.uint32)

    def _scratch_f32():
        return np.empty(_BLOCK, np.float32)

    def _scratch_acc(arr):
        return np.empty(_BLOCK, np.float64 if arr.dtype == np.float64 else np.float32)

    def _widen(x):
        if isinstance(x, np.uint16):  # as the hardware does: NaNs come out quiet
            y = np.float32(x.view(np.float16))
            return y if y == y else _f32_from_bits(_f32_bits(y) | _U32(0x00400000))
        return x

    def _narrow_like(x, like):
        if like.dtype == np.uint16:
            h = np.float16(x).view(np.uint16)
            return h if x == x else _U16(h | _U16(0x0200))
        return x

    def _view(arr, row, start, count):
        return (arr[row] if arr.ndim == 2 else arr)[start : start + count]

    def _view_pairs(arr, row, start, count):
        return _view(arr, row, start, 2 * count).view(np.uint32)

    def _row_view(src, x, me, j, start, count):
        return _view(x, 0, start, count) if j == me else _view(src, j, start, count)

    def _row_view_pairs(src, x, me, j, start, count):
        return _row_view(src, x, me, j, start, 2 * count).view(np.uint32)

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

    def _alloca_array(context, builder, nbtype):
        """A C-contiguous 1-d array of _BLOCK nbtype on the current stack frame.

        One uninitialised alloca in the entry block (so one per call, not per
        loop trip; cgutils.alloca_once would zero it on every call), 64-byte
        aligned, no meminfo. It must not outlive the function that made it.
        """
        elty = context.get_value_type(nbtype)
        itemsize = context.get_abi_sizeof(elty)
        lanes = 64 // itemsize
        vecty = _llir.VectorType(elty, lanes)  # a vector type has 64-byte alignment
        with builder.goto_entry_block():
            raw = builder.alloca(_llir.ArrayType(vecty, _BLOCK // lanes))
        arrty = types.Array(nbtype, 1, "C")
        ary = _make_array(arrty)(context, builder)
        intp = context.get_value_type(types.intp)
        _populate_array(
            ary,
            data=builder.bitcast(raw, elty.as_pointer()),
            shape=[_llir.Constant(intp, _BLOCK)],
            strides=[_llir.Constant(intp, itemsize)],
            itemsize=_llir.Constant(intp, itemsize),
            meminfo=None,
        )
        return ary._getvalue()

    @_intrinsic
    def _scratch_f32(typingctx):
        """Stack scratch: _BLOCK float32."""

        def codegen(context, builder, sig, args):
            return _alloca_array(context, builder, types.float32)

        return types.Array(types.float32, 1, "C")(), codegen

    def _acc_type(arrty):
        return types.float64 if arrty.dtype == types.float64 else types.float32

    @_intrinsic
    def _scratch_acc(typingctx, arr):
        """Stack scratch: _BLOCK accumulators for arr (float64 or float32)."""
        if not isinstance(arr, types.Array):
            return None
        accty = _acc_type(arr)

        def codegen(context, builder, sig, args):
            return _alloca_array(context, builder, accty)

        return types.Array(accty, 1, "C")(arr), codegen

    @_intrinsic
    def _widen(typingctx, x):
        """Stored value -> accumulator: float32/float64 as is, uint16 as f16 in
        hardware (LLVM fpext half; use only when HARDWARE_F16)."""
        if x == types.uint16:

            def codegen(context, builder, sig, args):
                half = builder.bitcast(args[0], _llir.HalfType())
                return builder.fpext(half, _llir.FloatType())

            return types.float32(x), codegen
        if x in (types.float32, types.float64):
            return x(x), lambda context, builder, sig, args: args[0]
        return None

    @_intrinsic
    def _narrow_like(typingctx, x, like):
        """Accumulator -> stored value of array `like`: identity for floats,
        f16 bits by hardware round-to-nearest-even for uint16 (fptrunc half)."""
        if not isinstance(like, types.Array):
            return None
        if like.dtype == types.uint16 and x == types.float32:

            def codegen(context, builder, sig, args):
                half = builder.fptrunc(args[0], _llir.HalfType())
                return builder.bitcast(half, _llir.IntType(16))

            return types.uint16(x, like), codegen
        if like.dtype == x:
            return x(x, like), lambda context, builder, sig, args: args[0]
        return None

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
            retty = _view_type(arr.dtype, pairs)
            if retty is None:
                return None

            def codegen(context, builder, sig, args):
                arrty = sig.args[0]
                a = _make_array(arrty)(context, builder, args[0])
                row_v, start_v, count_v = (
                    context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], sig.args[1:])
                )
                offset = start_v
                if arrty.ndim == 2:
                    ncols = builder.extract_value(a.shape, 1)
                    offset = builder.add(builder.mul(row_v, ncols), start_v)
                first = builder.gep(a.data, [offset])
                return _view_value(context, builder, retty, first, count_v)

            return retty(arr, row, start, count), codegen

        return view

    def _view_type(elty, pairs):
        """Type of a view of elements elty (None if pairs and elty is not uint16)."""
        if pairs:
            if elty != types.uint16:
                return None
            return types.Array(types.uint32, 1, "C", aligned=False)
        return types.Array(elty, 1, "C")

    def _view_value(context, builder, retty, first, count_v):
        """The view array (no meminfo) of count_v retty.dtype items at pointer first."""
        intp = context.get_value_type(types.intp)
        first = builder.bitcast(first, context.get_data_type(retty.dtype).as_pointer())
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

    def _make_row_view(pairs):
        """Intrinsic row_view(src, x, me, j, start, count): like
        view(x, 0, start, count) if j == me else view(src, j, start, count).

        src is a C-contiguous 2-d array, x a C-contiguous 1-d array of the
        same dtype. The row is picked by a pointer select, not by a call: an
        njit helper returning either view would pass src and x by reference,
        with an atomic reference count update per block.
        """

        @_intrinsic
        def row_view(typingctx, src, x, me, j, start, count):
            if not (
                isinstance(src, types.Array)
                and isinstance(x, types.Array)
                and src.layout == "C"
                and x.layout == "C"
                and src.ndim == 2
                and x.ndim == 1
                and src.dtype == x.dtype
                and all(isinstance(t, types.Integer) for t in (me, j, start, count))
            ):
                return None
            retty = _view_type(src.dtype, pairs)
            if retty is None:
                return None

            def codegen(context, builder, sig, args):
                a = _make_array(sig.args[0])(context, builder, args[0])
                b = _make_array(sig.args[1])(context, builder, args[1])
                me_v, j_v, start_v, count_v = (
                    context.cast(builder, v, t, types.intp) for v, t in zip(args[2:], sig.args[2:])
                )
                ncols = builder.extract_value(a.shape, 1)
                in_src = builder.gep(a.data, [builder.add(builder.mul(j_v, ncols), start_v)])
                in_x = builder.gep(b.data, [start_v])
                first = builder.select(builder.icmp_signed("==", j_v, me_v), in_x, in_src)
                return _view_value(context, builder, retty, first, count_v)

            return retty(src, x, me, j, start, count), codegen

        return row_view

    _view = _make_view(pairs=False)
    _view_pairs = _make_view(pairs=True)
    _row_view = _make_row_view(pairs=False)
    _row_view_pairs = _make_row_view(pairs=True)


# ---------------------------------------------------------------------------
# Scalar conversions. All integer work is wrapped in _U32(...) because numba
# widens uint32 arithmetic to 64 bits; the explicit truncation lets LLVM use
# 32-bit vector lanes and keeps the arithmetic modulo 2**32.
# ---------------------------------------------------------------------------


@numba.njit
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


@numba.njit
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


@numba.njit
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
# 2p+1 high). The kernels pass `f16` as a literal, so numba compiles one
# specialization per value and the test folds away.


@numba.njit
def _dec_lo(w, f16):
    if f16:
        return _f16_hi_to_f32(_U32(w << _U32(16)))
    return _f32_from_bits(_U32(w << _U32(16)))


@numba.njit
def _dec_hi(w, f16):
    if f16:
        return _f16_hi_to_f32(_U32(w & _U32(0xFFFF0000)))
    return _f32_from_bits(_U32(w & _U32(0xFFFF0000)))


@numba.njit
def _enc_pair(x_lo, x_hi, f16):
    """Two float32 values -> one uint32 word of two rounded 16-bit values."""
    if f16:
        return _U32(_f16_bits_lo(x_lo) | _U32(_f16_bits_lo(x_hi) << _U32(16)))
    return _U32((_bf16_round_hi(x_lo) >> _U32(16)) | (_bf16_round_hi(x_hi) & _U32(0xFFFF0000)))


@numba.njit
def _dec_one(h, f16):
    """One raw 16-bit value -> float32."""
    return _dec_hi(_U32(_U32(h) << _U32(16)), f16)


@numba.njit
def _enc_one(x, f16):
    """float32 -> one raw 16-bit value."""
    if f16:
        return _U16(_f16_bits_lo(x))
    return _U16(_bf16_round_hi(x) >> _U32(16))


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
    acc_lo = _scratch_f32()  # even elements
    acc_hi = _scratch_f32()  # odd elements
    for p0 in range(0, npairs, _BLOCK):
        m = min(_BLOCK, npairs - p0)
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


@numba.njit
def _sum2_plain(a, b, out):
    n = out.shape[0]
    if a.shape[0] < n or b.shape[0] < n:
        raise ValueError("sum2: a and b must be at least as long as out")
    acc = _scratch_acc(out)
    for b0 in range(0, n, _BLOCK):
        m = min(_BLOCK, n - b0)
        ra = _view(a, 0, b0, m)
        rb = _view(b, 0, b0, m)
        for i in range(m):
            acc[i] = _widen(ra[i]) + _widen(rb[i])
        o = _view(out, 0, b0, m)
        for i in range(m):
            o[i] = _narrow_like(acc[i], out)


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
def _rows_pairs(src, lo, hi, me, x, out, out2, out_lo, f16):
    """The row sum for 16-bit values read and written two per uint32 word."""
    k = src.shape[0]
    _check_args(src, lo, hi, me, x, out, out2, out_lo)
    n = hi - lo
    npairs = n // 2
    acc_lo = _scratch_f32()  # even elements
    acc_hi = _scratch_f32()  # odd elements
    for p0 in range(0, npairs, _BLOCK):
        m = min(_BLOCK, npairs - p0)
        s = lo + 2 * p0
        # Every input of the block into acc, then the stores: out may be a
        # row of src and out2 may be x.
        r0 = _row_view_pairs(src, x, me, 0, s, m)
        if k == 1:
            for p in range(m):
                w0 = r0[p]
                acc_lo[p] = _dec_lo(w0, f16)
                acc_hi[p] = _dec_hi(w0, f16)
        elif k == 2:
            r1 = _row_view_pairs(src, x, me, 1, s, m)
            for p in range(m):
                w0 = r0[p]
                w1 = r1[p]
                acc_lo[p] = _dec_lo(w0, f16) + _dec_lo(w1, f16)
                acc_hi[p] = _dec_hi(w0, f16) + _dec_hi(w1, f16)
        elif k == 3:
            r1 = _row_view_pairs(src, x, me, 1, s, m)
            r2 = _row_view_pairs(src, x, me, 2, s, m)
            for p in range(m):
                w0 = r0[p]
                w1 = r1[p]
                w2 = r2[p]
                acc_lo[p] = _dec_lo(w0, f16) + _dec_lo(w1, f16) + _dec_lo(w2, f16)
                acc_hi[p] = _dec_hi(w0, f16) + _dec_hi(w1, f16) + _dec_hi(w2, f16)
        else:
            r1 = _row_view_pairs(src, x, me, 1, s, m)
            r2 = _row_view_pairs(src, x, me, 2, s, m)
            r3 = _row_view_pairs(src, x, me, 3, s, m)
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
            rj = _row_view_pairs(src, x, me, j, s, m)
            for p in range(m):
                w = rj[p]
                acc_lo[p] += _dec_lo(w, f16)
                acc_hi[p] += _dec_hi(w, f16)
        o = _view_pairs(out, 0, out_lo + 2 * p0, m)
        if me < 0:
            for p in range(m):
                o[p] = _enc_pair(acc_lo[p], acc_hi[p], f16)
        else:
            o2 = _view_pairs(out2, 0, out_lo + 2 * p0, m)
            for p in range(m):
                w = _enc_pair(acc_lo[p], acc_hi[p], f16)
                o[p] = w
                o2[p] = w
    if n & 1:  # odd length: the last element on its own
        i = hi - 1
        v = _dec_one(x[i] if me == 0 else src[0, i], f16)
        for j in range(1, k):
            v += _dec_one(x[i] if j == me else src[j, i], f16)
        h = _enc_one(v, f16)
        out[out_lo + n - 1] = h
        if me >= 0:
            out2[out_lo + n - 1] = h


@numba.njit
def _rows_plain(src, lo, hi, me, x, out, out2, out_lo):
    """The row sum for one stored value per element: float32, float64, and
    f16 with hardware conversions."""
    k = src.shape[0]
    _check_args(src, lo, hi, me, x, out, out2, out_lo)
    n = hi - lo
    acc = _scratch_acc(src)
    for b0 in range(0, n, _BLOCK):
        m = min(_BLOCK, n - b0)
        s = lo + b0
        # Every input of the block into acc, then the stores: out may be a
        # row of src and out2 may be x.
        r0 = _row_view(src, x, me, 0, s, m)
        if k == 1:
            for i in range(m):
                acc[i] = _widen(r0[i])
        elif k == 2:
            r1 = _row_view(src, x, me, 1, s, m)
            for i in range(m):
                acc[i] = _widen(r0[i]) + _widen(r1[i])
        elif k == 3:
            r1 = _row_view(src, x, me, 1, s, m)
            r2 = _row_view(src, x, me, 2, s, m)
            for i in range(m):
                acc[i] = _widen(r0[i]) + _widen(r1[i]) + _widen(r2[i])
        else:
            r1 = _row_view(src, x, me, 1, s, m)
            r2 = _row_view(src, x, me, 2, s, m)
            r3 = _row_view(src, x, me, 3, s, m)
            for i in range(m):
                acc[i] = _widen(r0[i]) + _widen(r1[i]) + _widen(r2[i]) + _widen(r3[i])
        for j in range(4, k):
            rj = _row_view(src, x, me, j, s, m)
            for i in range(m):
                acc[i] += _widen(rj[i])
        o = _view(out, 0, out_lo + b0, m)
        if me < 0:
            for i in range(m):
                o[i] = _narrow_like(acc[i], out)
        else:
            o2 = _view(out2, 0, out_lo + b0, m)
            for i in range(m):
                v = _narrow_like(acc[i], out)
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
