"""The all-to-all's late-rank error names the rank that never arrived, on
every rank that waited, as the all-reduce's does (tests/mpi/test_faults.py):
across two nodes too, where a rank waits on its rail peer and that peer
waits, in its node's flag round, for the missing rank (issue 35, finding 7)."""

import time

import pytest
from conftest import torch
from test_faults import _GAVE_UP, _short, _wait_for_gave_up

import harmpi


@pytest.mark.parametrize("missing_local_rank", ["last", "first"])
def test_every_alltoall_waiter_names_the_rank_that_never_arrived(world, topo,
                                                                 missing_local_rank):
    """One rank of the last node never calls. At 2 x 2 with rank 3 missing,
    rank 0 waits on its rail peer rank 2, which waits on rank 3 in node 1's
    first flag round: rank 0 must still name rank 3 (with rank 2 missing,
    rank 1 must), and every waiting rank fail within a few deadlines."""
    r, size = world.Get_rank(), world.Get_size()
    G = topo.node_count
    if size == 1 or not topo.uniform or (G > 2 and G & (G - 1)):  # the same on every rank
        pytest.skip("one node, or 2^k equal nodes (the rail all-to-all)")
    comm = world.Dup()
    timeout_s = 1.0
    _short(comm, timeout_s=timeout_s)
    last_node = topo.node_ranks[-1]
    missing = last_node[-1] if missing_local_rank == "last" else last_node[0]
    if r == missing:
        _wait_for_gave_up(world, size - 1)   # stays away until every other rank raised
    else:
        x = torch.arange(size * 2 * 3, dtype=torch.float32).reshape(size * 2, 3) + 100 * r
        t0 = time.monotonic()
        try:
            with pytest.raises(harmpi.HarmpiTimeoutError) as info:
                harmpi.alltoall(x, comm=comm)
        finally:
            world.send(r, dest=missing, tag=_GAVE_UP)
        took_s = time.monotonic() - t0
        message = str(info.value)
        print(f"rank {r}: after {took_s:.2f} s: {message}", flush=True)
        assert f"rank {missing}" in message, message
        # one deadline, and one more for a peer stuck on the missing rank
        # (G > 2 nodes: turn t waits t + 2 deadlines, G - 2 at most)
        assert took_s < (4 if topo.node_count == 2 else topo.node_count + 1) * timeout_s, \
            (took_s, message)
    world.Barrier()
