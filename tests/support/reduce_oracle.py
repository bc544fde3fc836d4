"""Oracles for the reduce kernels, shared by tests/test_reduce.py and
tests/test_reduce_properties.py: the dtypes under test, the kernel tables
with the portable f16 path ("f16soft") added, and references built from
numpy's float16 casts, torch's bfloat16 cast and plain float32 adds, none
of which share the kernels' bit tricks."""

import numba
import numpy as np
import pytest

import harmpi.reduce as R
from harmpi.reduce import kernels

__all__ = ["JIT", "DTYPES", "HALF", "F16", "STORAGE", "ROWS", "ROWS_X", "SUM2", "widen",
           "seq_sum", "narrow", "reference_rows", "is_nan", "assert_same", "random_values",
           "bits16", "run_rows", "substituted", "nan_inputs"]

JIT = not numba.config.DISABLE_JIT
# "f16soft" is the portable bit-level f16 path, which sum_rows_f16 uses only
# where the CPU lacks f16 conversions (R.HARDWARE_F16 False); tested here
# through the private kernel bodies so it is covered on every machine.
# In pure-Python mode f16 already is the bit-level path: no need to run it twice.
DTYPES = ["bf16", "f16", "f16soft", "f32", "f64"] if JIT else ["bf16", "f16", "f32", "f64"]
HALF = [dt for dt in DTYPES if dt not in ("f32", "f64")]
F16 = [dt for dt in HALF if dt != "bf16"]
STORAGE = {"bf16": np.uint16, "f16": np.uint16, "f16soft": np.uint16, "f32": np.float32,
           "f64": np.float64}


@numba.njit(cache=True)
def _sum_rows_f16soft(src, lo, hi, out, out_lo):
    kernels._sum_rows_pairs(src, lo, hi, out, out_lo, True)


@numba.njit(cache=True)
def _sum2_f16soft(a, b, out):
    kernels._sum2_pairs(a, b, out, True)


@numba.njit(cache=True)
def _sum_rows_x_f16soft(src, lo, hi, me, x, out, out2, out_lo):
    kernels._sum_rows_x_pairs(src, lo, hi, me, x, out, out2, out_lo, True)


ROWS = dict(R.SUM_ROWS, f16soft=_sum_rows_f16soft)
ROWS_X = dict(R.SUM_ROWS_X, f16soft=_sum_rows_x_f16soft)
SUM2 = dict(R.SUM2, f16soft=_sum2_f16soft)


def widen(bits, dt):
    """Stored values -> float32 (bf16, f16) or the float type itself."""
    bits = np.asarray(bits, STORAGE[dt])
    if dt == "bf16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    if dt in F16:
        return bits.view(np.float16).astype(np.float32)
    return bits


def seq_sum(rows):
    """Row-ordered sum in the rows' own float type (float32 or float64)."""
    acc = rows[0].copy()
    for r in rows[1:]:
        acc = acc + r
    return acc


def narrow(acc, dt):
    """float32 accumulator -> stored 16-bit values, by an independent oracle."""
    acc = np.ascontiguousarray(acc, np.float32)
    if dt in F16:
        return acc.astype(np.float16).view(np.uint16)
    torch = pytest.importorskip("torch")
    return torch.from_numpy(acc.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def reference_rows(src, lo, hi, dt):
    rows = [widen(src[j, lo:hi], dt) for j in range(src.shape[0])]
    acc = seq_sum(rows)
    return narrow(acc, dt) if dt in HALF else acc


def is_nan(values, dt):
    values = np.asarray(values)
    if dt == "bf16":
        return (values & 0x7FFF) > 0x7F80
    if dt in F16:
        return (values & 0x7FFF) > 0x7C00
    return np.isnan(values)


def assert_same(out, expected, dt):
    """Bitwise equal, except that NaN only has to meet NaN (payloads differ)."""
    out = np.asarray(out)
    expected = np.asarray(expected)
    assert out.shape == expected.shape
    nan_out = is_nan(out, dt)
    nan_exp = is_nan(expected, dt)
    np.testing.assert_array_equal(nan_out, nan_exp, err_msg="NaN positions differ")
    if dt in HALF:
        quiet_bit = 0x0040 if dt == "bf16" else 0x0200
        assert np.all(out[nan_out] & quiet_bit), "16-bit NaN results must be quiet"
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}[out.dtype.itemsize]
    a = out.view(uint)[~nan_out]
    b = expected.view(uint)[~nan_out]
    bad = np.nonzero(a != b)[0]
    assert bad.size == 0, (
        f"{bad.size} values differ, first at {bad[0]}: {a[bad[0]]:#x} != {b[bad[0]]:#x}"
    )


def random_values(rng, dt, shape, specials=True):
    """Stored arrays: random 16-bit patterns for bf16/f16 (all classes of
    values), normal values with some Inf/NaN/-0/subnormals for f32/f64."""
    if dt in HALF:
        return rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    x = rng.standard_normal(shape).astype(STORAGE[dt])
    if specials and x.size:
        flat = x.reshape(-1)
        tiny = np.finfo(STORAGE[dt]).smallest_subnormal
        picks = rng.integers(0, flat.size, size=max(1, flat.size // 50))
        specials_pool = np.array([np.inf, -np.inf, np.nan, -0.0, 3 * tiny, -tiny], STORAGE[dt])
        flat[picks] = rng.choice(specials_pool, picks.size)
    return x


def bits16(values, dt):
    """Python floats -> stored 16-bit patterns (exactly representable values only)."""
    x = np.asarray(values, np.float32)
    if dt in F16:
        h = x.astype(np.float16)
        assert np.array_equal(h.astype(np.float32), x, equal_nan=True), "not representable"
        return h.view(np.uint16)
    b = x.view(np.uint32)
    assert not np.any(b & 0xFFFF), "not representable in bf16"
    return (b >> 16).astype(np.uint16)


def run_rows(dt, src, lo=0, hi=None, out=None, out_lo=0):
    hi = src.shape[1] if hi is None else hi
    if out is None:
        out = np.zeros(hi - lo, src.dtype)
    ROWS[dt](src, lo, hi, out, out_lo)
    return out


def substituted(src, me, x):
    """src with row me replaced by x[:ncols]: what sum_rows_x must sum."""
    s = src.copy()
    s[me] = x[: src.shape[1]]
    return s


def nan_inputs(src, dt):
    """Per column, how many of the rows are NaN."""
    return is_nan(src, dt).sum(axis=0)
