"""Run mpirun in the foreground: inherited stdout/stderr, signals forwarded, its exit status.

mpirun is started in a session of its own, so a Ctrl-C at the terminal reaches
only the launcher, which forwards it to mpirun exactly once; mpirun then stops
every rank (a second Ctrl-C is forwarded too and makes mpirun give up waiting).
Ranks are never signalled directly, so none is left behind half-killed.
"""

from __future__ import annotations

import signal
import subprocess
from typing import Mapping, Sequence

__all__ = ["FORWARDED_SIGNALS", "run_mpirun"]

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run_mpirun(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """Run ``argv`` with ``env``; return its exit status (128+N if killed by signal N)."""
    # The handlers go in before mpirun starts: a signal in between used to
    # find no handler (KeyboardInterrupt here, mpirun left running in its own
    # session). One that comes before mpirun exists is sent to it at once.
    # mpirun itself starts with the default actions (a handler does not pass
    # through exec), also where this launcher was started with SIGINT ignored.
    started = []
    pending = []

    def forward(signum: int, _frame: object) -> None:
        if not started:
            pending.append(signum)
        elif started[0].poll() is None:
            started[0].send_signal(signum)

    previous = {}
    for sig in FORWARDED_SIGNALS:
        try:
            previous[sig] = signal.signal(sig, forward)
        except ValueError:  # not the main thread: signals stay with the caller
            break
    try:
        proc = subprocess.Popen(list(argv), env=dict(env), start_new_session=True)
        started.append(proc)
        for signum in pending:
            proc.send_signal(signum)
        while True:
            try:
                rc = proc.wait()
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries already
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - rc if rc < 0 else rc
