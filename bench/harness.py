"""The measurement method of the OSU-style collective benchmarks (no MPI import here).

Everything in this module is pure: it takes numbers, arrays and callables and
returns numbers and arrays, so ``tests/test_bench.py`` checks it without
starting MPI.  The MPI side (who times what) lives in ``bench.osu``, the
report (tables, JSON, plot) in ``bench.report``, the job (topology, header
lines, rank-0 help, exit) in ``bench.job``; the implementations under test
live in ``bench.impls``.

Method, as in the OSU Micro-Benchmarks and nccl-tests:

1. Sizes: powers of two from ``MIN`` to ``MAX`` bytes (``-m MIN:MAX``), plus
   10240 B, the decode all-reduce of a 5120-wide bf16 hidden state.
2. Per size: ``warmup`` untimed iterations, then ``iterations`` timed ones.
   Defaults are OSU's for collectives: 1000 (+100 warm-up) up to 8192 B,
   100 (+10 warm-up) above.
3. Every iteration is fenced by a barrier *outside* the timed region; each
   rank times only its own call (``time.perf_counter_ns``).
4. Each rank reduces its samples to one number (mean, or median with
   ``--stat median``); the table shows the average of those over ranks and,
   with ``-f``, their minimum and maximum over ranks.
5. A separate untimed check pass (``-c``) fills the buffers with seeded data
   derived from the rank, compares the result with a float64 reference that
   every rank computes alone (it can regenerate every rank's input), and
   requires bitwise-identical results on every rank.

Timed buffers of a sum hold zeros: a thousand in-place sums of random data
would overflow f16/bf16 (and inf/NaN or subnormal values can change the speed
of software kernels).  The check pass uses random data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from typing import Callable, Iterable, Sequence

import numpy as np

__all__ = [
    "KIB",
    "MIB",
    "DEFAULT_MIN_NBYTES",
    "DEFAULT_MAX_NBYTES",
    "DECODE_NBYTES",
    "LARGE_MESSAGE_NBYTES",
    "DType",
    "DTYPES",
    "Collective",
    "ALLREDUCE",
    "ALLGATHER",
    "ALLTOALL",
    "parse_nbytes",
    "format_nbytes",
    "parse_sizes",
    "parse_names",
    "iterations_for",
    "capped_iterations",
    "time_op",
    "rank_stat_us",
    "summarize_ranks",
    "busbw_gbps",
    "bf16_bits_from_f32",
    "f32_from_bf16_bits",
    "digest",
]

KIB = 1024
MIB = 1024 * 1024

DEFAULT_MIN_NBYTES = 2
DEFAULT_MAX_NBYTES = 4 * MIB
#: 5120 (Qwen2.5-14B hidden size) x 2 bytes: one decode all-reduce at batch 1.
DECODE_NBYTES = 10240

# OSU Micro-Benchmarks defaults for collectives (osu_util.h).
LARGE_MESSAGE_NBYTES = 8192
ITERS_SMALL = 1000
WARMUP_SMALL = 100
ITERS_LARGE = 100
WARMUP_LARGE = 10


# --------------------------------------------------------------------------
# Data types
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DType:
    """A floating-point type as the benchmarks see it.

    ``storage`` is the numpy dtype holding the bits (bf16 is stored as
    uint16); ``unit_roundoff`` is u = 2**-p for a p-bit significand, the
    relative error of one round-to-nearest.
    """

    name: str
    itemsize: int
    storage: str
    unit_roundoff: float
    torch_name: str

    def to_float64(self, values: np.ndarray) -> np.ndarray:
        """Storage array -> float64 values."""
        if self.name == "bf16":
            return f32_from_bf16_bits(values).astype(np.float64)
        return np.asarray(values).astype(np.float64)

    def from_float64(self, values: np.ndarray) -> np.ndarray:
        """float64 values -> storage array, rounding to nearest even."""
        if self.name == "bf16":
            return bf16_bits_from_f32(np.asarray(values, dtype=np.float32))
        return np.asarray(values).astype(self.storage)


DTYPES = {
    "bf16": DType("bf16", 2, "uint16", 2.0**-8, "bfloat16"),
    "f16": DType("f16", 2, "float16", 2.0**-11, "float16"),
    "f32": DType("f32", 4, "float32", 2.0**-24, "float32"),
    "f64": DType("f64", 8, "float64", 2.0**-53, "float64"),
}


def bf16_bits_from_f32(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest, ties to even."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def f32_from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> float32, exact."""
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def digest(values: np.ndarray) -> str:
    """A short hash of an array's bytes, to compare results across ranks."""
    return hashlib.blake2b(np.ascontiguousarray(values).tobytes(), digest_size=16).hexdigest()


# --------------------------------------------------------------------------
# Collective descriptors
# --------------------------------------------------------------------------


def _seeded_values(seed: int, rank: int, count: int, dtype: DType) -> np.ndarray:
    """Uniform(-1, 1) values representable in ``dtype``, as a storage array.

    Depends only on (seed, rank, count, dtype), so any rank can regenerate
    any other rank's input.
    """
    rng = np.random.default_rng([seed, rank, count, dtype.itemsize])
    return dtype.from_float64(rng.uniform(-1.0, 1.0, count))


def _sum_tolerance(n_ranks: int, abs_sum: np.ndarray, dtype: DType) -> np.ndarray:
    """Error bound of an n-rank sum computed with at most n roundings to ``dtype``.

    Each rounding to nearest moves a partial sum by at most u times its
    magnitude, and every partial sum is bounded by S = sum_r |x_r|, so the
    result is within gamma_n * S of the exact sum, gamma_n = n u / (1 - n u)
    (Higham, Accuracy and Stability, ch. 4).  Any algorithm that accumulates
    in at least ``dtype`` precision and rounds at most n times along any path
    (ring: n-1, harmpi: once per stage) satisfies it; a wrong or missing
    contribution (|x| up to 1) does not, except by chance on a few elements.
    """
    nu = n_ranks * dtype.unit_roundoff
    return (nu / (1.0 - nu)) * abs_sum


@dataclasses.dataclass(frozen=True)
class Collective:
    """What the harness needs to know about one collective.

    ``size`` in the tables is the byte count each rank passes in (for an
    allgather: each rank's contribution, the result is n times larger; for
    an all-to-all, OSU's convention: what each rank sends to each rank, the
    input and the output n times larger).
    """

    name: str  # "Allreduce", as in the OSU title
    op: str  # method of an implementation adapter: "allreduce" / "allgather" / "alltoall"
    #: n ranks -> busbw / algbw, with algbw = size / t (nccl-tests' definition,
    #: rewritten for a per-rank size): allreduce 2(n-1)/n, allgather and
    #: all-to-all n-1.
    busbw_factor: Callable[[int], float]
    #: True if timed buffers may hold zeros (sums); False: use the seeded data.
    zero_timing_data: bool
    #: n ranks -> blocks of ``size`` bytes in each rank's input (all-to-all: n)
    blocks: Callable[[int], int] = lambda n: 1
    #: every rank holds the same result (the check compares them bitwise)
    same_result: bool = True

    def count(self, nbytes: int, dtype: DType) -> int:
        """Elements per rank (per block) for a message of ``nbytes`` (0: size too small)."""
        return nbytes // dtype.itemsize

    def init_values(self, seed: int, rank: int, count: int, dtype: DType,
                    n_ranks: int = 1) -> np.ndarray:
        """The check pass's input on ``rank`` (storage array)."""
        return _seeded_values(seed, rank, count * self.blocks(n_ranks), dtype)

    def timing_values(self, seed: int, rank: int, count: int, dtype: DType,
                      n_ranks: int = 1) -> np.ndarray:
        """The timed input on ``rank`` (storage array)."""
        if self.zero_timing_data:
            return np.zeros(count * self.blocks(n_ranks), dtype=dtype.storage)
        return self.init_values(seed, rank, count, dtype, n_ranks)

    def check(self, result: np.ndarray, seed: int, n_ranks: int, count: int,
              dtype: DType, rank: int = 0) -> tuple[bool, str]:
        """Compare ``rank``'s result (storage array) with the reference.

        Returns (ok, detail); detail is empty when ok.
        """
        inputs = [self.init_values(seed, r, count, dtype, n_ranks) for r in range(n_ranks)]
        got = np.asarray(result)
        if self.op == "allreduce":
            return _check_sum(got, inputs, dtype)
        if self.op == "allgather":
            return _check_concatenation(got, inputs)
        if self.op == "alltoall":  # block ``rank`` of every rank's input, in rank order
            return _check_concatenation(got, [x[rank * count:(rank + 1) * count]
                                              for x in inputs])
        raise ValueError(f"unknown collective op {self.op!r}")


def _check_sum(got: np.ndarray, inputs: Sequence[np.ndarray], dtype: DType) -> tuple[bool, str]:
    """An all-reduce result against the float64 sum of ``inputs``, within the rounding bound."""
    count = len(inputs[0])
    if got.shape != (count,):
        return False, f"result has shape {got.shape}, expected ({count},)"
    as_f64 = [dtype.to_float64(x) for x in inputs]
    reference = np.sum(as_f64, axis=0)
    tolerance = _sum_tolerance(len(inputs), np.sum(np.abs(as_f64), axis=0), dtype)
    error = np.abs(dtype.to_float64(got) - reference)
    bad = ~(error <= tolerance)  # NaN counts as bad
    if bad.any():
        first = int(np.argmax(bad))
        return False, (
            f"{int(bad.sum())} of {count} values outside the bound "
            f"(first at {first}: got {dtype.to_float64(got)[first]!r}, "
            f"reference {reference[first]!r}, bound {tolerance[first]:.3g})"
        )
    return True, ""


def _check_concatenation(got: np.ndarray, inputs: Sequence[np.ndarray]) -> tuple[bool, str]:
    """An allgather result against ``inputs`` concatenated, bit for bit."""
    count = len(inputs[0])
    expected = np.concatenate(inputs)
    if got.shape != expected.shape:
        return False, f"result has shape {got.shape}, expected {expected.shape}"
    got_bytes = got.view(np.uint8).reshape(len(got), -1)
    bad = (got_bytes != expected.view(np.uint8).reshape(len(expected), -1)).any(axis=1)
    if bad.any():
        first = int(np.argmax(bad))
        return False, (
            f"{int(bad.sum())} of {len(expected)} values differ "
            f"(first at {first}, from rank {first // count})"
        )
    return True, ""


ALLREDUCE = Collective(
    name="Allreduce",
    op="allreduce",
    busbw_factor=lambda n: 2.0 * (n - 1) / n,
    zero_timing_data=True,
)
ALLGATHER = Collective(
    name="Allgather",
    op="allgather",
    busbw_factor=lambda n: float(n - 1),
    zero_timing_data=False,
)
ALLTOALL = Collective(
    name="Alltoall",
    op="alltoall",
    busbw_factor=lambda n: float(n - 1),
    zero_timing_data=False,
    blocks=lambda n: n,
    same_result=False,
)


# --------------------------------------------------------------------------
# Sizes and iteration counts
# --------------------------------------------------------------------------

_SUFFIXES = {
    "": 1, "B": 1,
    "K": KIB, "KB": KIB, "KIB": KIB,
    "M": MIB, "MB": MIB, "MIB": MIB,
    "G": 1024 * MIB, "GB": 1024 * MIB, "GIB": 1024 * MIB,
}


def parse_nbytes(text: str) -> int:
    """'4096', '4K', '4KiB', '4M' -> bytes (binary multiples)."""
    cleaned = text.strip().upper()
    digits = cleaned.rstrip("BKMGI")
    suffix = cleaned[len(digits):]
    if not digits or suffix not in _SUFFIXES:
        raise ValueError(f"not a byte count: {text!r}")
    return int(digits) * _SUFFIXES[suffix]


def parse_names(text: str, known) -> list[str]:
    """'a,b' -> ['a', 'b'], each one of ``known`` (ValueError naming the others)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"unknown {unknown}; choose from {', '.join(known)}")
    return names


def format_nbytes(nbytes: int) -> str:
    """4096 -> '4K', 10240 -> '10K', 3 -> '3' (binary multiples, exact only)."""
    for suffix, unit in (("G", 1024 * MIB), ("M", MIB), ("K", KIB)):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def parse_sizes(spec: str | None, extra: Iterable[int] = (DECODE_NBYTES,)) -> list[int]:
    """Message sizes for ``-m [MIN:]MAX`` (OSU's syntax), plus ``extra`` in range.

    ``MIN:MAX`` doubles from MIN while <= MAX; ``MAX`` alone starts at the
    default minimum; ``MIN:`` ends at the default maximum.  Extra sizes
    (default: 10240) are added when they fall inside [MIN, MAX].

    >>> parse_sizes("1024:8192", extra=())
    [1024, 2048, 4096, 8192]
    """
    lo, hi = DEFAULT_MIN_NBYTES, DEFAULT_MAX_NBYTES
    if spec:
        if ":" in spec:
            lo_text, hi_text = spec.split(":", 1)
            if lo_text.strip():
                lo = parse_nbytes(lo_text)
            if hi_text.strip():
                hi = parse_nbytes(hi_text)
        else:
            hi = parse_nbytes(spec)
    if lo < 1 or hi < lo:
        raise ValueError(f"bad size range {spec!r}: need 1 <= MIN <= MAX")
    sizes = []
    size = lo
    while size <= hi:
        sizes.append(size)
        size *= 2
    sizes.extend(x for x in extra if lo <= x <= hi)
    return sorted(set(sizes))


def iterations_for(nbytes: int, iterations: int | None = None,
                   warmup: int | None = None) -> tuple[int, int]:
    """(timed iterations, warm-up iterations) for one size, OSU defaults.

    ``-i``/``-x`` given on the command line apply to every size, as in OSU.
    """
    large = nbytes > LARGE_MESSAGE_NBYTES
    default_iters, default_warmup = (
        (ITERS_LARGE, WARMUP_LARGE) if large else (ITERS_SMALL, WARMUP_SMALL)
    )
    return (
        default_iters if iterations is None else iterations,
        default_warmup if warmup is None else warmup,
    )


def capped_iterations(iterations: int, warmup: int, max_iterations: int | None) -> tuple[int, int]:
    """Apply an implementation's cap (gloo: a few ms per call) to (iterations, warm-up)."""
    if max_iterations is None or iterations <= max_iterations:
        return iterations, warmup
    return max_iterations, min(warmup, max(1, max_iterations // 10))


# --------------------------------------------------------------------------
# Timing and statistics
# --------------------------------------------------------------------------


def time_op(run: Callable[[], object], barrier: Callable[[], object], iterations: int,
            warmup: int) -> np.ndarray:
    """Time ``iterations`` calls of ``run`` after ``warmup`` untimed ones.

    Each call is preceded by ``barrier()``, outside the timed region, so
    every iteration starts with all ranks present (no pipelining of
    back-to-back collectives).  Returns per-call durations in ns.
    """
    for _ in range(warmup):
        barrier()
        run()
    samples_ns = np.empty(iterations, dtype=np.int64)
    clock = time.perf_counter_ns
    for i in range(iterations):
        barrier()
        t0 = clock()
        run()
        samples_ns[i] = clock() - t0
    return samples_ns


def rank_stat_us(samples_ns: np.ndarray, stat: str) -> float:
    """One rank's samples -> mean or median, in microseconds."""
    if len(samples_ns) == 0:
        raise ValueError("no samples")
    if stat == "mean":
        return float(np.mean(samples_ns)) / 1e3
    if stat == "median":
        return float(np.median(samples_ns)) / 1e3
    raise ValueError(f"stat must be 'mean' or 'median', not {stat!r}")


def summarize_ranks(per_rank_us: Sequence[float]) -> tuple[float, float, float]:
    """Per-rank values -> (average, minimum, maximum) over ranks, as OSU reports."""
    values = np.asarray(per_rank_us, dtype=np.float64)
    return float(values.mean()), float(values.min()), float(values.max())


def busbw_gbps(nbytes: int, t_us: float, factor: float) -> float:
    """Bus bandwidth in GB/s (1e9 B/s): size / t x factor (2(n-1)/n for allreduce)."""
    if t_us <= 0:
        return math.inf
    return nbytes / (t_us * 1e-6) * factor / 1e9
