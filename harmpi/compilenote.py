"""One line when numba compiles harmpi's kernels: the first run after install.

numba compiles each kernel on first use and keeps the machine code in its
cache (``cache=True``), so the first ``import harmpi`` after an install (or
after a source change) spends minutes compiling and later ones load in
about a second. pip cannot run code after installing a wheel and numba's
cache is tied to the installed files' timestamps and to the CPU, so the
compile cannot move to install time (``make setup`` does run it once). To
not sit silent instead, :func:`install` listens for numba's
``numba:compile`` event, which numba raises for a real compile and not for
a cache load; the first one for a harmpi kernel logs one warning (logger
"harmpi": shown on stderr even without any logging set up) on local rank 0:

    compiling harmpi kernels (numba cache is cold), first run only, ~80 s
"""

from __future__ import annotations

import logging
import math
import os
from typing import Mapping

from numba.core import event

__all__ = ["COLD_COMPILE_S", "install", "local_rank_and_size", "message"]

log = logging.getLogger("harmpi")

#: CPU seconds one process took to compile every kernel from a cold cache
#: (2-core Xeon VM, numba 0.68; two runs: 72 s and 81 s; wall time grows
#: with the load: 138 s and 485 s on this shared machine)
COLD_COMPILE_S = 80
_LOCAL = (("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
          ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
          ("LOCAL_RANK", "LOCAL_WORLD_SIZE"))


def local_rank_and_size(environ: Mapping[str, str]) -> tuple[int, int]:
    """(local rank, ranks on this host) from the launcher's variables; (0, 1) alone."""
    for rank, size in _LOCAL:
        if environ.get(rank, "").isdigit() and environ.get(size, "").isdigit():
            return int(environ[rank]), int(environ[size])
    return 0, 1


def message(local_size: int, n_cpus: int) -> str:
    """The line, with the time scaled by ranks per CPU (every rank compiles)."""
    seconds = COLD_COMPILE_S * math.ceil(local_size / max(n_cpus, 1))
    return f"compiling harmpi kernels (numba cache is cold), first run only, ~{seconds} s"


class _ColdCacheNote(event.Listener):
    """Logs :func:`message` at the first compile of a harmpi kernel (once)."""

    def __init__(self, text: str, package: str):
        self.text, self.package = text, package
        self.said = False  # (not unregistered: numba is iterating its listeners)

    def on_start(self, ev):
        dispatcher = (ev.data or {}).get("dispatcher")
        module = getattr(getattr(dispatcher, "py_func", None), "__module__", "") or ""
        if self.said or module.split(".")[0] != self.package:
            return
        self.said = True
        log.warning("%s", self.text)

    def on_end(self, ev):
        pass


def install(environ: Mapping[str, str] = os.environ, package: str = "harmpi") -> None:
    """Register the note for kernels of ``package`` on local rank 0 (other
    ranks compile silently)."""
    rank, size = local_rank_and_size(environ)
    if rank == 0:
        text = message(size, os.cpu_count() or 1)
        event.register("numba:compile", _ColdCacheNote(text, package))
