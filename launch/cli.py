"""``harmpi-launch`` / ``python -m launch``: the command line.

``python -m launch [OPTIONS] [--] COMMAND [ARGS]...`` runs COMMAND on every
rank; ``python -m launch info [OPTIONS]`` describes this host and the plan. The
only module of the launcher that prints.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
from dataclasses import replace
from typing import Any, Sequence

import click

from .errors import LaunchError, MpiNotFoundError, TooManyRanksError
from .hosts import Host, parse_hostfile, parse_hosts, unresolvable
from .mpi import MpiInfo, find_mpi
from .placement import BIND_TO, MAP_BY, TRANSPORTS, Layout, PlanInputs, plan_layout
from .plan import build_command
from .runner import Finished, run_mpirun
from .topology import HostTopology, detect_topology
from .torchrun import check_node_flags

__all__ = ["cli", "main", "plan_inputs", "run_cmd"]

PROG = "harmpi-launch"


def format_cpulist(cpus: Sequence[int]) -> str:
    """(0, 1, 2, 5) -> "0-2,5"."""
    parts: list[str] = []
    run: list[int] = []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


# --- click plumbing: `info` is a subcommand, everything else runs -----------


class _LaunchGroup(click.Group):
    """A group whose default command is ``run``: ``launch -np 2 -- cmd`` == ``launch run ...``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or args[0] not in self.commands:
            ctx.meta["launch.implicit_run"] = True
            args = ["run", *args]
        return super().parse_args(ctx, args)


class _RunContext(click.Context):
    @property
    def command_path(self) -> str:  # hide the implicit "run" in usage and errors
        if self.parent is not None and self.meta.get("launch.implicit_run"):
            return self.parent.command_path
        return super().command_path


class _RunCommand(click.Command):
    context_class = _RunContext


def _plan_options(f: Any) -> Any:
    """The options shared by the run command and ``info``."""
    options = [
        click.option("-np", "-n", "--np", "np", type=click.IntRange(min=1), metavar="N",
                     help="Number of ranks (info: default one per NUMA node of each host)."),
        click.option("-H", "--hosts", "--host", "hosts", metavar="H1[:SLOTS],H2...",
                     help="Comma-separated hosts; a host without :SLOTS gets as many "
                          "slots as this host has cores."),
        click.option("--hostfile", type=click.Path(exists=True, dir_okay=False),
                     help="Hostfile ('host slots=N' or 'host:N' lines), passed to mpirun."),
        click.option("--ranks-per-node", type=click.IntRange(min=1), metavar="K",
                     help="Exactly K consecutive ranks on each host; -np must divide by K."),
        click.option("--nproc-per-node", "--nproc_per_node", "nproc_per_node",
                     type=click.IntRange(min=1), metavar="K",
                     help="As torchrun: K ranks on each host (-np defaults to K x hosts)."),
        click.option("--nnodes", metavar="N",
                     help="As torchrun: the number of hosts; 1 is this host, more must be "
                          "named by --hosts/--hostfile."),
        click.option("--node-rank", "--node_rank", "node_rank", type=click.IntRange(min=0),
                     metavar="R", help="As torchrun; 0 only: this one command starts every "
                                       "host's ranks."),
        click.option("--standalone", is_flag=True,
                     help="As torchrun: this host alone (what runs without --hosts)."),
        click.option("--map-by", type=click.Choice(MAP_BY), default="numa", show_default=True,
                     help="Domain ranks are spread over."),
        click.option("--bind-to", type=click.Choice(BIND_TO), default="core",
                     show_default=True, help="What each rank is bound to."),
        click.option("--threads-per-rank", type=click.IntRange(min=1), metavar="T",
                     help="OpenMP threads per rank [default: cores of one mapping domain "
                          "divided among its ranks]."),
        click.option("--spin/--no-spin", default=None,
                     help="Keep OpenMP workers spinning (GOMP_SPINCOUNT=100000000, "
                          "KMP_BLOCKTIME=infinite) [default: on when ranks x threads fit "
                          "the cores of each host]."),
        click.option("--transport", type=click.Choice(TRANSPORTS),
                     help="Cross-node transport of harmpi (sets HARMPI_TRANSPORT)."),
        click.option("--virtual-nodes", type=click.IntRange(min=1), metavar="K",
                     help="Treat every K consecutive ranks of a host as one node "
                          "(sets HARMPI_RANKS_PER_NODE=K; uneven splits allowed)."),
        click.option("--oversubscribe", is_flag=True,
                     help="Allow more ranks than slots (binding is then relaxed to none)."),
        click.option("--mpi-arg", "mpi_args", multiple=True, metavar="ARGS",
                     help="Extra mpirun arguments, split like a shell; repeatable, "
                          "e.g. --mpi-arg '--mca btl tcp,self'."),
        click.option("--mpirun", "mpirun", metavar="PATH",
                     help="Use this mpirun/mpiexec instead of searching the "
                          "virtualenv's bin and PATH."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def free_port() -> int:
    """A TCP port free on this host now (MASTER_PORT; torchrun picks it the same way)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _hosts(params: dict[str, Any]) -> tuple[Host, ...]:
    if params["hosts"] and params["hostfile"]:
        raise LaunchError("give either --hosts or --hostfile, not both")
    if params["hosts"]:
        return parse_hosts(params["hosts"])
    if params["hostfile"]:
        with open(params["hostfile"]) as fh:
            return parse_hostfile(fh.read(), where=params["hostfile"])
    return ()


def _ranks(params: dict[str, Any], n_hosts: int) -> tuple[int | None, int | None]:
    """(-np, --ranks-per-node) once torchrun's --nproc-per-node K is folded in:
    K ranks on each given host (np = K x hosts), or on this host (np = K)."""
    np, per_node, k = params["np"], params["ranks_per_node"], params["nproc_per_node"]
    if k is None:
        return np, per_node
    if per_node is not None and per_node != k:
        raise LaunchError(f"--nproc-per-node {k} and --ranks-per-node {per_node} disagree")
    if np is None:
        np = k * max(n_hosts, 1)
    if n_hosts:
        return np, k
    if np != k:
        raise LaunchError(f"-np {np} with --nproc-per-node {k} on this host alone: give one "
                          "of them (or --hosts for several hosts)")
    return np, per_node


def plan_inputs(params: dict[str, Any], command: Sequence[str],
                master_port: int | None = None) -> PlanInputs:
    """The plan's inputs from ``run``'s parsed options (``run_cmd.make_context``'s
    params): what the launcher itself plans from, and what harmpi_vllm's
    executor plans its job from (LaunchError where the options cannot work)."""
    hosts = _hosts(params)
    check_node_flags(params["nnodes"], params["node_rank"], params["standalone"], len(hosts))
    np, ranks_per_node = _ranks(params, len(hosts))
    if np is None:
        raise LaunchError("missing -np N: how many ranks to start")
    mpi_args: list[str] = []
    for text in params["mpi_args"]:
        try:
            mpi_args += shlex.split(text)
        except ValueError as exc:
            raise LaunchError(f"--mpi-arg {text!r}: {exc}") from None
    return PlanInputs(
        np=np,
        command=tuple(command),
        hosts=hosts,
        hostfile=params["hostfile"],
        ranks_per_node=ranks_per_node,
        map_by=params["map_by"],
        bind_to=params["bind_to"],
        threads_per_rank=params["threads_per_rank"],
        spin=params["spin"],
        transport=params["transport"],
        virtual_nodes=params["virtual_nodes"],
        mpi_args=tuple(mpi_args),
        oversubscribe=params["oversubscribe"],
        run_as_root=hasattr(os, "geteuid") and os.geteuid() == 0,
        python=sys.executable,
        master_port=master_port,
    )


def _unresolvable_hosts(inputs: PlanInputs) -> str | None:
    """What to say about host names that do not resolve (None: all do)."""
    bad = unresolvable(inputs.hosts)
    if not bad:
        return None
    return (f"host name(s) {', '.join(bad)} do not resolve to an address here; "
            "mpirun could not reach them (fix the name, /etc/hosts or DNS)")


def _warn(ctx: click.Context, warnings: Sequence[str]) -> None:
    prog = ctx.find_root().info_name or PROG
    for w in warnings:
        click.echo(f"{prog}: warning: {w}", err=True)


def _plan_text(mpi: MpiInfo, lay: Layout, argv: Sequence[str], env: dict[str, str]) -> str:
    lines = [f"# {mpi.describe()}", f"# plan: {lay.describe()}"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    lines.append(shlex.join(argv))
    return "\n".join(lines)


# --- commands ---------------------------------------------------------------


@click.group(cls=_LaunchGroup, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Launch harmpi jobs with topology-aware placement."""


_RUN_HELP = """Run COMMAND on every rank through mpirun, placed and bound for CPU inference.

\b
Examples:
  harmpi-launch -np 2 -- python script.py
  harmpi-launch -np 4 --virtual-nodes 2 --dry-run python bench.py
  harmpi-launch -np 8 --hosts a,b --ranks-per-node 4 -- python tp.py
  harmpi-launch --standalone --nproc-per-node 2 tp.py   # torchrun's flags
  harmpi-launch info -np 4          # topology, MPI found and the plan

The MPI (Open MPI, MPICH/Hydra or Intel MPI) is found next to this Python, then
on PATH, and spoken to in its own dialect. OMP_NUM_THREADS, OpenMP binding and
spin settings, HARMPI_* variables (set here or already in the environment) are
forwarded to every rank. Options end at the first non-option word or `--`.
"""


@cli.command("run", cls=_RunCommand, help=_RUN_HELP, no_args_is_help=True,
             context_settings={"allow_interspersed_args": False,
                               "ignore_unknown_options": False})
@_plan_options
@click.option("--dry-run", is_flag=True,
              help="Print the environment and the exact command line; start nothing.")
@click.option("--tag/--no-tag", "tag_output", default=True, show_default=True,
              help="Prefix every output line with the rank that printed it (Open MPI: "
                   "'[1,R]<stdout>: ', MPICH/Intel MPI: '[R] ').")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="[--] COMMAND [ARGS]...")
@click.pass_context
def run_cmd(ctx: click.Context, command: tuple[str, ...], dry_run: bool, tag_output: bool,
            **params: Any) -> None:
    if not command:
        raise click.UsageError(
            "missing command: give the program to run after the options, "
            "e.g. `-np 2 -- python script.py`", ctx)
    try:
        inputs = replace(plan_inputs(params, command, free_port()), tag_output=tag_output)
        topo = detect_topology()
        plan_layout(inputs, topo)  # user mistakes first, even without an MPI
        bad_hosts = _unresolvable_hosts(inputs)
        if bad_hosts and not dry_run:  # refused before mpirun starts
            raise LaunchError(bad_hosts)
        mpi = find_mpi(params["mpirun"])
        argv, env, warnings = build_command(inputs, mpi, topo, os.environ)
    except MpiNotFoundError as exc:
        raise click.ClickException(str(exc)) from None
    except LaunchError as exc:
        raise click.UsageError(str(exc), ctx) from None
    _warn(ctx, warnings + [bad_hosts] if bad_hosts else warnings)
    if dry_run:
        click.echo(_plan_text(mpi, plan_layout(inputs, topo), argv, env))
        return
    sys.stdout.flush()
    sys.stderr.flush()
    finished = run_mpirun(argv, {**os.environ, **env})
    _say_how_it_ended(ctx, finished)
    ctx.exit(finished.exit_status)


def _say_how_it_ended(ctx: click.Context, finished: Finished) -> None:
    """One line on stderr when the job did not simply finish: stopped by a
    signal, or processes mpirun left behind that the launcher ended."""
    prog = ctx.find_root().info_name or PROG
    if finished.ended:
        files = f" and removed {len(finished.removed)} Open MPI shared-memory file(s) " \
                f"({', '.join(finished.removed)})" if finished.removed else ""
        click.echo(f"{prog}: mpirun ended with status {finished.mpirun_status} and left "
                   f"{len(finished.ended)} process(es) of the job running (pids "
                   f"{', '.join(map(str, finished.ended))}); ended them{files}"
                   + (f"; removed its session directory {finished.session_dir}"
                      if finished.session_dir else ""), err=True)
    if finished.stopped_by is not None:
        click.echo(f"{prog}: job stopped by {finished.stopped_by.name} "
                   f"(exit {finished.exit_status})", err=True)


def _topology_text(topo: HostTopology) -> str:
    lines = [
        f"Host {topo.hostname} (read from {topo.source})",
        f"  sockets            {topo.n_sockets}",
        f"  NUMA nodes         {topo.n_numa_nodes}",
    ]
    for node in topo.numa_ids:
        lines.append(
            f"    node{node:<13}{topo.cores_of_numa(node)} cores, "
            f"CPUs {format_cpulist(topo.cpus_of_numa(node))}"
        )
    tpc = topo.threads_per_core
    lines += [
        f"  cores              {topo.n_cores} ({topo.cores_per_numa} per NUMA node)",
        f"  hardware threads   {topo.n_hwthreads} ({tpc} per core, "
        f"hyperthreading {'on' if topo.hyperthreading else 'off'})",
        f"  RDMA devices       {', '.join(topo.rdma_devices) or 'none'}",
    ]
    return "\n".join(lines)


@cli.command("info", context_settings={"ignore_unknown_options": False})
@_plan_options
@click.pass_context
def info_cmd(ctx: click.Context, **params: Any) -> None:
    """Print this host's topology, the MPI found and the plan for -np N."""
    topo = detect_topology()
    click.echo(_topology_text(topo))
    notes: list[str] = []
    try:
        if params["np"] is None and params["nproc_per_node"] is None:
            # one rank per NUMA node (or K per node) of every host
            per_host = params["ranks_per_node"] or topo.n_numa_nodes
            params = {**params, "np": per_host * (len(_hosts(params)) or 1)}
        inputs = plan_inputs(params, ("COMMAND",))
        try:
            lay = plan_layout(inputs, topo)
        except TooManyRanksError as exc:  # show the plan anyway: what --oversubscribe runs
            notes.append(f"{exc} -- the plan below is what --oversubscribe would run")
            inputs = replace(inputs, oversubscribe=True)
            lay = plan_layout(inputs, topo)
        notes += filter(None, [_unresolvable_hosts(inputs)])
        mpi = find_mpi(params["mpirun"])
        argv, env, warnings = build_command(inputs, mpi, topo, os.environ)
    except MpiNotFoundError as exc:
        click.echo("MPI\n  none found")
        raise click.ClickException(str(exc)) from None
    except LaunchError as exc:
        raise click.UsageError(str(exc), ctx) from None
    click.echo(f"MPI\n  {mpi.display_name} {mpi.version} at {mpi.path}")
    why = ""
    if ctx.params["np"] is None and params["nproc_per_node"] is None:
        why = " (default: {} per host)".format(
            "--ranks-per-node" if params["ranks_per_node"] else "one rank per NUMA node")
    click.echo(f"Plan for -np {inputs.np}{why}")
    click.echo(f"  {lay.describe()}")
    for w in notes + warnings:
        click.echo(f"  warning: {w}")
    for k, v in sorted(env.items()):
        click.echo(f"  export {k}={shlex.quote(v)}")
    click.echo(f"  {shlex.join(argv)}")


def main(argv: Sequence[str] | None = None, prog_name: str = PROG) -> None:
    """Console-script entry point (``harmpi-launch``)."""
    cli.main(args=list(sys.argv[1:] if argv is None else argv), prog_name=prog_name)
