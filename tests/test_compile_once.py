"""Kernels compile once per host (issue 22): of several processes starting on
a cold numba cache one compiles and the others wait for it and load from
the cache; the announced time is measured here (harmpi.runtime.compilenote)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from support import REPO  # noqa: E402 (the checkout, one definition)

from harmpi.runtime import compilenote

KERNELS = '''
import numba

@numba.njit("int64(int64)", cache=True)
def twice(x):
    return 2 * x
'''

#: one "rank": compile_once with a package of one kernel, counting numba's real
#: compiles (the numba:compile event is raised for a compile, not for a cache load)
RANK = '''
import importlib.util, json, sys, time
from numba.core import event
spec = importlib.util.spec_from_file_location("compilenote", {note!r})
compilenote = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compilenote)   # without importing harmpi
compiles = []

class Count(event.Listener):
    def on_start(self, ev):
        compiles.append(1)
    def on_end(self, ev):
        pass

event.register("numba:compile", Count())

def compile_all():
    import kernpkg.kernels
    time.sleep({hold_s})   # hold the lock long enough for the other rank to meet it

t0 = time.monotonic()
from pathlib import Path
how = compilenote.compile_once(compile_all, Path({pkg!r}), Path({cache!r}))
import kernpkg.kernels
assert kernpkg.kernels.twice(21) == 42
print(json.dumps({{"how": how, "compiles": len(compiles), "s": time.monotonic() - t0}}))
'''


def _package(tmp_path):
    pkg = tmp_path / "kernpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels.py").write_text(KERNELS)
    return pkg


def _ranks(tmp_path, pkg, n, hold_s=3.0):
    cache = tmp_path / "cache"
    script = RANK.format(note=str(REPO / "harmpi/runtime/compilenote.py"), hold_s=hold_s,
                         pkg=str(pkg), cache=str(cache))
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "NUMBA_CACHE_DIR": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(n)]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        out.append((json.loads(stdout.strip().splitlines()[-1]), stderr))
    return out


@pytest.mark.timeout(320)
def test_two_ranks_on_a_cold_cache_compile_once(tmp_path):
    pkg = _package(tmp_path)
    t0 = time.monotonic()
    ranks = _ranks(tmp_path, pkg, 2)
    wall_s = time.monotonic() - t0
    results = sorted((r for r, _ in ranks), key=lambda r: r["how"])
    compiled = [r for r in results if r["how"] == "compiled"]
    others = [r for r in results if r["how"] != "compiled"]
    assert len(compiled) == 1 and compiled[0]["compiles"] >= 1, results
    # the other rank waited on the lock (or came after it was released) and
    # loaded the kernel from the cache: numba compiled nothing there
    assert [r["how"] in ("waited", "warm") for r in others] == [True], results
    assert others[0]["compiles"] == 0, results
    notes = [err for _, err in ranks if "compiling harmpi kernels" in err]
    assert len(notes) == 1, [err for _, err in ranks]  # said once, by the compiling rank
    assert "once per host" in notes[0] and "a test compile here took" in notes[0]
    record = json.loads(next((tmp_path / "cache").rglob(compilenote.RECORD)).read_text())
    assert record["most_cpu_s"] >= record["compile_cpu_s"] > 0 and record["key"]
    print(f"2 ranks, cold cache: {wall_s:.1f} s; {results}")

    # warm: no lock taken, nothing compiled, nothing said; the next cold
    # compile's estimate comes from this record
    again = _ranks(tmp_path, pkg, 1, hold_s=0)
    assert again[0][0]["how"] == "warm" and again[0][0]["compiles"] == 0
    assert "compiling" not in again[0][1]
    (pkg / "kernels.py").write_text(KERNELS.replace("2 * x", "x + x"))  # an edit: cold again
    cold = _ranks(tmp_path, pkg, 1, hold_s=0)
    assert cold[0][0]["how"] == "compiled"
    assert "the longest compile here took" in cold[0][1]


def test_the_key_follows_the_sources(tmp_path):
    pkg = _package(tmp_path)
    key = compilenote.source_key(pkg)
    assert compilenote.source_key(pkg) == key
    (pkg / "kernels.py").write_text(KERNELS + "\n")  # size changes
    assert compilenote.source_key(pkg) != key


def test_the_estimate_is_measured_here():
    # from the longest compile on this host, scaled by the processes per CPU
    s, how = compilenote.estimate({"most_cpu_s": 60.0}, load1=3.0, cpus=2,
                                  probe=lambda: pytest.fail("no probe with a record"))
    assert s == 120.0 and how.startswith("the longest compile here took 60 s of CPU; load 3.0")
    s, _ = compilenote.estimate({"most_cpu_s": 60.0}, load1=0.0, cpus=4)
    assert s == 60.0  # never less than the CPU time
    # no compile here yet: a timed probe compile, scaled
    s, how = compilenote.estimate({}, load1=0.0, cpus=2, probe=lambda: 0.5)
    assert s == 0.5 * compilenote.PROBE_RATIO and "a test compile here took 0.50 s" in how
    assert compilenote.message(75.4, how).startswith(
        "compiling harmpi kernels (numba cache is cold), once per host, ~75 s\n"
        "  (estimate: a test compile")
    assert max(len(x) for x in compilenote.message(9999, how).splitlines()) <= 100



LAYOUT_KERNEL = '''
import numba
from kernpkg.layout import OFFSET

@numba.njit("int64(int64)", cache=True)
def shifted(x):
    return x + OFFSET
'''

LAYOUT_RANK = '''
import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("compilenote", {note!r})
compilenote = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compilenote)
how = compilenote.compile_once(lambda: __import__("kernpkg.kernels"), Path({pkg!r}),
                               Path({cache!r}))
import kernpkg.kernels
print(how, kernpkg.kernels.shifted(40))
'''


@pytest.mark.timeout(300)
def test_a_change_in_another_module_recompiles_the_kernels_that_use_it(tmp_path):
    """numba checks only a kernel's own file: after an edit of a module it
    depends on (the control block's layout, say) it would load the old
    machine code. compile_once drops the cache of every kernel module that
    imports a changed module, directly or not, and keeps the others'."""
    pkg = tmp_path / "kernpkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    # kernels -> sub.mid -> layout, through a relative import of a parent
    (pkg / "sub" / "mid.py").write_text("from ..layout import OFFSET  # noqa\n")
    (pkg / "layout.py").write_text("OFFSET = 1\n")
    (pkg / "api.py").write_text("from . import kernels  # noqa\n")  # uses the kernels
    (pkg / "kernels.py").write_text(LAYOUT_KERNEL)
    cache = tmp_path / "cache"
    script = LAYOUT_RANK.format(note=str(REPO / "harmpi/runtime/compilenote.py"), pkg=str(pkg),
                                cache=str(cache))
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "NUMBA_CACHE_DIR": str(cache)}

    def run():
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=240)
        assert done.returncode == 0, done.stderr
        how, value = done.stdout.split()[-2:]
        return how, int(value)

    assert run() == ("compiled", 41)
    (pkg / "layout.py").write_text("OFFSET = 2  # the layout moved\n")  # kernels.py untouched
    assert run() == ("compiled", 42)
    # through a chain of imports: kernels imports sub.mid, which imports layout
    (pkg / "kernels.py").write_text(LAYOUT_KERNEL.replace("kernpkg.layout", "kernpkg.sub.mid"))
    assert run() == ("compiled", 42)
    (pkg / "layout.py").write_text("OFFSET = 3\n")
    assert run() == ("compiled", 43)
    # a module no kernel module imports (it imports them): every kernel stays
    (pkg / "api.py").write_text("from . import kernels  # noqa: the API changed\n")
    assert run() == ("loaded", 43)
