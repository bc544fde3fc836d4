"""Kernels compile over the host's cores (issue 36): workers share a cold
numba cache (harmpi.runtime.compilepool), and what they leave loads in a fresh
process without one compile, with every signature's own machine code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import REPO

from harmpi.runtime import compilenote, compilepool

#: a package of kernels shaped like harmpi's: explicit signatures (six on one
#: kernel, so workers save six entries of one index at once), a lazily typed
#: helper those call, a kernel calling another module's explicit kernel, a
#: cfunc whose address and a get_overload are read at import, and a step of
#: compile_all that calls a lazily typed kernel from Python
KERNELS_A = '''
import numba

@numba.njit(cache=True)
def twice(x):
    return x + x

@numba.njit("int64(int64)", cache=True)
def plus_one(x):
    return twice(x) // 2 + 1

@numba.njit(["int8(int8)", "int16(int16)", "int32(int32)", "int64(int64)", "float32(float32)",
             "float64(float64)"], cache=True)
def doubled(x):
    return twice(x)
'''

KERNELS_B = '''
import numba
from kernpkg import a

@numba.njit("float64(float64)", cache=True)
def both(x):
    return a.doubled(x) + a.plus_one(3)

@numba.cfunc("float64(float64)", cache=True)
def both_c(x):
    return both(x)

BOTH = both.get_overload((numba.float64,))
ADDRESS = both_c.address
'''

#: (a module that imports no kernel module itself: its importer would compile
#: them before compile_once starts)
BUILD = '''
def compile_all(claim=None):
    from kernpkg import a, b  # noqa: F401
    if claim is None or claim("lazy"):
        a.twice(1.5)
'''

#: the parent: harmpi made importable without its __init__ (which would
#: compile harmpi's own kernels into this test's cache), as compilepool does
PARENT = '''
import json, sys, types
from pathlib import Path
pkg = types.ModuleType("harmpi")
pkg.__path__ = [{harmpi!r}]
sys.modules["harmpi"] = pkg
from harmpi.runtime import compilenote
from kernpkg import build
how = compilenote.compile_once(build.compile_all, Path({pkg!r}), Path({cache!r}), processes={n})
print(json.dumps({{"how": how}}))
'''

#: a fresh process on the cache the workers left: counts numba's compiles
FRESH = '''
import ctypes, json, numpy as np
from numba.core import event
compiles = []

class Count(event.Listener):
    def on_start(self, ev):
        compiles.append(ev.data["dispatcher"].py_func.__qualname__)
    def on_end(self, ev):
        pass

event.register("numba:compile", Count())
from kernpkg import a, b, build
build.compile_all()
values = [repr(a.doubled(t(3))) for t in (np.int8, np.int16, np.int32, np.int64, np.float32,
                                           np.float64)]
c = ctypes.CFUNCTYPE(ctypes.c_double, ctypes.c_double)(b.ADDRESS)
print(json.dumps({"compiles": compiles, "values": values, "plus_one": int(a.plus_one(4)),
                  "both": b.BOTH(0.25), "cfunc": c(0.25), "cfunc_loaded": b.both_c._cache_hits}))
'''


def _package(tmp_path):
    pkg = tmp_path / "kernpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(KERNELS_A)
    (pkg / "b.py").write_text(KERNELS_B)
    (pkg / "build.py").write_text(BUILD)
    return pkg


def _run(tmp_path, script, timeout=240, env=None):
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "NUMBA_CACHE_DIR": str(tmp_path / "cache"),
           **(env or {})}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.timeout(300)
def test_workers_fill_a_cold_cache_that_loads_without_a_compile(tmp_path):
    pkg = _package(tmp_path)
    cache = tmp_path / "cache"
    out, err = _run(tmp_path, PARENT.format(harmpi=str(REPO / "harmpi"), pkg=str(pkg),
                                            cache=str(cache), n=3))
    assert out["how"] == "compiled", err
    record = json.loads(next(cache.rglob(compilenote.RECORD)).read_text())
    # every kernel compiled in a worker: the parent only loaded them
    assert record["processes"] == 3 and record["worker_failures"] == 0, (record, err)
    assert record["kernels"] >= 9 and record["compiled_here"] == 0, (record, err)
    assert err.count("compiling harmpi kernels") == 1, err  # said once, with the estimate
    assert "3 processes" in err and "harmpi kernels compiled in" in err, err
    assert not list(cache.glob("harmpi-kernels.run.*"))  # the run's directory is gone

    fresh, err = _run(tmp_path, FRESH)
    assert fresh["compiles"] == [], err  # all in the cache, the lazily typed step's too
    assert fresh["cfunc_loaded"] == 1
    # each of the six signatures saved at once into one index has its own code
    assert fresh["values"] == ["6", "6", "6", "6", "6.0", "6.0"]
    assert fresh["plus_one"] == 5 and fresh["both"] == fresh["cfunc"] == 0.5 + 4


def test_a_worker_that_fails_leaves_the_compile_to_its_parent(tmp_path):
    """A compile function a worker cannot import (a script's own): the
    workers fail, say so, and the parent compiles every kernel itself."""
    pkg = _package(tmp_path)
    cache = tmp_path / "cache"
    script = PARENT.format(harmpi=str(REPO / "harmpi"), pkg=str(pkg), cache=str(cache), n=2)
    script = script.replace("build.compile_all, Path", "compile_all, Path").replace(
        "from kernpkg import build", "from kernpkg.build import compile_all\n"
        "compile_all.__module__ = 'kernpkg.nowhere'")
    out, err = _run(tmp_path, script)
    assert out["how"] == "compiled"
    assert err.count("a kernel compile worker failed") == 2 and "kernpkg.nowhere" in err, err
    record = json.loads(next(cache.rglob(compilenote.RECORD)).read_text())
    assert record["worker_failures"] == 2 and record["compiled_here"] == record["kernels"] > 0
    fresh, err = _run(tmp_path, FRESH)
    assert fresh["compiles"] == [] and fresh["plus_one"] == 5, err


#: a compile function whose workers never finish (and say who they are)
BUILD_HANGS = '''
import os, time


def compile_all(claim=None):
    from kernpkg import a, b  # noqa: F401
    if claim is not None:  # a worker
        open(os.path.join(os.environ["WORKER_PIDS"], str(os.getpid())), "w").close()
        time.sleep(600)
'''


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


@pytest.mark.timeout(200)
def test_workers_past_their_deadline_are_ended_and_the_parent_compiles(tmp_path):
    """No process waits forever on a worker: past WORKER_DEADLINE_S the
    workers are ended, said so, and their parent compiles what is missing."""
    pkg = _package(tmp_path)
    (pkg / "build.py").write_text(BUILD_HANGS)
    (tmp_path / "pids").mkdir()
    script = PARENT.format(harmpi=str(REPO / "harmpi"), pkg=str(pkg),
                           cache=str(tmp_path / "cache"), n=2).replace(
        "from kernpkg import build", "from kernpkg import build\n"
        "from harmpi.runtime import compilepool\ncompilepool.WORKER_DEADLINE_S = 5.0")
    t0 = time.monotonic()
    out, err = _run(tmp_path, script, env={"WORKER_PIDS": str(tmp_path / "pids")})
    assert out["how"] == "compiled" and time.monotonic() - t0 < 120, err
    assert "workers still running after 5 s: ended" in err, err
    assert all(_gone(int(p.name)) for p in (tmp_path / "pids").iterdir())
    fresh, err = _run(tmp_path, FRESH)
    assert fresh["compiles"] == [] and fresh["plus_one"] == 5, err


@pytest.mark.timeout(200)
def test_workers_die_with_their_parent(tmp_path):
    """A killed parent (its host lock then goes to a waiting rank, which
    starts workers of its own) leaves no worker writing to the cache, and
    the next compile clears what it left."""
    pkg = _package(tmp_path)
    (pkg / "build.py").write_text(BUILD_HANGS)
    pids = tmp_path / "pids"
    pids.mkdir()
    script = PARENT.format(harmpi=str(REPO / "harmpi"), pkg=str(pkg),
                           cache=str(tmp_path / "cache"), n=2)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "NUMBA_CACHE_DIR": str(tmp_path / "cache"),
           "WORKER_PIDS": str(pids)}
    parent = subprocess.Popen([sys.executable, "-c", script], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 150
        while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = [int(p.name) for p in pids.iterdir()]
        assert len(workers) == 2
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in workers)
    # the next process to take the host lock clears the dead run's directory and
    # finds every kernel the dead workers saved (they hung after compile_all's imports)
    cache = tmp_path / "cache"
    assert len(list(cache.glob(compilepool.RUN_PREFIX + "*"))) == 1
    (pkg / "build.py").write_text(BUILD)
    out, err = _run(tmp_path, script)
    assert out["how"] == "loaded" and not list(cache.glob(compilepool.RUN_PREFIX + "*")), err
    fresh, err = _run(tmp_path, FRESH)
    assert fresh["compiles"] == [] and fresh["plus_one"] == 5, err


def test_the_estimate_shares_the_cpu_seconds_among_processes():
    # 60 s of CPU over 4 processes on 8 idle CPUs: each has a CPU
    s, how = compilenote.estimate({"most_cpu_s": 60.0}, load1=0.0, cpus=8, processes=4)
    assert s == 15.0 and how.endswith("load 0.0 on 8 CPUs, 4 processes")
    # a load of 4 on 4 CPUs: 8 runnable processes on 4 CPUs, each gets half of one
    s, _ = compilenote.estimate({"most_cpu_s": 60.0}, load1=4.0, cpus=4, processes=4)
    assert s == 30.0
    # 16 idle CPUs: the longest chain of kernels, not a 16th of the seconds
    s, _ = compilenote.estimate({"most_cpu_s": 100.0}, load1=0.0, cpus=16, processes=16)
    assert s == 100.0 * compilenote.CHAIN_SHARE > 100.0 / 16


def test_host_cpus_counts_the_host_not_a_binding():
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(mine)})  # a rank bound to one core
        assert compilepool.host_cpus() == len(mine)
        assert os.sched_getaffinity(0) == {min(mine)}  # and left as it was
        assert 1 <= compilepool.workers_here() <= min(len(mine), compilepool.MAX_PROCESSES)
        # the CPUs the load leaves idle, rounded up; a busy host compiles in one process
        assert compilepool.workers_here(load1=len(mine) - 0.5) == 1
        assert compilepool.workers_here(load1=100.0) == 1
    finally:
        os.sched_setaffinity(0, mine)


#: the package whose kernels a seeded copy of harmpi lacks: explicit signatures,
#: a cfunc and get_overload at import, a warm-up step of lazily typed kernels
#: (~7 s of CPU, against ~80 for every kernel)
COLD = "algorithms/alltoall/"


def _seeded_copy(tmp_path) -> Path:
    """A copy of harmpi (sources with their mtimes) whose numba cache holds
    the checkout's for every module but COLD's: numba keys its cache on a
    source's mtime and size, and this module's ``import harmpi`` has just
    made the checkout's cache warm. No record: a cold cache to harmpi."""
    src, dst = REPO / "harmpi", tmp_path / "copy" / "harmpi"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for py in src.rglob("*.py"):
        if str(py.relative_to(src)).startswith(COLD):
            continue
        for cached in (py.parent / "__pycache__").glob(f"{py.stem}.*.nb[ic]"):
            target = dst / py.parent.relative_to(src) / "__pycache__" / cached.name
            target.parent.mkdir(exist_ok=True)
            shutil.copy2(cached, target)
    return dst


def _copy_env(base, copy: Path) -> dict:
    env = {**base, "PYTHONPATH": str(copy.parent)}
    env.pop("NUMBA_CACHE_DIR", None)
    return env


def _counted_import(env: dict) -> dict:
    fresh = subprocess.run([sys.executable, "-c", COUNTED_IMPORT], env=env, capture_output=True,
                           text=True, timeout=300, cwd=env["PYTHONPATH"])
    assert fresh.returncode == 0, fresh.stderr
    return json.loads(fresh.stdout.strip().splitlines()[-1])


#: compile_once over two workers for harmpi itself, in a process that (like
#: a worker) has the package without its __init__ and MPI not initialised
HARMPI_PARENT = '''
import json, sys, types
from pathlib import Path
import mpi4py
mpi4py.rc.initialize = mpi4py.rc.finalize = False
pkg = types.ModuleType("harmpi")
pkg.__path__ = [{harmpi!r}]
sys.modules["harmpi"] = pkg
from harmpi.runtime import compilenote
how = compilenote.compile_once(compilenote.compile_all, Path({harmpi!r}), processes=2)
print(json.dumps({{"how": how}}))
'''


@pytest.mark.timeout(600)
def test_workers_compile_harmpis_own_kernels(tmp_path):
    """harmpi's kernels through two workers (the package imported without
    its __init__, mpi4py loaded without MPI): they leave the parent nothing
    to compile, and a fresh ``import harmpi`` nothing either."""
    copy = _seeded_copy(tmp_path)
    env = _copy_env(os.environ, copy)
    done = subprocess.run([sys.executable, "-c", HARMPI_PARENT.format(harmpi=str(copy))],
                          env=env, capture_output=True, text=True, timeout=500, cwd=copy.parent)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["how"] == "compiled", done.stderr
    record = json.loads((copy / "runtime" / "__pycache__" / compilenote.RECORD).read_text())
    assert record["processes"] == 2 and record["worker_failures"] == 0, (record, done.stderr)
    assert record["compiled_here"] == 0 < record["kernels"], record
    assert _counted_import(env) == {"how": "warm", "compiles": []}


HARMPI_JOB = '''
import json, time
t0 = time.monotonic()
import harmpi
from harmpi.runtime import compilenote
print(json.dumps({"how": compilenote.outcome, "s": time.monotonic() - t0}))
'''


@pytest.mark.timeout(900)
def test_two_ranks_import_harmpi_on_a_cold_cache(tmp_path, mpirun, mpi_env):
    """Two ranks of a job import harmpi at once on a cold cache: one
    compiles (over the CPUs the load leaves idle, else by itself), the
    other waits; then a fresh process imports harmpi and runs every lazily
    typed kernel without one compile."""
    copy = _seeded_copy(tmp_path)
    env = _copy_env(mpi_env, copy)
    t0 = time.monotonic()
    job = subprocess.run([mpirun, "-np", "2", "--map-by", ":OVERSUBSCRIBE", "--bind-to", "none",
                          "-x", "PYTHONPATH", sys.executable, "-c", HARMPI_JOB],
                         env=env, capture_output=True, text=True, timeout=800, cwd=copy.parent)
    wall_s = time.monotonic() - t0
    assert job.returncode == 0, job.stdout + job.stderr
    ranks = sorted(json.loads(line)["how"] for line in job.stdout.splitlines()
                   if line.startswith("{"))
    assert ranks == ["compiled", "waited"], job.stdout + job.stderr
    record = json.loads((copy / "runtime" / "__pycache__" / compilenote.RECORD).read_text())
    assert record["worker_failures"] == 0, record
    assert "harmpi kernels compiled in" in job.stderr, job.stderr
    print(f"2 ranks, {COLD} cold: {wall_s:.0f} s; {json.dumps(record)[:300]}")
    assert _counted_import(env) == {"how": "warm", "compiles": []}


COUNTED_IMPORT = '''
import json
from numba.core import event
compiles = []

class Count(event.Listener):
    def on_start(self, ev):
        compiles.append(ev.data["dispatcher"].py_func.__qualname__)
    def on_end(self, ev):
        pass

event.register("numba:compile", Count())
import harmpi
from harmpi.runtime import compilenote
compilenote.compile_all()  # the lazily typed kernels too
print(json.dumps({"how": compilenote.outcome, "compiles": compiles}))
'''
