"""A job started by ``harmpi-launch`` ends with the launcher (issue 35, finding 10).

Real 2-rank jobs that all-reduce in a loop: the launcher is killed (SIGKILL:
its mpirun must not outlive it), or stopped (SIGTERM, SIGINT: exit 128 + the
signal, one line saying so), or its mpirun is killed (SIGKILL: the launcher
ends the ranks mpirun left and removes their Open MPI files). Afterwards no
process of the job (matched by the job's directory in its argv) and none of
the job's shared-memory files (what its ranks had mapped from /dev/shm) may
be left. Plus: the cross-node transport is logged once per process, however
many communicators pick it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from support import REPO
from support.jobs import job_limit_s, run_job

from launch.errors import MpiNotFoundError
from launch.mpi import find_mpi
from launch.runner import GRACE_S, Finished, run_mpirun

# Each rank writes the /dev/shm files it maps (Open MPI's sm_segment.*, and
# harmpi's own) to DIR/rankR.maps once the first all-reduce is done, then
# all-reduces until it is stopped (or for 300 s: no test waits that long).
LOOP = """
import os, sys, time, torch, harmpi
from mpi4py import MPI
rank = MPI.COMM_WORLD.rank
x = torch.ones(1024)
harmpi.allreduce(x)
maps = {line.split(None, 5)[5].split(" (deleted)")[0].strip()
        for line in open("/proc/self/maps") if "/dev/shm/" in line}
with open(os.path.join(sys.argv[1], f"rank{rank}.part"), "w") as fh:
    fh.write("".join(m + "\\n" for m in sorted(maps)))
os.rename(os.path.join(sys.argv[1], f"rank{rank}.part"),
          os.path.join(sys.argv[1], f"rank{rank}.maps"))
end = time.monotonic() + 300
while time.monotonic() < end:
    harmpi.allreduce(x)
    time.sleep(0.01)
"""

#: how long the job may take to go once the launcher is killed or stopped
#: (0.5-2.3 s on a quiet machine; generous for a loaded 2-core one)
END_S = 60.0
#: how long the ranks may take to start looping: a few seconds with a warm
#: numba cache; a cold one (harmpi's sources changed) compiles for minutes
#: on a loaded 2-core machine
START_S = 360.0


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PRTE_", "PMIX_", "HARMPI_", "OMP_", "GOMP_", "KMP_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMPI_MCA_mpi_yield_when_idle"] = "1"  # more ranks than free cores here
    return env


def _job_pids(marker: str) -> list[str]:
    """Processes (mpirun/prterun, ranks) with ``marker`` in their command line."""
    found = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout
    return [line for line in found.splitlines() if line.strip()]


def _start(tmp_path):
    """(launcher process, job directory): the loop job on 2 ranks, started by
    ``python -m launch``; returns once both ranks loop, with their shm files."""
    try:
        find_mpi()
    except MpiNotFoundError as exc:
        pytest.skip(str(exc))
    pytest.importorskip("mpi4py")
    job = tmp_path / "job"
    job.mkdir()
    script = job / "loop.py"
    script.write_text(LOOP)
    options = ["-np", "2", "--no-spin"]
    if len(os.sched_getaffinity(0)) < 2:
        options.append("--oversubscribe")
    out = open(tmp_path / "launcher.out", "wb")
    err = open(tmp_path / "launcher.err", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch", *options, "--", sys.executable, str(script), str(job)],
        cwd=REPO, env=_env(tmp_path), stdout=out, stderr=err)
    limit_s = max(START_S, job_limit_s(10.0))
    deadline = time.monotonic() + limit_s
    while not all((job / f"rank{r}.maps").exists() for r in (0, 1)):
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill_job(proc, job)
            pytest.fail(f"the job did not loop within {limit_s:.0f} s (exit {proc.poll()}):\n"
                        f"{_text(tmp_path)}")
        time.sleep(0.2)
    return proc, job


@pytest.fixture
def loop_job(tmp_path):
    """(launcher process, job directory) of the loop job once both ranks loop;
    what the test leaves of the job (when it fails) is killed afterwards."""
    proc, job = _start(tmp_path)
    yield proc, job
    if proc.poll() is None or _job_pids(str(job)):
        _kill_job(proc, job)


def _text(tmp_path) -> str:
    return "".join(f"{name}: {(tmp_path / name).read_text(errors='replace')[-3000:]}\n"
                   for name in ("launcher.out", "launcher.err"))


def _kill_job(proc, job) -> None:
    """A failed test leaves nothing behind: the launcher, what matches the
    job's directory, then the shared memory its ranks had mapped."""
    proc.kill()
    proc.wait()
    for line in _job_pids(str(job)):
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(1.0)  # the killed ranks release their files
    for name in _shm_files(job):
        if name.startswith("/dev/shm/"):
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass


def _shm_files(job) -> list[str]:
    """The /dev/shm files the job's ranks had mapped (of the ranks that said)."""
    files = set()
    for maps in job.glob("rank*.maps"):
        files.update(line for line in maps.read_text().splitlines() if line)
    return sorted(files)


def _wait_job_gone(job, t0: float) -> float:
    """Seconds from ``t0`` until no process of the job is left; fails after END_S."""
    marker = str(job)
    while True:
        left = _job_pids(marker)
        if not left:
            return time.monotonic() - t0
        if time.monotonic() - t0 > END_S:
            pytest.fail(f"{END_S:.0f} s after the signal the job still runs:\n"
                        + "\n".join(left))
        time.sleep(0.2)


@pytest.mark.timeout(600)
def test_a_killed_launcher_takes_its_job_with_it(tmp_path, loop_job):
    proc, job = loop_job
    shm = _shm_files(job)
    assert any("sm_segment" in name for name in shm), shm  # what used to be left
    t0 = time.monotonic()
    proc.kill()  # SIGKILL: the launcher can forward nothing
    proc.wait()
    gone_s = _wait_job_gone(job, t0)
    left = [name for name in shm if os.path.exists(name)]
    assert left == [], f"the job's shared memory is left behind: {left}"
    print(f"job gone {gone_s:.1f} s after SIGKILL to the launcher")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_launcher_exits_128_plus_the_signal(tmp_path, loop_job, sig):
    proc, job = loop_job
    shm = _shm_files(job)
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        rc = proc.wait(timeout=END_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the launcher still ran {END_S:.0f} s after {sig.name}:\n{_text(tmp_path)}")
    ended_s = time.monotonic() - t0
    assert rc == 128 + sig, _text(tmp_path)
    err = (tmp_path / "launcher.err").read_text(errors="replace").strip().splitlines()
    assert err[-1] == f"python -m launch: job stopped by {sig.name} (exit {128 + sig})", err
    _wait_job_gone(job, t0)
    left = [name for name in shm if os.path.exists(name)]
    assert left == [], f"the job's shared memory is left behind: {left}"
    print(f"launcher exit {rc} {ended_s:.1f} s after {sig.name}")


@pytest.mark.timeout(600)
def test_a_killed_mpirun_leaves_nothing_behind(tmp_path, loop_job):
    proc, job = loop_job
    shm = _shm_files(job)
    mpirun = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                            text=True).stdout.split()
    assert len(mpirun) == 1, mpirun
    t0 = time.monotonic()
    os.kill(int(mpirun[0]), signal.SIGKILL)  # the ranks outlived it, and their files
    try:
        rc = proc.wait(timeout=END_S + 2 * GRACE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the launcher still ran {END_S:.0f} s after its mpirun was killed")
    assert rc == 128 + signal.SIGKILL, _text(tmp_path)
    err = (tmp_path / "launcher.err").read_text(errors="replace").strip().splitlines()
    assert "mpirun ended with status 137 and left 2 process(es) of the job" in err[-1], err
    assert "ended them and removed 2 Open MPI shared-memory file(s)" in err[-1], err
    gone_s = _wait_job_gone(job, t0)
    left = [name for name in shm if os.path.exists(name)]
    assert left == [], f"the job's shared memory is left behind: {left}"
    # PRRTE's session directory, which the killed mpirun could not remove
    session = os.path.join(tempfile.gettempdir(), f"ompi.{mpirun[0]}")
    assert not os.path.exists(session), f"mpirun's session directory is left: {session}"
    assert f"removed its session directory {session}" in err[-1], err
    print(f"job gone {gone_s:.1f} s after SIGKILL to mpirun: {err[-1]}")


def test_what_a_killed_mpirun_leaves_is_ended_and_removed(tmp_path):
    """The same without MPI: a fake mpirun starts a child (in its session)
    that maps an ``sm_segment.*`` file, then is SIGKILLed."""
    segment, ready = tmp_path / "sm_segment.fake.0", tmp_path / "ready"
    child = ("import mmap, sys, time; f = open(sys.argv[1], 'w+b'); f.truncate(4096); "
             "m = mmap.mmap(f.fileno(), 4096); open(sys.argv[2], 'w').close(); time.sleep(300)")
    fake = tmp_path / "mpirun"
    fake.write_text(f"""#!/bin/sh
"{sys.executable}" -c "{child}" {segment} {ready} &
while [ ! -f {ready} ]; do sleep 0.05; done
kill -KILL $$
""")
    fake.chmod(0o755)
    finished = run_mpirun([str(fake)], dict(os.environ))
    assert finished.mpirun_status == 128 + signal.SIGKILL
    assert finished.stopped_by is None and finished.exit_status == 137
    assert len(finished.ended) == 1 and finished.removed == (str(segment),)
    assert not segment.exists()
    assert _job_pids(str(segment)) == []
    assert run_mpirun(["true"], dict(os.environ)) == Finished(0)  # nothing to end


# --- the cross-node transport is logged once per process -------------------------

GROUPS = 5
LOG_JOB = f"""
    import logging, torch, harmpi
    from mpi4py import MPI
    logging.basicConfig(level=logging.DEBUG, format="LOG %(levelname)s %(message)s")
    x = torch.ones(64)
    comms = [MPI.COMM_WORLD.Dup() for _ in range({GROUPS})]
    for comm in [MPI.COMM_WORLD, *comms]:
        harmpi.allreduce(x, comm=comm)
    print("sum", float(x[0]), flush=True)
    harmpi.finalize()
"""


@pytest.mark.timeout(300)
def test_cross_node_transport_is_logged_once_per_process(tmp_path):
    proc = run_job(tmp_path, LOG_JOB, work_s=10.0, mpi4py_main=True,
                   extra_env={"HARMPI_TRANSPORT": "tcp", "HARMPI_RANKS_PER_NODE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(f"sum {2.0 ** (GROUPS + 1)}") == 2, proc.stdout
    lines = [line for line in proc.stderr.splitlines() if "cross-node transport: tcp" in line]
    # one per rank: INFO on rank 0, DEBUG on rank 1 (was one per communicator each)
    assert sorted(line.split()[1] for line in lines) == ["DEBUG", "INFO"], proc.stderr[-3000:]


def test_announce_logs_each_choice_once(caplog):
    pytest.importorskip("mpi4py")
    from harmpi import transports

    marker = f"test-{os.getpid()}-{time.monotonic_ns()}"  # a reason no other test logs
    with caplog.at_level(logging.DEBUG, logger="harmpi.transports"):
        for rank in (0, 0, 0, 1, 1):
            transports.announce("tcp", marker, rank)
        transports.announce("mpi", marker, 0)
    got = [(r.levelno, r.getMessage()) for r in caplog.records if marker in r.getMessage()]
    assert got == [(logging.INFO, f"cross-node transport: tcp ({marker})"),
                   (logging.DEBUG, f"cross-node transport: tcp ({marker})"),
                   (logging.INFO, f"cross-node transport: mpi ({marker})")]
