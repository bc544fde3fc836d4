"""One vLLM tensor-parallel group served by harmpi: its MPI communicator and
its two collectives.

vLLM names a group's members by their torch.distributed ranks. The plug-in
needs them to be MPI ranks of the same numbers: vLLM started one process per
rank under an MPI launcher (``distributed_executor_backend="external_launcher"``
under ``harmpi-launch`` or ``mpirun``, which export RANK/WORLD_SIZE from MPI's
own). Each member reads what its MPI launcher says it is from the
environment (no MPI call: a process that is not an MPI rank must not
initialise MPI), the members exchange that over vLLM's Gloo group, and every
member takes the same decision: serve the group, or raise the same
:class:`~harmpi_vllm.VllmLaunchError` naming what each rank saw.

Served: the group's communicator is MPI.COMM_WORLD when the group is every
rank of the job (the operator's group "", whose CPU kernel calls harmpi's
compiled entry directly), otherwise ``COMM_WORLD.Create_group`` of its
ranks, bound to the vLLM group's name with ``harmpi.native.name_group``.

Not served: where harmpi's torch extension (harmpi._C, whose operator
vLLM's compiled graph calls) is absent on any member, every member leaves
the group to vLLM's own collectives, and one line on the group's first
rank says why (``harmpi.native.status()``, as ``harmpi.info()["native"]``).
"""

from __future__ import annotations

import dataclasses
import logging
import os

from . import ENV, VllmLaunchError

# vLLM's logging configuration shows its own "vllm" loggers' INFO lines
log = logging.getLogger("vllm.harmpi")

#: (rank variable, size variable) of the MPI launchers: Open MPI, then
#: MPICH's Hydra and Intel MPI
MPI_ENV = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"))

HOW = ("run one process per vLLM rank under MPI and let vLLM start no workers of its own: "
       "LLM(..., distributed_executor_backend=\"external_launcher\") under "
       "`harmpi-launch -np N -- python script.py` (or mpirun -np N); or unset " + ENV)


#: how harmpi's waits go in a vLLM TP group unless HARMPI_WAIT says otherwise:
#: spinning, as vLLM's own shared-memory op does. vLLM binds each rank's
#: threads to cores of its own, so a spinning rank takes no core a peer
#: needs; "auto" would sleep through the longer waits of a decode step (a
#: rank's Python between steps) and every sleep puts the wake-up (~90 us on
#: a VM) on the step's critical path (issue 38: 1x2 compiled, 16 x 128
#: tokens, tokens/s median: auto 139.7, spin 173.3, vLLM's shm op 168.8).
#: Ranks that outnumber their cores still yield at once (harmpi.base.sync).
VLLM_WAIT = "spin"


def harmpi_config(environ):
    """The harmpi.Config a TP group's context gets: the environment's,
    with :data:`VLLM_WAIT` where HARMPI_WAIT is unset."""
    from harmpi import Config  # noqa: PLC0415 - see harmpi_vllm's docstring

    config = Config.from_env(environ)
    if not (environ.get("HARMPI_WAIT") or "").strip():
        config = dataclasses.replace(config, wait=VLLM_WAIT)
    return config


def mpi_rank_from_env(environ) -> tuple[int, int] | None:
    """(rank, size) that this process's MPI launcher exported, or None."""
    for rank_var, size_var in MPI_ENV:
        if rank_var in environ and size_var in environ:
            return int(environ[rank_var]), int(environ[size_var])
    return None


def rank_view(torch_rank: int, torch_world: int, environ) -> tuple:
    """What one member contributes to :func:`check_ranks`."""
    return torch_rank, torch_world, mpi_rank_from_env(environ)


def check_ranks(name: str, views) -> None:
    """Raise VllmLaunchError unless every member's torch rank is its MPI rank
    in a job whose MPI world is torch's world. ``views``: every member's
    :func:`rank_view`, the same list on every member (so all raise alike)."""
    bad = []
    for torch_rank, torch_world, mpi in views:
        if mpi is None:
            bad.append(f"vLLM rank {torch_rank} was not started by an MPI launcher")
        elif mpi != (torch_rank, torch_world):
            bad.append(f"vLLM rank {torch_rank} of {torch_world} is MPI rank {mpi[0]} of "
                       f"{mpi[1]}")
    if bad:
        raise VllmLaunchError(
            f"{ENV}=1: harmpi cannot carry vLLM's group {name!r} (ranks "
            f"{[v[0] for v in views]}): vLLM's ranks are not MPI ranks ({'; '.join(bad)}). "
            f"vLLM's default multiprocessing executor starts its workers itself; {HOW}")


def communicator_for(ranks, world):
    """(comm, op group name or "") for the group of MPI ranks ``ranks``:
    ``world`` itself when the group is all of it, else a communicator of
    those ranks (collective over the group's members only)."""
    ranks = list(ranks)
    if ranks == list(range(world.Get_size())):
        return world, ""
    return world.Create_group(world.Get_group().Incl(ranks)), None


class HarmpiGroup:
    """A vLLM TP group's collectives through harmpi (made by :meth:`make`).

    all_reduce(x): rank r holds x_r; every rank's x becomes x_0 + ... +
    x_{n-1} (bitwise the same everywhere), and x is returned: in place, as
    vLLM's own CpuCommunicator sums.
    all_gather(x, dim): every rank gets cat([x_0, ..., x_{n-1}], dim).
    """

    def __init__(self, comm, op_group: str, name: str, ranks):
        import torch  # noqa: PLC0415 - loaded by vLLM by now

        import harmpi  # noqa: PLC0415 - the point of this class: imported late
        from harmpi import native  # noqa: PLC0415

        self.comm, self.op_group, self.name, self.ranks = comm, op_group, name, list(ranks)
        # in place and returning nothing, as vLLM's shm op: in vLLM's
        # compiled graph inductor then sums the matmul's buffer where it
        # lies (the out-of-place operator allocated, copied and had its
        # result checked, ~1.5 us a call; issue 38)
        self._op = torch.ops.harmpi.all_reduce_inplace
        self._allgather = harmpi.allgather
        # the world's dim-0 allgather in C++ (a tensor, or an int: -1 where
        # it declines, a failure status; harmpi.allgather then decides)
        self._native_gather = native.allgather() if op_group == "" else None

    @classmethod
    def make(cls, name: str, ranks, views):
        """The group ``name`` of vLLM ranks ``ranks``; None where harmpi's
        torch extension is absent on a member (vLLM's own collectives carry
        the group; one line says so); or VllmLaunchError. ``views``:
        :func:`rank_view` of every member (collective)."""
        check_ranks(name, views)
        from mpi4py import MPI  # noqa: PLC0415

        import harmpi  # noqa: PLC0415 - only now: see harmpi_vllm's docstring
        from harmpi import native  # noqa: PLC0415

        comm, op_group = communicator_for(ranks, MPI.COMM_WORLD)
        # every member takes the same decision: one member without the
        # operator would leave the others waiting in it
        absent = comm.allgather(None if native.load() is not None else native.status())
        if any(absent):
            first = comm.Get_rank() == 0
            if comm is not MPI.COMM_WORLD:
                comm.Free()
            (log.warning if first else log.debug)(
                "harmpi does not carry vLLM's group %s: its torch extension (the operator "
                "torch.ops.harmpi.all_reduce_inplace that vLLM's graph calls) is %s on rank(s) %s; "
                "vLLM's own all-reduce and all_gather carry it", name,
                next(why for why in absent if why),
                [r for r, why in zip(ranks, absent) if why])
            return None
        if op_group is None:
            op_group = name
            native.name_group(name, comm)
        # collective: windows, transport, kernels now, not in a timed step
        try:
            harmpi.init(comm, config=harmpi_config(os.environ))
        except harmpi.HarmpiArgumentError:
            # the program used harmpi on this communicator already: its
            # context (and its waits) stay as they are, on every rank alike
            harmpi.init(comm)
        where = harmpi.info(comm)
        (log.info if comm.Get_rank() == 0 else log.debug)(
            "harmpi carries vLLM's all-reduce and all_gather in group %s: vLLM/MPI ranks %s, "
            "%s node(s), communicator %s, waits %s", name, list(ranks), where["nodes"],
            "MPI.COMM_WORLD" if not op_group else f"of ranks {list(ranks)} ({op_group!r})",
            where.get("wait"))
        return cls(comm, op_group, name, ranks)

    def all_reduce(self, x):
        self._op(x, self.op_group)
        return x

    def all_gather(self, x, dim: int):
        """cat([x_0, ..., x_{n-1}], dim): one dim-0 gather of the ranks'
        contiguous x, then (where a dimension before ``dim`` is not 1)
        vLLM's own reordering copy, as its CpuCommunicator does."""
        x = x.contiguous()
        d = dim % x.dim()
        got = self._native_gather(x) if self._native_gather is not None else -1
        if type(got) is int:
            got = self._allgather(x, dim=0, comm=self.comm)
        shape = list(x.shape)
        shape[d] *= len(self.ranks)
        if all(s == 1 for s in x.shape[:d]):
            return got.view(shape)  # each rank's block is contiguous in the result
        return got.view(len(self.ranks), *x.shape).movedim(0, d).reshape(shape)
