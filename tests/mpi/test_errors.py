"""Bad input: clear errors before any data moves, on every rank; deadlines, not hangs."""

import dataclasses

import numpy as np
import pytest
from conftest import torch
from mpi4py import MPI

import harmpi
from harmpi.algorithms.har_latency import rail_chunk_nbytes
from harmpi.algorithms.rail_turns import HALVING_MIN_NBYTES


def test_unsupported_dtype_is_rejected_locally(small_comm):
    with pytest.raises(harmpi.HarmpiArgumentError, match="unsupported"):
        harmpi.allreduce(np.zeros(4, np.int32), comm=small_comm)
    with pytest.raises(harmpi.HarmpiArgumentError, match="unsupported"):
        harmpi.allreduce(torch.zeros(4, dtype=torch.int64), comm=small_comm)
    with pytest.raises(harmpi.HarmpiArgumentError, match="numpy array or a torch tensor"):
        harmpi.allreduce([1.0, 2.0], comm=small_comm)


def test_layout_and_writability(small_comm):
    with pytest.raises(harmpi.HarmpiArgumentError, match="not contiguous"):
        harmpi.allreduce(torch.zeros(4, 4).t(), comm=small_comm)
    with pytest.raises(harmpi.HarmpiArgumentError, match="C-contiguous"):
        harmpi.allreduce(np.zeros((4, 4), np.float32)[:, 1], comm=small_comm)
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(harmpi.HarmpiArgumentError, match="read-only"):
        harmpi.allreduce(ro, comm=small_comm)
    with pytest.raises(harmpi.HarmpiArgumentError, match="requires grad"):
        harmpi.allreduce(torch.zeros(4, requires_grad=True), comm=small_comm)


def test_op_and_algorithm_are_checked(small_comm, topo):
    x = torch.ones(8)
    for op in ("max", "prod", MPI.MAX, None):
        with pytest.raises(harmpi.HarmpiArgumentError, match="not supported"):
            harmpi.allreduce(x, op=op, comm=small_comm)
    with pytest.raises(harmpi.HarmpiArgumentError, match="unknown algorithm"):
        harmpi.allreduce(x, comm=small_comm, algorithm="butterfly")
    if small_comm.Get_size() > 1:
        bad = ["har_latency"] if topo.node_count == 1 else ["shm"]
        for name in bad:  # every rank sees the same topology, so every rank raises
            with pytest.raises(harmpi.HarmpiArgumentError, match=name):
                harmpi.allreduce(x, comm=small_comm, algorithm=name)
    harmpi.allreduce(x, comm=small_comm, op="sum")
    assert torch.all(x == small_comm.Get_size())


@pytest.mark.parametrize("odd", ["last", "first"])
@pytest.mark.parametrize("algorithm", ["auto", "leader", "flat_ring"])
def test_mismatched_sizes_raise_on_every_rank(small_comm, algorithm, odd):
    """The odd rank out is the last rank, or rank 0 (a node leader: with
    three nodes its larger tensor travels over the rail to the extra node
    of the recursive doubling, which must not fail alone)."""
    r, n_ranks = small_comm.Get_rank(), small_comm.Get_size()
    if n_ranks == 1:
        pytest.skip("needs two ranks")  # same on every rank (n_ranks is global)
    odd_rank = n_ranks - 1 if odd == "last" else 0
    for n_odd in (11, 3000):  # one chunk, and more chunks than the others
        n = n_odd if r == odd_rank else 10
        x = torch.full((n,), 7.0)
        with pytest.raises(harmpi.HarmpiMismatchError, match="ranks disagree"):
            harmpi.allreduce(x, comm=small_comm, algorithm=algorithm)
        assert torch.all(x == 7.0), "the caller's tensor must not be touched"
    # the context is still usable afterwards
    y = torch.ones(10)
    harmpi.allreduce(y, comm=small_comm, algorithm=algorithm)
    assert torch.all(y == n_ranks)


def test_mismatched_large_sizes_with_default_settings(world):
    """The default call past one rail step (two nodes of one rank: the
    reduce-scatter + allgather steps of har_latency; four: its recursive
    halving): ranks that disagree by a few elements, or where one call takes
    one exchange (or doubling) and the other the two-exchange steps (or
    halving), rank 0 alone or half the ranks against the other half (their
    disagreement then seen only in a later turn), raise on every rank with x
    untouched; the context then still sums."""
    comm = world.Dup()
    try:
        r, size = comm.Get_rank(), comm.Get_size()
        if size == 1:
            pytest.skip("needs two ranks")
        step = rail_chunk_nbytes(harmpi.Config.from_env().slot_nbytes) // 4   # f32 elements
        halve = HALVING_MIN_NBYTES // 4
        for mine, others, split in ((step + 5, step + 7, 1), (step + 5, step - 3, 1),
                                    (3 * step, 3 * step + 2, 1), (step + 5, step + 7, size // 2),
                                    (halve - 9, halve + 9, 1), (halve - 9, halve + 9, size // 2)):
            n = mine if r < split else others
            x = torch.full((n,), 7.0)
            with pytest.raises(harmpi.HarmpiMismatchError, match="ranks disagree"):
                harmpi.allreduce(x, comm=comm)
            assert torch.all(x == 7.0), "the caller's tensor must not be touched"
        y = torch.arange(2 * step + 3, dtype=torch.float32)
        harmpi.allreduce(y, comm=comm)
        assert torch.equal(y, size * torch.arange(2 * step + 3, dtype=torch.float32))
    finally:
        comm.Free()  # frees the context with it


def test_mismatched_dtype_raises_on_every_rank(small_comm):
    r, n_ranks = small_comm.Get_rank(), small_comm.Get_size()
    if n_ranks == 1:
        pytest.skip("needs two ranks")
    x = torch.ones(8, dtype=torch.float32 if r else torch.float16)
    x16 = torch.ones(16, dtype=torch.float16) if r == 0 else None
    with pytest.raises(harmpi.HarmpiMismatchError):
        harmpi.allreduce(x16 if r == 0 else x, comm=small_comm)  # same bytes, other dtype


def test_a_rank_that_never_arrives_times_out(world):
    """Every waiting rank raises a HarmpiTimeoutError naming who it waited for
    (rank 0 itself, or a peer that is stuck waiting for rank 0)."""
    if world.Get_size() == 1:
        pytest.skip("needs two ranks")
    comm = world.Dup()
    cfg = dataclasses.replace(harmpi.Config.from_env(), timeout_s=1.0)
    ctx = harmpi.init(comm, config=cfg)
    # (several nodes over tcp: a rail peer that gave up closes its sockets,
    # which its peers see as a transport error naming it)
    expected = harmpi.HarmpiTimeoutError if ctx.topo.node_count == 1 else harmpi.HarmpiError
    if comm.Get_rank() != 0:
        with pytest.raises(expected, match=r"rank \d+") as info:
            harmpi.allreduce(torch.ones(100), comm=comm)
        assert "HARMPI_TIMEOUT_S" in str(info.value) or "gave up" in str(info.value)
        if ctx.topo.node_count == 1:  # one node: everyone waits on rank 0's flag
            assert "local rank 0 (rank 0)" in str(info.value)
        with pytest.raises(harmpi.HarmpiError, match="unusable"):
            harmpi.allreduce(torch.ones(100), comm=comm)
    else:
        ctx.broken = "test: this rank skipped a collective on purpose"
    world.Barrier()


def test_allgather_shape_mismatch(small_comm):
    r, n_ranks = small_comm.Get_rank(), small_comm.Get_size()
    if n_ranks == 1:
        pytest.skip("needs two ranks")
    x = torch.zeros((2, 6) if r == 0 else (3, 4))
    with pytest.raises(harmpi.HarmpiMismatchError):
        harmpi.allgather(x, comm=small_comm)


@pytest.mark.parametrize("odd", ["first", "last", "upper_half"])
@pytest.mark.parametrize("rows", [1, 700])
def test_allgather_count_mismatch_fails_every_rank_unwritten(small_comm, odd, rows):
    """Some ranks gather 5 columns, the others 4: every rank raises, and
    no output is written. On 4 one-rank nodes the upper half disagrees with
    the lower only in the rail's second turn (the first pairs 0-1 and 2-3);
    700 rows are many chunks of the 4 KiB slots."""
    r, n_ranks = small_comm.Get_rank(), small_comm.Get_size()
    if n_ranks == 1:
        pytest.skip("needs two ranks")
    odd_ranks = {"first": {0}, "last": {n_ranks - 1},
                 "upper_half": set(range(n_ranks // 2, n_ranks))}[odd]
    x = torch.full((rows, 5 if r in odd_ranks else 4), float(r + 1))
    out = torch.full((n_ranks * x.numel(),), -1.0)
    with pytest.raises(harmpi.HarmpiMismatchError):
        harmpi.allgather(x, comm=small_comm, out=out)
    assert torch.all(out == -1.0), "no output after a disagreement"
    y = torch.full((rows, 4), float(r))
    got = harmpi.allgather(y, comm=small_comm)
    assert torch.equal(got[::rows, 0], torch.arange(n_ranks, dtype=torch.float32))


def test_native_entry_point_errors_and_gate(world, topo):
    """harmpi.allreduce(t) on the world context goes through harmpi.native
    when it is built: a mismatch still raises on every rank and leaves the
    context usable, and a broken context is refused, not served."""
    from harmpi import api

    r, n_ranks = world.Get_rank(), world.Get_size()
    ctx = harmpi.init()
    harmpi.allreduce(torch.ones(4))  # torch seen: the entry point attaches
    if api._STATE.native is None:  # the same on every rank
        pytest.skip(f"native entry point not serving: {harmpi.info()['native']}")
    assert harmpi.info()["native"].startswith("serving")
    x = torch.ones(100 if r == 0 else 200, dtype=torch.bfloat16)
    if n_ranks > 1:
        with pytest.raises(harmpi.HarmpiMismatchError, match="ranks disagree"):
            harmpi.allreduce(x)
        assert torch.all(x == 1), "the caller's tensor must not be touched"
    y = torch.full((5000,), 2.0, dtype=torch.bfloat16)
    assert harmpi.allreduce(y) is y and torch.all(y == 2 * n_ranks)
    ctx.broken = "test: marked broken on purpose"
    try:
        assert ctx.ctl[0]["gate"] == 0
        with pytest.raises(harmpi.HarmpiError, match="unusable"):
            harmpi.allreduce(torch.ones(4))
    finally:
        ctx.broken = None
        ctx.ctl[0]["gate"] = 1
    assert api._STATE.native is not None
    harmpi.allreduce(torch.ones(4))

