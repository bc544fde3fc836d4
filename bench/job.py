"""The job around a benchmark: where its ranks run (topology, binding), the
header lines that say so, the rank-0-only ``--help``, and how the job ends
(every rank exits with one agreed code; an error on one rank aborts all)."""

from __future__ import annotations

import os
import sys
from importlib import metadata
from pathlib import Path

__all__ = [
    "bench_version",
    "topology",
    "environment_lines",
    "world_rank",
    "help_option",
    "exit_all",
    "run_or_abort",
]


def bench_version() -> str:
    """harmpi's version: the installed distribution, else the checkout's pyproject.toml."""
    try:
        return metadata.version("harmpi")
    except metadata.PackageNotFoundError:
        pass
    try:
        import tomllib

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return str(tomllib.loads(pyproject.read_text())["project"]["version"])
    except (OSError, KeyError, ValueError, ImportError):
        return "0+unknown"


# --------------------------------------------------------------------------
# What the header says about the run (collective: every rank calls these)
# --------------------------------------------------------------------------


def _cpu_list(cpus) -> str:
    """{0, 1, 2, 5} -> '0-2,5'."""
    cpus = sorted(cpus)
    parts, start = [], None
    for i, cpu in enumerate(cpus):
        if start is None:
            start = cpu
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            parts.append(str(start) if start == cpu else f"{start}-{cpu}")
            start = None
    return ",".join(parts)


def topology(comm) -> dict:
    """Hosts, nodes and ranks per node as harmpi sees them (HARMPI_RANKS_PER_NODE honoured).

    A node is the set of ranks of one host (MPI COMM_TYPE_SHARED); with
    HARMPI_RANKS_PER_NODE=k every k consecutive local ranks of a host form a
    virtual node.  Used for the header when harmpi is not among the
    implementations (otherwise ``harmpi.info()`` is quoted).
    """
    from mpi4py import MPI

    host_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    host_leader = host_comm.bcast(comm.Get_rank(), root=0)
    local_rank = host_comm.Get_rank()
    host_size = host_comm.Get_size()
    host_comm.Free()
    per_node_env = os.environ.get("HARMPI_RANKS_PER_NODE", "").strip()
    per_node = int(per_node_env) if per_node_env else 0
    node_key = (host_leader, local_rank // per_node if per_node > 0 else 0)
    keys = comm.allgather(node_key)
    order = sorted(set(keys))
    ranks_per_node = [keys.count(key) for key in order]
    hosts = len({key[0] for key in keys})
    return {
        "ranks": comm.Get_size(),
        "hosts": hosts,
        "nodes": len(order),
        "ranks_per_node": ranks_per_node,
        "virtual": per_node > 0 and len(order) > hosts,
        "max_ranks_per_host": comm.allreduce(host_size, op=MPI.MAX),
    }


def _ranks_line(topo: dict) -> str:
    per_node = topo["ranks_per_node"]
    if len(set(per_node)) == 1:
        nodes = f"{topo['nodes']} x {per_node[0]}"
    else:
        nodes = "+".join(map(str, per_node))
    where = f"{topo['hosts']} host{'s' if topo['hosts'] != 1 else ''}"
    if topo["virtual"]:
        where += (
            f", virtual nodes (HARMPI_RANKS_PER_NODE={os.environ.get('HARMPI_RANKS_PER_NODE')});"
            " only harmpi sees them, mpi and gloo see one host"
        )
    return f"# Ranks: {topo['ranks']}, nodes: {nodes} ({where})"


def _binding_line(affinity: list[str]) -> str:
    """Rank 0's line from every rank's CPU list."""
    if len(set(affinity)) == 1:
        binding = f"every rank may run on CPUs {affinity[0]}"
    else:
        binding = ", ".join(f"r{r}:{cpus}" for r, cpus in enumerate(affinity))
    return f"# Binding: {binding}"


def _harmpi_lines(info: dict) -> list[str]:
    extras = []
    for key, label in (("algorithm", "algorithm"), ("spin_count", "spin count"),
                       ("oversubscribed", "oversubscribed"),
                       ("mpi_thread_level", "MPI thread level")):
        if key in info:
            extras.append(f"{label} {info[key] if info[key] is not None else 'auto'}")
    lines = [
        f"# harmpi {info.get('version', '?')}: nodes {info.get('nodes')}, "
        f"ranks per node {info.get('ranks_per_node')}"
        + (" (virtual)" if info.get("virtual_nodes") else "")
        + (", " + ", ".join(extras) if extras else ""),
        f"# harmpi transport: {info.get('transport')} ({info.get('transport_reason', '')})",
    ]
    thresholds = info.get("thresholds")
    if thresholds:
        lines.append(
            "# harmpi thresholds: " + ", ".join(f"{k}={v}" for k, v in thresholds.items())
        )
    model = info.get("model")
    if model:  # where auto's switches came from (harmpi.algorithms.model)
        set_by = sorted(set(model.get("switches_set_by", {}).values()))
        lines.append(f"# harmpi switches set by: {', '.join(set_by)}; cost model constants: "
                     f"{model.get('source')}")
    return lines


def environment_lines(comm, topo: dict, harmpi_info: dict | None) -> list[str]:
    """'# ...' lines naming MPI, ranks, nodes, binding, threads, harmpi's choices."""
    from mpi4py import MPI

    library = MPI.Get_library_version().strip().splitlines()[0].split(",")[0]
    affinity = comm.gather(_cpu_list(os.sched_getaffinity(0)), root=0)
    load_1min = os.getloadavg()[0]
    lines = [
        f"# MPI: {library} (mpi4py {metadata.version('mpi4py')}), host CPUs: {os.cpu_count()}, "
        f"1-min load average {load_1min:.2f} (this job included)",
        _ranks_line(topo),
    ]
    if comm.Get_rank() == 0:
        lines.append(_binding_line(affinity))
    if harmpi_info is not None:
        lines += _harmpi_lines(harmpi_info)
    return lines


# --------------------------------------------------------------------------
# Rank-0 help and the end of the job
# --------------------------------------------------------------------------


def world_rank() -> int:
    """This process's rank in the job: the launcher's variables, else MPI's
    when mpi4py already started it, else 0 (a plain ``python -m``)."""
    for key in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        value = os.environ.get(key, "").strip()
        if value.isdigit():
            return int(value)
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.Get_rank()
    return 0


def _show_help_on_rank0(ctx, _param, value) -> None:
    if not value or ctx.resilient_parsing:
        return
    import click

    if world_rank() == 0:
        click.echo(ctx.get_help(), color=ctx.color)
    ctx.exit()


def help_option():
    """``-h/--help`` that prints on rank 0 only (click's prints once per rank)."""
    import click

    return click.help_option("-h", "--help", callback=_show_help_on_rank0)


def exit_all(code: int, comm=None):
    """``sys.exit(code)`` on every rank, after a barrier: the code is agreed,
    and no rank's exit (which ends the job under harmpi's fail-fast when the
    code is non-zero) can cut rank 0's last lines."""
    from mpi4py import MPI

    sys.stdout.flush()
    sys.stderr.flush()
    (MPI.COMM_WORLD if comm is None else comm).Barrier()
    sys.exit(code)


def run_or_abort(fn, *args, **kwargs):
    """Return fn(*args, **kwargs); on any error print it and abort the whole
    MPI job, so one failing rank never leaves the others waiting in a
    collective (also when started without ``python -m mpi4py``)."""
    try:
        return fn(*args, **kwargs)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException:
        import traceback

        from mpi4py import MPI

        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
        raise
