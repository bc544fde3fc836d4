"""Launcher of harmpi: builds and runs the mpirun line for topology-aware CPU inference.

``harmpi-launch -np 2 -- python script.py`` (``python -m harmpi_launch`` once
installed, ``python -m launch`` in a checkout) picks the MPI found next to
this Python or on PATH, maps ranks by NUMA node, binds them to cores, sizes
OpenMP threads, keeps workers spinning when cores allow, forwards HARMPI_*
settings, and gives every rank torchrun's variables (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). ``harmpi-launch
info`` shows the topology and the plan. The planning is a pure function, :func:`build_command`.
Jobs started without the launcher (tests, bench/demo, the Makefile) take Open
MPI's settings and ``mpirun`` from it too (launch/mpienv.py, which is also the
Makefile's ``python -m launch.mpienv --exports``).
"""

from .errors import LaunchError, MpiNotFoundError, TooManyRanksError
from .hosts import Host, parse_hostfile, parse_hosts
from .mpi import MpiInfo, find_mpi, find_mpirun, parse_mpi_version
from .placement import Layout, PlanInputs, plan_layout
from .plan import build_command, openmpi_defaults
from .topology import Cpu, HostTopology, detect_topology, read_sysfs_topology

__all__ = [
    "Cpu",
    "Host",
    "HostTopology",
    "Layout",
    "LaunchError",
    "MpiInfo",
    "MpiNotFoundError",
    "PlanInputs",
    "TooManyRanksError",
    "build_command",
    "detect_topology",
    "find_mpi",
    "find_mpirun",
    "openmpi_defaults",
    "parse_hostfile",
    "parse_hosts",
    "parse_mpi_version",
    "plan_layout",
    "read_sysfs_topology",
]
