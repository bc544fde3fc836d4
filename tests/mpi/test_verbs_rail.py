"""The real algorithms over the verbs transport class, driven by the
tests' shared-memory loopback NIC (tests/support/verbs_double.py) instead of a
device: every rank is its own (virtual) node, so every collective crosses
the rail. The stand-in is injected here, by replacing the transport
module's probe and opener for this file's contexts only; the library
itself cannot select it.

Run: HARMPI_RANKS_PER_NODE=1 mpirun -np 2 ... python -m mpi4py -m pytest
tests/mpi/test_verbs_rail.py (any rank count works: the contexts below set
ranks_per_node=1 themselves).
"""

import dataclasses
import os
import shutil
import sys
import tempfile

import numpy as np
import pytest
from conftest import DTYPES, as_f64, assert_same_everywhere, error_bound, make_input
from mpi4py import MPI

import harmpi
from harmpi import transports

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from support.verbs_double import LoopbackNic, loop_port  # noqa: E402

#: the library's own probe (the fixture below replaces it for this file's
#: stand-in contexts)
REAL_PROBE = transports.verbs_probe

#: tiny slots and RDMA chunks, so that both kinds of chunking are reached
CFG = dict(ranks_per_node=1, transport="verbs", slot_nbytes=16384, small_max_nbytes=1024,
           har_latency_max_nbytes=8192)
RDMA_CHUNK, RDMA_SLOTS = 4096, 2


@pytest.fixture(scope="module")
def fabric(world):
    path = tempfile.mkdtemp(prefix="harmpi-verbs-", dir="/dev/shm") if world.Get_rank() == 0 \
        else None
    path = world.bcast(path)
    mp = pytest.MonkeyPatch()
    mp.setattr(transports, "verbs_probe", lambda config, local_rank: (
        loop_port(), "loop0 port 1 is ACTIVE (the tests' loopback NIC)"))
    mp.setattr(transports, "_open_verbs", lambda choice, comm, spin, timeout_s: (
        transports.VerbsTransport(comm, spin, timeout_s, LoopbackNic(path),
                                  nslots=RDMA_SLOTS, chunk_nbytes=RDMA_CHUNK)))
    yield path
    mp.undo()
    world.Barrier()
    if world.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def vcomm(world, fabric):
    comm = world.Dup()
    harmpi.init(comm, config=dataclasses.replace(harmpi.Config.from_env(), **CFG))
    return comm


def test_the_rail_is_the_verbs_transport(vcomm):
    info = harmpi.info(vcomm)
    assert info["nodes"] == vcomm.Get_size()
    if vcomm.Get_size() > 1:
        assert info["transport"] == "verbs", info
        assert info["transport_reason"].startswith("HARMPI_TRANSPORT=verbs: verbs: every rank"), \
            info["transport_reason"]


SIZES = [1, 7, 1000, 2048, 4097, 8192 + 3, 30_000]
ALGORITHMS = [None, "har_latency", "har_bandwidth", "flat_ring", "leader"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("name", list(DTYPES))
def test_allreduce_matches_the_float64_reference(vcomm, name, algorithm):
    size = vcomm.Get_size()
    for n in SIZES:
        for rep in range(2):       # twice on one context: rings and slots are reused
            x, ref = make_input(name, n, vcomm.Get_rank(), seed=rep)
            refs = vcomm.allgather(ref)
            exact = np.sum(refs, axis=0)
            bound = error_bound(name, np.sum(np.abs(refs), axis=0), size, size,
                                algorithm or "auto")
            harmpi.allreduce(x, comm=vcomm, algorithm=algorithm)
            err = np.abs(as_f64(x, name) - exact)
            assert np.all(err <= bound), f"{name} n={n} {algorithm}: max error {err.max()}"
            assert_same_everywhere(vcomm, x)


def test_closed_form_sums(vcomm):
    size = vcomm.Get_size()
    for n in (5, 3000, 70_000):
        x = np.full(n, vcomm.Get_rank() + 1.0)
        harmpi.allreduce(x, comm=vcomm)
        assert np.all(x == size * (size + 1) / 2)


def test_allgather_over_the_rail(vcomm):
    r, size = vcomm.Get_rank(), vcomm.Get_size()
    x = np.full(1000, float(r))
    out = harmpi.allgather(x, comm=vcomm)
    assert np.array_equal(np.asarray(out).reshape(size, -1)[:, 0], np.arange(size, dtype=float))


def test_a_size_mismatch_fails_on_every_rank(world, fabric):
    if world.Get_size() < 2:
        return
    comm = world.Dup()
    harmpi.init(comm, config=dataclasses.replace(harmpi.Config.from_env(), **CFG))
    # rank 0 passes a larger tensor: its peers receive more than their buffer
    # holds, and must poison the step (not raise alone inside the transport)
    n = 3000 if comm.Get_rank() == 0 else 1000
    with pytest.raises(harmpi.HarmpiMismatchError):
        harmpi.allreduce(np.ones(n), comm=comm, algorithm="har_latency")


def test_forced_verbs_without_a_device_fails_at_init_on_every_rank(world, monkeypatch):
    """The library's real probe: here (no RDMA device) a forced verbs
    context fails at set-up on every rank, naming what each rank found; on
    a host with a device (make test-verbs) it runs."""
    monkeypatch.setattr(transports, "verbs_probe", REAL_PROBE)
    usable = world.allreduce(1 if REAL_PROBE()[0] is not None else 0, op=MPI.MIN)
    comm = world.Dup()
    cfg = dataclasses.replace(harmpi.Config.from_env(), ranks_per_node=1, transport="verbs")
    if usable or world.Get_size() == 1:
        harmpi.init(comm, config=cfg)
        return
    with pytest.raises(harmpi.HarmpiTransportError) as exc:
        harmpi.init(comm, config=cfg)
    msg = str(exc.value)
    assert msg.startswith("HARMPI_TRANSPORT=verbs cannot be used: verbs not usable on every rank")
    for r in range(world.Get_size()):
        assert f"rank {r}: " in msg, msg
    # the failed set-up left the world usable
    x = np.ones(10)
    harmpi.allreduce(x, comm=world)
    assert np.all(x == world.Get_size())
