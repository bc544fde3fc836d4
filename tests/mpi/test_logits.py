"""allgather along any dimension, gather_logits and gather_uneven under mpirun.

Rank r's data is derived from r alone, so every rank rebuilds every rank's
input and compares the result bitwise with torch.cat / np.concatenate.
"""

import dataclasses
import zlib

import numpy as np
import pytest
from conftest import assert_same_everywhere, torch

import harmpi
from harmpi import logits

ROUTES = ("allgather", "allreduce")
TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    """A tensor's raw bits (equal bits <=> bitwise-identical values, NaNs included)."""
    return t.contiguous().view(-1).view(INT_VIEW[t.element_size()])


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def block(rank, shape, kind="torch"):
    """Rank-dependent f32 data of ``shape``."""
    count = int(np.prod(shape))
    base = (np.arange(count, dtype=np.float32) + 1000 * rank).reshape(shape)
    return torch.from_numpy(base) if kind == "torch" else base


def width_of(rank, widths_seed):
    """Uneven vocabulary widths, rank 1 with none (when it exists)."""
    return (5, 0, 7, 3)[rank % 4] + widths_seed * (rank % 3)


def shard(rank, batch, width, dtype, seed=0):
    """A logits shard with special values: -0.0, +-inf, a subnormal, a NaN
    with a payload (f32), and random normals."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((seed, rank, batch, width)).encode()))
    x = (torch.randn(batch, width, generator=g) * 4).to(dtype)
    specials = [-0.0, float("inf"), float("-inf"), 0.0, torch.finfo(dtype).tiny / 4]
    flat = x.view(-1)
    for i, v in enumerate(specials[:flat.numel()]):
        flat[(i * 7 + rank) % flat.numel()] = v
    return x


@pytest.fixture(scope="module")
def fresh_comm(world):
    """Each call: a new duplicate of COMM_WORLD with its own context (tests
    that provoke disagreements, which may leave a context unusable)."""
    comms = []

    def make(**config):
        comm = world.Dup()
        cfg = dataclasses.replace(harmpi.Config.from_env(), **config)
        harmpi.init(comm, config=cfg)
        comms.append(comm)
        return comm
    return make


# -- allgather along any dimension ------------------------------------------------

SHAPES = [(5,), (3, 4), (2, 3, 4), (1, 3, 4), (3, 0, 2), (2, 700, 3)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_allgather_along_each_dim_is_cat(small_comm, shape, kind):
    r, n = small_comm.Get_rank(), small_comm.Get_size()
    for dim in sorted({0, 1, -1, len(shape) - 1} & set(range(-len(shape), len(shape)))):
        x = block(r, shape, kind)
        for _ in range(2):  # twice: slot and scratch reuse
            out = harmpi.allgather(x, dim, comm=small_comm)
            parts = [block(q, shape, kind) for q in range(n)]
            expect = torch.cat(parts, dim) if kind == "torch" else np.concatenate(parts, dim)
            assert type(out) is type(expect) and tuple(out.shape) == tuple(expect.shape), dim
            assert (torch.equal(out, expect) if kind == "torch"
                    else np.array_equal(out, expect)), (shape, dim)
            assert_same_everywhere(small_comm, out)


@pytest.mark.parametrize("name", ["bf16", "f16", "f64"])
def test_allgather_dim_dtypes_on_world(world, name):
    r, n = world.Get_rank(), world.Get_size()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64}[name]
    x = shard(r, 3, 5, dtype)
    out = harmpi.allgather(x, dim=-1)
    assert same_bits(out, torch.cat([shard(q, 3, 5, dtype) for q in range(n)], -1))


def test_allgather_dim_into_out(small_comm):
    """out= for dim != 0: exactly the result's shape, checked before anything moves."""
    r, n = small_comm.Get_rank(), small_comm.Get_size()
    x = block(r, (2, 3, 4))
    out = torch.empty(2, 3 * n, 4)
    assert harmpi.allgather(x, 1, comm=small_comm, out=out) is out
    assert torch.equal(out, torch.cat([block(q, (2, 3, 4)) for q in range(n)], 1))
    xn = block(r, (3, 5), "numpy")
    outn = np.empty((3, 5 * n), np.float32)
    assert harmpi.allgather(xn, -1, comm=small_comm, out=outn) is outn
    assert np.array_equal(outn, np.concatenate([block(q, (3, 5), "numpy") for q in range(n)], 1))
    for bad in (torch.empty(3 * n, 2, 4),              # the right count, another shape
                torch.empty(2, 3 * n, 4, dtype=torch.float64),
                torch.empty(2, 3 * n, 8)[:, :, ::2],   # not contiguous
                np.empty((2, 3 * n, 4), np.float32)):  # another kind
        with pytest.raises(harmpi.HarmpiArgumentError):
            harmpi.allgather(x, 1, comm=small_comm, out=bad)
    assert harmpi.allgather(x, 0, comm=small_comm).shape == (2 * n, 3, 4)  # still in step


def test_allgather_bad_dim_is_refused_locally(small_comm):
    x = torch.ones(2, 3)
    for dim in (2, -3, 100, 1.0, None, "1", True):
        with pytest.raises(harmpi.HarmpiArgumentError, match="dim"):
            harmpi.allgather(x, dim, comm=small_comm)
    with pytest.raises(harmpi.HarmpiArgumentError, match="dim"):
        harmpi.allgather(torch.ones(()), 1, comm=small_comm)
    # nothing moved: the next collective pairs up on every rank
    n = small_comm.Get_size()
    assert harmpi.allgather(x, -1, comm=small_comm).shape == (2, 3 * n)
    assert harmpi.allgather(torch.ones(()), -1, comm=small_comm).shape == (n,)


def test_allgather_dims_must_agree(fresh_comm):
    comm = fresh_comm()
    r, n = comm.Get_rank(), comm.Get_size()
    if n == 1:
        pytest.skip("needs two ranks")
    x = torch.ones(4, 6)
    with pytest.raises(harmpi.HarmpiMismatchError):
        harmpi.allgather(x, 1 if r == 0 else 0, comm=comm)


# -- gather_logits ------------------------------------------------------------------

@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", ["bf16", "f16", "f32"])
def test_gather_logits_uneven_shards_exact(small_comm, route, name):
    r, n = small_comm.Get_rank(), small_comm.Get_size()
    dtype = TORCH_DTYPES[name]
    logits.reset_widths(small_comm)
    for seed in (0, 2):  # two width tables (the first has a rank of width 0 from 2 ranks on)
        w = [width_of(q, seed) for q in range(n)]
        for batch in (1, 3, 0):
            for rep in range(2):  # the second call runs on the cached widths
                x = shard(r, batch, w[r], dtype, seed=rep)
                out = harmpi.gather_logits(x, comm=small_comm, route=route)
                expect = torch.cat([shard(q, batch, w[q], dtype, seed=rep) for q in range(n)], -1)
                assert same_bits(out, expect), (seed, batch, rep)
                assert out.is_contiguous()
                assert_same_everywhere(small_comm, out)
        logits.reset_widths(small_comm)


@pytest.mark.parametrize("route", ROUTES)
def test_gather_logits_numpy_3d_and_nan_payload(world, route):
    """numpy shards, two leading dimensions; on the allgather route NaN
    payloads arrive as they are (pure copies)."""
    r, n = world.Get_rank(), world.Get_size()
    logits.reset_widths(world)
    parts = [np.arange(2 * 3 * (q + 1), dtype=np.float32).reshape(2, 3, q + 1) - 7 * q
             for q in range(n)]
    nan = np.array([0x7FC01234], np.uint32).view(np.float32)[0]
    for p in parts:
        p[0, 0, 0] = nan
    out = harmpi.gather_logits(parts[r], comm=world, route=route)
    expect = np.concatenate(parts, -1)
    assert out.shape == expect.shape and out.dtype == expect.dtype
    if route == "allgather":
        assert np.array_equal(out.view(np.uint32), expect.view(np.uint32))
    else:  # NaN stays NaN, every other value exact
        assert np.array_equal(out, expect, equal_nan=True)
    assert_same_everywhere(world, out)
    logits.reset_widths(world)


def test_gather_logits_route_from_config(fresh_comm):
    """Config.logits_route is the default; a per-call route overrides it;
    a bad route name is refused before anything moves."""
    comm = fresh_comm(logits_route="allreduce")
    r, n = comm.Get_rank(), comm.Get_size()
    assert harmpi.info(comm)["logits_route"] == "allreduce"
    x = shard(r, 2, 4 + r, torch.bfloat16)
    expect = torch.cat([shard(q, 2, 4 + q, torch.bfloat16) for q in range(n)], -1)
    for route in (None, "auto", "allgather", "allreduce"):
        assert same_bits(harmpi.gather_logits(x, comm=comm, route=route), expect), route
    with pytest.raises(harmpi.HarmpiArgumentError, match="route"):
        harmpi.gather_logits(x, comm=comm, route="ring")
    with pytest.raises(harmpi.HarmpiArgumentError):
        harmpi.gather_logits(torch.ones(()), comm=comm)
    assert same_bits(harmpi.gather_logits(x, comm=comm), expect)


@pytest.mark.parametrize("route", ROUTES + (None,))
def test_gather_logits_mismatched_batch_raises_everywhere(fresh_comm, route):
    comm = fresh_comm()
    r, n = comm.Get_rank(), comm.Get_size()
    if n == 1:
        pytest.skip("needs two ranks")
    x = torch.ones(2, 3 + r, dtype=torch.bfloat16)
    harmpi.gather_logits(x, comm=comm, route=route)  # widths learned
    y = torch.ones(2 if r else 3, 3 + r, dtype=torch.bfloat16)
    with pytest.raises(harmpi.HarmpiMismatchError):
        harmpi.gather_logits(y, comm=comm, route=route)
    z = torch.ones(2, 3 + r, dtype=torch.bfloat16)  # same rows, other leading shape
    with pytest.raises(harmpi.HarmpiMismatchError):
        harmpi.gather_logits(z.view(1, 2, -1) if r else z.view(2, 1, -1), comm=comm, route=route)


@pytest.mark.parametrize("route", ROUTES + (None,))
def test_gather_logits_changed_width_after_caching_raises_everywhere(fresh_comm, route):
    comm = fresh_comm()
    r, n = comm.Get_rank(), comm.Get_size()
    if n == 1:
        pytest.skip("needs two ranks")
    x = torch.ones(1, 4 + r, dtype=torch.bfloat16)
    total = sum(4 + q for q in range(n))
    assert harmpi.gather_logits(x, comm=comm, route=route).shape == (1, total)
    y = torch.ones(1, 5 + r if r == n - 1 else 4 + r, dtype=torch.bfloat16)
    with pytest.raises(harmpi.HarmpiMismatchError, match="width"):
        harmpi.gather_logits(y, comm=comm, route=route)


def test_gather_logits_width_change_on_every_rank_relearns(small_comm):
    """Every rank changes its width at once: all exchange again."""
    r, n = small_comm.Get_rank(), small_comm.Get_size()
    logits.reset_widths(small_comm)
    for width in (3, 6, 3):
        x = torch.full((2, width + r), float(r))
        out = harmpi.gather_logits(x, comm=small_comm)
        assert torch.equal(out, torch.cat([torch.full((2, width + q), float(q))
                                           for q in range(n)], -1))


# -- gather_uneven (torch.distributed all_gather of uneven tensors) --------------------

@pytest.mark.parametrize("route", ROUTES)
def test_gather_uneven_fills_the_list(small_comm, route):
    r, n = small_comm.Get_rank(), small_comm.Get_size()
    for seed in (0, 1):
        w = [width_of(q, seed) for q in range(n)]
        x = shard(r, 3, w[r], torch.bfloat16)
        outs = [torch.empty(3, w[q], dtype=torch.bfloat16) for q in range(n)]
        assert logits.gather_uneven(x, outs, comm=small_comm, route=route) is outs
        for q in range(n):
            assert same_bits(outs[q], shard(q, 3, w[q], torch.bfloat16)), q
        assert_same_everywhere(small_comm, torch.cat(outs, -1))


def test_gather_uneven_checks_its_list(small_comm):
    r, n = small_comm.Get_rank(), small_comm.Get_size()
    x = torch.ones(2, 3)
    good = [torch.empty(2, 3) for _ in range(n)]
    for bad in (good[:-1], [torch.empty(2, 4) if q == r else o for q, o in enumerate(good)],
                [torch.empty(2, 3, dtype=torch.float64)] * n, [torch.empty(3, 3)] * n, None):
        with pytest.raises(harmpi.HarmpiArgumentError):
            logits.gather_uneven(x, bad, comm=small_comm)
    logits.gather_uneven(x, good, comm=small_comm)  # nothing moved before: still in step


@pytest.mark.parametrize("route", ROUTES)
def test_gather_uneven_disagreeing_lists_raise_everywhere(fresh_comm, route):
    """Ranks 0 and 1 each believe the other is one column wider: with two
    ranks the totals agree, so only the widths' digest can tell."""
    comm = fresh_comm()
    r, n = comm.Get_rank(), comm.Get_size()
    if n == 1:
        pytest.skip("needs two ranks")
    w = [3 + q for q in range(n)]
    believed = [w[q] + (1 if {q, r} == {0, 1} else 0) for q in range(n)]
    outs = [torch.empty(2, b, dtype=torch.bfloat16) for b in believed]
    with pytest.raises(harmpi.HarmpiMismatchError):
        logits.gather_uneven(torch.ones(2, w[r], dtype=torch.bfloat16), outs, comm=comm,
                             route=route)
