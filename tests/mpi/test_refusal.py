"""A rank that refuses its own arguments fails the call on every rank (issue 35, finding 1).

Before: the refusing rank raised before communicating, its peers waited in
the call, and the refusing rank's next call paired with the peers' current
one (wrong values on every rank, then a timeout). Now the refusing rank
takes part in the call as a refusal (harmpi.api.refuse): every peer fails
that call at once, naming it, and then either the next calls pair right
(one node) or the context is unusable on every rank at once (several
nodes: a disagreement across nodes may have left step counters apart), and
never does a rank return wrong data.
"""

import dataclasses
import time

import numpy as np
import pytest
import torch

import harmpi

#: a refusal must end every rank's call long before this deadline
TIMEOUT_S = 20.0


def _comm(world, **kw):
    comm = world.Dup()
    cfg = dataclasses.replace(harmpi.Config.from_env(), timeout_s=TIMEOUT_S, **kw)
    harmpi.init(comm, config=cfg)
    return comm


def _agree(world, problem):
    """Every rank's problem (None: none), asserted on every rank, so a check
    that fails on one rank fails the test everywhere instead of leaving the
    others in a collective of the test's own."""
    problems = world.allgather(problem)
    bad = [(r, p) for r, p in enumerate(problems) if p]
    assert not bad, bad


def _after(comm, world):
    """The calls after a refusal: right everywhere, or refused everywhere
    (an unusable context); never wrong values. Returns 'usable'/'unusable'."""
    r, size = comm.Get_rank(), comm.Get_size()
    outcome, problem = "usable", None
    t0 = time.monotonic()
    try:
        for i in range(3):
            x = torch.full((6,), float(10 * i + r + 1))
            try:
                harmpi.allreduce(x, comm=comm)
            except harmpi.HarmpiError as exc:
                # refused at the entry, or told by a rail peer whose context gave up
                assert "unusable" in str(exc) or "gave up" in str(exc), exc
                outcome = "unusable"
                break
            assert (x == sum(10 * i + k + 1 for k in range(size))).all(), (i, x)
        if outcome == "usable":
            src = torch.arange(2 * size, dtype=torch.float32) + 100 * r
            got = harmpi.alltoall(src, comm=comm)
            want = torch.tensor([100.0 * k + 2 * r + j for k in range(size) for j in range(2)])
            assert torch.equal(got, want), got
        assert time.monotonic() - t0 < TIMEOUT_S / 2, time.monotonic() - t0
    except (AssertionError, harmpi.HarmpiError) as exc:
        problem = f"after: {type(exc).__name__}: {exc}"
    _agree(world, problem)
    outcomes = world.allgather(outcome)
    assert len(set(outcomes)) == 1, outcomes  # the same on every rank
    return outcome


def _refused_on_rank0(comm, world, good, bad, topo):
    """Rank 0 makes ``bad`` (a HarmpiArgumentError), the others ``good``."""
    r = comm.Get_rank()
    t0 = time.monotonic()
    problem = None
    try:
        (bad if r == 0 else good)()
        problem = "the call did not raise"
    except harmpi.HarmpiError as exc:
        took, msg = time.monotonic() - t0, f"{type(exc).__name__}: {exc}"
        if r == 0:
            ok = isinstance(exc, harmpi.HarmpiArgumentError)
        elif topo.node_count == 1:  # the refusal is read from the flags
            ok = "rank 0" in msg and "refused" in msg
        else:
            # across nodes a rank learns from whichever comes first: the
            # refusal in its node's flags, a poisoned rail exchange, or a
            # peer that gave up on the disagreement
            ok = any(w in msg for w in ("refuse", "gave up", "disagree"))
        ok = ok and "never called" not in msg
        if not ok or took >= TIMEOUT_S / 2:
            problem = f"after {took:.2f} s: {msg}"
    _agree(world, problem)
    return _after(comm, world)


def test_a_bad_alltoall_split_on_one_rank(world, topo):
    comm = _comm(world)
    size = comm.Get_size()
    if size == 1:
        return
    x = torch.arange(2 * size, dtype=torch.float32)
    counts = [2] * size
    bad_counts = [-1, 3] + [2] * (size - 2)
    outcome = _refused_on_rank0(
        comm, world, lambda: harmpi.alltoall(x, counts, comm=comm),
        lambda: harmpi.alltoall(x, bad_counts, comm=comm), topo)
    if topo.node_count == 1:
        assert outcome == "usable"


def test_an_unsupported_dtype_on_one_rank(world, topo):
    comm = _comm(world)
    if comm.Get_size() == 1:
        return
    outcome = _refused_on_rank0(
        comm, world, lambda: harmpi.allreduce(torch.ones(5), comm=comm),
        lambda: harmpi.allreduce(torch.ones(5, dtype=torch.int32), comm=comm), topo)
    if topo.node_count == 1:
        assert outcome == "usable"


def test_a_wrong_allgather_output_on_one_rank(world, topo):
    comm = _comm(world)
    size = comm.Get_size()
    if size == 1:
        return
    x = torch.ones(3)
    outcome = _refused_on_rank0(
        comm, world, lambda: harmpi.allgather(x, comm=comm, out=torch.empty(3 * size)),
        lambda: harmpi.allgather(x, comm=comm, out=torch.empty(3 * size + 1)), topo)
    if topo.node_count == 1:
        assert outcome == "usable"


def test_a_bad_logits_route_on_one_rank(world, topo):
    comm = _comm(world)
    if comm.Get_size() == 1:
        return
    shard = torch.ones(2, 5)
    outcome = _refused_on_rank0(
        comm, world, lambda: harmpi.gather_logits(shard, comm=comm),
        lambda: harmpi.gather_logits(shard, comm=comm, route="bogus"), topo)
    if topo.node_count == 1:
        assert outcome == "usable"


def test_a_refusal_meets_a_zero_element_call(world, topo):
    """A zero-element all-reduce moves nothing, yet it must not pair with a
    refusal as if both had called the same thing."""
    comm = _comm(world)
    if comm.Get_size() == 1:
        return
    _refused_on_rank0(
        comm, world, lambda: harmpi.allreduce(torch.ones(0), comm=comm),
        lambda: harmpi.allreduce(torch.ones(0), op="max", comm=comm), topo)


def test_every_rank_refusing_keeps_the_context(world, topo):
    """The common case (the same bad call everywhere) still leaves a usable
    context on every layout: each rank raises its own error."""
    comm = _comm(world)
    size = comm.Get_size()
    x = torch.arange(2 * size, dtype=torch.float32)
    for _ in range(2):
        with pytest.raises(harmpi.HarmpiArgumentError, match="send_counts"):
            harmpi.alltoall(x, [-1, 2 * size + 1] + [0] * (size - 2) if size > 1 else [-1],
                            comm=comm)
        with pytest.raises(harmpi.HarmpiArgumentError):
            harmpi.allreduce(np.ones(4, np.int32), comm=comm)
    assert _after(comm, world) == "usable"


@pytest.fixture(scope="module")
def torch_dist():
    """The default process group on backend harmpi for this file's torch
    tests, destroyed after them (the torch files after this one make their own)."""
    import torch.distributed as dist  # noqa: PLC0415
    from conftest import harmpi_process_group  # noqa: PLC0415

    harmpi_process_group()
    yield dist
    dist.destroy_process_group()


def test_torch_all_to_all_single_with_a_bad_split_on_one_rank(world, topo, torch_dist):
    """The issue's own case, through the torch backend."""
    dist = torch_dist
    size, r = dist.get_world_size(), dist.get_rank()
    if size == 1:
        return
    # a group of its own: a failure across nodes leaves it unusable, and the
    # later test files use the default group
    g = dist.new_group(list(range(size)))
    x = torch.arange(2 * size, dtype=torch.float32) + 10 * r
    out = torch.empty(2 * size)
    splits = [2] * size
    t0 = time.monotonic()
    with pytest.raises(harmpi.HarmpiError):
        if r == 0:
            dist.all_to_all_single(out, x, splits, [-1, 3] + [2] * (size - 2), group=g)
        else:
            dist.all_to_all_single(out, x, splits, splits, group=g)
    assert time.monotonic() - t0 < 60
    # the next calls: right, or refused on every rank; never wrong values
    ok = True
    try:
        dist.all_to_all_single(out, x, splits, splits, group=g)
    except harmpi.HarmpiError:
        ok = False
    if ok:
        want = torch.tensor([10.0 * k + 2 * r + j for k in range(size) for j in range(2)])
        assert torch.equal(out, want), out
    assert len(set(world.allgather(ok))) == 1


def test_counts_beyond_any_memory_are_refused_clearly(world):
    """recv_counts of 2**62 overflowed into a raw torch error (finding 11);
    every rank refuses them the same way, so the context goes on."""
    comm = _comm(world)
    size = comm.Get_size()
    x = torch.zeros(size)
    for kw in (dict(recv_counts=[2 ** 62] * size), dict()):
        counts = [1] * size if kw else [2 ** 62] * size
        with pytest.raises(harmpi.HarmpiArgumentError, match=r"at most 2\*\*48 rows"):
            harmpi.alltoall(x, counts, comm=comm, **kw)
    assert _after(comm, world) == "usable"


def test_a_count_disagreement_says_which_outputs_are_unwritten(world, topo):
    """The pair error spoke for every rank ("No rank's output is written")
    where ranks whose own rows all matched may complete (finding 11)."""
    comm = _comm(world)
    size, r = comm.Get_size(), comm.Get_rank()
    if size == 1:
        return
    x = torch.zeros(2 * size)
    want = [2] * size
    if r == 0:
        want = [1, 3] + [2] * (size - 2)
    x = torch.arange(2 * size, dtype=torch.float32) + 100 * r
    try:
        got, _ = harmpi.alltoall(x, [2] * size, comm=comm, recv_counts=want)
    except harmpi.HarmpiError as exc:
        assert "No rank's output" not in str(exc) and "This rank's output" in str(exc), exc
    else:
        # (across nodes, a node whose own pairs all match completes: its rows are right)
        assert r != 0 and topo.node_index != 0
        want_rows = torch.tensor([100.0 * k + 2 * r + j for k in range(size) for j in range(2)])
        assert torch.equal(got, want_rows), got
    _after(comm, world)


def _torch_group(dist):
    return dist, dist.new_group(list(range(dist.get_world_size())))


def _bad_all_reduce(dist, g, size):
    t = torch.ones(4)
    dist.all_reduce(t, op=dist.ReduceOp.BAND, group=g)  # BAND of floats: refused


def _bad_all_gather(dist, g, size):
    dist.all_gather([torch.empty(4) for _ in range(size + 1)], torch.ones(4), group=g)


def _good_all_reduce(dist, g, size):
    dist.all_reduce(torch.ones(4), group=g)


def _good_all_gather(dist, g, size):
    dist.all_gather([torch.empty(4) for _ in range(size)], torch.ones(4), group=g)


@pytest.mark.parametrize("bad, good", [(_bad_all_reduce, _good_all_reduce),
                                       (_bad_all_gather, _good_all_gather)],
                         ids=["all_reduce-op", "all_gather-outputs"])
def test_torch_backend_refusals_reach_the_peers(world, bad, good, torch_dist):
    dist, g = _torch_group(torch_dist)
    size, r = dist.get_world_size(), dist.get_rank()
    if size == 1:
        return
    t0 = time.monotonic()
    with pytest.raises(harmpi.HarmpiError) as info:
        (bad if r == 0 else good)(dist, g, size)
    assert time.monotonic() - t0 < 60, info.value
    if r == 0:
        assert isinstance(info.value, harmpi.HarmpiArgumentError), info.value
    ok = True
    t = torch.full((3,), float(r + 1))
    try:
        dist.all_reduce(t, group=g)
    except harmpi.HarmpiError:
        ok = False
    if ok:
        assert (t == size * (size + 1) / 2).all(), t
    assert len(set(world.allgather(ok))) == 1
