"""harmpi's numba kernels compile once per host, and say so with a measured time.

numba compiles each kernel on first use and keeps the machine code in its
cache (``cache=True``), so the first ``import harmpi`` after an install (or
after a source change) spends minutes compiling and later ones load in
about a second. When several ranks of a host start on a cold cache they
would all compile the same kernels at once (4 ranks on 2 cores: four
times the CPU, each twice as slow). :func:`install`, run by ``import
harmpi`` before any kernel module loads, prevents that:

1. warm check, no lock: a record file in the kernels' cache directory
   (``harmpi-kernels.json``) holds a key of everything numba's cache
   depends on (every harmpi source file's mtime and size, numba, Python,
   the CPU). Key equal: the cache is warm, go on (stat calls, ~1 ms).
2. cold: take an exclusive ``fcntl.flock`` on ``harmpi-kernels.lock``
   beside it. The first process gets it at once; the others of the host
   block there until it is done.
3. holding the lock, read the record again: another process may have
   compiled meanwhile (then this one only loads from the cache). Else
   compile every kernel (:func:`compile_all`: the import-time ones and
   the ones Python calls lazily, multi-node and rail kernels included)
   over the host's idle CPUs: one worker process per CPU the load leaves
   idle (as many as memory holds, at most 16: harmpi.runtime.compilepool) shares
   them out, then this process loads them from the cache; on a busy host
   it compiles them itself. At the first real compile it logs one
   warning (logger "harmpi", shown on stderr without any logging set up),
   at the end one line with the time it took, and it writes the record.

The warning's estimate is measured on this host: the CPU seconds the last
compile here took (kept in the record across source changes), scaled by
the load average; before any compile here, a probe kernel is compiled
and timed and scaled by the ratio measured on the development machine:

    compiling harmpi kernels (numba cache is cold), once per host, ~50 s
      (estimate: the longest compile here took 80 s of CPU; load 0.2 on 2 CPUs, 2 processes)
    harmpi kernels compiled in 46 s by 2 processes (75 s of CPU); later imports load them ...

pip cannot run code after installing a wheel, so the compile cannot move to
install time; ``make setup`` runs ``python -m harmpi.precompile``.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import hashlib
import importlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable

from numba.core import event

__all__ = ["RECORD", "LOCK", "KERNEL_MODULES", "cache_dir", "source_key", "estimate", "message",
           "compile_once", "compile_all", "install", "drop_stale", "dependencies", "file_stamps",
           "changed_files", "read_record"]

log = logging.getLogger("harmpi")

RECORD = "harmpi-kernels.json"
LOCK = "harmpi-kernels.lock"
#: a full compile's CPU seconds over the probe's (numba 0.68, 2-core Xeon VM:
#: compile_all ~75 s of CPU, the probe ~0.5 s)
PROBE_RATIO = 150
#: the longest chain of harmpi's kernels that compile one after another (a
#: caller after its callees), over a full compile's CPU seconds: the least
#: share of them a compile over many processes takes (numba 0.68, 2-core
#: Xeon VM: 11.3 s of 87, from a serial compile's call graph)
CHAIN_SHARE = 0.13
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # the package harmpi

def _probe(x):
    return x + 1


def cache_dir(func=_probe) -> Path:
    """The directory numba caches ``func``'s module in (NUMBA_CACHE_DIR, the
    source's __pycache__ if writable, else the user's cache): harmpi's."""
    from numba.core.caching import FunctionCache

    return Path(FunctionCache(func)._impl.locator.get_cache_path())


def file_stamps(package_dir: Path = PACKAGE_DIR) -> dict[str, list[int]]:
    """Each source file's (mtime ns, size), by path within the package: what
    numba's own check of a file compares."""
    stamps = {}
    for path in sorted(package_dir.rglob("*.py")):
        st = path.stat()
        stamps[str(path.relative_to(package_dir))] = [st.st_mtime_ns, st.st_size]
    return stamps


def _resolve(package_dir: Path, dotted: str) -> Path | None:
    """The source file of module ``dotted`` (package-relative, "" for the
    package itself), or None if it is not one of the package's modules."""
    base = package_dir.joinpath(*dotted.split(".")) if dotted else package_dir
    candidates = [base / "__init__.py"] if not dotted else [base.with_suffix(".py"),
                                                             base / "__init__.py"]
    return next((path for path in candidates if path.is_file()), None)


def _imports(package_dir: Path, source: Path) -> set[Path]:
    """The package's modules that ``source`` imports anywhere (functions
    included: conservative), by source file."""
    name = package_dir.name
    # the subpackage ``source`` is in, which a relative import starts from
    here = list(source.relative_to(package_dir).parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = here[:len(here) - (node.level - 1)] if node.level > 1 else here
                module = ".".join([name, *up, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            targets = [(module, a.name) for a in node.names]
        for module, attr in targets:
            if module != name and not module.startswith(name + "."):
                continue
            dotted = module[len(name) + 1:]
            sub = _resolve(package_dir, f"{dotted}.{attr}" if dotted else attr) if attr else None
            path = sub or _resolve(package_dir, dotted)
            if path is not None:
                found.add(path)
    return found


def dependencies(package_dir: Path = PACKAGE_DIR) -> dict[Path, set[Path]]:
    """Each source file's transitive imports within the package, itself included."""
    direct = {path: _imports(package_dir, path) for path in sorted(package_dir.rglob("*.py"))}
    closure = {}
    for path in direct:
        seen, todo = {path}, [path]
        while todo:
            for dep in direct.get(todo.pop(), ()):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        closure[path] = seen
    return closure


def changed_files(old: dict | None, new: dict) -> set[str] | None:
    """Paths whose stamps differ between two :func:`file_stamps` (added and
    removed ones too); None if there is no old record to compare with."""
    if not old:
        return None
    return {path for path in old.keys() | new.keys() if old.get(path) != new.get(path)}


def drop_stale(package_dir: Path = PACKAGE_DIR, changed: set[str] | None = None) -> int:
    """Delete numba's cache files of every module that imports, directly or
    not, a changed source file (``changed``: paths within the package; None:
    every module); returns how many files. numba checks only a kernel's own
    source file against its cache, so after a change to a module it uses
    (the control block's layout, an inlined wait) it would load machine
    code built against the old one: wrong offsets, old protocol. A change
    to a module no kernel module imports (the API, the registry, the torch
    backend) keeps every kernel."""
    from numba.core.caching import CacheImpl

    closure = dependencies(package_dir) if changed is not None else {}
    dropped = 0
    for source in sorted(package_dir.rglob("*.py")):
        if changed is not None and not any(
                str(dep.relative_to(package_dir)) in changed for dep in closure[source]):
            continue
        for locator_class in CacheImpl._locator_classes:
            locator = locator_class.from_function(_probe, str(source))
            if locator is None:
                continue
            cache = Path(locator.get_cache_path())
            for stale in (*cache.glob(f"{source.stem}.*.nbi"), *cache.glob(f"{source.stem}.*.nbc")):
                with contextlib.suppress(OSError):
                    stale.unlink()
                    dropped += 1
            break
    return dropped


def source_key(package_dir: Path = PACKAGE_DIR) -> str:
    """A digest of what numba's cache of this package depends on: each source
    file's path, mtime and size (numba's own check), numba, Python, the CPU."""
    import llvmlite.binding as llvm
    import numba

    digest = hashlib.sha256()
    for part in (numba.__version__, sys.version, llvm.get_host_cpu_name(),
                 llvm.get_host_cpu_features().flatten()):
        digest.update(part.encode() + b"\0")
    for path in sorted(package_dir.rglob("*.py")):
        st = path.stat()
        digest.update(f"{path.relative_to(package_dir)}\0{st.st_mtime_ns}\0{st.st_size}\0"
                      .encode())
    return digest.hexdigest()


def read_record(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _probe_cpu_s() -> float:
    """CPU seconds numba takes to compile a small kernel here, uncached."""
    import numba
    import numpy as np

    def probe(a, out):
        for i in range(a.shape[0]):
            out[i] = np.float32(a[i]) * np.float32(2.0) + np.float32(i)
        return out.sum()

    t0 = time.process_time()
    numba.njit("float32(float64[::1], float32[::1])", cache=False)(probe)
    return time.process_time() - t0


def estimate(record: dict, load1: float, cpus: int,
             probe: Callable[[], float] = _probe_cpu_s, processes: int = 1) -> tuple[float, str]:
    """(seconds, how they were measured) a full compile will take here now:
    the longest compile's CPU seconds here (``record``: a full compile; a
    source edit recompiles only some kernels) or a timed probe compile
    scaled by PROBE_RATIO, shared by ``processes`` processes that each get
    at most a CPU, less when the load leaves less, and never below the
    longest chain of kernels (CHAIN_SHARE; pure but ``probe``)."""
    share = max(1.0, (load1 + processes) / max(cpus, 1))
    least = max(1 / processes, CHAIN_SHARE)
    cpu_s = record.get("most_cpu_s")
    if cpu_s:
        how = f"the longest compile here took {cpu_s:.0f} s of CPU"
    else:
        probe_s = probe()
        cpu_s = probe_s * PROBE_RATIO
        how = f"a test compile here took {probe_s:.2f} s"
    over = f", {processes} processes" if processes > 1 else ""
    return cpu_s * share * least, f"{how}; load {load1:.1f} on {cpus} CPUs{over}"


def message(seconds: float, how: str) -> str:
    """The warning: two lines, each within 100 columns."""
    return (f"compiling harmpi kernels (numba cache is cold), once per host, ~{seconds:.0f} s\n"
            f"  (estimate: {how})")


@contextlib.contextmanager
def _host_lock(path: Path):
    """An exclusive flock on ``path``; yields True if this process had to wait."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            waited = False
        except BlockingIOError:
            log.info("harmpi: another process of this host compiles the kernels; waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
            waited = True
        try:
            yield waited
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def compile_once(compile_all: Callable[..., None], package_dir: Path = PACKAGE_DIR,
                 directory: Path | None = None, processes: int | None = 1) -> str:
    """Make sure the kernels are in numba's cache, compiled by one process
    of the host: "warm" (nothing to do), "waited" (another process compiled
    them while this one waited), "compiled" (this one did), or "loaded" (the
    sources changed but every kernel was still in the cache); "no jit"
    under NUMBA_DISABLE_JIT=1. ``processes`` > 1 (None: one per idle CPU of
    the host, compilepool.workers_here()): that many worker processes
    compile first (harmpi.runtime.compilepool), then this one loads what they
    compiled. ``compile_all`` is then a module's function taking ``claim=``,
    in a module that imports no kernel module itself (its importer would
    compile those before this starts)."""
    from numba.core import config

    if config.DISABLE_JIT:  # NUMBA_DISABLE_JIT=1: nothing compiles, and no record is written
        return "no jit"
    directory = cache_dir() if directory is None else directory
    key = source_key(package_dir)
    record_path = directory / RECORD
    if read_record(record_path).get("key") == key:
        return "warm"
    directory.mkdir(parents=True, exist_ok=True)
    with _host_lock(directory / LOCK) as waited:
        record = read_record(record_path)
        if record.get("key") == key:
            return "waited" if waited else "warm"
        stamps = file_stamps(package_dir)
        if record.get("key"):  # sources changed since the last compile here
            drop_stale(package_dir, changed_files(record.get("files"), stamps))
        record, compiled = _compile(compile_all, package_dir, directory, processes, record)
        tmp = record_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**record, "key": key, "files": stamps, "at": time.time()}))
        os.replace(tmp, record_path)
    return "compiled" if compiled else "loaded"


def _compile(compile_all: Callable[..., None], package_dir: Path, directory: Path,
             processes: int | None, record: dict) -> tuple[dict, bool]:
    """compile_once's compile, under the host lock: (the new record, whether
    any kernel compiled); the old record if every kernel loaded."""
    if processes != 1:  # (a single process needs no package: tests load this file alone)
        from . import compilepool
    load1, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if processes is None:
        processes = compilepool.workers_here(load1)
    note = _ColdCacheNote(package_dir.name,
                          lambda: message(*estimate(record, load1, cpus, processes=processes)))
    wall0, cpu0 = time.monotonic(), time.process_time()
    spread = {"compiled": False, "compiles": 0, "cpu_s": 0.0, "failed": []}
    if processes > 1:
        spread = compilepool.compile_parallel(compile_all, directory, processes, note.say)
        for failure in spread["failed"]:
            log.warning("harmpi: a kernel compile worker failed (this process compiles "
                        "its share): %s", failure)
    event.register("numba:compile", note)
    try:
        compile_all()  # after the workers: loads what they compiled
    finally:
        event.unregister("numba:compile", note)
    compiles = spread["compiles"] + note.compiles
    if not (compiles or spread["compiled"]):  # every kernel loaded: keep the last figures
        return record, False
    cpu_s = round(time.process_time() - cpu0 + spread["cpu_s"], 2)
    wall_s = round(time.monotonic() - wall0, 2)
    log.warning("%s", f"harmpi kernels compiled in {wall_s:.0f} s by {_processes(processes)} "
                      f"({cpu_s:.0f} s of CPU); later imports load them from the cache")
    return {"compile_cpu_s": cpu_s, "most_cpu_s": max(cpu_s, record.get("most_cpu_s", 0)),
            "compile_wall_s": wall_s, "load1": load1, "cpus": cpus, "processes": processes,
            "kernels": compiles, "compiled_here": note.compiles,
            "worker_failures": len(spread["failed"]),
            "worker_max_rss_mb": spread.get("max_rss_mb", 0)}, True


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


class _ColdCacheNote(event.Listener):
    """Logs the line at the first real compile (numba raises numba:compile
    for a compile, not for a cache load) of a kernel of ``package``; counts them."""

    def __init__(self, package: str, text: Callable[[], str]):
        self.package, self.text = package, text
        self.compiles = 0
        self.measuring = False  # text() may compile a probe: not a kernel
        self.said = False

    def on_start(self, ev):
        dispatcher = (ev.data or {}).get("dispatcher")
        module = getattr(getattr(dispatcher, "py_func", None), "__module__", "") or ""
        if self.measuring or module.split(".")[0] != self.package:
            return
        self.compiles += 1
        if self.compiles == 1:
            self.say()

    def say(self):
        """Log the line, once (a worker's first compile calls this too)."""
        if self.said:
            return
        self.said = self.measuring = True
        try:
            log.warning("%s", self.text())
        finally:
            self.measuring = False

    def on_end(self, ev):
        pass


# -- harmpi's kernels ----------------------------------------------------------
# Most have explicit signatures and compile (or load) when their module is
# imported. A few take their types from their first call and are called from
# Python only on some paths: the tcp rail's socket steps (multi-node runs over
# HARMPI_TRANSPORT=tcp/auto), the bandwidth variant's part bounds and the rail
# tag (multi-node, any transport). Left alone they compile in every rank at
# its first multi-node collective, in the middle of a timed run; compile_all
# calls each once, on scratch arrays, with the argument types their callers
# use (other types would compile another specialisation: keep these in step
# with harmpi/transports/tcp.py and harmpi/algorithms/).

#: modules with kernels, in the order ``import harmpi`` meets them
#: (harmpi.logits only through harmpi.api: the two import each other)
KERNEL_MODULES = ("harmpi.base.control", "harmpi.base.kind", "harmpi.base.copytune",
                  "harmpi.record.recorder", "harmpi.reduce", "harmpi.base.sync", "harmpi.node",
                  "harmpi.algorithms", "harmpi.transports.sockio", "harmpi.transports.tcp",
                  "harmpi.api")


def _rail_socket_steps():
    """sockio's steps as TcpTransport calls them: int64 rows, fds from an
    int64 array, Python ints; no row is pending, so nothing touches a socket."""
    import numpy as np

    from harmpi.transports import sockio

    ops, pollfds, scratch = sockio.new_ops(4), sockio.new_pollfds(4), sockio.new_scratch()
    fds = np.full(2, -1, np.int64)
    buf = np.zeros(8, np.uint8)
    sockio.set_recv(ops, 0, fds[0], buf.ctypes.data, buf.nbytes)
    sockio.set_send(ops, 1, fds[0], buf.ctypes.data, buf.nbytes, 1, time.time_ns())
    sockio.kick(ops, 0, scratch)
    sockio.progress(ops, 0, 1, int(1e9), pollfds, scratch, 0, 0, 0)


def _rail_arithmetic():
    """The pure integer kernels the rail algorithms call from Python."""
    from harmpi import node
    from harmpi.base import kind

    node.part_bounds(1024, 2, 0, 2)
    kind.rail_tag(2048, 1)


def _reduce_warm_up():
    importlib.import_module("harmpi.reduce").warm_up()


def _alltoall_warm_up():
    importlib.import_module("harmpi.algorithms.alltoall").warm_up()


#: compile_all's steps after the imports: (name, the lazily typed kernels they call)
WARM_STEPS = (("reduce", _reduce_warm_up), ("rail socket steps", _rail_socket_steps),
              ("rail arithmetic", _rail_arithmetic), ("alltoall", _alltoall_warm_up))


def compile_all(claim: Callable[[str], bool] | None = None) -> None:
    """Import every kernel module and run the lazily typed kernels once.
    ``claim(name)``: whether this process runs step ``name`` (harmpi.runtime.compilepool's
    workers share the steps); every step without it."""
    for name in KERNEL_MODULES:
        importlib.import_module(name)
    for name, step in WARM_STEPS:
        if claim is None or claim(name):
            step()


#: what install() found at ``import harmpi`` (compile_once's answer)
outcome = None


def install() -> str:
    """``import harmpi``'s first step: the kernels compiled once per host (see
    the module docstring); returns (and keeps in ``outcome``) what compile_once did."""
    global outcome
    outcome = compile_once(compile_all, processes=None)
    return outcome
