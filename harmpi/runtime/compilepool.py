"""harmpi's kernels compiled by several processes at once, one per CPU.

harmpi.runtime.compilenote runs :func:`compile_parallel` on a cold numba cache,
holding its host lock (so no other compile of that cache runs meanwhile).
Each worker process runs compile_all, and the kernels are handed out as
they come:

1. each signature of a kernel compiled at its decoration (an explicit
   signature, a cfunc) is compiled by the first worker that claims it (a
   file created with O_EXCL in the run's directory); every other worker
   defers it and moves on to the next one;
2. a deferred kernel is compiled for real (its declared signatures, then
   closed to others, as its decorator does) when something in that worker
   needs it: a caller's typing, a call, its address. Then its claimer has
   usually saved it, and this worker loads it;
3. one compile of a kernel for one signature runs at a time on the host
   (an flock per kernel and signature in ``harmpi-kernels.locks/``): a
   worker that needs what another is compiling waits for it and loads it.
   Locks are taken along call chains, caller before callee, so they
   cannot deadlock;
4. numba's index of a kernel's signatures is read and written under an
   flock of its own, held only for that: the index names data files by a
   count, so two signatures saved at once by two processes could leave
   one's entry naming the other's machine code;
5. compile_all's steps that call lazily typed kernels from Python are
   claimed the same way (its ``claim(name)``).

The deferral lives in the worker processes only (it patches numba's
dispatcher there). The process that started them then runs compile_all
itself, unpatched: it loads every kernel from the cache and compiles
whatever a worker did not (a worker that failed is reported, not fatal).
A worker is started without running the package's ``__init__`` (``import
harmpi`` initialises MPI, and would wait on the host lock its parent
holds) and dies with its parent.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import importlib
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from numba.core import event

__all__ = ["LOCKS", "RUN_PREFIX", "WORKER_DEADLINE_S", "MAX_PROCESSES", "WORKER_MB", "host_cpus",
           "workers_here", "compile_parallel", "worker"]

#: the directory, beside the cache's record, of one lock file per kernel and signature
LOCKS = "harmpi-kernels.locks"
#: a compile's own directory (claims, the workers' figures), removed at its end
RUN_PREFIX = "harmpi-kernels.run."
#: a worker still running after this long is ended, and its share compiled
#: by its parent (a full compile takes ~80 s of CPU)
WORKER_DEADLINE_S = 1800.0
#: at most this many workers: the longest chain of kernels that must compile one
#: after another (a caller after its callees) is ~13% of harmpi's compile CPU
#: seconds, so beyond ~8 workers the gain is small
MAX_PROCESSES = 16
#: the memory a worker may take at its peak (measured: 531 MB, numba 0.68)
WORKER_MB = 600

#: a worker's start: the package importable without its __init__, and
#: mpi4py, if a kernel module imports it, loading MPI without initialising it
_BOOT = """
import sys, types
try:
    import mpi4py
    mpi4py.rc.initialize = mpi4py.rc.finalize = False
except ImportError:
    pass
pkg = types.ModuleType({name!r})
pkg.__path__, pkg.__file__ = [{path!r}], {init!r}
sys.modules[{name!r}] = pkg
from {name}.runtime.compilepool import worker
sys.exit(worker(sys.argv[1:]))
"""


def host_cpus() -> int:
    """The CPUs this host lets a process use: one bound to fewer (an MPI
    rank bound to a core) still counts all of them (its cgroup's). The
    workers run on all of them."""
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
        return len(os.sched_getaffinity(0))
    except OSError:
        return len(mine)
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, mine)


def workers_here(load1: float | None = None) -> int:
    """How many workers this host runs now: one per CPU the load average
    (``load1``, os.getloadavg's by default) leaves idle, rounded up, at most
    MAX_PROCESSES, and no more than its CPU quota and available memory
    (WORKER_MB each) hold (a container's: cgroup v2's cpu.max and
    memory.max, if set). 1: compile in one process. A busy host gains
    nothing from more processes (make test's set-up on 2 CPUs, two compiles
    beside pip and a g++ build: 123 and 156 s over 2 workers each; an
    earlier set-up's compile took 88 s in one process)."""
    load1 = os.getloadavg()[0] if load1 is None else load1
    cpus = host_cpus()
    cpus = max(1, min(cpus, math.ceil(cpus - load1)))
    quota = _cgroup("cpu.max")
    if quota and quota[0] != "max":
        cpus = min(cpus, max(1, -(-int(quota[0]) // int(quota[1]))))
    available_mb = _meminfo_mb("MemAvailable")
    limit, used = _cgroup("memory.max"), _cgroup("memory.current")
    if limit and used and limit[0] != "max":
        left_mb = (int(limit[0]) - int(used[0])) // 2**20
        available_mb = left_mb if available_mb is None else min(available_mb, left_mb)
    by_memory = MAX_PROCESSES if available_mb is None else max(1, available_mb // WORKER_MB)
    return min(cpus, MAX_PROCESSES, by_memory)


def _cgroup(name: str) -> list[str] | None:
    try:
        return Path("/sys/fs/cgroup", name).read_text().split()
    except OSError:
        return None


def _meminfo_mb(field: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def compile_parallel(target: Callable, directory: Path, processes: int,
                     first_compile: Callable[[], None]) -> dict:
    """Run ``target(claim=...)`` (a module's function) in ``processes``
    workers sharing numba's cache in ``directory``; call ``first_compile()``
    once, when a worker starts a real compile (not a cache load). Returns
    {"compiled": whether any worker compiled, "compiles" and "cpu_s" (of
    the workers that finished), "failed": [one line per failed worker],
    "max_rss_mb" (the largest child this process has had, workers included)}."""
    locks = directory / LOCKS
    locks.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(RUN_PREFIX + "*"):  # a killed compile's (the host lock is ours)
        shutil.rmtree(stale, ignore_errors=True)
    run = Path(tempfile.mkdtemp(prefix=RUN_PREFIX, dir=directory))
    (run / "claims").mkdir()
    failed = []
    try:
        procs = _start(run, locks, f"{target.__module__}:{target.__qualname__}", processes,
                       failed)
        said = _wait(procs, run, first_compile, failed)
        done = _collect(procs, run, failed)
        done["compiled"] = said or (run / "compiling").exists()
        if done["compiled"] and not said:
            first_compile()
        return done
    finally:
        shutil.rmtree(run, ignore_errors=True)


def _start(run: Path, locks: Path, spec: str, processes: int, failed: list) -> list:
    here = Path(__file__).parents[1]  # the package harmpi
    boot = _BOOT.format(name=here.name, path=str(here), init=str(here / "__init__.py"))
    procs = []
    for i in range(processes):
        with open(run / f"worker.{i}.err", "w") as err:
            try:
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", boot, str(run), str(locks), str(i), spec,
                     str(os.getpid())], stdin=subprocess.DEVNULL, stdout=err, stderr=err))
            except OSError as exc:  # no process to be had: the others (or the parent) do it
                failed.append(f"worker {i} did not start: {exc}")
                break
    return procs


def _wait(procs: list, run: Path, first_compile: Callable[[], None], failed: list) -> bool:
    """Until every worker has exited (or the deadline, then they are ended);
    True if ``first_compile`` was called."""
    deadline, said = time.monotonic() + WORKER_DEADLINE_S, False
    try:
        while any(p.poll() is None for p in procs):
            if not said and (run / "compiling").exists():
                said = True
                first_compile()
            if time.monotonic() > deadline:
                failed.append(f"workers still running after {WORKER_DEADLINE_S:.0f} s: ended")
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return said


def _collect(procs: list, run: Path, failed: list) -> dict:
    done = {"compiles": 0, "cpu_s": 0.0, "failed": failed,
            "max_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)}
    for i, p in enumerate(procs):
        result = run / f"worker.{i}.json"
        if p.returncode == 0 and result.exists():
            figures = json.loads(result.read_text())
            done["compiles"] += figures["compiles"]
            done["cpu_s"] += figures["cpu_s"]
        else:
            tail = (run / f"worker.{i}.err").read_text().strip().splitlines()[-3:]
            failed.append(f"worker {i} exited {p.returncode}: " + " | ".join(tail))
    return done


# -- the worker side ------------------------------------------------------------


def worker(argv: list[str]) -> int:
    """A worker's main: argv is (the run's directory, the locks directory,
    this worker's index, "module:function" to run with claim=, the parent's
    pid). Counts the compiles of that module's package."""
    run, locks, index, spec, parent = argv
    _die_with_parent(int(parent))
    with contextlib.suppress(OSError):  # a rank bound to one core starts us on it
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    cpu0 = time.process_time()
    module, _, name = spec.partition(":")
    deferral = _Deferral(Path(run), Path(locks), module.split(".")[0])
    deferral.install()
    getattr(importlib.import_module(module), name)(claim=deferral.claim)
    figures = {"compiles": deferral.compiles, "cpu_s": round(time.process_time() - cpu0, 2),
               "claimed": deferral.claimed, "waited_s": round(deferral.waited_s, 2)}
    tmp = Path(run) / f"worker.{index}.tmp"
    tmp.write_text(json.dumps(figures))
    os.replace(tmp, Path(run) / f"worker.{index}.json")
    return 0


def _die_with_parent(parent: int):
    """Have the kernel SIGKILL this process when its parent dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the prctl
        os._exit(1)


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:24]


def _kernel_name(py_func) -> str:
    """One name per numba cache index: source file, qualified name, line."""
    code = py_func.__code__
    return f"{code.co_filename}:{py_func.__qualname__}:{code.co_firstlineno}"


def _inner_code(func, name: str):
    """The code of the function ``name`` that ``func`` defines (numba's
    decorators define their ``wrapper`` so)."""
    found = [c for c in func.__code__.co_consts if getattr(c, "co_name", None) == name]
    if len(found) != 1:
        raise RuntimeError(f"numba changed: {func.__qualname__} defines no one {name}()")
    return found[0]


class _Later:
    """A deferred kernel's compiled function, compiled or loaded at its first
    call (what a worker's module-level ``get_overload`` gets)."""

    def __init__(self, get: Callable):
        self.get = get

    def __call__(self, *args):
        return self.get()(*args)


class _Deferral:
    """A worker's patch of numba's dispatcher (see the module docstring)."""

    def __init__(self, run: Path, locks: Path, package: str):
        self.claims, self.locks, self.package = run / "claims", locks, package
        self.marker = run / "compiling"
        # id(kernel) -> [kernel, [its deferred signatures] (None: a cfunc), disable after]
        self.deferred = {}
        self.held = {}  # lock file -> [open file, depth]
        self.claimed = self.compiles = 0
        self.waited_s = 0.0
        self.orig = {}

    def claim(self, name: str) -> bool:
        """True in the one process of the run that asks first."""
        try:
            os.close(os.open(self.claims / _digest(name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        self.claimed += 1
        return True

    @contextlib.contextmanager
    def lock(self, name: str):
        """An flock named ``name`` (re-entrant in this process: a recursive
        kernel compiles within its own compile)."""
        path = self.locks / (_digest(name) + ".lock")
        entry = self.held.get(path)
        if entry is None:
            f = open(path, "a")
            t0 = time.monotonic()
            fcntl.flock(f, fcntl.LOCK_EX)
            self.waited_s += time.monotonic() - t0
            entry = self.held[path] = [f, 0]
        entry[1] += 1
        try:
            yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self.held[path]
                fcntl.flock(entry[0], fcntl.LOCK_UN)
                entry[0].close()

    # -- numba's methods, as a worker has them --------------------------------------

    def compile(self, kernel, sig, at_decoration: bool):
        if not self.cached(kernel):
            return self.orig["compile"](kernel, sig)
        from numba.core import sigutils

        key = f"{_kernel_name(kernel.py_func)}|{tuple(sigutils.normalize_signature(sig)[0])}"
        if at_decoration and not self.claim(key):
            self.deferred.setdefault(id(kernel), [kernel, [], False])[1].append(sig)
            return None
        if not at_decoration:
            self.realise(kernel)
        with self.lock(key):
            return self.orig["compile"](kernel, sig)

    def disable(self, kernel, val=True):
        entry = self.deferred.get(id(kernel))
        if entry is None:
            return self.orig["disable_compile"](kernel, val)
        entry[2] = val  # when its signatures are in
        return None

    def realise(self, kernel):
        """Compile (or load) what a deferred kernel's decoration declared."""
        entry = self.deferred.pop(id(kernel), None)
        if entry is None:
            return
        if entry[1] is None:  # a cfunc
            with self.lock(f"{_kernel_name(kernel._pyfunc)}|cfunc"):
                self.orig["cfunc"](kernel)
            return
        for sig in entry[1]:
            self.compile(kernel, sig, False)
        if entry[2]:
            self.orig["disable_compile"](kernel, entry[2])

    def for_args(self, kernel, *args, **kws):
        if id(kernel) in self.deferred:
            self.realise(kernel)
            if not kernel._can_compile:
                return kernel  # numba calls what this returns: it now has its signatures
        return self.orig["_compile_for_args"](kernel, *args, **kws)

    def get_overload(self, kernel, sig):
        if id(kernel) in self.deferred:
            return _Later(lambda: (self.realise(kernel), self.orig["get_overload"](kernel, sig))[1])
        return self.orig["get_overload"](kernel, sig)

    def cfunc_compile(self, kernel, at_decoration: bool):
        if not self.cached(kernel):
            return self.orig["cfunc"](kernel)
        key = f"{_kernel_name(kernel._pyfunc)}|cfunc"
        if at_decoration and not self.claim(key):
            self.deferred[id(kernel)] = [kernel, None, False]
            return None
        with self.lock(key):
            return self.orig["cfunc"](kernel)

    def cached(self, kernel) -> bool:
        from numba.core.caching import NullCache

        return not isinstance(kernel._cache, NullCache)

    def install(self):
        """Patch numba in this process (a worker's only)."""
        from numba.core import caching, ccallback, decorators, dispatcher

        Dispatcher, CFunc, Cache = dispatcher.Dispatcher, ccallback.CFunc, caching.Cache
        jit_wrapper = _inner_code(decorators._jit, "wrapper")
        cfunc_wrapper = _inner_code(decorators.cfunc, "wrapper")
        for name in ("compile", "disable_compile", "get_call_template", "get_overload",
                     "_compile_for_args", "get_compile_result"):
            self.orig[name] = getattr(Dispatcher, name)
        self.orig["cfunc"] = CFunc.compile
        me = self

        def compile_(kernel, sig):
            return me.compile(kernel, sig, sys._getframe(1).f_code is jit_wrapper)

        def cfunc_compile(kernel):
            return me.cfunc_compile(kernel, sys._getframe(1).f_code is cfunc_wrapper)

        def realising(method):
            def call(kernel, *args, **kws):
                me.realise(kernel)
                return method(kernel, *args, **kws)
            return call

        def realising_property(prop):
            return property(lambda kernel: (me.realise(kernel), prop.fget(kernel))[1])

        def indexed(method):  # numba's index read or written under the kernel's flock
            def call(cache, *args):
                with me.lock(f"{_kernel_name(cache._py_func)}|index"):
                    return method(cache, *args)
            return call

        Dispatcher.compile, CFunc.compile = compile_, cfunc_compile
        Dispatcher.disable_compile = lambda kernel, val=True: me.disable(kernel, val)
        Dispatcher.get_call_template = realising(self.orig["get_call_template"])
        Dispatcher.get_compile_result = realising(self.orig["get_compile_result"])
        Dispatcher.get_overload = lambda kernel, sig: me.get_overload(kernel, sig)
        Dispatcher._compile_for_args = lambda kernel, *args, **kws: me.for_args(kernel, *args,
                                                                                **kws)
        for name in ("address", "native_name"):
            setattr(CFunc, name, realising_property(getattr(CFunc, name)))
        Cache.load_overload = indexed(Cache.load_overload)
        Cache.save_overload = indexed(Cache.save_overload)
        event.register("numba:compile", _Count(self))


class _Count(event.Listener):
    """Counts a worker's real compiles of its package's kernels (numba
    raises numba:compile for a compile, not for a cache load); the first
    leaves the run's marker, the parent's cue to say the cache was cold."""

    def __init__(self, deferral: _Deferral):
        self.deferral = deferral

    def on_start(self, ev):
        dispatcher = (ev.data or {}).get("dispatcher")
        module = getattr(getattr(dispatcher, "py_func", None), "__module__", "") or ""
        if module.split(".")[0] != self.deferral.package:
            return
        self.deferral.compiles += 1
        if self.deferral.compiles == 1:
            self.deferral.marker.touch()

    def on_end(self, ev):
        pass
