"""bench.demo without running jobs (issue 22): time limits that scale with the
machine and name the option that raises them; every line the demo prints
itself fits 100 columns."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from bench import demo


def test_job_timeout_scales_with_ranks_per_cpu_and_load():
    base = demo.BASE_TIMEOUT_S
    assert demo.job_timeout_s(2, 2, 0.0) == base  # a CPU per rank, idle: the base
    assert demo.job_timeout_s(1, 8, 0.5) == base  # never below the base
    assert demo.job_timeout_s(4, 2, 0.0) == 2 * base  # two ranks per CPU
    assert demo.job_timeout_s(4, 2, 2.0) == 3 * base  # plus two busy processes
    assert demo.job_timeout_s(4, 2, 18.0) == 11 * base  # the load of 18
    assert demo.job_timeout_s(2, 2, -1.0) == base  # (getloadavg never says < 0)
    assert demo.job_timeout_s(2, 2, 2.0, base_s=10.0) == 20.0


def test_timeout_note_names_the_option():
    note = demo.timeout_note(960.4, "240 s scaled for 4 ranks on 2 CPUs at load 4.0")
    assert note.startswith("timed out after 960 s (240 s scaled for 4 ranks")
    assert "python -m bench.demo --timeout SECONDS" in note


def _job(ranks=4):
    return demo.demo_jobs(demo.Path("/tmp/out"), demo.BASE_IMPLS, "harmpi,gloo")[-1] | {
        "ranks": ranks}


def test_a_job_out_of_time_says_how_its_limit_was_set(monkeypatch, capsys):
    seen = {}

    def fake_run(argv, env, timeout):
        seen["timeout"] = timeout
        raise subprocess.TimeoutExpired(argv, timeout)

    monkeypatch.setattr(demo.subprocess, "run", fake_run)
    monkeypatch.setattr(demo.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(demo.os, "getloadavg", lambda: (2.0, 1.0, 1.0))
    code, _ = demo._run_job(_job(), "mpirun", None)
    out = capsys.readouterr().out
    text = " ".join(x.removeprefix("#   ") for x in out.splitlines())  # unfolded
    assert code == 124 and seen["timeout"] == 3 * demo.BASE_TIMEOUT_S
    assert "timed out after 720 s (240 s scaled for 4 ranks on 2 CPUs at load 2.0)" in text
    assert "python -m bench.demo --timeout SECONDS" in text
    code, _ = demo._run_job(_job(), "mpirun", 30.0)  # --timeout given: as given
    assert seen["timeout"] == 30.0 and "timed out after 30 s (--timeout)" in capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= demo.WIDTH, out


def test_fold_keeps_comments_within_the_width():
    line = "# " + " ".join(["word"] * 60)
    parts = demo.fold(line)
    assert len(parts) > 1 and all(len(p) <= 100 and p.startswith("#") for p in parts)
    assert " ".join(p.removeprefix("#   ") for p in parts) == line
    assert demo.fold("short") == ["short"]
    table_row = "x" * 120  # not a comment: left alone (its author must fit it)
    assert demo.fold(table_row) == [table_row]


def test_shown_command_fits_and_reads_back_as_the_same_command():
    job = demo.demo_jobs(demo.Path("/a/long/output/directory/for/the/demo"), demo.BASE_IMPLS,
                         "harmpi,torch:harmpi,gloo,mpi")[2]
    argv = demo.mpirun_argv(job["ranks"], job["module"], job["args"],
                            mpirun="/work/main/.venv/bin/mpirun")
    lines = demo.shown_command(job["env"], argv)
    assert len(lines) > 1 and all(len(x) <= 100 for x in lines), lines
    assert lines[0].startswith("$ HARMPI_RANKS_PER_NODE=2 OMPI_MCA_btl=tcp,self ")
    joined = " ".join(x.removeprefix("$").removesuffix("\\") for x in lines)
    env_words = [f"{k}={v}" for k, v in job["env"].items()]
    assert shlex.split(joined) == env_words + argv


def _rows(impls, sizes=demo.SUMMARY_SIZES):
    return [{"impl": impl, "size": size, "avg_us": 3.0 + 4000.0 * i + size / 1000}
            for i, impl in enumerate(impls) for size in sizes]


@pytest.mark.parametrize("impls", [demo.SUMMARY_IMPLS, ("harmpi", "mpi")])
def test_summary_fits_100_columns(impls):
    meta = {"topology": {"ranks": 4, "hosts": 1, "virtual": True},
            "harmpi_info": {"oversubscribed": True}}
    docs = [(label, {"rows": _rows(impls), "meta": meta, "demo": {"env": {}}})
            for label in ("1 node x 2", "2 vnodes x 2, MPI on shm", "2 vnodes x 2, MPI on TCP")]
    docs[0][1]["rows"][-1]["avg_us"] = 1.0  # a loss: the long notes appear
    decode_row = {"tokens_per_s": 80.0, "ms_per_token": 12.5, "comm_share": 0.2,
                  "comm_ms_per_token": 2.0, "comm_latency_share": 0.05,
                  "compute_ms_per_token": 9.0, "tokens_agree": False, "first_divergence": 7,
                  "prefill_logits_gap_ulps": 1.0}
    decode = {"meta": {"ranks": 4}, "rows": [decode_row | {"comm": c} for c in
                                             ("harmpi", "torch:harmpi", "gloo", "mpi")]}
    decode["rows"][3]["tokens_per_s"] = 99.0  # harmpi loses: the why line appears
    lines = demo.summary_lines(docs, [("MPI on shm", decode), ("MPI on TCP", decode)])
    printed = [part for line in lines for part in demo.fold(line)]
    assert max(map(len, printed)) <= 100, max(printed, key=len)
    header = next(x for x in printed if x.startswith("# size (B)"))
    assert header.split()[3:] == list(impls)
    row = printed[printed.index("# 1 node x 2") + 2]  # 10240 B: harmpi 13.24, mpi 4013.24
    assert row.split()[:4] == ["10240", "13.2", "4013", "(303.11x)"], row
