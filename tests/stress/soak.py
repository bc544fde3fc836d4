"""Soak test: a million mixed harmpi calls, checked, with latency and memory drift.

    make soak                                        # the line below, from the repo root
    mpirun -np 2 python -m mpi4py -m tests.stress.soak
    mpirun -np 2 python -m mpi4py -m tests.stress.soak --calls 20000 --window 5000 --json soak.json

A stress test, not a benchmark (not part of ``make test``; its pure parts and
a 3000-call run are tests/stress/test_soak.py); it borrows bench's harness
for the header and the dtype table.

What runs (every call with default arguments, the path users take):

* a schedule that every rank computes alike from ``--seed`` (and that
  does not depend on ``--window``): mostly
  decode-like 10 KB ``harmpi.allreduce(t)`` on torch tensors, bf16 most of
  the time, also f16/f32/f64; now and then small (0-2 KB), odd (an odd
  element count up to 256 KB), medium (16 KB-1 MB) and, rarely, large
  (1-4 MB, chunked through the slot) messages; 1-D or 2-D shapes; one call
  in ten on a numpy array instead of a tensor (bf16: uint16 with
  ``dtype="bf16"``); one in twenty on a freshly allocated buffer instead of
  a reused one; ~10% ``harmpi.allgather``, half of them into ``out=``;
* the buffers hold zeros (as the OSU harness's timed buffers: repeated
  in-place sums of data would overflow), so after every window each rank
  checks that its reused buffers still hold only zeros;
* every ``--check-every`` calls a check group from (seed, rank, call index),
  rotating dtype and tensor/numpy: an all-reduce of small integers (exact in
  every dtype, compared bit for bit), an all-reduce of uniform(-1, 1) values
  against a float64 reference within the README's error bound, and an
  allgather compared bit for bit; then every rank's crc32 of the three
  results is gathered (mpi4py) and must agree.

Reported by rank 0, per window of ``--window`` calls: per-rank median and p99
latency of the 10 KB bf16 tensor all-reduces (each call timed alone, back to
back as in a decode loop, no barrier: a rank's latency includes waiting for a
late peer), averaged over ranks; the largest VmRSS over ranks; open file
descriptors and threads of each rank; wrong values.  At the end: first vs
last window median latency, RSS growth, totals, and PASS/FAIL (exit 1 on any
wrong value or any disagreement between ranks).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import zlib
from typing import NamedTuple, Sequence

import click
import numpy as np

from bench import harness, job
from bench.harness import DTYPES

__all__ = [
    "DTYPE_NAMES",
    "MAX_NBYTES",
    "Schedule",
    "make_schedule",
    "schedule_slice",
    "window_bounds",
    "CheckPlan",
    "check_plan",
    "exact_inputs",
    "random_inputs",
    "sum_error_bound",
    "count_wrong_sum",
    "count_wrong_exact",
    "parse_proc_status",
    "latency_stats_us",
    "Window",
    "drift_summary",
    "format_window_table",
    "format_summary",
    "main",
]

#: dtype index in a schedule -> name in bench.harness.DTYPES
DTYPE_NAMES = ("bf16", "f16", "f32", "f64")
_ITEMSIZES = np.array([DTYPES[name].itemsize for name in DTYPE_NAMES])

OP_ALLREDUCE, OP_ALLGATHER, OP_ALLGATHER_OUT = 0, 1, 2
OP_NAMES = ("allreduce", "allgather", "allgather(out=)")
_OP_P = (0.90, 0.05, 0.05)
_DTYPE_P = (0.70, 0.10, 0.10, 0.10)

SIZE_CLASSES = ("decode", "small", "odd", "medium", "large")
_CLASS_P = (0.88, 0.06, 0.04, 0.018, 0.002)
DECODE_NBYTES = harness.DECODE_NBYTES
SMALL_MAX_NBYTES = 2 * 1024
ODD_MAX_NBYTES = 256 * 1024
MEDIUM_NBYTES = (16 * 1024, 1024 * 1024)
MAX_NBYTES = 4 * 1024 * 1024
NUMPY_P = 0.10  # a numpy array instead of a torch tensor
FRESH_P = 0.05  # a newly allocated buffer instead of a view of the reused one
MATRIX_P = 0.50  # shape (4, count / 4) when count is a multiple of 4

_SCHEDULE_TAG = 0x50AC  # keeps schedule streams apart from the checks' streams
_CHECK_TAG = 0xC4EC
_WARMUP_BLOCK = 1 << 40  # the warm-up's schedule block, never a window's
SCHEDULE_BLOCK = 10_000  # calls per seeded block of the schedule


# --------------------------------------------------------------------------
# The schedule (pure: every rank computes the same one)
# --------------------------------------------------------------------------


class Schedule(NamedTuple):
    """One block of calls, one array entry per call."""

    op: np.ndarray  # OP_ALLREDUCE / OP_ALLGATHER / OP_ALLGATHER_OUT
    dtype: np.ndarray  # index into DTYPE_NAMES
    size_class: np.ndarray  # index into SIZE_CLASSES
    count: np.ndarray  # elements per rank
    numpy: np.ndarray  # bool: numpy array, not a torch tensor
    fresh: np.ndarray  # bool: newly allocated buffer
    matrix: np.ndarray  # bool: 2-D shape (4, count / 4)
    timed: np.ndarray  # bool: a 10 KB bf16 tensor all-reduce, the calls the report times

    def nbytes(self) -> np.ndarray:
        return self.count * _ITEMSIZES[self.dtype]

    def rows(self):
        """Python tuples (op, dtype, count, numpy, fresh, matrix, timed), one per call."""
        return zip(self.op.tolist(), self.dtype.tolist(), self.count.tolist(),
                   self.numpy.tolist(), self.fresh.tolist(), self.matrix.tolist(),
                   self.timed.tolist())


def _log_uniform(rng, low: float, high: float, size: int) -> np.ndarray:
    return np.exp(rng.uniform(math.log(low), math.log(high), size))


def _counts(rng, size_class: np.ndarray, itemsize: np.ndarray) -> np.ndarray:
    """Elements per call for each size class (all drawn, then picked by class)."""
    n = len(size_class)
    by_class = np.stack([
        DECODE_NBYTES // itemsize,
        rng.integers(0, SMALL_MAX_NBYTES // itemsize + 1),
        (_log_uniform(rng, 2, ODD_MAX_NBYTES, n) // itemsize).astype(np.int64) | 1,
        (_log_uniform(rng, *MEDIUM_NBYTES, n) // itemsize).astype(np.int64),
        rng.integers(MEDIUM_NBYTES[1], MAX_NBYTES + 1, n) // itemsize,
    ])
    return by_class[size_class, np.arange(n)].astype(np.int64)


def make_schedule(seed: int, block: int, length: int) -> Schedule:
    """One seeded block of ``length`` calls: the same on every rank for one seed."""
    rng = np.random.default_rng([seed, _SCHEDULE_TAG, block])
    op = rng.choice(len(_OP_P), size=length, p=_OP_P)
    dtype = rng.choice(len(DTYPE_NAMES), size=length, p=_DTYPE_P)
    size_class = rng.choice(len(SIZE_CLASSES), size=length, p=_CLASS_P)
    count = _counts(rng, size_class, _ITEMSIZES[dtype])
    numpy = rng.random(length) < NUMPY_P
    fresh = rng.random(length) < FRESH_P
    matrix = (rng.random(length) < MATRIX_P) & (count % 4 == 0) & (count > 0)
    timed = (op == OP_ALLREDUCE) & (dtype == 0) & (size_class == 0) & ~numpy
    return Schedule(op, dtype, size_class, count, numpy, fresh, matrix, timed)


def schedule_slice(seed: int, start: int, length: int) -> Schedule:
    """Calls ``start .. start + length - 1`` of the soak, cut from blocks of
    ``SCHEDULE_BLOCK`` calls, so the calls do not depend on ``--window``."""
    if length <= 0:
        return make_schedule(seed, 0, 0)
    first, last = start // SCHEDULE_BLOCK, (start + length - 1) // SCHEDULE_BLOCK
    blocks = [make_schedule(seed, b, SCHEDULE_BLOCK) for b in range(first, last + 1)]
    offset = start - first * SCHEDULE_BLOCK
    return Schedule(*(np.concatenate(field)[offset:offset + length] for field in zip(*blocks)))


def window_bounds(calls: int, window: int) -> list[tuple[int, int]]:
    """[(first call, calls in it)] of each window; the last one may be shorter."""
    return [(start, min(window, calls - start)) for start in range(0, calls, window)]


# --------------------------------------------------------------------------
# Checks (pure)
# --------------------------------------------------------------------------


class CheckPlan(NamedTuple):
    """What the check group after one call runs (the same on every rank)."""

    dtype: str
    use_numpy: bool
    count: int
    gather_out: bool


def check_plan(seed: int, call_index: int, check_number: int) -> CheckPlan:
    """Dtype and kind rotate with the check number; the size is a 10 KB message
    half the time, else log-uniform from 2 bytes to 256 KB."""
    name = DTYPE_NAMES[check_number % len(DTYPE_NAMES)]
    itemsize = DTYPES[name].itemsize
    rng = np.random.default_rng([seed, _CHECK_TAG, call_index])
    if rng.random() < 0.5:
        nbytes = DECODE_NBYTES
    else:
        nbytes = int(_log_uniform(rng, 2, ODD_MAX_NBYTES, 1)[0])
    count = max(1, nbytes // itemsize)
    return CheckPlan(name, (check_number // len(DTYPE_NAMES)) % 2 == 1, count,
                     check_number % 2 == 0)


def exact_inputs(seed: int, call_index: int, rank: int, count: int, n_ranks: int) -> np.ndarray:
    """Small integers (int64) whose sum over ``n_ranks`` stays within +-128, so
    every partial sum is exact in bf16, and so in every dtype harmpi takes."""
    bound = max(1, 128 // n_ranks)
    rng = np.random.default_rng([seed, _CHECK_TAG, call_index, rank, 1])
    return rng.integers(-bound, bound + 1, count)


def random_inputs(seed: int, call_index: int, rank: int, count: int, name: str) -> np.ndarray:
    """uniform(-1, 1) values rounded to ``name``, as its storage array."""
    rng = np.random.default_rng([seed, _CHECK_TAG, call_index, rank, 2])
    return DTYPES[name].from_float64(rng.uniform(-1.0, 1.0, count))


def sum_error_bound(name: str, abs_sum: np.ndarray, n_ranks: int, n_nodes: int) -> np.ndarray:
    """README's bound |result - exact| <= (s u + N 2^-24) sum|x_r| (f64: N 2^-53),
    s = 1 + ceil(log2 G) + 1 stages over G > 1 nodes, s = 1 on one node."""
    stages = 1 + (math.ceil(math.log2(n_nodes)) + 1 if n_nodes > 1 else 0)
    accumulation = n_ranks * (2.0**-53 if name == "f64" else 2.0**-24)
    return (stages * DTYPES[name].unit_roundoff + accumulation) * abs_sum + 1e-300


def count_wrong_sum(got: np.ndarray, inputs: Sequence[np.ndarray], name: str,
                    n_nodes: int) -> int:
    """Values of an all-reduce result (storage array) outside the bound of the
    float64 sum of ``inputs`` (storage arrays, one per rank); NaN is wrong."""
    dtype = DTYPES[name]
    as_f64 = np.array([dtype.to_float64(x) for x in inputs])
    bound = sum_error_bound(name, np.abs(as_f64).sum(axis=0), len(inputs), n_nodes)
    error = np.abs(dtype.to_float64(np.ravel(got)) - as_f64.sum(axis=0))
    return int(np.count_nonzero(~(error <= bound)))


def count_wrong_exact(got: np.ndarray, expected: np.ndarray) -> int:
    """Elements whose bytes differ (same shape expected: else every element is wrong)."""
    got, expected = np.ravel(got), np.ravel(expected)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return max(got.size, expected.size)
    return int(np.count_nonzero(got.view(np.uint8).reshape(got.size, -1)
                                != expected.view(np.uint8).reshape(expected.size, -1)))


# --------------------------------------------------------------------------
# Process numbers and statistics (pure)
# --------------------------------------------------------------------------


def parse_proc_status(text: str) -> tuple[int, int]:
    """(VmRSS in kB, Threads) from the text of /proc/<pid>/status."""
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.split()
    return int(fields["VmRSS"][0]), int(fields["Threads"][0])


def latency_stats_us(samples_ns: np.ndarray) -> tuple[float | None, float | None]:
    """(median, p99) in microseconds, (None, None) without samples."""
    if len(samples_ns) == 0:
        return None, None
    median, p99 = np.percentile(np.asarray(samples_ns, dtype=np.float64), [50, 99])
    return float(median) / 1e3, float(p99) / 1e3


@dataclasses.dataclass
class Window:
    """One window's row of the report (rank 0's view of every rank)."""

    index: int
    first_call: int
    calls: int
    timed_calls: int  # 10 KB bf16 tensor all-reduces on each rank
    median_us: float | None  # per-rank median, averaged over ranks
    p99_us: float | None  # per-rank p99, averaged over ranks
    rss_mb: float  # largest VmRSS over ranks at the end of the window
    fds: list[int]  # open file descriptors of each rank
    threads: list[int]  # threads of each rank
    wrong_values: int  # over ranks, checks and buffers of this window
    rank_mismatches: int  # check results whose crc32 differ between ranks
    wall_s: float
    load_1min: float = 0.0  # the host's 1-minute load average at the end (this job included)


def _ratio(last: float | None, first: float | None) -> float | None:
    return None if last is None or first is None or first <= 0 else last / first


def drift_summary(windows: Sequence[Window], wall_s: float, checked_calls: int) -> dict:
    """First vs last window: latency ratio, RSS/fd/thread growth; totals."""
    first, last = windows[0], windows[-1]
    wrong = sum(w.wrong_values for w in windows)
    mismatches = sum(w.rank_mismatches for w in windows)
    return {
        "calls": sum(w.calls for w in windows),
        "checked_calls": checked_calls,
        "wall_s": wall_s,
        "windows": len(windows),
        "median_us_first": first.median_us,
        "median_us_last": last.median_us,
        "median_ratio": _ratio(last.median_us, first.median_us),
        "p99_ratio": _ratio(last.p99_us, first.p99_us),
        "rss_mb_first": first.rss_mb,
        "rss_mb_last": last.rss_mb,
        "rss_growth_mb": last.rss_mb - first.rss_mb,
        "fd_growth": max(b - a for a, b in zip(first.fds, last.fds)),
        "thread_growth": max(b - a for a, b in zip(first.threads, last.threads)),
        "wrong_values": wrong,
        "rank_mismatches": mismatches,
        "passed": wrong == 0 and mismatches == 0,
    }


# --------------------------------------------------------------------------
# Report lines (pure)
# --------------------------------------------------------------------------


def _us(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _per_rank(values: Sequence[int]) -> str:
    return "/".join(map(str, values))


def format_window_table(windows: Sequence[Window], header: bool = True) -> list[str]:
    """The per-window table; ``header=False`` gives only the rows (printed as they come)."""
    lines = []
    if header:
        lines.append(f"{'# Window':<10}{'Calls':>10}{'10K bf16':>10}{'Median(us)':>12}"
                     f"{'P99(us)':>10}{'RSS(MB)':>10}{'FDs':>10}{'Threads':>10}"
                     f"{'Wrong':>8}{'Wall(s)':>9}{'Load':>7}")
    for w in windows:
        wrong = w.wrong_values + w.rank_mismatches
        lines.append(f"{w.index:<10}{w.first_call + w.calls:>10}{w.timed_calls:>10}"
                     f"{_us(w.median_us):>12}{_us(w.p99_us):>10}{w.rss_mb:>10.1f}"
                     f"{_per_rank(w.fds):>10}{_per_rank(w.threads):>10}{wrong:>8}"
                     f"{w.wall_s:>9.2f}{w.load_1min:>7.2f}")
    return lines


def format_summary(summary: dict) -> list[str]:
    """The closing lines: drift, totals, verdict."""
    ratio = summary["median_ratio"]
    ratio_text = "n/a" if ratio is None else f"{ratio:.2f}"
    return [
        f"# Drift: median latency last/first window {ratio_text} "
        f"({_us(summary['median_us_first'])} -> {_us(summary['median_us_last'])} us); "
        f"RSS growth {summary['rss_growth_mb']:+.1f} MB "
        f"({summary['rss_mb_first']:.1f} -> {summary['rss_mb_last']:.1f} MB, max over ranks); "
        f"fds {summary['fd_growth']:+d}, threads {summary['thread_growth']:+d}",
        f"# Total: {summary['calls']} calls + {summary['checked_calls']} checked calls in "
        f"{summary['wall_s']:.1f} s; wrong values {summary['wrong_values']}, "
        f"results differing between ranks {summary['rank_mismatches']}",
        f"# Result: {'PASS' if summary['passed'] else 'FAIL'}",
    ]


# --------------------------------------------------------------------------
# Buffers and calls (every rank)
# --------------------------------------------------------------------------


def _storage_of(x, name: str) -> np.ndarray:
    """A result (tensor or array) as its storage numpy array (bf16: uint16 bits)."""
    import torch

    if isinstance(x, torch.Tensor):
        if name == "bf16":
            return x.view(torch.int16).numpy().view(np.uint16)
        return x.numpy()
    return np.asarray(x)


def _from_storage(values: np.ndarray, name: str, use_numpy: bool):
    """A storage array as the argument of a call: a writable numpy copy or a tensor."""
    import torch

    values = np.ascontiguousarray(values).copy()
    if use_numpy:
        return values
    if name == "bf16":
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(values)


def _bf16_kwargs(name: str, use_numpy: bool) -> dict:
    """The one keyword a call needs: numpy bf16 is a uint16 array with dtype='bf16'."""
    return {"dtype": "bf16"} if use_numpy and name == "bf16" else {}


class _Buffers:
    """Zero-filled buffers the calls take views of: one input and one output
    pool of bytes, seen as every dtype, as a tensor and as an array."""

    def __init__(self, n_ranks: int):
        import torch

        self.torch, self.n_ranks = torch, n_ranks
        self.in_bytes = torch.zeros(MAX_NBYTES, dtype=torch.uint8)
        self.out_bytes = torch.zeros(n_ranks * MAX_NBYTES, dtype=torch.uint8)
        torch_dtypes = [getattr(torch, DTYPES[name].torch_name) for name in DTYPE_NAMES]
        self.tensors_in = [self.in_bytes.view(dt) for dt in torch_dtypes]
        self.tensors_out = [self.out_bytes.view(dt) for dt in torch_dtypes]
        storages = [np.dtype(DTYPES[name].storage) for name in DTYPE_NAMES]
        self.arrays_in = [self.in_bytes.numpy().view(st) for st in storages]
        self.arrays_out = [self.out_bytes.numpy().view(st) for st in storages]
        self.torch_dtypes, self.storages = torch_dtypes, storages
        self.kwargs = [[{}, _bf16_kwargs(name, True)] for name in DTYPE_NAMES]

    def operand(self, dt: int, count: int, use_numpy: bool, fresh: bool, matrix: bool):
        """The input of one call: a view of the pool, or a new zero buffer."""
        shape = (4, count // 4) if matrix else (count,)
        if fresh:
            if use_numpy:
                return np.zeros(shape, self.storages[dt])
            return self.torch.zeros(shape, dtype=self.torch_dtypes[dt])
        if use_numpy:
            return self.arrays_in[dt][:count].reshape(shape)
        return self.tensors_in[dt][:count].view(shape)

    def out(self, dt: int, count: int, use_numpy: bool, fresh: bool):
        """allgather's out=: n times the input's elements, flat."""
        n = self.n_ranks * count
        if fresh:
            return np.zeros(n, self.storages[dt]) if use_numpy else \
                self.torch.zeros(n, dtype=self.torch_dtypes[dt])
        return self.arrays_out[dt][:n] if use_numpy else self.tensors_out[dt][:n]

    def nonzero_bytes(self) -> int:
        """Bytes of the pools that are not zero: a stray write (every call sums zeros)."""
        return int(self.in_bytes.count_nonzero()) + int(self.out_bytes.count_nonzero())


def _run_block(harmpi, buffers: _Buffers, schedule: Schedule, timed_ns: np.ndarray,
               on_call) -> int:
    """Run one block of the schedule; the timed calls' durations go to
    ``timed_ns`` (returns how many); ``on_call(i)`` after each call."""
    clock = time.perf_counter_ns
    allreduce, allgather = harmpi.allreduce, harmpi.allgather
    n_timed = 0
    for i, (op, dt, count, use_numpy, fresh, matrix, timed) in enumerate(schedule.rows()):
        x = buffers.operand(dt, count, use_numpy, fresh, matrix)
        kwargs = buffers.kwargs[dt][use_numpy]
        if timed:
            t0 = clock()
            allreduce(x)
            timed_ns[n_timed] = clock() - t0
            n_timed += 1
        elif op == OP_ALLREDUCE:
            allreduce(x, **kwargs)
        elif op == OP_ALLGATHER:
            allgather(x, **kwargs)
        else:
            allgather(x, out=buffers.out(dt, count, use_numpy, fresh), **kwargs)
        on_call(i)
    return n_timed


class _Checker:
    """The check group every ``check_every`` calls; counts wrong values and
    results that differ between ranks (this rank's counts)."""

    def __init__(self, harmpi, comm, seed: int, check_every: int, n_nodes: int):
        self.harmpi, self.comm, self.seed = harmpi, comm, seed
        self.check_every, self.n_nodes = check_every, n_nodes
        self.rank, self.n_ranks = comm.Get_rank(), comm.Get_size()
        self.wrong_values = self.rank_mismatches = self.checks = 0

    def after_call(self, call_index: int) -> None:
        if (call_index + 1) % self.check_every == 0:
            self.run(call_index)

    def run(self, call_index: int) -> None:
        plan = check_plan(self.seed, call_index, self.checks)
        results = [self._exact(call_index, plan), self._random(call_index, plan),
                   self._gather(call_index, plan)]
        crcs = self.comm.allgather([zlib.crc32(np.ascontiguousarray(r).tobytes())
                                    for r in results])
        self.rank_mismatches += sum(len(set(column)) > 1 for column in zip(*crcs))
        self.checks += 1

    def _allreduce(self, values: np.ndarray, plan: CheckPlan) -> np.ndarray:
        x = _from_storage(values, plan.dtype, plan.use_numpy)
        self.harmpi.allreduce(x, **_bf16_kwargs(plan.dtype, plan.use_numpy))
        return _storage_of(x, plan.dtype).copy()

    def _exact(self, call_index: int, plan: CheckPlan) -> np.ndarray:
        dtype = DTYPES[plan.dtype]
        inputs = [exact_inputs(self.seed, call_index, r, plan.count, self.n_ranks)
                  for r in range(self.n_ranks)]
        got = self._allreduce(dtype.from_float64(inputs[self.rank]), plan)
        self.wrong_values += count_wrong_exact(got, dtype.from_float64(np.sum(inputs, axis=0)))
        return got

    def _random(self, call_index: int, plan: CheckPlan) -> np.ndarray:
        inputs = [random_inputs(self.seed, call_index, r, plan.count, plan.dtype)
                  for r in range(self.n_ranks)]
        got = self._allreduce(inputs[self.rank], plan)
        self.wrong_values += count_wrong_sum(got, inputs, plan.dtype, self.n_nodes)
        return got

    def _gather(self, call_index: int, plan: CheckPlan) -> np.ndarray:
        inputs = [random_inputs(self.seed, call_index + 1, r, plan.count, plan.dtype)
                  for r in range(self.n_ranks)]
        x = _from_storage(inputs[self.rank], plan.dtype, plan.use_numpy)
        kwargs = _bf16_kwargs(plan.dtype, plan.use_numpy)
        out = None
        if plan.gather_out:
            out = _from_storage(np.zeros(self.n_ranks * plan.count, DTYPES[plan.dtype].storage),
                                plan.dtype, plan.use_numpy)
        got = _storage_of(self.harmpi.allgather(x, out=out, **kwargs), plan.dtype).copy()
        self.wrong_values += count_wrong_exact(got, np.concatenate(inputs))
        return got


# --------------------------------------------------------------------------
# The run (every rank; rank 0 prints)
# --------------------------------------------------------------------------


def _process_numbers() -> tuple[int, int, int]:
    """(VmRSS kB, open fds, threads) of this process."""
    with open("/proc/self/status") as fh:
        rss_kb, threads = parse_proc_status(fh.read())
    return rss_kb, len(os.listdir("/proc/self/fd")), threads


@dataclasses.dataclass(frozen=True)
class _Plan:
    calls: int
    check_every: int
    seed: int
    window: int
    warmup: int


def _window_row(comm, index: int, first_call: int, calls: int, timed_ns: np.ndarray,
                wrong_values: int, rank_mismatches: int, wall_s: float) -> Window | None:
    """Gather every rank's numbers of one window; rank 0 gets the row, others None."""
    median_us, p99_us = latency_stats_us(timed_ns)
    mine = (median_us, p99_us, *_process_numbers(), wrong_values)
    every = comm.gather(mine, root=0)
    if every is None:
        return None
    medians = [r[0] for r in every if r[0] is not None]
    p99s = [r[1] for r in every if r[1] is not None]
    return Window(
        index=index, first_call=first_call, calls=calls, timed_calls=len(timed_ns),
        median_us=float(np.mean(medians)) if medians else None,
        p99_us=float(np.mean(p99s)) if p99s else None,
        rss_mb=max(r[2] for r in every) / 1024, fds=[r[3] for r in every],
        threads=[r[4] for r in every], wrong_values=sum(r[5] for r in every),
        rank_mismatches=rank_mismatches, wall_s=wall_s, load_1min=os.getloadavg()[0])


def _run_window(harmpi, comm, plan: _Plan, buffers: _Buffers, checker: _Checker,
                index: int, bounds: tuple[int, int]) -> Window | None:
    """One window of the schedule, then its checks of buffers and its report row."""
    first_call, length = bounds
    schedule = schedule_slice(plan.seed, first_call, length)
    timed_ns = np.empty(length, dtype=np.int64)
    wrong_before, mismatches_before = checker.wrong_values, checker.rank_mismatches
    t0 = time.perf_counter()
    n_timed = _run_block(harmpi, buffers, schedule, timed_ns,
                         lambda i: checker.after_call(first_call + i))
    wall_s = time.perf_counter() - t0
    checker.wrong_values += buffers.nonzero_bytes()
    return _window_row(comm, index, first_call, length, timed_ns[:n_timed],
                       checker.wrong_values - wrong_before,
                       checker.rank_mismatches - mismatches_before, wall_s)


def _header_lines(comm, plan: _Plan, harmpi_info: dict) -> list[str]:
    from bench.job import bench_version, environment_lines, topology

    env_lines = environment_lines(comm, topology(comm), harmpi_info)
    mix = ", ".join(f"{name} {p:.1%}" for name, p in zip(SIZE_CLASSES, _CLASS_P))
    return [
        f"# harmpi soak test v{bench_version()}",
        *env_lines,
        f"# Calls: {plan.calls} after {plan.warmup} untimed warm-up calls, seed {plan.seed}; "
        f"allreduce/allgather/allgather(out=) {_OP_P[0]:.0%}/{_OP_P[1]:.0%}/{_OP_P[2]:.0%}; "
        f"bf16/f16/f32/f64 {'/'.join(f'{p:.0%}' for p in _DTYPE_P)}; sizes {mix}; "
        f"numpy {NUMPY_P:.0%}, fresh buffers {FRESH_P:.0%}",
        f"# Checks: every {plan.check_every} calls an exact, a float64-bounded and an allgather "
        "check (+ crc32 across ranks); reused buffers must stay zero",
        "# Timed: each 10 KB bf16 tensor all-reduce alone, back to back (no barrier); "
        "per-rank median/p99 averaged over ranks; RSS: max over ranks; FDs, Threads: per rank; "
        "Load: the host's 1-min load average (other jobs slow every column)",
    ]


def _write_json(path: str, plan: _Plan, harmpi_info: dict, windows: Sequence[Window],
                summary: dict) -> None:
    from bench.report import jsonable as _jsonable

    document = {"meta": {"benchmark": "soak", **dataclasses.asdict(plan),
                         "harmpi_info": _jsonable(harmpi_info)},
                "windows": [dataclasses.asdict(w) for w in windows], "summary": summary}
    with open(path, "w") as fh:
        json.dump(document, fh, indent=2)
        fh.write("\n")


def _warm_up(harmpi, buffers: _Buffers, plan: _Plan) -> None:
    """Untimed calls from a schedule block of their own (first-touch, caches, allocator)."""
    if plan.warmup:
        schedule = make_schedule(plan.seed, _WARMUP_BLOCK, plan.warmup)
        _run_block(harmpi, buffers, schedule, np.empty(plan.warmup, np.int64), lambda i: None)


def run(plan: _Plan, json_path: str | None, comm=None) -> int:
    """The soak on every rank of the world; rank 0 prints.  Exit code, same on every rank."""
    from mpi4py import MPI

    import harmpi

    comm = MPI.COMM_WORLD if comm is None else comm
    rank = comm.Get_rank()
    say = (lambda text: print(text, flush=True)) if rank == 0 else (lambda text: None)
    harmpi.init()
    info = harmpi.info()
    for line in _header_lines(comm, plan, info):
        say(line)
    buffers = _Buffers(comm.Get_size())
    checker = _Checker(harmpi, comm, plan.seed, plan.check_every, info["nodes"])
    _warm_up(harmpi, buffers, plan)
    comm.Barrier()
    say(format_window_table([])[0])
    windows, t0 = [], time.perf_counter()
    for index, bounds in enumerate(window_bounds(plan.calls, plan.window)):
        row = _run_window(harmpi, comm, plan, buffers, checker, index, bounds)
        if row is not None:
            windows.append(row)
            say(format_window_table([row], header=False)[0])
    wall_s = time.perf_counter() - t0
    failed = comm.allreduce(checker.wrong_values + checker.rank_mismatches, op=MPI.SUM) > 0
    if rank == 0:
        summary = drift_summary(windows, wall_s, 3 * checker.checks)
        for line in format_summary(summary):
            say(line)
        if json_path:
            _write_json(json_path, plan, info, windows, summary)
    return 1 if failed else 0


# --------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------


@click.command(
    name="soak",
    help=(
        "Soak test of harmpi: many mixed allreduce/allgather calls with periodic checks, "
        "reporting latency and memory drift per window. Run under MPI: "
        "mpirun -np 2 python -m mpi4py -m tests.stress.soak [options]. Only rank 0 prints; "
        "exit 1 on any wrong value."
    ),
)
@job.help_option()
@click.option("--calls", type=click.IntRange(min=1), default=1_000_000, show_default=True,
              help="Mixed harmpi calls (the checks' calls come on top).")
@click.option("--check-every", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Run a check group (3 checked calls) after every this many calls.")
@click.option("--window", type=click.IntRange(min=1), default=50_000, show_default=True,
              help="Calls per report row.")
@click.option("--warmup", type=click.IntRange(min=0), default=5000, show_default=True,
              help="Untimed calls before the first window.")
@click.option("--seed", type=int, default=20240607, show_default=True,
              help="Seed of the schedule and of the checks' data.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True),
              default=None, help="Write the windows and the summary as JSON (rank 0).")
def main(calls, check_every, window, warmup, seed, json_path):
    plan = _Plan(calls=calls, check_every=check_every, seed=seed, window=window, warmup=warmup)
    job.exit_all(job.run_or_abort(run, plan, json_path))


if __name__ == "__main__":
    main()
