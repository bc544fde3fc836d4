"""torch threads for the ranks of a decode benchmark: the host's CPUs shared
among the ranks on it (``bench.decode``, ``bench.moe_decode``)."""

from __future__ import annotations

import dataclasses
import os

__all__ = ["Threads", "threads_per_rank", "set_threads"]


@dataclasses.dataclass(frozen=True)
class Threads:
    """torch threads of this rank and what the count was derived from."""

    count: int
    host_cpus: int | None
    local_ranks: int
    allowed_cpus: int


def threads_per_rank(host_cpus: int, local_ranks: int, allowed_cpus: int,
                     override: int | None = None) -> int:
    """Compute threads for one rank: the host's CPUs shared among the ranks on it.

    At least 1, and no more than the CPUs the rank is bound to.
    """
    if override is not None:
        return max(1, override)
    return max(1, min(host_cpus // max(1, local_ranks), allowed_cpus))


def _local_ranks(comm) -> int:
    """Ranks of ``comm`` on this host (collective)."""
    from mpi4py import MPI

    host_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local_ranks = host_comm.Get_size()
    host_comm.Free()
    return local_ranks


def set_threads(comm, override: int | None) -> Threads:
    """Give torch this rank's share of the host's CPUs (collective)."""
    local_ranks = _local_ranks(comm)
    allowed = len(os.sched_getaffinity(0))
    count = threads_per_rank(os.cpu_count() or 1, local_ranks, allowed, override)
    # Before torch starts its OpenMP pool; a value the user exported wins.
    os.environ.setdefault("OMP_NUM_THREADS", str(count))
    import torch

    torch.set_num_threads(count)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or parallel work already started
        pass
    return Threads(count, os.cpu_count(), local_ranks, allowed)

