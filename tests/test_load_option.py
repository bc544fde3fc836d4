"""bench.load (``--load N``): the busy processes run unbound while the
benchmark runs and none is left behind on any exit path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from support import REPO  # noqa: E402 (the checkout, one definition)

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.load import BusyLoad  # noqa: E402


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone(pids, timeout_s=20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_alive(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def _cpus_allowed(pid: int) -> set[int]:
    return os.sched_getaffinity(pid)


def test_busy_processes_spin_unbound_in_one_group_and_stop():
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})  # a rank bound to one core
    try:
        load = BusyLoad(2).start()
    finally:
        os.sched_setaffinity(0, cpus)
    try:
        pids = load.pids()
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        assert {os.getpgid(pid) for pid in pids} == {pids[0]}  # one group, not ours
        assert os.getpgid(pids[0]) != os.getpgrp()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_cpus_allowed(p) != cpus for p in pids):
            time.sleep(0.05)  # the child widens its affinity after starting
        assert all(_cpus_allowed(pid) == cpus for pid in pids)
        time.sleep(0.5)
    finally:
        load.stop()
    assert _gone(pids, 1.0)
    # they did spin: CPU time at all (two spinners for 0.5 s take ~1 s of it
    # on idle cores, 0.14 s was seen at load 20 on 2 cores)
    assert load.cpu_s > 0.01 and load.wall_s >= 0.5
    assert "# Load: 2 busy processes (unbound spin loops) ran on each host: " in load.summary()
    load.stop()  # idempotent


def test_zero_is_no_load_and_negative_is_refused():
    with BusyLoad(0) as load:
        assert load.pids() == []
    with pytest.raises(ValueError, match="--load -1"):
        BusyLoad(-1)


SCRIPT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {repo!r})
    from bench.load import BusyLoad
    how = sys.argv[1]
    with BusyLoad(2) as load:
        print(" ".join(map(str, load.pids())), flush=True)
        if how == "raise":
            raise RuntimeError("the benchmark failed")
        if how == "exit":
            sys.exit(3)
        if how == "wait":
            time.sleep(120)
    print("normal end", flush=True)
""")


def _start(tmp_path, how):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(repo=str(REPO)))
    # the job gets SIGINT's default action even where the test suite itself
    # was started with SIGINT ignored (a background job of a shell: `make test &`)
    proc = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pids = [int(x) for x in proc.stdout.readline().split()]
    assert len(pids) == 2, proc.stderr.read()
    return proc, pids


@pytest.mark.parametrize("how, code", [("normal", 0), ("raise", 1), ("exit", 3)])
def test_no_busy_process_outlives_a_run_that_ends(tmp_path, how, code):
    proc, pids = _start(tmp_path, how)
    assert proc.wait(timeout=60) == code
    assert _gone(pids)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_no_busy_process_outlives_a_signal(tmp_path, sig):
    proc, pids = _start(tmp_path, "wait")
    assert all(_alive(pid) for pid in pids)
    proc.send_signal(sig)
    code = proc.wait(timeout=60)
    assert code != 0
    if sig == signal.SIGTERM:
        assert code == 128 + signal.SIGTERM  # the handler stopped them, then exited
    assert _gone(pids), [pid for pid in pids if _alive(pid)]
