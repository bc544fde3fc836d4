"""Cross-node transports and their selection (``HARMPI_TRANSPORT``).

``auto`` takes the TCP transport when every rank of the communicator can
connect to every other (compiled socket I/O that sleeps in poll(2) while it
waits), and the portable MPI transport when it cannot; its reason also says
why an RDMA verbs transport could not run (there is none in this build).
The reason for the choice is logged once and reported by
``harmpi.info()``. Asking for ``verbs`` is an error that says why, never a
silent fallback; ``mpi`` keeps MPI's own network path (UCX,
libfabric, ...), which beats TCP on fabrics MPI drives natively.
"""

from __future__ import annotations

import logging

from mpi4py import MPI

from ..errors import HarmpiTransportError
from ..topology import arrive
from .base import MAX_TAG, POISON_TAG, Pending, Transport
from .mpi import MpiTransport
from .tcp import TcpTransport

__all__ = ["Transport", "Pending", "MpiTransport", "TcpTransport", "select", "verbs_status",
           "POISON_TAG", "MAX_TAG"]

log = logging.getLogger(__name__)


def verbs_status():
    """(usable, reason): whether an RDMA verbs transport could run on this host."""
    try:
        from pyverbs import device as _device  # noqa: PLC0415 - optional dependency
    except ImportError as exc:
        return False, f"pyverbs is not importable ({exc})"
    try:
        devices = _device.get_device_list()
    except Exception as exc:  # pyverbs raises PyverbsRDMAError when no device exists  # noqa: BLE001
        return False, f"no RDMA device ({type(exc).__name__}: {exc})"
    if not devices:
        return False, "no RDMA device (pyverbs lists none)"
    names = ", ".join(d.name.decode() if isinstance(d.name, bytes) else str(d.name)
                      for d in devices)
    return False, (f"RDMA device(s) {names} found, but this build of harmpi has no verbs "
                   "transport yet")


def select(requested: str, comm, spin_count: int, timeout_s: float = 30.0):
    """Return ``(transport, reason)`` for ``requested`` in auto|tcp|mpi|verbs
    (collective over ``comm``; a rank that never comes is a timeout)."""
    arrive(comm, timeout_s, f"setting up the {requested} transport")
    if requested == "mpi":
        return MpiTransport(comm, spin_count), "HARMPI_TRANSPORT=mpi"
    if requested == "tcp":
        return TcpTransport(comm, spin_count, timeout_s), "HARMPI_TRANSPORT=tcp"
    usable, why = verbs_status()
    if requested == "verbs":
        if not usable:
            raise HarmpiTransportError(f"HARMPI_TRANSPORT=verbs cannot be used: {why}; "
                                       "set HARMPI_TRANSPORT=tcp, mpi or auto")
    transport, failure = None, None
    try:
        transport = TcpTransport(comm, spin_count, timeout_s)
    except HarmpiTransportError as exc:
        failure = exc
    # every rank must pick the same transport
    if comm.allreduce(0 if transport is None else 1, op=MPI.MIN) == 0:
        if transport is not None:
            transport.close()
        return MpiTransport(comm, spin_count), (
            f"auto: {why}; tcp set-up failed ({failure or 'on another rank'}); using mpi")
    return transport, (f"auto: {why}; using the tcp transport (HARMPI_TRANSPORT=mpi selects "
                       "MPI's own network path)")
