"""RDMA verbs transport: one RC queue pair per rail peer, RDMA WRITE WITH
IMMEDIATE into a registered landing ring, credits back by RDMA WRITE.

Layers: :mod:`harmpi.transports.verbs_proto` (wire records, layout, chunks,
immediates, port choice, completion errors: plain Python), this module (the
rail protocol over a *NIC adapter*), and :mod:`harmpi.transports.verbs_nic`
(the adapter that calls pyverbs). The adapter is the only code that touches
pyverbs; tests drive this module over a stand-in with the same methods::

    nic.port                          PortChoice (device, port, GID, LID, MTU)
    nic.register(nbytes)              region: .buf (uint8 array), .addr, .lkey, .rkey
    nic.create_qp(send_depth, recv_depth)   -> qp with .qpn
    nic.connect(qp, psn, remote)      INIT -> RTR -> RTS toward ConnInfo ``remote``
    nic.post_recv(qp, wr_id)          a receive without scatter list
    nic.post_write(qp, wr_id, region, offset, nbytes, remote_addr, rkey, imm)
                                      RDMA WRITE (imm None) or WRITE WITH IMM, signaled
    nic.poll(max_n)                   [(wr_id, status, opcode, byte_len, imm, vendor_err)]
    nic.close()

Resources, made once per transport: one protection domain, one completion
queue, one RC queue pair per peer, one registered region (layout in
verbs_proto): credit words, landing rings, staging rings.

Set-up (collective over ``comm``, bounded by the deadline): every rank makes
its QPs and region, sends each peer a ConnInfo record (MPI_Alltoall), moves
each QP INIT -> RTR -> RTS toward the peer's record (timeout, retry and RNR
values: verbs_proto.QP_*), pre-posts its receives, and agrees with every
rank that all of this worked (an allreduce) before anyone writes.

Messages (post/complete, the Transport interface): a message of n bytes is
cut into chunks of at most ``chunk_nbytes`` (verbs_proto.chunk_sizes). Chunk
k to peer p is copied into staging slot k % S, then written to the peer's
landing slot k % S with the immediate (tag, LAST, k mod 2**15), once the
peer's credit word says it has consumed chunk k - S. The receiver takes
chunks from its completion queue in order, copies each into the caller's
receive buffer (what does not fit is counted but dropped, so the caller's
recv_check sees a larger peer's count and poisons the step on every rank
instead of this rank raising alone), then returns credit.

Why copies, not zero-copy: an RDMA WRITE needs its target address before the
receiver has said which buffer it will receive into, and the transport
interface names receive buffers only at post time; the buffer the node step
reads (the context's rail receive buffer) is allocated by the context, not
the transport. So a chunk lands in the transport's registered ring and is
copied out (and a send is staged into registered memory). Measured here
(ctypes.memmove between numpy buffers, 2-vCPU x86 VM, best of 5): 0.54 us
at 10 KB, 26-34 us at 1 MB per copy, so two copies per exchange; the Python
around one exchange (below) costs far more than the 10 KB copies. Reading
the peer's chunk where it landed (:meth:`VerbsTransport.landing_view`) and
returning its credit only after the node sum would remove the receive
copy; the algorithms do not ask for that yet.

Completion polling runs in Python: pyverbs keeps its ibv_cq pointer in a
Cython attribute that Python cannot read, so numba cannot call ibv_poll_cq
on it, and each poll is a pyverbs call (CQ.poll: one ibv_poll_cq plus a WC
object per completion; not measured here, where no device exists). Over
the tests' stand-in NIC (whose empty poll costs 0.26 us) a 10 KB exchange
between two processes took 42 us and a 1 MB one 365 us, against 40 us and
477 us for the MPI transport in the same run (2-vCPU VM under a load
average of ~5: read them as an upper bound of the Python protocol's cost,
which does not depend on the NIC). Waiting spins
``spin_count`` polls, then yields the core on every further poll
(sched_yield, wait spin, and for ``yield_ns`` under the other policies) or
naps between polls, 10 us doubling to 1 ms (wait auto and sleep), until
``timeout_s``. Not a completion channel:
pyverbs (44) gives a CompChannel no file descriptor to poll with a timeout,
only a ``get_cq_event`` that blocks without one, which would hold a rank
past its deadline and past Ctrl-C. Errors: a completion with any status
other than success raises HarmpiTransportError naming the peer, operation
and status (verbs_proto.completion_error); a wait past the deadline raises
HarmpiTimeoutError naming the peers still outstanding; a peer that gave up
(:meth:`VerbsTransport.give_up`: a zero-byte write with ABANDON_TAG) makes a
receive from it raise HarmpiTimeoutError.
"""

from __future__ import annotations

import collections
import ctypes
import random
import time

import numpy as np
from mpi4py import MPI

from ..base.kind import ABANDON_TAG
from ..base.topology import allgather_polled, arrive, world_ranks
from ..errors import HarmpiTimeoutError, HarmpiTransportError
from . import verbs_proto as proto
from .base import NAP_FIRST_S, Pending, Transport, idle, timeout_error

__all__ = ["VerbsTransport", "CHUNK_NBYTES", "NSLOTS"]

#: bytes per RDMA write; a message above it is chunked
CHUNK_NBYTES = 256 << 10
#: landing slots per peer (chunks in flight before the sender waits for credit)
NSLOTS = 4
#: completions taken per poll call
_POLL_BATCH = 16

# work request kinds, in the high half of a wr_id (the low half is the peer)
_WR_DATA, _WR_CREDIT, _WR_RECV, _WR_ABANDON = 1, 2, 3, 4
_WR_NAMES = {_WR_DATA: "RDMA_WRITE_WITH_IMM", _WR_CREDIT: "RDMA_WRITE (credit)",
             _WR_RECV: "RECV_RDMA_WITH_IMM", _WR_ABANDON: "RDMA_WRITE_WITH_IMM (give-up notice)"}


_WC_FLUSH = 5   # WR_FLUSH_ERR


def _wr_id(kind, peer):
    return (kind << 32) | peer


def _addr_of(buf):
    a = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
    return a.ctypes.data, a.nbytes


class _Send:
    __slots__ = ("peer", "buf", "addr", "sizes", "tag", "next", "off", "last_seq")

    def __init__(self, peer, buf, tag, chunk):
        self.buf = buf         # kept alive until its last chunk is staged
        self.addr, nbytes = _addr_of(buf)
        self.peer, self.tag = peer, tag
        self.sizes = proto.chunk_sizes(nbytes, chunk)
        self.next = 0          # chunks posted so far
        self.off = 0           # bytes posted so far
        self.last_seq = -1     # sequence number of the last chunk, once posted


class _Recv:
    __slots__ = ("peer", "buf", "addr", "cap", "got", "tag", "done")

    def __init__(self, peer, buf):
        self.buf = buf
        self.addr, self.cap = _addr_of(buf)
        self.peer = peer
        self.got, self.tag, self.done = 0, None, False


class _VerbsPending(Pending):
    __slots__ = ("sends", "recvs")

    def __init__(self, sends, recvs):
        self.sends, self.recvs = sends, recvs


class _Peer:
    """Per-peer protocol state (p: the peer's rank in ``comm``)."""

    __slots__ = ("rank", "qp", "remote", "tx_seq", "tx_done", "tx_queue", "rx_seq",
                 "rx_consumed", "rx_arrived", "rx_queue", "credit_dirty", "credits_out",
                 "abandoned", "error")

    def __init__(self, rank, qp):
        self.rank, self.qp, self.remote = rank, qp, None
        self.tx_seq = 0          # chunks written to the peer
        self.tx_done = 0         # of those, completions reaped
        self.tx_queue = collections.deque()   # _Send, in posting order
        self.rx_seq = 0          # chunks that arrived from the peer
        self.rx_consumed = 0     # of those, copied out (the credit we return)
        self.rx_arrived = collections.deque()  # (nbytes, tag, last) not yet claimed
        self.rx_queue = collections.deque()   # _Recv, in posting order
        self.credit_dirty = False
        self.credits_out = 0     # credit writes not yet completed
        self.abandoned = False
        self.error = None        # a failed credit write: raised at the next use


class VerbsTransport(Transport):
    """The rail over RDMA verbs (module docstring); ``nic``: an opened adapter."""

    name = "verbs"

    def __init__(self, comm, spin_count, timeout_s, nic, nslots=NSLOTS,
                 chunk_nbytes=CHUNK_NBYTES):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.spin_count = spin_count
        self.nic = nic
        self.nslots, self.chunk = nslots, chunk_nbytes
        self.failed = None
        self._world = _world_ranks(comm)
        self.layout = proto.Layout(max(1, self.size), nslots, chunk_nbytes)
        self.send_depth = 2 * nslots + 4     # data + credit writes + a give-up notice
        self.recv_depth = nslots + 2         # chunks in flight + a give-up notice
        self.peers = {}
        self.region = None
        try:
            self._connect(timeout_s)
        except BaseException:
            self.close()
            raise

    # -- set-up -----------------------------------------------------------------

    def _local_setup(self):
        """Region and QPs; returns this rank's ConnInfo record per peer."""
        lay = self.layout
        self.region = self.nic.register(lay.nbytes)
        self.region.buf[: lay.landing_off] = 0
        self._base = self.region.addr
        port = self.nic.port
        out = [b""] * self.size
        for p in range(self.size):
            if p == self.rank:
                continue
            qp = self.nic.create_qp(self.send_depth, self.recv_depth)
            self.peers[p] = _Peer(p, qp)
            psn = random.getrandbits(24)
            self.peers[p].remote = psn  # our own PSN until the peer's record arrives
            out[p] = proto.ConnInfo(
                qpn=qp.qpn, psn=psn, lid=port.lid, gid=port.gid, mtu=port.mtu,
                land_addr=self._base + lay.landing(p), land_rkey=self.region.rkey,
                credit_addr=self._base + lay.credit(p), credit_rkey=self.region.rkey,
                nslots=self.nslots, chunk_nbytes=self.chunk, port=port.port).encode()
        return out

    def _connect_peers(self, records):
        for p, peer in self.peers.items():
            remote = proto.ConnInfo.decode(records[p])
            if (remote.nslots, remote.chunk_nbytes) != (self.nslots, self.chunk):
                raise HarmpiTransportError(
                    f"verbs set-up: rank {self._world[p]} uses {remote.nslots} slots of "
                    f"{remote.chunk_nbytes} bytes, this rank {self.nslots} of {self.chunk}")
            psn, peer.remote = peer.remote, remote
            self.nic.connect(peer.qp, psn, remote)
            for _ in range(self.recv_depth):
                self.nic.post_recv(peer.qp, _wr_id(_WR_RECV, p))

    def _connect(self, timeout_s):
        failure = None
        records = None
        try:
            records_out = self._local_setup()
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            failure, records_out = exc, [b""] * self.size
        arrive(self.comm, timeout_s, "verbs transport set-up")
        # (every rank's list, gathered and polled: MPI's alltoall of objects blocks)
        records = [row[self.rank] for row in allgather_polled(
            self.comm, records_out, timeout_s, "verbs transport set-up (queue pairs)")]
        if failure is None:
            try:
                if any(p != self.rank and not records[p] for p in range(self.size)):
                    raise HarmpiTransportError("a peer could not make its queue pair")
                self._connect_peers(records)
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                failure = exc
        why = f"rank {self._world[self.rank]}: {failure}" if failure is not None else ""
        whys = [w for w in allgather_polled(self.comm, why, timeout_s,
                                            "verbs transport set-up (verdicts)") if w]
        if whys:
            raise HarmpiTransportError(f"verbs transport set-up failed: {'; '.join(whys)}")
        # nobody writes before every QP is ready to receive
        arrive(self.comm, timeout_s, "verbs transport set-up (queue pairs ready)")

    # -- data -------------------------------------------------------------------

    def landing_view(self, peer, seq=0):
        """The landing slot that chunk ``seq`` from ``peer`` is written into."""
        off = self.layout.landing(peer, seq)
        return self.region.buf[off: off + self.chunk]

    def post(self, sends, recvs):
        if self.failed is not None:
            raise self.failed
        for p in {p for p, *_ in recvs} | {p for p, *_ in sends}:
            if self.peers[p].error is not None:
                self.failed = self.peers[p].error
                raise self.failed
        rs = []
        for peer, buf in recvs:
            r = _Recv(peer, buf)
            self.peers[peer].rx_queue.append(r)
            rs.append(r)
        ss = []
        for peer, buf, tag in sends:
            s = _Send(peer, buf, tag, self.chunk)
            self.peers[peer].tx_queue.append(s)
            ss.append(s)
        # start the writes now: the network works while the caller goes on
        for s in ss:
            self._push(self.peers[s.peer])
        return _VerbsPending(ss, rs)

    def complete(self, pending, timeout_s, what):
        deadline = time.monotonic() + timeout_s
        naps_from = time.monotonic() + self.yield_ns * 1e-9
        polls = 0
        pause = NAP_FIRST_S
        try:
            while not self._progress(pending, what):
                polls += 1
                if polls < self.spin_count:
                    continue
                pause = idle(self.naps and time.monotonic() >= naps_from, pause)
                if time.monotonic() > deadline and not self._progress(pending, what):
                    self._raise_timeout(pending, timeout_s, what)
        except HarmpiTransportError as exc:
            self.failed = self.failed or exc
            raise
        return [(r.got, r.tag if r.tag is not None else -1) for r in pending.recvs]

    def _progress(self, pending, what):  # noqa: C901 - one pass of complete()'s polling loop, kept whole: a helper call per pass adds to every poll
        """One pass: reap completions, claim arrived chunks, return credit,
        write what credit allows. True when ``pending`` is complete."""
        self._poll(what)
        done = True
        for r in pending.recvs:
            if not r.done:
                peer = self.peers[r.peer]
                if peer.error is not None:
                    raise peer.error
                self._claim(peer)
                if not r.done:
                    if peer.abandoned:
                        self._raise_abandoned(r.peer, what)
                    done = False
        for peer in self.peers.values():
            if peer.credit_dirty:
                self._return_credit(peer)
            if peer.tx_queue:
                self._push(peer)
        for s in pending.sends:
            peer = self.peers[s.peer]
            if s.last_seq < 0 or peer.tx_done <= s.last_seq:
                if peer.error is not None:
                    raise peer.error
                if peer.abandoned:
                    self._raise_abandoned(s.peer, what)
                done = False
        return done

    def _poll(self, what):
        for wr_id, status, _opcode, nbytes, imm, vendor_err in self.nic.poll(_POLL_BATCH):
            kind, p = wr_id >> 32, wr_id & 0xFFFFFFFF
            peer = self.peers[p]
            if status != proto.WC_SUCCESS:
                err = proto.completion_error(self._world[self.rank], what, self._world[p],
                                             _WR_NAMES.get(kind, f"work request {kind}"),
                                             status, vendor_err)
                if kind in (_WR_CREDIT, _WR_ABANDON):
                    # the data it acknowledges was delivered: the failure
                    # belongs to the next exchange with this peer (a peer that
                    # closed after its last collective is not an error yet)
                    peer.error = peer.error or err
                    continue
                # a flushed request names the failure that flushed it
                raise peer.error if status == _WC_FLUSH and peer.error else err
            if kind == _WR_RECV:
                self._arrived(peer, nbytes, imm, what)
                self.nic.post_recv(peer.qp, wr_id)
            elif kind == _WR_DATA:
                peer.tx_done += 1
            elif kind == _WR_CREDIT:
                peer.credits_out -= 1

    def _arrived(self, peer, nbytes, imm, what):
        tag, last, seq = proto.decode_imm(imm)
        if tag == ABANDON_TAG:
            peer.abandoned = True
            return
        if seq != peer.rx_seq % proto.SEQ_MOD:
            raise HarmpiTransportError(
                f"rank {self._world[self.rank]}: {what}: verbs: chunk {seq} from rank "
                f"{self._world[peer.rank]} arrived where chunk {peer.rx_seq % proto.SEQ_MOD} "
                "was due (lost or reordered write: a protocol error)", culprit=peer.rank)
        peer.rx_seq += 1
        peer.rx_arrived.append((nbytes, tag, last))

    def _claim(self, peer):
        """Copy arrived chunks into the receives waiting on ``peer``, in order."""
        base, lay = self._base, self.layout
        while peer.rx_arrived and peer.rx_queue:
            r = peer.rx_queue[0]
            nbytes, tag, last = peer.rx_arrived.popleft()
            fit = max(0, min(nbytes, r.cap - r.got))
            if fit:
                ctypes.memmove(r.addr + r.got, base + lay.landing(peer.rank, peer.rx_consumed),
                               fit)
            r.got += nbytes
            if r.tag is None:
                r.tag = tag
            peer.rx_consumed += 1
            peer.credit_dirty = True
            if last:
                r.done = True
                peer.rx_queue.popleft()

    def _return_credit(self, peer):
        if peer.credits_out >= self.nslots:
            return  # the send queue is busy with credit writes: the next pass sends it
        off = self.layout.consumed(peer.rank)
        self.region.buf[off: off + 8].view(np.uint64)[0] = peer.rx_consumed
        self.nic.post_write(peer.qp, _wr_id(_WR_CREDIT, peer.rank), self.region, off, 8,
                            peer.remote.credit_addr, peer.remote.credit_rkey, None)
        peer.credits_out += 1
        peer.credit_dirty = False

    def _credit(self, peer):
        off = self.layout.credit(peer.rank)
        return int(self.region.buf[off: off + 8].view(np.uint64)[0])

    def _push(self, peer):
        """Write the chunks of ``peer``'s queued sends that credit allows."""
        lay, base, rem = self.layout, self._base, peer.remote
        while peer.tx_queue:
            s = peer.tx_queue[0]
            while s.next < len(s.sizes):
                seq = peer.tx_seq
                if seq - self._credit(peer) >= self.nslots or seq - peer.tx_done >= self.nslots:
                    return
                n = s.sizes[s.next]
                off = lay.staging(peer.rank, seq)
                if n:
                    ctypes.memmove(base + off, s.addr + s.off, n)
                last = s.next == len(s.sizes) - 1
                self.nic.post_write(peer.qp, _wr_id(_WR_DATA, peer.rank), self.region, off, n,
                                    rem.land_addr + (seq % self.nslots) * self.chunk,
                                    rem.land_rkey, proto.encode_imm(s.tag, last, seq))
                peer.tx_seq += 1
                s.next += 1
                s.off += n
                if last:
                    s.last_seq = seq
            peer.tx_queue.popleft()

    # -- failures ---------------------------------------------------------------

    def _raise_abandoned(self, p, what):
        raise HarmpiTimeoutError(
            f"rank {self._world[self.rank]}: {what}: rank {self._world[p]} gave up on this "
            "collective before this rank completed it (it timed out, failed or was interrupted; "
            "HARMPI_TIMEOUT_S sets the deadline)", culprit=self._world[p])

    def _raise_timeout(self, pending, timeout_s, what):
        waiting, late = [], []
        for r in pending.recvs:
            if not r.done:
                waiting.append(f"a message from rank {self._world[r.peer]}")
                late.append(self._world[r.peer])
        for s in pending.sends:
            if s.last_seq < 0 or self.peers[s.peer].tx_done <= s.last_seq:
                waiting.append(f"delivery to rank {self._world[s.peer]}")
                late.append(self._world[s.peer])
        raise timeout_error(self._world[self.rank], what, timeout_s, self.name, waiting, late)

    def give_up(self, extra_ops=()):
        """This rank gives up on the collective in progress: tell every peer
        (a zero-byte write with ABANDON_TAG), so a peer waiting on this rank
        fails at once instead of at its deadline. Best effort: no wait."""
        for p, peer in self.peers.items():
            if peer.remote is None or not isinstance(peer.remote, proto.ConnInfo):
                continue
            try:
                self.nic.post_write(peer.qp, _wr_id(_WR_ABANDON, p), self.region, 0, 0,
                                    peer.remote.land_addr, peer.remote.land_rkey,
                                    proto.encode_imm(ABANDON_TAG, True, 0))
            except Exception:  # noqa: BLE001 - a failed QP cannot carry the notice
                pass

    def world_rank(self, peer):
        return self._world[peer]

    def close(self):
        if self.nic is not None:
            self.nic.close()
        self.nic = None
        self.peers = {}
        self.failed = self.failed or HarmpiTransportError("the verbs transport is closed")


def _world_ranks(comm):
    try:
        return world_ranks(comm)
    except (MPI.Exception, AttributeError):  # (tests' stand-in communicators have no group)
        return list(range(comm.Get_size()))
