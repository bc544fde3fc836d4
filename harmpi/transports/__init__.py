"""Cross-node transports and their selection (``HARMPI_TRANSPORT``).

``auto`` takes the RDMA verbs transport when pyverbs imports and every rank
of the communicator has a usable ACTIVE port (agreed by an allreduce, so
every rank picks the same); otherwise the TCP transport when every rank can
connect to every other (compiled socket I/O that sleeps in poll(2) while it
waits), and the portable MPI transport when it cannot. The reason for the
choice, verbs' included either way, is logged once per process
(:func:`announce`) and reported by ``harmpi.info()``. Asking for ``verbs``
where it cannot run fails on every rank at set-up, saying what each rank
looked for and found - never a silent fallback; ``mpi`` keeps MPI's own
network path (UCX, libfabric, ...), which beats TCP on fabrics MPI drives
natively.
"""

from __future__ import annotations

import functools
import logging

from mpi4py import MPI

from ..base.topology import arrive, gather_records, vote, world_ranks
from ..errors import HarmpiTransportError
from .base import MAX_TAG, POISON_TAG, Pending, Transport
from .mpi import MpiTransport
from .tcp import TcpTransport
from .verbs import VerbsTransport

#: the longest reason a rank sends when verbs is not usable there (bytes)
_VERDICT_NBYTES = 900

__all__ = ["Transport", "Pending", "MpiTransport", "TcpTransport", "VerbsTransport", "select",
           "announce", "verbs_status", "verbs_probe", "POISON_TAG", "MAX_TAG"]

log = logging.getLogger(__name__)


def announce(name: str, reason: str, rank: int) -> None:
    """Log ``cross-node transport: NAME (REASON)`` once per process: at INFO
    on the communicator's rank 0, DEBUG elsewhere. Every communicator picks
    its transport (each ``new_group``), nearly always for the same reason; a
    different choice or reason is logged once too."""
    _log_once(f"cross-node transport: {name} ({reason})",
              logging.INFO if rank == 0 else logging.DEBUG)


@functools.cache  # the cache is the record of what this process has logged
def _log_once(message: str, level: int) -> None:
    log.log(level, message)


def _local_settings(config, local_rank):
    """(device, port, gid index) this local rank asks for (None: any)."""
    from . import verbs_proto  # noqa: PLC0415

    pick = verbs_proto.pick_for_local_rank
    if config is None:
        return None, None, None
    return (pick(config.ib_devices, local_rank), pick(config.ib_ports, local_rank),
            pick(config.ib_gid_indexes, local_rank))


def verbs_probe(config=None, local_rank=0):
    """(PortChoice or None, reason): the port an RDMA verbs transport would
    use on this rank (HARMPI_IB_* settings in ``config``), or why none."""
    try:
        import pyverbs  # noqa: F401, PLC0415 - optional dependency

        from . import verbs_nic  # noqa: PLC0415 - imports pyverbs lazily
    except ImportError as exc:
        return None, f"pyverbs is not importable ({exc})"
    device, port, gid_index = _local_settings(config, local_rank)
    choice, wanted, found = verbs_nic.probe(device, port, gid_index)
    if choice is None:
        return None, f"looked for {wanted}; found {found}"
    return choice, f"{choice.describe()} is ACTIVE"


def verbs_status(config=None, local_rank=0):
    """(usable, reason): whether an RDMA verbs transport could run on this rank."""
    choice, why = verbs_probe(config, local_rank)
    return choice is not None, why


def _open_verbs(choice, comm, spin_count, timeout_s):
    """The verbs transport over the real NIC (tests replace this function
    to drive the transport over a stand-in NIC)."""
    from .verbs_nic import PyverbsNic  # noqa: PLC0415

    return VerbsTransport(comm, spin_count, timeout_s, PyverbsNic(choice))


def _verbs_everywhere(comm, config, local_rank, timeout_s):
    """(PortChoice or None, reason), the same verdict on every rank: usable
    only if usable on every rank of ``comm``. One polled gather of every
    rank's verdict (topology.gather_records), never a blocking collective:
    two threads setting up contexts over two communicators at once, across
    nodes, hung for minutes with one thread in a blocking MPI_Allreduce here
    and the other polling on its own communicator (2 virtual nodes x 2)."""
    choice, why = verbs_probe(config, local_rank)
    rank = comm.Get_rank()
    said = "yes" if choice is not None else "no: " + " ".join(why.split())
    said = said.encode()[:_VERDICT_NBYTES].decode(errors="ignore")
    _, texts = gather_records(comm, timeout_s, "checking for RDMA verbs on every rank",
                              (("verbs", said),))
    verdicts = [t.partition("=")[2] for t in texts]
    if all(v == "yes" for v in verdicts):
        return choice, f"verbs: every rank has an ACTIVE port (this rank: {why})"
    try:  # errors name the ranks users know
        names = world_ranks(comm)
    except MPI.Exception:
        names = list(range(len(verdicts)))
    bad = [f"rank {names[r]}: {v[4:]}" for r, v in enumerate(verdicts) if v != "yes"]
    mine = "" if choice is None else f" (this rank {names[rank]}: {why})"
    return None, f"verbs not usable on every rank: {'; '.join(bad)}{mine}"


def _select_verbs(requested, comm, spin_count, timeout_s, config, local_rank):
    """(transport or None, reason) of the verbs transport; forced: raises."""
    choice, why = _verbs_everywhere(comm, config, local_rank, timeout_s)
    if choice is None:
        if requested == "verbs":
            raise HarmpiTransportError(f"HARMPI_TRANSPORT=verbs cannot be used: {why}; "
                                       "set HARMPI_TRANSPORT=tcp, mpi or auto")
        return None, why
    try:
        return _open_verbs(choice, comm, spin_count, timeout_s), why
    except HarmpiTransportError as exc:  # raised on every rank (a collective verdict)
        if requested == "verbs":
            raise HarmpiTransportError(f"HARMPI_TRANSPORT=verbs: {exc}") from None
        return None, f"{why}, but {exc}"


def select(requested: str, comm, spin_count: int, timeout_s: float = 30.0, config=None,
           local_rank: int = 0):
    """Return ``(transport, reason)`` for ``requested`` in auto|tcp|mpi|verbs
    (collective over ``comm``; a rank that never comes is a timeout).
    ``config`` holds the HARMPI_IB_* settings (None: defaults); a per-local-rank
    list gives this rank entry ``local_rank`` % len."""
    arrive(comm, timeout_s, f"setting up the {requested} transport")
    if requested == "mpi":
        return MpiTransport(comm, spin_count, timeout_s), "HARMPI_TRANSPORT=mpi"
    if requested == "tcp":
        return TcpTransport(comm, spin_count, timeout_s), "HARMPI_TRANSPORT=tcp"
    transport, why = _select_verbs(requested, comm, spin_count, timeout_s, config, local_rank)
    if transport is not None:
        return transport, (f"HARMPI_TRANSPORT=verbs: {why}" if requested == "verbs"
                           else f"auto: {why}; using the verbs transport")
    transport, failure = None, None
    try:
        transport = TcpTransport(comm, spin_count, timeout_s)
    except (HarmpiTransportError, OSError) as exc:
        failure = exc
    # every rank must pick the same transport: a polled vote (a rank that
    # does not come is a timeout on every rank, not a hang)
    ok, vote_why = vote(comm, timeout_s, "choosing the cross-node transport",
                        transport is not None)
    if not ok:
        if transport is not None:
            transport.close()
        if "did not arrive" in vote_why:
            raise HarmpiTransportError(vote_why)
        return MpiTransport(comm, spin_count, timeout_s), (
            f"auto: {why}; tcp set-up failed ({failure or 'on another rank'}); using mpi")
    return transport, (f"auto: {why}; using the tcp transport (HARMPI_TRANSPORT=mpi selects "
                       "MPI's own network path)")
