"""A rank that fails ends the whole job, within a second or so.

Under an MPI launcher (``mpirun``, ``python -m launch``), an uncaught
exception on one rank leaves the others waiting: the failing rank hangs in
MPI_Finalize (Open MPI fences there until every rank arrives) while its
peers wait on it inside a collective until harmpi's deadline, or forever in
user code. Two ways end the job instead; ``import harmpi`` itself changes
neither ``sys.excepthook`` nor ``sys.exit``:

- **the runner**, ``python -m harmpi.run script.py [args]`` (harmpi.run;
  the launcher runs every Python command with it): :func:`run` calls the
  program and ends the job when it raises, including a ``SystemExit`` with
  a non-zero status (``sys.exit(3)``: status 3; a message instead of a
  number: 1), as torchrun ends the job when a worker exits non-zero;
- **the hook**, :func:`install`, for a program started by plain ``mpirun
  python script.py``: it installs :class:`AbortHook` as ``sys.excepthook``
  (Python shows a SystemExit to no hook: ``sys.exit(n)`` ends only that
  rank there).

Either way, on the failing rank:

1. the current ``sys.excepthook`` prints the traceback, once, on the
   failing rank only (its peers are killed before they can fail, and
   print nothing), each line prefixed by the rank as torch.distributed
   prefixes it (``[rank1]: Traceback ...``);
2. the line "rank r of n ended with ..." is logged, and stdout and stderr
   are flushed (the launcher forwards them; nothing is lost);
3. ``MPI.COMM_WORLD.Abort(status)``: the launcher kills every other rank
   (SIGTERM; a rank inside a harmpi wait dies there too) and exits with a
   non-zero status. status is 1, or 130 for KeyboardInterrupt (as ``python
   -m mpi4py`` does).

Steps 1 and 2 write to the process's real stderr (``sys.__stderr__``), not
to whatever ``sys.stderr`` is while the hook runs: ``init_process_group``
installs torch's own excepthook, which points ``sys.stderr`` at a buffer,
calls the previous hook (this one) and prints the buffer when it returns --
which it never does here, as the job ends in step 3. Written to the buffer,
the traceback and harmpi's line would be lost; the user would see only
Open MPI's "MPI_ABORT was invoked on rank 1".

What is left alone, and why:

- Exceptions in other threads (``threading.excepthook``): Python keeps the
  process running, and so does harmpi. A thread that dies is often harmless
  (a progress bar, a prefetcher); if the main thread then fails, the job
  ends, and if it waits on the dead thread's share of a collective, the
  deadline does.
- ``python -i`` (inspect after an error): no abort, the user asked to look.
- A process forked from a rank, a one-rank world, MPI not initialised or
  already finalised: there is no job to end, or no MPI to end it with.
- A rank killed by a signal (SIGKILL, SIGSEGV, SIGTERM): the launcher
  already ends the job (Open MPI's prterun kills the other ranks within
  ~0.5 s, measured); nothing runs in a killed process.

Opt out with ``HARMPI_ABORT_ON_EXCEPTION=0`` (read when the runner starts or
:func:`install` runs), or by giving ``harmpi.init`` a
``Config(abort_on_exception=False)`` for the world communicator (looked at
when a rank fails).
"""

from __future__ import annotations

import io
import logging
import os
import signal
import sys
from typing import Callable

from ..config import Config
from ..errors import HarmpiArgumentError

__all__ = ["AbortHook", "install", "run", "abort_status", "exit_status", "rank_prefixed"]

log = logging.getLogger("harmpi")


def abort_status(exc_type) -> int:
    """The status the job ends with for an uncaught ``exc_type``."""
    if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
        return 128 + signal.SIGINT
    return 1


def exit_status(code) -> int:
    """The process status of ``sys.exit(code)`` (0: a clean exit)."""
    if code is None:
        return 0
    return int(code) if isinstance(code, int) else 1


def _opted_out() -> bool:
    """Whether the world context runs with ``Config(abort_on_exception=False)``
    (given to harmpi.init)."""
    registry = sys.modules.get("harmpi.runtime.registry")
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
        world = self.world()
        if world is None:
            self.previous(exc_type, exc, tb)
            return
        try:
            self._report(world.Get_rank(), exc_type, exc, tb)
        finally:
            self._abort(world, abort_status(exc_type), f"an uncaught {exc_type.__name__}")

    def _report(self, rank, exc_type, exc, tb):
        """The previous hook's output, each line prefixed by the rank, on the real stderr."""
        buf = io.StringIO()
        captured, sys.stderr = sys.stderr, buf
        try:
            self.previous(exc_type, exc, tb)
        finally:
            sys.stderr = captured
            _write_stderr(rank_prefixed(buf.getvalue(), rank))

    def exited(self, code):
        """A SystemExit that nothing caught: end the job if its status is not 0
        (a message, which Python would print, is printed first)."""
        status = exit_status(code)
        world = self.world() if status else None
        if world is not None:
            if code is not None and not isinstance(code, int):
                _write_stderr(f"{code}\n")
            self._abort(world, status, f"sys.exit({code!r})")

    def world(self):
        """COMM_WORLD to abort, or None: no abort here."""
        if sys.flags.inspect or os.getpid() != self.pid or _opted_out():
            return None
        return _mpi_world()

    @staticmethod
    def _abort(world, status, what):
        captured, sys.stderr = sys.stderr, _real_stderr()  # for logging's last resort
        try:
            log.error("harmpi: rank %d of %d ended with %s; aborting the job (MPI_Abort, "
                      "status %d; HARMPI_ABORT_ON_EXCEPTION=0 turns this off)",
                      world.Get_rank(), world.Get_size(), what, status)
        finally:
            sys.stderr = captured
        for stream in (sys.stdout, sys.stderr, _real_stderr()):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not stop the abort
                log.debug("could not flush %r before MPI_Abort", stream)
        world.Abort(status)


def rank_prefixed(text, rank):
    """``text`` with each non-empty line prefixed ``[rank<r>]: `` as torch.distributed's
    excepthook does (a line that has the prefix already keeps one)."""
    prefix = f"[rank{rank}]:"
    return "".join(line if not line.strip() or line.startswith(prefix) else f"{prefix} {line}"
                   for line in text.splitlines(keepends=True))


def _real_stderr():
    """The process's stderr as Python started it (what the launcher forwards)."""
    return sys.__stderr__ if sys.__stderr__ is not None else sys.stderr


def _write_stderr(text):
    stream = _real_stderr()
    try:
        stream.write(text)
        stream.flush()
    except Exception:  # noqa: BLE001 - a closed stderr must not stop the abort
        log.debug("could not write the traceback to stderr before MPI_Abort")


def _enabled(env=None) -> bool:
    try:
        return Config.from_env(env).abort_on_exception
    except HarmpiArgumentError:
        # a bad setting raises at the first collective, as it always did;
        # meanwhile a failure still ends the job
        return Config.abort_on_exception


def install(env=None) -> bool:
    """Install :class:`AbortHook` as ``sys.excepthook`` (once) unless the
    configuration opts out; whether it is installed. For programs started by
    plain ``mpirun python script.py``; ``python -m harmpi.run`` needs no hook."""
    if isinstance(sys.excepthook, AbortHook):
        return True
    if not _enabled(env):
        return False
    sys.excepthook = AbortHook(sys.excepthook)
    return True


def run(main: Callable[[], object], env=None) -> None:
    """Call ``main()``, ending the whole job when it raises (the runner's
    half of this module: see the module docstring). A ``SystemExit`` of
    status 0, and any exception outside a multi-rank job or with the
    configuration opting out, propagates as Python would handle it."""
    if not _enabled(env):
        main()
        return
    try:
        main()
    except SystemExit as exc:
        AbortHook(sys.excepthook).exited(exc.code)
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure ends the job
        hook = AbortHook(sys.excepthook)
        if hook.world() is None:
            raise
        tb = exc.__traceback__ = _own_frames_dropped(exc.__traceback__)  # (hooks print it)
        hook(type(exc), exc, tb)
        raise  # (only if MPI_Abort returned)


def _own_frames_dropped(tb):
    """``tb`` without its first frames in this module, harmpi.run (the
    command's module and harmpi.cli.run) and runpy:
    the traceback starts at the program, as under ``python script.py``."""
    import runpy  # noqa: PLC0415 - only on a failure

    own = {os.path.normcase(os.path.abspath(f)) for f in (__file__, runpy.__file__)}
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    own.update(os.path.normcase(os.path.join(package, *where, "run.py"))
               for where in ((), ("cli",)))
    own.add("<frozen runpy>")  # (runpy's code when Python was built with it frozen)
    while tb is not None and os.path.normcase(tb.tb_frame.f_code.co_filename) in own:
        tb = tb.tb_next
    return tb
