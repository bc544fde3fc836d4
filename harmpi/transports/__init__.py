"""Cross-node transports and their selection (``HARMPI_TRANSPORT``).

``auto`` takes the RDMA verbs transport when pyverbs imports and an RDMA
device is present, and the portable MPI transport otherwise; the reason for
the choice is logged once and reported by ``harmpi.info()``. Asking for
``verbs`` where it cannot run is an error, never a silent fallback.
"""

from __future__ import annotations

import logging

from ..errors import HarmpiTransportError
from .base import MAX_TAG, POISON_TAG, Pending, Transport, tag_for
from .mpi import MpiTransport

__all__ = ["Transport", "Pending", "MpiTransport", "select", "verbs_status",
           "tag_for", "POISON_TAG", "MAX_TAG"]

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
    names = ", ".join(d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices)
    return False, (f"RDMA device(s) {names} found, but this build of harmpi has no verbs "
                   "transport yet")


def select(requested: str, comm, spin_count: int):
    """Return ``(transport, reason)`` for ``requested`` in auto|mpi|verbs."""
    if requested == "mpi":
        return MpiTransport(comm, spin_count), "HARMPI_TRANSPORT=mpi"
    usable, why = verbs_status()
    if requested == "verbs":
        if not usable:
            raise HarmpiTransportError(f"HARMPI_TRANSPORT=verbs cannot be used: {why}; "
                                       "set HARMPI_TRANSPORT=mpi or auto")
    reason = f"auto: {why}; using the mpi transport"
    return MpiTransport(comm, spin_count), reason
