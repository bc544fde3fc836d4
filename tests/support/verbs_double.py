"""A loopback stand-in for the verbs NIC adapter (tests only; the library
cannot select it).

It implements the adapter interface harmpi.transports.verbs documents, over
files in a shared directory (a "fabric", e.g. under /dev/shm), so ranks in
one process or in several processes can talk:

- a registered region is a file ``mr-<rkey>`` mapped into the owner; page 0
  holds the owner's address of the data (so a writer can turn a remote
  address into an offset), the data follows;
- a queue pair is a file ``qp-<qpn>``: a header (receives posted by the
  owner, receives consumed by the peer, ring head, ring tail, closed flag)
  and a ring of inbound completions written by the peer;
- ``post_write`` copies the bytes into the peer's mapped region at once and,
  with an immediate, appends a completion to the peer's ring (payload
  first, then the tail: x86 keeps stores in order). Its own completion is
  queued locally. Errors follow the hardware's: an address outside the
  peer's region is REM_ACCESS_ERR, a write with immediate when the peer has
  no receive posted is RNR_RETRY_EXC_ERR, a closed peer is RETRY_EXC_ERR,
  and after any error the QP flushes (WR_FLUSH_ERR).

``inject(kind, status)`` makes the next ``kind`` ("write", "write_imm" or
"recv") complete with ``status`` (a receive error arrives as the next
inbound completion).
"""

from __future__ import annotations

import collections
import itertools
import mmap
import os
import threading

import numpy as np

from harmpi.transports import verbs_proto as proto
from harmpi.transports.verbs import VerbsTransport

_HDR = 4096
_RING = 256
_POSTED, _CONSUMED, _HEAD, _TAIL, _CLOSED = range(5)
_ids = itertools.count(1)

SUCCESS, WR_FLUSH_ERR, REM_ACCESS_ERR, RETRY_EXC_ERR, RNR_RETRY_EXC_ERR = 0, 5, 10, 12, 13
WRITE, RECV_IMM = 1, 129


def _map(path, nbytes=None):
    if nbytes is not None:
        with open(path, "wb") as f:
            f.truncate(nbytes)
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
    return mm, np.frombuffer(mm, np.uint8)


def loop_port(lid=7):
    gid = bytes(10) + b"\xff\xff" + bytes([10, 0, 0, lid])
    return proto.PortChoice("loop0", 1, 1, gid, lid, 5, proto.LINK_LAYER_ETHERNET)


class _Region:
    def __init__(self, path, nbytes):
        self.path = path
        self.mm, arr = _map(path, _HDR + nbytes)
        self.buf = arr[_HDR:]
        self.addr = self.buf.ctypes.data
        arr[:8].view(np.uint64)[0] = self.addr


class _QP:
    def __init__(self, path):
        self.path = path
        self.mm, arr = _map(path, 64 + _RING * 32)
        self.hdr = arr[:64].view(np.int64)
        self.ring = arr[64:].view(np.int64).reshape(_RING, 4)
        self.qpn = int(path.rsplit("-", 1)[1])
        self.recv_wrs = collections.deque()
        self.remote = None      # (hdr, ring) of the peer's QP
        self.error = False


class LoopbackNic:
    """The adapter interface over a shared directory (module docstring)."""

    def __init__(self, fabric_dir, port=None):
        self.dir = fabric_dir
        self.port = port or loop_port()
        self._cq = collections.deque()
        self._qps = []
        self._regions = []
        self._remote = {}
        self._faults = collections.deque()
        self.closed = False

    def _name(self, kind):
        return os.path.join(self.dir, f"{kind}-{(os.getpid() * 4096 + next(_ids)) & 0xFFFFFF}")

    # -- adapter interface ---------------------------------------------------

    def register(self, nbytes):
        path = self._name("mr")
        region = _Region(path, nbytes)
        region.lkey = region.rkey = int(path.rsplit("-", 1)[1])
        self._regions.append(region)
        return region

    def create_qp(self, send_depth, recv_depth):
        qp = _QP(self._name("qp"))
        self._qps.append(qp)
        return qp

    def connect(self, qp, psn, remote):
        _mm, arr = _map(os.path.join(self.dir, f"qp-{remote.qpn}"))
        qp.remote = (_mm, arr[:64].view(np.int64), arr[64:].view(np.int64).reshape(_RING, 4))

    def post_recv(self, qp, wr_id):
        qp.recv_wrs.append(wr_id)
        qp.hdr[_POSTED] += 1

    def post_write(self, qp, wr_id, region, offset, nbytes, remote_addr, rkey, imm):
        status = self._write(qp, region, offset, nbytes, remote_addr, rkey, imm)
        if status != SUCCESS:
            qp.error = True
        self._cq.append((wr_id, status, WRITE, nbytes, 0, 0))

    def poll(self, max_n):
        out = []
        while self._cq and len(out) < max_n:
            out.append(self._cq.popleft())
        for qp in self._qps:
            while qp.hdr[_HEAD] < qp.hdr[_TAIL] and len(out) < max_n:
                nbytes, imm, status, _ = qp.ring[qp.hdr[_HEAD] % _RING]
                qp.hdr[_HEAD] += 1
                if self._faults and self._faults[0][0] == "recv":
                    status = self._faults.popleft()[1]
                out.append((qp.recv_wrs.popleft(), int(status), RECV_IMM, int(nbytes),
                            int(imm), 0))
        return out

    def close(self):
        if self.closed:
            return
        self.closed = True
        for qp in self._qps:
            qp.hdr[_CLOSED] = 1
        for obj in self._qps + self._regions:
            try:
                os.unlink(obj.path)
            except FileNotFoundError:
                pass

    # -- test controls ---------------------------------------------------------

    def inject(self, kind, status):
        self._faults.append((kind, status))

    # -- the write itself ----------------------------------------------------

    def _remote_region(self, rkey):
        got = self._remote.get(rkey)
        if got is None:
            try:
                mm, arr = _map(os.path.join(self.dir, f"mr-{rkey}"))
            except FileNotFoundError:
                return None
            got = self._remote[rkey] = (mm, arr, int(arr[:8].view(np.uint64)[0]))
        return got

    def _write(self, qp, region, offset, nbytes, remote_addr, rkey, imm):
        if qp.error or self.closed:
            return WR_FLUSH_ERR
        kind = "write" if imm is None else "write_imm"
        if self._faults and self._faults[0][0] == kind:
            return self._faults.popleft()[1]
        _mm, rhdr, rring = qp.remote
        if rhdr[_CLOSED]:
            return RETRY_EXC_ERR
        target = self._remote_region(rkey)
        if target is None:
            return REM_ACCESS_ERR
        _rmm, arr, base = target
        off = remote_addr - base
        if off < 0 or off + nbytes > arr.size - _HDR:
            return REM_ACCESS_ERR
        if imm is not None and rhdr[_CONSUMED] >= rhdr[_POSTED]:
            return RNR_RETRY_EXC_ERR
        if nbytes:
            arr[_HDR + off: _HDR + off + nbytes] = region.buf[offset: offset + nbytes]
        if imm is not None:
            rhdr[_CONSUMED] += 1
            rring[rhdr[_TAIL] % _RING] = (nbytes, imm, SUCCESS, 0)
            rhdr[_TAIL] += 1
        return SUCCESS


# -- ranks as threads, for one-process tests ------------------------------------

class _Shared:
    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots = [None] * size


class _Done:
    def Test(self):  # noqa: N802 - MPI spelling
        return True


class ThreadComm:
    """Just enough of a communicator for the transport's set-up, one rank
    per thread."""

    def __init__(self, shared, rank):
        self.shared, self.rank = shared, rank

    def Get_rank(self):  # noqa: N802
        return self.rank

    def Get_size(self):  # noqa: N802
        return self.shared.size

    def Ibarrier(self):  # noqa: N802
        self.shared.barrier.wait()
        return _Done()

    def _exchange(self, obj):
        sh = self.shared
        sh.barrier.wait()
        sh.slots[self.rank] = obj
        sh.barrier.wait()
        out = list(sh.slots)
        sh.barrier.wait()
        return out

    def allgather(self, obj):
        return self._exchange(obj)

    def Iallgather(self, send, recv):  # noqa: N802
        """topology's polled gathers (arrival records, sizes): one equal
        block per thread-rank."""
        rows = recv[0].reshape(self.shared.size, -1)
        for r, block in enumerate(self._exchange(send[0].copy())):
            rows[r] = block.reshape(-1)
        return _Done()

    def Iallgatherv(self, send, recv):  # noqa: N802
        """topology.allgather_polled's pickles: block r at displacement r."""
        out, (_counts, displs), _ = recv
        for r, block in enumerate(self._exchange(send[0].copy())):
            out[displs[r]:displs[r] + block.size] = block
        return _Done()

    def alltoall(self, objs):
        return [row[self.rank] for row in self._exchange(objs)]


def run_ranks(size, fn, tmp_path, nic=None, **kw):
    """fn(transport, rank) on ``size`` thread-ranks, each with a NIC from
    ``nic()`` (default: a loopback NIC on the fabric ``tmp_path``); returns
    (results, exceptions, nics)."""
    shared = _Shared(size)
    out, errs = [None] * size, [None] * size
    nics = [nic() if nic else LoopbackNic(str(tmp_path)) for _ in range(size)]

    def body(r):
        t = None
        try:
            t = VerbsTransport(ThreadComm(shared, r), kw.get("spin", 4), 10.0, nics[r],
                               nslots=kw.get("nslots", 2), chunk_nbytes=kw.get("chunk", 4096))
            out[r] = fn(t, r)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errs[r] = exc
        finally:
            if t is not None and kw.get("close", True):
                t.close()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    return out, errs, nics
