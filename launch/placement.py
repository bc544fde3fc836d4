"""Where ranks go and how they run: hosts, ranks per host, threads, binding, spin.

Pure, like the rest of the plan (nothing read from the machine, nothing
started); independent of the MPI flavour. :func:`plan_layout` is what
``info`` shows and what launch.plan turns into each flavour's argv.

Placement rules (every host is assumed to look like the launching host):

* **Slots.** A host's slots are its given count (``h:4``, ``slots=4``) or, when
  none is given, this host's core count (hardware threads when mapping or
  binding by ``hwthread``). Ranks fill hosts in order (``--map-by node``:
  round-robin). More ranks than slots is an error unless ``--oversubscribe``.
* **Ranks per node.** ``--ranks-per-node K`` puts exactly K consecutive ranks on
  each of the first np/K hosts (np must divide by K). Within a host the ranks are
  spread evenly over the mapping domains when K divides by their number (Open
  MPI ``ppr:K/D:numa``), otherwise they are packed in order (``ppr:K:node``).
* **Threads.** Default threads per rank = cores of one mapping domain (NUMA node
  for ``numa``, socket for ``socket``, the host for ``node``/``slot``, one core
  for ``core``/``hwthread``) divided by the ranks placed in that domain, at least
  1. With core binding each rank is bound to that many cores (Open MPI
  ``:PE=T``, Hydra ``core:T``, Intel ``I_MPI_PIN_DOMAIN=T:compact``) and its
  OpenMP threads are placed on them (``OMP_PROC_BIND=close``,
  ``OMP_PLACES=cores``). With ``numa``/``socket`` binding the ranks of a domain
  share it, so OMP_PROC_BIND is left unset (pinning would stack every rank's
  threads on the domain's first cores).
* **Oversubscription.** When a host gets more ranks than it has cores, binding
  is relaxed to ``none`` (with a warning): bound ranks would share one core.
* **Spin.** ``GOMP_SPINCOUNT=100000000`` and ``KMP_BLOCKTIME=infinite`` keep
  OpenMP workers hot between kernels (+13% decode speed in the published
  study). On by default only when ranks x threads fit the cores of each host;
  forcing ``--spin`` beyond that is allowed but warned about. An explicit
  ``--spin`` also sets ``HARMPI_WAIT=spin`` (harmpi's waits poll instead of
  sleeping) unless the caller set HARMPI_WAIT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import LaunchError, TooManyRanksError
from .hosts import Host
from .topology import HostTopology

__all__ = ["BIND_TO", "Layout", "MAP_BY", "PlanInputs", "SPIN_ENV", "TRANSPORTS", "plan_layout"]

MAP_BY = ("numa", "socket", "core", "hwthread", "node", "slot")
BIND_TO = ("core", "hwthread", "numa", "socket", "none")
TRANSPORTS = ("auto", "tcp", "mpi", "verbs")
SPIN_ENV = {"GOMP_SPINCOUNT": "100000000", "KMP_BLOCKTIME": "infinite"}


@dataclass(frozen=True)
class PlanInputs:
    """What the user asked for (the CLI options, already parsed)."""

    np: int
    command: tuple[str, ...]
    hosts: tuple[Host, ...] = ()  # from --hosts or read from the hostfile
    hostfile: str | None = None  # passed through to mpirun when given
    ranks_per_node: int | None = None
    map_by: str = "numa"
    bind_to: str = "core"
    threads_per_rank: int | None = None  # None: derived from the topology
    spin: bool | None = None  # None: on when every rank has dedicated cores
    transport: str | None = None  # HARMPI_TRANSPORT
    virtual_nodes: int | None = None  # HARMPI_RANKS_PER_NODE
    mpi_args: tuple[str, ...] = ()
    oversubscribe: bool = False
    run_as_root: bool = False
    python: str = "python"  # the interpreter `python` and bare scripts run with
    master_port: int | None = None  # MASTER_PORT (None: only the caller's, if any)
    tag_output: bool = False  # prefix every output line with its rank (the CLI's default)


@dataclass(frozen=True)
class Layout:
    """Where ranks go and how they run; independent of the MPI flavour."""

    np: int
    hosts: tuple[Host, ...]  # every host with its slot count filled in
    explicit_hosts: bool  # False: a single-host run on this machine
    ranks_on_host: tuple[int, ...]
    ranks_per_host: int  # the busiest host
    cpu_unit: str  # "core" or "hwthread": what slots and binding count
    cpus_per_host: int
    domains_per_host: int
    cpus_per_domain: int
    ranks_per_domain: int
    threads_per_rank: int
    cpus_per_rank: int  # cores each rank is bound to (1 without core binding)
    bind_to: str  # effective binding (may be relaxed to "none")
    oversubscribed: bool  # more ranks than slots on some host
    spin: bool
    ppr: tuple[int, str] | None  # (ranks, object) for --ranks-per-node
    warnings: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        """One line: the job, then what each host and each rank gets."""
        n_hosts = sum(1 for r in self.ranks_on_host if r)
        where = "this host" if not self.explicit_hosts else _n(n_hosts, "host")
        used = [r for r in self.ranks_on_host if r]
        ranks = (_n(self.ranks_per_host, "rank") if len(set(used)) == 1
                 else "+".join(map(str, used)) + " ranks")
        if self.bind_to in ("core", "hwthread"):
            bound = f"bound to {_n(self.cpus_per_rank, self.cpu_unit)}"
        elif self.bind_to == "none":
            bound = "not bound"
        else:
            bound = f"bound to its {self.bind_to} (shared)"
        return (f"{_n(self.np, 'rank')} on {where}; per host: {ranks}, "
                f"{_n(self.cpus_per_host, self.cpu_unit)}; per rank: "
                f"{_n(self.threads_per_rank, 'thread')}, {bound}; "
                f"OpenMP spin {'on' if self.spin else 'off'}")


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _check_choice(value: str, choices: tuple[str, ...], option: str) -> None:
    if value not in choices:
        raise LaunchError(f"{option} {value!r} is not one of {', '.join(choices)}")


def _check_positive(value: int | None, option: str) -> None:
    if value is not None and value < 1:
        raise LaunchError(f"{option} must be at least 1, got {value}")


def _distribute(np: int, slots: list[int], round_robin: bool) -> list[int]:
    """Ranks per host: fill in order (or round-robin) within slots, then overflow round-robin."""
    counts = [0] * len(slots)
    placed = 0
    if round_robin:
        i = 0
        while placed < np and any(c < s for c, s in zip(counts, slots)):
            if counts[i] < slots[i]:
                counts[i] += 1
                placed += 1
            i = (i + 1) % len(slots)
    else:
        for i, s in enumerate(slots):
            take = min(s, np - placed)
            counts[i] = take
            placed += take
    i = 0
    while placed < np:
        counts[i] += 1
        placed += 1
        i = (i + 1) % len(slots)
    return counts


def _domains(map_by: str, topo: HostTopology, unit: str, cpus_per_host: int) -> tuple[int, int]:
    """(domains per host, cpus per domain) of a mapping policy."""
    per_core = topo.threads_per_core if unit == "hwthread" else 1
    if map_by == "numa":
        return topo.n_numa_nodes, topo.cores_per_numa * per_core
    if map_by == "socket":
        return topo.n_sockets, topo.cores_per_socket * per_core
    if map_by == "core":
        return topo.n_cores, per_core
    if map_by == "hwthread":
        return topo.n_hwthreads, 1
    return 1, cpus_per_host  # node, slot


def _check_inputs(inputs: PlanInputs) -> None:
    if inputs.np < 1:
        raise LaunchError(f"-np must be at least 1, got {inputs.np}")
    _check_choice(inputs.map_by, MAP_BY, "--map-by")
    _check_choice(inputs.bind_to, BIND_TO, "--bind-to")
    if inputs.transport is not None:
        _check_choice(inputs.transport, TRANSPORTS, "--transport")
    _check_positive(inputs.ranks_per_node, "--ranks-per-node")
    _check_positive(inputs.threads_per_rank, "--threads-per-rank")
    _check_positive(inputs.virtual_nodes, "--virtual-nodes")


def _counts_per_node(inputs: PlanInputs, hosts: tuple[Host, ...], explicit: bool) -> list[int]:
    """Ranks on each host with --ranks-per-node k: k on each of the first np / k hosts."""
    np, k = inputs.np, inputs.ranks_per_node
    if inputs.map_by == "node":
        raise LaunchError(
            "--ranks-per-node places consecutive ranks on each host, "
            "--map-by node places them round-robin; choose one"
        )
    if np % k:
        raise LaunchError(
            f"-np {np} is not divisible by --ranks-per-node {k}: "
            f"every node must get exactly {k} ranks"
        )
    if np // k > len(hosts):
        where = (
            f"only {len(hosts)} host(s) given" if explicit
            else "only this host is used (add --hosts or --hostfile; "
            "--virtual-nodes splits one host into virtual nodes)"
        )
        raise LaunchError(
            f"-np {np} with --ranks-per-node {k} needs {np // k} hosts, but {where}"
        )
    return [k] * (np // k) + [0] * (len(hosts) - np // k)


def _check_slots(inputs: PlanInputs, over: list, explicit: bool, cpus_per_host: int,
                 unit: str, total_slots: int) -> None:
    """LaunchError for hosts given more ranks than slots, unless --oversubscribe."""
    if not over or inputs.oversubscribe:
        return
    if explicit:
        detail = ", ".join(f"{h.name} gets {c} ranks for {h.slots} slots" for h, c in over)
    else:
        detail = f"this host has {cpus_per_host} {unit}s"
    raise TooManyRanksError(
        f"more ranks than slots: {inputs.np} ranks for {total_slots} slots ({detail}); "
        "pass --oversubscribe to run anyway (binding is then relaxed to none) "
        "or use fewer ranks"
    )


def _threads_per_rank(inputs: PlanInputs, procs_exceed: bool, cpus_per_domain: int,
                      ranks_per_domain: int) -> int:
    if inputs.threads_per_rank is not None:
        return inputs.threads_per_rank
    if procs_exceed:
        return 1
    return max(1, cpus_per_domain // ranks_per_domain)


def _cpus_per_rank(inputs: PlanInputs, bind: str, threads: int, rph: int, cpus_per_host: int,
                   cpus_per_domain: int, ranks_per_domain: int, unit: str,
                   warnings: list[str]) -> int:
    """CPUs each rank is bound to: its threads, as far as its share of the domain allows."""
    if bind not in ("core", "hwthread") or threads <= 1:
        return 1
    if inputs.map_by in ("core", "hwthread"):
        avail = cpus_per_host // rph  # mapped like "slot" (see _openmpi)
    else:
        avail = cpus_per_domain // ranks_per_domain
    cpus_per_rank = min(threads, max(1, avail))
    if cpus_per_rank < threads:
        warnings.append(
            f"{threads} threads per rank but only {cpus_per_rank} {unit}(s) per rank "
            f"free in each {inputs.map_by} domain: each rank is bound to "
            f"{cpus_per_rank} {unit}(s) and its threads share them"
        )
    return cpus_per_rank


def _spin(inputs: PlanInputs, fits: bool, rph: int, threads: int, cpus_per_host: int,
          unit: str, warnings: list[str]) -> bool:
    """Let OpenMP workers spin: by default when ranks x threads fit the CPUs."""
    if inputs.spin is None:
        return fits
    if inputs.spin and not fits:
        warnings.append(
            f"--spin with {rph} ranks x {threads} threads on {cpus_per_host} {unit}s "
            "per host oversubscribes them: spinning OpenMP workers steal time from "
            "the threads doing the work (use --no-spin)"
        )
    return inputs.spin


def _ppr(inputs: PlanInputs, domains: int) -> tuple[int, str] | None:
    """Open MPI's ppr:N:domain for --ranks-per-node k (None without it)."""
    k = inputs.ranks_per_node
    if k is None:
        return None
    if inputs.map_by in ("numa", "socket") and domains > 1 and k % domains == 0:
        return (k // domains, inputs.map_by)
    return (k, "node")


def plan_layout(inputs: PlanInputs, topo: HostTopology) -> Layout:
    """Decide ranks per host, threads, binding and spin; LaunchError on bad input."""
    _check_inputs(inputs)
    warnings: list[str] = []

    unit = "hwthread" if "hwthread" in (inputs.map_by, inputs.bind_to) else "core"
    cpus_per_host = topo.n_hwthreads if unit == "hwthread" else topo.n_cores
    explicit = bool(inputs.hosts)
    hosts = tuple(
        Host(h.name, h.slots if h.slots is not None else cpus_per_host)
        for h in (inputs.hosts or (Host(topo.hostname, None),))
    )
    slots = [h.slots for h in hosts]
    if inputs.ranks_per_node is not None:
        counts = _counts_per_node(inputs, hosts, explicit)
    else:
        counts = _distribute(inputs.np, slots, round_robin=inputs.map_by == "node")
    over = [(h, c) for h, c in zip(hosts, counts) if c > h.slots]
    _check_slots(inputs, over, explicit, cpus_per_host, unit, sum(slots))

    rph = max(counts)
    domains, cpus_per_domain = _domains(inputs.map_by, topo, unit, cpus_per_host)
    ranks_per_domain = math.ceil(rph / domains)
    procs_exceed = rph > cpus_per_host

    bind = inputs.bind_to
    if procs_exceed and bind != "none":
        warnings.append(
            f"{rph} ranks on {cpus_per_host} {unit}s per host: binding relaxed from "
            f"{bind} to none (bound ranks would share {unit}s; expect slower collectives)"
        )
        bind = "none"

    threads = _threads_per_rank(inputs, procs_exceed, cpus_per_domain, ranks_per_domain)
    cpus_per_rank = _cpus_per_rank(inputs, bind, threads, rph, cpus_per_host, cpus_per_domain,
                                   ranks_per_domain, unit, warnings)
    fits = not over and rph * threads <= cpus_per_host
    spin = _spin(inputs, fits, rph, threads, cpus_per_host, unit, warnings)

    if inputs.virtual_nodes is not None and inputs.virtual_nodes > rph:
        warnings.append(
            f"--virtual-nodes {inputs.virtual_nodes} is more than the {rph} ranks per "
            "host: every host stays one node"
        )

    return Layout(
        np=inputs.np,
        hosts=hosts,
        explicit_hosts=explicit,
        ranks_on_host=tuple(counts),
        ranks_per_host=rph,
        cpu_unit=unit,
        cpus_per_host=cpus_per_host,
        domains_per_host=domains,
        cpus_per_domain=cpus_per_domain,
        ranks_per_domain=ranks_per_domain,
        threads_per_rank=threads,
        cpus_per_rank=cpus_per_rank,
        bind_to=bind,
        oversubscribed=bool(over),
        spin=spin,
        ppr=_ppr(inputs, domains),
        warnings=tuple(warnings),
    )
