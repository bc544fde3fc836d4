"""The launcher as a torchrun user expects it (issue 13, "torchrun habits").

Pure checks first (the rank shim's variables, `python` resolution,
MASTER_ADDR/MASTER_PORT, --nproc-per-node, the info warning, unresolvable
hosts), then two real 2-rank jobs: an unmodified ``init_process_group("gloo")``
script and one on backend "harmpi" with MASTER_ADDR set (torch's env://).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
from click.testing import CliRunner
from support import REPO  # noqa: E402 (the checkout, one definition)

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import launch.cli as cli_mod  # noqa: E402
from launch import Host, MpiInfo, MpiNotFoundError, PlanInputs, build_command, find_mpi  # noqa: E402
from launch.hosts import unresolvable  # noqa: E402
from launch.plan import RANKENV, RUNNER, rank_command, with_runner  # noqa: E402
from launch.rankenv import rank_variables  # noqa: E402
from launch.runner import Finished  # noqa: E402
from launch.topology import build_topology  # noqa: E402

OMPI5 = MpiInfo("openmpi", "5.0.11", "/opt/ompi/bin/mpirun")
TWO_CORES = build_topology([(0, 0, 0, 0), (1, 0, 1, 0)], hostname="box", source="test")
PY = "/venv/bin/python"


# --- the rank shim --------------------------------------------------------------


def test_rank_variables_from_each_mpi():
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    hydra = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
    assert rank_variables(ompi) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                    "LOCAL_WORLD_SIZE": "2"}
    assert rank_variables(hydra) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                     "LOCAL_WORLD_SIZE": "4"}
    with pytest.raises(LookupError, match="OMPI_COMM_WORLD_RANK"):
        rank_variables({"RANK": "0"})


def test_rankenv_sets_the_variables_and_execs():
    env = {"PATH": os.environ["PATH"], "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "RANK": "7"}
    show = 'echo "$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $$"'
    proc = subprocess.run([sys.executable, "-I", "-S", RANKENV, "--", "sh", "-c", show],
                          env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:4] == ["1", "2", "1", "2"]  # RANK from MPI, not the caller
    missing = subprocess.run([sys.executable, RANKENV, "--", "no-such-command-xyz"],
                             env=env, capture_output=True, text=True, timeout=30)
    assert missing.returncode == 127 and "cannot run 'no-such-command-xyz'" in missing.stderr


# --- the pure plan ---------------------------------------------------------------


@pytest.mark.parametrize("command, runs", [
    (("python", "s.py", "-x"), [PY, *RUNNER, "s.py", "-x"]),
    (("python3", "-c", "pass"), [PY, *RUNNER, "-c", "pass"]),
    (("s.py", "--flag"), [PY, *RUNNER, "s.py", "--flag"]),         # torchrun's bare script
    (("dir/s.py",), [PY, *RUNNER, "dir/s.py"]),
    ((PY, "-u", "-m", "pytest"), [PY, "-u", *RUNNER, "-m", "pytest"]),  # the launcher's own
    (("/usr/bin/python3", "s.py"), ["/usr/bin/python3", "s.py"]),  # a path is the user's choice
    (("hostname",), ["hostname"]),
])
def test_rank_command_resolves_python(command, runs):
    assert rank_command(command, PY) == [PY, "-I", "-S", RANKENV, "--", *runs]


@pytest.mark.parametrize("args, runs", [
    (("-X", "dev", "s.py"), ("-X", "dev", *RUNNER, "s.py")),
    (("-Xdev", "-W", "error", "-c", "pass"), ("-Xdev", "-W", "error", *RUNNER, "-c", "pass")),
    ((), ()), (("-i",), ("-i",)), (("-",), ("-",)),   # no program: nothing to run it under
    (("-um", "mod"), ("-um", "mod")),                 # a cluster of options is left as written
])
def test_the_runner_goes_before_the_program(args, runs):
    assert with_runner(args) == runs


def build(env=None, **kw):
    kw = {"np": 2, "command": ("python", "s.py"), "python": PY, **kw}
    return build_command(PlanInputs(**kw), OMPI5, TWO_CORES, env or {})


def test_master_addr_and_port():
    argv, env, _ = build(master_port=29511)
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "29511"
    x = [argv[i + 1] for i, a in enumerate(argv) if a == "-x"]
    assert {"MASTER_ADDR", "MASTER_PORT"} <= set(x)  # reaches remote hosts too
    _, env, _ = build(master_port=29511, np=4, hosts=(Host("a", 2), Host("b", 2)))
    assert env["MASTER_ADDR"] == "a"  # rank 0's host
    argv, env, _ = build(master_port=29511, env={"MASTER_ADDR": "10.0.0.9"})
    assert "MASTER_ADDR" not in env and env["MASTER_PORT"] == "29511"  # the caller's wins
    assert "MASTER_ADDR" in argv  # and is forwarded


# --- the CLI ---------------------------------------------------------------------


@pytest.fixture
def fake_machine(monkeypatch):
    monkeypatch.setattr(cli_mod, "detect_topology", lambda: TWO_CORES)
    monkeypatch.setattr(cli_mod, "find_mpi", lambda explicit=None: OMPI5)
    started = []
    monkeypatch.setattr(cli_mod, "run_mpirun",
                        lambda argv, env: started.append(argv) or Finished(0))
    for name in list(os.environ):
        if name.startswith(("HARMPI_", "OMP_", "GOMP_", "KMP_", "OMPI_", "MASTER_")):
            monkeypatch.delenv(name)
    return started


def invoke(*args):
    return CliRunner().invoke(cli_mod.cli, list(args), prog_name="harmpi-launch")


def test_info_with_more_ranks_than_cores_warns_and_shows_the_plan(fake_machine):
    result = invoke("info", "-np", "4")
    assert result.exit_code == 0, result.output
    assert "warning: more ranks than slots: 4 ranks for 2 slots" in result.output
    assert ("4 ranks on this host; per host: 4 ranks, 2 cores; per rank: 1 thread, "
            "not bound; OpenMP spin off") in result.output
    assert "--map-by numa:OVERSUBSCRIBE --bind-to none" in result.output
    assert invoke("-np", "4", "--", "true").exit_code == 2  # running it still needs the flag


def test_unresolvable_hosts_are_refused_before_mpirun(fake_machine):
    assert unresolvable((Host("localhost"), Host("no-such-host.invalid"))) == [
        "no-such-host.invalid"]
    result = invoke("-np", "2", "--hosts", "localhost:1,no-such-host.invalid:1", "--", "true")
    assert result.exit_code == 2 and "no-such-host.invalid do not resolve" in result.output
    assert fake_machine == []  # mpirun never started
    dry = invoke("-np", "2", "--hosts", "no-such-host.invalid:2", "--dry-run", "--", "true")
    assert dry.exit_code == 0 and "warning: host name(s) no-such-host.invalid" in dry.stderr
    assert invoke("-np", "2", "--hosts", "localhost:2", "--", "true").exit_code == 0
    assert len(fake_machine) == 1


def test_nproc_per_node_as_torchrun_spells_it(fake_machine):
    for spelling in ("--nproc-per-node", "--nproc_per_node"):
        result = invoke(spelling, "2", "--dry-run", "s.py")
        assert result.exit_code == 0, result.output
        argv = shlex.split(result.stdout.splitlines()[-1])
        assert argv[1:3] == ["-np", "2"] and argv[-4:] == [sys.executable, *RUNNER, "s.py"]
    result = invoke("--nproc-per-node", "1", "--hosts", "localhost:1,127.0.0.1:1", "--dry-run",
                    "s.py")
    argv = shlex.split(result.stdout.splitlines()[-1])
    assert argv[1:3] == ["-np", "2"] and "ppr:1:node" in argv[4]
    result = invoke("--nproc-per-node", "2", "-np", "3", "s.py")
    assert result.exit_code == 2 and "give one of them" in result.output


def _dry_argv(*args):
    result = invoke(*args, "--dry-run", "s.py")
    assert result.exit_code == 0, result.output
    return shlex.split(result.stdout.splitlines()[-1])


def test_torchruns_node_flags_on_one_host(fake_machine):
    plain = _dry_argv("--nproc-per-node", "2")
    for flags in (("--standalone",), ("--nnodes", "1"), ("--nnodes=1:1",), ("--node-rank", "0"),
                  ("--node_rank=0", "--nnodes", "1", "--standalone")):
        argv = _dry_argv(*flags, "--nproc-per-node", "2")
        assert argv == plain, flags
    assert plain[1:3] == ["-np", "2"] and plain[-4:] == [sys.executable, *RUNNER, "s.py"]


def test_torchruns_nnodes_names_the_hosts(fake_machine):
    argv = _dry_argv("--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1",
                     "--hosts", "localhost:1,127.0.0.1:1")
    assert argv[1:3] == ["-np", "2"] and "ppr:1:node" in argv[4]
    assert argv[argv.index("--host") + 1] == "localhost:1,127.0.0.1:1"


@pytest.mark.parametrize("flags, says", [
    (("--nnodes", "2"), "name the 2 hosts with --hosts"),
    (("--nnodes", "3", "--hosts", "localhost:1,127.0.0.1:1"), "--nnodes 3 but 2 hosts given"),
    (("--nnodes", "1", "--hosts", "localhost:1,127.0.0.1:1"), "give --nnodes 2 or one host"),
    (("--nnodes", "1:4"), "an elastic range is not supported"),
    (("--nnodes", "two"), "give a number of hosts"),
    (("--node-rank", "1"), "runs once, on the first host (node rank 0)"),
    (("--standalone", "--hosts", "localhost:2"), "--standalone runs on this host only"),
])
def test_torchruns_node_flags_that_do_not_map_are_refused(fake_machine, flags, says):
    result = invoke(*flags, "--nproc-per-node", "1", "s.py")
    assert result.exit_code == 2 and says in " ".join(result.output.split()), result.output
    assert fake_machine == []  # nothing started


# --- real jobs -------------------------------------------------------------------

GLOO_SCRIPT = """
import os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
print("rank", dist.get_rank(), "sum", int(t.item()), sys.executable,
      *(f"{n}={os.environ.get(n, '-')}" for n in names), flush=True)
dist.destroy_process_group()
"""

HARMPI_SCRIPT = """
import os
import torch
import torch.distributed as dist
import harmpi

dist.init_process_group("harmpi")  # MASTER_ADDR is set: torch's env:// rendezvous
t = torch.full((5120,), float(dist.get_rank() + 1), dtype=torch.bfloat16)
dist.all_reduce(t)
print("rank", dist.get_rank(), "of", dist.get_world_size(), "sum", int(t[0].item()),
      "env", "MASTER_ADDR" in os.environ, flush=True)
dist.destroy_process_group()
"""


def _job(tmp_path, script, command):
    try:
        find_mpi()
    except MpiNotFoundError as exc:
        pytest.skip(str(exc))
    (tmp_path / "job.py").write_text(script)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text("#!/bin/sh\necho wrong python >&2\nexit 99\n")
    (fake / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PRTE_", "PMIX_", "HARMPI_", "OMP_", "GOMP_", "KMP_",
                                "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env["PATH"] = os.pathsep.join([str(fake), os.path.dirname(sys.executable), env["PATH"]])
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-m", "launch", "-np", "2", "--bind-to", "none", "--no-tag", "--",
         *command],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    return sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))


@pytest.mark.timeout(180)
def test_unmodified_gloo_script_runs_under_the_launcher(tmp_path):
    # `python` on PATH is a fake that fails: the ranks must use the launcher's
    lines = _job(tmp_path, GLOO_SCRIPT, ["python", "job.py"])
    assert len(lines) == 2, lines
    for rank, line in enumerate(lines):
        assert line.split()[:5] == ["rank", str(rank), "sum", "3", sys.executable], line
        assert (f"RANK={rank} WORLD_SIZE=2 LOCAL_RANK={rank} LOCAL_WORLD_SIZE=2 "
                "MASTER_ADDR=127.0.0.1") in line


@pytest.mark.timeout(180)
def test_harmpi_backend_with_master_addr_under_the_launcher(tmp_path):
    lines = _job(tmp_path, HARMPI_SCRIPT, ["job.py"])  # a bare script, as torchrun runs it
    assert lines == ["rank 0 of 2 sum 3 env True", "rank 1 of 2 sum 3 env True"]


@pytest.mark.timeout(180)
def test_a_bare_torchrun_is_told_the_launcher_line(tmp_path):
    """torchrun starts each rank as an MPI world of one: the harmpi backend
    refuses, and says which harmpi-launch line starts the same job."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("no torchrun next to this Python")
    (tmp_path / "job.py").write_text(HARMPI_SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM", "PMIX_", "PMI_", "HARMPI_", "MASTER_", "RANK",
                                "WORLD_SIZE", "LOCAL_"))}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([torchrun, "--nproc-per-node", "2", "job.py", "--steps", "3"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode != 0
    err = " ".join(proc.stderr.split())
    assert "torch says rank 1 of 2, MPI says rank 0 of 1" in err, proc.stderr[-3000:]
    assert "`harmpi-launch --nproc-per-node 2 job.py --steps 3`" in err, proc.stderr[-3000:]
