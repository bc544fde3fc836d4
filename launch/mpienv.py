"""The Open MPI environment of jobs started without the launcher.

The tests, ``bench/demo.py`` and the Makefile start ``mpirun`` themselves;
they take its settings from here, and here takes them from the launcher's
plan (:func:`launch.plan.openmpi_defaults`), so the settings are written
once. The ``mpirun`` to start is :func:`find_mpirun` (from launch/mpi.py,
which documents the search order).

    python -m launch.mpienv --exports

prints ``NAME=value``, one a line, for each setting the environment does not
have yet (what the Makefile exports: ``export $(python -m launch.mpienv
--exports)`` does the same in a shell). It needs nothing beyond the standard
library, so the system Python runs it before the virtualenv exists.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Mapping

from .mpi import find_mpirun
from .plan import openmpi_defaults

__all__ = ["find_mpirun", "job_defaults", "main", "mpi_env"]


def job_defaults(*, yield_when_idle: bool = True) -> dict[str, str]:
    """Open MPI's settings for a job started by hand: root allowed (harmless
    when not root), no UCX (these jobs run without RDMA hardware) and, unless
    asked not to, waiting ranks yield their core (tests run more ranks than
    cores)."""
    return openmpi_defaults(run_as_root=True, rdma=False, yield_when_idle=yield_when_idle)


def mpi_env(base: Mapping[str, str] | None = None, extra: Mapping[str, str] | None = None, *,
            yield_when_idle: bool = True) -> dict[str, str]:
    """A job's environment: ``base`` (default: this process's), plus each of
    :func:`job_defaults` that ``base`` does not set (the caller's values win),
    plus ``extra`` (which wins over both)."""
    env = dict(os.environ if base is None else base)
    for name, value in job_defaults(yield_when_idle=yield_when_idle).items():
        env.setdefault(name, value)
    env.update(extra or {})
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.mpienv", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--exports", action="store_true", required=True,
                        help="print NAME=value for each setting the environment lacks")
    parser.parse_args(argv)
    for name, value in job_defaults().items():
        if name not in os.environ:
            print(f"{name}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
