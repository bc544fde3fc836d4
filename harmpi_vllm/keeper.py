"""The keeper of :class:`harmpi_vllm.executor.MpiExecutor`'s MPI job: a small
process outside vLLM's process tree that runs mpirun and cleans up after it.

Why a process of its own: on Ctrl-C or SIGTERM, vLLM's API server stops its
engine process with a grace of ``shutdown_timeout`` (0 by default) and then
kills the engine's whole process tree (``kill_process_tree``). An mpirun
started by the engine would die with it, SIGKILLed with its ranks, and
leave Open MPI's and vLLM's /dev/shm files behind. The keeper is started
by the engine and at once leaves its tree (it forks, and its parent exits:
init adopts it); mpirun is the keeper's child and receives SIGTERM if the
keeper dies. The keeper is a child subreaper, so a rank that outlives
mpirun is still its descendant, found and ended.

Process groups, not sessions: the keeper and mpirun each lead a process
group of their own (a Ctrl-C at the terminal reaches neither: the engine
handles it) but stay in the server's session. On Linux with
``sched_autogroup_enabled`` every session is a scheduling group of its own:
ranks in a session apart would share each core half and half with the
engine's polling however often it yields (measured on 2 vCPUs: 29 output
tokens/s against 92 for vLLM's own executor, whose workers share the
engine's session).

    python -m harmpi_vllm.keeper ENGINE_PID EVENTS_FD -- MPIRUN_ARGV...

mpirun writes to the keeper's stdout and stderr, which are the engine's.
stdin (from the engine), one command a line; its end (the engine closed it,
or died) means stop:

- ``job PATH``: a /dev/shm file a rank made that the engine maps too (a
  rank's response queue), to remove if it is left;
- ``stop``: stop now.

EVENTS_FD (a pipe to the engine), one event a line: ``mpirun PID``, ``exit STATUS``
(mpirun ended), ``forced TEXT`` (what stopping had to force), ``stopped``.

Stopping: the ranks leave by themselves when their channel to the engine
ends (harmpi_vllm.worker), and mpirun then exits; after :data:`GRACE_S`
mpirun gets SIGTERM, after twice that what is left below the keeper is
killed; then every /dev/shm file that still exists of those the job's
processes had mapped and the engine had not, and of those named by
``job``, is removed. The engine's own files (its scheduler queue) are
vLLM's resource tracker's to remove, while the engine lives; once it is
gone (on Ctrl-C vLLM's server kills it at once), those of them that no
live process maps are removed too: a tracker that died with the engine
leaves them. All of it ends well within vLLM's 30 s.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import signal
import subprocess
import sys
import time

__all__ = ["main", "shm_mapped", "GRACE_S", "SNAPSHOT_S"]

#: how long the ranks get to leave by themselves before mpirun gets SIGTERM
GRACE_S = 8.0
#: how often the job's mapped /dev/shm files are listed
SNAPSHOT_S = 2.0
SHM = "/dev/shm/"
_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def _all_pids() -> list[int]:
    """Every process's pid (Linux /proc)."""
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _descendants(root: int) -> list[int]:
    """``root``'s descendants that are not zombies (Linux /proc)."""
    children: dict[int, list[int]] = {}
    states = {}
    for pid in _all_pids():
        if (st := _stat(pid)) is not None:
            children.setdefault(st[1], []).append(pid)
            states[pid] = st[0]
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if states.get(pid) != "Z":
            found.append(pid)
        todo += children.get(pid, [])
    return found


def shm_mapped(pids) -> set[str]:
    """The /dev/shm files that ``pids`` have mapped (and not unlinked)."""
    files = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as fh:
                for line in fh:
                    parts = line.split(None, 5)
                    path = parts[5].strip() if len(parts) == 6 else ""
                    if path.startswith(SHM) and not path.endswith("(deleted)"):
                        files.add(path)
        except OSError:
            continue
    return files


_events: list[int] = []  # the engine's pipe (set once, in main)


def _say(line: str) -> None:
    """Tell the engine; what had to be forced also goes to stderr (the
    server's log: the engine may be gone)."""
    if line.startswith("forced "):
        print(f"harmpi keeper: {line[len('forced '):]}", file=sys.stderr, flush=True)
    try:
        os.write(_events[0], (line + "\n").encode())
    except OSError:  # the engine is gone
        pass


def _become_subreaper() -> None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: leftovers are found while mpirun lives
        pass


class Keeper:
    def __init__(self, engine_pid: int, argv):
        from harmpi_launch.runner import die_with_launcher  # noqa: PLC0415

        arm = die_with_launcher()

        def own_group_dies_with_keeper() -> None:
            os.setpgid(0, 0)
            if arm is not None:
                arm()

        self.engine_pid = engine_pid
        self.engine_files: set[str] = set()
        self.job_files: set[str] = set()  # named by the engine: removed even if it maps them
        self.mapped: set[str] = set()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                     preexec_fn=own_group_dies_with_keeper)
        _say(f"mpirun {self.proc.pid}")
        self.exited = False

    def _engine_alive(self) -> bool:
        return (st := _stat(self.engine_pid)) is not None and st[0] != "Z"

    def snapshot(self) -> None:
        """Add the /dev/shm files the job's and the engine's processes map."""
        if self._engine_alive():
            self.engine_files |= shm_mapped([self.engine_pid])
        self.mapped |= shm_mapped(_descendants(os.getpid()))

    def _reap(self) -> None:
        """Reap adopted zombies (never mpirun: subprocess reaps it)."""
        me = os.getpid()
        for pid in _all_pids():
            if pid != self.proc.pid and _stat(pid) == ("Z", me):
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass

    def _poll_mpirun(self) -> None:
        if not self.exited and self.proc.poll() is not None:
            self.exited = True
            _say(f"exit {self.proc.returncode}")

    def serve(self) -> None:
        """Until the engine says stop or goes."""
        stdin = sys.stdin.buffer
        buffered = b""
        while True:
            self._poll_mpirun()
            self._reap()
            if not self.exited:
                self.snapshot()
            ready, _, _ = select.select([stdin], [], [], SNAPSHOT_S)
            if not ready:
                continue
            chunk = os.read(stdin.fileno(), 4096)
            if not chunk:
                return
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                command, _, arg = line.decode().partition(" ")
                if command == "job":
                    self.job_files.add(arg)
                elif command == "stop":
                    return

    def _end_leftovers(self) -> list[int]:
        """SIGTERM, then SIGKILL, what is left below the keeper."""
        left = _descendants(os.getpid())
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in _descendants(os.getpid()):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 1.0
            while _descendants(os.getpid()) and time.monotonic() < deadline:
                self._reap()
                time.sleep(0.05)
        return left

    def stop(self) -> None:
        if not self.exited:
            self.snapshot()
        t0 = time.monotonic()
        for sig, until in ((None, GRACE_S), (signal.SIGTERM, 2 * GRACE_S)):
            if sig is not None and self.proc.poll() is None:
                _say(f"forced mpirun was still running {GRACE_S:.0f} s after the stop: "
                     f"sent it {sig.name}")
                self.proc.send_signal(sig)
            try:
                self.proc.wait(max(0.0, t0 + until - time.monotonic()))
                break
            except subprocess.TimeoutExpired:
                continue
        self._poll_mpirun()
        ended = self._end_leftovers()
        self.proc.poll()
        self._poll_mpirun()
        if ended:
            _say(f"forced killed {len(ended)} process(es) the job left: {ended}")
        left = (self.mapped - self.engine_files) | self.job_files
        if self.engine_files and not self._engine_alive():
            left |= self.engine_files - shm_mapped(_all_pids())
        for path in sorted(left):
            try:
                os.unlink(path)
                _say(f"forced removed {path}")
            except OSError:
                pass
        _say("stopped")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python -m harmpi_vllm.keeper ENGINE_PID EVENTS_FD -- MPIRUN_ARGV...",
              file=sys.stderr)
        return 2
    _events.append(int(argv[1]))
    # leave the engine's process tree: the parent returns at once, init adopts the child
    if os.fork():
        os._exit(0)
    os.setpgid(0, 0)  # out of the terminal's foreground group; same session (see above)
    _become_subreaper()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the engine's to handle
    signal.signal(signal.SIGTERM, _exit_on_signal)
    keeper = Keeper(int(argv[0]), argv[3:])
    try:
        keeper.serve()
    except SystemExit:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the stop itself runs to its end
        keeper.stop()
    os._exit(0)  # nothing left to flush to an engine that may be gone


def _exit_on_signal(signum, _frame):
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
