"""torchrun's rank variables under a bare MPI launcher, for libraries that read them.

torchrun gives every worker RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_WORLD_SIZE, and libraries read them instead of asking torch: transformers
takes the tensor-parallel size of ``tp_plan="auto"`` from WORLD_SIZE (unset,
it silently runs the whole model on every rank), accelerate its process
layout. ``harmpi-launch`` sets them in every rank (launch/rankenv.py); under a
plain ``mpirun python script.py`` nothing does, so ``import
harmpi.distributed`` (through :func:`harmpi.distributed.register`) and the
runner ``python -m harmpi.run`` call :func:`export`:

==================  =====================================================
RANK, WORLD_SIZE    MPI.COMM_WORLD's rank and size
LOCAL_RANK,         the launcher's own variables: Open MPI's
LOCAL_WORLD_SIZE    OMPI_COMM_WORLD_LOCAL_{RANK,SIZE}, Hydra's (MPICH,
                    Intel MPI) MPI_LOCALRANKID / MPI_LOCALNRANKS; the
                    ranks on this host, as harmpi-launch and torchrun
                    count them (virtual nodes do not change them)
==================  =====================================================

Only variables that are unset are set: a value given by the caller stays
(``init_process_group`` then checks RANK and WORLD_SIZE against MPI and
names a disagreement). Nothing is set outside an MPI launcher (a singleton
is not a world) or in a one-rank job started without one. When the launcher
gives no local rank, LOCAL_RANK and LOCAL_WORLD_SIZE stay unset and that is
logged once: finding them would take a collective, which an import must not
run.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from typing import Mapping, MutableMapping, Sequence

__all__ = ["LAUNCHER_SIGNS", "LOCAL_SOURCES", "TORCH_NAMES", "export", "launched",
           "rank_variables", "torchrun_hint"]

log = logging.getLogger("harmpi")

TORCH_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
#: each MPI launcher's names for (local rank, local size)
LOCAL_SOURCES = (
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)
#: variables that only an MPI launcher sets in its ranks
LAUNCHER_SIGNS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS")


def launched(environ: Mapping[str, str]) -> bool:
    """Whether this process was started by an MPI launcher (not an MPI singleton)."""
    return any(k in environ for k in LAUNCHER_SIGNS)


def rank_variables(rank: int, size: int, environ: Mapping[str, str]) -> dict[str, str]:
    """TORCH_NAMES -> values for MPI rank ``rank`` of ``size``; the local pair only
    when the launcher's variables give it."""
    values = {"RANK": str(rank), "WORLD_SIZE": str(size)}
    for local_rank, local_size in LOCAL_SOURCES:
        if environ.get(local_rank, "").isdigit() and environ.get(local_size, "").isdigit():
            values["LOCAL_RANK"] = environ[local_rank]
            values["LOCAL_WORLD_SIZE"] = environ[local_size]
            break
    return values


def export(environ: MutableMapping[str, str] | None = None, comm=None) -> dict[str, str]:
    """Set the unset TORCH_NAMES in ``environ`` (default ``os.environ``) from MPI,
    under an MPI launcher; return what was set."""
    environ = os.environ if environ is None else environ
    if not launched(environ):
        return {}
    if comm is None:
        from mpi4py import MPI  # noqa: PLC0415 - harmpi has initialised MPI by now

        comm = MPI.COMM_WORLD
    values = rank_variables(comm.Get_rank(), comm.Get_size(), environ)
    if "LOCAL_RANK" not in values and "LOCAL_RANK" not in environ:
        log.info("harmpi: LOCAL_RANK and LOCAL_WORLD_SIZE left unset: the MPI launcher "
                 "gives no local rank (looked for %s)",
                 ", ".join(n for pair in LOCAL_SOURCES for n in pair))
    added = {k: v for k, v in values.items() if k not in environ}
    environ.update(added)
    if added:
        log.debug("harmpi: set %s from MPI", ", ".join(f"{k}={v}" for k, v in added.items()))
    return added


def torchrun_hint(environ: Mapping[str, str] | None = None,
                  argv: Sequence[str] | None = None) -> str:
    """What to say to a process that torchrun started (empty otherwise).

    torchrun starts every rank as a process of its own, not through an MPI
    launcher: each is an MPI world of one, and harmpi's groups need MPI's
    world to be torch's. The hint names the launcher line that starts the
    same job: ``harmpi-launch --nproc-per-node K`` with the script and its
    arguments as this rank got them (``--hosts`` when torchrun ran several
    nodes).
    """
    environ = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in environ:
        return ""
    argv = sys.argv if argv is None else argv
    line = ["harmpi-launch", "--nproc-per-node", environ.get("LOCAL_WORLD_SIZE", "N")]
    nodes = environ.get("GROUP_WORLD_SIZE", "1")
    if nodes != "1":
        line += ["--hosts", ",".join(f"HOST{i}" for i in range(1, int(nodes) + 1))
                 if nodes.isdigit() else "HOST1,HOST2"]
    command = list(argv) if argv and argv[0] not in ("", "-c") else ["script.py"]
    return (" This process was started by torchrun, which starts each rank as an MPI job of "
            "its own; harmpi needs every rank in one MPI job. Start it with "
            f"`{shlex.join(line + command)}` instead (one command on the first host; "
            "mpirun starts the ranks on every host).")
