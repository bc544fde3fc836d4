"""The matrix of ``make bench-host`` (``bench.host``, whose docstring says
what it holds): the host's cores and CPU, the layouts sized to them, and
each job's command line (pure but for reading /proc and /sys)."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Sequence

from bench.harness import format_nbytes

__all__ = ["FULL_SIZES", "QUICK_SIZES", "FULL", "QUICK", "MIN_JOB_S", "Layout", "Settings",
           "physical_cores", "flags_summary", "host_description", "parse_layout",
           "default_layouts", "job_limit_s", "job_command", "shown_command"]

FULL_SIZES = tuple(2048 << i for i in range(12)) + (10240,)
QUICK_SIZES = (2048, 10240, 65536, 1 << 20)
DECODE_RANKS = (2, 4, 8)
#: the CPU flags a reader of the table cares about (vector width, bf16, AMX)
FLAGS_SHOWN = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16",
               "avx_vnni", "amx_tile", "amx_bf16")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One job of the matrix."""

    name: str  # "1x8", "2x4 tcp", "decode 4"
    kind: str  # "collectives" or "decode"
    nodes: int
    per_node: int
    bind: str  # "core" or "none" (oversubscribed)

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node

    @property
    def btl(self) -> str:
        return "self,tcp" if self.nodes > 1 else ""

    @property
    def slug(self) -> str:  # its log and JSON file names
        return re.sub(r"[^0-9a-z]+", "_", self.name)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "ranks": self.ranks, "btl": self.btl}


@dataclasses.dataclass(frozen=True)
class Settings:
    """How every job runs (from the command line)."""

    sizes: tuple[int, ...]
    collectives: tuple[str, ...]
    gloo: bool = True
    check: bool = False
    budget_mb: float = 256.0  # per cell and rank (bench.host_job --budget-mb)
    max_iters: int = 500
    min_iters: int = 10
    settle_calls: int = 1000  # untimed calls before each collective's first cell
    decode_tokens: int = 32
    decode_rounds: int = 3
    timeout_s: float | None = None  # None: scaled per job (job_limit_s)
    deadline_s: float | None = None  # seconds into the matrix after which no job runs


#: the least time worth starting a job with (start-up alone takes seconds)
MIN_JOB_S = 20.0
#: calls per cell: 500 up to 512 KB all-reduces, down to 10 for a 4 MB all-gather at 16
#: ranks (64 MB per call); sized for the 16-core matrix in under 5 min (an estimate from
#: the 2-core runs and the issue's 16-core job times, not yet measured there)
FULL = dict(budget_mb=256.0, max_iters=500, min_iters=10, decode_tokens=32, decode_rounds=3)
QUICK = dict(budget_mb=64.0, max_iters=200, min_iters=5, decode_tokens=16, decode_rounds=2)


# --------------------------------------------------------------------------
# The host
# --------------------------------------------------------------------------


def physical_cores(cpus: Sequence[int], sysfs: str = "/sys/devices/system/cpu") -> int:
    """Distinct (package, core) pairs among ``cpus``: what ``--bind-to core``
    can give one rank each (hyperthreads count once); len(cpus) if unknown."""
    pairs = set()
    for cpu in cpus:
        base = Path(sysfs) / f"cpu{cpu}" / "topology"
        try:
            pairs.add(((base / "physical_package_id").read_text().strip(),
                       (base / "core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return len(pairs) or len(cpus)


def _cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str, set[str]]:
    model, flags = "unknown CPU", set()
    try:
        for line in Path(path).read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return model, flags


def flags_summary(flags: set[str]) -> str:
    """The CPU flags of FLAGS_SHOWN the host has, and how many avx512 ones."""
    shown = [flag for flag in FLAGS_SHOWN if flag in flags]
    wide = sum(1 for flag in flags if flag.startswith("avx512"))
    return " ".join(shown) + (f" ({wide} avx512 flags)" if wide else "") if shown else "none"


def host_description() -> dict:
    """CPUs this process may use, their physical cores, NUMA nodes, model, flags."""
    cpus = sorted(os.sched_getaffinity(0))
    model, flags = _cpuinfo()
    numa = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1
    return {"cpus": len(cpus), "cores": physical_cores(cpus), "numa_nodes": numa,
            "cpu_model": model, "flags": flags_summary(flags), "load_1min": os.getloadavg()[0]}


# --------------------------------------------------------------------------
# The matrix
# --------------------------------------------------------------------------


def parse_layout(text: str, cores: int) -> Layout:
    """'1x8', '2x4' (virtual nodes, MPI on TCP), 'decode:4' -> a Layout bound
    to cores when ``cores`` suffice (ValueError when malformed)."""
    spec = text.strip().lower()
    if match := re.fullmatch(r"decode:(\d+)", spec):
        ranks = int(match.group(1))
        if ranks < 2:
            raise ValueError(f"decode needs at least 2 ranks, not {text!r}")
        return Layout(f"decode {ranks}", "decode", 1, ranks,
                      "core" if ranks <= cores else "none")
    if match := re.fullmatch(r"(\d+)x(\d+)", spec):
        nodes, per_node = int(match.group(1)), int(match.group(2))
        if nodes < 1 or per_node < 1 or nodes * per_node < 2:
            raise ValueError(f"a layout needs at least 2 ranks, not {text!r}")
        name = f"{nodes}x{per_node}" + (" tcp" if nodes > 1 else "")
        return Layout(name, "collectives", nodes, per_node,
                      "core" if nodes * per_node <= cores else "none")
    raise ValueError(f"not a layout: {text!r} (NODESxRANKS, e.g. 1x8 or 2x4, or decode:N)")


def default_layouts(cores: int, quick: bool = False) -> list[str]:
    """The matrix for a host of ``cores`` cores (pure): see the module docstring.
    ``quick``: 1 x 2, 1 x C, 2 x C/2 and decode at 2 ranks."""
    cores = max(1, cores)
    half, quarter = max(1, cores // 2), max(1, cores // 4)
    if quick:
        one = [2] + ([cores] if cores > 2 else [])
        virtual = [(2, half)]
        decode = [2]
    else:
        one = [n for n in (2, 4, 8, 16) if n <= cores] or [2]
        one += [cores] if cores > one[-1] else []
        virtual = [(2, 1)] + ([(2, 2)] if cores >= 4 else []) + [(2, half), (4, quarter)]
        decode = [n for n in DECODE_RANKS if n <= cores] or [2]
    names = ([f"1x{n}" for n in one] + [f"{g}x{k}" for g, k in virtual]
             + [f"decode:{n}" for n in decode])
    return list(dict.fromkeys(names))


def job_limit_s(layout: Layout, cpus: int, settings: Settings) -> float:
    """A job's time limit: ``--timeout``, else 240 s (several times what a
    16-rank job should take) times the ranks per CPU when oversubscribed."""
    if settings.timeout_s is not None:
        return settings.timeout_s
    return 240.0 * max(1.0, layout.ranks / max(1, cpus))


def _mpirun_words(layout: Layout) -> list[str]:
    """Placement and binding: a core each when there are enough, else shared."""
    if layout.bind == "core":
        words = ["--map-by", "core", "--bind-to", "core"]
    else:
        words = ["--map-by", ":OVERSUBSCRIBE", "--bind-to", "none"]
    if layout.nodes > 1:  # one host: Open MPI would use shared memory between the "nodes"
        words += ["--mca", "btl", layout.btl, "-x", "HARMPI_RANKS_PER_NODE"]
    return words


def job_command(layout: Layout, settings: Settings, json_path: str, *, mpirun: str = "mpirun",
                python: str = sys.executable) -> tuple[dict[str, str], list[str]]:
    """(environment added, argv) of one job (pure; tests check it)."""
    # a waiting rank yields its core only where ranks share cores (Open MPI's
    # own rule); set either way, as make exports yield for its tests
    env = {"OMPI_MCA_mpi_yield_when_idle": "0" if layout.bind == "core" else "1"}
    if layout.kind == "decode":
        comms = "harmpi,mpi" + (",gloo" if settings.gloo else "")
        argv = [python, "-m", "launch", "-np", str(layout.ranks)]
        argv += ["--oversubscribe"] if layout.bind == "none" else []
        argv += ["--", "python", "-m", "bench.decode", "--comm", comms,
                 "--tokens", str(settings.decode_tokens), "--rounds", str(settings.decode_rounds),
                 "--json", json_path]
        return env, argv
    if layout.nodes > 1:
        env["HARMPI_RANKS_PER_NODE"] = str(layout.per_node)
    gloo = settings.gloo and layout.ranks == 2 and layout.nodes == 1
    argv = [mpirun, "-np", str(layout.ranks), *_mpirun_words(layout),
            python, "-m", "mpi4py", "-m", "bench.host_job",
            "--collectives", ",".join(settings.collectives),
            "--sizes", ",".join(format_nbytes(s) for s in settings.sizes),
            "--impl", "harmpi,mpi" + (",gloo" if gloo else ""),
            "--budget-mb", f"{settings.budget_mb:g}", "--max-iters", str(settings.max_iters),
            "--min-iters", str(settings.min_iters), "--settle-calls", str(settings.settle_calls),
            "--json", json_path]
    return env, argv + (["--check"] if settings.check else [])


def shown_command(env: dict[str, str], argv: Sequence[str]) -> str:
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()]
                    + [shlex.quote(a) for a in argv])
