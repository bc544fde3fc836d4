"""TCP transport: one socket per pair of ranks, framed messages, compiled I/O.

Why, next to the MPI transport: on Ethernet without RDMA, MPI's TCP path
polls its progress engine from every waiting rank, and from Python each
poll is a Python call. Here a waiting rank runs compiled code (no GIL) and,
after ``spin`` empty passes, sleeps in ``poll(2)`` until its bytes arrive,
so ranks that share cores give them to the ranks that have work. Measured
on 4 ranks / 2 cores, 10 KB exchange between rail peers: ~40-80 us over
MPI's TCP BTL from Python, ~30-45 us here.

Set-up (collective over ``comm``, bounded by the deadline): every rank
listens on an ephemeral port and publishes (host key, addresses, port)
with one allgather; then it connects to every lower rank, trying the
loopback address when both ranks share a kernel and network namespace and
the peer's addresses otherwise, sends its rank as a hello, and accepts one
connection from every higher rank. Sockets are non-blocking, TCP_NODELAY.

Messages: see sockio (16-byte header with size and tag, then payload). The
algorithms' tags carry their (size, kind) digest as with MPI, so a peer in
a different collective is detected from the header.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import time

import numpy as np
from mpi4py import MPI

from ..base.topology import allgather_polled, arrive, wait_polled, world_ranks
from ..errors import HarmpiTimeoutError, HarmpiTransportError
from ..platform import mpiprogress
from ..platform.machine import boot_id
from . import sockio
from .base import Pending, Transport, timeout_error

__all__ = ["TcpTransport", "host_key", "local_ipv4_addresses"]

_SIOCGIFADDR = 0x8915
#: socket buffers large enough that a decode-size send never blocks
_SOCKET_BUFFER_NBYTES = 4 << 20
_HELLO = struct.Struct("<qq")
_MAGIC = 0x68726D7069746370  # "hrmpitcp"


def host_key():
    """Ranks with equal keys reach each other over 127.0.0.1: same kernel
    (boot id) and same network namespace."""
    boot = boot_id() or socket.gethostname()
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    return f"{boot}/{netns}"


def local_ipv4_addresses():
    """Non-loopback IPv4 addresses of this network namespace: those the host
    name resolves to first (what the cluster's name service says), then
    every interface's."""
    out = []
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            out.append(info[4][0])
    except OSError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _index, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                out.append(socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24]))
            except OSError:
                continue   # interface without an IPv4 address
    seen = []
    for a in out:
        if not a.startswith("127.") and a not in seen:
            seen.append(a)
    return seen


class _TcpPending(Pending):
    __slots__ = ("k", "recv_rows", "peers")

    def __init__(self, k, recv_rows, peers):
        self.k = k
        self.recv_rows = recv_rows
        self.peers = peers


class TcpTransport(Transport):
    name = "tcp"
    compiled_rail = True

    def __init__(self, comm, spin_count: int = 1, connect_timeout_s: float = 30.0):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.spin_count = spin_count
        #: how long this rank waits for an exchange; its messages say when
        #: it gives up (sockio's header), so a receiver never completes a
        #: step this rank abandoned
        self.timeout_ns = int(connect_timeout_s * 1e9)
        self._world = self._world_ranks(comm)
        self.socks = [None] * self.size
        self.fds = np.full(self.size, -1, np.int64)
        self.ops = sockio.new_ops(max(4, 2 * self.size))
        self.pollfds = sockio.new_pollfds(self.ops.shape[0])
        self.scratch = sockio.new_scratch()
        self.hook = mpiprogress.new_hook()
        try:
            self._connect_all(connect_timeout_s)
        except BaseException:
            self.close()
            raise
        self.addresses_used = None
        self._load_io()

    def _load_io(self):
        """Call once, on no rows, each compiled routine that post() and
        complete() call from Python: numba loads them (from its cache) here
        in the set-up, not in the first collective."""
        ops = sockio.new_ops(1)
        fd = self.fds[self.rank]
        sockio.set_recv(ops, 0, fd, 0, 0)
        sockio.set_send(ops, 0, fd, 0, 0, 0, 0)
        sockio.kick(ops, 0, self.scratch)
        sockio.progress(ops, 0, self.spin_count, 0, self.pollfds, self.scratch,
                        self.hook.ctypes.data, 0, 0)

    @staticmethod
    def _world_ranks(comm):
        try:
            return world_ranks(comm)
        except MPI.Exception:
            return list(range(comm.Get_size()))

    # -- set-up ---------------------------------------------------------------

    def _connect_all(self, timeout_s):
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        failed = None
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("0.0.0.0", 0))
            listener.listen(max(8, self.size))
            me = (host_key(), local_ipv4_addresses(), listener.getsockname()[1])
            arrive(self.comm, timeout_s, "tcp transport set-up")
            everyone = allgather_polled(self.comm, me, timeout_s, "tcp transport set-up")
            deadline = time.monotonic() + timeout_s
            failures = []
            for peer in range(self.rank):
                key, addrs, port = everyone[peer]
                candidates = ["127.0.0.1"] if key == me[0] else addrs
                sock = self._connect(candidates, port, deadline, failures, peer)
                if sock is not None:
                    try:
                        sock.sendall(_HELLO.pack(_MAGIC, self.rank))
                    except OSError as exc:  # counted below, with every rank
                        sock.close()
                        failures.append(f"rank {self._world[peer]}: hello not sent ({exc})")
                        continue
                    self._adopt(peer, sock)
            # a rank that could not reach a peer says so; everyone fails together
            ok = all(allgather_polled(self.comm, not failures, timeout_s,
                                      "tcp transport set-up (connections tried)"))
            if not ok:
                raise HarmpiTransportError(
                    f"tcp transport: rank {self._world[self.rank]} could not connect: "
                    f"{'; '.join(failures) or 'another rank failed to connect'}")
            try:
                self._accept_all(listener, deadline, timeout_s)
            except (OSError, HarmpiTransportError) as exc:
                # kept until this rank has posted the barrier below like its
                # peers: a rank that left before it would meet their barrier
                # with its next collective on this communicator
                failed = exc if isinstance(exc, HarmpiTransportError) else HarmpiTransportError(
                    f"tcp transport: rank {self._world[self.rank]}: accepting a connection "
                    f"failed ({exc})")
        finally:
            listener.close()
        # nobody sends data before everybody has its sockets; polled, so a
        # rank that does not come costs the others their deadline, not a hang
        req = self.comm.Ibarrier()
        try:
            wait_polled(self.comm, req, timeout_s, "tcp transport set-up (connections made)", ())
        except HarmpiTimeoutError as exc:
            raise HarmpiTransportError(str(exc)) from None
        if failed is not None:
            raise failed

    def _accept_all(self, listener, deadline, timeout_s):
        """The connections of every higher rank, each with its hello."""
        for _ in range(self.size - 1 - self.rank):
            listener.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                sock, _addr = listener.accept()
            except socket.timeout:
                raise HarmpiTransportError(
                    f"tcp transport: rank {self._world[self.rank]} waited "
                    f"{timeout_s:g} s for connections from higher ranks") from None
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                magic, peer = _HELLO.unpack(self._recv_exact(sock, _HELLO.size))
            except (OSError, HarmpiTransportError) as exc:  # silent, short or reset
                sock.close()
                raise HarmpiTransportError(
                    f"tcp transport: rank {self._world[self.rank]}: no hello from a "
                    f"connection on the listening port ({exc})") from None
            if magic != _MAGIC or not self.rank < peer < self.size or self.socks[peer]:
                sock.close()
                raise HarmpiTransportError("tcp transport: unexpected connection on the "
                                           "listening port")
            self._adopt(peer, sock)

    def _connect(self, candidates, port, deadline, failures, peer):
        errors = []
        for addr in candidates:
            try:
                return socket.create_connection(
                    (addr, port), timeout=max(0.05, min(5.0, deadline - time.monotonic())))
            except OSError as exc:
                errors.append(f"{addr}:{port}: {exc}")
        failures.append(f"rank {self._world[peer]} unreachable "
                        f"({', '.join(errors) or 'it advertised no address'})")
        return None

    @staticmethod
    def _recv_exact(sock, n):
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise HarmpiTransportError("tcp transport: peer closed during set-up")
            buf += chunk
        return buf

    def _adopt(self, peer, sock):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER_NBYTES)
            except OSError:
                pass  # capped by net.core.*mem_max: fine, only slower
        sock.setblocking(False)
        self.socks[peer] = sock
        self.fds[peer] = sock.fileno()

    # -- data -------------------------------------------------------------------

    def fd(self, peer):
        return int(self.fds[peer])

    def _rows(self, k):
        if k > self.ops.shape[0]:
            self.ops = sockio.new_ops(k)
            self.pollfds = sockio.new_pollfds(k)
        return self.ops

    @staticmethod
    def _addr(buf):
        a = np.frombuffer(buf, np.uint8) if not isinstance(buf, np.ndarray) else buf
        return a.ctypes.data, a.nbytes

    def _give_up_ns(self):
        """When this rank's wait for an exchange posted now reaches its
        deadline (CLOCK_REALTIME, as sync.realtime_ns): sockio's header."""
        return time.time_ns() + self.timeout_ns

    def post(self, sends, recvs):
        ops = self._rows(len(sends) + len(recvs))
        peers = []
        i = 0
        for peer, buf in recvs:
            addr, nbytes = self._addr(buf)
            sockio.set_recv(ops, i, self.fds[peer], addr, nbytes)
            peers.append(peer)
            i += 1
        give_up = self._give_up_ns()
        for peer, buf, tag in sends:
            addr, nbytes = self._addr(buf)
            sockio.set_send(ops, i, self.fds[peer], addr, nbytes, tag, give_up)
            peers.append(peer)
            i += 1
        if sockio.kick(ops, i, self.scratch) != sockio.IO_OK:
            self.raise_failed(peers, "post")
        return _TcpPending(i, len(recvs), peers)

    def post_exchange(self, peer, send_buf, tag, recv_buf):
        ops = self.ops
        fd = self.fds[peer]
        addr, nbytes = self._addr(recv_buf)
        sockio.set_recv(ops, 0, fd, addr, nbytes)
        addr, nbytes = self._addr(send_buf)
        sockio.set_send(ops, 1, fd, addr, nbytes, tag, self._give_up_ns())
        if sockio.kick(ops, 2, self.scratch) != sockio.IO_OK:
            self.raise_failed((peer, peer), "post")
        return _TcpPending(2, 1, (peer, peer))

    def complete(self, pending, timeout_s, what):
        ops = self.ops
        rc = sockio.progress(ops, pending.k, self.spin_count, int(timeout_s * 1e9),
                             self.pollfds, self.scratch, self.hook.ctypes.data,
                             self.yield_ns, self.wait_state)
        if rc == sockio.IO_TIMEOUT:
            self.raise_timeout(pending.k, pending.peers, timeout_s, what)
        elif rc == sockio.IO_INTERRUPTED:
            raise KeyboardInterrupt(f"rank {self._world[self.rank]}: {what}: interrupted while "
                                    "waiting on the tcp transport")
        elif rc != sockio.IO_OK:
            self.raise_failed(pending.peers, what)
        got = []
        now = time.time_ns()
        for i in range(pending.recv_rows):
            if now > ops[i, sockio.OP_HDR_DL]:
                self.close()  # the sender gave up: so does this rank, visibly
                raise HarmpiTimeoutError(
                    f"rank {self._world[self.rank]}: {what}: rank "
                    f"{self._world[pending.peers[i]]} sent its part "
                    f"{(now - ops[i, sockio.OP_HDR_DL]) / 1e9 + timeout_s:.3g} s ago and has "
                    "given up on this collective by now: this rank arrived after its deadline "
                    "(HARMPI_TIMEOUT_S sets it)")
            # n may exceed the buffer (a peer passed a larger tensor): sockio
            # dropped the excess, so the stream stays aligned, and the
            # caller's recv_check sees the count. Raising here instead would
            # leave this rank's node waiting for a flag round it never posts.
            n, tag = int(ops[i, sockio.OP_HDR_N]), int(ops[i, sockio.OP_HDR_TAG])
            got.append((n, tag))
        return got

    def world_rank(self, peer):
        return self._world[peer]

    def watch_signals(self, sigfd):
        """Let this transport's waits notice a SIGINT on Python's wakeup fd."""
        self.hook[4] = sigfd

    def raise_failed(self, peers, what, ops=None):
        """Raise for the op rows that failed (row i talks to peers[i]; ``ops``:
        rows other than the transport's own)."""
        ops = self.ops if ops is None else ops
        for i, peer in enumerate(peers):
            if ops[i, sockio.OP_STATE] == sockio.ST_FAILED:
                err = int(ops[i, sockio.OP_ERRNO])
                if err == sockio.ERR_ABANDONED:
                    raise HarmpiTimeoutError(
                        f"rank {self._world[self.rank]}: {what}: rank {self._world[peer]} gave "
                        "up on this collective (it timed out, failed or was interrupted) "
                        "after sending its part: no rank completes it (HARMPI_TIMEOUT_S sets "
                        "the deadline)")
                why = "closed the connection" if err == sockio.ERR_CLOSED else os.strerror(err)
                raise HarmpiTransportError(
                    f"rank {self._world[self.rank]}: {what}: tcp connection to rank "
                    f"{self._world[peer]}: {why} (that rank gave up on this collective - it "
                    "timed out, failed or was interrupted, and closed its connections - or it "
                    "exited or crashed)")
        raise HarmpiTransportError(f"rank {self._world[self.rank]}: {what}: tcp I/O failed")

    def raise_timeout(self, k, peers, timeout_s, what, ops=None):
        """Raise for op rows [0, k) still pending (row i talks to peers[i])."""
        ops = self.ops if ops is None else ops
        waiting, late = [], []
        for i in range(k):
            if ops[i, sockio.OP_STATE] == sockio.ST_PENDING:
                kind = ("a message from" if ops[i, sockio.OP_KIND] == sockio.KIND_RECV
                        else "delivery to")
                waiting.append(f"{kind} rank {self._world[peers[i]]}")
                late.append(self._world[peers[i]])
        raise timeout_error(self._world[self.rank], what, timeout_s, self.name, waiting, late)

    def give_up(self, extra_ops=()):
        """This rank gave up on the collective in progress: write the abandon
        notice (sockio) on every socket, then close them all, so a peer that
        receives this rank's part of the step still fails. No notice goes
        where a message is half sent (in this transport's op rows or in
        ``extra_ops``, another user's rows): the bytes would land inside
        that message; its receiver fails on the closed socket instead."""
        half_sent = set()
        for ops in (self.ops, *extra_ops):
            sending = (ops[:, sockio.OP_KIND] == sockio.KIND_SEND) & (
                ops[:, sockio.OP_STATE] == sockio.ST_PENDING) & (ops[:, sockio.OP_DONE] > 0)
            half_sent.update(int(fd) for fd in ops[sending, sockio.OP_FD])
        notice = struct.pack("<qqq", *sockio.ABANDON_NOTICE, 0)
        for s in self.socks:
            if s is not None and s.fileno() not in half_sent:
                try:
                    s.send(notice, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
                except OSError:
                    pass  # full or already reset: the close below tells the peer
        self.close()

    def close_local(self):
        self.close()

    def close(self):
        for i, s in enumerate(self.socks):
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass
                self.socks[i] = None
        self.fds[:] = -1
