"""The soak test (tests/stress/soak.py, ``make soak``): its pure parts, then a
3000-call run under mpirun (the full soak, 10^6 calls, is not part of ``make test``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.have import HAVE_HARMPI, HAVE_TORCH
from support.jobs import run_module

from bench.harness import DTYPES


def test_soak_schedule_is_seeded_and_mostly_decode_sized():
    from tests.stress import soak

    a, b = soak.make_schedule(7, 3, 20000), soak.make_schedule(7, 3, 20000)
    assert all((x == y).all() for x, y in zip(a, b))  # every rank computes the same calls
    assert not (soak.make_schedule(7, 4, 20000).count == a.count).all()
    nbytes = a.nbytes()
    assert nbytes.max() <= soak.MAX_NBYTES and nbytes.min() >= 0
    assert (nbytes[a.size_class == 0] == 10240).all()
    assert (a.count[a.size_class == 2] % 2 == 1).all()  # odd element counts
    assert (a.count[a.matrix] % 4 == 0).all() and (a.count[a.matrix] > 0).all()
    for field, kinds in ((a.op, 3), (a.dtype, 4), (a.size_class, 5)):
        assert set(field.tolist()) == set(range(kinds))
    assert 0.4 < a.timed.mean() < 0.6 and (a.size_class == 4).sum() < 100  # large is rare
    timed = a.timed
    assert (a.op[timed] == 0).all() and (a.dtype[timed] == 0).all() and not a.numpy[timed].any()
    assert len(list(a.rows())) == 20000


def test_soak_schedule_does_not_depend_on_the_window():
    from tests.stress.soak import SCHEDULE_BLOCK, make_schedule, schedule_slice

    whole = schedule_slice(7, 0, 25000)
    parts = [schedule_slice(7, 0, 12345), schedule_slice(7, 12345, 12655)]
    for field, first, second in zip(whole, *parts):
        assert (field == np.concatenate([first, second])).all()
    block = make_schedule(7, 1, SCHEDULE_BLOCK)
    assert all((a == b).all() for a, b in zip(schedule_slice(7, SCHEDULE_BLOCK, SCHEDULE_BLOCK),
                                               block))
    assert len(schedule_slice(7, 5, 0).count) == 0


def test_soak_window_bounds_cover_every_call():
    from tests.stress.soak import window_bounds

    assert window_bounds(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert window_bounds(3, 50) == [(0, 3)]


def test_soak_check_plan_rotates_dtype_kind_and_out():
    from tests.stress.soak import DTYPE_NAMES, check_plan

    plans = [check_plan(1, 1000 * k + 999, k) for k in range(16)]
    assert [p.dtype for p in plans[:4]] == list(DTYPE_NAMES)
    assert {(p.dtype, p.use_numpy, p.gather_out) for p in plans} >= {
        ("bf16", False, True), ("bf16", True, True), ("f16", False, False), ("f16", True, False)}
    assert all(p.count >= 1 for p in plans) and plans[0] == check_plan(1, 999, 0)


@pytest.mark.parametrize("n_ranks", [2, 3, 4, 8])
def test_soak_exact_inputs_sum_exactly_in_every_dtype(n_ranks):
    from tests.stress.soak import DTYPE_NAMES, count_wrong_exact, exact_inputs

    inputs = [exact_inputs(5, 999, r, 4096, n_ranks) for r in range(n_ranks)]
    assert not (inputs[0] == inputs[1]).all()  # derived from the rank
    total = np.sum(inputs, axis=0)
    for name in DTYPE_NAMES:
        dtype = DTYPES[name]
        partial = np.zeros(4096)
        for x in inputs:  # every partial sum is representable: any order is exact
            partial = partial + dtype.to_float64(dtype.from_float64(x))
            assert (dtype.to_float64(dtype.from_float64(partial)) == partial).all()
        expected = dtype.from_float64(total)
        assert count_wrong_exact(dtype.from_float64(partial), expected) == 0
        flipped = expected.copy()
        flipped.view(np.uint8)[5] ^= 1
        assert count_wrong_exact(flipped, expected) == 1
        assert count_wrong_exact(expected[:-1], expected) == 4096


def test_soak_error_bound_follows_the_readme():
    from tests.stress.soak import sum_error_bound

    s = np.array([2.0])
    assert sum_error_bound("bf16", s, 2, 1)[0] == pytest.approx((2**-8 + 2 * 2**-24) * 2)
    assert sum_error_bound("f16", s, 4, 2)[0] == pytest.approx((3 * 2**-11 + 4 * 2**-24) * 2)
    assert sum_error_bound("f64", s, 2, 1)[0] == pytest.approx((2**-53 + 2 * 2**-53) * 2)


@pytest.mark.parametrize("name", ["bf16", "f16", "f32", "f64"])
def test_soak_count_wrong_sum(name):
    from tests.stress.soak import count_wrong_sum, random_inputs

    dtype, n_ranks = DTYPES[name], 3
    inputs = [random_inputs(2, 999, r, 1000, name) for r in range(n_ranks)]
    good = dtype.from_float64(np.sum([dtype.to_float64(x) for x in inputs], axis=0))
    assert count_wrong_sum(good, inputs, name, n_nodes=1) == 0
    missing = dtype.from_float64(np.sum([dtype.to_float64(x) for x in inputs[:-1]], axis=0))
    assert count_wrong_sum(missing, inputs, name, n_nodes=1) > 900
    nan = good.copy()
    nan[7] = dtype.from_float64(np.array([np.nan]))[0]
    assert count_wrong_sum(nan, inputs, name, n_nodes=1) == 1


def test_soak_proc_status_and_latency_stats():
    from tests.stress.soak import latency_stats_us, parse_proc_status

    text = "Name:\tpython\nVmHWM:\t  9000 kB\nVmRSS:\t  8192 kB\nThreads:\t5\n"
    assert parse_proc_status(text) == (8192, 5)
    with open("/proc/self/status") as fh:
        rss_kb, threads = parse_proc_status(fh.read())
    assert rss_kb > 1000 and threads >= 1
    median, p99 = latency_stats_us(np.arange(1, 101) * 1000)
    assert median == pytest.approx(50.5) and 99 < p99 < 100
    assert latency_stats_us(np.array([], dtype=np.int64)) == (None, None)


def _window(index, median_us, rss_mb, fds=(10, 11), wrong=0):
    from tests.stress.soak import Window

    return Window(index=index, first_call=index * 100, calls=100, timed_calls=50,
                  median_us=median_us, p99_us=2 * median_us, rss_mb=rss_mb, fds=list(fds),
                  threads=[3, 4], wrong_values=wrong, rank_mismatches=0, wall_s=0.5,
                  load_1min=1.25)


def test_soak_drift_summary_and_report_lines():
    from tests.stress.soak import drift_summary, format_summary, format_window_table

    windows = [_window(0, 3.0, 100.0), _window(1, 3.3, 100.5), _window(2, 3.6, 101.5, (10, 13))]
    summary = drift_summary(windows, wall_s=12.0, checked_calls=9)
    assert summary["calls"] == 300 and summary["windows"] == 3
    assert summary["median_ratio"] == pytest.approx(1.2)
    assert summary["rss_growth_mb"] == pytest.approx(1.5)
    assert summary["fd_growth"] == 2 and summary["thread_growth"] == 0
    assert summary["passed"] and summary["wrong_values"] == 0
    table = format_window_table(windows)
    assert table[0].startswith("# Window") and "Median(us)" in table[0] and "RSS(MB)" in table[0]
    assert table[1].split() == ["0", "100", "50", "3.00", "6.00", "100.0", "10/11", "3/4", "0",
                                "0.50", "1.25"]
    assert table[0].split()[-2:] == ["Wall(s)", "Load"]
    assert format_window_table(windows[:1], header=False) == table[1:2]
    lines = format_summary(summary)
    assert lines[0].startswith("# Drift: median latency last/first window 1.20 (3.00 -> 3.60 us)")
    assert "RSS growth +1.5 MB" in lines[0]
    assert lines[1].startswith("# Total: 300 calls + 9 checked calls in 12.0 s; wrong values 0")
    assert lines[-1] == "# Result: PASS"
    failed = drift_summary([_window(0, 3.0, 100.0, wrong=2)], wall_s=1.0, checked_calls=3)
    assert not failed["passed"] and failed["median_ratio"] == pytest.approx(1.0)
    assert format_summary(failed)[-1] == "# Result: FAIL"


class _OneRank:
    """A communicator of one rank (what the soak's checker asks of mpi4py)."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def allgather(self, value):
        return [value]


class _FakeHarmpi:
    """harmpi at one rank (the sum is the input); ``off_by`` corrupts every all-reduce."""

    def __init__(self, off_by=0):
        self.off_by, self.calls = off_by, []

    def allreduce(self, x, **kwargs):
        self.calls.append(("allreduce", type(x).__name__, kwargs))
        if self.off_by:
            x[...] = (x.astype(np.float64) if isinstance(x, np.ndarray) else x) + self.off_by
        return x

    def allgather(self, x, out=None, **kwargs):
        self.calls.append(("allgather", type(x).__name__, kwargs))
        if out is None:
            return x.copy() if isinstance(x, np.ndarray) else x.clone()
        out.reshape(x.shape)[...] = x
        return out


@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_soak_checker_counts_wrong_values_on_tensors_and_arrays():
    from tests.stress.soak import _Checker

    fine = _FakeHarmpi()
    checker = _Checker(fine, _OneRank(), seed=3, check_every=10, n_nodes=1)
    for call_index in range(80):  # 8 checks: every dtype, tensors and numpy arrays
        checker.after_call(call_index)
    assert checker.checks == 8 and checker.wrong_values == 0 and checker.rank_mismatches == 0
    kinds = {(name, kind) for name, kind, _ in fine.calls}
    assert kinds == {("allreduce", "Tensor"), ("allreduce", "ndarray"), ("allgather", "Tensor"),
                     ("allgather", "ndarray")}
    assert ("allreduce", "ndarray", {"dtype": "bf16"}) in fine.calls
    broken = _Checker(_FakeHarmpi(off_by=1), _OneRank(), seed=3, check_every=10, n_nodes=1)
    broken.run(9)
    assert broken.wrong_values > 0


@pytest.mark.timeout(180)
@pytest.mark.skipif(not (HAVE_TORCH and HAVE_HARMPI), reason="needs torch and harmpi")
def test_soak_under_mpirun(tmp_path):
    json_path = tmp_path / "soak.json"
    proc = run_module(2, "tests.stress.soak", ["--calls", "3000", "--window", "1000",
                                               "--check-every", "250", "--warmup", "200",
                                               "--json", str(json_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("# harmpi soak test v")
    assert any(line.startswith("# Window") and "Median(us)" in line for line in lines)
    rows = [line.split() for line in lines if line[:1].isdigit()]
    assert [row[1] for row in rows] == ["1000", "2000", "3000"], proc.stdout
    assert all(row[8] == "0" for row in rows)
    assert any(line.startswith("# Drift: median latency last/first window") for line in lines)
    assert "# Total: 3000 calls + 36 checked calls" in proc.stdout
    assert lines[-1] == "# Result: PASS"
    doc = json.loads(json_path.read_text())
    assert len(doc["windows"]) == 3 and doc["summary"]["wrong_values"] == 0
    assert doc["summary"]["passed"] is True and doc["meta"]["calls"] == 3000
