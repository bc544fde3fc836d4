"""torchrun's node flags, mapped onto one mpirun command.

torchrun runs one launcher per node (``--nnodes 2 --node-rank 0`` here,
``--node-rank 1`` there) that meet at a rendezvous; ``harmpi-launch`` runs
once, on the first host, and mpirun starts the ranks of every host it is
given (``--hosts``/``--hostfile``). So:

================  =======================================================
``--standalone``  one host with its own rendezvous: what harmpi-launch does
                  without ``--hosts`` (refused with ``--hosts``)
``--nnodes N``    N hosts: 1 is this host alone; more must be named by
                  ``--hosts``/``--hostfile``, N of them. ``MIN:MAX``
                  (elastic) only as ``N:N``.
``--node-rank``   0 only: the one launcher runs on the first node; mpirun
                  starts the others
================  =======================================================

``--nproc-per-node`` (K ranks on each host) is folded into ``-np`` by the CLI.
Pure: these functions read nothing but their arguments.
"""

from __future__ import annotations

from .errors import LaunchError

__all__ = ["check_node_flags", "parse_nnodes"]


def parse_nnodes(text: str) -> int:
    """torchrun's ``--nnodes`` value (``N`` or ``N:N``) as a count of hosts."""
    parts = text.split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise LaunchError(f"--nnodes {text!r}: give a number of hosts, e.g. --nnodes 2")
    low, high = int(parts[0]), int(parts[-1])
    if low != high:
        raise LaunchError(f"--nnodes {text}: an elastic range is not supported; mpirun starts "
                          "a fixed set of hosts (give --nnodes N)")
    if low < 1:
        raise LaunchError(f"--nnodes {text}: at least one host")
    return low


def check_node_flags(nnodes: str | None, node_rank: int | None, standalone: bool,
                     n_hosts: int) -> None:
    """Refuse torchrun node flags that contradict the hosts mpirun is given
    (``n_hosts``: hosts named by --hosts/--hostfile, 0 for this host alone)."""
    if node_rank is not None and node_rank != 0:
        raise LaunchError(
            f"--node-rank {node_rank}: harmpi-launch runs once, on the first host (node rank "
            "0), and mpirun starts the ranks of every host given by --hosts/--hostfile; do "
            "not run it on the other hosts")
    if standalone and n_hosts:
        raise LaunchError("--standalone runs on this host only; drop it or drop "
                          "--hosts/--hostfile")
    if nnodes is None:
        return
    n = parse_nnodes(nnodes)
    if n == 1 and n_hosts > 1:
        raise LaunchError(f"--nnodes 1 with {n_hosts} hosts given: give --nnodes {n_hosts} "
                          "or one host")
    if n > 1 and n_hosts == 0:
        raise LaunchError(
            f"--nnodes {n}: name the {n} hosts with --hosts H1,H2,... or --hostfile (torchrun "
            "runs a launcher on each node; harmpi-launch runs once and mpirun reaches them)")
    if n > 1 and n_hosts != n:
        raise LaunchError(f"--nnodes {n} but {n_hosts} hosts given")
