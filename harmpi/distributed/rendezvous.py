"""``init_method="mpi://"``: torch.distributed's rendezvous over MPI, for any
backend, registered with torch's public ``register_rendezvous_handler``.

torch's env:// rendezvous needs MASTER_ADDR and MASTER_PORT, which harmpi's
launcher (and torchrun) set; under plain mpirun, ``mpi://`` takes rank and
world size from MPI instead: rank 0 starts a TCPStore on a free port and
broadcasts its address, so gloo groups can be made beside harmpi ones in
the same job. A rank or world size given by the caller (or by
RANK/WORLD_SIZE) must match MPI's. Every MPI call here is non-blocking and
polled under the deadline (harmpi.distributed.waits).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from urllib.parse import parse_qs, urlparse

import numpy as np
import torch.distributed as dist
from mpi4py import MPI

from ..config import Config
from ..errors import HarmpiArgumentError, HarmpiTimeoutError
from .waits import group_timeout, wait_requests

__all__ = ["RENDEZVOUS", "install_rendezvous", "mpi_rendezvous"]

log = logging.getLogger("harmpi")

_WORLD = MPI.COMM_WORLD


def _query_int(query, name):
    values = parse_qs(query).get(name)
    return int(values[0]) if values else None


def mpi_rendezvous(url, timeout=datetime.timedelta(minutes=30), **kwargs):
    """``init_method="mpi://"``: rank and world size from MPI, a TCPStore on
    rank 0 at a free port broadcast over MPI (no MASTER_ADDR/MASTER_PORT)."""
    query = urlparse(url).query
    rank, size = _WORLD.Get_rank(), _WORLD.Get_size()
    for name, mine, env in (("rank", rank, "RANK"), ("world_size", size, "WORLD_SIZE")):
        given = _query_int(query, name)
        if given == -1:  # torch's "not given"
            given = None
        if given is None and os.environ.get(env):
            given = int(os.environ[env])
        if given is not None and given != mine:
            raise HarmpiArgumentError(
                f"init_process_group: {name}={given} but MPI says {mine}; under mpirun leave "
                f"{name} out (harmpi takes it from MPI) or pass MPI's")
    # every MPI call here is non-blocking and polled under the deadline: a
    # rank that never comes (it failed before init_process_group and its
    # failure did not end the job) is named instead of hanging the others
    timeout_s = group_timeout(timeout) or Config.from_env().timeout_s
    hosts = np.zeros((size, _NAME_BYTES), np.uint8)
    _rendezvous_wait(_WORLD.Iallgather(_name_bytes(socket.gethostname()), hosts), timeout_s,
                     "exchanging host names")
    where = np.zeros(_NAME_BYTES, np.uint8)
    if rank == 0:
        store = dist.TCPStore("0.0.0.0", 0, size, True, timeout=timeout,
                              wait_for_workers=False)
        addr = "127.0.0.1" if len({row.tobytes() for row in hosts}) == 1 else _host_address()
        where[:] = _name_bytes(f"{addr} {store.port}")
    _rendezvous_wait(_WORLD.Ibcast(where, root=0), timeout_s, "hearing the store's address")
    addr, port = where.tobytes().rstrip(b"\0").decode().split()
    where = (addr, int(port))
    if rank != 0:
        store = dist.TCPStore(addr, int(port), size, False, timeout=timeout)
    # every rank is connected before any goes on (a rank that fails right
    # after must not close the store under one still connecting)
    _rendezvous_wait(_WORLD.Ibarrier(), timeout_s, "waiting for every rank's store connection")
    log.debug("torch.distributed rendezvous over MPI: store at %s:%d", *where)
    yield (store, rank, size)
    raise RuntimeError("harmpi's MPI rendezvous cannot re-rendezvous")


#: bytes of a host name or an address in the rendezvous' fixed-size messages
_NAME_BYTES = 256


def _name_bytes(text):
    raw = text.encode()[:_NAME_BYTES]
    return np.frombuffer(raw.ljust(_NAME_BYTES, b"\0"), np.uint8).copy()


def _rendezvous_wait(req, timeout_s, step):
    def late(_pending):
        raise HarmpiTimeoutError(
            f"rank {_WORLD.Get_rank()}: init_process_group's rendezvous over MPI ({step}): "
            f"the other ranks did not arrive within {timeout_s:g} s (a rank failed or hangs "
            "before init_process_group; HARMPI_TIMEOUT_S or timeout= sets the deadline)")

    wait_requests([req], timeout_s, late)


def _host_address():
    from ..transports.tcp import local_ipv4_addresses  # noqa: PLC0415

    addrs = local_ipv4_addresses()
    return addrs[0] if addrs else socket.gethostname()


#: the URL scheme of the MPI rendezvous: ``init_process_group(..., init_method="mpi://")``
RENDEZVOUS = "mpi"


def install_rendezvous():
    """``mpi://`` with torch's public registry (once: torch refuses a scheme twice)."""
    from torch.distributed.rendezvous import register_rendezvous_handler  # noqa: PLC0415

    try:
        register_rendezvous_handler(RENDEZVOUS, mpi_rendezvous)
    except RuntimeError:  # registered already (this module imported twice, under two names)
        log.debug("rendezvous scheme %s:// is registered already", RENDEZVOUS)
