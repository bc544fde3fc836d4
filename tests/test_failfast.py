"""A rank that fails ends the whole job within seconds (harmpi.failfast):
an uncaught exception under the launcher, under plain mpirun with harmpi's
runner (``python -m harmpi.run``) or with the hook the program opts into
(``harmpi.failfast.install()``), and under ``python -m mpi4py``, and a rank
killed by a signal, with the traceback shown once, a non-zero status and
nothing left in the shared-memory backing directory. The opt-out keeps the
old behaviour. Whole jobs, plus the hook, the runner's call and the
runner's command line in-process or in one process."""

import io
import os
import re
import signal
import subprocess
import sys
import time
import types

import pytest
from support import REPO
from support.jobs import job_limit_s, job_script

from harmpi import Config, HarmpiArgumentError
from harmpi.platform import failfast

pytestmark = pytest.mark.timeout(300)

#: seconds from the failure to the end of the job (measured: ~0.1-0.5 s on
#: a quiet machine; the old behaviour took harmpi's 60 s deadline, or the
#: peer's 120 s sleep): half the deadline, room for a loaded machine
BOUND_S = 30.0

JOB = """
    import os, signal, sys, time, harmpi, torch
    {install}
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.rank
    MPI.COMM_WORLD.Barrier()      # start-up (seconds apart under load) out of a short deadline
    harmpi.allreduce(torch.ones(10))
    if rank == 1:
        time.sleep(0.5)           # the peer is inside its wait (or sleep) by now
        print(f"rank 1 fails at {{time.time():.6f}}", flush=True)
        {fail}
    elif "{peer}" == "wait":
        harmpi.allreduce(torch.ones(10))
    else:
        time.sleep(120)
    print(f"rank {{rank}} exits", flush=True)
"""
RAISE = 'raise RuntimeError("rank 1 fails on purpose")'


def _launch_argv(argv):
    """``python -m launch`` running the job of :func:`support.jobs.job_script`'s argv."""
    script = argv[argv.index(sys.executable) + 1:]
    forward = " ".join(f"-x {argv[i + 1]}" for i, a in enumerate(argv) if a == "-x")
    return [sys.executable, "-m", "launch", "-np", "2", "--oversubscribe", "--bind-to", "none",
            "--mpi-arg", forward, "--", sys.executable, *script]


#: how a job starts: "launch" (python -m launch, which runs harmpi.run),
#: "mpirun" (plain mpirun, python -m harmpi.run), "hook" (plain mpirun, plain
#: python, the job calls harmpi.failfast.install()), "mpi4py" (python -m
#: mpi4py, with the hook: mpi4py's own abort comes at exit, after harmpi's
#: exit-time teardown waited on the peers, ~60 s)
STARTERS = ("launch", "mpirun", "hook", "mpi4py")
INSTALL = "harmpi.failfast.install()"


def _starter_job(tmp_path, body, starter, extra_env=None):
    """:func:`support.jobs.job_script` started by ``starter`` (see STARTERS)."""
    body = body.replace("{install}", INSTALL if starter in ("hook", "mpi4py") else "pass")
    argv, env, shm = job_script(tmp_path, body, mpi4py_main=starter == "mpi4py",
                                runner=starter == "mpirun", extra_env=extra_env)
    return (_launch_argv(argv) if starter == "launch" else argv), env, shm


def _start(tmp_path, fail, peer="wait", starter="mpirun", extra_env=None):
    """Run the job; (completed process, seconds from the failure to the end)."""
    body = JOB.format(fail=fail, peer=peer, install="{install}")
    argv, env, shm = _starter_job(tmp_path, body, starter, extra_env)
    proc = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=job_limit_s(BOUND_S))
    ended = time.time()
    m = re.search(r"rank 1 fails at ([0-9.]+)", proc.stdout)
    assert m, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert os.listdir(shm) == [], "shared memory left behind"
    return proc, ended - float(m.group(1))


@pytest.mark.parametrize("starter", STARTERS)
def test_an_uncaught_exception_ends_the_job(tmp_path, starter):
    proc, took = _start(tmp_path, RAISE, starter=starter)
    assert took < BOUND_S, (took, proc.stderr[-3000:])
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert out.count("Traceback (most recent call last)") == 1, out[-3000:]
    assert out.count("RuntimeError: rank 1 fails on purpose") == 1, out[-3000:]
    assert "rank 1 of 2 ended with an uncaught RuntimeError" in proc.stderr
    assert "rank 0 exits" not in proc.stdout


TORCH_JOB = """
    import os, sys, time, torch
    import harmpi.distributed           # backend "harmpi"
    import torch.distributed as dist
    {install}
    # (installs torch's excepthook around harmpi's; env:// under the launcher)
    dist.init_process_group("harmpi", init_method=None if "MASTER_ADDR" in os.environ else "mpi://")
    rank = dist.get_rank()
    print(f"rank {rank} excepthook {sys.excepthook.__name__}", flush=True)
    dist.all_reduce(torch.ones(10))
    if rank == 1:
        time.sleep(0.5)           # the peer is inside its all-reduce by now
        print(f"rank 1 fails at {time.time():.6f}", flush=True)
        raise RuntimeError("rank 1 fails on purpose")
    dist.all_reduce(torch.ones(10))
    print(f"rank {rank} exits", flush=True)
"""


@pytest.mark.parametrize("starter", ["launch", "mpirun", "hook"])
def test_the_traceback_survives_torchs_excepthook(tmp_path, starter):
    """With a torch process group, torch's excepthook points sys.stderr at a
    buffer and calls the hook before it (harmpi's, with the opt-in hook),
    which aborts before torch prints the buffer; the runner calls torch's
    hook with its own buffer. Either way harmpi writes the traceback
    (prefixed by the rank, as torch would) and its line to the real stderr."""
    argv, env, shm = _starter_job(tmp_path, TORCH_JOB, starter)
    proc = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=job_limit_s(BOUND_S))
    took = time.time() - float(re.search(r"rank 1 fails at ([0-9.]+)", proc.stdout).group(1))
    assert "rank 1 excepthook _distributed_excepthook" in proc.stdout, proc.stdout[-2000:]
    assert took < BOUND_S, (took, proc.stderr[-3000:])
    assert proc.returncode != 0 and "rank 0 exits" not in proc.stdout
    err = proc.stderr
    assert err.count("[rank1]: Traceback (most recent call last)") == 1, err[-3000:]
    assert "runpy" not in err and "harmpi/platform/failfast.py" not in err  # starts at the program
    assert err.count("[rank1]: RuntimeError: rank 1 fails on purpose") == 1, err[-3000:]
    assert "rank 1 of 2 ended with an uncaught RuntimeError" in err, err[-3000:]
    assert err.index("[rank1]: Traceback") < err.index("rank 1 of 2 ended with")
    assert os.listdir(shm) == []


@pytest.mark.parametrize("fail,status,tracebacks",
                         [(RAISE, 1, 1), ("raise KeyboardInterrupt", 130, 1),
                          ("sys.exit(3)", 3, 0)],
                         ids=["exception", "keyboard-interrupt", "sys-exit"])
def test_a_peer_outside_harmpi_is_ended_too(tmp_path, fail, status, tracebacks):
    """The peer sleeps (user code): only the launcher can end it."""
    proc, took = _start(tmp_path, fail, peer="sleep")
    assert took < BOUND_S, (took, proc.stderr[-3000:])
    assert proc.returncode == status, proc.stderr[-3000:]
    assert (proc.stdout + proc.stderr).count("Traceback (most recent call last)") == tracebacks


def test_the_hook_leaves_sys_exit_alone(tmp_path):
    """The opt-in hook sees no SystemExit (Python shows it to no hook): the
    rank that exits ends alone and its sleeping peer is not ended early."""
    body = JOB.format(fail="sys.exit(3)", peer="sleep", install=INSTALL).replace(
        "time.sleep(120)", "time.sleep(3)")
    argv, env, shm = job_script(tmp_path, body)
    proc = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=job_limit_s(BOUND_S))
    assert proc.returncode == 3 and "rank 0 exits" in proc.stdout, proc.stderr[-3000:]
    assert "MPI_ABORT" not in proc.stderr


def test_sys_exit_non_zero_ends_the_job_under_the_launcher(tmp_path):
    proc, took = _start(tmp_path, "sys.exit(3)", starter="launch")
    assert took < BOUND_S, (took, proc.stderr[-3000:])
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "rank 1 of 2 ended with sys.exit(3)" in proc.stderr


@pytest.mark.parametrize("sig,peer", [("SIGKILL", "wait"), ("SIGKILL", "sleep"),
                                      ("SIGSEGV", "wait"), ("SIGTERM", "sleep")])
def test_a_killed_rank_ends_the_job(tmp_path, sig, peer):
    """Open MPI's launcher ends the job itself when a rank dies of a signal."""
    proc, took = _start(tmp_path, f"os.kill(os.getpid(), signal.{sig})", peer=peer)
    assert took < BOUND_S, (took, proc.stderr[-3000:])
    assert proc.returncode == 128 + getattr(signal, sig), proc.stderr[-3000:]
    assert "rank 0 exits" not in proc.stdout


def test_a_killed_rank_ends_the_job_under_the_launcher(tmp_path):
    proc, took = _start(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)", starter="launch")
    assert took < BOUND_S, (took, proc.stderr[-3000:])
    assert proc.returncode != 0


def test_the_opt_out_keeps_the_old_behaviour(tmp_path):
    """HARMPI_ABORT_ON_EXCEPTION=0: the failed rank waits in MPI_Finalize and
    its peer fails at harmpi's deadline; no MPI_Abort."""
    proc, took = _start(tmp_path, RAISE, extra_env={"HARMPI_ABORT_ON_EXCEPTION": "0",
                                                    "HARMPI_TIMEOUT_S": "3"})
    assert took >= 3.0, (took, proc.stderr[-3000:])
    assert proc.returncode != 0
    assert "RuntimeError: rank 1 fails on purpose" in proc.stderr
    assert "HarmpiTimeoutError" in proc.stderr and "MPI_ABORT" not in proc.stderr


def test_a_clean_exit_never_aborts(tmp_path):
    """A rank that leaves early with status 0 (after catching an exception
    and a sys.exit(7), one of them kept until exit) ends nothing: the
    other finishes its work."""
    body = """
        import sys, time, harmpi, torch
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.rank
        harmpi.allreduce(torch.ones(10))
        try:
            raise RuntimeError("caught")
        except RuntimeError:
            pass
        try:
            sys.exit(7)
        except SystemExit as exc:
            kept = exc            # released by the finalising interpreter
        if rank == 1:
            time.sleep(2)
            print("rank 1 finished its work", flush=True)
        else:
            sys.exit(0)
    """
    argv, env, shm = job_script(tmp_path, body, runner=True)
    proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                          timeout=job_limit_s(BOUND_S))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1 finished its work" in proc.stdout and "MPI_ABORT" not in proc.stderr
    assert os.listdir(shm) == []


# -- the hook in this process (no MPI job) -----------------------------------


class _World:
    def __init__(self):
        self.aborted = []

    def Get_rank(self):
        return 1

    def Get_size(self):
        return 2

    def Abort(self, status):
        self.aborted.append(status)


@pytest.fixture
def world(monkeypatch):
    w = _World()
    monkeypatch.setattr(failfast, "_mpi_world", lambda: w)
    return w


def _hook():
    seen = []
    return failfast.AbortHook(lambda *exc: seen.append(exc[0])), seen


def test_the_hook_prints_through_the_previous_hook_then_aborts(world):
    hook, seen = _hook()
    hook(RuntimeError, RuntimeError("x"), None)
    hook(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert seen == [RuntimeError, KeyboardInterrupt] and world.aborted == [1, 130]


def test_the_traceback_reaches_the_real_stderr_under_a_capturing_hook(world, capfd, caplog):
    """A hook around harmpi's that captures sys.stderr while it runs (torch's
    _distributed_excepthook does) never gets to print: harmpi has aborted."""
    hook = failfast.AbortHook(sys.__excepthook__)

    def torch_like(*exc):
        saved, sys.stderr = sys.stderr, io.StringIO()
        try:
            hook(*exc)
        finally:
            sys.stderr = saved  # torch prints its buffer here: never reached in a job

    try:
        raise RuntimeError("lost before")
    except RuntimeError as exc:
        torch_like(type(exc), exc, exc.__traceback__)
    err = capfd.readouterr().err
    assert "[rank1]: Traceback (most recent call last):" in err, err
    assert "[rank1]: RuntimeError: lost before" in err, err
    # (pytest's log capture takes harmpi's line here; the jobs above see it on stderr)
    assert "rank 1 of 2 ended with an uncaught RuntimeError" in caplog.text
    assert world.aborted == [1]


def test_rank_prefixed():
    text = "Traceback:\n  x\n\n[rank3]: already\n"
    assert failfast.rank_prefixed(text, 3) == ("[rank3]: Traceback:\n[rank3]:   x\n\n"
                                               "[rank3]: already\n")


def test_the_hook_aborts_even_if_the_previous_hook_fails(world):
    def broken(*exc):
        raise OSError("stderr is gone")

    with pytest.raises(OSError):
        failfast.AbortHook(broken)(RuntimeError, RuntimeError("x"), None)
    assert world.aborted == [1]


def test_no_abort_in_a_forked_child_or_without_a_world(world, monkeypatch):
    hook, seen = _hook()
    hook.pid = os.getpid() + 1
    hook(RuntimeError, RuntimeError("x"), None)
    monkeypatch.setattr(failfast, "_mpi_world", lambda: None)
    hook, _ = _hook()  # a one-rank world, or MPI finalized
    hook(RuntimeError, RuntimeError("x"), None)
    assert world.aborted == []


def test_a_world_context_config_opts_out(world, monkeypatch):
    from harmpi.runtime import registry

    ctx = types.SimpleNamespace(config=Config(abort_on_exception=False))
    monkeypatch.setattr(registry.STATE, "world", ctx)
    hook, _ = _hook()
    hook(RuntimeError, RuntimeError("x"), None)
    assert world.aborted == []
    ctx.config = Config()
    hook(RuntimeError, RuntimeError("x"), None)
    assert world.aborted == [1]


def test_the_runner_aborts_on_an_exit_that_nothing_caught(world):
    with pytest.raises(SystemExit):
        failfast.run(lambda: sys.exit(0), env={})

    def caught():
        try:
            sys.exit(7)
        except SystemExit:
            pass

    failfast.run(caught, env={})
    assert world.aborted == []
    for code in (4, "a message"):  # Python prints a message, the status is 1
        with pytest.raises(SystemExit):
            failfast.run(lambda code=code: sys.exit(code), env={})
    assert world.aborted == [4, 1]


def test_the_runner_aborts_on_an_exception_from_the_program(world, capfd):
    def program():
        raise RuntimeError("from the program")

    with pytest.raises(RuntimeError):  # (the fake world's Abort returns)
        failfast.run(program, env={})
    err = capfd.readouterr().err
    assert "[rank1]: RuntimeError: from the program" in err, err
    assert "harmpi/platform/failfast.py" not in err  # the traceback starts at the program
    assert world.aborted == [1]
    with pytest.raises(RuntimeError):
        failfast.run(program, env={"HARMPI_ABORT_ON_EXCEPTION": "0"})
    assert world.aborted == [1]


def test_install_once_and_the_environment_opt_out(monkeypatch):
    builtin_exit = sys.exit
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    assert not failfast.install({"HARMPI_ABORT_ON_EXCEPTION": "0"})
    assert sys.excepthook is sys.__excepthook__
    # another bad setting surfaces at the first collective; the hook goes in
    assert failfast.install({"HARMPI_SLOT_BYTES": "63"})
    hook = sys.excepthook
    assert isinstance(hook, failfast.AbortHook) and hook.previous is sys.__excepthook__
    assert failfast.install({}) and sys.excepthook is hook
    assert sys.exit is builtin_exit  # never rebound


RUN_SCRIPT = """
import os, sys
print("name", __name__, "argv", sys.argv[1:], "path0", sys.path[0] == os.path.dirname(
    os.path.realpath(__file__)) if "__file__" in globals() else sys.path[0], flush=True)
if sys.argv[1:2] == ["fail"]:
    raise RuntimeError("the program fails")
sys.exit(int(sys.argv[2]) if sys.argv[1:2] == ["exit"] else 0)
"""


@pytest.mark.parametrize("how", ["script", "module", "command"])
def test_the_runner_runs_a_program_as_python_would(tmp_path, how):
    """``python -m harmpi.run`` outside a job: the program's name, argv and
    sys.path[0] as under ``python``, its status, one traceback without the
    runner's frames (no job: Python reports it)."""
    (tmp_path / "prog.py").write_text(RUN_SCRIPT)
    program = {"script": [str(tmp_path / "prog.py")], "module": ["-m", "prog"],
               "command": ["-c", RUN_SCRIPT]}[how]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(tmp_path)]))
    for name in list(env):
        if name.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_")):
            del env[name]

    def run(*args):
        return subprocess.run([sys.executable, "-m", "harmpi.run", *program, *args], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)

    ok = run("a", "b")
    assert ok.returncode == 0, ok.stderr[-3000:]
    path0 = {"script": "True", "module": "True", "command": ""}[how]
    assert ok.stdout.split("\n")[0] == f"name __main__ argv ['a', 'b'] path0 {path0}"
    assert run("exit", "3").returncode == 3
    failed = run("fail")
    assert failed.returncode == 1
    assert failed.stderr.count("Traceback (most recent call last)") == 1, failed.stderr
    assert "RuntimeError: the program fails" in failed.stderr
    bad = subprocess.run([sys.executable, "-m", "harmpi.run"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 1 and "usage: python -m harmpi.run" in bad.stderr


def test_config_reads_the_switch():
    assert Config.from_env({}).abort_on_exception is True
    assert Config.from_env({"HARMPI_ABORT_ON_EXCEPTION": "off"}).abort_on_exception is False
    with pytest.raises(HarmpiArgumentError, match="HARMPI_ABORT_ON_EXCEPTION"):
        Config.from_env({"HARMPI_ABORT_ON_EXCEPTION": "maybe"})
