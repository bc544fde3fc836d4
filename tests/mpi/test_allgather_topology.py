"""allgather, barrier, info and topology under mpirun."""

import math
import os

import numpy as np
import pytest
from conftest import SMALL, assert_same_everywhere, torch
from mpi4py import MPI

import harmpi


@pytest.mark.parametrize("shape", [(0,), (1,), (7, 3), (SMALL["slot_nbytes"] // 4 + 5,), ()])
@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_allgather_concatenates_in_rank_order(small_comm, shape, kind):
    r, n = small_comm.Get_rank(), small_comm.Get_size()
    base = np.asarray(np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 1000 * r)
    x = torch.from_numpy(base.copy()) if kind == "torch" else base.copy()
    for _ in range(2):
        out = harmpi.allgather(x, comm=small_comm)
        rows = shape[0] if shape else 1
        assert tuple(out.shape) == ((rows * n,) + tuple(shape[1:]))
        got = np.asarray(out)
        for q in range(n):
            expect = (np.arange(int(np.prod(shape)), dtype=np.float32) + 1000 * q).reshape(
                (rows,) + tuple(shape[1:]))
            assert np.array_equal(got[q * rows:(q + 1) * rows], expect), q
        assert_same_everywhere(small_comm, out)


def test_allgather_bf16_default_config(world):
    r, n = world.Get_rank(), world.Get_size()
    x = torch.full((5, 1024), float(r), dtype=torch.bfloat16)
    out = harmpi.allgather(x)
    assert out.dtype == torch.bfloat16 and out.shape == (5 * n, 1024)
    assert torch.equal(out[::5, 0], torch.arange(n, dtype=torch.bfloat16))


@pytest.mark.parametrize("shape", [(0,), (1,), (7, 3), (1, 4096), (3, 5, 2)])
def test_default_allgather_runs_from_cpp_on_one_node(world, topo, shape):
    """Where harmpi._C serves the world context (one node, module built), a
    dim-0 allgather of a tensor runs from C++ (harmpi.allgather's hot path):
    every rank's x in rank order, the same bits everywhere; elsewhere it
    declines (-1) and the Python path runs."""
    from harmpi.runtime.registry import STATE  # noqa: PLC0415

    r, n = world.Get_rank(), world.Get_size()
    x = (torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + 100 * r) \
        .to(torch.bfloat16)
    want = torch.cat([(torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
                       + 100 * q).to(torch.bfloat16) for q in range(n)])
    assert torch.equal(harmpi.allgather(x), want)  # (the first tensor call attaches the module)
    native = STATE.native_allgather
    if not harmpi.info()["native"].startswith("serving"):
        assert native is None or native(x) == -1
        return
    got = native(x)
    assert isinstance(got, torch.Tensor) == (topo.node_count == 1)
    if topo.node_count == 1:
        assert torch.equal(got, want)
        assert_same_everywhere(world, got)
        assert native(x.float()).dtype == torch.float32  # another format: its own kind
        assert native(torch.zeros(())) == -1  # 0-d: the Python path's (it counts as (1,))
        # into a given tensor of any shape with n times x's elements (as
        # all_gather_into_tensor): filled in place; one it cannot take
        # (another dtype or count, not contiguous) goes to the Python path,
        # which explains its refusal
        out = torch.full((n * max(1, x.numel()),), -1.0, dtype=torch.bfloat16)[:n * x.numel()]
        back = native(x, out)
        assert isinstance(back, torch.Tensor) and back.data_ptr() == out.data_ptr()
        assert torch.equal(out, want.reshape(-1))
        assert native(x, out.float()) == -1
        if x.numel():
            assert native(x, torch.empty(n * x.numel() + 1, dtype=torch.bfloat16)) == -1
        if n * x.numel() > 1:  # (a view of one element is contiguous)
            assert native(x, torch.empty(2 * n * x.numel(), dtype=torch.bfloat16)[::2]) == -1
        assert harmpi.allgather(x, out=out) is out and torch.equal(out, want.reshape(-1))


def test_ranks_that_gather_different_shapes_fail_alike_then_recover(world):
    """On the C++ path as on Python's: a disagreement raises on every rank
    and the next call is right."""
    r, n = world.Get_rank(), world.Get_size()
    if n == 1:
        pytest.skip("one rank cannot disagree")
    x = torch.full((1, 64), float(r), dtype=torch.bfloat16)
    harmpi.allgather(x)
    with pytest.raises(harmpi.HarmpiMismatchError):
        harmpi.allgather(torch.zeros((1, 64 + r), dtype=torch.bfloat16))
    out = harmpi.allgather(x)
    assert torch.equal(out[:, 0], torch.arange(n, dtype=torch.bfloat16))


def test_barrier(small_comm):
    for _ in range(5):
        harmpi.barrier(small_comm)


def test_topology_matches_environment(world, topo):
    size = world.Get_size()
    k = os.environ.get("HARMPI_RANKS_PER_NODE")
    assert topo.size == size and topo.rank == world.Get_rank()
    assert sum(topo.node_sizes) == size
    if k:
        k = int(k)
        assert topo.node_count == math.ceil(size / k)
        assert topo.node_sizes == tuple(min(k, size - i * k) for i in range(topo.node_count))
        assert topo.local_rank == topo.rank % k and topo.node_index == topo.rank // k
    assert topo.node_ranks[topo.node_index][topo.local_rank] == topo.rank
    info = harmpi.info()
    assert info["nodes"] == topo.node_count and info["ranks"] == size
    assert info["ranks_per_node"] == list(topo.node_sizes)
    if topo.node_count > 1:
        wanted = os.environ.get("HARMPI_TRANSPORT", "auto")
        # auto: no RDMA here, and every rank reaches every other over TCP
        assert info["transport"] == ("tcp" if wanted == "auto" else wanted)
        assert info["transport_reason"].startswith("auto: " if wanted == "auto" else
                                                   f"HARMPI_TRANSPORT={wanted}")
        # the allgather's rail steps: compiled over tcp on 2^k equal nodes
        G = topo.node_count
        rail_steps = info["transport"] == "tcp" and topo.uniform and G & (G - 1) == 0
        assert ("recursive doubling over the tcp rail" in info["allgather"]) == rail_steps, \
            info["allgather"]
    else:
        assert info["transport"] == "none"


@pytest.mark.parametrize("obj", [None, 0, "x" * 5000, ("host", ["10.0.0.1"], 4242)])
def test_set_up_collectives_poll_and_equal_mpis(world, obj):
    """The set-up's polled collectives (base.topology: allgather_polled,
    barrier_polled, dup_polled) give what MPI's blocking ones give, with a
    different object size on every rank, and a duplicate that works."""
    from harmpi.base.topology import allgather_polled, barrier_polled, dup_polled

    r = world.Get_rank()
    mine = (r, obj, [r] * r)
    assert allgather_polled(world, mine, 30.0, "test") == world.allgather(mine)
    barrier_polled(world, 30.0, "test")
    dup = dup_polled(world, 30.0, "test")
    try:
        assert dup.Get_size() == world.Get_size() and dup.Get_rank() == r
        assert MPI.Comm.Compare(dup, world) == MPI.CONGRUENT
        assert allgather_polled(dup, r, 30.0, "test") == list(range(world.Get_size()))
    finally:
        dup.Free()


def test_allgather_both_spellings():
    import harmpi.allgather  # noqa: F401
    out = harmpi.allgather(torch.ones(2))
    assert out.shape == (2 * harmpi.info()["ranks"],)


def test_sub_communicators_have_their_own_context(world):
    """Even and odd ranks reduce separately; each split gets its own window."""
    r = world.Get_rank()
    sub = world.Split(r % 2, key=r)
    x = torch.full((3000,), float(r), dtype=torch.float32)
    harmpi.allreduce(x, comm=sub)
    expect = sum(q for q in range(world.Get_size()) if q % 2 == r % 2)
    assert torch.all(x == expect)
    g = harmpi.allgather(torch.tensor([float(r)]), comm=sub)
    assert g.tolist() == [float(q) for q in range(world.Get_size()) if q % 2 == r % 2]
    assert harmpi.info(sub)["ranks"] == sub.Get_size()


def test_allgather_into_out(small_comm):
    """out= receives the result (any shape with the right element count) and
    is returned; a wrong out is refused before any data moves."""
    r, n_ranks = small_comm.Get_rank(), small_comm.Get_size()
    for n in (0, 3, 700):
        x = torch.full((n, 2), float(r), dtype=torch.bfloat16)
        out = torch.empty(n_ranks * n * 2, dtype=torch.bfloat16)
        assert harmpi.allgather(x, comm=small_comm, out=out) is out
        expect = torch.arange(n_ranks, dtype=torch.bfloat16).repeat_interleave(2 * n)
        assert torch.equal(out, expect)
        xn = np.full(n, r, np.float32)
        outn = np.empty((n_ranks, n), np.float32)
        assert harmpi.allgather(xn, comm=small_comm, out=outn) is outn
        expect = np.repeat(np.arange(n_ranks, dtype=np.float32), n).reshape(n_ranks, n)
        assert np.array_equal(outn, expect)
    x = torch.ones(4)
    for bad in (torch.empty(4 * n_ranks + 1), torch.empty(4 * n_ranks, dtype=torch.float64),
                np.empty(4 * n_ranks, np.float32), torch.empty(8 * n_ranks)[::2]):
        with pytest.raises(harmpi.HarmpiArgumentError):
            harmpi.allgather(x, comm=small_comm, out=bad)


def test_allgather_into_out_on_world_checks_shapes(world):
    """The world communicator's one-node fast path (tensors into out=) still
    compares shapes across ranks and returns the right blocks."""
    r, n_ranks = world.Get_rank(), world.Get_size()
    x = torch.full((2, 3), float(r), dtype=torch.float32)
    out = torch.empty(6 * n_ranks, dtype=torch.float32)
    assert harmpi.allgather(x, out=out) is out
    assert torch.equal(out, torch.arange(n_ranks, dtype=torch.float32).repeat_interleave(6))
    if n_ranks > 1:
        y = torch.zeros((2, 3) if r == 0 else (3, 2))  # same size, other shape
        with pytest.raises(harmpi.HarmpiMismatchError):
            harmpi.allgather(y, out=out)
    z = harmpi.allgather(torch.full((1,), float(r), dtype=torch.bfloat16))
    assert torch.equal(z, torch.arange(n_ranks, dtype=torch.bfloat16))


def _gather_expected(n, size):
    """Every rank's bf16 tensor in the large allgather tests (rank q's own)."""
    return [(torch.arange(n) % 251 + 1000 * q).to(torch.bfloat16) for q in range(size)]


def test_large_allgather_reads_each_peer_in_place(world, topo):
    """One node where the kernel lets ranks read each other: from
    CMA_MIN_NBYTES per rank each peer's tensor is read straight into out
    (info says so); right and bitwise the same on every rank at sizes around
    that switch and up to past 4 MiB, through the default call (C++ where it
    serves) and out=; ranks on either side of the switch fail alike, then
    the next call is right."""
    from harmpi.node import cma
    r, size = world.Get_rank(), world.Get_size()
    if topo.node_count != 1 or size == 1:
        pytest.skip("one node of two ranks or more")
    note = harmpi.info()["allgather"]
    assert note.startswith("single copy"), note
    k = cma.CMA_MIN_NBYTES // 2
    for n in (k - 1, k, k + 1, 3 * k + 7, (4 << 20) // 2 + 3):
        xs = _gather_expected(n, size)
        x = xs[r]
        out = harmpi.allgather(x)
        assert torch.equal(out, torch.cat(xs)), n
        assert_same_everywhere(world, out.float().numpy())
        out2 = torch.full((size * n,), -1.0, dtype=torch.bfloat16)
        assert harmpi.allgather(x, out=out2) is out2
        assert torch.equal(out2, out), n
    with pytest.raises(harmpi.HarmpiMismatchError):
        harmpi.allgather(torch.zeros(k + (r % 2) * 2 - 1, dtype=torch.bfloat16))
    x = torch.full((k + 5,), float(r), dtype=torch.bfloat16)
    assert torch.equal(harmpi.allgather(x)[::k + 5], torch.arange(size, dtype=torch.bfloat16))


def test_a_rank_that_cannot_read_its_peers_keeps_the_node_on_the_slots(world, topo, monkeypatch):
    """The probe's verdict is the node's: one rank whose reads fail (here
    faked) puts every local rank of a new context on the two-copy path,
    which still gathers large tensors right."""
    from harmpi.node import cma
    r, size = world.Get_rank(), world.Get_size()
    if topo.node_count != 1 or size == 1:
        pytest.skip("one node of two ranks or more")
    if r == size - 1:
        monkeypatch.setattr(cma, "_read_word", lambda libc, pid, addr: None)
    comm = world.Dup()
    try:
        note = harmpi.info(comm)["allgather"]
        assert note.startswith("through the slots (process_vm_readv of local rank"), note
        n = cma.CMA_MIN_NBYTES
        xs = _gather_expected(n, size)
        out = harmpi.allgather(xs[r], comm=comm)
        assert torch.equal(out, torch.cat(xs))
    finally:
        comm.Free()
