"""Compile every harmpi kernel a job can use, over the host's CPUs.

    python -m harmpi.precompile      # make setup runs it; prints what it did, and how long

Every kernel: those that compile at import and those Python calls with
types known only at the first call (the multi-node and tcp-rail ones);
harmpi.runtime.compilenote.compile_all lists them.

``import harmpi`` runs compile_all (it lives in harmpi.runtime.compilenote, which
has one process per host run it when numba's cache is cold, with one
worker process per CPU: harmpi.runtime.compilepool); this module is the command
line: it says whether it compiled, how long it took and in how many
processes.
"""

from __future__ import annotations

import sys

from ..runtime.compilenote import compile_all

__all__ = ["compile_all", "main"]


def main() -> int:
    from ..runtime import compilenote
    from . import cliout

    # ``import harmpi`` (this module's package) has run compile_once already
    how = compilenote.outcome or compilenote.compile_once(compile_all)
    record = compilenote.read_record(compilenote.cache_dir() / compilenote.RECORD)
    processes = record.get("processes", 1)
    took = {"compiled": f"compiled in {record.get('compile_wall_s', 0):.0f} s by {processes} "
                        + ("process" if processes == 1 else "processes"),
            "waited": "compiled by another process (waited for it)",
            "loaded": "all loaded from the cache (sources changed, kernels did not)",
            "warm": "already in the cache",
            "no jit": "none compiled (NUMBA_DISABLE_JIT=1)"}[how]
    cliout.log.info("%s", f"harmpi kernels: {took}"
                    + (f" (the last compile here took {record['compile_cpu_s']:.0f} s of CPU)"
                       if record.get("compile_cpu_s") else "")
                    + f"\n  numba cache: {compilenote.cache_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
