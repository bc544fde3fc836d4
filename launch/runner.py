"""Run mpirun in the foreground: inherited stdout/stderr, signals forwarded, its exit status.

mpirun is started in a session of its own, so a Ctrl-C at the terminal reaches
only the launcher, which forwards it to mpirun exactly once; mpirun then stops
every rank (a second Ctrl-C is forwarded too and makes mpirun give up waiting).
Ranks are never signalled directly, so none is left behind half-killed.

A launcher that is itself killed (SIGKILL, or a crash) cannot forward
anything: on Linux mpirun is asked to receive SIGTERM when the launcher dies
(``prctl(PR_SET_PDEATHSIG)``), and tears the job down as if it had been sent
one. A job stopped by a forwarded signal ends the launcher with 128 + that
signal's number, as a shell reports a program killed by it.

An mpirun that is killed itself (SIGKILL, the OOM killer) leaves its ranks
running and Open MPI's ``sm_segment.*`` files behind. The ranks stay in
mpirun's session, so once mpirun is gone the launcher ends what is left of
that session (SIGTERM, SIGKILL after :data:`GRACE_S`) and removes the
``sm_segment.*`` files those processes had mapped (Linux: read from /proc),
and mpirun's own session directory (PRRTE's ``ompi.<mpirun's pid>`` in the
temporary directory), which a killed mpirun cannot remove.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

__all__ = ["FORWARDED_SIGNALS", "GRACE_S", "PARENT_DEATH_SIGNAL", "Finished",
           "die_with_launcher", "run_mpirun"]

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: what mpirun receives when the launcher dies without forwarding anything;
#: mpirun stops its ranks on SIGTERM (SIGKILL would orphan them)
PARENT_DEATH_SIGNAL = signal.SIGTERM
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: how long processes mpirun left behind get to end on SIGTERM before SIGKILL
GRACE_S = 5.0
#: Open MPI's shared-memory backing files (btl/sm, osc/sm): sm_segment.HOST.UID.JOB.RANK
_OMPI_SEGMENT = "sm_segment."


@dataclass(frozen=True)
class Finished:
    """How mpirun ended: its own exit status (128+N if killed by signal N) and
    the signal the launcher forwarded to it, if one stopped the job."""

    mpirun_status: int
    stopped_by: signal.Signals | None = None
    #: processes of the job still running when mpirun had gone, ended by the launcher
    ended: tuple[int, ...] = ()
    #: Open MPI shared-memory files of those processes, removed by the launcher
    removed: tuple[str, ...] = ()
    #: a killed mpirun's session directory, removed by the launcher
    session_dir: str | None = None

    @property
    def exit_status(self) -> int:
        """The launcher's exit status: 128 + the forwarded signal when one
        stopped the job, else mpirun's."""
        return 128 + self.stopped_by if self.stopped_by is not None else self.mpirun_status


def die_with_launcher() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive :data:`PARENT_DEATH_SIGNAL`
    when this process dies (None where prctl is not available: not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:  # loaded here, before the fork: the child only calls it
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    launcher_pid = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0)
        if os.getppid() != launcher_pid:  # the launcher died before prctl ran
            os.kill(os.getpid(), PARENT_DEATH_SIGNAL)

    return arm


def _session(sid: int) -> list[int]:
    """The processes in session ``sid`` (Linux /proc; none elsewhere)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    found = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                stat = fh.read()
        except OSError:  # gone meanwhile
            continue
        # after "pid (comm)": state ppid pgrp session ...
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 3 and fields[3] == str(sid):
            found.append(int(name))
    return found


def _ompi_segments(pids: Sequence[int]) -> set[str]:
    """Open MPI shared-memory files that ``pids`` have mapped and that still exist."""
    files = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as fh:
                for line in fh:
                    parts = line.split(None, 5)  # address perms offset dev inode path
                    path = parts[5].strip() if len(parts) == 6 else ""
                    if (os.path.basename(path).startswith(_OMPI_SEGMENT)
                            and not path.endswith("(deleted)")):
                        files.add(path)
        except OSError:  # gone meanwhile
            continue
    return files


def _end_session(sid: int, grace_s: float = GRACE_S) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """End what is left of mpirun's session ``sid`` (its ranks, once mpirun is
    gone) and remove their Open MPI shared-memory files: (pids, files)."""
    pids = _session(sid)
    if not pids:
        return (), ()
    files = _ompi_segments(pids)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        for pid in _session(sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while _session(sid) and time.monotonic() < deadline:
            time.sleep(0.05)
    removed = []
    for path in sorted(files):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:  # the ranks removed it on their way out
            pass
    return tuple(pids), tuple(removed)


def _remove_session_dir(pid: int, env: Mapping[str, str]) -> str | None:
    """Remove PRRTE's session directory of the mpirun ``pid`` (``ompi.<pid>``
    in the job's temporary directory; mpirun removes it itself unless it was
    killed). Only a real directory of this user; the path, or None."""
    base = env.get("TMPDIR") or tempfile.gettempdir()
    path = os.path.join(base, f"ompi.{pid}")
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return None
    shutil.rmtree(path, ignore_errors=True)
    return None if os.path.exists(path) else path


def run_mpirun(argv: Sequence[str], env: Mapping[str, str]) -> Finished:
    """Run ``argv`` with ``env`` until it exits; how it ended."""
    # The handlers go in before mpirun starts: a signal in between used to
    # find no handler (KeyboardInterrupt here, mpirun left running in its own
    # session). One that comes before mpirun exists is sent to it at once.
    # mpirun itself starts with the default actions (a handler does not pass
    # through exec), also where this launcher was started with SIGINT ignored.
    started = []
    pending = []
    received: list[signal.Signals] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signal.Signals(signum))
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
        proc = subprocess.Popen(list(argv), env=dict(env), start_new_session=True,
                                preexec_fn=die_with_launcher())
        started.append(proc)
        for signum in pending:
            proc.send_signal(signum)
        while True:
            try:
                rc = proc.wait()
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries already
                continue
        # mpirun stops its ranks before it exits, unless it was killed itself
        ended, removed = _end_session(proc.pid)
        session_dir = _remove_session_dir(proc.pid, env) if rc < 0 else None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    status = 128 - rc if rc < 0 else rc
    # a job that finished cleanly although a signal came is reported as finished
    return Finished(status, received[0] if received and status != 0 else None, ended, removed,
                    session_dir)
