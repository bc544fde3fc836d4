"""The tcp rail's abandon notice (issue 21 #5), on socket pairs in one
process: a receive fails when the notice comes as its header, or right
behind a message it completed (the sender gave up after sending its part);
an ordinary next message is left alone; give_up writes no notice into a
half-sent message."""

import socket
import struct

import numpy as np
import pytest

pytest.importorskip("numba")

from harmpi.base.kind import ABANDON_TAG  # noqa: E402
from harmpi.transports import sockio  # noqa: E402
from harmpi.transports.tcp import TcpTransport  # noqa: E402

NOTICE = struct.pack("<qqq", 0, ABANDON_TAG, 0)


def _message(payload, tag=7):
    return struct.pack("<qqq", len(payload), tag, 1 << 62) + payload


def _receive(sock, cap=64):
    """One receive through sockio.progress: (io status, op row, bytes)."""
    ops, pollfds, scratch = sockio.new_ops(1), sockio.new_pollfds(1), sockio.new_scratch()
    buf = np.zeros(cap, np.uint8)
    sockio.set_recv(ops, 0, sock.fileno(), buf.ctypes.data, cap)
    rc = sockio.progress(ops, 1, 1, int(2e9), pollfds, scratch, 0, 0, 0)
    return rc, ops[0], bytes(buf[: max(0, int(ops[0, sockio.OP_HDR_N]))])


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


def test_a_notice_as_the_header_fails_the_receive(pair):
    a, b = pair
    a.send(NOTICE)
    rc, row, _ = _receive(b)
    assert rc == sockio.IO_FAILED and row[sockio.OP_ERRNO] == sockio.ERR_ABANDONED


def test_a_notice_right_behind_a_completed_message_fails_it(pair):
    a, b = pair
    a.send(_message(b"abcd") + NOTICE)
    rc, row, got = _receive(b)
    assert got == b"abcd"          # the bytes arrived, but the step must not complete
    assert rc == sockio.IO_FAILED and row[sockio.OP_ERRNO] == sockio.ERR_ABANDONED


def test_a_next_message_or_a_close_behind_a_message_is_not_a_notice(pair):
    a, b = pair
    a.send(_message(b"abcd") + _message(b"efgh"))
    for want in (b"abcd", b"efgh"):
        rc, row, got = _receive(b)
        assert rc == sockio.IO_OK and got == want
    a.send(_message(b"ijkl"))
    a.shutdown(socket.SHUT_WR)      # a peer that completed and exited
    rc, _, got = _receive(b)
    assert rc == sockio.IO_OK and got == b"ijkl"


def _transport_over(sock):
    """A TcpTransport whose one peer (rank 1) is ``sock``, without set-up."""
    t = TcpTransport.__new__(TcpTransport)
    t.socks = [None, sock]
    t.fds = np.array([-1, sock.fileno()], np.int64)
    t.ops = sockio.new_ops(4)
    return t


def test_give_up_writes_the_notice_then_closes(pair):
    a, b = pair
    _transport_over(a).give_up()
    assert b.recv(64) == NOTICE and b.recv(64) == b""   # the notice, then end of stream


def test_give_up_writes_no_notice_into_a_half_sent_message(pair):
    a, b = pair
    t = _transport_over(a)
    extra = sockio.new_ops(2)          # another user's rows (the two-node step's)
    sockio.set_send(extra, 1, a.fileno(), 0, 1000, 7, 0)
    extra[1, sockio.OP_DONE] = 100      # 100 of its 1024 bytes are on the wire
    t.give_up([extra])
    assert b.recv(64) == b""            # closed without a notice: the receiver fails
