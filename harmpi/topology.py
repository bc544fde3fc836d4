"""Who is where: nodes, local ranks and rails, discovered once per communicator.

A *node* is the set of ranks that can share memory: MPI's
``COMM_TYPE_SHARED`` split. ``HARMPI_RANKS_PER_NODE=k`` cuts every such node
into *virtual nodes* of k consecutive local ranks, so a single host can
exercise every multi-node path. Nodes are numbered by their lowest rank.

A *rail* is the set of ranks with the same local rank on every node; the
cross-node step of the hierarchical algorithms runs on rails. On uneven nodes
(3 ranks as 2+1) some rails do not reach every node; algorithms that need
full rails check :attr:`Topology.uniform`.
"""

from __future__ import annotations

import dataclasses
import functools
import time

from mpi4py import MPI

from .errors import HarmpiArgumentError, HarmpiTimeoutError

__all__ = ["Topology", "discover", "arrive"]


def arrive(comm, timeout_s, what):
    """Wait, with a deadline, until every rank of ``comm`` has reached this
    point (MPI_Ibarrier, polled), so that the blocking collectives of a
    set-up that follow cannot hang on a rank that never comes: that rank is
    reported as a HarmpiTimeoutError instead."""
    req = comm.Ibarrier()
    deadline = time.monotonic() + timeout_s
    pause = 1e-5
    while not req.Test():
        if time.monotonic() > deadline:
            raise HarmpiTimeoutError(
                f"rank {comm.Get_rank()} of a communicator of {comm.Get_size()}: {what}: the "
                f"other ranks did not arrive within {timeout_s:g} s (a rank never called the "
                "same harmpi collective, or called it with another algorithm; "
                "HARMPI_TIMEOUT_S sets the deadline)")
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)


@dataclasses.dataclass(frozen=True)
class Topology:
    """Immutable placement facts of one rank within one communicator."""

    rank: int                 #: rank in the communicator
    size: int                 #: size of the communicator
    node_index: int           #: 0 .. node_count-1, nodes ordered by lowest rank
    node_count: int
    local_rank: int           #: rank inside the node
    local_size: int           #: ranks on this node
    node_ranks: tuple         #: node_ranks[g][l] = communicator rank of local rank l of node g
    virtual: bool             #: nodes were cut by HARMPI_RANKS_PER_NODE
    hostname: str

    @functools.cached_property
    def node_sizes(self) -> tuple:
        return tuple(len(r) for r in self.node_ranks)

    @functools.cached_property
    def uniform(self) -> bool:
        """Every node has the same number of ranks (so every rail spans all nodes)."""
        return len(set(self.node_sizes)) == 1

    @property
    def is_leader(self) -> bool:
        return self.local_rank == 0


def discover(comm, ranks_per_node=None):
    """Return ``(topology, node_comm, rail_comm)`` for ``comm``; collective over ``comm``.

    ``node_comm`` holds the ranks of this (possibly virtual) node ordered by
    rank; ``rail_comm`` holds the ranks with this local rank, ordered by node.
    """
    if ranks_per_node is not None and ranks_per_node < 1:
        raise HarmpiArgumentError(f"ranks per node must be >= 1, got {ranks_per_node}")
    rank = comm.Get_rank()
    host_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    virtual = False
    if ranks_per_node is not None and ranks_per_node < host_comm.Get_size():
        node_comm = host_comm.Split(host_comm.Get_rank() // ranks_per_node, key=rank)
        host_comm.Free()
        virtual = True
    else:
        node_comm = host_comm
    local_rank = node_comm.Get_rank()
    members = tuple(node_comm.allgather(rank))
    # Every rank learns every node's member list; node order = lowest rank.
    all_members = comm.allgather(members)
    node_ranks = tuple(sorted(set(all_members), key=lambda m: m[0]))
    node_index = node_ranks.index(members)
    rail_comm = comm.Split(local_rank, key=node_index)
    topo = Topology(
        rank=rank, size=comm.Get_size(), node_index=node_index, node_count=len(node_ranks),
        local_rank=local_rank, local_size=node_comm.Get_size(), node_ranks=node_ranks,
        virtual=virtual, hostname=MPI.Get_processor_name(),
    )
    return topo, node_comm, rail_comm
