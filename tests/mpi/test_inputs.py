"""Inputs nobody checked (issue 21): byte order, COMM_NULL, numpy array
subclasses, deadlines that are not finite. Each gets a clear answer on the
calling rank before anything moves, or just works (a memmap is an array)."""

import dataclasses
import math

import numpy as np
import pytest
from conftest import torch
from mpi4py import MPI

import harmpi

BIG_ENDIAN = [">f2", ">f4", ">f8"]


# -- byte order -------------------------------------------------------------------

@pytest.mark.parametrize("dt", BIG_ENDIAN)
def test_non_native_byte_order_is_refused_untouched(small_comm, dt):
    """1.5 + 1.5 on '>f4' used to give 8.5e37 (bytes summed as if native)."""
    x = np.full(16, 1.5, dtype=dt)
    with pytest.raises(harmpi.HarmpiArgumentError, match="big-endian") as info:
        harmpi.allreduce(x, comm=small_comm)
    assert "newbyteorder" in str(info.value)
    assert (x == 1.5).all() and x.dtype.str == dt
    with pytest.raises(harmpi.HarmpiArgumentError, match="big-endian"):
        harmpi.allgather(x, comm=small_comm)
    with pytest.raises(harmpi.HarmpiArgumentError, match="big-endian"):
        harmpi.allgather(x, dim=-1, comm=small_comm)
    size = small_comm.Get_size()
    with pytest.raises(harmpi.HarmpiArgumentError, match="big-endian"):
        harmpi.allgather(x.astype(x.dtype.newbyteorder("=")), comm=small_comm,
                         out=np.empty(16 * size, dtype=dt))
    # the conversion the message names gives the right sum
    y = x.astype(x.dtype.newbyteorder("="))
    harmpi.allreduce(y, comm=small_comm)
    assert (y == 1.5 * size).all()


def test_big_endian_bf16_bits_are_refused(small_comm):
    x = np.full(8, 0x3FC0, dtype=">u2")  # 1.5 in bf16, stored big-endian
    with pytest.raises(harmpi.HarmpiArgumentError, match="big-endian"):
        harmpi.allreduce(x, comm=small_comm, dtype="bf16")
    assert (x == 0x3FC0).all()


# -- COMM_NULL ------------------------------------------------------------------

def test_comm_null_is_an_argument_error(world):
    x = np.ones(4, np.float32)
    calls = [lambda: harmpi.allreduce(x, comm=MPI.COMM_NULL),
             lambda: harmpi.allreduce(torch.ones(4), comm=MPI.COMM_NULL),
             lambda: harmpi.allgather(x, comm=MPI.COMM_NULL),
             lambda: harmpi.gather_logits(torch.ones(2, 3), comm=MPI.COMM_NULL),
             lambda: harmpi.barrier(comm=MPI.COMM_NULL),
             lambda: harmpi.init(MPI.COMM_NULL),
             lambda: harmpi.init(MPI.COMM_NULL, config=harmpi.Config()),
             lambda: harmpi.info(MPI.COMM_NULL)]
    for call in calls:
        with pytest.raises(harmpi.HarmpiArgumentError, match="COMM_NULL"):
            call()
    assert (x == 1).all()


def test_a_split_that_leaves_a_rank_out(world):
    """Split with MPI.UNDEFINED gives the left-out rank a null communicator
    (another object than MPI.COMM_NULL): it is refused there, the members
    get their sum."""
    r, size = world.Get_rank(), world.Get_size()
    out = size - 1
    sub = world.Split(MPI.UNDEFINED if r == out and size > 1 else 0, key=r)
    x = np.full(8, float(r + 1), np.float32)
    if r == out and size > 1:
        with pytest.raises(harmpi.HarmpiArgumentError, match="COMM_NULL"):
            harmpi.allreduce(x, comm=sub)
        assert (x == r + 1).all()
    else:
        harmpi.allreduce(x, comm=sub)
        m = sub.Get_size()
        assert (x == m * (m + 1) / 2).all()
        sub.Free()
    world.Barrier()


# -- numpy subclasses -------------------------------------------------------------

@pytest.fixture
def rank_dir(world, tmp_path_factory):
    return tmp_path_factory.mktemp(f"rank{world.Get_rank()}")


def test_memmap_allreduce_in_place(world, rank_dir):
    r, size = world.Get_rank(), world.Get_size()
    path = rank_dir / "x.f32"
    m = np.memmap(path, dtype=np.float32, mode="w+", shape=(3000,))
    m[:] = np.arange(3000, dtype=np.float32) + r
    assert harmpi.allreduce(m, comm=world) is m
    expect = size * np.arange(3000, dtype=np.float64) + size * (size - 1) / 2
    assert (m == expect).all()
    m.flush()
    assert (np.fromfile(path, np.float32) == expect).all()   # the file holds the sum
    del m


def test_memmap_allgather_and_out(world, rank_dir):
    r, size = world.Get_rank(), world.Get_size()
    path = rank_dir / "shard.f64"
    np.full((4, 5), float(r), np.float64).tofile(path)
    shard = np.memmap(path, dtype=np.float64, mode="r", shape=(4, 5))  # read-only is fine
    got = harmpi.allgather(shard, comm=world)
    assert got.shape == (4 * size, 5)
    assert (got == np.repeat(np.arange(size, dtype=np.float64), 4)[:, None]).all()
    cols = harmpi.allgather(shard, dim=1, comm=world)
    assert cols.shape == (4, 5 * size) and (cols[:, ::5] == np.arange(size)).all()
    out = np.memmap(rank_dir / "out.f64", dtype=np.float64, mode="w+", shape=(4 * size, 5))
    assert harmpi.allgather(shard, comm=world, out=out) is out
    assert (out == got).all()
    # a read-only memmap cannot take an in-place sum
    with pytest.raises(harmpi.HarmpiArgumentError, match="read-only"):
        harmpi.allreduce(shard, comm=world)
    del shard, out


def test_masked_arrays_are_refused(small_comm):
    x = np.ma.masked_array(np.ones(4, np.float32), mask=[0, 1, 0, 0])
    with pytest.raises(harmpi.HarmpiArgumentError, match="masked"):
        harmpi.allreduce(x, comm=small_comm)


# -- deadlines -----------------------------------------------------------------

BAD_TIMEOUTS = ["inf", "-inf", "Infinity", "nan", "0", "-1", "1e300", "soon"]


@pytest.mark.parametrize("raw", BAD_TIMEOUTS)
def test_bad_timeout_from_the_environment(raw):
    with pytest.raises(harmpi.HarmpiArgumentError, match="HARMPI_TIMEOUT_S") as info:
        harmpi.Config.from_env({"HARMPI_TIMEOUT_S": raw})
    assert repr(raw) in str(info.value)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 0.0, -2.0, 1e300, "60"])
def test_bad_timeout_in_a_config(value):
    with pytest.raises(harmpi.HarmpiArgumentError, match="timeout_s="):
        harmpi.Config(timeout_s=value)
    with pytest.raises(harmpi.HarmpiArgumentError, match="timeout_s="):
        dataclasses.replace(harmpi.Config(), timeout_s=value)


def test_an_infinite_timeout_fails_set_up_on_every_rank(world, monkeypatch):
    """The environment is read when a communicator is first used: every rank
    raises the same clear error before any communication, and the world can
    go on."""
    comm = world.Dup()
    monkeypatch.setenv("HARMPI_TIMEOUT_S", "inf")
    with pytest.raises(harmpi.HarmpiArgumentError, match="HARMPI_TIMEOUT_S='inf'"):
        harmpi.allreduce(np.ones(4, np.float32), comm=comm)
    monkeypatch.setenv("HARMPI_TIMEOUT_S", "30")
    x = np.ones(4, np.float32)
    harmpi.allreduce(x, comm=comm)
    assert (x == world.Get_size()).all()
    assert harmpi.Config.from_env({"HARMPI_TIMEOUT_S": "0.5"}).timeout_s == 0.5
    world.Barrier()
    comm.Free()
