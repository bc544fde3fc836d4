"""Threads and one communicator: a context belongs to the thread that set it
up (harmpi.runtime.owner). Another thread's call is refused at once, on every rank,
so no call ever returns a sum paired with another thread's call."""

import contextlib
import dataclasses
import faulthandler
import sys
import tempfile
import threading
import time

import numpy as np
import pytest
from conftest import torch
from mpi4py import MPI

import harmpi

CALLS = 200
#: seconds after which _run_threads prints every thread's stack (a set-up
#: deadline is 60 s by default)
STALL_S = 40.0


#: pytest's capture manager (set by _capture below), for _run_threads' stacks
_CAPTURE = [None]


@pytest.fixture(autouse=True)
def _capture(pytestconfig):
    _CAPTURE[0] = pytestconfig.pluginmanager.getplugin("capturemanager")


def _setup(comm, timeout_s=5.0):
    cfg = dataclasses.replace(harmpi.Config.from_env(), timeout_s=timeout_s)
    return harmpi.init(comm, config=cfg)


def _make(kind, value, n=256):
    if kind == "torch":
        return torch.full((n,), value, dtype=torch.float32)
    return np.full(n, value, np.float32)


def _hammer(comm, kind, tid, out):
    """CALLS all-reduces of values that tell the threads apart; counts
    (right, wrong, refused) and the first refusal's message."""
    r, size = comm.Get_rank(), comm.Get_size()
    right = wrong = refused = 0
    first = None
    for _ in range(CALLS):
        x = _make(kind, float(1000 * (tid + 1) + r))
        try:
            harmpi.allreduce(x, comm=comm)
        except harmpi.HarmpiError as exc:
            refused += 1
            first = first or str(exc)
            continue
        if float(x[0]) == 1000 * (tid + 1) * size + size * (size - 1) / 2:
            right += 1
        else:
            wrong += 1
    out[tid] = (right, wrong, refused, first)


def _run_threads(target, *args, count=2):
    """Run ``target(*args, k, out)`` in ``count`` threads; ``out`` as they
    left it. A thread that raised puts ``("raised", repr(exc))`` under its
    key, so a failing assertion shows why (a thread's exception is
    otherwise only a warning at the end of a session an abort may cut)."""
    out = {}

    def run(k):
        try:
            target(*args, k, out)
        except BaseException as exc:  # noqa: BLE001 - reported through out
            out[k] = ("raised", repr(exc)[:2000])

    threads = [threading.Thread(target=run, args=(k,), name=f"caller-{k}")
               for k in range(count)]
    # every thread's stack once a thread has run STALL_S (where each sits
    # when a set-up misses its deadline): faulthandler's watchdog writes it
    # without the GIL, which a stalled thread may hold; it is printed past
    # pytest's capture, since the abort after a failure cuts captured output
    with tempfile.TemporaryFile("w+") as stacks:
        faulthandler.dump_traceback_later(STALL_S, file=stacks)
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            faulthandler.cancel_dump_traceback_later()
        stacks.seek(0)
        text = stacks.read()
    if text:
        capture = _CAPTURE[0]
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            print(f"\n== test_threads: rank {MPI.COMM_WORLD.Get_rank()}: threads still running "
                  f"after {STALL_S:g} s; stacks:\n{text}", file=sys.stderr, flush=True)
    return out


def _closed_form(comm, kind="torch", n=1000):
    r, size = comm.Get_rank(), comm.Get_size()
    x = _make(kind, float(r + 1), n)
    harmpi.allreduce(x, comm=comm)
    return bool((x == size * (size + 1) / 2).all())


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_other_threads_are_refused_at_once_and_never_mixed(world, kind):
    """The main thread set the communicator up; two more threads hammer it.
    Every one of their calls is refused, quickly, and none returns a sum
    (before: 65-73 of 200 calls per thread returned the other thread's sum)."""
    comm = world.Dup()
    _setup(comm)
    assert _closed_form(comm, kind)
    t0 = time.monotonic()
    out = _run_threads(_hammer, comm, kind)
    took = time.monotonic() - t0
    for tid, (right, wrong, refused, first) in out.items():
        assert (right, wrong, refused) == (0, 0, CALLS), (tid, out[tid])
        assert "belongs to thread 'MainThread'" in first and f"'caller-{tid}'" in first, first
    assert took < 30.0, took          # refused at once, not at a deadline (200 x 5 s)
    assert _closed_form(comm, kind)   # the owner's calls are unaffected
    world.Barrier()
    comm.Free()


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_race_to_set_up_never_pairs_two_threads(world, kind):
    """Two threads on every rank make the first call on a fresh communicator
    at once. Whoever wins on each rank, no call returns a wrong sum: if the
    winners' names differ between ranks every rank refuses the set-up."""
    comm = world.Dup()
    out = _run_threads(_hammer, comm, kind)
    wrong = sum(v[1] for v in out.values())
    right = sum(v[0] for v in out.values())
    assert wrong == 0, out
    # at most one thread per rank had its calls run
    assert right in (0, CALLS) and sorted(v[0] for v in out.values())[0] == 0, out
    world.Barrier()


def test_a_thread_that_sets_up_its_own_communicator_works(world, topo):
    """The remedy the error names: each thread its own communicator, set up
    from that thread. Both threads' sums are right, on every rank."""
    comms = [world.Dup(), world.Dup()]   # made by the main thread: Dup is collective

    def body(tid, out):
        comm = comms[tid]
        ok = True
        for i in range(50):
            x = _make("numpy", float(comm.Get_rank() + tid + i))
            harmpi.allreduce(x, comm=comm)
            size = comm.Get_size()
            ok &= float(x[0]) == size * (tid + i) + size * (size - 1) / 2
        out[tid] = ok

    out = _run_threads(lambda tid, out: body(tid, out))
    assert out == {0: True, 1: True}
    world.Barrier()
    for c in comms:
        c.Free()


def test_the_world_context_refuses_another_thread_on_every_path(world):
    """harmpi.allreduce(t) on the world context (harmpi.native's C++ entry
    when built), numpy, allgather and barrier: all refused from a thread that
    did not set the world up."""
    harmpi.init()
    harmpi.allreduce(torch.ones(4))
    calls = {
        "tensor": lambda: harmpi.allreduce(torch.ones(8)),
        "numpy": lambda: harmpi.allreduce(np.ones(8, np.float32)),
        "allgather": lambda: harmpi.allgather(torch.ones(8)),
        "barrier": harmpi.barrier,
    }
    seen = {}

    def body(_tid, out):
        for name, call in calls.items():
            try:
                call()
                seen[name] = "ran"
            except harmpi.HarmpiError as exc:
                seen[name] = str(exc)

    _run_threads(body, count=1)
    for name, what in seen.items():
        assert "belongs to thread 'MainThread'" in what, (name, what)
    assert _closed_form(world)
    world.Barrier()


def test_a_context_whose_thread_ended_refuses_every_later_thread(world):
    """The set-up thread ends; threads started after it (one of them may be
    given the ended thread's pthread id: glibc reuses them) are refused at
    once on every rank, with a message that says the owner ended."""
    comm = world.Dup()
    done = {}

    def set_up():
        _setup(comm)
        done["sum"] = _closed_form(comm, "numpy")

    t = threading.Thread(target=set_up, name="setter")
    t.start()
    t.join()
    assert done["sum"]
    for k in range(4):  # several, so one likely reuses the ended thread's id
        out = _run_threads(_hammer, comm, "numpy", count=1)
        right, wrong, refused, first = out[0]
        assert (right, wrong, refused) == (0, 0, CALLS), (k, out)
        assert "'setter', which set it up and has ended" in first, first
    world.Barrier()
