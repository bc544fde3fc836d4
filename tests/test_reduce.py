"""Tests of harmpi.reduce against plain numpy references (no MPI).

Oracles are independent of the kernels' bit tricks: numpy's float16 casts for
f16, torch's float32 -> bfloat16 cast (round-to-nearest-even) for bf16, numpy
elementwise adds for the float32 accumulation, math.fsum for exact sums.

Also run in pure-Python mode, which exercises the kernel code line by line:

    NUMBA_DISABLE_JIT=1 python -m pytest tests/test_reduce.py

(test_pure_python_mode does exactly that from inside a normal run). The
references and the dtype tables are in tests/support/reduce_oracle.py.
"""

import ctypes
import math
import os
import subprocess
import sys

import numba
import numpy as np
import pytest
from support.reduce_oracle import (
    DTYPES,
    F16,
    HALF,
    JIT,
    ROWS,
    ROWS_X,
    STORAGE,
    SUM2,
    assert_same,
    bits16,
    is_nan,
    nan_inputs,
    narrow,
    random_values,
    reference_rows,
    run_rows,
    seq_sum,
    substituted,
    widen,
)

import harmpi.reduce as R
from harmpi.reduce import convert, primitives

PUBLIC = ["bf16", "f16", "f32", "f64"]
# Lengths around the kernels' block size (256 pairs = 512 16-bit elements,
# 256 float elements) and odd lengths (16-bit kernels work on pairs).
LENGTHS = [0, 1, 2, 7, 255, 256, 257, 511, 512, 513, 1025]


@pytest.fixture(autouse=True)
def _quiet_float_warnings():
    # Overflow, Inf - Inf and NaN are intended here; numpy scalar arithmetic
    # (pure-Python mode) and the numpy references would warn about them.
    with np.errstate(all="ignore"):
        yield


# ---------------------------------------------------------------------------
# Kernels against the references
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_sum_rows_matches_reference(dt, k):
    rng = np.random.default_rng(1000 * k + DTYPES.index(dt))
    for n in LENGTHS:
        src = random_values(rng, dt, (k, n))
        assert_same(run_rows(dt, src), reference_rows(src, 0, n, dt), dt)


@pytest.mark.parametrize("dt", DTYPES)
def test_sum2_matches_reference(dt):
    rng = np.random.default_rng(7 + DTYPES.index(dt))
    for n in LENGTHS:
        ab = random_values(rng, dt, (2, n))
        a, b = ab[0].copy(), ab[1].copy()
        out = np.zeros(n, ab.dtype)
        SUM2[dt](a, b, out)
        assert_same(out, reference_rows(ab, 0, n, dt), dt)


@pytest.mark.parametrize("dt", DTYPES)
def test_sum_rows_subranges_leave_the_rest_alone(dt):
    rng = np.random.default_rng(11)
    sentinel = np.array(0x5A5A, np.uint16) if dt in HALF else np.array(-1234.5, STORAGE[dt])
    for k in (1, 2, 3, 4, 5):
        ncols = 1100
        src = random_values(rng, dt, (k, ncols))
        for _ in range(12):
            lo = int(rng.integers(0, ncols))
            hi = int(rng.integers(lo, ncols + 1))
            out_lo = int(rng.integers(0, 40))
            out = np.full(out_lo + (hi - lo) + 37, sentinel, src.dtype)
            ROWS[dt](src, lo, hi, out, out_lo)
            assert_same(out[out_lo : out_lo + hi - lo], reference_rows(src, lo, hi, dt), dt)
            assert np.all(out[:out_lo] == sentinel)
            assert np.all(out[out_lo + hi - lo :] == sentinel)


@pytest.mark.parametrize("dt", DTYPES)
def test_sum_rows_out_aliases_a_row(dt):
    """out is row j of src over the same range: every row j, several blocks."""
    rng = np.random.default_rng(12)
    for k in (1, 2, 3, 4, 5):
        for lo, hi in ((0, 1537), (3, 1200), (1, 2), (0, 0)):
            src = random_values(rng, dt, (k, 1537))
            expected = reference_rows(src, lo, hi, dt)
            for j in range(k):
                s = src.copy()
                ROWS[dt](s, lo, hi, s[j], lo)
                assert_same(s[j, lo:hi], expected, dt)
                others = [i for i in range(k) if i != j]
                assert np.array_equal(s[others], src[others], equal_nan=True)
                assert np.array_equal(s[j, :lo], src[j, :lo], equal_nan=True)
                assert np.array_equal(s[j, hi:], src[j, hi:], equal_nan=True)


@pytest.mark.parametrize("dt", DTYPES)
def test_sum2_out_aliases_an_input(dt):
    rng = np.random.default_rng(13)
    for n in (1, 2, 513, 1537):
        ab = random_values(rng, dt, (2, n))
        expected = reference_rows(ab, 0, n, dt)
        a, b = ab[0].copy(), ab[1].copy()
        SUM2[dt](a, b, a)
        assert_same(a, expected, dt)
        assert np.array_equal(b, ab[1], equal_nan=True)
        a, b = ab[0].copy(), ab[1].copy()
        SUM2[dt](a, b, b)
        assert_same(b, expected, dt)
        assert np.array_equal(a, ab[0], equal_nan=True)


@pytest.mark.parametrize("dt", DTYPES)
def test_sum2_length_comes_from_out(dt):
    rng = np.random.default_rng(14)
    ab = random_values(rng, dt, (2, 700))
    out = np.zeros(301, ab.dtype)
    SUM2[dt](ab[0], ab[1], out)
    assert_same(out, reference_rows(ab, 0, 301, dt), dt)


# ---------------------------------------------------------------------------
# Rounding, special values, subnormals
# ---------------------------------------------------------------------------

# (inputs as floats, expected sum as a float) for both 16-bit types, where
# `ulp1` is the spacing just above 1.0 and `half` half of it.
def tie_cases(dt):
    ulp1 = 2.0**-7 if dt == "bf16" else 2.0**-10
    half = ulp1 / 2
    return [
        ([1.0, half], 1.0),  # tie, 1.0 is even: down
        ([1.0 + ulp1, half], 1.0 + 2 * ulp1),  # tie, odd below: up to even
        ([-1.0 - ulp1, -half], -1.0 - 2 * ulp1),  # negative tie, up in magnitude
        ([-1.0, -half], -1.0),
        ([1.0, half, half / 64], 1.0 + ulp1),  # just above the tie: up
        ([1.0, half, -half / 64], 1.0),  # just below the tie: down
        ([1.0 + ulp1, half, -half / 64], 1.0 + ulp1),
        ([2.0, half * 2], 2.0),  # tie one binade up
        ([2.0 + 2 * ulp1, half * 2], 2.0 + 4 * ulp1),
    ]


@pytest.mark.parametrize("dt", HALF)
def test_round_half_to_even(dt):
    for inputs, expected in tie_cases(dt):
        src = bits16(inputs, dt).reshape(-1, 1)
        out = run_rows(dt, src)
        assert out[0] == bits16([expected], dt)[0], (inputs, expected, hex(out[0]))
        # The same through sum2 when there are two inputs.
        if len(inputs) == 2:
            o2 = np.zeros(1, np.uint16)
            SUM2[dt](src[0], src[1], o2)
            assert o2[0] == out[0]


@pytest.mark.parametrize("dt", HALF)
def test_ties_in_a_long_vector(dt):
    """The tie cases across vector lanes, block edges and the odd tail."""
    cases = tie_cases(dt)
    two = [c for c in cases if len(c[0]) == 2]
    n = 1031
    src = np.zeros((2, n), np.uint16)
    expected = np.zeros(n, np.uint16)
    for i in range(n):
        inputs, result = two[i % len(two)]
        src[:, i] = bits16(inputs, dt)
        expected[i] = bits16([result], dt)[0]
    assert_same(run_rows(dt, src), expected, dt)


@pytest.mark.parametrize("dt", HALF)
def test_overflow_to_inf(dt):
    if dt == "bf16":
        big = float(np.float32(2.0**127 * (2 - 2.0**-7)))  # largest finite bf16
        half_ulp = 2.0**119
        below = float(np.float32(2.0**127 * (2 - 2.0**-6)))  # its even neighbour below
    else:
        big, half_ulp, below = 65504.0, 16.0, 65472.0
    inf = np.inf
    cases = [
        ([big, half_ulp], inf),  # tie at the top: to even, which is Inf
        ([-big, -half_ulp], -inf),
        ([big, half_ulp / 2], big),  # below the tie: stays finite
        ([below, half_ulp], below),  # tie with an even neighbour below: down
        ([big, big], inf),
        ([-big, -big, -big], -inf),
        ([big, big, -big], inf if dt == "bf16" else big),  # bf16: float32 overflowed first
    ]
    for inputs, expected in cases:
        src = bits16(inputs, dt).reshape(-1, 1)
        assert run_rows(dt, src)[0] == bits16([expected], dt)[0], (inputs, expected)


@pytest.mark.parametrize("dt", DTYPES)
def test_inf_nan_and_signed_zero(dt):
    inf, nan = np.inf, np.nan
    cases = [
        ([inf, 1.0], inf),
        ([-inf, 1.0], -inf),
        ([inf, inf], inf),
        ([inf, -inf], nan),
        ([-inf, 2.0, inf], nan),
        ([nan, 1.0], nan),
        ([1.0, nan], nan),
        ([nan, inf], nan),
        ([nan], nan),
        ([-0.0, -0.0], -0.0),
        ([-0.0, 0.0], 0.0),
        ([0.0, -0.0], 0.0),
        ([-0.0], -0.0),
        ([-0.0, -0.0, -0.0, -0.0, -0.0], -0.0),
        ([1.0, -1.0], 0.0),
        ([inf], inf),
    ]
    for inputs, expected in cases:
        if dt in HALF:
            src = bits16(inputs, dt).reshape(-1, 1)
            exp = bits16([expected], dt)
        else:
            src = np.array(inputs, STORAGE[dt]).reshape(-1, 1)
            exp = np.array([expected], STORAGE[dt])
        assert_same(run_rows(dt, src), exp, dt)


def test_bf16_nan_keeps_sign_and_becomes_quiet():
    # Signalling NaNs, both signs, with and without arithmetic.
    for k_inputs, expected in [
        ([0x7F81], 0x7FC1),
        ([0xFF81], 0xFFC1),
        ([0x7FC5], 0x7FC5),
        ([0xFFFF], 0xFFFF),
        ([0xFF81, 0x3F80], 0xFFC1),
        ([0x3F80, 0x7F81], 0x7FC1),
    ]:
        src = np.array(k_inputs, np.uint16).reshape(-1, 1)
        assert run_rows("bf16", src)[0] == expected, [hex(v) for v in k_inputs]


@pytest.mark.parametrize("dt", F16)
def test_f16_nan_keeps_sign_and_is_quiet(dt):
    # The bit-level path gives the canonical 0x7E00 | sign; hardware
    # conversions keep the top payload bits too.
    canonical = dt == "f16soft" or not R.HARDWARE_F16
    cases = [([0x7C01], 0), ([0xFC01], 0x8000), ([0x7FFF, 0x3C00], 0), ([0x3C00, 0xFE01], 0x8000)]
    for k_inputs, sign in cases:
        src = np.array(k_inputs, np.uint16).reshape(-1, 1)
        out = run_rows(dt, src)[0]
        assert is_nan(out, dt) and out & 0x0200 and out & 0x8000 == sign, hex(out)
        if canonical:
            assert out == 0x7E00 | sign


@pytest.mark.parametrize("dt", HALF)
def test_subnormals(dt):
    # Patterns: smallest subnormal, largest subnormal, smallest normal.
    s_min, s_max, n_min = (0x0001, 0x007F, 0x0080) if dt == "bf16" else (0x0001, 0x03FF, 0x0400)
    neg = 0x8000
    cases = [
        ([s_min], s_min),
        ([s_min, s_min], 2 * s_min),
        ([s_min, neg | s_min], 0x0000),
        ([neg | s_min, neg | s_min], neg | 2),
        ([s_max, s_min], n_min),  # subnormal + subnormal = smallest normal
        ([n_min, neg | s_min], s_max),  # normal - subnormal = subnormal
        ([s_max, s_max, s_max], None),
        ([0x0005, 0x0003, neg | 0x0002], 0x0006),
    ]
    for inputs, expected in cases:
        src = np.array(inputs, np.uint16).reshape(-1, 1)
        out = run_rows(dt, src)
        ref = reference_rows(src, 0, 1, dt)
        assert out[0] == ref[0], ([hex(v) for v in inputs], hex(out[0]), hex(ref[0]))
        if expected is not None:
            assert out[0] == expected
    # All subnormal pairs of one sign and of mixed sign, vectorized.
    sub = np.arange(1, s_max + 1, dtype=np.uint16)
    a = np.repeat(sub, sub.size)
    b = np.tile(sub, sub.size)
    if not JIT:
        a, b = a[::37], b[::37]
    for signs in (0, neg):
        src = np.stack([a, b | signs]).astype(np.uint16)
        assert_same(run_rows(dt, src), reference_rows(src, 0, a.size, dt), dt)


@numba.njit(cache=True)
def _narrow_bf16(x, out):
    for i in range(x.shape[0]):
        out[i] = np.uint16(convert.bf16_round_hi(x[i]) >> np.uint32(16))


@numba.njit(cache=True)
def _narrow_f16(x, out):
    for i in range(x.shape[0]):
        out[i] = np.uint16(convert.f16_bits_lo(x[i]))


@numba.njit(cache=True)
def _widen_f16(h, out):
    for i in range(h.shape[0]):
        out[i] = convert.f16_hi_to_f32(np.uint32(np.uint32(h[i]) << np.uint32(16)))


@numba.njit(cache=True)
def _narrow_f16_hw(x, out):
    for i in range(x.shape[0]):
        out[i] = primitives.narrow_like(x[i], out)


@numba.njit(cache=True)
def _widen_f16_hw(h, out):
    for i in range(h.shape[0]):
        out[i] = primitives.widen(h[i])


def float32_patterns(rng, count):
    """float32 bit patterns hitting every rounding situation of 16-bit types."""
    parts = [rng.integers(0, 1 << 32, size=count, dtype=np.uint64).astype(np.uint32)]
    # Every 16-bit value with low halves 0 (exact), 0x8000 (tie), 0x7FFF and
    # 0x8001 (just below and above the tie): covers bf16 ties everywhere.
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    parts += [hi | low for low in (0x0000, 0x8000, 0x7FFF, 0x8001, 0x0001, 0xFFFF)]
    # f16 ties and neighbours over the whole float16 range, including the
    # subnormal grid (2**-24 spacing) and the overflow threshold.
    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    h = h[np.isfinite(h)].astype(np.float64)
    up = np.nextafter(h.astype(np.float16), np.float16(np.inf)).astype(np.float64)
    mid = ((h + up) / 2)[np.isfinite(up)]
    mid32 = mid.astype(np.float32)  # exact: f16 midpoints need 12 bits
    above = np.nextafter(mid32, np.float32(np.inf))
    below = np.nextafter(mid32, np.float32(-np.inf))
    for m in (mid32, above, below):
        parts.append(m.view(np.uint32))
    # f16 overflow threshold 65520 and neighbours, Inf, NaNs, float32
    # subnormals, and 2**-25 (half the smallest f16 subnormal) with neighbours.
    edges = [0x477FF000, 0x477FEFFF, 0x477FF001, 0xC77FF000, 0x7F800000, 0xFF800000, 0x7F800001,
             0xFFC00000, 0x00000001, 0x80000001, 0x33000000, 0x33000001, 0x32FFFFFF, 0xB3000000]
    parts.append(np.array(edges, np.uint32))
    return np.concatenate(parts)


def test_narrowing_conversions_match_oracles():
    """The float32 -> bf16 / f16 rounding itself, including subnormal results
    (sum_rows can't produce those inexactly: 16-bit inputs sum to multiples of
    the subnormal spacing)."""
    rng = np.random.default_rng(15)
    bits = float32_patterns(rng, 200_000 if JIT else 2_000)
    if not JIT:
        bits = bits[:: max(1, bits.size // 20_000)]
    x = bits.view(np.float32)
    out = np.zeros(x.size, np.uint16)
    _narrow_f16(x, out)
    assert_same(out, x.astype(np.float16).view(np.uint16), "f16")
    if R.HARDWARE_F16 or not JIT:
        _narrow_f16_hw(x, out)
        assert_same(out, x.astype(np.float16).view(np.uint16), "f16")
    _narrow_bf16(x, out)
    assert_same(out, narrow(x, "bf16"), "bf16")


def test_f16_widening_is_exact_for_every_pattern():
    h = np.arange(1 << 16, dtype=np.uint16)
    if not JIT:
        h = h[::17]
    out = np.zeros(h.size, np.float32)
    _widen_f16(h, out)
    assert_same(out, h.view(np.float16).astype(np.float32), "f32")
    if R.HARDWARE_F16 or not JIT:
        _widen_f16_hw(h, out)
        assert_same(out, h.view(np.float16).astype(np.float32), "f32")


# ---------------------------------------------------------------------------
# Error bound
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dt", HALF)
def test_error_bound_against_exact_sums(dt):
    """|out - s*| <= 0.5 ulp_T(s) + gamma_{k-1} sum|x|, as the module states."""
    rng = np.random.default_rng(16)
    n = 2000 if JIT else 300
    u = 2.0**-24
    for k in (1, 2, 3, 4, 5):
        x = rng.standard_normal((k, n)).astype(np.float32) * np.float32(2.0 ** rng.integers(-6, 7))
        if dt in F16:
            src = x.astype(np.float16).view(np.uint16)
        else:
            src = narrow(x, "bf16")
        out = widen(run_rows(dt, src), dt).astype(np.float64)
        vals = widen(src, dt).astype(np.float64)
        s = seq_sum(list(widen(src, dt))).astype(np.float64)
        exact = np.array([math.fsum(vals[:, i]) for i in range(n)])
        _, e = np.frexp(s)
        e = np.maximum(e - 1, -126 if dt == "bf16" else -14)
        ulp = np.ldexp(1.0, e - (7 if dt == "bf16" else 10))
        gamma = (k - 1) * u / (1 - (k - 1) * u)
        bound = 0.5 * ulp + gamma * np.abs(vals).sum(axis=0)
        err = np.abs(out - exact)
        assert np.all(err <= bound * (1 + 1e-12)), float(np.max(err / bound))
        if k == 2:  # exponents within 15 (bf16) / 12 (f16): float32 sum exact
            limit = 15 if dt == "bf16" else 12
            _, ea = np.frexp(vals[0])
            _, eb = np.frexp(vals[1])
            close = (np.abs(ea - eb) <= limit) & (vals[0] != 0) & (vals[1] != 0)
            assert close.sum() > n // 2
            assert np.array_equal(s[close], exact[close])


# ---------------------------------------------------------------------------
# Calling conventions
# ---------------------------------------------------------------------------


# How the collectives hand memory to the kernels: an integer address turned
# into a typed pointer (inttoptr) and wrapped with numba.carray.
if JIT:
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def _address_to_pointer(typingctx, address, example):
        """Typed pointer (CPointer of example's type) from an integer address."""
        ptrty = types.CPointer(example)

        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(ptrty))

        return ptrty(address, example), codegen

else:

    def _address_to_pointer(address, example):
        ctype = {np.uint16: ctypes.c_uint16, np.float32: ctypes.c_float,
                 np.float64: ctypes.c_double}
        return ctypes.cast(int(address), ctypes.POINTER(ctype[type(example)]))


@numba.njit
def _rows_via_carray(kernel, src_addr, k, ncols, out_addr, nout, lo, hi, out_lo, example):
    src = numba.carray(_address_to_pointer(src_addr, example), (k, ncols))
    out = numba.carray(_address_to_pointer(out_addr, example), (nout,))
    kernel(src, lo, hi, out, out_lo)


@numba.njit
def _sum2_via_carray(kernel, a_addr, b_addr, out_addr, n, example):
    a = numba.carray(_address_to_pointer(a_addr, example), (n,))
    b = numba.carray(_address_to_pointer(b_addr, example), (n,))
    out = numba.carray(_address_to_pointer(out_addr, example), (n,))
    kernel(a, b, out)


@numba.njit
def _rows_repeatedly(kernel, src, out, reps):
    # Many calls from one compiled loop (each call gets its own stack scratch).
    for r in range(reps):
        kernel(src, r, src.shape[1], out, r)


@pytest.mark.parametrize("dt", DTYPES)
def test_callable_from_compiled_code(dt):
    rng = np.random.default_rng(17)
    k, ncols = 3, 1301
    src = random_values(rng, dt, (k, ncols))
    out = np.zeros(ncols + 5, src.dtype)
    example = STORAGE[dt](0)
    _rows_via_carray(ROWS[dt], src.ctypes.data, k, ncols, out.ctypes.data, out.size, 10, 1200, 5,
                     example)
    assert_same(out[5 : 5 + 1190], reference_rows(src, 10, 1200, dt), dt)

    a, b = src[0].copy(), src[1].copy()
    out = np.zeros(ncols, src.dtype)
    _sum2_via_carray(SUM2[dt], a.ctypes.data, b.ctypes.data, out.ctypes.data, ncols, example)
    assert_same(out, reference_rows(src[:2], 0, ncols, dt), dt)

    out = np.zeros(ncols, src.dtype)
    _rows_repeatedly(ROWS[dt], src, out, 4)
    assert_same(out[3:], reference_rows(src, 3, ncols, dt), dt)


@pytest.mark.parametrize("dt", DTYPES)
def test_bad_ranges_raise(dt):
    src = np.zeros((2, 10), STORAGE[dt])
    out = np.zeros(10, STORAGE[dt])
    f = ROWS[dt]
    for lo, hi, out_lo in [(-1, 5, 0), (6, 5, 0), (0, 11, 0), (0, 10, 1), (0, 5, -1), (2, 10, 3)]:
        with pytest.raises(ValueError):
            f(src, lo, hi, out, out_lo)
    with pytest.raises(ValueError):
        f(np.zeros((0, 10), STORAGE[dt]), 0, 10, out, 0)
    f(src, 4, 4, out, 10)  # empty range at the very end is fine
    with pytest.raises(ValueError):
        SUM2[dt](src[0, :5], src[1], out)


@pytest.mark.skipif(not JIT, reason="signatures exist only when compiled")
@pytest.mark.parametrize("dt", PUBLIC)
def test_signatures_are_exact_and_strict(dt):
    # One compiled signature each, no lazy compilation of others.
    assert len(ROWS[dt].signatures) == 1
    assert len(SUM2[dt].signatures) == 1
    src = np.zeros((2, 8), STORAGE[dt])
    with pytest.raises(TypeError):
        ROWS[dt](src[:, ::2], 0, 4, np.zeros(4, STORAGE[dt]), 0)  # not C-contiguous
    with pytest.raises(TypeError):
        ROWS[dt](src.astype(np.int32), 0, 4, np.zeros(4, np.int32), 0)


def test_tables_and_warm_up():
    assert set(R.SUM_ROWS) == set(R.SUM_ROWS_X) == set(R.SUM2) == set(PUBLIC)
    assert R.SUM_ROWS["bf16"] is R.sum_rows_bf16 and R.SUM2["f64"] is R.sum2_f64
    assert R.SUM_ROWS_X["f16"] is R.sum_rows_x_f16
    R.warm_up()


# ---------------------------------------------------------------------------
# sum_rows_x: row `me` from a private vector x, the result stored twice
# ---------------------------------------------------------------------------

# Around the blocks: 256 float elements, 256 pairs = 512 16-bit elements.
LENGTHS_X = [0, 1, 2, 255, 256, 257, 511, 512, 513, 1000] if JIT else [0, 1, 255, 256, 257, 513]


def assert_x_matches_rows(dt, src, lo, hi, me, x, out, out2, out_lo):
    """out and out2 hold, at out_lo, exactly sum_rows on the substituted src:
    the same bits, NaN payloads included where at most one input is NaN."""
    sub = substituted(src, me, x)
    expected = np.zeros(hi - lo, src.dtype)
    ROWS[dt](sub, lo, hi, expected, 0)
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}[src.dtype.itemsize]
    one_nan = nan_inputs(sub[:, lo:hi], dt) <= 1
    for o in (out, out2):
        got = o[out_lo : out_lo + hi - lo]
        assert_same(got, expected, dt)
        a, b = got.view(uint)[one_nan], expected.view(uint)[one_nan]
        assert np.array_equal(a, b), np.nonzero(a != b)[0][:5]
    return expected


def x_inputs(rng, dt, k, n, extra=0):
    """src (k, n), and x of n + extra with different values (so that reading
    src[me] instead of x would show)."""
    src = random_values(rng, dt, (k, n))
    x = random_values(rng, dt, (n + extra,))
    return src, x


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_sum_rows_x_matches_sum_rows(dt, k):
    rng = np.random.default_rng(2000 * k + DTYPES.index(dt))
    for n in LENGTHS_X:
        src, x = x_inputs(rng, dt, k, n)
        for me in range(k):
            out = np.zeros(n, src.dtype)
            out2 = np.zeros(n, src.dtype)
            s0, x0 = src.copy(), x.copy()
            ROWS_X[dt](src, 0, n, me, x, out, out2, 0)
            expected = assert_x_matches_rows(dt, src, 0, n, me, x, out, out2, 0)
            # and against the independent reference
            assert_same(expected, reference_rows(substituted(src, me, x), 0, n, dt), dt)
            assert np.array_equal(src, s0, equal_nan=True) and np.array_equal(x, x0, equal_nan=True)


@pytest.mark.parametrize("dt", DTYPES)
def test_sum_rows_x_subranges_leave_the_rest_alone(dt):
    rng = np.random.default_rng(21)
    sentinel = np.array(0x5A5A, np.uint16) if dt in HALF else np.array(-1234.5, STORAGE[dt])
    ncols = 1100 if JIT else 600
    for k in (1, 2, 3, 4, 5):
        src, x = x_inputs(rng, dt, k, ncols, extra=9)
        for trial in range(6 if JIT else 2):
            me = trial % k
            lo = int(rng.integers(0, ncols))
            hi = int(rng.integers(lo, ncols + 1))
            out_lo = int(rng.integers(0, 40))
            out = np.full(out_lo + (hi - lo) + 37, sentinel, src.dtype)
            out2 = np.full(out_lo + (hi - lo) + 3, sentinel, src.dtype)
            ROWS_X[dt](src, lo, hi, me, x, out, out2, out_lo)
            assert_x_matches_rows(dt, src, lo, hi, me, x, out, out2, out_lo)
            for o in (out, out2):
                assert np.all(o[:out_lo] == sentinel)
                assert np.all(o[out_lo + hi - lo :] == sentinel)
        # out and out2 may be the same array
        out = np.zeros(ncols + 3, src.dtype)
        ROWS_X[dt](src, 1, ncols, 0, x, out, out, 3)
        assert_x_matches_rows(dt, src, 1, ncols, 0, x, out, out, 3)
        # x exactly hi long is enough
        lo, hi = 5, 300
        out = np.zeros(hi - lo, src.dtype)
        out2 = np.zeros(hi - lo, src.dtype)
        ROWS_X[dt](src, lo, hi, k - 1, x[:hi].copy(), out, out2, 0)
        assert_x_matches_rows(dt, src, lo, hi, k - 1, x, out, out2, 0)


@pytest.mark.parametrize("dt", DTYPES)
def test_sum_rows_x_in_place(dt):
    """The reduce-scatter call: out is the rank's own shared row src[me], out2
    is x itself, both at out_lo == lo (and out another row of src)."""
    rng = np.random.default_rng(22)
    ncols = 1537 if JIT else 520
    if JIT:
        ranges = [(0, ncols), (3, ncols - 100), (1, 2), (0, 0), (513, 1026)]
    else:
        ranges = [(3, 518), (1, 2)]
    for k in (1, 2, 3, 4, 5):
        for lo, hi in ranges:
            src, x = x_inputs(rng, dt, k, ncols, extra=5)
            for me in range(k):
                expected = np.zeros(hi - lo, src.dtype)
                ROWS[dt](substituted(src, me, x), lo, hi, expected, 0)
                for j in sorted({me, (me + 1) % k}):  # out = src[me], or another row
                    s, xx = src.copy(), x.copy()
                    ROWS_X[dt](s, lo, hi, me, xx, s[j], xx, lo)
                    assert_same(s[j, lo:hi], expected, dt)
                    assert_same(xx[lo:hi], expected, dt)
                    assert np.array_equal(s[j, lo:hi], xx[lo:hi], equal_nan=True)
                    others = [i for i in range(k) if i != j]
                    assert np.array_equal(s[others], src[others], equal_nan=True)
                    assert np.array_equal(s[j, :lo], src[j, :lo], equal_nan=True)
                    assert np.array_equal(s[j, hi:], src[j, hi:], equal_nan=True)
                    assert np.array_equal(xx[:lo], x[:lo], equal_nan=True)
                    assert np.array_equal(xx[hi:], x[hi:], equal_nan=True)


def special_pool(dt):
    """Stored values that exercise ties, overflow, Inf, NaN and signed zeros."""
    if dt in HALF:
        ulp1 = 2.0**-7 if dt == "bf16" else 2.0**-10
        big = float(np.float32(2.0**127 * (2 - 2.0**-7))) if dt == "bf16" else 65504.0
        vals = [0.0, -0.0, 1.0, -1.0, ulp1 / 2, -ulp1 / 2, 1.0 + ulp1, -1.0 - ulp1, big, -big,
                np.inf, -np.inf]
        pool = list(bits16(vals, dt))
        pool += [0x7F81, 0xFF81, 0x7FC5] if dt == "bf16" else [0x7C01, 0xFC01, 0x7E05]  # NaNs
        pool += [0x0001, 0x8001]  # smallest subnormals
        return np.array(pool, np.uint16)
    tiny = np.finfo(STORAGE[dt]).smallest_subnormal
    eps = np.finfo(STORAGE[dt]).eps
    vals = [0.0, -0.0, 1.0, -1.0, eps / 2, -eps / 2, 1.0 + eps, np.inf, -np.inf, np.nan, -np.nan,
            tiny, -tiny, np.finfo(STORAGE[dt]).max]
    return np.array(vals, STORAGE[dt])


@pytest.mark.parametrize("dt", DTYPES)
def test_sum_rows_x_special_values(dt):
    # Explicit cases with known results; every choice of me.
    inf, nan = np.inf, np.nan
    cases = [([inf, 1.0], inf), ([inf, -inf], nan), ([nan, 1.0], nan), ([1.0, nan], nan),
             ([-0.0, -0.0], -0.0), ([-0.0, 0.0], 0.0), ([0.0, -0.0], 0.0), ([-0.0], -0.0),
             ([-0.0, -0.0, -0.0, -0.0, -0.0], -0.0), ([-inf, 2.0, inf], nan), ([1.0, -1.0], 0.0)]
    if dt in HALF:
        cases += tie_cases(dt)
    for inputs, result in cases:
        if dt in HALF:
            col, exp = bits16(inputs, dt), bits16([result], dt)
        else:
            col, exp = np.array(inputs, STORAGE[dt]), np.array([result], STORAGE[dt])
        for me in range(len(col)):
            # src[me] holds a NaN that must not be read; x holds the real input
            src = col.reshape(-1, 1).copy()
            x = src[me].copy()
            src[me] = 0x7FC0 if dt in HALF else np.nan
            out = np.zeros(1, src.dtype)
            out2 = np.zeros(1, src.dtype)
            ROWS_X[dt](src, 0, 1, me, x, out, out2, 0)
            assert_same(out, exp, dt)
            assert_same(out2, exp, dt)
    # Long random mixes of those values across blocks and the odd tail.
    rng = np.random.default_rng(23)
    pool = special_pool(dt)
    n = 1031 if JIT else 259
    for k in (1, 2, 3, 5):
        src = rng.choice(pool, (k, n))
        x = rng.choice(pool, n)
        for me in range(k):
            out = np.zeros(n, src.dtype)
            out2 = np.zeros(n, src.dtype)
            ROWS_X[dt](src, 0, n, me, x, out, out2, 0)
            assert_x_matches_rows(dt, src, 0, n, me, x, out, out2, 0)
            s, xx = src.copy(), x.copy()
            ROWS_X[dt](s, 0, n, me, xx, s[me], xx, 0)
            assert np.array_equal(s[me], out, equal_nan=True)
            assert np.array_equal(xx, out, equal_nan=True)


@pytest.mark.parametrize("dt", DTYPES)
def test_sum_rows_x_bad_arguments_raise(dt):
    st = STORAGE[dt]
    src = np.zeros((3, 10), st)
    x = np.zeros(10, st)
    out = np.zeros(10, st)
    out2 = np.zeros(10, st)
    f = ROWS_X[dt]
    for lo, hi, out_lo in [(-1, 5, 0), (6, 5, 0), (0, 11, 0), (0, 10, 1), (0, 5, -1), (2, 10, 3)]:
        with pytest.raises(ValueError):
            f(src, lo, hi, 0, x, out, out2, out_lo)
    for me in (-1, 3, 100):
        with pytest.raises(ValueError, match="me"):
            f(src, 0, 10, me, x, out, out2, 0)
    with pytest.raises(ValueError, match="x"):
        f(src, 0, 10, 1, x[:9], out, out2, 0)
    with pytest.raises(ValueError, match="out2"):
        f(src, 0, 10, 1, x, out, out2[:9], 0)
    with pytest.raises(ValueError, match="out"):
        f(src, 0, 10, 1, x, out[:9], out2, 0)
    with pytest.raises(ValueError, match="out2"):
        f(src, 2, 7, 1, x, out, out2[:8], 4)
    with pytest.raises(ValueError):
        f(np.zeros((0, 10), st), 0, 10, 0, x, out, out2, 0)
    f(src, 4, 4, 2, x[:4], out, out2, 10)  # empty range at the very end is fine
    f(src, 2, 7, 1, x[:7], out[:5], out2[:5], 0)  # everything exactly long enough


@pytest.mark.skipif(not JIT, reason="signatures exist only when compiled")
@pytest.mark.parametrize("dt", PUBLIC)
def test_sum_rows_x_signature_is_exact_and_strict(dt):
    f = R.SUM_ROWS_X[dt]
    assert len(f.signatures) == 1
    st = STORAGE[dt]
    src = np.zeros((2, 8), st)
    x, out, out2 = np.zeros(8, st), np.zeros(8, st), np.zeros(8, st)
    with pytest.raises(TypeError):
        f(src, 0, 4, 0, np.zeros(16, st)[::2], out, out2, 0)  # x not C-contiguous
    with pytest.raises(TypeError):
        f(src, 0, 4, 0, x.astype(np.int32), out, out2, 0)
    f(src, 0, 8, 1, x, out, out2, 0)
    assert len(f.signatures) == 1


@numba.njit
def _rows_x_via_carray(kernel, src_addr, k, ncols, x_addr, nx, lo, hi, me, example):
    # The reduce-scatter call from compiled code: out = src[me], out2 = x.
    src = numba.carray(_address_to_pointer(src_addr, example), (k, ncols))
    x = numba.carray(_address_to_pointer(x_addr, example), (nx,))
    kernel(src, lo, hi, me, x, src[me], x, lo)


@pytest.mark.parametrize("dt", DTYPES)
def test_sum_rows_x_callable_from_compiled_code(dt):
    rng = np.random.default_rng(24)
    k, ncols, lo, hi, me = 3, 1301, 10, 1200, 1
    src, x = x_inputs(rng, dt, k, ncols)
    expected = np.zeros(hi - lo, src.dtype)
    ROWS[dt](substituted(src, me, x), lo, hi, expected, 0)
    s, xx = src.copy(), x.copy()
    example = STORAGE[dt](0)
    _rows_x_via_carray(ROWS_X[dt], s.ctypes.data, k, ncols, xx.ctypes.data, xx.size, lo, hi, me,
                       example)
    assert_same(s[me, lo:hi], expected, dt)
    assert_same(xx[lo:hi], expected, dt)


@pytest.mark.timeout(330)  # the subprocess's own 300 s first (44 s on a quiet machine)
@pytest.mark.skipif(not JIT, reason="already in pure-Python mode")
def test_pure_python_mode():
    """This whole file again with NUMBA_DISABLE_JIT=1: runs the kernel code as
    Python (coverage) and checks the numpy fallbacks of the intrinsics."""
    env = dict(os.environ, NUMBA_DISABLE_JIT="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         os.path.abspath(__file__)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
