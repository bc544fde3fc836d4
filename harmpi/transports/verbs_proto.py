"""The verbs rail's protocol, without pyverbs: wire records, layout, chunks,
immediates, port choice and completion errors.

Everything here is plain Python and numpy, so it is tested on machines
without an RDMA device (harmpi.transports.verbs drives it over an adapter,
harmpi.transports.verbs_nic is the adapter that calls pyverbs).

Wire records
    :class:`ConnInfo` is what a rank tells one rail peer at set-up (one
    fixed-size little-endian record per peer, exchanged with MPI_Alltoall):
    the queue pair number and first PSN of the QP it made for that peer, its
    port's LID, GID and active MTU, the address and rkey of the landing ring
    the peer writes into, and of the credit word the peer reads.

Immediate (32 bits, carried by every RDMA WRITE WITH IMMEDIATE)::

    bits  0..15  tag: the collective's rail tag (harmpi.base.kind.rail_tag, the
                 digest every rail carries), or POISON_TAG / ABANDON_TAG
    bit  16      LAST: this chunk ends the message
    bits 17..31  the chunk's sequence number on this QP, modulo 2**15

Registration layout (one memory region per transport, sections 4 KiB
aligned; P = number of peers, S = slots per peer, C = chunk bytes)::

    credit   P x 64 B   word 0 of line p: chunks peer p has consumed from
                        this rank (written by peer p with an RDMA WRITE)
    consumed P x 64 B   word 0 of line p: chunks this rank has consumed from
                        peer p (the source of that RDMA WRITE)
    landing  P x S x C  ring written by peer p: chunk k lands in slot k % S
    staging  P x S x C  this rank's outgoing chunk k to peer p, slot k % S

Flow control: a sender writes chunk k to peer p only while
k - credit[p] < S, so a landing slot is never overwritten before the
receiver has copied it out; the receiver returns credit (its consumed
counter, one 8-byte RDMA WRITE) after each copy.
"""

from __future__ import annotations

import dataclasses
import struct

from ..base.kind import ABANDON_TAG, MAX_TAG, POISON_TAG
from ..errors import HarmpiTransportError

__all__ = ["ConnInfo", "Layout", "PortInfo", "DeviceInfo", "PortChoice", "choose_port",
           "chunk_sizes", "encode_imm", "decode_imm", "completion_error", "WC_STATUS",
           "WC_OPCODE", "QP_TIMEOUT", "QP_RETRY_CNT", "QP_RNR_RETRY", "QP_MIN_RNR_TIMER",
           "TAG_BITS", "SEQ_MOD", "pick_for_local_rank", "GID_TYPE_ROCE_V2"]

# -- queue pair timing, applied INIT -> RTR -> RTS (harmpi.transports.verbs_nic)
#: local ACK timeout, 4.096 us * 2**14 = 67 ms before a send is retried
QP_TIMEOUT = 14
#: transport retries before the send fails with RETRY_EXC_ERR: a peer whose
#: QP is gone (it exited or crashed) is reported after ~7 x 67 ms = 0.5 s
QP_RETRY_CNT = 7
#: receiver-not-ready retries (7 would mean "forever"). The protocol keeps
#: more receives posted than chunks can be in flight, so an RNR NAK means a
#: peer stopped servicing its queue; 6 retries of the timer below turn it
#: into RNR_RETRY_EXC_ERR within ~4 ms instead of a silent stall
QP_RNR_RETRY = 6
#: RNR NAK timer code 12 = 0.64 ms between receiver-not-ready retries
QP_MIN_RNR_TIMER = 12

TAG_BITS = 16
_TAG_MASK = (1 << TAG_BITS) - 1
_LAST = 1 << TAG_BITS
SEQ_MOD = 1 << 15
assert ABANDON_TAG <= _TAG_MASK and POISON_TAG <= _TAG_MASK and MAX_TAG < POISON_TAG

#: ibv_gid_type_sysfs value of a RoCE v2 GID
GID_TYPE_ROCE_V2 = 1
#: ibv_port_state IBV_PORT_ACTIVE; ibv link layers
PORT_ACTIVE = 4
LINK_LAYER_INFINIBAND, LINK_LAYER_ETHERNET = 1, 2
_PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
_LINK_LAYERS = {0: "unspecified", 1: "InfiniBand", 2: "Ethernet"}

#: ibv_wc_status: name and what it means for this rail
WC_STATUS = {
    0: ("SUCCESS", "success"),
    1: ("LOC_LEN_ERR", "a local length error (the work request exceeds the registration)"),
    2: ("LOC_QP_OP_ERR", "the local queue pair rejected the work request"),
    3: ("LOC_EEC_OP_ERR", "local EE context error"),
    4: ("LOC_PROT_ERR", "the local buffer is not inside the registered memory region"),
    5: ("WR_FLUSH_ERR", "flushed: the queue pair had already failed (an earlier error, or the "
                        "transport was closed)"),
    6: ("MW_BIND_ERR", "memory window bind error"),
    7: ("BAD_RESP_ERR", "the peer answered with an unexpected transport opcode"),
    8: ("LOC_ACCESS_ERR", "local access error"),
    9: ("REM_INV_REQ_ERR", "the peer found the request invalid (message too long for it?)"),
    10: ("REM_ACCESS_ERR", "the peer refused the write (address or rkey not registered there: "
                           "it closed or re-registered its memory)"),
    11: ("REM_OP_ERR", "the peer could not complete the operation"),
    12: ("RETRY_EXC_ERR", "no acknowledgement after every retry: the peer's queue pair is gone "
                          "(it exited or crashed) or the path is down"),
    13: ("RNR_RETRY_EXC_ERR", "the peer had no receive posted after every retry: it stopped "
                              "servicing its queue"),
    14: ("LOC_RDD_VIOL_ERR", "local RDD violation"),
    15: ("REM_INV_RD_REQ_ERR", "remote invalid RD request"),
    16: ("REM_ABORT_ERR", "the peer aborted the operation"),
    17: ("INV_EECN_ERR", "invalid EE context number"),
    18: ("INV_EEC_STATE_ERR", "invalid EE context state"),
    19: ("FATAL_ERR", "fatal device error"),
    20: ("RESP_TIMEOUT_ERR", "response timeout"),
    21: ("GENERAL_ERR", "general device error"),
}
#: ibv_wc_opcode names
WC_OPCODE = {0: "SEND", 1: "RDMA_WRITE", 2: "RDMA_READ", 3: "COMP_SWAP", 4: "FETCH_ADD",
             5: "BIND_MW", 6: "LOCAL_INV", 128: "RECV", 129: "RECV_RDMA_WITH_IMM"}
WC_SUCCESS = 0
WC_RDMA_WRITE = 1
WC_RECV_RDMA_WITH_IMM = 129


def encode_imm(tag, last, seq):
    """The 32-bit immediate of a chunk (see the module docstring)."""
    if not 0 <= tag <= _TAG_MASK:
        raise ValueError(f"tag {tag} does not fit {TAG_BITS} bits")
    return tag | (_LAST if last else 0) | ((seq % SEQ_MOD) << (TAG_BITS + 1))


def decode_imm(imm):
    """(tag, last, seq mod 2**15) of an immediate."""
    imm &= 0xFFFFFFFF
    return imm & _TAG_MASK, bool(imm & _LAST), imm >> (TAG_BITS + 1)


def chunk_sizes(nbytes, chunk_nbytes):
    """Chunk lengths of a message of ``nbytes``: full chunks, then the rest;
    a message that fills its last chunk exactly ends there (the LAST bit
    marks the end, not a short chunk); an empty message is one empty chunk."""
    if nbytes < 0 or chunk_nbytes <= 0:
        raise ValueError(f"nbytes={nbytes}, chunk_nbytes={chunk_nbytes}")
    if nbytes == 0:
        return [0]
    full, rest = divmod(nbytes, chunk_nbytes)
    return [chunk_nbytes] * full + ([rest] if rest else [])


# -- connection information ---------------------------------------------------

_CONN = struct.Struct("<IHBBIIH2x16sQIIQIIQ")
_MAGIC = 0x76726268  # "hbrv"
_VERSION = 1


@dataclasses.dataclass(frozen=True)
class ConnInfo:
    """What a rank tells one rail peer about the QP it made for that peer."""

    qpn: int
    psn: int
    lid: int
    gid: bytes          # 16 bytes; all zero on InfiniBand without a GRH
    mtu: int            # ibv_mtu enum (1: 256 ... 5: 4096)
    land_addr: int      # landing ring this peer writes into
    land_rkey: int
    credit_addr: int    # credit word this peer writes its consumed count into
    credit_rkey: int
    nslots: int
    chunk_nbytes: int
    port: int = 1

    NBYTES = _CONN.size

    def encode(self) -> bytes:
        if len(self.gid) != 16:
            raise ValueError("a GID is 16 bytes")
        return _CONN.pack(_MAGIC, _VERSION, self.port, self.mtu, self.qpn, self.psn & 0xFFFFFF,
                          self.lid, self.gid, self.land_addr, self.land_rkey, self.nslots,
                          self.credit_addr, self.credit_rkey, 0, self.chunk_nbytes)

    @classmethod
    def decode(cls, raw) -> "ConnInfo":
        raw = bytes(raw)
        if len(raw) != _CONN.size:
            raise HarmpiTransportError(f"verbs set-up: a connection record of {len(raw)} bytes "
                                       f"(expected {_CONN.size})")
        (magic, version, port, mtu, qpn, psn, lid, gid, land_addr, land_rkey, nslots,
         credit_addr, credit_rkey, _pad, chunk) = _CONN.unpack(raw)
        if magic != _MAGIC or version != _VERSION:
            raise HarmpiTransportError(
                f"verbs set-up: a peer sent a connection record of another format (magic "
                f"{magic:#x}, version {version}); every rank must run the same harmpi")
        return cls(qpn=qpn, psn=psn, lid=lid, gid=gid, mtu=mtu, land_addr=land_addr,
                   land_rkey=land_rkey, credit_addr=credit_addr, credit_rkey=credit_rkey,
                   nslots=nslots, chunk_nbytes=chunk, port=port)


# -- registration layout ------------------------------------------------------

_ALIGN = 4096
_LINE = 64


def _up(n, a=_ALIGN):
    return (n + a - 1) // a * a


@dataclasses.dataclass(frozen=True)
class Layout:
    """Byte offsets inside the one registered region (module docstring)."""

    npeers: int
    nslots: int
    chunk_nbytes: int

    def __post_init__(self):
        if self.npeers < 0 or self.nslots < 1 or self.chunk_nbytes < 1:
            raise ValueError(f"bad layout {self}")
        if self.chunk_nbytes % _LINE:
            raise ValueError(f"chunk_nbytes {self.chunk_nbytes} must be a multiple of {_LINE}")

    @property
    def credit_off(self):
        return 0

    @property
    def consumed_off(self):
        return _up(self.npeers * _LINE)

    @property
    def landing_off(self):
        return self.consumed_off + _up(self.npeers * _LINE)

    @property
    def ring_nbytes(self):
        return self.nslots * self.chunk_nbytes

    @property
    def staging_off(self):
        return self.landing_off + _up(self.npeers * self.ring_nbytes)

    @property
    def nbytes(self):
        return max(_ALIGN, self.staging_off + _up(self.npeers * self.ring_nbytes))

    def credit(self, p):
        return self.credit_off + p * _LINE

    def consumed(self, p):
        return self.consumed_off + p * _LINE

    def landing(self, p, seq=0):
        return self.landing_off + p * self.ring_nbytes + (seq % self.nslots) * self.chunk_nbytes

    def staging(self, p, seq=0):
        return self.staging_off + p * self.ring_nbytes + (seq % self.nslots) * self.chunk_nbytes


# -- device and port choice ---------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PortInfo:
    """One port as the device reports it. ``gids``: (index, 16-byte GID, type)."""

    num: int
    state: int
    link_layer: int
    lid: int
    mtu: int
    gids: tuple = ()

    def describe(self):
        return (f"port {self.num} {_PORT_STATES.get(self.state, self.state)}, "
                f"{_LINK_LAYERS.get(self.link_layer, self.link_layer)}")


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    name: str
    ports: tuple


@dataclasses.dataclass(frozen=True)
class PortChoice:
    """The device, port and GID index this rank uses."""

    device: str
    port: int
    gid_index: int      # -1: no GRH (InfiniBand addressed by LID)
    gid: bytes
    lid: int
    mtu: int
    link_layer: int

    def describe(self):
        where = f"{self.device} port {self.port}"
        return where if self.gid_index < 0 else f"{where} GID index {self.gid_index}"


def pick_for_local_rank(values, local_rank):
    """An entry of a per-local-rank list (``a,b``: local rank l takes entry
    l % len), or None for an empty list."""
    if not values:
        return None
    return values[local_rank % len(values)]


def _gid_nonzero(gid):
    return any(gid)


def _choose_gid(port, gid_index):
    """(index, gid) for ``port``: the one asked for, else on Ethernet a RoCE
    v2 GID (an IPv4-mapped one first), else on InfiniBand none (LID)."""
    if gid_index is not None:
        for idx, gid, _typ in port.gids:
            if idx == gid_index and _gid_nonzero(gid):
                return idx, gid
        return None
    if port.link_layer != LINK_LAYER_ETHERNET:
        return -1, bytes(16)
    v2 = [(idx, gid) for idx, gid, typ in port.gids
          if typ == GID_TYPE_ROCE_V2 and _gid_nonzero(gid)]
    v4 = [(idx, gid) for idx, gid in v2 if gid[:12] == bytes(10) + b"\xff\xff"]
    return (v4 or v2 or [None])[0]


def choose_port(devices, device=None, port=None, gid_index=None):
    """(PortChoice or None, what was looked for, what was found).

    Looks at ``device`` (else every device in order), ``port`` (else every
    port) and takes the first ACTIVE port with a usable GID (``gid_index``,
    else a RoCE v2 GID on Ethernet, else the LID on InfiniBand)."""
    wanted = (f"device {device or 'any'}, port {port or 'first ACTIVE'}, GID index "
              f"{'RoCE v2 on Ethernet' if gid_index is None else gid_index}")
    seen = []
    for dev in devices:
        if device is not None and dev.name != device:
            continue
        for p in dev.ports:
            if port is not None and p.num != port:
                continue
            seen.append(f"{dev.name} {p.describe()}")
            if p.state != PORT_ACTIVE:
                continue
            g = _choose_gid(p, gid_index)
            if g is None:
                seen[-1] += (f", no GID at index {gid_index}" if gid_index is not None
                             else ", no RoCE v2 GID")
                continue
            return (PortChoice(dev.name, p.num, g[0], g[1], p.lid, p.mtu, p.link_layer),
                    wanted, "; ".join(seen))
    if not seen:
        names = ", ".join(d.name for d in devices) or "none"
        seen.append(f"devices: {names}")
    return None, wanted, "; ".join(seen)


# -- completions --------------------------------------------------------------

def completion_error(me, what, peer, opcode, status, vendor_err=0):
    """The HarmpiTransportError for a completion with status other than
    success. ``opcode``: a name, or an ibv_wc_opcode number (an error
    completion's own opcode field is undefined, so the transport names the
    operation from its work request id)."""
    name, meaning = WC_STATUS.get(status, (f"status {status}", "unknown status"))
    op = opcode if isinstance(opcode, str) else WC_OPCODE.get(opcode, f"opcode {opcode}")
    return HarmpiTransportError(
        f"rank {me}: {what}: verbs {op} with rank {peer} completed with {name} ({status}, "
        f"vendor error {vendor_err:#x}): {meaning}", culprit=peer)
