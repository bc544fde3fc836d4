"""Throughput of the harmpi.reduce kernels on one core (no MPI).

    python -m bench.reduce_kernels            # default cases
    python -m bench.reduce_kernels --dtype bf16 --rows 2,4 --count 5120,2097152

Each row times ``sum_rows_<dt>(src, 0, count, out, 0)`` with ``src`` of
shape (rows, count), and the reduce-scatter variant
``sum_rows_x_<dt>(src, 0, count, 0, x, out, out2, 0)`` (row 0 from x):

``njit us``     per call from a compiled loop (what the collectives pay),
``python us``   per call from Python (adds numba's dispatch, ~0.3 us),
``aliased us``  compiled loop with ``out`` = ``src[1]`` (the in-slot case),
``x us``        sum_rows_x per call from a compiled loop, out and out2 separate,
``x inpl us``   the same with ``out`` = ``src[0]`` and ``out2`` = ``x`` (as the
                reduce-scatter calls it),
``GB/s``        (rows + 1) * count * itemsize / njit time,
``numpy us``    a plain numpy version (widen, add row by row, round).

Times are the best of several repeats (the machine is shared and small).
"""

import time

import click
import numba
import numpy as np

from bench import job
from harmpi.reduce import SUM_ROWS, SUM_ROWS_X

_STORAGE = {"bf16": np.uint16, "f16": np.uint16, "f32": np.float32, "f64": np.float64}


@numba.njit
def _loop(kernel, src, out, reps):
    n = src.shape[1]
    for _ in range(reps):
        kernel(src, 0, n, out, 0)


@numba.njit
def _loop_x(kernel, src, x, out, out2, reps):
    n = src.shape[1]
    for _ in range(reps):
        kernel(src, 0, n, 0, x, out, out2, 0)


def _python_loop(kernel, src, out, reps):
    n = src.shape[1]
    for _ in range(reps):
        kernel(src, 0, n, out, 0)


def numpy_sum_rows(dt, src):
    """The same sum in plain numpy (reference speed, not used for checks)."""
    if dt == "bf16":
        f = (src.astype(np.uint32) << 16).view(np.float32)
    elif dt == "f16":
        f = src.view(np.float16).astype(np.float32)
    else:
        f = src
    acc = f[0].copy()
    for r in f[1:]:
        acc += r
    if dt == "bf16":
        b = acc.view(np.uint32)
        out = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(acc)
        out[nan] = (b[nan] >> 16).astype(np.uint16) | 0x40
        return out
    if dt == "f16":
        return acc.astype(np.float16).view(np.uint16)
    return acc


def _best_us(fn, reps, repeats):
    fn(1)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(reps)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


def measure(dt, rows, count, repeats=7):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, count)).astype(np.float32)
    if dt == "bf16":
        src = (x.view(np.uint32) >> 16).astype(np.uint16)
    elif dt == "f16":
        src = x.astype(np.float16).view(np.uint16)
    else:
        src = x.astype(_STORAGE[dt])
    out = np.empty(count, src.dtype)
    kernel = SUM_ROWS[dt]
    reps = max(1, int(2e7 // max(1, rows * count)))
    njit_us = _best_us(lambda r: _loop(kernel, src, out, r), reps, repeats)
    python_us = _best_us(lambda r: _python_loop(kernel, src, out, r), reps, repeats)
    aliased = src.copy()
    aliased_us = _best_us(lambda r: _loop(kernel, aliased, aliased[1], r), reps, repeats)
    kernel_x = SUM_ROWS_X[dt]
    x = src[0].copy()
    out2 = np.empty(count, src.dtype)
    x_us = _best_us(lambda r: _loop_x(kernel_x, src, x, out, out2, r), reps, repeats)
    in_place = src.copy()
    x_in = src[0].copy()
    x_inpl_us = _best_us(lambda r: _loop_x(kernel_x, in_place, x_in, in_place[0], x_in, r), reps,
                         repeats)
    np_reps = max(1, reps // 20)
    numpy_us = _best_us(lambda r: [numpy_sum_rows(dt, src) for _ in range(r)], np_reps, 3)
    gbps = (rows + 1) * count * src.itemsize / njit_us / 1e3
    return njit_us, python_us, aliased_us, x_us, x_inpl_us, gbps, numpy_us


@click.command(name="reduce_kernels", help=__doc__.splitlines()[0])
@job.help_option()
@click.option("--dtype", "dtypes", default="bf16,f16,f32,f64", show_default=True)
@click.option("--rows", "row_counts", default="2,4", show_default=True)
@click.option("--count", "counts", default="5120,2097152", show_default=True,
              help="Elements per row, comma list.")
def main(dtypes, row_counts, counts):
    print("# harmpi.reduce sum_rows kernels, one core")
    print(f"# {'dtype':<5} {'rows':>4} {'count':>9} {'njit us':>10} {'python us':>10} "
          f"{'aliased us':>10} {'x us':>10} {'x inpl us':>10} {'GB/s':>7} {'numpy us':>10}")
    for dt in dtypes.split(","):
        for rows in (int(r) for r in row_counts.split(",")):
            for count in (int(c) for c in counts.split(",")):
                njit_us, python_us, aliased_us, x_us, x_inpl_us, gbps, numpy_us = measure(
                    dt, rows, count
                )
                print(f"  {dt:<5} {rows:>4} {count:>9} {njit_us:>10.3f} {python_us:>10.3f} "
                      f"{aliased_us:>10.3f} {x_us:>10.3f} {x_inpl_us:>10.3f} {gbps:>7.1f} "
                      f"{numpy_us:>10.1f}")


if __name__ == "__main__":
    main()
