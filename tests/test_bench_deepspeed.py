"""The deepspeed adapter (bench.deepspeed_op): its pure decisions, then runs under mpirun.

The mpirun runs need DeepSpeed (``pip install 'harmpi[deepspeed]'``, which
``make setup`` installs) and its shm op built (``make setup`` builds it
once); without either they skip and say why.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from support.have import HAVE_TORCH
from support.jobs import run_module

from bench.deepspeed_op import cpu_flags, deepspeed_refusal, deepspeed_wire
from bench.demo import default_impls, summary_lines
from bench.harness import DTYPES
from bench.impls import parse_impls

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

AVX512 = frozenset({"sse2", "avx", "avx2", "avx512f", "avx512bw"})
AVX2 = frozenset({"sse2", "avx", "avx2"})


def _topo(hosts=1, virtual=False, ranks=2):
    return {"ranks": ranks, "hosts": hosts, "nodes": 2 if virtual else hosts,
            "ranks_per_node": [ranks], "virtual": virtual, "max_ranks_per_host": ranks}


def test_bf16_needs_avx512bw():
    bf16, f16, f32 = DTYPES["bf16"], DTYPES["f16"], DTYPES["f32"]
    assert deepspeed_wire(bf16, AVX512) == (bf16, "")
    assert deepspeed_wire(f16, AVX512) == (f16, "")
    assert deepspeed_wire(f32, AVX512) == (f32, "")
    wire, why = deepspeed_wire(bf16, AVX2)
    assert wire is f32
    assert why.startswith("float32, same bytes") and "avx512bw" in why and "SIGILL" in why
    assert deepspeed_wire(f32, AVX2) == (f32, "")


def test_no_avx2_or_float64_is_not_reduced():
    wire, why = deepspeed_wire(DTYPES["bf16"], frozenset({"sse2"}))
    assert wire is None and "avx512bw" in why
    wire, why = deepspeed_wire(DTYPES["f32"], frozenset({"sse2"}))
    assert wire is None and "avx2" in why
    wire, why = deepspeed_wire(DTYPES["f64"], AVX512)
    assert wire is None and "f64" in why


def test_refused_across_hosts_and_under_virtual_nodes(monkeypatch):
    assert deepspeed_refusal(_topo()) is None
    assert "2 hosts" in deepspeed_refusal(_topo(hosts=2, ranks=4))
    monkeypatch.setenv("HARMPI_RANKS_PER_NODE", "1")
    why = deepspeed_refusal(_topo(virtual=True))
    assert "virtual nodes (HARMPI_RANKS_PER_NODE=1)" in why


def test_cpu_flags_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512bw\n\n"
                       "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(cpuinfo)) == {"fpu", "avx2", "avx512bw"}
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_parse_impls_knows_deepspeed():
    assert parse_impls("harmpi,deepspeed,mpi") == ["harmpi", "deepspeed", "mpi"]
    for bad in ("deepspeed:x", "deepspeed:", "deepspeed,deepspeed"):
        with pytest.raises(ValueError):
            parse_impls(bad)


def test_demo_includes_deepspeed_only_when_installed():
    impls, note = default_impls(have_deepspeed=True)
    assert impls.split(",")[-1] == "deepspeed" and note == ""
    impls, note = default_impls(have_deepspeed=False)
    assert "deepspeed" not in impls and "pip install 'harmpi[deepspeed]'" in note


def test_demo_summary_has_a_deepspeed_column():
    rows = [{"impl": impl, "size": size, "avg_us": us} for impl, size, us in
            [("harmpi", 10240, 4.0), ("deepspeed", 10240, 9.0), ("mpi", 10240, 14.0),
             ("harmpi", 4194304, 600.0), ("deepspeed", 4194304, 1800.0)]]
    refused = [{"impl": "harmpi", "size": 10240, "avg_us": 20.0},
               {"impl": "deepspeed", "size": 10240, "avg_us": None}]
    lines = summary_lines([("1 node x 2", {"rows": rows}),
                           ("2 vnodes x 2", {"rows": refused})], None)
    header = next(line for line in lines if line.startswith("# size"))
    assert header.split()[-1] == "deepspeed", header
    first = lines.index("# 1 node x 2")
    ours, refused_rows = lines[first + 2:first + 4], lines[lines.index("# 2 vnodes x 2") + 2:]
    assert "9.0 (2.25x)" in ours[0] and "14.0 (3.50x)" in ours[0]  # deepspeed, mpi / harmpi
    assert "1800 (3.00x)" in ours[1]  # deepspeed / harmpi at 4 MB
    assert refused_rows[0].split()[:2] == ["10240", "20.0"] and "n/a" in refused_rows[0], lines


# --------------------------------------------------------------------------
# Under mpirun
# --------------------------------------------------------------------------


def _mpirun(n_ranks, module, args, env=None):
    """:func:`support.jobs.run_module`, with room for the op's first build and
    for a loaded machine: DeepSpeed's shm op spins without ever yielding, so
    its jobs slow down with every process beside them (its runs timed out at
    240 s on a busy machine). 240 s times the runnable processes per CPU when
    the job starts, between 240 and 600 s."""
    per_cpu = os.getloadavg()[0] / (os.cpu_count() or 1)
    return run_module(n_ranks, module, args, env=env,
                      timeout_s=min(600.0, 240.0 * max(1.0, per_cpu)))


def _skip_if_unavailable(stdout: str) -> None:
    for line in stdout.splitlines():
        if line.startswith("deepspeed unavailable: "):
            pytest.skip(line)


@pytest.mark.timeout(630)
@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed not installed "
                    "(pip install 'harmpi[deepspeed]'; make setup installs it)")
def test_deepspeed_adapter_under_mpirun():
    proc = _mpirun(2, "tests.support.deepspeed_check", [])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _skip_if_unavailable(proc.stdout)
    assert "deepspeed ok: deepspeed: torch.ops.deepspeed.inference_all_reduce_" in proc.stdout
    assert "deepspeed ok without avx512bw:" in proc.stdout, proc.stdout
    if "avx512bw" in cpu_flags():
        assert "on a torch bfloat16 tensor" in proc.stdout.splitlines()[0], proc.stdout


@pytest.mark.timeout(630)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_deepspeed_refused_under_virtual_nodes():
    # refused before anything is built: runs without deepspeed installed too
    proc = _mpirun(2, "tests.support.deepspeed_check", ["refused"],
                   env={"HARMPI_RANKS_PER_NODE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "deepspeed refused: DeepSpeed's shm op has no notion of nodes" in proc.stdout


@pytest.mark.timeout(630)
@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed not installed "
                    "(pip install 'harmpi[deepspeed]'; make setup installs it)")
def test_osu_allreduce_with_deepspeed_under_mpirun():
    proc = _mpirun(2, "bench.osu_allreduce",
                   ["-m", "1024:4096", "-i", "5", "-x", "2", "-c",
                    "--impl", "harmpi,deepspeed,mpi"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if "# note: deepspeed (every size): not run:" in proc.stdout:
        pytest.skip(proc.stdout.split("# note: deepspeed (every size): ")[1].splitlines()[0])
    assert "# deepspeed: torch.ops.deepspeed.inference_all_reduce_" in proc.stdout
    table = [line.split() for line in proc.stdout.splitlines() if line[:1].isdigit()]
    assert [int(row[0]) for row in table] == [1024, 2048, 4096]
    assert all(row.count("Pass") == 3 for row in table), proc.stdout
