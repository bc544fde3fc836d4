"""Ctrl-C during a set-up's blocking MPI calls (issue 21): the rank holds it
until its set-up is complete and registered, so its peers finish theirs;
then it raises KeyboardInterrupt, and the communicator works on every rank.
Without the hold, rank 0 would leave half-way and its peers would sit in a
blocking split or window allocation forever."""

import os
import signal

import numpy as np
import pytest
from mpi4py import MPI

import harmpi
from harmpi.runtime import context


def test_ctrl_c_in_the_blocking_set_up_is_held_until_it_is_done(world, monkeypatch):
    comm = world.Dup()
    rank = comm.Get_rank()
    real = context.discover

    def discover_after_ctrl_c(*args, **kwargs):
        if rank == 0:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, right at the first blocking call
        return real(*args, **kwargs)

    monkeypatch.setattr(context, "discover", discover_after_ctrl_c)
    if rank == 0:
        with pytest.raises(KeyboardInterrupt):
            harmpi.init(comm)
    else:
        harmpi.init(comm)
    monkeypatch.setattr(context, "discover", real)
    # every rank's set-up completed: the communicator is usable everywhere,
    # and the held signal does not interrupt the next wait
    x = np.full(1000, rank + 1.0, np.float32)
    harmpi.allreduce(x, comm=comm)
    n = comm.Get_size()
    assert np.all(x == n * (n + 1) / 2)
    comm.Barrier()
    comm.Free()
    assert MPI.Is_initialized()
