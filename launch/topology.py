"""What this host looks like: sockets, NUMA nodes, cores and hardware threads.

Read from sysfs (``/sys/devices/system/cpu/cpu*/topology`` and
``/sys/devices/system/node/node*/cpulist``), with ``lscpu -p`` and finally
``os.cpu_count()`` as fallbacks. Only CPUs that are online *and* in this
process's affinity mask count, so a container limited to a cpuset plans for the
cores it can really use.

The parsing is split from the reading: :func:`parse_cpulist`,
:func:`parse_lscpu` and :func:`build_topology` take text and records, and
:func:`read_sysfs_topology` takes the sysfs root, so tests feed them fake trees.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable, Iterable

__all__ = [
    "Cpu",
    "HostTopology",
    "build_topology",
    "detect_topology",
    "parse_cpulist",
    "parse_lscpu",
    "read_sysfs_topology",
]


@dataclass(frozen=True)
class Cpu:
    """One logical CPU (hardware thread) and where it sits."""

    cpu: int  # logical CPU number, as the kernel names it
    core: int  # physical core index, unique on the host (0..n_cores-1)
    socket: int  # physical package id
    numa: int  # NUMA node id


@dataclass(frozen=True)
class HostTopology:
    """The usable CPUs of one host; every count below is derived from ``cpus``."""

    hostname: str
    cpus: tuple[Cpu, ...]
    source: str  # "sysfs", "lscpu" or "os.cpu_count"
    rdma_devices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.cpus:
            raise ValueError("a host topology needs at least one CPU")

    @property
    def n_hwthreads(self) -> int:
        return len(self.cpus)

    @property
    def n_cores(self) -> int:
        return len({c.core for c in self.cpus})

    @property
    def socket_ids(self) -> tuple[int, ...]:
        return tuple(sorted({c.socket for c in self.cpus}))

    @property
    def numa_ids(self) -> tuple[int, ...]:
        return tuple(sorted({c.numa for c in self.cpus}))

    @property
    def n_sockets(self) -> int:
        return len(self.socket_ids)

    @property
    def n_numa_nodes(self) -> int:
        return len(self.numa_ids)

    @property
    def threads_per_core(self) -> int:
        per_core: dict[int, int] = {}
        for c in self.cpus:
            per_core[c.core] = per_core.get(c.core, 0) + 1
        return max(per_core.values())

    @property
    def hyperthreading(self) -> bool:
        return self.threads_per_core > 1

    def cpus_of_numa(self, node: int) -> tuple[int, ...]:
        return tuple(sorted(c.cpu for c in self.cpus if c.numa == node))

    def cores_of_numa(self, node: int) -> int:
        return len({c.core for c in self.cpus if c.numa == node})

    def cores_of_socket(self, sock: int) -> int:
        return len({c.core for c in self.cpus if c.socket == sock})

    @property
    def cores_per_numa(self) -> int:
        """Cores of the smallest NUMA node (what a rank placed anywhere can count on)."""
        return min(self.cores_of_numa(n) for n in self.numa_ids)

    @property
    def cores_per_socket(self) -> int:
        return min(self.cores_of_socket(s) for s in self.socket_ids)

    def summary(self) -> str:
        return (
            f"{self.n_sockets} socket(s), {self.n_numa_nodes} NUMA node(s), "
            f"{self.n_cores} cores, {self.n_hwthreads} hardware threads"
        )


def parse_cpulist(text: str) -> tuple[int, ...]:
    """Parse a kernel cpulist such as ``"0-3,8-11"`` or ``"0-7:2"``; empty text -> ()."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        stride = 1
        if ":" in part:
            part, stride_text = part.split(":", 1)
            stride = int(stride_text)
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.extend(range(int(lo), int(hi) + 1, stride))
        else:
            cpus.append(int(part))
    return tuple(sorted(set(cpus)))


def build_topology(
    records: Iterable[tuple[int, int, Hashable, int]],
    *,
    hostname: str,
    source: str,
    allowed_cpus: Iterable[int] | None = None,
    rdma_devices: Iterable[str] = (),
) -> HostTopology:
    """Make a :class:`HostTopology` from ``(cpu, socket, core_key, numa)`` records.

    ``core_key`` is anything that is equal for the hardware threads of one core
    (the thread-siblings set, or ``(socket, core_id)``); cores are renumbered
    0..n-1. CPUs outside ``allowed_cpus`` are dropped, unless that would drop
    every CPU (an affinity mask naming CPUs the records do not know).
    """
    rows = sorted(records, key=lambda r: r[0])
    if allowed_cpus is not None:
        allowed = set(allowed_cpus)
        kept = [r for r in rows if r[0] in allowed]
        rows = kept or rows
    if not rows:
        raise ValueError("no CPUs found")
    core_index: dict[Hashable, int] = {}
    cpus = []
    for cpu, sock, core_key, numa in rows:
        core = core_index.setdefault((sock, core_key), len(core_index))
        cpus.append(Cpu(cpu=cpu, core=core, socket=sock, numa=numa))
    return HostTopology(
        hostname=hostname,
        cpus=tuple(cpus),
        source=source,
        rdma_devices=tuple(sorted(rdma_devices)),
    )


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def read_sysfs_topology(
    root: str | os.PathLike = "/sys",
    *,
    hostname: str = "localhost",
    allowed_cpus: Iterable[int] | None = None,
) -> HostTopology | None:
    """Read the topology under a sysfs root; None when it has no CPU topology.

    Uses ``devices/system/cpu/online`` (else every ``cpuN`` directory),
    ``cpuN/topology/{physical_package_id,thread_siblings_list,core_id}``, and
    ``devices/system/node/nodeN/cpulist`` (no node directory: one node 0).
    NUMA nodes without CPUs (memory-only, CXL) are ignored.
    """
    root = Path(root)
    cpu_dir = root / "devices" / "system" / "cpu"
    online = _read(cpu_dir / "online")
    if online is not None and online.strip():
        cpu_ids = parse_cpulist(online)
    else:
        cpu_ids = tuple(
            sorted(
                int(p.name[3:])
                for p in cpu_dir.glob("cpu[0-9]*")
                if p.name[3:].isdigit() and (p / "topology").is_dir()
            )
        )
    numa_of: dict[int, int] = {}
    node_dir = root / "devices" / "system" / "node"
    for p in sorted(node_dir.glob("node[0-9]*")):
        if not p.name[4:].isdigit():
            continue
        text = _read(p / "cpulist")
        for cpu in parse_cpulist(text or ""):
            numa_of[cpu] = int(p.name[4:])

    records = []
    for cpu in cpu_ids:
        topo = cpu_dir / f"cpu{cpu}" / "topology"
        package = _read(topo / "physical_package_id")
        if package is None:
            continue
        siblings = _read(topo / "thread_siblings_list") or _read(topo / "core_cpus_list")
        if siblings is not None and siblings.strip():
            core_key: Hashable = parse_cpulist(siblings)
        else:
            core_key = ("core_id", (_read(topo / "core_id") or str(cpu)).strip())
        records.append((cpu, int(package.strip()), core_key, numa_of.get(cpu, 0)))
    if not records:
        return None
    rdma_dir = root / "class" / "infiniband"
    rdma = [p.name for p in rdma_dir.iterdir()] if rdma_dir.is_dir() else []
    return build_topology(
        records,
        hostname=hostname,
        source="sysfs",
        allowed_cpus=allowed_cpus,
        rdma_devices=rdma,
    )


def parse_lscpu(text: str) -> list[tuple[int, int, Hashable, int]]:
    """Parse ``lscpu -p=CPU,CORE,SOCKET,NODE`` into build_topology records.

    Comment lines start with ``#``; an empty NODE field (no NUMA support) is node 0.
    """
    records = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split(",")
        if len(fields) < 3:
            raise ValueError(f"unexpected lscpu line: {line!r}")
        cpu, core, sock = int(fields[0]), fields[1], fields[2]
        node = fields[3] if len(fields) > 3 else ""
        records.append((cpu, int(sock or 0), int(core or cpu), int(node or 0)))
    return records


def _allowed_cpus() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def detect_topology(sysfs_root: str | os.PathLike = "/sys") -> HostTopology:
    """This host's topology: sysfs, else ``lscpu``, else ``os.cpu_count()`` flat."""
    hostname = socket.gethostname()
    allowed = _allowed_cpus()
    topo = read_sysfs_topology(sysfs_root, hostname=hostname, allowed_cpus=allowed)
    if topo is not None:
        return topo
    lscpu = shutil.which("lscpu")
    if lscpu:
        try:
            out = subprocess.run(
                [lscpu, "-p=CPU,CORE,SOCKET,NODE"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout
            records = parse_lscpu(out)
            if records:
                return build_topology(
                    records, hostname=hostname, source="lscpu", allowed_cpus=allowed
                )
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    n = len(allowed) if allowed else (os.cpu_count() or 1)
    return build_topology(
        [(i, 0, i, 0) for i in range(n)], hostname=hostname, source="os.cpu_count"
    )
