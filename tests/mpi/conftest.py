"""Fixtures of the MPI tests: run under ``mpirun -np N python -m mpi4py -m pytest tests/mpi``.

Every rank runs every test; collectives inside a test must be reached by all
ranks, so tests never skip on some ranks only. ``python -m mpi4py`` turns an
uncaught exception into MPI_Abort and pytest-timeout ends a hung test, so a
failing rank ends the job instead of hanging it.

A test that fails on one rank would leave its peers in later tests whose
collectives no longer pair (each waiting its deadline, the job ending at
make test's cap with nothing said), so a failed test prints its report
with the rank's number and aborts the whole job (pytest_runtest_logreport).
"""

import dataclasses
import math
import sys
import zlib

import numpy as np
import pytest
from mpi4py import MPI

import harmpi

torch = pytest.importorskip("torch")

#: a tiny slot so that chunk boundaries are cheap to reach
SMALL = dict(slot_nbytes=4096, small_max_nbytes=1024, har_latency_max_nbytes=2048)

DTYPES = {
    # name: (torch dtype or None, numpy dtype, unit roundoff)
    "bf16": (torch.bfloat16, None, 2.0 ** -8),
    "f16": (torch.float16, np.float16, 2.0 ** -11),
    "f32": (torch.float32, np.float32, 2.0 ** -24),
    "f64": (torch.float64, np.float64, 2.0 ** -53),
}
ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8}


@pytest.fixture(scope="session")
def world():
    return MPI.COMM_WORLD


@pytest.fixture(scope="session")
def small_comm(world):
    """A duplicate of COMM_WORLD whose harmpi context has 4 KiB slots."""
    comm = world.Dup()
    cfg = dataclasses.replace(harmpi.Config.from_env(), **SMALL)
    harmpi.init(comm, config=cfg)
    yield comm


@pytest.fixture(scope="session")
def topo(world):
    return harmpi.init(world).topo


def make_input(name, n, rank, seed=0, kind="torch", scale=1.0):
    """Rank-dependent random data of dtype ``name``; returns (x, float64 copy of x)."""
    rng = np.random.default_rng([seed, rank, n])
    ref = rng.standard_normal(n) * scale
    tdtype, ndtype, _ = DTYPES[name]
    if kind == "torch":
        x = torch.from_numpy(ref).to(tdtype)
        return x, x.to(torch.float64).numpy()
    if name == "bf16":
        t = torch.from_numpy(ref).to(torch.bfloat16)
        x = t.view(torch.int16).numpy().view(np.uint16).copy()
        return x, t.to(torch.float64).numpy()
    x = ref.astype(ndtype)
    return x, x.astype(np.float64)


def as_f64(x, name):
    if isinstance(x, torch.Tensor):
        return x.to(torch.float64).numpy()
    if name == "bf16":
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).to(torch.float64).numpy()
    return x.astype(np.float64)


def error_bound(name, inputs_abs_sum, nranks, nnodes, algorithm="auto"):
    """Documented bound of |result - exact| for a sum over ranks.

    Each stage rounds once to the storage type (node sum, then each
    cross-node combine: ceil(log2 G) + 1 with folding; the flat ring rounds
    at each of its N-1 adds) and fp32 accumulation adds at most
    nranks * 2^-24 relative to the sum of magnitudes.
    """
    _, _, u = DTYPES[name]
    if algorithm == "flat_ring":
        stages = max(1, nranks - 1)
    else:
        stages = 1 + (math.ceil(math.log2(nnodes)) + 1 if nnodes > 1 else 0)
    if name == "f64":
        acc = nranks * 2.0 ** -53
    else:
        acc = nranks * 2.0 ** -24
    return (stages * u + acc) * inputs_abs_sum + 1e-300


def digest(x):
    if isinstance(x, torch.Tensor):
        b = x.contiguous().view(torch.uint8).numpy().tobytes() if x.numel() else b""
    else:
        b = x.tobytes()
    return zlib.crc32(b), len(b)


def assert_same_everywhere(comm, x):
    """Bitwise-identical result on every rank."""
    d = digest(x)
    all_d = comm.allgather(d)
    assert all(v == all_d[0] for v in all_d), f"results differ between ranks: {all_d}"


def harmpi_process_group():
    """harmpi's world context from the environment (a file before may have
    made it with another config: then harmpi starts over) and the default
    process group on backend harmpi, for the torch files' fixtures."""
    import torch.distributed as dist

    try:
        harmpi.init(config=harmpi.Config.from_env())
    except harmpi.HarmpiArgumentError:
        harmpi.finalize()
    from harmpi import distributed  # noqa: F401, PLC0415 - backend "harmpi", mpi://

    if not dist.is_initialized():
        dist.init_process_group("harmpi", init_method="mpi://")


def pytest_runtest_logreport(report):
    """End the MPI job at the first failure on any rank, saying which test
    failed on which rank and why (the peers are killed by MPI_Abort)."""
    if not report.failed:
        return
    rank = MPI.COMM_WORLD.Get_rank()
    sys.stderr.write(f"\n==== rank {rank} of {MPI.COMM_WORLD.Get_size()}: {report.nodeid} "
                     f"failed in {report.when}; aborting the job\n{report.longreprtext}\n")
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)
