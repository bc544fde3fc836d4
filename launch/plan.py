"""The launch plan: options + MPI flavour + topology -> argv and environment.

Everything here is pure: nothing is read from the machine and nothing is
started, so tests check the exact argv for every MPI flavour.
:func:`build_command` is the entry point; :func:`plan_layout` is the part that
does not depend on the MPI (ranks per host, threads, binding, spin) and is what
``info`` shows.

Where ranks go (hosts, threads, binding, spin): launch.placement.

What the plan adds:

* **torchrun's variables.** Every rank gets MASTER_ADDR (127.0.0.1 on one
  host, else the first host, where rank 0 runs) and MASTER_PORT (a free port
  the CLI picked) unless the caller set them, and the command runs under
  ``rankenv.py``, which sets RANK, WORLD_SIZE, LOCAL_RANK and
  LOCAL_WORLD_SIZE from the MPI's own variables, so an unmodified
  ``init_process_group("gloo")`` script runs. ``python`` (also ``python3``)
  as the command means the launcher's interpreter, and a bare ``script.py``
  is run with it, as torchrun does.
* **Fail-fast.** The launcher's interpreter runs its program under
  ``python -m harmpi.run`` (harmpi.failfast): a rank that raises or exits
  non-zero ends the whole job at once instead of leaving its peers waiting.
* **Virtual nodes.** ``--virtual-nodes K`` sets ``HARMPI_RANKS_PER_NODE=K``:
  harmpi then treats each K consecutive ranks of a host as one node (uneven
  splits such as 3 ranks as 2+1 are legal), to test multi-node code on one host.
"""

from __future__ import annotations

import os
import re
from typing import Mapping

from .errors import LaunchError
from .mpi import MpiInfo
from .placement import SPIN_ENV, Layout, PlanInputs, plan_layout
from .topology import HostTopology

__all__ = [
    "FORWARD_PREFIXES",
    "RANKENV",
    "RUNNER",
    "build_command",
    "openmpi_defaults",
    "rank_command",
    "with_runner",
]

# Variables forwarded to every rank with the flavour's syntax when the launcher
# sets them; HARMPI_* is forwarded from the caller's environment as well.
FORWARD_PREFIXES = ("HARMPI_", "OMP_", "GOMP_", "KMP_", "I_MPI_", "MASTER_")
#: the per-rank shim every command runs under (a file: it must not import this package)
RANKENV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rankenv.py")
#: what the launcher's interpreter runs every program under: harmpi's runner
#: (harmpi/cli/run.py; an uncaught exception or a non-zero exit ends the job)
RUNNER = ("-m", "harmpi.run")
_PYTHON = re.compile(r"^python(3(\.\d+)?)?$")



# --- per-flavour dialects ---------------------------------------------------


def _openmpi_map_by(inputs: PlanInputs, lay: Layout, modern: bool) -> str:
    """The --map-by spec: ppr, slot or the policy, then PE= and OVERSUBSCRIBE."""
    token = {"socket": "package" if modern else "socket"}
    if lay.ppr is not None:
        spec = f"ppr:{lay.ppr[0]}:{token.get(lay.ppr[1], lay.ppr[1])}"
    elif inputs.map_by in ("core", "hwthread") and lay.cpus_per_rank > 1:
        spec = "slot"  # a core cannot hold PE>1 cores; slots can
    else:
        spec = token.get(inputs.map_by, inputs.map_by)
    if lay.cpus_per_rank > 1:
        spec += f":PE={lay.cpus_per_rank}"
    if inputs.oversubscribe and modern:
        spec += ":OVERSUBSCRIBE"
    return spec


def openmpi_defaults(*, run_as_root: bool, rdma: bool,
                     yield_when_idle: bool = False) -> dict[str, str]:
    """The Open MPI settings harmpi's jobs start with (pure); mpirun reads them
    from its environment and its ranks inherit them.

    The one place that states them: :func:`build_command` adds them for the
    launcher, :func:`launch.mpienv.mpi_env` for jobs started by hand (the
    tests, bench/demo, the Makefile). ``yield_when_idle`` (a rank waiting in
    MPI gives up its core) is for jobs with more ranks than cores, as the
    tests run them; the launcher leaves it to Open MPI.
    """
    defaults = {}
    if run_as_root:  # mpirun refuses to start as root without both
        defaults["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
        defaults["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    defaults["OMPI_MCA_osc"] = "^ucx"  # the wheel's UCX osc warns without UCX devices
    if not rdma:
        defaults["OMPI_MCA_pml"] = "ob1"  # no RDMA hardware: UCX pml only warns
    if yield_when_idle:
        defaults["OMPI_MCA_mpi_yield_when_idle"] = "1"
    return defaults


def _openmpi_defaults(inputs: PlanInputs, topo: HostTopology, base_env: Mapping[str, str],
                      env: dict[str, str]) -> None:
    """MCA and root settings mpirun itself reads (ranks inherit them); never the user's."""
    defaults = openmpi_defaults(run_as_root=inputs.run_as_root, rdma=bool(topo.rdma_devices))
    for name, value in defaults.items():
        if name not in base_env:
            env[name] = value


def _openmpi(inputs: PlanInputs, lay: Layout, mpi: MpiInfo, topo: HostTopology,
             base_env: Mapping[str, str], env: dict[str, str],
             forward: list[str]) -> list[str]:
    modern = mpi.major >= 5 or mpi.major == 0
    bind_token = "package" if modern and lay.bind_to == "socket" else lay.bind_to
    argv = [mpi.path, "-np", str(inputs.np), "--map-by", _openmpi_map_by(inputs, lay, modern),
            "--bind-to", bind_token]
    if lay.cpu_unit == "hwthread":
        argv.append("--use-hwthread-cpus")
    if inputs.oversubscribe and not modern:
        argv.append("--oversubscribe")
    if inputs.tag_output:  # "[1,R]<stdout>: " before every line of rank R
        argv += ["--output", "tag"] if modern else ["--tag-output"]
    if inputs.hostfile:
        argv += ["--hostfile", inputs.hostfile]
    elif lay.explicit_hosts:
        argv += ["--host", ",".join(f"{h.name}:{h.slots}" for h in lay.hosts)]
    for name in forward:
        argv += ["-x", name]
    _openmpi_defaults(inputs, topo, base_env, env)
    return argv


def _mpich(inputs: PlanInputs, lay: Layout, mpi: MpiInfo, topo: HostTopology,
           base_env: Mapping[str, str], env: dict[str, str],
           forward: list[str]) -> list[str]:
    bind = lay.bind_to
    if bind in ("core", "hwthread") and lay.cpus_per_rank > 1:
        bind += f":{lay.cpus_per_rank}"
    argv = [mpi.path, "-n", str(inputs.np), "-bind-to", bind]
    if inputs.tag_output:  # "[R] " before every line of rank R
        argv.append("-prepend-rank")
    if inputs.map_by in ("numa", "socket") or (
        inputs.map_by in ("core", "hwthread") and lay.cpus_per_rank == 1
    ):
        argv += ["-map-by", inputs.map_by]
    if inputs.ranks_per_node is not None:
        argv += ["-ppn", str(inputs.ranks_per_node)]
    elif inputs.map_by == "node":
        argv += ["-ppn", "1"]  # Hydra wraps round-robin over the hosts
    if inputs.hostfile:
        argv += ["-f", inputs.hostfile]
    elif lay.explicit_hosts:
        argv += ["-hosts", ",".join(f"{h.name}:{h.slots}" for h in lay.hosts)]
    for name in forward:
        argv += ["-genv", name, env.get(name, base_env.get(name, ""))]
    return argv


def _intel_pinning(inputs: PlanInputs, lay: Layout) -> dict[str, str]:
    if lay.bind_to == "none":
        return {"I_MPI_PIN": "0"}
    pin = {"I_MPI_PIN": "1"}
    if lay.bind_to in ("numa", "socket"):
        pin["I_MPI_PIN_DOMAIN"] = lay.bind_to
    else:
        pin["I_MPI_PIN_CELL"] = "core" if lay.bind_to == "core" else "unit"
        if lay.bind_to == "core" and lay.cpus_per_rank == 1:
            pin["I_MPI_PIN_DOMAIN"] = "core"
        else:
            pin["I_MPI_PIN_DOMAIN"] = f"{lay.cpus_per_rank}:compact"
    pin["I_MPI_PIN_ORDER"] = "scatter" if inputs.map_by in ("numa", "socket") else "compact"
    return pin


def _intel(inputs: PlanInputs, lay: Layout, mpi: MpiInfo, topo: HostTopology,
           base_env: Mapping[str, str], env: dict[str, str],
           forward: list[str]) -> list[str]:
    argv = [mpi.path, "-n", str(inputs.np)]
    if inputs.tag_output:  # "[R] " before every line of rank R
        argv.append("-prepend-rank")
    if inputs.ranks_per_node is not None:
        argv += ["-ppn", str(inputs.ranks_per_node)]
    elif lay.explicit_hosts and not inputs.hostfile and any(h.slots for h in inputs.hosts):
        counts = {h.slots for h in lay.hosts}
        if len(counts) > 1:
            raise LaunchError(
                "Intel MPI's -hosts cannot give hosts different slot counts; "
                "use --hostfile with host:N lines or --ranks-per-node"
            )
        argv += ["-ppn", str(counts.pop())]
    if inputs.map_by == "node":
        argv.append("-rr")
    if inputs.hostfile:
        with_counts = any(h.slots is not None for h in inputs.hosts)
        argv += ["-machinefile" if with_counts else "-f", inputs.hostfile]
    elif lay.explicit_hosts:
        argv += ["-hosts", ",".join(h.name for h in lay.hosts)]
    for name in forward:
        argv += ["-genv", name, env.get(name, base_env.get(name, ""))]
    return argv


_DIALECTS = {"openmpi": _openmpi, "mpich": _mpich, "intel": _intel}


def rank_command(command: tuple[str, ...], python: str) -> list[str]:
    """What each rank runs: COMMAND under the rankenv shim, `python` resolved.

    ``python`` (or ``python3``, ``python3.N``) becomes ``python``, the
    launcher's interpreter; a bare ``script.py`` is run with it, as torchrun
    does; anything else runs as given. The launcher's interpreter runs its
    program (a script, ``-m module`` or ``-c code``) under harmpi's runner
    (:data:`RUNNER`), so that a rank that fails ends the job.
    """
    head, *rest = command
    if _PYTHON.match(head) or head == python:
        command = (python, *with_runner(tuple(rest)))
    elif head.endswith(".py"):
        command = (python, *RUNNER, *command)
    return [python, "-I", "-S", RANKENV, "--", *command]


#: interpreter options that take the next argument as their value
_VALUED_OPTIONS = ("-W", "-X", "--check-hash-based-pycs")
_CLUSTER_ENDING_CM = re.compile(r"^-[A-VYZa-z]+[cm]$")  # -um, -Bc: not -Xname=...c


def with_runner(args: tuple[str, ...]) -> tuple[str, ...]:
    """An interpreter's arguments with :data:`RUNNER` put before its program
    (``python -u s.py`` -> ``python -u -m harmpi.run s.py``); unchanged when
    there is no program to run (an interactive or stdin interpreter, a
    ``-um``-style cluster of options, which is left as written)."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-c", "-m") or not arg.startswith("-"):
            return (*args[:i], *RUNNER, *args[i:])
        if arg in ("-", "--") or _CLUSTER_ENDING_CM.match(arg):
            return args
        i += 2 if arg in _VALUED_OPTIONS else 1
    return args


def _master_env(lay: Layout, port: int | None, base_env: Mapping[str, str]) -> dict[str, str]:
    """MASTER_ADDR/MASTER_PORT for torch's env:// rendezvous, never over the caller's."""
    first = next(h.name for h, r in zip(lay.hosts, lay.ranks_on_host) if r)  # rank 0's host
    decided = {"MASTER_ADDR": first if lay.explicit_hosts else "127.0.0.1"}
    if port is not None:
        decided["MASTER_PORT"] = str(port)
    return {k: v for k, v in decided.items() if k not in base_env}


def build_command(
    plan_inputs: PlanInputs,
    mpi_info: MpiInfo,
    host_topology: HostTopology,
    base_env: Mapping[str, str],
) -> tuple[list[str], dict[str, str], list[str]]:
    """Build the launcher command line.

    Returns ``(argv, env_updates, warnings)``: run ``argv`` with ``base_env``
    updated by ``env_updates``. Raises LaunchError for input that cannot work.
    Pure: reads nothing but its arguments, starts nothing.
    """
    inputs = plan_inputs
    if not inputs.command:
        raise LaunchError(
            "missing command: give the program to run after the options, "
            "e.g. `-np 2 -- python script.py`"
        )
    lay = plan_layout(inputs, host_topology)
    warnings = list(lay.warnings)

    # Environment the launcher decides; explicit options beat the caller's env.
    decided: dict[str, str] = {"OMP_NUM_THREADS": str(lay.threads_per_rank)}
    if lay.bind_to in ("core", "hwthread"):
        decided["OMP_PROC_BIND"] = "close"
        decided["OMP_PLACES"] = "threads" if lay.bind_to == "hwthread" else "cores"
    if lay.spin:
        decided.update(SPIN_ENV)
    if mpi_info.flavour == "intel":
        decided.update(_intel_pinning(inputs, lay))
    for name, value in decided.items():
        old = base_env.get(name)
        if old is not None and old != value:
            warnings.append(f"{name}={old} from the environment is replaced by {name}={value}")
    env = dict(decided)
    if inputs.transport is not None:
        env["HARMPI_TRANSPORT"] = inputs.transport
    if inputs.spin and "HARMPI_WAIT" not in base_env:
        # an explicit --spin says the cores are the ranks' own: harmpi's waits
        # spin too (the default, auto, sleeps once spinning stops paying)
        env["HARMPI_WAIT"] = "spin"
    if inputs.virtual_nodes is not None:
        env["HARMPI_RANKS_PER_NODE"] = str(inputs.virtual_nodes)
    env.update(_master_env(lay, inputs.master_port, base_env))

    forward = sorted(
        {n for n in env if n.startswith(FORWARD_PREFIXES)}
        | {n for n in base_env if n.startswith(("HARMPI_", "MASTER_"))}
    )
    argv = _DIALECTS[mpi_info.flavour](
        inputs, lay, mpi_info, host_topology, base_env, env, forward
    )
    argv += list(inputs.mpi_args)
    argv += rank_command(inputs.command, inputs.python)
    return argv, env, warnings
