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

The code: ``primitives`` (bit casts, stack scratch, no-reference views:
numba intrinsics), ``convert`` (bf16/f16 <-> float32 by bit arithmetic,
two values per 32-bit word), ``kernels`` (the block loops and the typed
kernels; its docstring has the implementation notes).
"""

from .kernels import (
    SUM2,
    SUM_ROWS,
    SUM_ROWS_X,
    sum2_bf16,
    sum2_f16,
    sum2_f32,
    sum2_f64,
    sum_rows_bf16,
    sum_rows_f16,
    sum_rows_f32,
    sum_rows_f64,
    sum_rows_x_bf16,
    sum_rows_x_f16,
    sum_rows_x_f32,
    sum_rows_x_f64,
    warm_up,
)
from .primitives import HARDWARE_F16

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
