"""Property tests of harmpi.reduce (hypothesis): every kernel against numpy.

hypothesis draws the number of rows k (1..8), the summed range [lo, hi) (its
length 0..300, and lengths around the kernels' blocks and vector widths), the
output offset, and stored values that mix NaNs (quiet and signalling, both
signs, several payloads), +-Inf, +-0, subnormals of the stored type, its
largest finite values (so sums overflow to Inf), and columns on which
rounding decides: an accumulated sum exactly halfway between two neighbours
of the stored type (a tie), just above or below one, or a small term that
the accumulator's precision and the row order absorb or keep.

The references are those of test_reduce.py: numpy's row-ordered float32 /
float64 sums, then one round to nearest even by numpy's float16 cast or
torch's bfloat16 cast, compared bitwise except that NaN only has to meet NaN.
Kernel-against-kernel properties (sum_rows_x with the own row as x is
sum_rows; a sum does not depend on where its range sits, on the output
offset, or on being summed in place; sum2 is a two-row sum) compare all bits,
NaN payloads included wherever at most one input of an element is NaN (the
module leaves open which of several NaNs survives).

Runs are reproducible: the default profile, harmpi-ci, is derandomized (the
same examples every run, no example database). A longer random search:

    HARMPI_HYPOTHESIS_PROFILE=harmpi-explore python -m pytest tests/test_reduce_properties.py

test_pure_python_mode runs a small subset again with NUMBA_DISABLE_JIT=1.
"""

import dataclasses
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.reduce_oracle import (
    DTYPES,
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
    reference_rows,
)

import harmpi.reduce as R
from harmpi.reduce import primitives

# No deadline and no too_slow health check: both depend on the machine's
# load, and a run must not fail for that.
settings.register_profile(
    "harmpi-ci", max_examples=60, deadline=None, derandomize=True, database=None,
    print_blob=True, suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "harmpi-explore", settings.get_profile("harmpi-ci"), max_examples=2000, derandomize=False
)
settings.register_profile("harmpi-nojit", settings.get_profile("harmpi-ci"), max_examples=12)
PROFILE = settings.get_profile(
    os.environ.get("HARMPI_HYPOTHESIS_PROFILE", "harmpi-ci" if JIT else "harmpi-nojit")
)

MAX_ROWS = 8
# Pure Python sums a few microseconds per element: shorter rows there.
MAX_LENGTH = 300 if JIT else 24
# Lengths at the kernels' edges: vector widths and their unrolled multiples
# (doubled for the 16-bit kernels, which work on pairs), one and two blocks
# (_BLOCK float elements, _BLOCK pairs = 2 * _BLOCK 16-bit elements).
EDGE_LENGTHS = sorted(
    {w + d for w in (2, 4, 8, 16, 32, 64, 128) for d in (-1, 0, 1)}
    | {b + d for b in (primitives.BLOCK, 2 * primitives.BLOCK) for d in (-2, -1, 0, 1, 2)}
) if JIT else [primitives.BLOCK - 1, 2 * primitives.BLOCK + 1]


@pytest.fixture(autouse=True)
def _quiet_float_warnings():
    # Overflow, Inf - Inf and NaN are intended; numpy would warn about them.
    with np.errstate(all="ignore"):
        yield


# ---------------------------------------------------------------------------
# Bit layouts of the stored types
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """Bit layout of a stored type: its unsigned twin, width, mantissa bits."""

    uint: type
    nbits: int
    mant: int

    @property
    def sign(self):
        return 1 << (self.nbits - 1)

    @property
    def inf(self):
        """+Inf; also the exponent mask."""
        return ((1 << (self.nbits - 1 - self.mant)) - 1) << self.mant

    @property
    def quiet(self):
        return 1 << (self.mant - 1)

    @property
    def emax(self):
        """Exponent of the largest finite value (also the bias)."""
        return (1 << (self.nbits - 2 - self.mant)) - 1

    @property
    def emin(self):
        """Exponent of the smallest normal value."""
        return 1 - self.emax

    @property
    def esub(self):
        """Exponent of the smallest subnormal value."""
        return self.emin - self.mant


LAYOUT = {
    "bf16": Layout(np.uint16, 16, 7),
    "f16": Layout(np.uint16, 16, 10),
    "f16soft": Layout(np.uint16, 16, 10),
    "f32": Layout(np.uint32, 32, 23),
    "f64": Layout(np.uint64, 64, 52),
}


def bits_of(values):
    """The bit patterns of stored values (a view)."""
    return values.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[values.dtype.itemsize])


def to_bits(values, dt):
    """Python floats (exactly representable in dt) -> bit patterns."""
    if dt in HALF:
        return bits16(values, dt)
    return np.asarray(values, STORAGE[dt]).view(LAYOUT[dt].uint)


def special_bits(dt):
    """NaNs (quiet, signalling, several payloads), +-Inf, +-0, subnormals
    (smallest, middle, largest), the smallest normal, the two largest finite
    values, 1 and its upper neighbour; both signs of each."""
    L = LAYOUT[dt]
    mask = (1 << L.mant) - 1
    nans = [L.inf | L.quiet, L.inf | 1, L.inf | mask, L.inf | L.quiet | 0x15, L.inf | 0x15]
    one = int(to_bits([1.0], dt)[0])
    finite = [0, 1, L.quiet, mask, mask + 1, L.inf - 1, L.inf - 2, one, one + 1]
    magnitudes = nans + [L.inf] + finite
    return [v for m in magnitudes for v in (m, L.sign | m)]


# A NaN that no kernel makes (signalling, odd payload), and the background of
# the outputs: a finite value a sum of the drawn inputs rarely gives.
def poison(dt):
    return LAYOUT[dt].inf | 0x5


SENTINEL = {"bf16": 0x5A5A, "f16": 0x5A5A, "f16soft": 0x5A5A,
            "f32": int(np.float32(-1234.5).view(np.uint32)),
            "f64": int(np.float64(-1234.5).view(np.uint64))}


def filled(dt, size, value):
    return np.full(size, value, LAYOUT[dt].uint).view(STORAGE[dt])


# ---------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------

SIGNS = st.sampled_from([1.0, -1.0])
ZEROS = st.sampled_from([0.0, -0.0])


def lengths():
    return st.one_of(st.integers(0, MAX_LENGTH), st.sampled_from(EDGE_LENGTHS))


def element_bits(dt):
    """One stored value as its bit pattern: a special, a subnormal, anything."""
    L = LAYOUT[dt]
    subnormal = st.tuples(st.integers(1, (1 << L.mant) - 1), st.sampled_from([0, L.sign]))
    return st.one_of(
        st.sampled_from(special_bits(dt)),
        subnormal.map(lambda ms: ms[0] | ms[1]),
        st.integers(0, (1 << L.nbits) - 1),
    )


# Mantissa bits of the accumulator: float64 for f64, float32 for the others.
ACC_MANT = {dt: LAYOUT["f64" if dt == "f64" else "f32"].mant for dt in LAYOUT}
ROUNDINGS = ("tie", "split", "above", "below", "absorbed")


@st.composite
def rounding_column(draw, dt, k):
    """k stored values, in drawn row order, whose sum rounding decides:

    tie: a + h with h half an ulp of a in dt, exactly halfway between two
        neighbours (a quarter of the a's are the largest finite value, whose
        tie rounds to Inf);
    split, above, below: a + h/2 + h/2, a + h + h/64, a + h - h/64;
    absorbed: a + s - a with s at or below half an ulp of a in the
        accumulator: row order and accumulator precision decide whether s
        survives.

    Signed zeros fill the other rows."""
    L = LAYOUT[dt]
    e_any = st.integers(max(L.emin, L.esub + L.mant + 1), L.emax)
    e = draw(st.one_of(e_any, st.just(L.emax)), label="exponent of a")
    frac_any = st.integers(0, (1 << L.mant) - 1)
    frac = draw(st.one_of(frac_any, st.just((1 << L.mant) - 1)), label="fraction of a")
    a = math.ldexp((1 << L.mant) + frac, e - L.mant) * draw(SIGNS)
    h = math.ldexp(1.0, e - L.mant - 1) * draw(SIGNS)
    how = draw(st.sampled_from(ROUNDINGS), label="rounding")
    parts = [a, h]
    if how == "split" and e - L.mant - 2 >= L.esub:
        parts = [a, h / 2, h / 2]
    elif how in ("above", "below") and e - L.mant - 7 >= L.esub:
        parts.append(h / 64 if how == "above" else -h / 64)
    elif how == "absorbed":
        d = draw(st.integers(ACC_MANT[dt] + 1, ACC_MANT[dt] + 9), label="exponent gap")
        parts = [a, math.copysign(math.ldexp(1.0, max(e - d, L.esub)), h), -a]
    parts = parts[:k] + [draw(ZEROS) for _ in range(k - len(parts))]
    return [int(b) for b in to_bits(draw(st.permutations(parts)), dt)]


# How stored_values fills an array before placing single values and rounding
# columns: zeros, random signed zeros, normal values (each row with its own
# scale), specials, any bit pattern (filled by numpy from a drawn seed), or
# a few drawn rounding columns repeated across it.
BACKGROUNDS = ("zeros", "signed zeros", "normal", "specials", "patterns", "rounding")


def background(kind, seed, dt, shape):
    """Bit patterns of shape filled by numpy from seed (any kind but rounding)."""
    L = LAYOUT[dt]
    rng = np.random.default_rng(seed)
    if kind == "zeros":
        return np.zeros(shape, L.uint)
    if kind == "signed zeros":
        return rng.choice(np.array([0, L.sign], L.uint), size=shape)
    if kind == "specials":
        return rng.choice(np.array(special_bits(dt), L.uint), size=shape)
    if kind == "patterns":
        return rng.integers(0, 1 << L.nbits, size=shape, dtype=L.uint)
    x = rng.standard_normal(shape) * 2.0 ** rng.integers(-8, 9, size=(shape[0], 1))
    if dt in HALF:
        return narrow(x.astype(np.float32), dt).reshape(shape)
    return x.astype(STORAGE[dt]).view(L.uint)


@st.composite
def stored_values(draw, dt, shape, backgrounds=BACKGROUNDS):
    """Stored values of shape (k, ncols): a background, then up to 20 single
    values and 6 rounding columns at drawn places."""
    k, ncols = shape
    kind = draw(st.sampled_from(backgrounds), label="background")
    if kind == "rounding":
        cols = draw(st.lists(rounding_column(dt, k), min_size=1, max_size=5),
                    label="repeated rounding columns")
        bits = np.tile(np.array(cols, LAYOUT[dt].uint).T, ncols // len(cols) + 1)[:, :ncols]
        bits = np.ascontiguousarray(bits)
    else:
        bits = background(kind, draw(st.integers(0, 2**32 - 1), label="seed"), dt, shape)
    if ncols:
        cells = st.tuples(st.integers(0, k - 1), st.integers(0, ncols - 1), element_bits(dt))
        for i, j, v in draw(st.lists(cells, max_size=20), label="values (row, column, bits)"):
            bits[i, j] = v
        cols = st.tuples(st.integers(0, ncols - 1), rounding_column(dt, k))
        for j, col in draw(st.lists(cols, max_size=6), label="rounding columns (column, bits)"):
            bits[:, j] = col
    return bits.view(STORAGE[dt])


@st.composite
def row_sums(draw, dt, backgrounds=BACKGROUNDS):
    """(src, lo, hi): stored values (k, ncols) with 1 <= k <= 8, and a range."""
    k = draw(st.integers(1, MAX_ROWS), label="k")
    n = draw(lengths(), label="hi - lo")
    lo = draw(st.integers(0, 9), label="lo")
    ncols = lo + n + draw(st.integers(0, 3), label="ncols - hi")
    return draw(stored_values(dt, (k, ncols), backgrounds)), lo, lo + n


@st.composite
def output(draw, dt, n):
    """(out_lo, out): room for n results at out_lo, the sentinel everywhere."""
    out_lo = draw(st.integers(0, 9), label="out_lo")
    tail = draw(st.integers(0, 3), label="room after the results")
    return out_lo, filled(dt, out_lo + n + tail, SENTINEL[dt])


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------


def assert_window(out, out_lo, expected, dt):
    """out holds expected at out_lo (assert_same) and the sentinel elsewhere."""
    n = len(expected)
    assert_same(out[out_lo : out_lo + n], expected, dt)
    rest = np.concatenate([bits_of(out)[:out_lo], bits_of(out)[out_lo + n :]])
    assert np.all(rest == SENTINEL[dt]), "written outside out[out_lo : out_lo + hi - lo]"


def assert_same_bits(got, expected, inputs, dt):
    """The same values, and the same bits wherever at most one of the
    element's inputs (a column of inputs) is NaN."""
    assert_same(got, expected, dt)
    one_nan = nan_inputs(inputs, dt) <= 1
    a, b = bits_of(got)[one_nan], bits_of(expected)[one_nan]
    bad = np.nonzero(a != b)[0]
    assert bad.size == 0, f"bits differ at {bad[:5]}: {a[bad[:5]]} != {b[bad[:5]]}"


def assert_unchanged(after, before):
    assert np.array_equal(bits_of(after), bits_of(before)), "an input was written"


def run_rows(dt, src, lo, hi):
    out = filled(dt, hi - lo, SENTINEL[dt])
    ROWS[dt](src, lo, hi, out, 0)
    return out


# ---------------------------------------------------------------------------
# Kernels against the numpy references
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dt", DTYPES)
@PROFILE
@given(data=st.data())
def test_sum_rows_matches_reference(dt, data):
    src, lo, hi = data.draw(row_sums(dt), label="src, lo, hi")
    out_lo, out = data.draw(output(dt, hi - lo))
    before = src.copy()
    ROWS[dt](src, lo, hi, out, out_lo)
    assert_window(out, out_lo, reference_rows(src, lo, hi, dt), dt)
    assert_unchanged(src, before)


@pytest.mark.parametrize("dt", DTYPES)
@PROFILE
@given(data=st.data())
def test_sum_rows_x_matches_reference(dt, data):
    """The rows summed are `rows`; the kernel gets them as src, whose row me is
    poison (any read of it shows), and x, which is row me up to hi and
    poison after."""
    rows, lo, hi = data.draw(row_sums(dt), label="rows, lo, hi")
    me = data.draw(st.integers(0, rows.shape[0] - 1), label="me")
    src = rows.copy()
    bits_of(src)[me] = poison(dt)
    x = filled(dt, hi + data.draw(st.integers(0, 3), label="len(x) - hi"), poison(dt))
    x[:hi] = rows[me, :hi]
    out_lo, out = data.draw(output(dt, hi - lo))
    out2 = out
    if not data.draw(st.booleans(), label="out2 is out"):
        tail = data.draw(st.integers(0, 3), label="room after the results in out2")
        out2 = filled(dt, out_lo + hi - lo + tail, SENTINEL[dt])
    src0, x0 = src.copy(), x.copy()
    ROWS_X[dt](src, lo, hi, me, x, out, out2, out_lo)
    expected = reference_rows(rows, lo, hi, dt)
    assert_window(out, out_lo, expected, dt)
    assert_window(out2, out_lo, expected, dt)
    assert_unchanged(src, src0)
    assert_unchanged(x, x0)


@pytest.mark.parametrize("dt", DTYPES)
@PROFILE
@given(data=st.data())
def test_sum2_matches_reference(dt, data):
    """out[i] = a[i] + b[i] for i < len(out); a and b may be longer."""
    n = data.draw(lengths(), label="len(out)")
    ab = data.draw(stored_values(dt, (2, n + 3)), label="a, b")
    a = ab[0, : n + data.draw(st.integers(0, 3), label="len(a) - n")].copy()
    b = ab[1, : n + data.draw(st.integers(0, 3), label="len(b) - n")].copy()
    out = filled(dt, n, SENTINEL[dt])
    SUM2[dt](a, b, out)
    assert_same(out, reference_rows(ab, 0, n, dt), dt)
    assert_unchanged(a, ab[0, : len(a)])
    assert_unchanged(b, ab[1, : len(b)])


# ---------------------------------------------------------------------------
# A sum depends only on its inputs in row order
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dt", DTYPES)
@PROFILE
@given(data=st.data())
def test_sum_rows_x_with_own_row_is_sum_rows(dt, data):
    src, lo, hi = data.draw(row_sums(dt), label="src, lo, hi")
    me = data.draw(st.integers(0, src.shape[0] - 1), label="me")
    out_lo, expected = data.draw(output(dt, hi - lo))
    out, out2 = expected.copy(), expected.copy()
    ROWS[dt](src, lo, hi, expected, out_lo)
    ROWS_X[dt](src, lo, hi, me, src[me].copy(), out, out2, out_lo)
    window = slice(out_lo, out_lo + hi - lo)
    for o in (out, out2):
        assert_same_bits(o[window], expected[window], src[:, lo:hi], dt)
        assert_unchanged(o[: out_lo], expected[: out_lo])
        assert_unchanged(o[window.stop :], expected[window.stop :])


@pytest.mark.parametrize("dt", DTYPES)
@PROFILE
@given(data=st.data())
def test_sum_rows_independent_of_placement(dt, data):
    """The same columns at another offset, among other values, summed into
    another output offset: the same bits."""
    src, lo, hi = data.draw(row_sums(dt), label="src, lo, hi")
    k, n = src.shape[0], hi - lo
    shift = data.draw(st.integers(0, 9), label="new lo")
    other = data.draw(stored_values(dt, (k, shift + n + 2)), label="surroundings")
    other[:, shift : shift + n] = src[:, lo:hi]
    out_lo, out = data.draw(output(dt, n))
    ROWS[dt](other, shift, shift + n, out, out_lo)
    assert_same_bits(out[out_lo : out_lo + n], run_rows(dt, src, lo, hi), src[:, lo:hi], dt)


@pytest.mark.parametrize("dt", DTYPES)
@PROFILE
@given(data=st.data())
def test_in_place_sums_are_the_same(dt, data):
    """sum_rows into row j of src, sum_rows_x into a row of src and into x
    (the reduce-scatter call): the bits of the out-of-place sum."""
    src, lo, hi = data.draw(row_sums(dt), label="src, lo, hi")
    k = src.shape[0]
    j = data.draw(st.integers(0, k - 1), label="out = src[j]")
    me = data.draw(st.integers(0, k - 1), label="me")
    inputs = src[:, lo:hi]
    expected = run_rows(dt, src, lo, hi)

    s = src.copy()
    ROWS[dt](s, lo, hi, s[j], lo)
    assert_same_bits(s[j, lo:hi], expected, inputs, dt)
    s[j, lo:hi] = src[j, lo:hi]
    assert_unchanged(s, src)

    s, x = src.copy(), src[me].copy()
    ROWS_X[dt](s, lo, hi, me, x, s[j], x, lo)
    assert_same_bits(s[j, lo:hi], expected, inputs, dt)
    assert_same_bits(x[lo:hi], expected, inputs, dt)
    s[j, lo:hi] = src[j, lo:hi]
    x[lo:hi] = src[me, lo:hi]
    assert_unchanged(s, src)
    assert_unchanged(x, src[me])


@pytest.mark.parametrize("dt", DTYPES)
@PROFILE
@given(data=st.data())
def test_sum2_is_a_two_row_sum(dt, data):
    n = data.draw(lengths(), label="n")
    ab = data.draw(stored_values(dt, (2, n)), label="a, b")
    expected = run_rows(dt, ab, 0, n)
    out = filled(dt, n, SENTINEL[dt])
    SUM2[dt](ab[0], ab[1], out)
    assert_same_bits(out, expected, ab, dt)
    a, b = ab[0].copy(), ab[1].copy()
    SUM2[dt](a, b, a)
    assert_same_bits(a, expected, ab, dt)
    SUM2[dt](ab[0], b, b)
    assert_same_bits(b, expected, ab, dt)


# ---------------------------------------------------------------------------
# Closed forms from the module docstring
# ---------------------------------------------------------------------------


def quieted(nan_bits, dt):
    """What a 16-bit sum with exactly one NaN input gives: the NaN, quiet,
    with its sign; bf16 and hardware f16 keep the payload, the bit-level f16
    path gives the canonical NaN."""
    L = LAYOUT[dt]
    if dt == "f16soft" or (dt == "f16" and not R.HARDWARE_F16):
        return (nan_bits & L.sign) | L.inf | L.quiet
    return nan_bits | L.quiet


@pytest.mark.parametrize("dt", DTYPES)
@PROFILE
@given(data=st.data())
def test_signed_zeros_and_single_nans(dt, data):
    """A sum of zeros is -0 exactly when every input is -0. One NaN input,
    where the other inputs alone do not make a NaN, gives a NaN: for 16-bit
    types that NaN, quiet, as quieted() says (f32 and f64: IEEE 754 only
    recommends keeping the payload, so only NaN is required)."""
    zeros_and_nans = ("zeros", "signed zeros", "specials")
    src, lo, hi = data.draw(row_sums(dt, zeros_and_nans), label="src, lo, hi")
    L = LAYOUT[dt]
    inputs = bits_of(src[:, lo:hi])
    got = bits_of(run_rows(dt, src, lo, hi))

    zeros = ((inputs & ~L.uint(L.sign)) == 0).all(axis=0)
    all_negative = (inputs == L.sign).all(axis=0)
    assert np.array_equal(got[zeros], np.where(all_negative[zeros], L.sign, 0).astype(L.uint))

    nan = is_nan(src[:, lo:hi], dt)
    without_nan = src[:, lo:hi].copy()
    without_nan[nan] = 0
    rest_ok = ~is_nan(reference_rows(without_nan, 0, hi - lo, dt), dt)
    single = (nan.sum(axis=0) == 1) & rest_ok
    assert np.all(is_nan(got[single].view(src.dtype), dt))
    if dt in HALF:
        the_nan = np.where(nan, inputs, 0).max(axis=0)[single]
        assert np.array_equal(got[single], quieted(the_nan, dt).astype(L.uint))


# ---------------------------------------------------------------------------
# The kernels' code run as Python
# ---------------------------------------------------------------------------


@pytest.mark.timeout(330)  # the subprocess's own 300 s first (28 s on a quiet machine)
@pytest.mark.skipif(not JIT, reason="already in pure-Python mode")
def test_pure_python_mode():
    """A few examples of every property with NUMBA_DISABLE_JIT=1 (short rows
    and the block edges): runs the kernel code itself as Python."""
    env = dict(os.environ, NUMBA_DISABLE_JIT="1")
    env.pop("HARMPI_HYPOTHESIS_PROFILE", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         os.path.abspath(__file__)],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
