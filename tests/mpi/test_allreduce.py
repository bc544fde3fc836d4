"""harmpi.allreduce under mpirun: correctness against a float64 reference,
bitwise agreement across ranks, chunk boundaries, every algorithm, repeats."""

import dataclasses

import numpy as np
import pytest
from conftest import (
    DTYPES,
    ITEMSIZE,
    SMALL,
    as_f64,
    assert_same_everywhere,
    error_bound,
    make_input,
    torch,
)

import harmpi
from harmpi.algorithms.har_latency import rail_chunk_nbytes
from harmpi.algorithms.rail_turns import HALVING_MIN_NBYTES

SLOT = SMALL["slot_nbytes"]


def valid_algorithms(topo):
    """None first: the path users take (no algorithm=: the context's entry)."""
    algos = [None, "auto", "leader", "flat_ring"]
    if topo.node_count == 1:
        algos += ["shm", "shm_rsag"]
    elif topo.uniform:
        algos += ["har_latency", "har_bandwidth"]
    return algos


def sizes_for(name):
    """Element counts around every chunk and threshold boundary of the SMALL config."""
    isz = ITEMSIZE[name]
    slot = SLOT // isz
    out = {0, 1, 7, slot - 1, slot, slot + 1, 3 * slot + 5,
           SMALL["small_max_nbytes"] // isz + 1, SMALL["har_latency_max_nbytes"] // isz + 1}
    return sorted(out)


def check(comm, topo, name, n, kind, algorithm, repeats=2):
    world_size = comm.Get_size()
    for rep in range(repeats):
        x, ref = make_input(name, n, comm.Get_rank(), seed=rep, kind=kind)
        all_refs = comm.allgather(ref)
        exact = np.sum(all_refs, axis=0) if n else np.zeros(0)
        bound = error_bound(name, np.sum(np.abs(all_refs), axis=0), world_size, topo.node_count,
                            algorithm)
        dtype = "bf16" if (kind == "numpy" and name == "bf16") else None
        out = harmpi.allreduce(x, comm=comm, algorithm=algorithm, dtype=dtype)
        assert out is x
        got = as_f64(x, name)
        err = np.abs(got - exact)
        assert np.all(err <= bound), (
            f"{name} n={n} {algorithm}: max error {err.max()} exceeds bound at "
            f"{int(np.argmax(err - bound))}")
        assert_same_everywhere(comm, x)


@pytest.mark.parametrize("name", list(DTYPES))
def test_sizes_around_chunks_torch(small_comm, topo, name):
    for algorithm in valid_algorithms(topo):
        for n in sizes_for(name):
            check(small_comm, topo, name, n, "torch", algorithm)


@pytest.mark.parametrize("name", list(DTYPES))
def test_numpy_inputs(small_comm, topo, name):
    for n in (0, 5, SLOT // ITEMSIZE[name] + 3):
        check(small_comm, topo, name, n, "numpy", "auto")


def default_size_classes(name):
    """Element counts of every size class of the default config: empty, tiny,
    the decode size, each side of small_max (sum every slot / reduce-scatter)
    and of har_latency_max (full tensor / one share on the rail), each side
    of one rail step (har_latency's chunk) and of the rail's halving size
    (more than two one-rank nodes), and past one slot (several chunks), of
    the world context."""
    cfg = harmpi.Config()
    isz = ITEMSIZE[name]
    # the switches the world context runs with (the cost model's for this
    # topology, or the job's settings), capped: a switch that never happens
    t = {k: min(v, 4 * cfg.slot_nbytes) for k, v in harmpi.info()["thresholds"].items()}
    small, har = t["small_max_nbytes"], t["har_latency_max_nbytes"]
    rail = rail_chunk_nbytes(cfg.slot_nbytes) // isz
    return [0, 1, 7, 5120, small // isz, small // isz + 1, har // isz, har // isz + 3,
            rail, rail + 1, HALVING_MIN_NBYTES // isz, HALVING_MIN_NBYTES // isz + 3,
            cfg.slot_nbytes // isz + 5, 2 * cfg.slot_nbytes // isz + 7]


@pytest.mark.parametrize("name", ["bf16", "f32"])
def test_the_default_call_at_every_size_class(world, topo, name):
    """harmpi.allreduce(t) with every argument at its default, on the world
    communicator: the native entry point where it serves (one node), the
    context's compiled or Python entry otherwise."""
    for n in default_size_classes(name):
        check(world, topo, name, n, "torch", None, repeats=2)
        check(world, topo, name, n, "numpy", None, repeats=1)


def test_the_native_entry_serves_the_default_call_on_one_node(world, topo):
    from harmpi import native
    harmpi.allreduce(torch.ones(2))
    status = harmpi.info()["native"]
    if topo.node_count == 1 and native.load() is not None and harmpi.Config.from_env().native:
        assert status.startswith("serving"), status
    else:
        assert not status.startswith("serving"), status


def test_closed_form_every_algorithm(small_comm, topo):
    """Sum of (rank + 1) over n ranks is n(n+1)/2, exactly, in every dtype."""
    n_ranks = small_comm.Get_size()
    for algorithm in valid_algorithms(topo):
        for tdtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            x = torch.full((3000, 2), float(small_comm.Get_rank() + 1), dtype=tdtype)
            harmpi.allreduce(x, comm=small_comm, algorithm=algorithm)
            assert torch.all(x == n_ranks * (n_ranks + 1) / 2), (algorithm, tdtype)


def test_many_repeats_alternating_sizes(small_comm, topo):
    """Back-to-back collectives of changing size reuse both slot parities."""
    r = small_comm.Get_rank()
    n_ranks = small_comm.Get_size()
    for i in range(200):
        n = (i * 37) % 3000
        x = torch.full((n,), float(r + i % 5), dtype=torch.float32)
        harmpi.allreduce(x, comm=small_comm)
        expect = n_ranks * (n_ranks - 1) / 2 + n_ranks * (i % 5)
        assert torch.all(x == expect), i


def test_special_values(small_comm):
    """Inf and NaN survive, inf + -inf is NaN, -0.0 + -0.0 stays -0.0."""
    r, n_ranks = small_comm.Get_rank(), small_comm.Get_size()
    for tdtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.tensor([float("inf"), float("-inf"), 0.0, float("nan"), -0.0, 3.0], dtype=tdtype)
        if n_ranks > 1 and r == 1:
            x[2] = float("-inf")
        if r == 0:
            x[2] = float("inf")
        harmpi.allreduce(x, comm=small_comm)
        assert torch.isinf(x[0]) and x[0] > 0
        assert torch.isinf(x[1]) and x[1] < 0
        assert torch.isnan(x[2]) if n_ranks > 1 else torch.isinf(x[2])
        assert torch.isnan(x[3])
        assert x[4] == 0 and torch.signbit(x[4])
        assert x[5] == 3.0 * n_ranks
        assert_same_everywhere(small_comm, x)


def test_any_shape_and_in_place(small_comm):
    n_ranks = small_comm.Get_size()
    x = torch.ones((4, 3, 5), dtype=torch.float32)
    view_before = x.data_ptr()
    y = harmpi.allreduce(x, comm=small_comm)
    assert y is x and x.data_ptr() == view_before and x.shape == (4, 3, 5)
    assert torch.all(x == n_ranks)
    s = torch.tensor(2.0, dtype=torch.float64)  # 0-d
    harmpi.allreduce(s, comm=small_comm)
    assert s.item() == 2.0 * n_ranks


def test_both_spellings():
    import harmpi.allreduce  # noqa: F401 - the spelling research scripts use
    x = torch.ones(4)
    assert harmpi.allreduce(x) is x
    assert callable(harmpi.allreduce)


@pytest.fixture(scope="module", params=["on", "off", "flush", "auto"])
def copy_mode_comm(request, world):
    """A duplicate of COMM_WORLD whose slots are filled with streaming
    stores, plain stores, plain stores flushed by the readers, or whichever
    the tuner measures fastest."""
    comm = world.Dup()
    cfg = dataclasses.replace(harmpi.Config.from_env(), slot_nbytes=16384, small_max_nbytes=8192,
                              har_latency_max_nbytes=4096, stream_stores=request.param)
    harmpi.init(comm, config=cfg)
    return comm


def test_slot_copy_modes(copy_mode_comm, topo):
    """Sizes around the streaming threshold (node.STREAM_MIN_NBYTES) and the
    small-step limit (8 KiB, so small steps stream and walk the slot ring),
    unaligned tails, and enough repeats for the tuner to probe and switch."""
    from harmpi import node
    edge = node.STREAM_MIN_NBYTES
    for name in ("bf16", "f32"):
        isz = ITEMSIZE[name]
        for n in (1, (edge - 1) // isz, edge // isz, (edge + 1) // isz + 1, 8192 // isz - 3,
                  8192 // isz + 7, 3 * 16384 // isz + 1):
            check(copy_mode_comm, topo, name, n, "torch", None, repeats=2)
    r = copy_mode_comm.Get_rank()
    size = copy_mode_comm.Get_size()
    for i in range(300):
        x = torch.full((2500 + i % 7,), float(r + i % 3), dtype=torch.bfloat16)
        harmpi.allreduce(x, comm=copy_mode_comm)
        assert torch.all(x == size * (size - 1) / 2 + size * (i % 3)), i


def _ring(comm):
    from harmpi import api
    return int(api._context(comm).ctl[0]["ring"])


def test_small_steps_walk_the_slot_and_ranks_agree_on_where(small_comm, topo):
    """Small steps are placed one after another in the slot (node.ring_pos):
    the position wraps, every rank holds the same one, sums stay exact, and a
    mismatch (different sizes, so different advances) brings all back to 0."""
    r, n_ranks = small_comm.Get_rank(), small_comm.Get_size()
    if topo.node_count != 1 or n_ranks == 1:  # the same on every rank
        pytest.skip("the ring is the single-node path's (one rank has no steps)")
    seen, wrapped = [], 0
    for i in range(120):
        n = (1, 7, 100, 255, 256, 257)[i % 6]  # f32: up to the 1 KiB small limit, unaligned
        x = torch.full((n,), float(r + i % 4), dtype=torch.float32)
        harmpi.allreduce(x, comm=small_comm)
        assert torch.all(x == n_ranks * (n_ranks - 1) / 2 + n_ranks * (i % 4)), i
        pos = _ring(small_comm)
        assert pos % 64 == 0 and 0 < pos <= SMALL["slot_nbytes"] + 63
        wrapped += bool(seen) and pos < seen[-1]
        seen.append(pos)
    assert wrapped >= 5, seen
    assert small_comm.allgather(seen) == [seen] * n_ranks
    x = torch.ones(100 if r == 0 else 200)
    with pytest.raises(harmpi.HarmpiMismatchError):
        harmpi.allreduce(x, comm=small_comm)
    assert _ring(small_comm) == 0
    y = torch.ones(250)
    harmpi.allreduce(y, comm=small_comm)
    assert torch.all(y == n_ranks)
    assert small_comm.allgather(_ring(small_comm)) == [1024] * n_ranks  # 1000 B, rounded up
