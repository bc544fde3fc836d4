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


def _job(tmp_path, ranks=4):
    return demo.demo_jobs(tmp_path, demo.BASE_IMPLS, "harmpi,gloo")[-1] | {"ranks": ranks}


def test_a_job_out_of_time_says_how_its_limit_was_set(monkeypatch, capsys, tmp_path):
    seen = {}

    def fake_run(argv, env, timeout, **_output):
        seen["timeout"] = timeout
        raise subprocess.TimeoutExpired(argv, timeout)

    monkeypatch.setattr(demo.subprocess, "run", fake_run)
    monkeypatch.setattr(demo.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(demo.os, "getloadavg", lambda: (2.0, 1.0, 1.0))
    code, _ = demo._run_job(_job(tmp_path), "mpirun", None)
    out = capsys.readouterr().out
    text = " ".join(x.removeprefix("#   ") for x in out.splitlines())  # unfolded
    assert code == 124 and seen["timeout"] == 3 * demo.BASE_TIMEOUT_S
    assert "timed out after 720 s (240 s scaled for 4 ranks on 2 CPUs at load 2.0)" in text
    assert "python -m bench.demo --timeout SECONDS" in text
    code, _ = demo._run_job(_job(tmp_path), "mpirun", 30.0)  # --timeout given: as given
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


def _canned_documents():
    """Three all-reduce layouts x 13 sizes x 6 implementations and two decode
    runs, as the jobs' --json files hold them: harmpi at 1 us per KiB + 2,
    each rival a fixed multiple of it."""
    factor = {"harmpi": 1.0, "torch:harmpi": 1.5, "mpi": 2.0, "gloo": 400.0,
              "gloo:unbound": 100.0, "deepspeed": 3.0}
    sizes = [2 ** k for k in range(11, 23)] + [10240]
    docs = []
    for label in ("1 node x 2", "2 vnodes x 2, MPI on shm", "2 vnodes x 2, MPI on TCP"):
        rows = [{"impl": impl, "size": size, "avg_us": (2 + size / 1024) * f}
                for impl, f in factor.items() for size in sizes]
        docs.append((label, {"meta": {"stat": "median"}, "rows": rows}))
    decode = [(label, {"meta": {"ranks": 4}, "rows": [
        {"comm": "harmpi", "tokens_per_s": 100.0}, {"comm": "torch:harmpi", "tokens_per_s": 80.0},
        {"comm": "gloo", "tokens_per_s": 25.0}, {"comm": "mpi", "tokens_per_s": 125.0}]})
        for label in ("MPI on shm", "MPI on TCP")]
    return docs, decode


def test_the_closing_table_reads_at_a_glance():
    docs, decode = _canned_documents()
    lines = demo.glance_lines(docs, decode)
    assert len(lines) <= demo.GLANCE_LINES and max(map(len, lines)) <= demo.WIDTH, lines
    assert all(" " in line.strip() for line in lines)  # no two cells run together
    # every layout, each at every glance size, with every rival's ratio to harmpi
    for label, _ in docs:
        block = lines[lines.index(f"# {label}") + 2:][:len(demo.GLANCE_SIZES)]
        assert [int(line.split()[0]) for line in block] == list(demo.GLANCE_SIZES)
    ten_k = next(line for line in lines if line.split()[0] == "10240")
    assert ten_k.split()[1] == "12.0"  # harmpi: 2 + 10 us
    for ratio in ("(1.50x)", "(2.00x)", "(400x)", "(100x)", "(3.00x)"):
        assert ratio in ten_k, ten_k
    header = next(line for line in lines if line.startswith("# size"))
    assert header.split()[3:] == ["harmpi", "torch:harmpi", "mpi", "gloo", "gloo:unbound",
                                  "deepspeed"]
    shm = next(line for line in lines if line.startswith("MPI on shm"))
    assert "100.0" in shm and "80.0 (1.25x)" in shm and "25.0 (4.00x)" in shm
    assert "125.0 (0.80x)" in shm


def test_the_plot_has_a_panel_per_layout(tmp_path):
    pytest.importorskip("matplotlib")
    docs, _ = _canned_documents()
    path = tmp_path / "latency.png"
    assert demo.plot_latency(docs, path) == 3
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width = int.from_bytes(data[16:20], "big")
    height = int.from_bytes(data[20:24], "big")
    assert width > 2 * height  # three panels side by side
