"""Under mpirun, ``import harmpi.distributed`` gives libraries torchrun's rank variables
(harmpi.platform.worldenv): RANK and WORLD_SIZE from MPI, the local pair from the launcher."""

import os

from mpi4py import MPI

import harmpi.distributed  # noqa: F401 - sets the variables


def test_rank_variables_match_mpi():
    world = MPI.COMM_WORLD
    assert os.environ["RANK"] == str(world.Get_rank())
    assert os.environ["WORLD_SIZE"] == str(world.Get_size())
    local = world.Split_type(MPI.COMM_TYPE_SHARED)  # the host, whatever the virtual nodes
    try:
        assert os.environ["LOCAL_RANK"] == str(local.Get_rank())
        assert os.environ["LOCAL_WORLD_SIZE"] == str(local.Get_size())
    finally:
        local.Free()
