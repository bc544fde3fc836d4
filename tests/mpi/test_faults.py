"""Faults and misuse inside one job (every rank runs every test): each ends
in a clear error on every rank concerned, or in correct results, never in a
silent wrong result. Jobs that lose a rank, exit after a failure or get a
Ctrl-C are started as separate mpirun jobs by tests/test_faults.py."""

import dataclasses
import os
import threading
import time

import pytest
from conftest import torch

import harmpi


def _short(comm, timeout_s=2.0, **kw):
    """Set ``comm`` up with a short deadline (faults are timed in seconds)."""
    cfg = dataclasses.replace(harmpi.Config.from_env(), timeout_s=timeout_s, **kw)
    return harmpi.init(comm, config=cfg)


def _closed_form(comm, n=3000, dtype=torch.float32):
    r, size = comm.Get_rank(), comm.Get_size()
    x = torch.full((n,), float(r + 1), dtype=dtype)
    harmpi.allreduce(x, comm=comm)
    return bool(torch.all(x == size * (size + 1) / 2))


def test_a_freed_communicators_handle_does_not_bring_its_context_back(world):
    """Open MPI hands a freed communicator's handle to the next one: the new
    communicator (another group) must get a context of its own."""
    from harmpi import api
    r, size = world.Get_rank(), world.Get_size()
    a = world.Dup()
    old = harmpi.init(a)
    assert _closed_form(a)
    handle = a.handle
    a.Free()                                      # frees the context with it
    assert old.broken == "finalized" and old.arena.freed
    b = world.Split(r % 2, key=r)                 # another group, maybe the same handle
    x = torch.full((500,), float(r), dtype=torch.float32)
    harmpi.allreduce(x, comm=b)
    expect = sum(q for q in range(size) if q % 2 == r % 2)
    assert torch.all(x == expect), (b.handle == handle, x[:3])
    assert api._STATE.lookup(b) is not old
    b.Free()


def test_a_late_rank_fails_instead_of_completing_an_abandoned_step(world):
    """Rank 0 gives up waiting for the last rank, which then arrives: it must
    raise too (the step is abandoned), and so must every other rank.

    The late rank arrives only after every other rank has raised (each tells
    it so over the world communicator), not after a fixed sleep: on a loaded
    machine the others' deadlines and their cascade can take longer than any
    sleep chosen on a quiet one, and a late rank that came too early would
    test something else. Bounds are in deadlines, not seconds."""
    r, size = world.Get_rank(), world.Get_size()
    if size == 1:
        pytest.skip("needs two ranks")
    deadline_s = 3.0
    comm = world.Dup()
    _short(comm, timeout_s=deadline_s)
    late = size - 1
    x = torch.full((100,), 1.0)
    try:
        if r == late:
            _wait_for_gave_up(world, size - 1)
        t0 = time.monotonic()
        with pytest.raises(harmpi.HarmpiError) as info:
            harmpi.allreduce(x, comm=comm)
        took = time.monotonic() - t0
        if r != late:
            world.send(r, dest=late, tag=_GAVE_UP)
        assert torch.all(x == 1.0), "the caller's tensor must not be touched"
        msg = str(info.value)
        if r == late:
            # fails on arrival: well before a deadline of its own would end it
            assert took < deadline_s, (took, msg)
            assert "deadline" in msg or "gave up" in msg or "did not" in msg, msg
        # every rank refuses afterwards: its context is unusable, or (a rank
        # whose own first failure was its deadline, across the rail) it now
        # reads the abandonment of the rank that gave up first
        with pytest.raises(harmpi.HarmpiError, match="unusable|gave up"):
            harmpi.allreduce(x, comm=comm)
    finally:
        world.Barrier()  # also after a failed assertion: the next test starts together


#: tag of the "I raised" messages to the late rank
_GAVE_UP = 7301


def _wait_for_gave_up(world, count, limit_s=100.0):
    """Receive ``count`` "gave up" messages (polled, so a lost one fails the
    test instead of hanging it past pytest's own timeout)."""
    end = time.monotonic() + limit_s
    got = 0
    while got < count:
        if world.Iprobe(tag=_GAVE_UP):
            world.recv(tag=_GAVE_UP)
            got += 1
        elif time.monotonic() > end:
            raise AssertionError(f"only {got} of {count} ranks reported giving up in {limit_s} s")
        else:
            time.sleep(0.01)


def test_two_threads_on_one_communicator_are_refused_not_mixed(world):
    """While the thread that set the communicator up waits inside a
    collective, a second thread's call on it raises at once (it is not the
    owner: harmpi.runtime.owner); the first completes correctly. (More in
    test_threads.py.)"""
    r, size = world.Get_rank(), world.Get_size()
    if size == 1:
        pytest.skip("needs two ranks")
    comm = world.Dup()
    _short(comm, timeout_s=10.0)
    results = {}
    if r == 0:
        def second():
            t0 = time.monotonic()
            try:
                harmpi.allreduce(torch.ones(1000), comm=comm)
            except harmpi.HarmpiError as exc:
                results["refused"] = (str(exc), time.monotonic() - t0)
        t = threading.Thread(target=second)
        t.start()                                 # while the main thread waits below
        assert _closed_form(comm, n=1000)
        t.join()
        msg, took = results["refused"]
        assert "belongs to thread 'MainThread'" in msg and took < 5.0, (msg, took)
    else:
        time.sleep(0.8)
        assert _closed_form(comm, n=1000)
    assert _closed_form(comm, n=10)               # the context is fine afterwards


def test_a_forked_child_is_not_its_parents_rank(world):
    comm = world.Dup()
    harmpi.init(comm)
    harmpi.allreduce(torch.ones(4), comm=comm)
    pid = os.fork()
    if pid == 0:                                  # the child: no MPI, no collectives
        code = 3
        try:
            harmpi.allreduce(torch.ones(4), comm=comm)
        except harmpi.HarmpiError as exc:
            code = 0 if "forked" in str(exc) else 2
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _closed_form(comm)                     # the parent is unaffected


def test_a_rank_alone_in_forcing_flat_ring_gets_a_deadline(world):
    """Its transport set-up waits for ranks that never come: a timeout on it,
    and an error on the others, within the deadline (not a hang)."""
    r, size = world.Get_rank(), world.Get_size()
    if size == 1:
        pytest.skip("needs two ranks")
    comm = world.Dup()
    _short(comm, timeout_s=1.5)
    t0 = time.monotonic()
    try:
        with pytest.raises(harmpi.HarmpiError):
            harmpi.allreduce(torch.ones(64), comm=comm,
                             algorithm="flat_ring" if r == 0 else None)
        # a deadline ended it, not pytest's timeout: a loose bound in deadlines
        # (six ranks on two busy cores stretch every step)
        assert time.monotonic() - t0 < 15 * 1.5
    finally:
        world.Barrier()


def test_after_a_mixed_call_no_rank_returns_wrong_data(world, topo):
    """One rank calls allgather while the others call allreduce (and, next,
    one rank forces leader): every rank raises; afterwards a valid call
    either gives the right sum everywhere or raises on every rank that makes
    it. Run on virtual nodes too, where it once desynchronised step counters."""
    r, size = world.Get_rank(), world.Get_size()
    if size == 1:
        pytest.skip("needs two ranks")
    for odd_one in ("allgather", "leader"):
        comm = world.Dup()
        _short(comm, timeout_s=2.0)
        x = torch.full((40,), float(r + 1))
        with pytest.raises(harmpi.HarmpiError):
            if r == size - 1 and odd_one == "allgather":
                harmpi.allgather(x, comm=comm)
            else:
                harmpi.allreduce(x, comm=comm,
                                 algorithm="leader" if r == size - 1 else None)
        for _ in range(3):
            y = torch.full((40,), float(r + 1))
            try:
                harmpi.allreduce(y, comm=comm)
            except harmpi.HarmpiError:
                # on one node a mix of allgather and allreduce stops every
                # rank at the same flag round: the context must stay usable
                assert not (topo.node_count == 1 and odd_one == "allgather")
                continue
            assert torch.all(y == size * (size + 1) / 2), (odd_one, y[:4])
        world.Barrier()



def test_a_node_whose_ranks_pick_different_algorithms_fails_alike(world, topo):
    """Two equal nodes: the last rank's size is above har_latency_max (auto
    gives it har_bandwidth), the others' below (har_latency's two-node
    step): the two meet in the same flag rounds, every rank raises with its
    tensor untouched, and the next calls give the right sum everywhere (the
    step counters stayed together)."""
    r, size = world.Get_rank(), world.Get_size()
    if topo.node_count != 2 or not topo.uniform:  # the same on every rank
        pytest.skip("two equal nodes")
    comm = world.Dup()
    _short(comm, timeout_s=5.0, har_latency_max_nbytes=4096)
    for big in (4096, 20000):  # f32: 16 KB (one slot step), 80 KB
        x = torch.full((big if r == size - 1 else 100,), float(r + 1))
        with pytest.raises(harmpi.HarmpiError) as info:
            harmpi.allreduce(x, comm=comm)
        assert not isinstance(info.value, harmpi.HarmpiTimeoutError), str(info.value)
        assert torch.all(x == r + 1)
        for n in (100, 3000, 100):
            y = torch.full((n,), float(r + 1))
            harmpi.allreduce(y, comm=comm)
            assert torch.all(y == size * (size + 1) / 2), (big, n, y[:4])
    world.Barrier()


def test_every_waiting_rank_names_the_rank_that_never_arrived(world, topo):
    """On one node and on two (equal) nodes, every rank that gives up names
    the missing rank, also those that waited on a live peer which was itself
    waiting for it (across the rail)."""
    r, size = world.Get_rank(), world.Get_size()
    if size == 1 or topo.node_count > 2 or not topo.uniform:  # the same on every rank
        pytest.skip("one node, or two equal nodes")
    comm = world.Dup()
    _short(comm, timeout_s=1.0)
    missing = size - 1
    if r == missing:
        _wait_for_gave_up(world, size - 1)   # stays away until every other rank raised
    else:
        try:
            with pytest.raises(harmpi.HarmpiTimeoutError) as info:
                harmpi.allreduce(torch.ones(10), comm=comm)
        finally:
            world.send(r, dest=missing, tag=_GAVE_UP)
        assert f"rank {missing}" in str(info.value), str(info.value)
    world.Barrier()


def test_a_sparse_tensor_is_called_sparse(world):
    with pytest.raises(harmpi.HarmpiArgumentError, match="sparse"):
        harmpi.allreduce(torch.ones(4).to_sparse())
