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
    proc = subprocess.Popen(list(argv), env=dict(env), start_new_session=True)

    def forward(signum: int, _frame: object) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {}
    for sig in FORWARDED_SIGNALS:
        try:
            previous[sig] = signal.signal(sig, forward)
        except ValueError:  # not the main thread: signals stay with the caller
            break
    try:
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
