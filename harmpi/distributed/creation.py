"""Creating a harmpi process group: what the creator torch calls for every
group of backend "harmpi" does (harmpi.distributed registers it). Rank and
world size come from MPI: a rank or world size given by the caller (or by
RANK/WORLD_SIZE) must match MPI's. A ``new_group``'s members first meet on
the group's own store, under the deadline, before the blocking
MPI_Comm_create_group."""

from __future__ import annotations

import time

import torch.distributed as dist
from mpi4py import MPI

from ..base.topology import LATE_FRACTION
from ..config import Config
from ..errors import HarmpiArgumentError, HarmpiError, HarmpiTimeoutError
from ..platform import worldenv
from .group import ProcessGroupHarmpi
from .waits import group_timeout

__all__ = ["create_group"]

_WORLD = MPI.COMM_WORLD


def create_group(backend_opts):
    """The group torch asked for (the creator's ``backend_opts``: the group's
    ranks, store and timeout): the world's, or one over a new communicator
    of its members."""
    if not MPI.Is_initialized():
        raise HarmpiError("harmpi backend: MPI is not initialised; run under mpirun")
    ranks = list(backend_opts.global_ranks_in_group)
    rank, size = backend_opts.group_rank, backend_opts.group_size
    timeout_s = group_timeout(getattr(backend_opts, "timeout", None))
    if not ranks:  # the default group: torch's world must be MPI's
        if (rank, size) != (_WORLD.Get_rank(), _WORLD.Get_size()):
            raise HarmpiArgumentError(
                f"harmpi backend: torch says rank {rank} of {size}, MPI says rank "
                f"{_WORLD.Get_rank()} of {_WORLD.Get_size()}: the rank and world size given to "
                "init_process_group (or RANK/WORLD_SIZE) must match mpirun's, or be left out."
                + worldenv.torchrun_hint())
        return ProcessGroupHarmpi(_WORLD, rank, size, timeout_s)
    world = dist.distributed_c10d._get_default_group()
    if world.size() != _WORLD.Get_size():
        raise HarmpiArgumentError("harmpi backend: the default group does not span MPI's world")
    # MPI_Comm_create_group blocks until every member calls it: first make
    # sure (a polled meeting on the group's own store, under the deadline)
    # that they all came, so one that never does is named instead
    _members_arrive(backend_opts.store, rank, ranks,
                    timeout_s or Config.from_env().timeout_s)
    world_group = _WORLD.Get_group()
    members = world_group.Incl(ranks)
    try:
        comm = _WORLD.Create_group(members)
    finally:
        members.Free()
        world_group.Free()
    if comm.Get_rank() != rank:
        raise HarmpiError(f"harmpi backend: group rank {rank} is MPI rank {comm.Get_rank()}")
    return ProcessGroupHarmpi(comm, rank, size, timeout_s)


def _members_arrive(store, rank, ranks, timeout_s):
    """Every member of a new group has come to its creation in time, or
    HarmpiTimeoutError on every member (the store is the group's own: torch
    prefixes it with the group's unique name). Each member posts its arrival
    time (CLOCK_REALTIME) and counts itself in. A member that does not see
    all of them within ``timeout_s`` of its own arrival names the missing
    ones and raises. Once all have come, each member decides from the posted
    times alone, so all decide alike: a member that came more than
    LATE_FRACTION x ``timeout_s`` after the first fails everywhere, since the
    first may have given up by then (a late member used to go on into the
    blocking MPI_Comm_create_group alone and wait there forever). The last
    member to read the times deletes the meeting's keys (see
    :func:`_clear_meeting`)."""
    store.set(f"harmpi/arrived/{rank}", repr(time.time()))
    count = store.add("harmpi/arrived", 1)
    deadline = time.monotonic() + timeout_s
    pause = 1e-4
    while count < len(ranks):
        if time.monotonic() > deadline:
            late = [w for r, w in enumerate(ranks) if not store.check([f"harmpi/arrived/{r}"])]
            raise HarmpiTimeoutError(
                f"rank {_WORLD.Get_rank()}: harmpi backend: creating a process group of world "
                f"ranks {ranks}: world rank{'s' if len(late) > 1 else ''} "
                f"{', '.join(map(str, late))} did not come within {timeout_s:g} s (it failed "
                "or hangs, or did not call new_group; HARMPI_TIMEOUT_S or timeout= sets the "
                "deadline)", culprit=late[0] if late else -1)
        time.sleep(pause)
        pause = min(2 * pause, 0.01)
        count = store.add("harmpi/arrived", 0)
    stamps = [float(store.get(f"harmpi/arrived/{r}")) for r in range(len(ranks))]
    _clear_meeting(store, len(ranks))
    first = min(stamps)
    late = [(w, t - first) for w, t in zip(ranks, stamps) if t - first > LATE_FRACTION * timeout_s]
    if late:
        raise HarmpiTimeoutError(
            f"rank {_WORLD.Get_rank()}: harmpi backend: creating a process group of world ranks "
            f"{ranks}: " + ", ".join(f"world rank {w} came {d:.1f} s" for w, d in late)
            + f" after the first, past {LATE_FRACTION:g} x the {timeout_s:g} s deadline: the "
            "others may have given up (HARMPI_TIMEOUT_S or timeout= sets the deadline)",
            culprit=late[0][0])


def _clear_meeting(store, size):
    """Each member counts itself out once it has read every arrival time;
    the last one deletes the meeting's keys. The store outlives the group
    (it is the default group's, under the group's prefix): kept, the keys
    of every new_group grew rank 0's store server, which holds them, by
    ~0.9 KB per group, 5 keys at 4 ranks (issue 35, finding 9). No member
    touches them after counting itself out; a meeting that failed keeps
    them (its members raise before they count out)."""
    if store.add("harmpi/read", 1) == size:
        for r in range(size):
            store.delete_key(f"harmpi/arrived/{r}")
        store.delete_key("harmpi/arrived")
        store.delete_key("harmpi/read")
