"""A rank that fails ends the whole job, within a second or so.

Under an MPI launcher (``mpirun``, ``python -m launch``, ``python -m
mpi4py``), an uncaught exception on one rank used to leave the others
waiting: the failing rank hangs in MPI_Finalize (Open MPI fences there
until every rank arrives) while its peers wait on it inside a collective
until harmpi's deadline, or forever in user code. ``import harmpi`` under a
launcher therefore installs :class:`AbortHook` as ``sys.excepthook``:

1. the previous hook prints the traceback, once, on the failing rank only
   (its peers are killed before they can fail, and print nothing);
2. stdout and stderr are flushed (the launcher forwards them; nothing is lost);
3. ``MPI.COMM_WORLD.Abort(status)``: the launcher kills every other rank
   (SIGTERM; a rank inside a harmpi wait dies there too) and exits with a
   non-zero status. status is 1, or 130 for KeyboardInterrupt (as ``python
   -m mpi4py`` does).

What is left alone, and why:

- ``SystemExit`` (``sys.exit(n)``) never reaches ``sys.excepthook``, and
  its status is not visible to Python code at exit. harmpi does not rebind
  ``sys.exit`` to see it: that would also abort the job for exits a program
  catches (a CLI's ``--help`` under test). ``python -m mpi4py`` wraps the
  main script and aborts on a non-zero ``SystemExit``; without it the rank
  exits once its peers finish (or at their next collective's deadline).
- Exceptions in other threads (``threading.excepthook``): Python keeps the
  process running, and so does harmpi. A thread that dies is often harmless
  (a progress bar, a prefetcher); if the main thread then fails, this hook
  ends the job, and if it waits on the dead thread's share of a collective,
  the deadline does.
- ``python -i`` (inspect after an error): no abort, the user asked to look.
- A process forked from a rank, a one-rank world, MPI not initialised or
  already finalised: there is no job to end, or no MPI to end it with.
- A rank killed by a signal (SIGKILL, SIGSEGV, SIGTERM): the launcher
  already ends the job (Open MPI's prterun kills the other ranks within
  ~0.5 s, measured); nothing runs in a killed process.

Opt out with ``HARMPI_ABORT_ON_EXCEPTION=0`` (read at import), or by giving
``harmpi.init`` a ``Config(abort_on_exception=False)`` for the world
communicator (looked at when a rank fails).
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from .config import Config
from .errors import HarmpiArgumentError

__all__ = ["AbortHook", "install", "abort_status"]

log = logging.getLogger("harmpi")


def abort_status(exc_type) -> int:
    """The status the job ends with for an uncaught ``exc_type``."""
    if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
        return 128 + signal.SIGINT
    return 1


def _opted_out() -> bool:
    """Whether the world context runs with ``Config(abort_on_exception=False)``
    (given to harmpi.init)."""
    registry = sys.modules.get("harmpi.registry")
    ctx = registry.STATE.world if registry is not None else None
    return ctx is not None and not ctx.config.abort_on_exception


def _mpi_world():
    """COMM_WORLD if it is up with more than one rank, else None."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    world = mpi.COMM_WORLD
    return world if world.Get_size() > 1 else None


class AbortHook:
    """``sys.excepthook``: run the previous hook, then end the whole job."""

    def __init__(self, previous):
        self.previous = previous
        self.pid = os.getpid()  # a forked child is not a rank: it never aborts the job

    def __call__(self, exc_type, exc, tb):
        world = None
        if not (sys.flags.inspect or os.getpid() != self.pid or _opted_out()):
            world = _mpi_world()
        try:
            self.previous(exc_type, exc, tb)
        finally:
            if world is not None:
                self._abort(world, exc_type)

    @staticmethod
    def _abort(world, exc_type):
        status = abort_status(exc_type)
        log.error("harmpi: rank %d of %d ended with an uncaught %s; aborting the job "
                  "(MPI_Abort, status %d; HARMPI_ABORT_ON_EXCEPTION=0 turns this off)",
                  world.Get_rank(), world.Get_size(), exc_type.__name__, status)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not stop the abort
                log.debug("could not flush %r before MPI_Abort", stream)
        world.Abort(status)


def _enabled(env=None) -> bool:
    try:
        return Config.from_env(env).abort_on_exception
    except HarmpiArgumentError:
        # a bad setting raises at the first collective, as it always did;
        # meanwhile a failure still ends the job
        return Config.abort_on_exception


def install(env=None) -> bool:
    """Install :class:`AbortHook` (once) unless the configuration opts out;
    whether it is installed. harmpi calls this at import, under a launcher."""
    if isinstance(sys.excepthook, AbortHook):
        return True
    if not _enabled(env):
        return False
    sys.excepthook = AbortHook(sys.excepthook)
    return True
