"""Unit tests of the TCP transport without mpirun: the compiled socket I/O
(sockio) over socket pairs in one process, with threads standing in for the
peer where both ends must act at once, and TcpTransport's completion and
error mapping on an object built around those sockets (no MPI set-up)."""

import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

import harmpi
from harmpi.transports import sockio
from harmpi.transports.tcp import TcpTransport, host_key, local_ipv4_addresses

HDR = struct.Struct("<qqq")  # payload bytes, tag, give-up time
#: a give-up time far in the future (the sender waits long)
LATER = 2 ** 62
MiB = 1 << 20


# -- helpers ----------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def no_leaks():
    """Every test closes its sockets and joins its threads."""
    fds = set(os.listdir("/proc/self/fd"))
    threads = set(threading.enumerate())
    yield
    assert set(threading.enumerate()) - threads == set()
    assert set(os.listdir("/proc/self/fd")) - fds == set()


@pytest.fixture(autouse=True)
def fake_comms_gather_at_once(monkeypatch):
    """The set-up's polled allgather (topology.allgather_polled) takes
    FakeComm's allgather, whose hook fakes an absent rank or a stranger;
    the polled path itself runs in the MPI tests (tests/mpi)."""
    from harmpi.transports import tcp

    real = tcp.allgather_polled

    def gather(comm, obj, timeout_s, what):
        if isinstance(comm, FakeComm):
            # the connect verdicts (flags) as the thread-ranks' own; the
            # address exchange through the hook
            return comm._gather(obj) if isinstance(obj, bool) else comm.allgather(obj)
        return real(comm, obj, timeout_s, what)

    monkeypatch.setattr(tcp, "allgather_polled", gather)


def _unix_pair():
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


def _tcp_pair():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        a = socket.create_connection(listener.getsockname(), timeout=5)
        b, _ = listener.accept()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


@pytest.fixture
def make_pair():
    """make_pair(kind="unix"|"tcp") -> two connected non-blocking sockets, closed afterwards."""
    made = []

    def make(kind="unix"):
        a, b = _unix_pair() if kind == "unix" else _tcp_pair()
        for s in (a, b):
            s.setblocking(False)
        made.extend((a, b))
        return a, b

    yield make
    for s in made:
        s.close()


class Side:
    """One end's op table, poll array and scratch (each thread needs its own)."""

    def __init__(self, rows=4):
        self.ops = sockio.new_ops(rows)
        self.pollfds = sockio.new_pollfds(rows)
        self.scratch = sockio.new_scratch()

    def send(self, i, sock, buf, tag, give_up_ns=LATER):
        sockio.set_send(self.ops, i, sock.fileno(), buf.ctypes.data, buf.nbytes, tag, give_up_ns)

    def recv(self, i, sock, buf):
        sockio.set_recv(self.ops, i, sock.fileno(), buf.ctypes.data, buf.nbytes)

    def progress(self, k, timeout_s=10.0, spin=1, yield_ns=0, state_addr=0):
        return sockio.progress(self.ops, k, spin, int(timeout_s * 1e9), self.pollfds,
                               self.scratch, 0, yield_ns, state_addr)

    def kick(self, k):
        return sockio.kick(self.ops, k, self.scratch)

    def row(self, i, field):
        return int(self.ops[i, field])


class Worker(threading.Thread):
    """Runs fn() concurrently; finish() joins (bounded) and returns its result."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.exc = fn, None, None
        self.start()

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in finish()
            self.exc = exc

    def finish(self, timeout=30.0):
        self.join(timeout)
        assert not self.is_alive(), "worker thread did not finish (deadlock?)"
        if self.exc is not None:
            raise self.exc
        return self.result


def payload(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def recv_raw(sock, n, timeout=5.0):
    """Read exactly n bytes from a non-blocking socket (Python side, for checks)."""
    out = b""
    deadline = time.monotonic() + timeout
    while len(out) < n:
        try:
            chunk = sock.recv(n - len(out))
        except BlockingIOError:
            assert time.monotonic() < deadline, f"only {len(out)} of {n} bytes arrived"
            time.sleep(0.001)
            continue
        assert chunk, "peer closed"
        out += chunk
    return out


def pending_bytes(sock):
    """Everything currently readable from a non-blocking socket, without waiting for more."""
    time.sleep(0.02)
    out = b""
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except BlockingIOError:
            return out
        if not chunk:
            return out
        out += chunk


def unframe(raw):
    """[(payload, tag)] of the frames in ``raw`` (give-up times aside)."""
    out = []
    while raw:
        n, tag, _ = HDR.unpack(raw[:HDR.size])
        out.append((raw[HDR.size:HDR.size + n], tag))
        raw = raw[HDR.size + n:]
    return out


def frame(data, tag):
    data = bytes(data)
    return HDR.pack(len(data), tag, LATER) + data


# -- sockio: framing and round trips ----------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 63, 64, 65, 4096, 1 * MiB + 3])
def test_round_trip_sizes(make_pair, n):
    a, b = make_pair()
    data = payload(n, n)
    out = np.full(n + 8, 0xAB, np.uint8)          # capacity larger than the message
    tag = (1 << 40) + 12345                       # all 64 bits of the tag word are kept
    recv_side = Side()
    recv_side.recv(0, b, out)
    receiver = Worker(lambda: recv_side.progress(1))
    send_side = Side()
    send_side.send(0, a, data, tag)
    assert send_side.progress(1) == sockio.IO_OK
    assert receiver.finish() == sockio.IO_OK
    assert send_side.row(0, sockio.OP_STATE) == sockio.ST_DONE
    assert send_side.row(0, sockio.OP_DONE) == sockio.HEADER_NBYTES + n
    assert recv_side.row(0, sockio.OP_STATE) == sockio.ST_DONE
    assert recv_side.row(0, sockio.OP_HDR_N) == n
    assert recv_side.row(0, sockio.OP_HDR_TAG) == tag
    assert recv_side.row(0, sockio.OP_DONE) == sockio.HEADER_NBYTES + n
    assert bytes(out[:n]) == bytes(data)
    assert (out[n:] == 0xAB).all()                # nothing written past the message
    assert pending_bytes(b) == b""


def test_wire_format_is_header_then_payload(make_pair):
    a, b = make_pair()
    data = payload(40, 1)
    side = Side()
    side.send(0, a, data, 77)
    assert side.progress(1) == sockio.IO_OK
    assert recv_raw(b, HDR.size + 40) == HDR.pack(40, 77, LATER) + bytes(data)

    # and a frame written by hand is understood by the receiver
    b.sendall(frame(b"hello world", -5))
    out = np.zeros(32, np.uint8)
    side.recv(0, a, out)
    assert side.progress(1) == sockio.IO_OK
    assert (side.row(0, sockio.OP_HDR_N), side.row(0, sockio.OP_HDR_TAG)) == (11, -5)
    assert bytes(out[:11]) == b"hello world"


def test_zero_byte_message_into_zero_capacity(make_pair):
    a, b = make_pair()
    side = Side()
    empty = np.zeros(0, np.uint8)
    side.send(0, a, empty, 9)
    nxt = np.frombuffer(b"next", np.uint8).copy()   # buffers must outlive the op
    side.send(1, a, nxt, 10)
    assert side.progress(2) == sockio.IO_OK
    r = Side()
    out0 = np.zeros(0, np.uint8)
    out1 = np.zeros(4, np.uint8)
    r.recv(0, b, out0)
    r.recv(1, b, out1)
    assert r.progress(2) == sockio.IO_OK
    assert [r.row(0, f) for f in (sockio.OP_HDR_N, sockio.OP_HDR_TAG, sockio.OP_DONE)] == \
        [0, 9, HDR.size]
    assert [r.row(1, f) for f in (sockio.OP_HDR_N, sockio.OP_HDR_TAG)] == [4, 10]
    assert bytes(out1) == b"next"


def test_header_split_across_arrivals(make_pair):
    """Header and payload trickle in: the receiver assembles them across poll waits."""
    a, b = make_pair()
    wire = frame(b"abcdefghij", 3)
    r = Side()
    out = np.zeros(10, np.uint8)
    r.recv(0, b, out)

    def trickle():
        for piece in (wire[:3], wire[3:15], wire[15:20], wire[20:]):
            time.sleep(0.02)
            a.sendall(piece)

    w = Worker(trickle)
    assert r.progress(1, timeout_s=5) == sockio.IO_OK
    w.finish()
    assert (r.row(0, sockio.OP_HDR_N), r.row(0, sockio.OP_HDR_TAG)) == (10, 3)
    assert bytes(out) == b"abcdefghij"


@pytest.mark.parametrize("kind", ["unix", "tcp"])
def test_large_exchange_both_directions_does_not_deadlock(make_pair, kind):
    """Both ends post an 8 MiB send and an 8 MiB receive at once (bigger than any socket
    buffer): progress must interleave sending and receiving on each end."""
    a, b = make_pair(kind)
    n = 8 * MiB
    data = {a: payload(n, 10), b: payload(n, 11)}
    out = {a: np.zeros(n, np.uint8), b: np.zeros(n, np.uint8)}

    def exchange(sock, tag):
        side = Side()
        side.recv(0, sock, out[sock])             # rows as TcpTransport.post_exchange lays them
        side.send(1, sock, data[sock], tag)
        assert side.kick(2) == sockio.IO_OK
        rc = side.progress(2, timeout_s=20)
        return rc, side.row(0, sockio.OP_HDR_N), side.row(0, sockio.OP_HDR_TAG)

    wa = Worker(lambda: exchange(a, 100))
    wb = Worker(lambda: exchange(b, 200))
    assert wa.finish() == (sockio.IO_OK, n, 200)
    assert wb.finish() == (sockio.IO_OK, n, 100)
    assert np.array_equal(out[a], data[b])
    assert np.array_equal(out[b], data[a])


def test_queued_messages_arrive_in_order_without_over_reading(make_pair):
    a, b = make_pair()
    msgs = [payload(5, 20), payload(16, 21), payload(64, 22)]
    s = Side()
    for i, m in enumerate(msgs):
        s.send(i, a, m, 500 + i)
    assert s.progress(3) == sockio.IO_OK

    # one receive with room to spare must take message 0 only
    r = Side()
    big = np.zeros(1000, np.uint8)
    r.recv(0, b, big)
    assert r.progress(1) == sockio.IO_OK
    assert (r.row(0, sockio.OP_HDR_N), r.row(0, sockio.OP_HDR_TAG)) == (5, 500)
    assert r.row(0, sockio.OP_DONE) == HDR.size + 5
    assert bytes(big[:5]) == bytes(msgs[0])
    assert (big[5:] == 0).all()

    # the next two, received in one progress, come out in table order
    outs = [np.zeros(64, np.uint8), np.zeros(64, np.uint8)]
    r.recv(0, b, outs[0])
    r.recv(1, b, outs[1])
    assert r.progress(2) == sockio.IO_OK
    assert [(r.row(i, sockio.OP_HDR_N), r.row(i, sockio.OP_HDR_TAG)) for i in (0, 1)] == \
        [(16, 501), (64, 502)]
    assert bytes(outs[0][:16]) == bytes(msgs[1])
    assert bytes(outs[1]) == bytes(msgs[2])
    assert pending_bytes(b) == b""


def test_receive_stops_at_message_boundary_with_raw_bytes_behind(make_pair):
    a, b = make_pair()
    a.sendall(frame(b"first", 1) + frame(b"second!", 2) + b"tail")
    r = Side()
    out = np.zeros(100, np.uint8)
    r.recv(0, b, out)
    assert r.progress(1) == sockio.IO_OK
    assert bytes(out[:5]) == b"first"
    # exactly the rest of the stream is still on the socket
    assert pending_bytes(b) == frame(b"second!", 2) + b"tail"


@pytest.mark.parametrize("announced, cap", [(100, 40), (300_000, 1000), (70, 0)])
def test_oversized_message_is_truncated_and_stream_stays_aligned(make_pair, announced, cap):
    a, b = make_pair()
    big = payload(announced, 30)
    after = payload(33, 31)
    s = Side()
    s.send(0, a, big, 7)
    s.send(1, a, after, 8)
    sender = Worker(lambda: s.progress(2))        # 300 kB exceeds the socket buffer
    r = Side()
    buf = np.full(cap + 16, 0xEE, np.uint8)
    sockio.set_recv(r.ops, 0, b.fileno(), buf.ctypes.data, cap)
    nxt = np.zeros(33, np.uint8)
    r.recv(1, b, nxt)
    assert r.progress(2) == sockio.IO_OK
    assert sender.finish() == sockio.IO_OK
    assert r.row(0, sockio.OP_STATE) == sockio.ST_DONE
    assert r.row(0, sockio.OP_HDR_N) == announced
    assert r.row(0, sockio.OP_HDR_TAG) == 7
    assert r.row(0, sockio.OP_DONE) == HDR.size + announced
    assert bytes(buf[:cap]) == bytes(big[:cap])
    assert (buf[cap:] == 0xEE).all()              # nothing written past the capacity
    assert (r.row(1, sockio.OP_HDR_N), r.row(1, sockio.OP_HDR_TAG)) == (33, 8)
    assert bytes(nxt) == bytes(after)
    assert pending_bytes(b) == b""


# -- sockio: failures, deadline, kick ---------------------------------------------------------


def test_peer_close_fails_receive_with_err_closed(make_pair):
    a, b = make_pair()
    a.sendall(frame(b"last words", 4))
    a.close()
    r = Side()
    out = np.zeros(10, np.uint8)
    r.recv(0, b, out)
    assert r.progress(1, timeout_s=5) == sockio.IO_OK   # what was sent before still arrives
    assert bytes(out) == b"last words"
    r.recv(0, b, out)
    t0 = time.monotonic()
    assert r.progress(1, timeout_s=5) == sockio.IO_FAILED
    assert time.monotonic() - t0 < 2
    assert r.row(0, sockio.OP_STATE) == sockio.ST_FAILED
    assert r.row(0, sockio.OP_ERRNO) == sockio.ERR_CLOSED


def test_peer_close_mid_message_fails(make_pair):
    a, b = make_pair()
    a.sendall(frame(b"0123456789", 4)[:HDR.size + 4])  # header and 4 of 10 payload bytes
    r = Side()
    out = np.zeros(10, np.uint8)
    r.recv(0, b, out)
    w = Worker(lambda: r.progress(1, timeout_s=5))
    time.sleep(0.05)
    a.close()
    assert w.finish() == sockio.IO_FAILED
    assert r.row(0, sockio.OP_ERRNO) == sockio.ERR_CLOSED
    assert r.row(0, sockio.OP_DONE) == HDR.size + 4


def test_negative_size_header_is_rejected(make_pair):
    a, b = make_pair()
    a.sendall(HDR.pack(-1, 0, LATER))
    r = Side()
    out = np.zeros(8, np.uint8)
    r.recv(0, b, out)
    assert r.progress(1, timeout_s=5) == sockio.IO_FAILED
    assert r.row(0, sockio.OP_ERRNO) == sockio.ERR_CLOSED


def test_send_to_closed_peer_fails_with_errno(make_pair):
    a, b = make_pair()
    b.close()
    s = Side()
    data = payload(100, 5)
    s.send(0, a, data, 1)
    assert s.progress(1, timeout_s=5) == sockio.IO_FAILED   # and no SIGPIPE kills us
    assert s.row(0, sockio.OP_STATE) == sockio.ST_FAILED
    assert s.row(0, sockio.OP_ERRNO) in (32, 104)          # EPIPE, ECONNRESET


def test_receive_times_out_and_stays_pending(make_pair):
    a, b = make_pair()
    r = Side()
    out = np.zeros(8, np.uint8)
    r.recv(0, b, out)
    t0 = time.monotonic()
    assert r.progress(1, timeout_s=0.2, spin=10) == sockio.IO_TIMEOUT
    elapsed = time.monotonic() - t0
    assert 0.15 <= elapsed <= 3.0
    assert r.row(0, sockio.OP_STATE) == sockio.ST_PENDING
    assert r.row(0, sockio.OP_DONE) == 0

    # a late message completes the same row on the next progress call
    a.sendall(frame(b"late!!!!", 6))
    assert r.progress(1, timeout_s=5) == sockio.IO_OK
    assert bytes(out) == b"late!!!!"


def test_a_yield_window_keeps_the_deadline_and_completes_a_late_message(make_pair):
    # ranks outnumber cores: past the spin the wait yields the core instead of
    # sleeping in poll(2), for a window longer than the deadline here
    a, b = make_pair()
    r = Side()
    out = np.zeros(8, np.uint8)
    r.recv(0, b, out)
    t0 = time.monotonic()
    assert r.progress(1, timeout_s=0.2, yield_ns=int(30e9)) == sockio.IO_TIMEOUT
    assert 0.15 <= time.monotonic() - t0 <= 3.0
    receiver = Worker(lambda: r.progress(1, timeout_s=20, yield_ns=int(30e9)))
    time.sleep(0.05)
    a.sendall(frame(b"yielded!", 7))
    assert receiver.finish() == sockio.IO_OK
    assert bytes(out) == b"yielded!" and r.row(0, sockio.OP_HDR_TAG) == 7


def test_on_a_busy_host_the_rail_does_not_spin(make_pair, tmp_path):
    # a billion polls of spin would outlast the test: on a busy host
    # (sync.host_busy, a score already past the line) the loop skips them and
    # sleeps in poll(2) until its deadline, using next to no CPU
    from harmpi.base import sync
    p = tmp_path / "loadavg"
    p.write_text("9.0 9.0 9.0 9/300 1\n")
    fd = os.open(p, os.O_RDONLY)
    buf = np.zeros(64, np.uint8)
    st = np.zeros(sync.WS_WORDS, np.int64)
    st[sync.WS_POLICY] = sync.WAIT_AUTO
    st[sync.WS_BUSY_FD], st[sync.WS_BUSY_BUF], st[sync.WS_BUSY_CPUS] = fd + 1, buf.ctypes.data, 2
    st[sync.WS_BUSY] = 1024
    a, b = make_pair()
    r = Side()
    out = np.zeros(8, np.uint8)
    r.recv(0, b, out)
    try:
        cpu0, t0 = time.thread_time(), time.monotonic()
        assert r.progress(1, timeout_s=0.2, spin=10 ** 9,
                          state_addr=st.ctypes.data) == sockio.IO_TIMEOUT
        assert 0.15 <= time.monotonic() - t0 <= 3.0
        assert time.thread_time() - cpu0 < 0.1
    finally:
        os.close(fd)
    a.sendall(frame(b"busyhost", 5))
    assert r.progress(1, timeout_s=5, state_addr=st.ctypes.data) == sockio.IO_OK
    assert bytes(out) == b"busyhost"


def test_timeout_after_partial_header_keeps_what_arrived(make_pair):
    a, b = make_pair()
    wire = frame(b"xyz", 2)
    a.sendall(wire[:7])
    r = Side()
    out = np.zeros(3, np.uint8)
    r.recv(0, b, out)
    assert r.progress(1, timeout_s=0.2) == sockio.IO_TIMEOUT
    assert r.row(0, sockio.OP_STATE) == sockio.ST_PENDING
    assert r.row(0, sockio.OP_DONE) == 7
    a.sendall(wire[7:])
    assert r.progress(1, timeout_s=5) == sockio.IO_OK
    assert (r.row(0, sockio.OP_HDR_N), r.row(0, sockio.OP_HDR_TAG)) == (3, 2)
    assert bytes(out) == b"xyz"


def test_kick_sends_what_fits_without_blocking(make_pair):
    a, b = make_pair()
    n = 8 * MiB
    data = payload(n, 40)
    s = Side()
    s.send(0, a, data, 41)
    t0 = time.monotonic()
    assert s.kick(1) == sockio.IO_OK
    assert time.monotonic() - t0 < 1.0
    done = s.row(0, sockio.OP_DONE)
    assert 0 < done < HDR.size + n                # some, not all: nobody is reading yet
    assert s.row(0, sockio.OP_STATE) == sockio.ST_PENDING
    assert s.kick(1) == sockio.IO_OK              # a second kick on a full socket: no block
    assert s.row(0, sockio.OP_DONE) == done

    r = Side()
    out = np.zeros(n, np.uint8)
    r.recv(0, b, out)
    w = Worker(lambda: r.progress(1))
    assert s.progress(1) == sockio.IO_OK
    assert w.finish() == sockio.IO_OK
    assert np.array_equal(out, data)


def test_kick_completes_small_sends_and_leaves_receives_pending(make_pair):
    a, b = make_pair()
    s = Side()
    out = np.zeros(4, np.uint8)
    s.recv(0, a, out)
    ping = np.frombuffer(b"ping", np.uint8).copy()   # buffers must outlive the op
    pong = np.frombuffer(b"pong", np.uint8).copy()
    s.send(1, a, ping, 1)
    s.send(2, a, pong, 2)
    assert s.kick(3) == sockio.IO_OK
    assert s.row(0, sockio.OP_STATE) == sockio.ST_PENDING
    assert s.row(1, sockio.OP_STATE) == sockio.ST_DONE
    assert s.row(2, sockio.OP_STATE) == sockio.ST_DONE
    assert pending_bytes(b) == frame(b"ping", 1) + frame(b"pong", 2)


def test_kick_reports_failure(make_pair):
    a, b = make_pair()
    b.close()
    s = Side()
    data = payload(10, 1)
    s.send(0, a, data, 1)
    assert s.kick(1) == sockio.IO_FAILED
    assert s.row(0, sockio.OP_STATE) == sockio.ST_FAILED


# -- TcpTransport helpers ---------------------------------------------------------------------


def test_host_key_is_stable_and_names_the_netns():
    key = host_key()
    assert key == host_key()
    netns = os.readlink("/proc/self/ns/net")
    assert netns and key.endswith("/" + netns)
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert key.startswith(f.read().strip() + "/")


def test_local_ipv4_addresses_exclude_loopback():
    addrs = local_ipv4_addresses()
    assert isinstance(addrs, list)
    assert len(addrs) == len(set(addrs))
    for a in addrs:
        socket.inet_aton(a)                       # a dotted IPv4 address
        assert a.count(".") == 3
        assert not a.startswith("127.")


# -- TcpTransport over socket pairs, without MPI ----------------------------------------------


def fake_transport(rank, world, peer_socks, spin_count=1, timeout_s=60.0):
    """A TcpTransport of local rank ``rank`` (world ranks ``world``) whose peers are
    already connected: peer_socks maps a local peer rank to its socket."""
    t = object.__new__(TcpTransport)
    size = len(world)
    t.rank, t.size, t.comm = rank, size, None
    t._world = list(world)
    t.spin_count = spin_count
    t.timeout_ns = int(timeout_s * 1e9)
    t.socks = [None] * size
    t.fds = np.full(size, -1, np.int64)
    for peer, sock in peer_socks.items():
        t.socks[peer] = sock
        t.fds[peer] = sock.fileno()
    t.ops = sockio.new_ops(max(4, 2 * size))
    t.pollfds = sockio.new_pollfds(t.ops.shape[0])
    t.scratch = sockio.new_scratch()
    t.hook = np.array([0, 0, 0, 0, -1], np.int64)  # no MPI progress hook, no wakeup fd
    return t


WORLD = [3, 8]          # local ranks 0, 1 are world ranks 3, 8


def test_transport_exchange_returns_sizes_and_tags(make_pair):
    a, b = make_pair()
    t0, t1 = fake_transport(0, WORLD, {1: a}), fake_transport(1, WORLD, {0: b})
    x0, x1 = payload(24, 50), payload(24, 51)
    r0, r1 = np.zeros(32, np.uint8), np.zeros(32, np.uint8)
    p0 = t0.post_exchange(1, x0, 11, r0)
    p1 = t1.post_exchange(0, x1, 22, r1)
    assert t0.complete(p0, 5, "test") == [(24, 22)]
    assert t1.complete(p1, 5, "test") == [(24, 11)]
    assert bytes(r0[:24]) == bytes(x1) and bytes(r1[:24]) == bytes(x0)
    assert t0.fd(1) == a.fileno() and t0.world_rank(1) == 8


def test_transport_post_many_peers_grows_the_table(make_pair):
    """Rank 0 of three exchanges two messages with each peer (8 rows: the op table grows)."""
    a01, b01 = make_pair()
    a02, b02 = make_pair()
    world = [5, 6, 7]
    t0 = fake_transport(0, world, {1: a01, 2: a02})
    t0.ops = sockio.new_ops(2)                    # force _rows to grow the table
    t0.pollfds = sockio.new_pollfds(2)
    bufs = [payload(8 * (i + 1), 60 + i) for i in range(4)]
    outs = [np.zeros(64, np.uint8) for _ in range(4)]
    b01.sendall(frame(b"from-1-a", 1) + frame(b"from-1-bb", 2))
    b02.sendall(frame(b"from-2", 3) + frame(b"", 4))
    p = t0.post([(1, bufs[0], 10), (2, bufs[1], 20), (1, bufs[2], 30), (2, bufs[3], 40)],
                [(1, outs[0]), (2, outs[1]), (1, outs[2]), (2, outs[3])])
    assert t0.complete(p, 5, "test") == [(8, 1), (6, 3), (9, 2), (0, 4)]
    assert bytes(outs[0][:8]) == b"from-1-a" and bytes(outs[2][:9]) == b"from-1-bb"
    assert bytes(outs[1][:6]) == b"from-2"
    assert t0.ops.shape[0] >= 8
    assert unframe(pending_bytes(b01)) == [(bytes(bufs[0]), 10), (bytes(bufs[2]), 30)]
    assert unframe(pending_bytes(b02)) == [(bytes(bufs[1]), 20), (bytes(bufs[3]), 40)]


def test_transport_too_large_message_reports_its_count_then_recovers(make_pair):
    """A message larger than its buffer fills the buffer, drops the rest and
    reports the sender's count: the algorithm's recv_check then poisons the
    step on every rank (raising here would strand this rank's node)."""
    a, b = make_pair()
    t0 = fake_transport(0, WORLD, {1: a})
    sent = payload(100, 70)
    b.sendall(frame(sent, 5) + frame(b"ok", 6))
    small = np.zeros(40, np.uint8)
    p = t0.post([], [(1, small)])
    assert t0.complete(p, 5, "allreduce") == [(100, 5)]
    assert bytes(small) == bytes(sent[:40])
    # the stream stays aligned: the next message is intact
    nxt = np.zeros(2, np.uint8)
    assert t0.complete(t0.post([], [(1, nxt)]), 5, "allreduce") == [(2, 6)]
    assert bytes(nxt) == b"ok"


def test_transport_closed_peer_raises_transport_error(make_pair):
    a, b = make_pair()
    t0 = fake_transport(0, WORLD, {1: a})
    out = np.zeros(8, np.uint8)
    p = t0.post([], [(1, out)])
    b.close()
    with pytest.raises(harmpi.HarmpiTransportError,
                       match=r"rank 3: allgather: tcp connection to rank 8: closed the connection"):
        t0.complete(p, 5, "allgather")


def test_transport_post_to_closed_peer_raises(make_pair):
    a, b = make_pair()
    b.close()
    t0 = fake_transport(0, WORLD, {1: a})
    # post_exchange: the receive row (row 0) sees the close first
    with pytest.raises(harmpi.HarmpiTransportError,
                       match=r"rank 3: post: tcp connection to rank 8: closed the connection"):
        t0.post_exchange(1, payload(8, 1), 1, np.zeros(8, np.uint8))
    # a send alone reports the errno of the failed send
    data = payload(8, 2)
    with pytest.raises(harmpi.HarmpiTransportError) as info:
        t0.post([(1, data, 1)], [])
    msg = str(info.value)
    assert "rank 3: post: tcp connection to rank 8: " in msg
    assert os.strerror(32) in msg or os.strerror(104) in msg


def test_transport_timeout_names_the_silent_peer(make_pair):
    a, b = make_pair()
    t0 = fake_transport(0, WORLD, {1: a})
    out = np.zeros(8, np.uint8)
    data = payload(8, 1)
    p = t0.post_exchange(1, data, 1, out)
    t_start = time.monotonic()
    with pytest.raises(harmpi.HarmpiTimeoutError) as info:
        t0.complete(p, 0.2, "barrier")
    assert 0.15 <= time.monotonic() - t_start <= 3.0
    msg = str(info.value)
    assert "rank 3: barrier: waited 0.2 s for a message from rank 8 over the tcp" in msg
    assert "delivery to" not in msg               # the send did go out
    assert isinstance(info.value, TimeoutError)


def test_transport_timeout_names_undelivered_send(make_pair):
    a, b = make_pair()
    t0 = fake_transport(0, WORLD, {1: a})
    data = payload(8 * MiB, 2)
    p = t0.post([(1, data, 1)], [])
    with pytest.raises(harmpi.HarmpiTimeoutError, match=r"for delivery to rank 8 over"):
        t0.complete(p, 0.2, "allreduce")


def test_transport_close_releases_sockets():
    a, b = _unix_pair()
    try:
        t0 = fake_transport(0, WORLD, {1: a})
        t0.close()
        assert a.fileno() == -1
        assert t0.socks == [None, None]
        assert (t0.fds == -1).all()
    finally:
        a.close()
        b.close()


# -- TcpTransport connection set-up with a stand-in communicator ------------------------------


class _Done:
    @staticmethod
    def Test():
        return True


class FakeComm:
    """The few collectives _connect_all uses, for ranks that are threads of this process.
    ``hook(rank, everyone)`` may edit the allgather result (e.g. to fake an absent rank)."""

    class Shared:
        def __init__(self, size, hook=None):
            self.size, self.hook = size, hook
            self.barrier = threading.Barrier(size, timeout=10)
            self.slots = [None] * size

    def __init__(self, shared, rank):
        self.shared, self.rank = shared, rank

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.shared.size

    def Get_group(self):
        from mpi4py import MPI
        raise MPI.Exception(MPI.ERR_GROUP)      # TcpTransport falls back to local = world ranks

    def _gather(self, value):
        sh = self.shared
        sh.slots[self.rank] = value
        sh.barrier.wait()
        out = list(sh.slots)
        sh.barrier.wait()
        return out

    def allgather(self, value):
        out = self._gather(value)
        if self.shared.hook is not None:
            self.shared.hook(self.rank, out)
        return out

    def allreduce(self, value, op=None):
        return min(self._gather(value))

    def Iallgather(self, send, recv):
        """topology.agree's gather of arrival records: rows of thread-ranks' bytes."""
        rows = self._gather(send[0].copy())
        for r in range(len(recv[0])):           # a faked absent rank arrived with rank 0
            recv[0][r] = rows[r] if r < len(rows) else rows[0]
        return _Done()

    def Ibarrier(self):
        """A request that completes when every thread-rank has asked for one."""
        self._gather(None)
        return _Done()

    def Barrier(self):
        self.shared.barrier.wait()


def test_transport_set_up_connects_every_pair_and_exchanges():
    size = 3
    shared = FakeComm.Shared(size)
    workers = [Worker(lambda r=r: TcpTransport(FakeComm(shared, r), 1, 5.0))
               for r in range(size)]
    ts = [w.finish() for w in workers]
    try:
        for t in ts:
            assert t._world == [0, 1, 2]
            for peer in range(size):
                sock = t.socks[peer]
                if peer == t.rank:
                    assert sock is None and t.fd(peer) == -1
                    continue
                assert t.fd(peer) == sock.fileno() >= 0
                assert sock.getblocking() is False
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
                assert sock.getpeername()[0] == "127.0.0.1"   # same host key: loopback

        # a ring exchange: rank r sends to r+1 and receives from r-1, all ranks at once
        def ring(t):
            data = np.full(1000, t.rank + 1, np.uint8)
            out = np.zeros(1000, np.uint8)
            p = t.post([((t.rank + 1) % size, data, 40 + t.rank)], [((t.rank - 1) % size, out)])
            got = t.complete(p, 5, "ring")
            return got, int(out[0]), int(out[-1])

        results = [Worker(lambda t=t: ring(t)) for t in ts]
        for r, w in enumerate(results):
            prev = (r - 1) % size
            assert w.finish() == ([(1000, 40 + prev)], prev + 1, prev + 1)
    finally:
        for t in ts:
            t.close()


def test_transport_set_up_times_out_without_higher_ranks():
    """Rank 0 of 2 alone: rank 1 never connects, so set-up fails at the deadline."""
    shared = FakeComm.Shared(1, hook=lambda rank, everyone: everyone.append(everyone[0]))
    comm = FakeComm(shared, 0)
    comm.Get_size = lambda: 2
    t0 = time.monotonic()
    with pytest.raises(harmpi.HarmpiTransportError,
                       match=r"rank 0 waited 0.3 s for connections from higher ranks"):
        TcpTransport(comm, 1, 0.3)
    assert 0.2 <= time.monotonic() - t0 <= 3.0


def test_transport_set_up_reports_unreachable_peer():
    """Rank 1 of 2 alone: rank 0 advertises a port nobody listens on."""
    with socket.socket() as s:                  # a port that was just free
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]

    def hook(rank, everyone):
        everyone.insert(0, (everyone[0][0], [], dead_port))

    shared = FakeComm.Shared(1, hook=hook)
    comm = FakeComm(shared, 0)
    comm.Get_rank, comm.Get_size = (lambda: 1), (lambda: 2)
    comm.rank = 0                                # its slot in the one-thread collectives
    with pytest.raises(harmpi.HarmpiTransportError,
                       match=r"rank 1 could not connect: rank 0 unreachable \(127\.0\.0\.1:"):
        TcpTransport(comm, 1, 2.0)


@pytest.mark.parametrize("hello, match", [
    (b"not a harmpi hello", "unexpected connection on the listening port"),
    (b"", r"rank 0: no hello from a connection on the listening port \(timed out\)"),
    (b"short", r"rank 0: no hello from a connection on the listening port \(timed out\)"),
    (b"bye-close", r"no hello from a connection .*peer closed during set-up"),
], ids=["garbage", "silent", "short", "short-then-close"])
def test_transport_set_up_rejects_a_stranger(hello, match):
    """Rank 0 of 2 alone; a stranger connects to its port instead of rank 1 and sends
    garbage, nothing, or too little (and maybe hangs up). Set-up must fail with a
    HarmpiTransportError naming the problem, within the deadline, closing the socket."""
    strangers = []

    def hook(rank, everyone):
        port = everyone[0][2]
        everyone.append(everyone[0])
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(hello)
        if hello.endswith(b"close"):
            s.shutdown(socket.SHUT_WR)
        strangers.append(s)

    shared = FakeComm.Shared(1, hook=hook)
    comm = FakeComm(shared, 0)
    comm.Get_size = lambda: 2
    t0 = time.monotonic()
    try:
        with pytest.raises(harmpi.HarmpiTransportError, match=match):
            TcpTransport(comm, 1, 0.3)
        assert time.monotonic() - t0 <= 3.0
    finally:
        for s in strangers:
            s.close()


def test_the_senders_give_up_time_travels_in_the_header(make_pair):
    a, b = make_pair()
    s = Side()
    s.send(0, a, payload(10, 1), 3, give_up_ns=123456789)
    assert s.progress(1) == sockio.IO_OK
    r = Side()
    out = np.zeros(10, np.uint8)
    r.recv(0, b, out)
    assert r.progress(1) == sockio.IO_OK
    assert r.row(0, sockio.OP_HDR_DL) == 123456789


def test_a_message_older_than_its_senders_deadline_is_refused(make_pair):
    """The sender gave up on the exchange before this rank completed it: the
    receiver must fail too, not complete a step its peer abandoned."""
    a, b = make_pair()
    t0 = fake_transport(0, WORLD, {1: a}, timeout_s=0.2)
    t1 = fake_transport(1, WORLD, {0: b})
    r1 = np.zeros(8, np.uint8)
    t0.post_exchange(1, payload(8, 1), 5, np.zeros(8, np.uint8))   # rank 0 sends, then...
    time.sleep(0.4)                                                 # ...is past its deadline
    p1 = t1.post_exchange(0, payload(8, 2), 5, r1)
    with pytest.raises(harmpi.HarmpiTimeoutError, match="given up on this collective"):
        t1.complete(p1, 5, "test")
