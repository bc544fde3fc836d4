"""Everything the benchmarks and the profile print fits 100 columns by
default (issue 22): OSU tables side by side and ``-f``, decode tables and
comment lines, the profile summary; ``--wide`` keeps the long layout.
Formatting functions on synthetic results, then real 2-rank runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support import REPO
from support.have import HAVE_TORCH
from support.jobs import job_env, run_module

from bench import report
from bench.decode import _method_lines, _report_lines
from bench.decode_results import format_decode_table
from bench.report import Row

WIDTH = 100
IMPL_SETS = [["mpi"], ["harmpi", "mpi"], ["harmpi", "mpi", "gloo"],
             ["harmpi", "torch:harmpi", "mpi", "gloo", "gloo:unbound"],
             ["harmpi:shm_rsag", "harmpi:har_latency", "mpi", "deepspeed"]]


def _widest(lines) -> int:
    return max(len(line) for line in lines)


def _rows(impls, sizes=(2, 10240, 4194304), avg=123456.78, valid=True):
    return [Row(impl=name, dtype="bf16", size=size, avg_us=avg, min_us=avg * 0.9,
                max_us=avg * 1.1, iterations=1000, valid=valid, busbw_gbps=12.345)
            for name in impls for size in sizes]


@pytest.mark.parametrize("impls", IMPL_SETS, ids=lambda x: ",".join(x))
@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("stat", ["mean", "median"])
def test_osu_tables_fit(impls, full, check, stat):
    rows = _rows(impls)
    table = report.format_table(rows, impls, full=full, check=check, stat=stat)
    assert _widest(table) <= WIDTH, "\n".join(table)
    # the header alone decides the layout, so lines printed size by size match it
    header = report.format_table([], impls, full=full, check=check, stat=stat)
    assert table[:len(header)] == header
    full_tables = report.format_tables(rows, impls, check=check, stat=stat)
    assert _widest(full_tables) <= WIDTH, "\n".join(full_tables)


def test_side_by_side_while_it_fits_then_one_line_per_implementation():
    three = ["harmpi", "mpi", "gloo"]
    side = report.format_table(_rows(three, sizes=(1024,)), three, check=True)
    assert side[1].split()[:3] == ["#", "Size", "Avg(us)"] and len(side) == 3
    five = IMPL_SETS[3]
    stacked = report.format_table(_rows(five, sizes=(1024, 2048)), five, check=True)
    assert stacked[0].split()[:5] == ["#", "Size", "Implementation", "Avg", "Latency(us)"]
    assert [line.split()[1] for line in stacked[1:]] == five * 2
    # --wide: side by side with OSU's labels, however long
    wide = report.format_table(_rows(five, sizes=(1024,)), five, check=True, width=None)
    assert "Avg Latency(us)" in wide[1] and _widest(wide) > WIDTH


def test_comment_lines_wrap_and_tables_do_not():
    long = "# harmpi thresholds: " + ", ".join(f"knob_{i}=123456" for i in range(20))
    table = "1024" + " " * 120 + "1.00"
    out = report.fit_lines([long, table, "# short"])
    assert _widest(out[:-2]) <= WIDTH and out[-2:] == [table, "# short"]
    assert all(line.startswith("#   ") for line in out[1:-2])
    assert " ".join(part.lstrip("# ") for part in out[:-2]) == long.lstrip("# ")
    assert report.fit_lines([long], None) == [long]


def _decode_row(comm, tok_s=1234.5, agree=True):
    return dict(comm=comm, tokens_per_s=tok_s, tokens_per_s_rounds={"min": 1000.1, "max": 1300.2},
                ms_per_token=123.45, mean_ms_per_token=130.2, compute_ms_per_token=120.12,
                comm_ms_per_token=10.11, comm_share=0.123, comm_share_min=0.1,
                comm_latency_ms_per_token=1.23, comm_latency_share=0.012, prefill_ms=1234.5,
                tokens_identical_across_ranks=agree, tokens_repeat_across_rounds=False,
                agrees_with="harmpi", divergence_note="first differs at step 17 (top-2 "
                "margin 0.5 ulp: a near tie, not an error)", prefill_logits_gap_ulps=1.5)


def test_decode_table_and_notes_fit():
    rows = [_decode_row(c) for c in ("harmpi", "torch:harmpi", "gloo", "gloo:unbound", "mpi")]
    table = format_decode_table(rows)
    assert _widest(table) <= WIDTH, "\n".join(table)
    assert table[2].split()[:2] == ["harmpi", "1234.5"] and table[2].split()[-1] == "yes"
    printed = report.fit_lines(_report_lines(rows) + _method_lines(True) + _method_lines(False))
    assert _widest(printed) <= WIDTH, "\n".join(printed)
    wide = format_decode_table(rows, wide=True)
    assert "prefill ms" in wide[1] and "ranks agree" in wide[1]


@pytest.mark.timeout(600)  # importing harmpi compiles its kernels on a cold cache
def test_profile_summary_fits():
    from harmpi.record import breakdown as hprofile

    ranks = 4
    s = {
        "ranks": ranks, "nodes": 2, "calls": 123456789, "clock_bound_s": 1.5e-6,
        "collectives": {"allreduce": {"calls": 123456789, "bytes": 10**13},
                        "allgather": {"calls": 5, "bytes": 10**6}},
        "p50_s": 12.3e-6, "p99_s": 4.5e-3,
        "calls_by_rank": [123456789] * ranks, "total_s_by_rank": [9999.0] * ranks,
        "wait_s_by_rank": [1234.0] * ranks, "own_s_by_rank": [765.0] * ranks,
        "p99_s_by_rank": [4.5e-3] * ranks, "last_arrival_count": {r: 1234567 for r in range(ranks)},
        "last_arrival_delay_s": [12.345] * ranks,
        "last_arrival_by_node": {g: 1234567 for g in range(2)},
        "last_arrival_by_rail": {lr: 1234567 for lr in range(2)},
        "last_arrival_from_records": 16384, "last_arrival_unattributed": 123456,
    }
    text = hprofile.format_summary(s).splitlines()
    assert _widest(text) <= WIDTH, "\n".join(text)
    assert any("HARMPI_PROFILE_RECORDS keeps more" in line for line in text)


# --------------------------------------------------------------------------
# Real runs at 2 ranks
# --------------------------------------------------------------------------


@pytest.mark.timeout(450)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_osu_allreduce_output_fits_at_2_ranks(tmp_path):
    impls = "harmpi,torch:harmpi,mpi,gloo,gloo:unbound"
    json_path = tmp_path / "ar.json"
    proc = run_module(2, "bench.osu_allreduce",
                      ["-m", "1024:2048", "-i", "5", "-x", "2", "-c", "-f", "--stat", "median",
                       "--impl", impls, "--load", "1", "--json", str(json_path)], timeout_s=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert _widest(lines) <= WIDTH, [line for line in lines if len(line) > WIDTH]
    assert "\0" not in proc.stdout + proc.stderr
    assert any(line.startswith("# Load: 1 busy process (unbound spin loops) ran on each host")
               for line in lines), proc.stdout
    stacked = [line.split() for line in lines if line[:1].isdigit() and len(line.split()) > 3
               and line.split()[1] in impls.split(",")]
    assert len(stacked) >= 2 * 5 and all(row[-2] == "Pass" for row in stacked[:10])
    # the details that no longer fit the screen are in the JSON
    doc = json.loads(json_path.read_text())
    assert any(len(text) > WIDTH for text in doc["meta"]["descriptions"].values())


@pytest.mark.timeout(450)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_osu_alltoall_through_the_launcher_is_tagged_fits_and_has_no_nul():
    env = job_env()
    proc = subprocess.run(
        [sys.executable, "-m", "launch", "-np", "2", "--bind-to", "none", "--",
         "python", "-m", "mpi4py", "-m", "bench.osu_alltoall", "--sizes", "4K", "--iters", "8",
         "--rounds", "2", "--warmup", "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "\0" not in proc.stdout + proc.stderr  # grep would call it binary
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines and all(line.startswith("[1,0]<stdout>: ") for line in lines), proc.stdout
    content = [line.split(": ", 1)[1] for line in lines]
    assert any(line.startswith("# all-to-all latency: 2 ranks") for line in content)
    assert _widest(content) <= WIDTH, content



@pytest.mark.timeout(450)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_decode_output_fits_at_2_ranks(tmp_path):
    comms = "harmpi,torch:harmpi,gloo,mpi"
    proc = run_module(2, "bench.decode",
                      ["--comm", comms, "--hidden", "64", "--layers", "2", "--heads", "4",
                       "--kv-heads", "2", "--ffn", "256", "--vocab", "1024", "--batch", "2",
                       "--prompt-len", "4", "--tokens", "4", "--warmup", "1", "--profile",
                       "--load", "1", "--json", str(tmp_path / "d.json")], timeout_s=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert _widest(lines) <= WIDTH, [line for line in lines if len(line) > WIDTH]
    assert [line.split()[0] for line in lines if line.split()[:1] and line.split()[0]
            in comms.split(",")] == comms.split(",")
    assert any(line.startswith("# profile harmpi:") for line in lines)
    assert any(line.startswith("# Load: 1 busy process (unbound spin loops)") for line in lines)
