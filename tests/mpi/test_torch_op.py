"""torch.ops.harmpi.all_reduce_ under mpirun: the same sum as
harmpi.allreduce(t) on the world communicator (float64 reference, bitwise
agreement across ranks, repeats), its errors, and torch.compile."""

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

import harmpi
from harmpi import native
from harmpi.registry import STATE

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
    return [0, 1, 7, 5120, cfg.small_max_nbytes // isz + 1, cfg.slot_nbytes // isz + 5]


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
