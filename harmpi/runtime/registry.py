"""Which context serves which communicator, and the process events that end them.

harmpi keeps one :class:`~harmpi.runtime.context.Context` per communicator. This
module is the one piece of module state that tracks them (STATE), and the
hooks that retire them: a communicator's free (an MPI attribute's delete
callback), MPI_Finalize (an attribute on COMM_SELF), fork() (a child is
not its parent's rank) and interpreter exit (no collective then). It also
installs the signal wakeup fd through which compiled waits see Ctrl-C
(:class:`SigintWatch`).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading

from mpi4py import MPI

from ..base import arena
from ..base.topology import vote
from ..config import Config
from ..errors import HarmpiArgumentError, HarmpiError
from . import owner
from .context import Context
from .signals import drain_wakeup

__all__ = ["STATE"]

log = logging.getLogger("harmpi")

_COMM_WORLD = MPI.COMM_WORLD


class Registry:
    """The one explicit piece of module state: the contexts, and the native
    entry point while it serves the world context.

    A context hangs on its communicator as an MPI attribute (MPI's own
    answer for per-communicator state): freeing the communicator runs the
    attribute's delete callback, which frees the context, and a later
    communicator that reuses the freed handle starts without one. The world
    context is also kept here for the hot path. An attribute on COMM_SELF
    tells when MPI_Finalize starts (MPI deletes COMM_SELF's attributes
    first); a fork handler tells a child that it is not its parent's rank.
    """

    def __init__(self):
        self.contexts = []          # every live context, in creation order
        self.leaked = []            # contexts whose release was refused (see release)
        self.world = None
        self.torch = None           # harmpi.runtime.torchbuf, once a tensor has been seen
        self.native = None          # harmpi.native's allreduce(t), while it serves
        #: harmpi.native's alltoall(t) once loaded (it declines when nothing is served)
        self.native_alltoall = None
        #: harmpi.native's allgather(t) once loaded (it declines likewise)
        self.native_allgather = None
        self.keyval = None
        self.closed = None          # why no collective may run any more (finalize, fork)
        self.sigint = SigintWatch(self.waiting_elsewhere)
        self._lock = threading.Lock()  # guards _creating and the hooks' installation
        self._creating = {}         # communicator handle -> name of the thread setting it up

    def get(self, comm):
        if comm is None or comm is _COMM_WORLD:
            return self.world or self.create(_COMM_WORLD)
        self.check_comm(comm)
        return self.lookup(comm) or self.create(comm)

    def check_comm(self, comm):
        """HarmpiError unless ``comm`` is a communicator harmpi may touch now:
        an mpi4py communicator, not MPI.COMM_NULL, while MPI is running
        (after MPI_Finalize any MPI call on it would abort the process)."""
        if not isinstance(comm, MPI.Comm):
            raise HarmpiArgumentError(
                f"comm must be an mpi4py communicator, got {type(comm).__name__}")
        if self.closed is not None:  # (MPI_Finalize closes harmpi: see _on_mpi_finalize)
            raise HarmpiError(f"harmpi cannot run: {self.closed}")
        if not comm:  # a null handle: MPI.COMM_NULL, or a split that left this rank out
            raise HarmpiArgumentError(
                "comm is MPI.COMM_NULL: this rank is not a member of it (say, a Split with "
                "color MPI.UNDEFINED); call harmpi's collectives only on the ranks of a "
                "communicator")

    def check_open(self):
        """HarmpiError once no collective may run any more (MPI finalized,
        fork, interpreter exit), before anything that would call MPI: after
        MPI_Finalize most MPI calls abort the process."""
        if self.closed is not None:
            raise HarmpiError(f"harmpi cannot run: {self.closed}")
        if MPI.Is_finalized():
            raise HarmpiError("harmpi cannot run: MPI has been finalized (MPI.Finalize() was "
                              "called); harmpi's calls belong before it")

    def lookup(self, comm):
        """The live context of ``comm`` (None if it has none)."""
        if comm is _COMM_WORLD:
            return self.world
        return comm.Get_attr(self.keyval) if self.keyval is not None else None

    def create(self, comm, config=None):
        """A new context for ``comm`` (collective), owned by the calling
        thread (harmpi.runtime.owner); or the live one another thread made meanwhile.
        A second thread that comes while one sets the communicator up is
        refused at once."""
        self.check_open()
        if not MPI.Is_initialized():
            raise HarmpiError("MPI is not initialised; import mpi4py's MPI and run under mpirun")
        ident, name = owner.current()
        key = comm.handle
        with self._lock:
            live = self.lookup(comm)
            if live is not None and live.broken is None:
                return live
            busy = self._creating.get(key)
            if busy is not None:
                raise HarmpiError(f"thread {busy!r} is setting up harmpi on this communicator; "
                                  + owner.refusal(busy))
            self._creating[key] = name
            if self.keyval is None:
                self._install_hooks()
            self.sigint.start()
        try:
            return self._make(comm, config, ident, name)
        finally:
            with self._lock:
                del self._creating[key]

    def _make(self, comm, config, ident, name):
        ctx = Context(comm, config or Config.from_env(), self.sigint.fd)
        ctx.owner_name = name
        # owned before another thread can find it (below): a thread that
        # looked the context up before its owner was set ran its calls on it
        ctx.ctl[0]["owner"] = ident
        owner.watch(ctx.ctl)  # a later thread given this one's id must not pass for it
        self.contexts.append(ctx)
        try:
            owner.agree(comm, name, ctx.config.timeout_s)
        except HarmpiError as exc:
            ctx.broken = str(exc)  # kept, so later calls say why (its window is left to MPI)
            raise
        finally:
            if comm == _COMM_WORLD:
                self.world = ctx
            else:
                comm.Set_attr(self.keyval, ctx)
        self.adopt_torch()
        if ctx is self.world:
            self.attach_native()
        ctx.held_sigint.deliver()  # a Ctrl-C held over the set-up's blocking calls
        return ctx

    def _install_hooks(self):
        self.keyval = MPI.Comm.Create_keyval(delete_fn=self._on_comm_free)
        finalize_key = MPI.Comm.Create_keyval(delete_fn=self._on_mpi_finalize)
        MPI.COMM_SELF.Set_attr(finalize_key, True)
        os.register_at_fork(after_in_child=self._after_fork)
        # runs before mpi4py's own MPI_Finalize (atexit is last-in, first-out)
        atexit.register(self.at_exit)

    def _on_comm_free(self, comm, keyval, ctx):
        """MPI_Comm_free of a communicator with a context, or harmpi.finalize()
        (collective, like the context's own free)."""
        self.forget(ctx)
        if not MPI.Is_finalized():
            self.release(ctx)

    def release(self, ctx):
        """Free ``ctx`` if every rank agrees it can (a polled vote with a
        deadline on the context's own communicator, topology.vote), else
        leave its window to MPI_Finalize with a warning. Never a blocking
        collective free that only some ranks enter: MPI_Win_free waits for
        every rank of the node, so after a failure one rank saw (its
        context broken, its peers' healthy) the healthy ranks used to wait
        there forever while the broken one skipped it."""
        if self.closed is not None:  # MPI finalizing, a forked child, exit: no collective
            ctx.leak(self.closed)
            self.leaked.append(ctx)
            return
        ok, why = vote(ctx.setup_comm or ctx.comm, ctx.config.timeout_s,
                       "freeing harmpi's context of a communicator", ctx.broken is None)
        if ok:
            ctx.free()
            return
        if ctx.broken is None or ctx.topo.size > 1:
            log.warning("harmpi: not freeing a context collectively (%s); its shared window "
                        "and communicators are left to MPI_Finalize", why)
        ctx.leak(why)
        self.leaked.append(ctx)  # MPI still owns its window: keep the handles alive

    def _on_mpi_finalize(self, comm, keyval, value):
        self.close("MPI has been finalized (MPI.Finalize() or interpreter exit)")
        # an explicit MPI.Finalize() before exit: MPI still works while it
        # deletes COMM_SELF's attributes, so the windows go in order here
        arena.free_remaining()

    def _after_fork(self):
        self.close(f"this process was forked (pid {os.getpid()}) from a rank after harmpi "
                   "was set up; a child is not its parent's rank and cannot take part in its "
                   "collectives")

    def close(self, why):
        """No collective may run any more: every context refuses (its gate
        closes, so the native entry point declines too), and Ctrl-C is
        Python's alone again."""
        self.closed = why
        self.sigint.stop()
        self.native = None
        for ctx in self.contexts:
            ctx.broken = ctx.broken or why
        native = sys.modules.get("harmpi.runtime.native")
        if native is not None:
            native.detach()

    def forget(self, ctx):
        if ctx in self.contexts:
            self.contexts.remove(ctx)
        if ctx is self.world:
            self.world = None
            self.native = None
            native = sys.modules.get("harmpi.runtime.native")
            if native is not None:
                native.detach()

    def at_exit(self):
        """Interpreter exit: no vote, no context's collective free (a peer
        may be exiting on a failure this rank never saw, or still at work).
        The sockets close here; the windows, which MPI_Finalize would free
        anyway (each free waits for the window's ranks), are freed in their
        allocation order (arena.free_remaining: MPI's own order can differ
        between ranks and deadlock)."""
        for ctx in self.contexts + self.leaked:
            ctx.close_transports()
        self.close("the interpreter is exiting")
        if getattr(sys, "last_value", None) is not None and "mpi4py.run" in sys.modules:
            # the script ended on an uncaught exception (Python printed it and
            # set sys.last_value) under `python -m mpi4py`, whose exit calls
            # MPI_Abort: a collective free here would first wait for peers
            # that may be in a collective, waiting for this rank, until their
            # deadline (a 2-rank job took 60 s to end after a crash, not 1)
            return
        if MPI.Is_initialized() and not MPI.Is_finalized():
            arena.free_remaining()  # (not a forked child's: they are its parent's)

    def adopt_torch(self):
        """When torch is already imported, load harmpi's tensor path now (in
        the set-up) rather than at the first tensor a call sees: that first
        call paid ~2 ms for the import and the native module's load."""
        if self.torch is None and "torch" in sys.modules:
            from . import torchbuf  # noqa: PLC0415 - only when torch is in use

            self.torch = torchbuf

    def attach_native(self):
        """Let harmpi.native serve harmpi.allreduce(t) for the world context,
        once torch is in use and the context's default entry is compiled (and
        harmpi.alltoall(t) where its all-to-all is: one node, or 2^k nodes
        over the tcp rail, whose all-reduce is not)."""
        ctx = self.world
        if self.torch is None or ctx is None or ctx.broken is not None:
            return
        a2a_cfunc = getattr(ctx.alltoall, "cfunc", 0)
        if not (ctx.entry_cfunc or a2a_cfunc) or not ctx.config.native:
            return
        from . import native  # noqa: PLC0415 - imports torch's C++ side

        served = native.attach(ctx)
        self.native = served if ctx.entry_cfunc else None
        self.native_alltoall = native.alltoall()
        self.native_allgather = native.allgather()

    def free_all(self):
        """harmpi.finalize(): free every healthy context (collective)."""
        contexts, self.contexts = self.contexts, []
        world, self.world = self.world, None
        self.native = None
        native = sys.modules.get("harmpi.runtime.native")
        if native is not None:  # also for a broken world context, which is not freed
            native.detach()
        if MPI.Is_finalized():
            return
        # in creation order, the order every rank set them up in: contexts
        # that share ranks were set up in the same order on those ranks
        # (else their set-ups could not have completed), so the votes and
        # frees meet in that order too
        for ctx in contexts:
            if ctx is not world:
                # the attribute's delete callback releases the context
                ctx.comm.Delete_attr(self.keyval)
            else:
                self.release(ctx)
        self.sigint.stop()  # the next set-up watches again

    def waiting_elsewhere(self):
        """Whether a context owned by a thread other than the calling one is
        inside a collective (its wait may be the one a Ctrl-C is for)."""
        me = threading.get_ident()
        return any(ctx.ctl[0]["busy"] and ctx.ctl[0]["owner"] != me for ctx in self.contexts)


class SigintWatch:
    """Ctrl-C for harmpi's compiled waits: Python's signal wakeup fd points
    at a pipe that they read (sync.sigint_arrived), so a Ctrl-C ends a wait
    within ~1 ms instead of at its deadline; and SIGINT's Python-level
    handler is a :class:`DrainFirst` in front of the program's, which
    empties that pipe before it runs the program's handler.

    Why the handler: Python's C-level handler writes a byte for every
    signal, wherever the program is. A SIGINT that the program handles
    outside harmpi (it catches KeyboardInterrupt between two collectives)
    left its byte behind, and the next wait that had to wait took it for a
    Ctrl-C of its own and gave up on every rank. Python runs a Python-level
    handler in the main thread between bytecodes, never while the main
    thread is inside a compiled wait, so a wait reads the byte of a signal
    that came during it first; the handler then drains what no wait took.
    Nothing is added to a call (no read per call).

    A handler the program installs after its last set-up replaces harmpi's
    until the next set-up puts one in front of it again: a SIGINT that
    handler takes leaves its byte, and the next harmpi wait that has to wait
    reports an interrupt (KeyboardInterrupt, and the context is unusable).
    Such a program installs its handler before its first harmpi call (or
    calls the handler it replaced, which is harmpi's).

    Only from the main thread (Python's signal calls are refused elsewhere),
    and only if nobody else (asyncio, say) uses the wakeup fd; otherwise the
    contexts get -1, and a wait notices Ctrl-C at its deadline."""

    def __init__(self, waiting_elsewhere):
        #: read end of the pipe (-1 until made); kept for the process's life,
        #: since contexts and transports hold its number
        self.fd = -1
        self._write_fd = -1
        self.watching = False       # the wakeup fd is ours
        #: whether another thread's context is inside a collective: its wait
        #: reads the byte of a Ctrl-C that Python handles in the main thread
        self.waiting_elsewhere = waiting_elsewhere

    def start(self):
        """At every set-up (main thread): own the wakeup fd if it is free, and
        put a DrainFirst in front of SIGINT's Python-level handler if another
        one took its place. Returns the pipe's read end, or -1."""
        if threading.current_thread() is not threading.main_thread():
            return self.fd if self.watching else -1
        if not self.watching and not self._own_wakeup_fd():
            return -1
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler) and not isinstance(handler, DrainFirst):
            signal.signal(signal.SIGINT, DrainFirst(handler, self))
        return self.fd

    def _own_wakeup_fd(self):
        if self.fd < 0:
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            self.fd, self._write_fd = r, w
        old = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        if old != -1:  # someone else's: give it back
            signal.set_wakeup_fd(old)
            log.debug("signal wakeup fd in use: Ctrl-C ends a harmpi wait at its deadline")
            return False
        drain_wakeup(self.fd)  # bytes from before are no interrupt of a wait to come
        self.watching = True
        return True

    def stop(self):
        """harmpi.finalize(), MPI_Finalize, fork, exit: the program's SIGINT
        handler and the wakeup fd as they were (main thread only; elsewhere
        harmpi keeps watching, harmlessly). The pipe stays open, unwritten."""
        if not self.watching or threading.current_thread() is not threading.main_thread():
            return
        handler = signal.getsignal(signal.SIGINT)
        if isinstance(handler, DrainFirst):
            signal.signal(signal.SIGINT, handler.handler)
        now = signal.set_wakeup_fd(-1)
        if now != self._write_fd:  # someone else's since: theirs stays
            signal.set_wakeup_fd(now)
        self.watching = False

    def consume(self):
        """A SIGINT is being handled in Python: its byte is no interrupt of a
        wait to come. Left where another thread waits (its wait takes it)."""
        if self.watching and not self.waiting_elsewhere():
            drain_wakeup(self.fd)


class DrainFirst:
    """SIGINT's Python-level handler while harmpi watches (SigintWatch):
    empties harmpi's wakeup pipe, then runs ``handler``, the one it stands
    in front of (Python's default raises KeyboardInterrupt)."""

    def __init__(self, handler, watch):
        self.handler = handler
        self.watch = watch

    def __call__(self, signum, frame):
        self.watch.consume()
        return self.handler(signum, frame)

    def __repr__(self):
        return f"<harmpi's wakeup-pipe drain in front of {self.handler!r}>"


STATE = Registry()
