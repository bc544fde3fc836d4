"""Ctrl-C around collectives: held over a set-up, drained after a wait.

harmpi's compiled waits notice a SIGINT through Python's wakeup fd (the
registry's pipe, ``sigfd``): the signal writes a byte there, a wait that
reads it gives up on its step. Two things follow. A set-up's blocking MPI
calls must not be left half-way by one rank, so Ctrl-C is held over them
(:class:`HeldSigint`). And a byte a Python-level wait left behind would
interrupt the next compiled wait, so it is read away (:func:`drain_wakeup`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

__all__ = ["HeldSigint", "drain_wakeup"]


def drain_wakeup(sigfd):
    """Read harmpi's signal wakeup pipe (non-blocking) empty: the signals
    its bytes stand for have been handled (-1: no pipe)."""
    if sigfd >= 0:
        with contextlib.suppress(OSError):  # BlockingIOError once empty
            while os.read(sigfd, 64):
                pass


class HeldSigint:
    """Hold Ctrl-C over a section that every rank must finish together (the
    blocking MPI calls of a set-up: a rank that left one half-way would hang
    its peers in theirs). Inside, Python's SIGINT handler is one that notes
    the signal; on leaving, the old handler is back and the byte the signal
    left in harmpi's wakeup pipe is drained (the next wait must not be
    interrupted by it); :meth:`deliver` then runs the old handler
    (KeyboardInterrupt) where the caller is ready for it. Only in the main
    thread (where Python runs signal handlers) and over a Python-level
    handler; otherwise nothing is held."""

    def __init__(self, sigfd):
        self.sigfd = sigfd
        self.old = None
        self.got = []

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            old = signal.getsignal(signal.SIGINT)
            if callable(old):
                self.old = old
                signal.signal(signal.SIGINT, lambda signum, frame: self.got.append(frame))
        return self

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
            if self.got:
                drain_wakeup(self.sigfd)
        return False

    def deliver(self):
        """Run the old handler if a SIGINT came while held (once)."""
        if self.got and self.old is not None:
            frame, self.got = self.got[0], []
            self.old(signal.SIGINT, frame)
