"""``--load N``: N busy processes beside a benchmark, for the whole run.

A controlled stand-in for a busy machine (issue 25): each process is a
Python spin loop (``while True: pass``), not bound to any core (it widens its
CPU affinity to every CPU of the host, since a rank bound by mpirun would
otherwise pass its own core on), started by the first rank of each host only,
so a host runs N of them whatever its rank count.

They never outlive the run:

- all of them are one process group, stopped with one ``killpg`` (SIGKILL)
  and reaped, from ``stop()``, the ``with`` block's exit (normal return or
  exception, so also SIGINT's KeyboardInterrupt), an ``atexit`` hook and a
  SIGTERM handler (installed only where SIGTERM had its default action);
- each asks the kernel to kill it when its parent dies
  (``PR_SET_PDEATHSIG``), which covers the rank being killed by SIGKILL.

    with BusyLoad(2) as load:   # or host_load(comm, 2) under MPI
        run_the_benchmark()
    print(load.summary())       # "# Load: 2 busy processes ran ..."
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time

__all__ = ["BusyLoad", "host_load", "SPIN_CODE"]

#: what each busy process runs: die with the parent, use every CPU, spin
SPIN_CODE = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(0)  # the parent died before prctl\n"
    "try:\n"
    "    os.sched_setaffinity(0, range(os.cpu_count() or 1))\n"
    "except OSError:\n"
    "    pass\n"
    "while True:\n"
    "    pass\n"
)


class BusyLoad:
    """``count`` busy processes in one process group (none when ``count`` is 0)."""

    def __init__(self, count: int):
        if count < 0:
            raise ValueError(f"--load {count}: the number of busy processes must be >= 0")
        self.count = count
        self.procs: list[subprocess.Popen] = []
        self.pgid: int | None = None
        self.cpu_s = 0.0  # CPU time the processes used, known after stop()
        self.wall_s = 0.0
        self._t0 = 0.0
        self._old_sigterm = None

    # -- start / stop ------------------------------------------------------

    def start(self) -> "BusyLoad":
        if self.count == 0 or self.procs:
            return self
        atexit.register(self.stop)
        self._hook_sigterm()
        self._t0 = time.monotonic()
        argv = [sys.executable, "-I", "-S", "-c", SPIN_CODE, str(os.getpid())]
        for _ in range(self.count):
            # the first is the group's leader; the rest join its group
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    process_group=0 if self.pgid is None else self.pgid)
            if self.pgid is None:
                self.pgid = proc.pid
            self.procs.append(proc)
        return self

    def stop(self) -> None:
        """Kill and reap every process (idempotent; safe from atexit and signals)."""
        if not self.procs:
            return
        procs, self.procs = self.procs, []
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for proc in procs:
            proc.kill()  # in case one left the group
            try:
                _, status, usage = os.wait4(proc.pid, 0)
                proc.returncode = status
                self.cpu_s += usage.ru_utime + usage.ru_stime
            except ChildProcessError:  # reaped elsewhere
                pass
        self.wall_s = time.monotonic() - self._t0
        self._unhook_sigterm()
        atexit.unregister(self.stop)

    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def __enter__(self) -> "BusyLoad":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- SIGTERM -----------------------------------------------------------

    def _hook_sigterm(self) -> None:
        try:
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread: atexit and PDEATHSIG still hold
            self._old_sigterm = None

    def _unhook_sigterm(self) -> None:
        if self._old_sigterm is not None:
            try:
                signal.signal(signal.SIGTERM, self._old_sigterm)
            except ValueError:
                pass
            self._old_sigterm = None

    def _on_sigterm(self, signum, frame) -> None:
        self.stop()
        raise SystemExit(128 + signum)

    # -- what to print -----------------------------------------------------

    def summary(self) -> str:
        """The one line a benchmark prints after the run (its CPU time: this host's)."""
        used = f": {self.cpu_s:.1f} CPU s in {self.wall_s:.1f} s here" if self.wall_s else ""
        return (f"# Load: {self.count} busy process{'es' if self.count != 1 else ''} "
                f"(unbound spin loops) ran on each host{used}")


def host_load(comm, count: int) -> BusyLoad:
    """Start ``count`` busy processes on the first rank of each host of ``comm``
    (collective: every rank calls it); the other ranks get an empty BusyLoad.
    ``count`` must be the same on every rank."""
    from mpi4py import MPI

    host_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    first_on_host = host_comm.Get_rank() == 0
    host_comm.Free()
    return BusyLoad(count if first_on_host else 0).start()
