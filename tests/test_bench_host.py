"""make bench-host (bench.host, issue 37): the matrix sized to the host's cores,
the job command lines, one table of harmpi/MPI ratios within 100 columns,
every cell in --json, failed cells reported with their reason (a job that
exits non-zero, one that outlives its limit, one --deadline leaves out); one
tiny real run at 2 ranks through the command line (~10 s)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support import REPO
from support.jobs import job_env, job_limit_s, mpirun_or_skip

from bench import host, host_report
from bench import host_matrix as matrix
from bench.host_job import cell_iterations

SIXTEEN = matrix.default_layouts(16)
COLLECTIVES = ("allreduce", "allgather", "alltoall")


def test_the_matrix_follows_the_cores():
    assert SIXTEEN == ["1x2", "1x4", "1x8", "1x16", "2x1", "2x2", "2x8", "4x4",
                       "decode:2", "decode:4", "decode:8"]
    assert matrix.default_layouts(2) == ["1x2", "2x1", "4x1", "decode:2"]
    assert matrix.default_layouts(12)[:4] == ["1x2", "1x4", "1x8", "1x12"]  # and all cores
    assert matrix.default_layouts(2, quick=True) == ["1x2", "2x1", "decode:2"]
    bound = {name: matrix.parse_layout(name, 2).bind for name in matrix.default_layouts(2)}
    assert bound == {"1x2": "core", "2x1": "core", "4x1": "none", "decode:2": "core"}
    with pytest.raises(ValueError, match="not a layout"):
        matrix.parse_layout("2by4", 16)


def test_job_commands_bind_or_share_and_put_virtual_nodes_on_tcp():
    settings = matrix.Settings((2048, 10240), COLLECTIVES, **matrix.QUICK)
    env, argv = matrix.job_command(matrix.parse_layout("2x1", 2), settings, "o.json",
                                 mpirun="mpirun", python="py")
    assert argv[:7] == ["mpirun", "-np", "2", "--map-by", "core", "--bind-to", "core"]
    assert argv[7:12] == ["--mca", "btl", "self,tcp", "-x", "HARMPI_RANKS_PER_NODE"]
    assert env == {"OMPI_MCA_mpi_yield_when_idle": "0", "HARMPI_RANKS_PER_NODE": "1"}
    assert argv[argv.index("--sizes") + 1] == "2K,10K" and "harmpi,mpi" in argv
    assert argv[argv.index("--settle-calls") + 1] == "1000"
    env, argv = matrix.job_command(matrix.parse_layout("1x4", 2), settings, "o.json",
                                 mpirun="mpirun", python="py")
    assert argv[3:7] == ["--map-by", ":OVERSUBSCRIBE", "--bind-to", "none"]
    assert env == {"OMPI_MCA_mpi_yield_when_idle": "1"} and "--mca" not in argv
    _, argv = matrix.job_command(matrix.parse_layout("1x2", 2), settings, "o.json", python="py")
    assert "harmpi,mpi,gloo" in argv  # Gloo only where it costs seconds
    _, argv = matrix.job_command(matrix.parse_layout("decode:4", 2), settings, "d.json",
                               python="py")
    assert argv[:6] == ["py", "-m", "launch", "-np", "4", "--oversubscribe"]
    assert argv[argv.index("--") + 1:][:4] == ["python", "-m", "bench.decode", "--comm"]


def test_cell_iterations_move_a_budget_within_bounds():
    assert cell_iterations(2048, 1 << 30, 1000, 10) == (1000, 100)
    assert cell_iterations(64 << 20, 1 << 30, 1000, 10) == (16, 2)
    assert cell_iterations(1 << 30, 1 << 20, 1000, 10) == (10, 2)


def _canned(sizes):
    """Cells of the whole 16-core matrix, from documents as the jobs write them:
    extreme ratios, a cell whose implementation was unavailable, a job that
    ran out of time half-way, a decode job that exited 1 after its figures
    (as bench.decode does when ranks generated different tokens)."""
    cells = []
    for name in SIXTEEN:
        layout = matrix.parse_layout(name, 16)
        if layout.kind == "decode":
            ok = layout.ranks != 8
            doc = {"rows": [{"comm": "harmpi", "tokens_per_s": 274.2},
                            {"comm": "mpi", "tokens_per_s": 251.0},
                            {"comm": "gloo", "tokens_per_s": 34.1}]}
            outcome = {"exit": 0 if ok else 1, "timed_out": False, "limit_s": 240,
                       "last_error": "RuntimeError: boom"}
            doc = doc if ok else {"rows": [{"comm": "harmpi", "tokens_per_s": 9.0},
                                           {"comm": "mpi", "tokens_per_s": 9.0}]}
            cells += host_report.decode_cells(layout.as_dict(), doc, outcome)
            continue
        rows = []
        for collective in COLLECTIVES:
            for i, size in enumerate(sizes):
                if layout.name == "2x8 tcp" and collective == "alltoall" and size > 65536:
                    continue  # killed by its time limit before these
                for impl, us in (("harmpi", 10.0 ** (i % 7 - 3) * 3.3), ("mpi", 3.3)):
                    unavailable = layout.name == "4x4 tcp" and impl == "harmpi" and size == 2048
                    rows.append({"collective": collective, "impl": impl, "size": size,
                                 "avg_us": None if unavailable else us, "iterations": 100,
                                 "valid": None, "note": "no such algorithm"
                                 if unavailable else ""})
        late = layout.name == "2x8 tcp"
        outcome = {"exit": None if late else 0, "timed_out": late,
                   "limit_s": 240.0}
        cells += host_report.collective_cells(layout.as_dict(), COLLECTIVES, sizes,
                                              {"rows": rows}, outcome)
    return cells


def test_table_fits_100_columns_json_has_every_cell_and_failures_say_why():
    sizes = sorted(matrix.FULL_SIZES)
    cells = _canned(sizes)
    lines = host_report.table_lines(cells) + host_report.failure_lines(cells)
    assert max(map(len, lines)) <= 100, "\n".join(lines)
    collective_layouts = [n for n in SIXTEEN if not n.startswith("decode")]
    assert len(cells) == len(collective_layouts) * len(COLLECTIVES) * len(sizes) + 3
    table = "\n".join(lines)
    assert "0.00" in table and ">999" in table and "FAIL" in table
    assert "decode 8  core dec   FAIL" in table
    assert "1.09  tok/s: harmpi 274.2, mpi 251.0, gloo 34.1" in table
    unfolded = " ".join(line.removeprefix("#   ") for line in lines)
    assert ("FAIL 2x8 tcp a2a 128K,256K,512K,1M,2M,4M: job timed out after 240 s "
            "(bench.host --timeout; --deadline)") in unfolded
    assert "FAIL 4x4 tcp ar 2K; ag 2K; a2a 2K: harmpi: no such algorithm" in unfolded
    assert "FAIL decode 8 dec: job exit 1: RuntimeError: boom" in unfolded
    host_info = {"cores": 16, "cpus": 16, "cpu_model": "Xeon", "flags": "avx2 amx_bf16"}
    doc = json.loads(json.dumps(host_report.document({"host": host_info}, cells, [])))
    keys = {(c["layout"], c["collective"], c["size"]) for c in doc["cells"]}
    assert len(keys) == len(cells)
    first = doc["cells"][0]
    assert {"harmpi", "mpi", "ratio", "ranks", "layout", "bind", "host_cores", "cpu_model",
            "cpu_flags", "status", "reason"} <= set(first)
    assert first["ratio"] == pytest.approx(first["harmpi"] / first["mpi"])
    # more sizes than fit one line: a second block, still 100 columns
    many = [1 << i for i in range(8, 24)]
    assert max(map(len, host_report.table_lines(_canned(many)))) <= 100


@pytest.mark.timeout(240)  # above job_limit_s's 200 s, so that the test ends bench.host
def test_a_quick_run_at_2_ranks(tmp_path):
    """One tiny real matrix through the command line: 1 x 2, harmpi and MPI,
    two collectives at two sizes."""
    mpirun_or_skip()
    argv = [sys.executable, "-m", "bench.host", "--quick", "--no-gloo", "--no-precompile",
            "--settle-calls", "100", "--layouts", "1x2", "--sizes", "2K,10K",
            "--collectives", "allreduce,alltoall", "--out", str(tmp_path / "out"),
            "--json", str(tmp_path / "cells.json")]
    proc = subprocess.Popen(argv, cwd=REPO, env=job_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        text, err = proc.communicate(timeout=job_limit_s(10, 2))
    except subprocess.TimeoutExpired:
        proc.terminate()  # bench.host ends its running job on SIGTERM
        text, err = proc.communicate()
        pytest.fail(f"bench.host still ran after its limit:\n{text}\n{err[-3000:]}")
    assert proc.returncode == 0, text + err[-3000:]
    table = text[text.index("# layout"):].splitlines()
    assert max(map(len, text.splitlines())) <= 100, text
    bind = matrix.parse_layout("1x2", matrix.host_description()["cores"]).bind
    assert [line.split()[:3] for line in table[1:3]] == [["1x2", bind, "ar"],
                                                         ["1x2", bind, "a2a"]]
    assert "# 4/4 cells ok" in text
    cells = json.loads((tmp_path / "cells.json").read_text())["cells"]
    assert [(c["collective"], c["size"], c["status"]) for c in cells] == [
        ("allreduce", 2048, "ok"), ("allreduce", 10240, "ok"), ("alltoall", 2048, "ok"),
        ("alltoall", 10240, "ok")]
    assert all(c["harmpi"] > 0 and c["mpi"] > 0 and c["ranks"] == 2 for c in cells)


FAILING_JOB = ("import sys, time; print('Traceback (most recent call last):'); "
               "print('RuntimeError: rank 1 could not start', file=sys.stderr); "
               "sys.stdout.flush(); time.sleep(float(sys.argv[1])); sys.exit(3)")


@pytest.mark.parametrize("sleep_s, reason", [
    (0, "job exit 3: RuntimeError: rank 1 could not start"),
    (60, "job timed out after 2 s (bench.host --timeout; --deadline)")])
def test_a_failing_job_fails_its_cells_with_the_reason(tmp_path, monkeypatch, sleep_s, reason):
    """A job that exits non-zero or outlives its limit (ended with its
    process group): its cells fail with the reason, the next job still runs."""
    mpirun_or_skip()
    calls = []

    def job_command(layout, settings, json_path, **_where):
        calls.append(layout.name)
        return {}, [sys.executable, "-c", FAILING_JOB, str(sleep_s)]

    monkeypatch.setattr(host, "job_command", job_command)
    settings = matrix.Settings((2048,), ("allreduce", "alltoall"), timeout_s=2.0)
    layouts = [matrix.parse_layout(name, 2) for name in ("1x2", "decode:2")]
    cells, jobs, _ = host.run_matrix(layouts, settings, tmp_path, {"cpus": 2},
                                     say=lambda _: None)
    assert calls == ["1x2", "decode 2"] and all(job["elapsed_s"] < 30 for job in jobs)
    assert [(c.layout, c.collective, c.status, c.reason) for c in cells] == [
        ("1x2", "allreduce", "failed", reason), ("1x2", "alltoall", "failed", reason),
        ("decode 2", "decode", "failed", reason)]
    lines = host_report.table_lines(cells) + host_report.failure_lines(cells)
    assert lines[1].split()[-1] == "FAIL" and lines[-1].startswith("# FAIL decode 2 dec: ")


def test_a_deadline_fails_the_jobs_it_leaves_out(tmp_path):
    """--deadline (a host lent for minutes): a job with too little time left
    is not started, and its cells fail saying so."""
    mpirun_or_skip()
    settings = matrix.Settings((2048,), ("allreduce",), deadline_s=1.0)
    layouts = [matrix.parse_layout(name, 2) for name in ("1x2", "decode:2")]
    cells, jobs, _ = host.run_matrix(layouts, settings, tmp_path, {"cpus": 2},
                                     say=lambda _: None)
    assert [(c.layout, c.status) for c in cells] == [("1x2", "failed"), ("decode 2", "failed")]
    assert all(c.reason == "not started: --deadline 1 s reached" for c in cells)
    assert not list(tmp_path.iterdir()) and all(job["skipped"] for job in jobs)
