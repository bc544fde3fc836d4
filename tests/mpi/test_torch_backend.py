"""torch.distributed backend "harmpi" under mpirun, against gloo in the same job.

The default group is harmpi (init_process_group("harmpi",
init_method="mpi://") without MASTER_ADDR: rank and world size from MPI); a gloo group over the same
ranks computes the reference of every call. Subgroups: consecutive pairs
(a TP group inside a larger world) and the even ranks (a group that spans
virtual nodes when HARMPI_RANKS_PER_NODE splits the host).
"""

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import DTYPES, assert_same_everywhere, error_bound
from mpi4py import MPI

import harmpi
import harmpi.distributed  # noqa: F401 - backend "harmpi", mpi://

pytestmark = pytest.mark.timeout(240)

FLOATS = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32,
          "f64": torch.float64}


@pytest.fixture(scope="module")
def groups():
    """(default harmpi group, gloo world group, [(harmpi subgroup, gloo subgroup,
    ranks)] for the subgroups this rank belongs to)."""
    # the world context as the environment configures it: an earlier test may
    # have left it broken (then init makes a new one) or configured otherwise.
    # (Not harmpi.finalize(): after the fault tests a context may be broken on
    # one rank only, and a collective free would then wait forever.)
    try:
        harmpi.init(config=harmpi.Config.from_env())
    except harmpi.HarmpiArgumentError:
        harmpi.finalize()
    assert "MASTER_ADDR" not in os.environ
    dist.init_process_group("harmpi", init_method="mpi://")
    world = MPI.COMM_WORLD
    n = world.Get_size()
    gloo = dist.new_group(backend="gloo")
    subs = []
    specs = [[r, r + 1] for r in range(0, n - 1, 2)] + [list(range(0, n, 2))]
    for ranks in specs:
        h = dist.new_group(ranks)          # every rank calls new_group, members or not
        g = dist.new_group(ranks, backend="gloo")
        if world.Get_rank() in ranks:
            subs.append((h, g, ranks))
    yield dist.group.WORLD, gloo, subs
    dist.destroy_process_group()


def _all_groups(groups):
    default, gloo, subs = groups
    return [(default, gloo, list(range(dist.get_world_size())))] + subs


def _data(name, n, seed):
    rng = np.random.default_rng([seed, dist.get_rank(), n])
    return torch.from_numpy(rng.standard_normal(n)).to(FLOATS[name])


def _node_count(ranks):
    rpn = os.environ.get("HARMPI_RANKS_PER_NODE")
    if not rpn:
        return 1
    return len({r // int(rpn) for r in ranks})


def test_backend_is_registered_and_ranks_come_from_mpi(groups):
    assert "harmpi" in dist.Backend.backend_list
    assert dist.get_backend() == "harmpi"
    assert dist.get_rank() == MPI.COMM_WORLD.Get_rank()
    assert dist.get_world_size() == MPI.COMM_WORLD.Get_size()


@pytest.mark.parametrize("name", list(FLOATS))
@pytest.mark.parametrize("n", [1, 1000, 5120, 70001])
def test_all_reduce_sum_and_avg_match_gloo(groups, name, n):
    for h, g, ranks in _all_groups(groups):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            x = _data(name, n, 1)
            ref = x.to(torch.float64, copy=True)
            dist.all_reduce(ref, op=dist.ReduceOp.SUM, group=g)
            if op == dist.ReduceOp.AVG:
                ref /= len(ranks)
            for _ in range(2):  # repeated calls
                y = x.clone()
                dist.all_reduce(y, op=op, group=h)
                bound = error_bound(name, _abs_sum(x, g), len(ranks), _node_count(ranks))
                if op == dist.ReduceOp.AVG:
                    bound = bound / len(ranks) + DTYPES[name][2] * ref.abs()
                err = (y.to(torch.float64) - ref).abs()
                assert bool((err <= bound).all()), f"{name} {op} err {err.max()}"
                _same_in_group(h, y)


def _abs_sum(x, g):
    a = x.to(torch.float64).abs()
    dist.all_reduce(a, group=g)
    return a


def _same_in_group(h, y):
    """Bitwise-identical results on every rank of the group (its MPI communicator)."""
    assert_same_everywhere(h.comm, y)


@pytest.mark.parametrize("name", list(FLOATS))
def test_all_reduce_max_min_exact(groups, name):
    for h, g, _ranks in _all_groups(groups):
        for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
            x = _data(name, 777, 2)
            ref = x.to(torch.float64, copy=True)
            dist.all_reduce(ref, op=op, group=g)
            y = x.clone()
            dist.all_reduce(y, op=op, group=h)
            assert torch.equal(y.to(torch.float64), ref)


@pytest.mark.parametrize("name", list(FLOATS))
@pytest.mark.parametrize("shape", [(3,), (4, 5), (2, 3, 1025)])
def test_gathers_match_gloo_exactly(groups, name, shape):
    for h, g, ranks in _all_groups(groups):
        x = _data(name, int(np.prod(shape)), 3).view(shape)
        k = len(ranks)
        ref = [torch.empty(shape, dtype=torch.float64) for _ in range(k)]
        dist.all_gather(ref, x.to(torch.float64), group=g)
        out = [torch.empty(shape, dtype=x.dtype) for _ in range(k)]
        dist.all_gather(out, x, group=h)
        for o, r in zip(out, ref):
            assert torch.equal(o.to(torch.float64), r)
        single = torch.empty((k * shape[0],) + shape[1:], dtype=x.dtype)
        dist.all_gather_into_tensor(single, x, group=h)
        assert torch.equal(single.to(torch.float64), torch.cat(ref))


@pytest.mark.parametrize("name", ["bf16", "f32"])
def test_reduce_scatter_tensor_matches_gloo(groups, name):
    for h, g, ranks in _all_groups(groups):
        k = len(ranks)
        x = _data(name, 6 * k, 4)
        ref = x.to(torch.float64, copy=True)
        dist.all_reduce(ref, group=g)
        me = dist.get_rank(h)
        out = torch.empty(6, dtype=x.dtype)
        dist.reduce_scatter_tensor(out, x, group=h)
        bound = error_bound(name, _abs_sum(x, g), k, _node_count(ranks))[me * 6:(me + 1) * 6]
        assert bool(((out.to(torch.float64) - ref[me * 6:(me + 1) * 6]).abs() <= bound).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.bool])
def test_broadcast_and_scatter_exact(groups, dtype):
    for h, g, ranks in _all_groups(groups):
        k = len(ranks)
        root = ranks[-1]
        x = (torch.arange(10) * (dist.get_rank() + 1)).to(dtype)
        ref = x.clone()
        dist.broadcast(ref, src=root, group=g)
        y = x.clone()
        dist.broadcast(y, src=root, group=h)
        assert torch.equal(y, ref)
        chunks = [torch.full((3,), i + 1).to(dtype) for i in range(k)] \
            if dist.get_rank() == root else None
        out = torch.zeros(3, dtype=dtype)
        dist.scatter(out, chunks, src=root, group=h)
        assert torch.equal(out, torch.full((3,), dist.get_rank(h) + 1).to(dtype))


def test_barrier(groups):
    for h, _g, _ranks in _all_groups(groups):
        dist.barrier(group=h)


def test_async_all_reduce_with_interleaved_compute(groups):
    n = dist.get_world_size()
    for size in (5, 5120, 40000, 700000):  # small, rsag and multi-slot sizes
        x = torch.full((size,), float(dist.get_rank() + 1), dtype=torch.bfloat16)
        work = dist.all_reduce(x, async_op=True)
        a = torch.randn(64, 64)
        b = a @ a  # independent compute while the collective is in flight
        assert work.wait()
        assert work.is_completed()
        assert bool((x == n * (n + 1) / 2).all())
        assert b.shape == (64, 64)
    # a later call on the group completes the started one first, in order
    x = torch.ones(100)
    y = torch.ones(100)
    w1 = dist.all_reduce(x, async_op=True)
    w2 = dist.all_reduce(y, op=dist.ReduceOp.AVG, async_op=True)
    assert w2.get_future().wait()[0] is y
    w1.wait()
    assert bool((x == n).all()) and bool((y == 1).all())
    assert_same_everywhere(MPI.COMM_WORLD, x)


def test_async_then_direct_harmpi_call_is_refused(groups):
    if harmpi.init().split is None:
        pytest.skip("this topology has no split-phase all-reduce (its async calls complete "
                    "before they return)")
    x = torch.ones(64)
    work = dist.all_reduce(x, async_op=True)
    with pytest.raises(harmpi.HarmpiError, match="not yet waited"):
        harmpi.allreduce(torch.ones(8))
    work.wait()
    assert bool((x == dist.get_world_size()).all())
    harmpi.allreduce(torch.ones(8))  # usable again


def test_unsupported_calls_raise_clear_errors(groups):
    # (every op gloo serves works: tests/mpi/test_torch_ops_full.py)
    with pytest.raises(harmpi.HarmpiArgumentError,
                       match="BAND of torch.float32 is not supported"):
        dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND)
    x = torch.ones(4)
    dist.all_reduce(x)  # the group still works
    assert bool((x == dist.get_world_size()).all())


def test_functional_collectives(groups):
    import torch.distributed._functional_collectives as funcol

    n = dist.get_world_size()
    x = torch.full((8,), float(dist.get_rank() + 1))
    y = funcol.all_reduce(x, "sum", dist.group.WORLD)
    assert bool((y == n * (n + 1) / 2).all())
    z = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
    assert torch.equal(z, torch.cat([torch.full((8,), float(r + 1)) for r in range(n)]))


def test_parallelize_module_matches_gloo(groups):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    _default, gloo, _subs = groups
    n = dist.get_world_size()
    outs = []
    for mesh in (DeviceMesh.from_group(dist.group.WORLD, "cpu"),
                 DeviceMesh.from_group(gloo, "cpu")):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 8 * n), torch.nn.ReLU(),
                                    torch.nn.Linear(8 * n, 16))
        model = parallelize_module(model, mesh, {"0": ColwiseParallel(),
                                                 "2": RowwiseParallel()})
        torch.manual_seed(1)
        with torch.no_grad():
            outs.append(model(torch.randn(4, 16)))
    assert torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    assert_same_everywhere(MPI.COMM_WORLD, outs[0])


@pytest.mark.parametrize("name", ["bf16", "f32"])
def test_all_gather_of_uneven_vocabulary_shards(groups, name):
    """dist.all_gather with outputs whose last dimension differs per rank:
    gather_logits' route (harmpi.logits.gather_uneven), exact."""
    for h, _g, ranks in _all_groups(groups):
        widths = [3 + 2 * q for q in range(len(ranks))]
        me = dist.get_rank(h)
        x = _data(name, 4 * widths[me], 5).view(4, widths[me])
        outs = [torch.empty(4, w, dtype=x.dtype) for w in widths]
        for _ in range(2):
            dist.all_gather(outs, x, group=h)
            ref = h.comm.allgather(x.to(torch.float64).numpy())
            for o, r in zip(outs, ref):
                assert np.array_equal(o.to(torch.float64).numpy(), r)
