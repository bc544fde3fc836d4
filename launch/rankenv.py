"""Per-rank torch.distributed variables, then the rank's own command.

mpirun gives every rank the same environment; only the MPI knows each rank's
number, and it says so in variables of its own. The launcher therefore runs
every rank as ``PYTHON -I -S .../rankenv.py -- COMMAND...``: this sets what
torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE; MASTER_ADDR
and MASTER_PORT come from the launcher itself) from the MPI's variables and
replaces itself with COMMAND (``os.execvp``: same process, so mpirun's view
of the rank is unchanged). It uses the standard library only and imports
neither harmpi nor the launcher, so it costs one bare interpreter start.

=============================  =======================================
MPI                            rank, size, local rank, local size
=============================  =======================================
Open MPI                       OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}
MPICH (Hydra), Intel MPI       PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
=============================  =======================================
"""

from __future__ import annotations

import os
import sys
from typing import Mapping, Sequence

__all__ = ["SOURCES", "TORCH_NAMES", "main", "rank_variables"]

TORCH_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
#: each MPI's names for TORCH_NAMES, in that order
SOURCES = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def rank_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """TORCH_NAMES -> values read from the first MPI in SOURCES that set all four.

    Raises LookupError naming what was looked for when no MPI set them.
    """
    for names in SOURCES:
        if all(environ.get(n, "").isdigit() for n in names):
            return {t: environ[n] for t, n in zip(TORCH_NAMES, names)}
    looked = "; ".join(", ".join(names) for names in SOURCES)
    raise LookupError(f"no MPI rank variables in the environment (looked for {looked}): "
                      "rankenv runs under mpirun, started by the harmpi launcher")


def main(argv: Sequence[str]) -> None:
    """``rankenv.py [--] COMMAND [ARGS]...``: export the rank variables, exec COMMAND."""
    command = list(argv[1:] if argv and argv[0] == "--" else argv)
    if not command:
        sys.exit("rankenv: missing command")
    try:
        os.environ.update(rank_variables(os.environ))
    except LookupError as exc:
        sys.exit(f"rankenv: {exc}")
    try:
        os.execvp(command[0], command)
    except OSError as exc:  # 127: the shell's "command not found"
        print(f"rankenv: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
