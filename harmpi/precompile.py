"""Compile every harmpi kernel a job can use, in this one process.

    python -m harmpi.precompile      # make setup runs it; prints what it did

Every kernel: those that compile at import and those Python calls with
types known only at the first call (the multi-node and tcp-rail ones);
harmpi.compilenote.compile_all lists them.

``import harmpi`` runs compile_all (it lives in harmpi.compilenote, which
runs it in one process per host when numba's cache is cold); this module
is the command line: it says whether it compiled, and how long it took.
"""

from __future__ import annotations

import sys

from .compilenote import compile_all

__all__ = ["compile_all", "main"]


def main() -> int:
    from . import cliout, compilenote

    # ``import harmpi`` (this module's package) has run compile_once already
    how = compilenote.outcome or compilenote.compile_once(compile_all)
    record = compilenote.read_record(compilenote.cache_dir() / compilenote.RECORD)
    took = {"compiled": f"compiled in {record.get('compile_wall_s', 0):.0f} s",
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
