"""The running MPI job of :class:`harmpi_vllm.executor.MpiExecutor`: the
listener its ranks connect back to, one channel per rank
(harmpi_vllm.channel), and the keeper that runs mpirun outside vLLM's
process tree (harmpi_vllm.keeper). Nothing here imports vLLM: the payloads
the executor sends and the queue handles the ranks return pass through as
objects.

Lifecycle, as the executor drives it::

    job = RankJob.listen(world_size, listen_host)        # listener, probe
    job.launch(argv, env)                                # keeper, mpirun: env plus job.env
    hellos = job.accept(deadline_s)                      # every rank connected
    job.send(rank, message) ...                          # settings, worker arguments
    handles = job.wait_ready()                           # every rank's response queue
    failure = job.watch(stopping)                        # blocks: who ended first
    job.stop()                                           # every rank gone, nothing left

``stop`` closes the channels (the ranks leave their loop and MPI ends
normally) and tells the keeper, which ends whatever is left and removes
the /dev/shm files the job had mapped if any is still there; it waits for
that at most :data:`STOP_BUDGET_S` (vLLM may kill the engine's process
tree at once: the keeper, outside it, goes on by itself). A dying engine
closes the channels and the keeper's pipe just the same.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Listener, wait

from . import channel

__all__ = ["RankJob", "RankInfo", "JobFailed", "STOP_BUDGET_S"]

log = logging.getLogger("vllm.harmpi.executor")

#: how long stop() waits for the keeper to report the job stopped
STOP_BUDGET_S = 20.0
#: how long a connected rank has to say Hello
_HELLO_S = 30.0


class JobFailed(RuntimeError):
    """The MPI job or one of its ranks ended before the executor was done with it."""


@dataclass
class RankInfo:
    """One rank as it introduced itself, and how its channel ended."""

    hello: channel.Hello
    conn: object
    shares_shm: bool
    bye: str | None = None  # the reason it gave for leaving
    closed: bool = False

    def name(self) -> str:
        h = self.hello
        return f"rank {h.rank} of {h.world_size} (pid {h.pid} on {h.host})"


class RankJob:
    """See the module docstring."""

    def __init__(self, listener, probe_path, token, world_size, env):
        self.keeper = None
        self.mpirun_pid: int | None = None
        self.mpirun_status: int | None = None
        self.forced: list[str] = []
        self._keeper_done = threading.Event()
        self.listener, self.probe_path, self.token = listener, probe_path, token
        self.world_size = world_size
        #: what every rank needs to find the engine (forwarded to every host)
        self.env = env
        self.ranks: dict[int, RankInfo] = {}
        self._incoming: queue.Queue = queue.Queue()
        self._stopped = False
        threading.Thread(target=self._accept_loop, daemon=True, name="HarmpiAccept").start()

    @classmethod
    def listen(cls, world_size: int, listen_host: str) -> "RankJob":
        """Listen on ``listen_host`` (any port) and write the probe; the
        channel's settings for the ranks are in :attr:`env`."""
        key = secrets.token_bytes(32)
        listener = Listener((listen_host, 0), family="AF_INET6" if ":" in listen_host
                            else "AF_INET", authkey=key)
        host, port = listener.address[:2]
        token = secrets.token_hex(16).encode()
        probe = f"harmpi_vllm_probe_{os.getpid()}_{secrets.token_hex(4)}"
        probe_path = os.path.join(channel.SHM_DIR, probe)
        try:
            fd = os.open(probe_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(token)
        except OSError:
            probe_path = None  # no /dev/shm here: every rank reads the queues over TCP
        env = {channel.ENGINE_ENV: f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
               channel.AUTHKEY_ENV: key.hex(), channel.PROBE_ENV: probe}
        return cls(listener, probe_path, token, world_size, env)

    def launch(self, argv, env) -> None:
        """Start the keeper (which starts ``argv``, mpirun) with ``env``
        plus :attr:`env`; returns at once."""
        read_fd, write_fd = os.pipe()
        try:
            self.keeper = subprocess.Popen(
                [sys.executable, "-m", "harmpi_vllm.keeper", str(os.getpid()), str(write_fd),
                 "--", *argv], env=dict(env, **self.env), stdin=subprocess.PIPE,
                pass_fds=(write_fd,))
        finally:
            os.close(write_fd)
        self.keeper.wait()  # it forks at once: its child is the keeper, adopted by init
        events = os.fdopen(read_fd, "rb")
        threading.Thread(target=self._keeper_events, args=(events,), daemon=True,
                         name="HarmpiKeeper").start()

    def _keeper_events(self, events) -> None:
        for raw in events:
            event, _, arg = raw.decode(errors="replace").rstrip("\n").partition(" ")
            if event == "mpirun":
                self.mpirun_pid = int(arg)
            elif event == "exit":
                self.mpirun_status = int(arg)
            elif event == "forced":
                self.forced.append(arg)
            elif event == "stopped":
                break
        self._keeper_done.set()

    # --- start-up ------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopped:
            try:
                conn = self.listener.accept()
            except OSError:  # closed: stop() or start-up over
                return
            except Exception as exc:  # a peer without the key (AuthenticationError)
                log.warning("harmpi: refused a connection to the executor's listener: %s", exc)
                continue
            self._incoming.put(conn)

    def _mpirun_ended(self, what: str) -> None:
        status = self.mpirun_status
        if status is None and self._keeper_done.is_set():
            status = "unknown: the keeper ended"
        if status is not None:
            raise JobFailed(f"the MPI job ended (mpirun exit status {status}) {what}; "
                            "its output is above")

    def accept(self, timeout_s: float) -> dict[int, RankInfo]:
        """Wait until every rank has connected and said Hello."""
        deadline = time.monotonic() + timeout_s
        while len(self.ranks) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(self.ranks))
            self._mpirun_ended(f"before rank(s) {missing} connected to vLLM's engine")
            if time.monotonic() > deadline:
                raise JobFailed(f"rank(s) {missing} did not connect to vLLM's engine within "
                                f"{timeout_s:.0f} s (HARMPI_VLLM_START_TIMEOUT_S)")
            try:
                conn = self._incoming.get(timeout=0.5)
            except queue.Empty:
                continue
            self._hello(conn)
        self._remove_probe()
        return self.ranks

    def _hello(self, conn) -> None:
        if not conn.poll(_HELLO_S):
            conn.close()
            return
        hello = conn.recv()
        if not isinstance(hello, channel.Hello) or hello.world_size != self.world_size or \
                not 0 <= hello.rank < self.world_size or hello.rank in self.ranks:
            conn.close()
            raise JobFailed(f"unexpected first message on the executor's channel: {hello!r} "
                            f"(expected rank 0..{self.world_size - 1} of {self.world_size}, "
                            "each once)")
        shares = hello.probe is not None and hello.probe == self.token
        self.ranks[hello.rank] = RankInfo(hello, conn, shares)

    def send(self, rank: int, message) -> None:
        self.ranks[rank].conn.send(message)

    def wait_ready(self) -> dict[int, object]:
        """Every rank's Ready handle; JobFailed naming the rank that failed or died."""
        handles: dict[int, object] = {}
        pending = {info.conn: info for info in self.ranks.values()}
        while pending:
            self._mpirun_ended("while vLLM's workers started")
            for conn in wait(list(pending), timeout=0.5):
                info = pending.pop(conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    info.closed = True
                    raise JobFailed(f"vLLM worker {info.name()} ended while starting") from None
                if isinstance(msg, channel.Failed):
                    raise JobFailed(f"vLLM worker {info.name()} failed to start:\n{msg.text}")
                if isinstance(msg, channel.Bye):
                    info.bye = msg.reason
                    raise JobFailed(f"vLLM worker {info.name()} stopped while starting: "
                                    f"{msg.reason}")
                handles[info.hello.rank] = msg.handle
        return handles

    def claim(self, path: str) -> None:
        """Tell the keeper that ``path`` (in /dev/shm) is the job's, though the engine maps it."""
        self.keeper.stdin.write(f"job {path}\n".encode())
        self.keeper.stdin.flush()

    # --- running ---------------------------------------------------------------

    def watch(self, stopping) -> str | None:
        """Block until a rank's channel ends or mpirun exits (None once
        ``stopping()`` is true): what ended, naming the rank."""
        open_ = {info.conn: info for info in self.ranks.values() if not info.closed}
        while not stopping():
            for conn in wait(list(open_), timeout=1.0):
                info = open_[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    info.closed = True
                    del open_[conn]
                    if stopping():
                        return None
                    return self._culprit(open_)
                if isinstance(msg, channel.Bye):
                    info.bye = msg.reason
            if (self.mpirun_status is not None or self._keeper_done.is_set()) \
                    and not stopping():
                return self._culprit(open_)
        return None

    def _culprit(self, open_) -> str:
        """Name what ended the job: the first rank whose channel closed
        without a Bye, else the first that left by itself."""
        time.sleep(0.3)  # the others' Bye or end, if mpirun is taking them down
        for conn in wait(list(open_), timeout=0):
            info = open_[conn]
            try:
                msg = conn.recv()
                if isinstance(msg, channel.Bye):
                    info.bye = msg.reason
            except (EOFError, OSError):
                info.closed = True
        ranks = [self.ranks[r] for r in sorted(self.ranks)]
        dead = [i for i in ranks if i.closed and i.bye is None]
        left = [i for i in ranks if i.bye is not None]
        status = self.mpirun_status
        tail = f"; mpirun exit status {status}" if status is not None else ""
        if dead:
            return (f"vLLM worker {dead[0].name()} died (its process ended without leaving: "
                    f"killed, or crashed){tail}")
        if left:
            return f"vLLM worker {left[0].name()} stopped: {left[0].bye}{tail}"
        return f"the MPI job ended (mpirun exit status {status}) with every rank still there"

    # --- stopping --------------------------------------------------------------

    def stop(self, budget_s: float = STOP_BUDGET_S) -> list[str]:
        """End the job: close the channels, tell the keeper, wait for it at
        most ``budget_s``; returns what it had to force (empty: clean)."""
        self._stopped = True
        for info in self.ranks.values():
            info.conn.close()  # the rank's sign to leave
        self.listener.close()
        self._remove_probe()
        if self.keeper is None:  # never launched
            return []
        try:
            self.keeper.stdin.write(b"stop\n")
            self.keeper.stdin.close()
        except OSError:  # the keeper is gone already
            pass
        if not self._keeper_done.wait(budget_s):
            return [*self.forced, f"the keeper did not report the job stopped within "
                                  f"{budget_s:.0f} s (it goes on by itself)"]
        return list(self.forced)

    def _remove_probe(self) -> None:
        if self.probe_path:
            try:
                os.unlink(self.probe_path)
            except FileNotFoundError:
                pass
            self.probe_path = None
