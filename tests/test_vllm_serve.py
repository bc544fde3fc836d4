"""vLLM's OpenAI server with harmpi's executor (harmpi_vllm.executor.MpiExecutor):
the TP workers as one MPI job of harmpi's launcher, driven by vLLM's queues.

Without vLLM (any pytest run): the job's launcher line on one host, across
virtual nodes and across named hosts, the refusals made before anything
starts, the harmpi-vllm command's checks.

With .venv-vllm (`make vllm-test` sets HARMPI_VLLM_REQUIRED=1; elsewhere
these skip, as they start vLLM servers: ~4 min on 2 cores): the executor's
refusals inside vLLM; ``harmpi-vllm serve`` with the executor at 1 node x 2
and at 2 virtual nodes x 1, each waited for on /health, then completions at
temperature 0 whose token ids must equal an offline generation of the same
prompts with vLLM's own communicator (bench/vllm_job.py under harmpi-launch),
rank 0's log naming harmpi's communicator; the first server is stopped by
SIGINT to its process group (a Ctrl-C) and the second by killing rank 1:
every process of the job must be gone within 30 s and no /dev/shm file
they had mapped left, and the dead rank must end the server non-zero with
a message naming it, /health reporting it meanwhile. A third server runs
across two hosts (network namespaces, tests/support/netns.py: its rank on
the second host reads vLLM's queues over TCP) and is stopped by Ctrl-C.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from support import REPO
from support.vllm import VLLM_PY, need_vllm_venv, vllm_env

from harmpi_vllm import VllmLaunchError
from harmpi_vllm.cli import EXECUTOR, refusal
from harmpi_vllm.mpijob import plan_job
from launch.mpi import MpiInfo
from launch.plan import RANKENV
from launch.topology import build_topology

pytestmark = pytest.mark.timeout(1200)
ANSI = re.compile(r"\x1b\[[0-9;]*m")
PROMPTS, PROMPT_LEN, MAX_TOKENS = 2, 16, 8


def _topo(cores: int, host: str = "h"):
    return build_topology([(c, 0, c, 0) for c in range(cores)], hostname=host, source="test")


@pytest.fixture
def ompi(tmp_path):
    """An Open MPI 5 whose mpirun has PRRTE's prterun beside it (nothing is run)."""
    for name in ("mpirun", "prterun"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    return MpiInfo("openmpi", "5.0.11", str(tmp_path / "mpirun"))


def _plan(ompi, launch="", world=2, cores=2, **kw):
    env = {"HARMPI_VLLM_LAUNCH": launch, "HARMPI_VLLM_ENGINE": "10.0.0.1:5000",
           "HARMPI_VLLM_AUTHKEY": "ab", "HARMPI_VLLM_PROBE": "p", **kw.pop("env", {})}
    return plan_job(world, env, python="/v/bin/python", master_port=29500,
                    topo=_topo(cores), mpi=ompi, **kw)


def test_launch_line_one_host_keeps_a_core_for_the_server(ompi):
    job = _plan(ompi, local_names=["h"])
    argv = list(job.argv)
    assert argv[:7] == [ompi.path, "-np", "2", "--map-by", "numa", "--bind-to", "core"]
    # every rank: the launcher's rankenv shim, harmpi's runner, the worker
    assert argv[-10:] == ["/v/bin/python", "-I", "-S", RANKENV, "--", "/v/bin/python", "-m",
                          "harmpi.run", "-m", "harmpi_vllm.worker"]
    # the channel's settings reach every rank
    for name in ("HARMPI_VLLM_ENGINE", "HARMPI_VLLM_AUTHKEY", "HARMPI_VLLM_PROBE"):
        assert ["-x", name] == argv[argv.index(name) - 1:argv.index(name) + 1]
    # 2 ranks on 2 cores: a thread each, bound, and no spinning on the server's time
    assert job.env["OMP_NUM_THREADS"] == "1" and "GOMP_SPINCOUNT" not in job.env
    assert job.env["MASTER_ADDR"] == "127.0.0.1" and job.env["MASTER_PORT"] == "29500"
    assert job.remote_hosts == ()
    # 2 ranks on 8 cores: 3 threads each (4 would leave the server none), spinning
    job = _plan(ompi, cores=8, local_names=["h"])
    assert job.env["OMP_NUM_THREADS"] == "3" and job.env["GOMP_SPINCOUNT"] == "100000000"
    # the setting wins
    job = _plan(ompi, "--threads-per-rank 4 --no-spin", cores=8, local_names=["h"])
    assert job.env["OMP_NUM_THREADS"] == "4" and "GOMP_SPINCOUNT" not in job.env


def test_launch_line_virtual_nodes(ompi):
    job = _plan(ompi, "--virtual-nodes 1 --transport tcp", local_names=["h"])
    assert job.env["HARMPI_RANKS_PER_NODE"] == "1" and job.env["HARMPI_TRANSPORT"] == "tcp"
    assert "HARMPI_RANKS_PER_NODE" in job.argv and job.remote_hosts == ()


def test_launch_line_across_hosts(ompi):
    """HARMPI_VLLM_LAUNCH="--hosts a:1,b:1 --transport verbs" on head host a."""
    job = _plan(ompi, "--hosts a:1,b:1 --transport verbs", cores=4, local_names=["a"])
    argv = list(job.argv)
    assert argv[argv.index("--host") + 1] == "a:1,b:1"
    assert job.env["MASTER_ADDR"] == "a" and job.env["HARMPI_TRANSPORT"] == "verbs"
    assert job.remote_hosts == ("b",)
    assert "-x" in argv and "HARMPI_VLLM_ENGINE" in argv and "HARMPI_TRANSPORT" in argv
    # a rank alone on the 4-core head host: 3 threads; the setting's spin stays the plan's
    assert job.env["OMP_NUM_THREADS"] == "3"
    # the head host is not among them: every host is remote, no core kept
    job = _plan(ompi, "--hosts a:1,b:1", cores=4, local_names=["c"])
    assert job.remote_hosts == ("a", "b") and job.env["OMP_NUM_THREADS"] == "4"


@pytest.mark.parametrize("launch, world, says", [
    ("-np 4", 2, "-np (vLLM's --tensor-parallel-size decides"),
    ("--hosts a:1,b:1 --nnodes 2", 2, "--nnodes"),
    ("--bogus", 2, "No such option"),
    ("-- python x.py", 2, "names a command"),
    ("--hosts a:1,b:1", 3, "vLLM's 3 tensor-parallel rank(s) cannot be placed"),
    ("", 3, "more ranks than slots: 3 ranks for 2 slots"),
    ("--hosts 'a", 2, "No closing quotation"),
])
def test_refusals_before_anything_starts(ompi, launch, world, says):
    with pytest.raises(VllmLaunchError, match=re.escape(says)):
        _plan(ompi, launch, world=world)


def test_refuses_a_missing_mpirun_or_prterun(ompi, tmp_path):
    os.unlink(tmp_path / "prterun")
    with pytest.raises(VllmLaunchError, match="needs PRRTE's prterun next to it"):
        _plan(ompi)
    with pytest.raises(VllmLaunchError, match="--mpirun /nonexistent: no such executable"):
        plan_job(2, {"HARMPI_VLLM_LAUNCH": "--mpirun /nonexistent"}, topo=_topo(2))


def test_harmpi_vllm_command_checks():
    serve = ["serve", "M", "--tensor-parallel-size", "2", "--distributed-executor-backend",
             EXECUTOR]
    assert "set HARMPI_VLLM=1" in refusal(serve, {})
    assert "HARMPI_VLLM='yes'" in refusal(serve, {"HARMPI_VLLM": "yes"})
    why = refusal([*serve, "--nnodes", "2"], {"HARMPI_VLLM": "1"})
    assert "--nnodes 2" in why and 'HARMPI_VLLM_LAUNCH="--hosts a:1,b:1"' in why
    assert refusal(serve, {"HARMPI_VLLM": "1"}) is None
    assert refusal(["serve", "M", "--nnodes", "2"], {}) is None   # vLLM's own executor


# --- with vLLM -------------------------------------------------------------------


def _need_vllm():
    if os.environ.get("HARMPI_VLLM_REQUIRED") != "1":
        pytest.skip("starts vLLM servers (minutes): run by `make vllm-test`, which sets "
                    "HARMPI_VLLM_REQUIRED=1")
    need_vllm_venv()


def _vllm_env():
    return vllm_env(NO_COLOR="1")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    _need_vllm()
    path = str(tmp_path_factory.mktemp("serve") / "model")
    subprocess.run([VLLM_PY, os.path.join(REPO, "bench", "vllm_model.py"), path], check=True,
                   env=_vllm_env(), capture_output=True, timeout=300)
    return path


@pytest.fixture(scope="module")
def offline_tokens(model, tmp_path_factory):
    """The prompts' tokens from vLLM's offline LLM with its own communicator."""
    out = tmp_path_factory.mktemp("offline") / "r.json"
    launch = os.path.join(os.path.dirname(VLLM_PY), "harmpi-launch")
    proc = subprocess.run(
        [launch, "-np", "2", "--", VLLM_PY, os.path.join(REPO, "bench", "vllm_job.py"),
         "--model", model, "--comm", "vllm", "--mode", "eager", "--runs", "1", "--warmup", "0",
         "--prompts", str(PROMPTS), "--prompt-len", str(PROMPT_LEN), "--max-tokens",
         str(MAX_TOKENS), "--out", str(out)],
        env=dict(_vllm_env(), VLLM_LOGGING_LEVEL="WARNING"), capture_output=True, text=True,
        timeout=900, cwd=str(out.parent))  # not the checkout: see bench/vllm_demo.run_job
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return json.loads(out.read_text())["arms"][0]["tokens"]


def _bench():
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import vllm_serve  # noqa: PLC0415 - bench/ (needs no vLLM)

    return vllm_serve


def _server(model, tmp_path, name, launch):
    vs = _bench()
    srv = vs.Server(VLLM_PY, model, str(tmp_path / f"{name}.log"), executor="harmpi",
                    launch=launch, max_num_seqs=PROMPTS)
    srv.extra_env = {k: v for k, v in _vllm_env().items() if k.startswith("OMPI_")}
    srv.start()
    try:
        health_s = srv.wait_healthy(600)
    except BaseException:
        srv.stop(signal.SIGKILL, group=True)
        raise
    print(f"{name}: /health after {health_s:.0f} s")
    return vs, srv


def _check_generation(vs, srv, offline_tokens):
    prompts = vs.vllm_model.prompts(PROMPTS, PROMPT_LEN)
    data = srv.complete(prompts, MAX_TOKENS)   # one request of both: batched as offline
    tokens = [c["token_ids"] for c in sorted(data["choices"], key=lambda c: c["index"])]
    assert tokens == offline_tokens
    log = ANSI.sub("", srv.log())
    rank0 = re.search(r"vLLM worker rank 0 connected: pid (\d+)", log)
    assert rank0, log[-4000:]
    assert re.search(rf"pid={rank0.group(1)}\).*harmpi carries vLLM's all-reduce and "
                     r"all_gather in group tp:0", log), log[-4000:]
    return log


def _job(vs, srv):
    pids = vs.job_processes(srv.proc.pid)
    return pids, vs.shm_files(pids)


def _all_gone(vs, pids, files, since, limit_s=30.0):
    while vs.alive(pids) and time.monotonic() - since < limit_s:
        time.sleep(0.25)
    took = time.monotonic() - since
    left = vs.alive(pids)
    assert not left, f"still running {took:.0f} s after the signal: {left}"
    assert not [f for f in files if os.path.exists(f)]
    return took


def test_executor_refusals_inside_vllm():
    _need_vllm()
    code = """
import types
from harmpi_vllm import executor as e
pc = lambda **kw: types.SimpleNamespace(**{"nnodes": 1, "pipeline_parallel_size": 1,
    "data_parallel_size": 1, "prefill_context_parallel_size": 1, **kw})
for env, kw in (({}, {}), ({"HARMPI_VLLM": "1"}, {"nnodes": 2}),
                ({"HARMPI_VLLM": "1"}, {"pipeline_parallel_size": 2}), ({"HARMPI_VLLM": "1"}, {})):
    try:
        e.check_config(pc(**kw), env)
        print("ok")
    except e.VllmLaunchError as x:
        print(x)
class W:
    def __init__(self, vllm_config, rank): pass
owners = {"WorkerProc": W, "MultiprocExecutor": e.MultiprocExecutor,
          "MessageQueue": e.MessageQueue, "FutureWrapper": e.FutureWrapper, "Handle": e.Handle}
print(e.interface_differences() == [])
try:
    e.check_interface("0.99.0", owners)
except e.VllmLaunchError as x:
    print(x)
"""
    proc = subprocess.run([VLLM_PY, "-c", code], env=_vllm_env(), capture_output=True,
                          text=True, timeout=300, cwd="/")
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert "is off: set HARMPI_VLLM=1" in lines[0]
    assert "--nnodes 2" in lines[1] and "HARMPI_VLLM_LAUNCH" in lines[1]
    assert "tensor parallelism only" in lines[2] and "--pipeline-parallel-size 2" in lines[2]
    assert lines[3:5] == ["ok", "True"]
    assert "differs in this vLLM 0.99.0: WorkerProc.__init__(vllm_config, rank)" in lines[5]
    # the command refuses before vLLM starts
    cli = os.path.join(os.path.dirname(VLLM_PY), "harmpi-vllm")
    proc = subprocess.run([cli, "serve", "M", "--distributed-executor-backend", EXECUTOR],
                          env=_vllm_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "is off: set HARMPI_VLLM=1" in proc.stderr, proc.stderr


def test_serve_one_node_then_ctrl_c(model, offline_tokens, tmp_path):
    vs, srv = _server(model, tmp_path, "1x2", "")
    try:
        log = _check_generation(vs, srv, offline_tokens)
        assert "CPU SHM communicator disabled for group tp" not in log  # one node: vLLM's op
        pids, files = _job(vs, srv)
        assert len(pids) >= 5, pids  # server, engine, keeper, mpirun, 2 ranks
    except BaseException:
        srv.stop(signal.SIGKILL, group=True)
        raise
    t0 = time.monotonic()
    status = srv.stop(signal.SIGINT, group=True, timeout_s=30)
    took = _all_gone(vs, pids, files, t0)
    # the ranks leave by themselves; on a busy machine the keeper may have had to end them
    forced = [x for x in srv.log().splitlines() if x.startswith("harmpi keeper:")]
    print(f"1x2: Ctrl-C: server exit {status}, every process gone in {took:.1f} s, "
          f"forced: {forced or 'nothing'}")


def test_serve_two_virtual_nodes_then_a_rank_dies(model, offline_tokens, tmp_path):
    vs, srv = _server(model, tmp_path, "2x1", "--virtual-nodes 1 --transport tcp")
    try:
        log = _check_generation(vs, srv, offline_tokens)
        # harmpi's ranks span two nodes: vLLM's shm op is never built for them
        assert log.count("CPU SHM communicator disabled for group tp:0") == 2
        pids, files = _job(vs, srv)
        rank1 = int(re.search(r"vLLM worker rank 1 connected: pid (\d+)", log).group(1))
    except BaseException:
        srv.stop(signal.SIGKILL, group=True)
        raise
    t0 = time.monotonic()
    os.kill(rank1, signal.SIGKILL)
    health = set()
    # vLLM's server answers 503 from the moment it sees its engine dead until
    # it closes (~1 s after the kill here, when quiet): poll often enough
    while srv.proc.poll() is None and time.monotonic() - t0 < 30:
        health.add(srv.health())
        time.sleep(0.02)
    status = srv.stop(signal.SIGKILL, group=True, timeout_s=5) if srv.proc.poll() is None \
        else srv.proc.returncode
    took = _all_gone(vs, pids, files, t0)
    log = ANSI.sub("", srv.log())
    print(f"2x1: rank 1 killed: server exit {status}, /health {sorted(health)}, "
          f"every process gone in {took:.1f} s")
    assert status not in (0, -signal.SIGKILL), log[-4000:]
    named = f"vLLM worker rank 1 of 2 (pid {rank1} on "
    assert f"harmpi: {named}" in log, log[-4000:]                      # the engine's log
    assert f"harmpi-vllm: error: the server stopped: harmpi: {named}" in log  # the last word
    assert 503 in health, health


def test_serve_across_two_hosts(model, offline_tokens, tmp_path):
    """The executor's cross-host form: the server on host a of two network-
    namespace hosts (tests/support/netns.py), ``HARMPI_VLLM_LAUNCH="--hosts
    a:1,b:1 ..."``, rank 1 started on host b by mpirun's rsh agent. Host b has
    a /dev/shm of its own, as another machine has: its rank reads vLLM's
    scheduler queue and answers over TCP (vLLM's network path), and harmpi's
    communicator spans 2 nodes over its tcp rail."""
    from support import netns  # noqa: PLC0415

    ok, why = netns.can_make_namespaces()
    if not ok:
        pytest.skip(f"two-host netns harness unavailable: {why}")
    vs = _bench()
    mpirun = os.path.join(os.path.dirname(VLLM_PY), "mpirun")
    with netns.TwoHosts(ranks_per_host=1, own_shm=True, mpirun=mpirun) as hosts:
        a, b = hosts.names
        # the harness's Open MPI settings (rsh agent, the veth's subnet) through
        # the launcher's own --mpi-arg; unbound: both "hosts" see the same cores
        mca = " ".join(f"--mca {k} {v}" for k, v in hosts.default_mca().items())
        launch = f"--hosts {a}:1,{b}:1 --bind-to none --transport tcp --mpi-arg '{mca}'"
        env = hosts.env({"VLLM_HOST_IP": hosts.addresses[0], "NO_COLOR": "1",
                         "PATH": os.path.dirname(VLLM_PY) + os.pathsep + os.environ["PATH"]})
        srv = vs.Server(VLLM_PY, model, str(tmp_path / "hosts.log"), executor="harmpi",
                        launch=launch, max_num_seqs=PROMPTS, extra_env=env,
                        prefix=hosts.host_argv(a, []))
        srv.start()
        try:
            health_s = hosts.call_in(a, srv.wait_healthy, 600)
            prompts = vs.vllm_model.prompts(PROMPTS, PROMPT_LEN)
            data = hosts.call_in(a, srv.complete, prompts, MAX_TOKENS)
        except BaseException:
            srv.stop(signal.SIGKILL, group=True)
            raise
        t0 = time.monotonic()
        status = srv.stop(signal.SIGINT, group=True, timeout_s=30)
        took = time.monotonic() - t0
        log = ANSI.sub("", srv.log())
        while hosts.pids() and time.monotonic() - t0 < 30:  # rank 1 and prted on b
            time.sleep(0.25)
        left = hosts.pids()
    print(f"2 hosts x 1: /health after {health_s:.0f} s; Ctrl-C: exit {status} in {took:.1f} s")
    tokens = [c["token_ids"] for c in sorted(data["choices"], key=lambda c: c["index"])]
    assert tokens == offline_tokens
    assert re.search(rf"vLLM worker rank 0 connected: pid \d+ on {a} \(shared memory\)", log), \
        log[-4000:]
    assert re.search(rf"vLLM worker rank 1 connected: pid \d+ on {b} \(TCP\)", log), log[-4000:]
    assert "harmpi carries vLLM's all-reduce and all_gather in group tp:0: vLLM/MPI ranks " \
           "[0, 1], 2 node(s)" in log, log[-4000:]
    assert log.count("CPU SHM communicator disabled for group tp:0") == 2, log[-4000:]
    assert not left, f"still running in the two hosts 30 s after Ctrl-C: {left}"
    assert hosts.last_cleanup == {}, hosts.last_cleanup
