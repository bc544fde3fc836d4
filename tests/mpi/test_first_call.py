"""The first collectives after harmpi.init() pay nothing later ones do not.

Counted, never timed: across a context's first calls no numba overload is
added to a harmpi kernel (nothing compiled or loaded from the cache), no
module is imported, and the process takes no more minor page faults than a
warm call does (init maps the node's slots and the rail's receive buffer;
unmapped, a 1 MB call faulted ~256 times per slot parity). Then tensors
around the default 1 MiB slot, on a fresh context (the other files use
4 KiB slots): exact, and the same bits on every rank.
"""

import resource
import sys

import numpy as np
import pytest
from conftest import as_f64, assert_same_everywhere, error_bound, make_input, torch
from numba.core.dispatcher import Dispatcher

import harmpi

#: faults a call may take for reasons of its own (the allocator, a stack
#: page); an unmapped 1 MB slot alone is 256
FAULT_SLACK = 32


def _overloads():
    """Compiled overloads held by harmpi's numba dispatchers."""
    total = 0
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("harmpi"):
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, Dispatcher):
                total += len(obj.overloads)
    return total


def _minflt():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.fixture
def fresh(world):
    """A communicator whose context is made here, with the default slots."""
    comm = world.Dup()
    harmpi.init(comm, config=harmpi.Config.from_env())
    yield comm
    comm.Free()  # frees the context with it


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_first_calls_compile_import_and_fault_nothing(fresh, kind):
    slot = harmpi.init(fresh).config.slot_nbytes
    n = slot // 4  # f32: one whole slot, every page of it
    xs = [np.full(n, fresh.rank + 1.0, np.float32) for _ in range(3)]
    if kind == "torch":
        xs = [torch.from_numpy(x) for x in xs]
    for x in xs:  # the arrays' own pages, outside the counts
        x[:] = fresh.rank + 1.0
    fresh.Barrier()
    overloads, modules = _overloads(), set(sys.modules)
    faults = []
    for x in xs:  # parity 0, parity 1, then a warm call
        before = _minflt()
        harmpi.allreduce(x, comm=fresh)
        faults.append(_minflt() - before)
    assert _overloads() == overloads, "a first call compiled or loaded a kernel"
    assert set(sys.modules) == modules, f"a first call imported {set(sys.modules) - modules}"
    assert max(faults[:2]) <= faults[2] + FAULT_SLACK, f"minor faults per call: {faults}"
    size = fresh.Get_size()
    for x in xs:
        assert float(x[0]) == float(x[-1]) == size * (size + 1) / 2


@pytest.mark.parametrize("name", ["bf16", "f32"])
def test_around_one_slot(fresh, name):
    """Sizes up to, at and past one default slot (both parities)."""
    isz = {"bf16": 2, "f32": 4}[name]
    slot = harmpi.init(fresh).config.slot_nbytes // isz
    for n in (slot // 8 + 1, slot - 3, slot, slot + 5):
        for rep in range(2):  # twice: both slot parities
            x, ref = make_input(name, n, fresh.rank, seed=rep)
            total = np.sum(fresh.allgather(ref), axis=0)
            bound = error_bound(name, np.sum(np.abs(fresh.allgather(ref)), axis=0),
                                fresh.Get_size(), harmpi.init(fresh).topo.node_count)
            harmpi.allreduce(x, comm=fresh)
            assert np.all(np.abs(as_f64(x, name) - total) <= bound), (name, n, rep)
            assert_same_everywhere(fresh, x)
