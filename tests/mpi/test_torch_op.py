"""torch.ops.harmpi.all_reduce_ (in place) and all_reduce (out of place)
under mpirun: the same sum as harmpi.allreduce(t) on the world communicator
(float64 reference, bitwise agreement across ranks, repeats), a named
sub-communicator, errors, and torch.compile against eager code where the
reduced tensor is a view, is used after the call, is a graph input, or is
the output of a fused op."""

import os

import numpy as np
import pytest
from conftest import (
    ITEMSIZE,
    as_f64,
    assert_same_everywhere,
    error_bound,
    make_input,
    torch,
)
from mpi4py import MPI

import harmpi
from harmpi import native
from harmpi.runtime.registry import STATE

if native.load() is None:  # the same on every rank
    pytest.skip(f"no torch operator: harmpi.native {native.status()}", allow_module_level=True)

all_reduce_ = torch.ops.harmpi.all_reduce_


def test_the_first_call_makes_the_world_context(world):
    """Called before anything else (when this file runs first), the operator
    takes the Python path, which makes the world context; it serves it after."""
    r, n_ranks = world.Get_rank(), world.Get_size()
    for _ in range(3):
        x = torch.full((10,), float(r + 1))
        assert all_reduce_(x) is x
        assert torch.all(x == n_ranks * (n_ranks + 1) / 2)
    assert STATE.world is not None
    topo = STATE.world.topo
    if topo.node_count == 1 and harmpi.Config.from_env().native:
        assert harmpi.info()["native"].startswith("serving"), harmpi.info()["native"]


def sizes(name):
    """Empty, tiny, the decode size, each side of the one-node small/large
    switch and past one slot of the default config."""
    cfg = harmpi.Config()
    isz = ITEMSIZE[name]
    small = min(harmpi.info()["thresholds"]["small_max_nbytes"], 4 * cfg.slot_nbytes)
    return [0, 1, 7, 5120, small // isz + 1, cfg.slot_nbytes // isz + 5]


@pytest.mark.parametrize("name", ["bf16", "f32"])
def test_the_sum_against_a_float64_reference(world, topo, name):
    n_ranks = world.Get_size()
    for n in sizes(name):
        for rep in range(2):
            x, ref = make_input(name, n, world.Get_rank(), seed=rep)
            all_refs = world.allgather(ref)
            exact = np.sum(all_refs, axis=0) if n else np.zeros(0)
            bound = error_bound(name, np.sum(np.abs(all_refs), axis=0), n_ranks,
                                topo.node_count)
            assert all_reduce_(x) is x
            err = np.abs(as_f64(x, name) - exact)
            assert np.all(err <= bound), f"{name} n={n}: max error {err.max()}"
            assert_same_everywhere(world, x)


def test_repeated_calls_and_the_overload(world):
    r, n_ranks = world.Get_rank(), world.Get_size()
    for i in range(300):
        n = (i * 37) % 3000
        x = torch.full((n,), float(r + i % 5), dtype=torch.bfloat16 if i % 2 else torch.float32)
        out = all_reduce_(x) if i % 3 else all_reduce_.default(x)
        assert out is x
        assert torch.all(x == n_ranks * (n_ranks - 1) / 2 + n_ranks * (i % 5)), i


def test_the_same_result_as_harmpi_allreduce(world):
    x, _ = make_input("bf16", 5120, world.Get_rank(), seed=3)
    y = x.clone()
    all_reduce_(x)
    harmpi.allreduce(y)
    assert torch.equal(x.view(torch.int16), y.view(torch.int16))


def test_errors_are_harmpi_s(world):
    """The operator raises what harmpi.allreduce(t) raises, as the same class."""
    r, n_ranks = world.Get_rank(), world.Get_size()
    for bad, match in [(torch.ones(4, dtype=torch.int32), "unsupported tensor dtype"),
                       (torch.ones(4, 4)[:, 0], "not contiguous"),
                       (torch.ones(4, requires_grad=True), "requires grad")]:
        with pytest.raises(harmpi.HarmpiArgumentError, match=match):
            all_reduce_(bad)
    if n_ranks > 1:
        x = torch.ones(100 if r == 0 else 200, dtype=torch.bfloat16)
        with pytest.raises(harmpi.HarmpiMismatchError, match="ranks disagree"):
            all_reduce_(x)
        assert torch.all(x == 1), "the caller's tensor must not be touched"
    y = torch.full((5000,), 2.0, dtype=torch.bfloat16)
    assert all_reduce_(y) is y and torch.all(y == 2 * n_ranks)  # usable afterwards


@pytest.mark.skipif(bool(os.environ.get("HARMPI_RANKS_PER_NODE") or
                           os.environ.get("HARMPI_STREAM_STORES")),
                    reason="the compiled graph calls the same op as the eager tests, which "
                    "cover the topologies; compiling costs ~7 s per run")
def test_torch_compile_fullgraph(world):
    r, n_ranks = world.Get_rank(), world.Get_size()

    def f(x):
        y = x * 2
        all_reduce_(y)
        return y + 1

    compiled = torch.compile(f, fullgraph=True)
    for dtype in (torch.float32, torch.bfloat16):
        for i in range(3):
            x = torch.full((64, 3), float(r + 1 + i), dtype=dtype)
            out = compiled(x)
            expect = 2 * (n_ranks * (n_ranks + 1) / 2 + n_ranks * i) + 1
            assert torch.all(out == expect), (dtype, i, out.flatten()[:4])
            assert torch.all(x == r + 1 + i), "the input is not the reduced tensor"
            assert_same_everywhere(world, out)


all_reduce = torch.ops.harmpi.all_reduce


def test_the_out_of_place_operator(world):
    r, n_ranks = world.Get_rank(), world.Get_size()
    for n in (0, 7, 5120, 70001):
        x, ref = make_input("bf16", n, r, seed=5)
        keep = x.clone()
        y = all_reduce(x)
        assert y.data_ptr() != x.data_ptr() or n == 0
        assert torch.equal(x.view(torch.int16), keep.view(torch.int16)), "the input is untouched"
        harmpi.allreduce(keep)
        assert torch.equal(y.view(torch.int16), keep.view(torch.int16))
        assert_same_everywhere(world, y)
    x = torch.full((6, 5), float(r + 1))[:, 1:4]          # a non-contiguous view
    assert torch.all(all_reduce(x) == n_ranks * (n_ranks + 1) / 2)


def test_a_named_group(world):
    """A communicator of some ranks (even and odd world ranks), bound to a
    name, as a TP group inside a larger world."""
    r = world.Get_rank()
    sub = world.Split(r % 2, r)
    try:
        native.name_group(f"parity{r % 2}", sub)
        x = torch.full((300,), float(r + 1), dtype=torch.bfloat16)
        y = all_reduce(x, f"parity{r % 2}")
        members = [q for q in range(world.Get_size()) if q % 2 == r % 2]
        assert torch.all(y == sum(q + 1 for q in members))
        assert all_reduce_(x, group=f"parity{r % 2}") is x and torch.equal(x, y)
        assert_same_everywhere(sub, y)
        with pytest.raises(harmpi.HarmpiArgumentError, match="no communicator is named"):
            all_reduce(x, "never-named")
    finally:
        native.unname_group(f"parity{r % 2}")
        sub.Free()


# Eager and compiled code must agree bit for bit. Values are small integers,
# so fused arithmetic rounds nothing and any difference is a wrong value.

def _in_place(a, b):
    y = all_reduce_(a)          # a graph input, reduced in place
    y.mul_(2)                   # an update through the result...
    s = a + y                   # ...seen through the input
    h = b * 3 + 1               # the output of a fused op
    v = h[1:]                   # a view of it (contiguous rows)
    all_reduce_(v)
    return s, h, v.sum(dim=0)


def _out_of_place(a, b):
    y = all_reduce((b * 2 - 1)[:, 1:])   # a fused op's output, viewed (not contiguous)
    y.add_(a[:, :-1])                     # the result is updated in place
    a.mul_(2)                             # the input is used (and updated) after the call
    return y, a + all_reduce(a)


def _compile_layout():
    """Compiling costs tens of seconds per run on 2 cores: the compiled tests
    run at 2 ranks on one node and at 2 virtual nodes x 2 (tcp rail), the two
    paths the operators take (the native entry, and the Python fallback)."""
    rpn = os.environ.get("HARMPI_RANKS_PER_NODE")
    n = MPI.COMM_WORLD.Get_size()
    if os.environ.get("HARMPI_STREAM_STORES") or os.environ.get("HARMPI_TRANSPORT") == "mpi":
        return False
    return (rpn is None and n == 2) or (rpn == "2" and n == 4)


@pytest.mark.skipif(not _compile_layout(),
                    reason="compiled graphs run at -np 2 and at 2 virtual nodes x 2 only")
@pytest.mark.timeout(600)  # inductor compiles on every rank at once, more ranks than cores
@pytest.mark.parametrize("f, same_on_every_rank", [(_in_place, (0, 2)), (_out_of_place, ())])
def test_compiled_equals_eager(world, f, same_on_every_rank):
    r = world.Get_rank()
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    for i in range(3):
        a0 = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6) % 7 + r + i
        b0 = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6) % 5 - r
        ea, eb, ca, cb = a0.clone(), b0.clone(), a0.clone(), b0.clone()
        eager = f(ea, eb)
        got = compiled(ca, cb)
        for k, (e, c) in enumerate(zip(eager, got)):
            assert torch.equal(e.view(torch.int16), c.view(torch.int16)), (f.__name__, k, e, c)
            if k in same_on_every_rank:   # the others hold rank-local values too
                assert_same_everywhere(world, c)
        assert torch.equal(ea, ca) and torch.equal(eb, cb), "the inputs' updates differ"
