"""Run a Python program as one rank of a harmpi job, ending the job if it fails.

    mpirun -np 2 python -m harmpi.run script.py [args]     # as python script.py
    mpirun -np 2 python -m harmpi.run -m package.module [args]
    mpirun -np 2 python -m harmpi.run -c "code" [args]

The program runs as ``python script.py`` would run it (``__name__ ==
"__main__"``, ``sys.argv``, the script's directory first on ``sys.path``),
inside :func:`harmpi.failfast.run`: an uncaught exception, or an exit with
a non-zero status, on any rank prints that rank's traceback once and ends
every rank of the job (MPI_Abort) instead of leaving the others waiting.
harmpi's launcher (``python -m launch``) runs every Python command this
way. Under the runner, :func:`harmpi.platform.worldenv.export` sets torchrun's RANK,
WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE where they are unset.

The runner imports harmpi before the program runs, so a program that
imports torch and then harmpi (which registers backend "harmpi" when torch
came first) would find harmpi imported before torch. The runner therefore
registers the backend right after the program's first ``import torch``
(:class:`RegisterAfterTorch`), never importing torch itself: a program
that sets torch's environment before importing it keeps that order.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import runpy
import sys
import types
from typing import Callable, Sequence

from ..platform import failfast, worldenv

__all__ = ["USAGE", "RegisterAfterTorch", "main", "target"]

USAGE = "usage: python -m harmpi.run (script.py | -m module | -c command) [args...]"


def target(argv: Sequence[str]) -> Callable[[], object]:
    """What ``python -m harmpi.run ARGV...`` runs, as a call that sets
    ``sys.argv`` and ``sys.path[0]`` as the interpreter would, then runs it.
    Raises SystemExit with the usage when ARGV names no program."""
    if not argv or (argv[0] in ("-m", "-c") and len(argv) < 2) or argv[0] in ("-h", "--help"):
        raise SystemExit(USAGE)
    if argv[0] == "-m":
        module, rest = argv[1], list(argv[2:])

        def run_module():
            sys.argv = [module, *rest]  # (runpy puts the module's path in argv[0])
            runpy.run_module(module, run_name="__main__", alter_sys=True)

        return run_module
    if argv[0] == "-c":
        source, rest = argv[1], list(argv[2:])

        def run_command():
            sys.argv = ["-c", *rest]
            sys.path[0] = ""
            main_module = types.ModuleType("__main__")
            sys.modules["__main__"] = main_module
            exec(compile(source, "<string>", "exec"), main_module.__dict__)  # noqa: S102

        return run_command
    if argv[0].startswith("-"):
        raise SystemExit(f"harmpi.run: unknown option {argv[0]!r}\n{USAGE}")
    path, rest = argv[0], list(argv[1:])

    def run_path():
        sys.argv = [path, *rest]
        sys.path[0] = os.path.dirname(os.path.realpath(path))
        runpy.run_path(path, run_name="__main__")

    return run_path


class RegisterAfterTorch(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` entry that, once torch's ``__init__`` has run in
    the program's first ``import torch``, imports harmpi.distributed (which
    registers the backend) and leaves ``sys.meta_path``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run_torch = spec.loader.exec_module

        def exec_module(module):
            run_torch(module)
            importlib.import_module("harmpi.distributed")

        spec.loader.exec_module = exec_module  # (this import's own loader object)
        return spec


def main(argv: Sequence[str] | None = None) -> None:
    program = target(sys.argv[1:] if argv is None else argv)
    worldenv.export()
    if "torch" not in sys.modules:
        sys.meta_path.insert(0, RegisterAfterTorch())
    failfast.run(program)


if __name__ == "__main__":
    main()
