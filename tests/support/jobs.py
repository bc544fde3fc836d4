"""Whole ``mpirun`` jobs started by the unit tests, written once.

The mpirun and Open MPI's settings are the launcher's (launch/mpienv.py);
this module adds what the tests need on top: a skip when there is no
mpirun, the checkout on PYTHONPATH, the job's command line (more ranks than
cores, unbound), time limits that follow the machine's load, and runners.

* :func:`job_env`, :func:`job_argv`: any job.
* :func:`run_module`: a module of bench/ (or a rank program of
  tests/support) as ``make demo`` runs one (bench.demo.mpirun_argv).
* :func:`job_script`, :func:`run_job`: a script body on ``np`` ranks with
  Open MPI's shared-memory files in a directory of the test's own, checked
  empty afterwards; the job is killed when it outlives :func:`job_limit_s`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Iterable, Mapping, Sequence

import pytest

from launch.errors import MpiNotFoundError
from launch.mpienv import find_mpirun, mpi_env

from . import REPO

__all__ = [
    "JOB_LIMIT_MAX_S",
    "RESOURCE_USAGE",
    "SHM_VARIABLES",
    "STARTUP_PER_RANK_S",
    "STARTUP_S",
    "job_argv",
    "job_env",
    "job_limit_s",
    "job_script",
    "mpirun_or_skip",
    "run_job",
    "run_module",
    "shm_env",
]

#: Open MPI's shared-memory backing files go to the job's own directory
SHM_VARIABLES = ("OMPI_MCA_btl_sm_backing_directory", "OMPI_MCA_osc_sm_backing_directory")


def mpirun_or_skip() -> str:
    """launch's mpirun (beside this Python, else on PATH); the test skips without one."""
    try:
        return find_mpirun()
    except MpiNotFoundError as exc:
        pytest.skip(str(exc))


def job_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment, plus Open MPI's settings (launch.mpienv;
    the caller's values win), the checkout on PYTHONPATH, then ``extra``."""
    return mpi_env(extra={"PYTHONPATH": str(REPO), **(extra or {})})


def job_argv(np: int, command: Sequence[str], *, forward: Iterable[str] = (),
             mpirun: str | None = None) -> list[str]:
    """``mpirun -np NP --map-by :OVERSUBSCRIBE --bind-to none -x NAME... COMMAND``:
    more ranks than cores is the point of many tests, so no binding. Pure
    when ``mpirun`` is given."""
    argv = [mpirun or mpirun_or_skip(), "-np", str(np), "--map-by", ":OVERSUBSCRIBE",
            "--bind-to", "none"]
    for name in forward:
        argv += ["-x", name]
    return argv + list(command)


def run_module(np: int, module: str, args: Sequence[str], *,
               env: Mapping[str, str] | None = None,
               timeout_s: float = 150) -> subprocess.CompletedProcess:
    """``python -m mpi4py -m MODULE ARGS`` on ``np`` ranks from the checkout,
    with the command line ``make demo`` gives its jobs; output captured."""
    from bench.demo import mpirun_argv  # bench/ is imported only by the tests that run it

    argv = mpirun_argv(np, module, args, mpirun=mpirun_or_skip())
    return subprocess.run(argv, env=job_env(env), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s)


def shm_env(tmp_path, extra: Mapping[str, str] | None = None):
    """(:func:`job_env` with Open MPI's shared-memory files in ``tmp_path/shm``,
    that directory)."""
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    env = job_env({**{name: str(shm) for name in SHM_VARIABLES}, **(extra or {})})
    return env, shm


def job_script(tmp_path, body: str, np: int = 2, mpi4py_main: bool = False,
               extra_env: Mapping[str, str] | None = None, runner: bool = False):
    """(argv, env, shm dir) of an mpirun job running ``body`` on ``np`` ranks
    (under ``python -m mpi4py`` or harmpi's runner ``python -m harmpi.run`` if
    asked), as ``job.py TMP_PATH``."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    env, shm = shm_env(tmp_path, extra_env)
    starter = ["-m", "mpi4py"] if mpi4py_main else ["-m", "harmpi.run"] if runner else []
    argv = job_argv(np, [sys.executable, *starter, str(script), str(tmp_path)],
                    forward=[*SHM_VARIABLES, "PYTHONPATH", *(extra_env or {})])
    return argv, env, shm


# Job-script text (four spaces in, as the job bodies): usage() gives this
# rank's (RSS MB, open fds, mappings, files in the job's shm directory
# ``shm``), what the create/destroy cycle jobs compare before and after. RSS
# is read with the allocator's free memory given back: glibc keeps freed heap
# (the dynamic mmap threshold puts later buffers on the heap, where they
# fragment), so unsettled RSS rises 20-40 MB over the first few hundred
# torch group cycles at 2 x 1 and creeps on, while malloc_trim brings it back
# to within 3 MB of the start (by hand, 800 cycles: 417 -> 488 MB as read,
# 420 MB trimmed; live Python objects flat): memory still held survives it.
RESOURCE_USAGE = """\
    def usage():
        import ctypes, gc
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        pages = int(open("/proc/self/statm").read().split()[1])
        return (pages * os.sysconf("SC_PAGE_SIZE") >> 20, len(os.listdir("/proc/self/fd")),
                sum(1 for _ in open("/proc/self/maps")), len(os.listdir(shm)))
"""


#: what a job's start-up (python, torch, harmpi and the numba cache in every
#: rank) may take on a 2-core machine with nothing else running (~3x what
#: it takes here): a fixed part and a part per rank
STARTUP_S, STARTUP_PER_RANK_S = 20.0, 10.0

#: the longest :func:`job_limit_s` gives
JOB_LIMIT_MAX_S = 200.0


def job_limit_s(work_s: float, np: int = 2) -> float:
    """Seconds a job of ``np`` ranks may run when its ranks wait ``work_s``
    seconds in all (their sleeps and deadlines, or their loops at a quiet
    machine's speed): its start-up, then twice its work, times the runnable
    processes per CPU when it starts (at least 1: on a loaded machine every
    part of the job slows down by about that much). A job that hangs (the
    bugs these tests guard against wait forever, or until a deadline far
    longer than the work) fails then, instead of after a fixed 300 s.
    At most :data:`JOB_LIMIT_MAX_S`, under the pytest timeouts of the job
    files (240 s and more), so that run_job, not pytest, ends the job."""
    busy = max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    return min(JOB_LIMIT_MAX_S, (STARTUP_S + STARTUP_PER_RANK_S * np + 2.0 * work_s) * busy)


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def run_job(tmp_path, body: str, work_s: float, **kw) -> subprocess.CompletedProcess:
    """Runs the job of :func:`job_script`; fails if it outlives :func:`job_limit_s`
    (the whole job is killed then) or leaves shared memory behind."""
    argv, env, shm = job_script(tmp_path, body, **kw)
    limit_s = job_limit_s(work_s, kw.get("np", 2))
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # mpirun and the ranks it started
        out, err = proc.communicate()
        pytest.fail(f"the job still ran after {time.monotonic() - t0:.0f} s (limit "
                    f"{limit_s:.0f} s: start-up, then twice its {work_s} s of work, times "
                    f"the load per CPU)\n"
                    f"stdout: {_text(out)[-2000:]}\nstderr: {_text(err)[-2000:]}")
    assert os.listdir(shm) == [], "shared memory left behind"
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
