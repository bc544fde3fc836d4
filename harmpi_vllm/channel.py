"""The channel between :class:`harmpi_vllm.executor.MpiExecutor` (vLLM's
engine process) and each of its MPI ranks (harmpi_vllm.worker).

One TCP connection per rank, opened by the rank to the address the executor
exports in ``HARMPI_VLLM_ENGINE``, and authenticated both ways by
``multiprocessing.connection``'s HMAC challenge with the job's random key
(``HARMPI_VLLM_AUTHKEY``, hex; mpirun forwards both to every rank: on a
shared host, other users cannot read a process's environment). What goes
over it, in order:

======  =========================  ============================================
from    message                    when
======  =========================  ============================================
rank    :class:`Hello`             at once: who and where the rank is
engine  :class:`Env`               the engine's VLLM_* settings (before the
                                   rank imports vLLM)
engine  the worker's arguments     vLLM config, the scheduler queue's handle
rank    :class:`Ready`/`Failed`    after vLLM's worker loaded the model
rank    :class:`Bye`               when the rank leaves on purpose
======  =========================  ============================================

After that the channel carries nothing: vLLM's own message queues carry the
work. It stays open as each side's sign of life. A rank whose connection
ends without a :class:`Bye` died (the executor names it); a rank whose
connection ends was told to stop (the executor closes it at shutdown, or
its process ended).

The shared-memory probe: the executor writes :attr:`Hello.probe`'s token
into a /dev/shm file named in ``HARMPI_VLLM_PROBE``; a rank that reads it
back shares the engine's /dev/shm and reads vLLM's queues from shared
memory, any other rank over TCP. Nothing here imports vLLM or harmpi.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from multiprocessing.connection import Client

__all__ = ["ENGINE_ENV", "AUTHKEY_ENV", "PROBE_ENV", "Hello", "Env", "Ready", "Failed", "Bye",
           "connect", "local_ip", "read_probe", "SHM_DIR"]

#: host:port of the executor's listener
ENGINE_ENV = "HARMPI_VLLM_ENGINE"
#: the job's key, hex
AUTHKEY_ENV = "HARMPI_VLLM_AUTHKEY"
#: name of the /dev/shm file holding the probe token
PROBE_ENV = "HARMPI_VLLM_PROBE"
SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class Hello:
    rank: int
    world_size: int
    local_rank: int
    pid: int
    host: str
    probe: bytes | None  # what the rank read from the probe file (None: not there)


@dataclass(frozen=True)
class Env:
    variables: dict  # set on the rank where it has none of its own


@dataclass(frozen=True)
class Ready:
    handle: object  # vLLM's shm_broadcast.Handle of the rank's response queue


@dataclass(frozen=True)
class Failed:
    text: str


@dataclass(frozen=True)
class Bye:
    reason: str


def connect(environ, timeout_s: float = 60.0):
    """This rank's connection to the executor (retried until ``timeout_s``:
    the listener exists before mpirun starts, so a refusal is a network one)."""
    host, _, port = environ[ENGINE_ENV].rpartition(":")
    key = bytes.fromhex(environ[AUTHKEY_ENV])
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client((host.strip("[]"), int(port)), family="AF_INET6" if ":" in host
                          else "AF_INET", authkey=key)
        except (ConnectionError, socket.timeout) as exc:
            if time.monotonic() > deadline:
                raise ConnectionError(f"cannot reach vLLM's engine at {environ[ENGINE_ENV]} "
                                      f"({ENGINE_ENV}) for {timeout_s:.0f} s: {exc}") from None
            time.sleep(0.2)


def local_ip(conn) -> str:
    """This end's address of ``conn`` (a :func:`connect` connection): the
    address by which this host reaches the engine, so the one the engine can
    reach it by (VLLM_HOST_IP, where the job's environment carries the head
    host's, would name another host)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        return sock.getsockname()[0]


def read_probe(environ) -> bytes | None:
    """The probe token, if this process sees the engine's /dev/shm."""
    name = environ.get(PROBE_ENV, "")
    if not name or "/" in name:
        return None
    try:
        with open(os.path.join(SHM_DIR, name), "rb") as f:
            return f.read(64)
    except OSError:
        return None
