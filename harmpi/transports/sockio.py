"""Compiled socket I/O for the TCP transport: framed messages, a progress
engine over many sockets, and a deadline — no Python and no GIL inside.

Wire format: each message is a 24-byte header (int64 payload bytes, int64
tag, int64 give-up time) followed by the payload. The give-up time is when
the sender's wait for this exchange reaches its deadline (CLOCK_REALTIME,
ns): a receiver that gets the message after it knows the sender has given
up on the collective (or is about to), and must fail instead of completing
a step its peer abandoned. Messages on one socket arrive in the order
they were sent, so a receiver reads the header, then exactly that many
payload bytes, and never consumes the next message.

A rank that gives up on a collective (timeout, Ctrl-C, a peer's failure)
writes an *abandon notice* on each socket before closing it: a header with
0 bytes and ABANDON_TAG (harmpi.base.kind). A receive that reads it as its header
fails (ERR_ABANDONED), and so does a receive whose message is complete but
followed by a notice (one MSG_PEEK after each message): the sender gave up
after sending its part, so the step must not complete here either.

An *op table* (int64 array, one row per send or receive) drives the engine:

    OP_FD      socket (non-blocking)
    OP_KIND    KIND_SEND or KIND_RECV
    OP_ADDR    payload address
    OP_CAP     send: payload bytes; receive: buffer capacity
    OP_DONE    bytes moved so far, header included
    OP_HDR_N   header word 0: payload bytes (send: set by the caller;
               receive: as read from the wire)
    OP_HDR_TAG header word 1: tag
    OP_HDR_DL  header word 2: the sender's give-up time
    OP_STATE   ST_PENDING, ST_DONE, or ST_FAILED (OP_ERRNO says why)

A receive whose header announces more than OP_CAP bytes fills the buffer
and discards the rest (so the stream stays aligned); the caller sees
OP_HDR_N > OP_CAP and reports a mismatch. Ops on the same socket and in
the same direction run in table order.

``progress`` loops: each pending op is advanced with non-blocking calls
until it would block; when a whole pass moved nothing it polls ``spin``
more passes (then, when ranks outnumber cores, yields the core between
passes for a short window), then sleeps in ``poll(2)`` on the blocked
sockets (so an oversubscribed rank gives its core away instead of
spinning), in slices
of at most 2 ms, with an MPI progress poke before each once the wait has
lasted 100 us (mpiprogress),
until every op is done, one fails, or the deadline passes.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..base.kind import ABANDON_TAG
from ..base.sync import (
    SLEEP_POKE_NS,
    busy_window,
    monotonic_ns,
    poke,
    realtime_ns,
    sched_yield,
    sigint_arrived,
)

__all__ = ["OP_FD", "OP_KIND", "OP_ADDR", "OP_CAP", "OP_DONE", "OP_HDR_N", "OP_HDR_TAG",
           "OP_HDR_DL", "OP_STATE", "OP_ERRNO", "OP_WORDS", "KIND_SEND", "KIND_RECV", "ST_PENDING",
           "ST_DONE", "ST_FAILED", "HEADER_NBYTES", "IO_OK", "IO_TIMEOUT", "IO_FAILED",
           "IO_INTERRUPTED",
           "ERR_CLOSED", "ERR_ABANDONED", "ABANDON_NOTICE", "progress", "set_send", "set_recv",
           "new_ops", "new_pollfds", "new_scratch", "realtime_ns"]

(OP_FD, OP_KIND, OP_ADDR, OP_CAP, OP_DONE, OP_HDR_N, OP_HDR_TAG, OP_HDR_DL, OP_STATE,
 OP_ERRNO) = range(10)
OP_WORDS = 10          # (the header words must be adjacent: OP_HDR_N, OP_HDR_TAG, OP_HDR_DL)
KIND_SEND, KIND_RECV = 0, 1
ST_PENDING, ST_DONE, ST_FAILED = 0, 1, 2
HEADER_NBYTES = 24
IO_OK, IO_TIMEOUT, IO_FAILED, IO_INTERRUPTED = 0, 1, 2, 3
#: OP_ERRNO of a receive whose peer closed the connection
ERR_CLOSED = -1
#: OP_ERRNO of a receive whose peer sent the abandon notice (see below)
ERR_ABANDONED = -2

#: the header a rank that gives up on a collective writes on each of its
#: sockets before it closes them (TcpTransport.give_up): payload bytes 0,
#: tag ABANDON_TAG, and the culprit word of its flag line in the third word
ABANDON_NOTICE = (0, ABANDON_TAG)

_EAGAIN, _EWOULDBLOCK, _EINTR = 11, 11, 4
_MSG_PEEK = 0x2
_POLLIN, _POLLOUT = 0x001, 0x004
_MSG_NOSIGNAL = 0x4000
#: longest single poll(2) sleep: the deadline is checked, and MPI is let
#: progress (see mpiprogress), at least this often
_POLL_SLICE_MS = 2
_SCRATCH_NBYTES = 1 << 16
#: the most one send(2) is given before the progress loop turns to the other
#: rows: both ends of an exchange send at once, and a slice lets each
#: receive between its sends. 2 x 1 over loopback, 1 MB in two 512 KiB
#: exchanges, bf16 medians on the 2-vCPU Xeon: unsliced 415-524 us, 128 KiB
#: slices 396-399, 256 KiB 350-355 (a plain socket exchange of 1 MB: 353
#: unsliced, 203 in 256 KiB sends, 245 in 64 KiB)
SEND_SLICE_NBYTES = 1 << 18

_I64 = ir.IntType(64)
_I32 = ir.IntType(32)


def _libc_call(builder, name, ret, argtys, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, argtys), name)
    return builder.call(fn, args)


_I8P = ir.IntType(8).as_pointer()


def _syscall(name, ret, argtys, c_args, doc):
    """An intrinsic f(a, b, c) -> int64 (all int64) calling libc ``name``
    with ``c_args(builder, (a, b, c))``; returns its result, or -errno."""
    @intrinsic
    def call(typingctx, a, b, c):
        sig = types.int64(types.int64, types.int64, types.int64)

        def codegen(context, builder, signature, args):
            r = _libc_call(builder, name, ret, argtys, c_args(builder, args))
            return _or_errno(builder, r if ret is _I64 else builder.sext(r, _I64))

        return sig, codegen

    call.__doc__ = doc
    return call


_send = _syscall(
    "send", _I64, [_I32, _I8P, _I64, _I32],
    lambda b, a: [b.trunc(a[0], _I32), b.inttoptr(a[1], _I8P), a[2],
                  ir.Constant(_I32, _MSG_NOSIGNAL)],
    "send(fd, addr, nbytes, MSG_NOSIGNAL) -> bytes or -errno.")
_recv = _syscall(
    "recv", _I64, [_I32, _I8P, _I64, _I32],
    lambda b, a: [b.trunc(a[0], _I32), b.inttoptr(a[1], _I8P), a[2], ir.Constant(_I32, 0)],
    "recv(fd, addr, nbytes, 0) -> bytes (0: closed) or -errno.")
_peek = _syscall(
    "recv", _I64, [_I32, _I8P, _I64, _I32],
    lambda b, a: [b.trunc(a[0], _I32), b.inttoptr(a[1], _I8P), a[2], ir.Constant(_I32, _MSG_PEEK)],
    "recv(fd, addr, nbytes, MSG_PEEK) -> bytes (0: closed) or -errno; leaves them queued.")
_sendmsg = _syscall(
    "sendmsg", _I64, [_I32, _I8P, _I32],
    lambda b, a: [b.trunc(a[0], _I32), b.inttoptr(a[1], _I8P), ir.Constant(_I32, _MSG_NOSIGNAL)],
    "sendmsg(fd, msghdr_addr, MSG_NOSIGNAL) (third argument unused) -> bytes or -errno.")
_poll = _syscall(
    "poll", _I32, [_I8P, _I64, _I32],
    lambda b, a: [b.inttoptr(a[0], _I8P), a[1], b.trunc(a[2], _I32)],
    "poll(fds_addr, nfds, timeout_ms) -> ready count or -errno.")


def _or_errno(builder, r):
    """r if r >= 0, else -errno (read right after the failing call)."""
    neg = builder.icmp_signed("<", r, ir.Constant(_I64, 0))
    with builder.if_else(neg) as (then, otherwise):
        with then:
            loc = _libc_call(builder, "__errno_location", _I32.as_pointer(), [], [])
            err = builder.sext(builder.load(loc), _I64)
            bb_then = builder.block
            v_then = builder.neg(err)
        with otherwise:
            bb_else = builder.block
    phi = builder.phi(_I64)
    phi.add_incoming(v_then, bb_then)
    phi.add_incoming(r, bb_else)
    return phi


def new_ops(nrows):
    return np.zeros((nrows, OP_WORDS), np.int64)


def new_pollfds(nrows):
    """struct pollfd[nrows] (int fd; short events; short revents) as int32 pairs."""
    return np.zeros((nrows, 2), np.int32)


def new_scratch():
    """Room for the msghdr/iovec of a send and for discarding excess bytes."""
    return np.zeros(_SCRATCH_NBYTES // 8, np.int64)


@numba.njit(cache=True, nogil=True)
def set_send(ops, i, fd, addr, nbytes, tag, give_up_ns):
    ops[i, OP_FD] = fd
    ops[i, OP_KIND] = KIND_SEND
    ops[i, OP_ADDR] = addr
    ops[i, OP_CAP] = nbytes
    ops[i, OP_DONE] = 0
    ops[i, OP_HDR_N] = nbytes
    ops[i, OP_HDR_TAG] = tag
    ops[i, OP_HDR_DL] = give_up_ns
    ops[i, OP_STATE] = ST_PENDING
    ops[i, OP_ERRNO] = 0


@numba.njit(cache=True, nogil=True)
def set_recv(ops, i, fd, addr, cap):
    ops[i, OP_FD] = fd
    ops[i, OP_KIND] = KIND_RECV
    ops[i, OP_ADDR] = addr
    ops[i, OP_CAP] = cap
    ops[i, OP_DONE] = 0
    ops[i, OP_HDR_N] = 0
    ops[i, OP_HDR_TAG] = 0
    ops[i, OP_HDR_DL] = 0
    ops[i, OP_STATE] = ST_PENDING
    ops[i, OP_ERRNO] = 0


@numba.njit(cache=True, nogil=True)
def _fail(ops, i, err):
    """Mark op i failed with ``err`` (an errno, or ERR_CLOSED); returns -1."""
    ops[i, OP_STATE] = ST_FAILED
    ops[i, OP_ERRNO] = err
    return -1


@numba.njit(cache=True, nogil=True)
def _advance_send(ops, i, scratch):
    """Move as much of send op i as the socket takes now.
    Returns 1 if bytes moved, 0 if it would block, -1 on failure."""
    fd = ops[i, OP_FD]
    hdr = ops.ctypes.data + (i * OP_WORDS + OP_HDR_N) * 8
    total = HEADER_NBYTES + ops[i, OP_CAP]
    moved = 0
    while ops[i, OP_DONE] < total:
        done = ops[i, OP_DONE]
        if done < HEADER_NBYTES:
            # header and payload in one system call (and one TCP segment)
            # struct msghdr {name, namelen, iov, iovlen, control, controllen, flags}
            m = scratch.ctypes.data
            iov = m + 64
            scratch[0] = 0
            scratch[1] = 0
            scratch[2] = iov
            scratch[3] = 2
            scratch[4] = 0
            scratch[5] = 0
            scratch[6] = 0
            scratch[8] = hdr + done
            scratch[9] = HEADER_NBYTES - done
            scratch[10] = ops[i, OP_ADDR]
            scratch[11] = min(ops[i, OP_CAP], SEND_SLICE_NBYTES)
            r = _sendmsg(fd, m, 0)
        else:
            off = done - HEADER_NBYTES
            r = _send(fd, ops[i, OP_ADDR] + off, min(ops[i, OP_CAP] - off, SEND_SLICE_NBYTES))
        if r > 0:
            ops[i, OP_DONE] = done + r
            moved = 1
            if done + r < total and done + r >= SEND_SLICE_NBYTES:
                return moved   # a slice sent: the other rows first
        elif r == -_EINTR:
            continue
        elif r == -_EAGAIN or r == 0:
            return moved
        else:
            return _fail(ops, i, -r)
    ops[i, OP_STATE] = ST_DONE
    return 1


@numba.njit(cache=True, nogil=True)
def _advance_recv(ops, i, scratch):  # noqa: C901 - the receive state machine (header, body, excess, notice) and the errno cases of recv
    """Move as much of receive op i as has arrived.
    Returns 1 if bytes moved, 0 if it would block, -1 on failure."""
    fd = ops[i, OP_FD]
    hdr = ops.ctypes.data + (i * OP_WORDS + OP_HDR_N) * 8
    moved = 0
    while True:
        done = ops[i, OP_DONE]
        if done < HEADER_NBYTES:
            r = _recv(fd, hdr + done, HEADER_NBYTES - done)
        else:
            total = HEADER_NBYTES + ops[i, OP_HDR_N]
            if done >= total:
                break
            off = done - HEADER_NBYTES
            cap = ops[i, OP_CAP]
            if off < cap:
                r = _recv(fd, ops[i, OP_ADDR] + off, min(cap, ops[i, OP_HDR_N]) - off)
            else:  # excess beyond the buffer: read and drop
                r = _recv(fd, scratch.ctypes.data + 128,
                          min(total - done, scratch.size * 8 - 128))
        if r > 0:
            ops[i, OP_DONE] = done + r
            moved = 1
            if done + r == HEADER_NBYTES:
                if ops[i, OP_HDR_TAG] == ABANDON_TAG:
                    return _fail(ops, i, ERR_ABANDONED)  # the peer gave up
                if ops[i, OP_HDR_N] < 0:
                    return _fail(ops, i, ERR_CLOSED)   # not our protocol
        elif r == 0:
            return _fail(ops, i, ERR_CLOSED)
        elif r == -_EINTR:
            continue
        elif r == -_EAGAIN:
            return moved
        else:
            return _fail(ops, i, -r)
    if _notice_queued(fd, scratch):
        # the sender gave up on this step after sending its part: completing
        # it would return a result of a step that rank dropped
        return _fail(ops, i, ERR_ABANDONED)
    ops[i, OP_STATE] = ST_DONE
    return 1


@numba.njit(cache=True, nogil=True)
def _notice_queued(fd, scratch):
    """True if the next bytes queued on ``fd`` are an abandon notice (one
    non-blocking peek, after a message is complete)."""
    at = scratch.ctypes.data + 128
    if _peek(fd, at, HEADER_NBYTES) != HEADER_NBYTES:
        return False
    return scratch[16] == 0 and scratch[17] == ABANDON_TAG


@numba.njit(cache=True, nogil=True)
def _advance(ops, i, scratch):
    """_advance_send or _advance_recv, by the op's kind."""
    if ops[i, OP_KIND] == KIND_SEND:
        return _advance_send(ops, i, scratch)
    return _advance_recv(ops, i, scratch)


@numba.njit(cache=True, nogil=True)
def _waits_behind(ops, i):
    """True if an earlier op on the same socket and direction is not done."""
    for j in range(i):
        if (ops[j, OP_STATE] == ST_PENDING and ops[j, OP_FD] == ops[i, OP_FD]
                and ops[j, OP_KIND] == ops[i, OP_KIND]):
            return True
    return False


@numba.njit(cache=True, nogil=True)
def kick(ops, k, scratch):
    """One non-blocking pass over ops [0, k) (start sends early). Returns
    IO_FAILED if an op failed, else IO_OK."""
    for i in range(k):
        if ops[i, OP_STATE] != ST_PENDING or _waits_behind(ops, i):
            continue
        if _advance(ops, i, scratch) < 0:
            return IO_FAILED
    return IO_OK


@numba.njit(cache=True, nogil=True)
def progress(ops, k, spin, timeout_ns, pollfds, scratch, hook_addr, yield_ns,  # noqa: C901 - the compiled poll loop: one pass over the ops, then spin, deadline, SIGINT, poke, poll(2)
             state_addr):
    """Complete ops [0, k). Returns IO_OK, IO_FAILED (a row is ST_FAILED),
    IO_TIMEOUT (rows still ST_PENDING) after ``timeout_ns`` of waiting, or
    IO_INTERRUPTED when a SIGINT arrived while it slept (sync.sigint_arrived).
    Every SLEEP_POKE_NS of waiting it lets MPI progress before a sleep
    in poll(2) (``hook_addr``: an mpiprogress hook and the wakeup fd, 0 for
    none). For the first ``yield_ns`` past the spin it yields the core
    instead of sleeping (harmpi.base.sync's yield window: ranks outnumber cores).
    ``state_addr``: the context's wait state (0: none); on a busy host
    (sync.busy_window) the loop does not spin, and yields before it
    sleeps, as the node's waits do."""
    idle = 0
    started = 0
    last_poke = 0
    while True:
        pending = 0
        moved = False
        npoll = 0
        for i in range(k):
            if ops[i, OP_STATE] != ST_PENDING:
                continue
            pending += 1
            if _waits_behind(ops, i):
                continue
            r = _advance(ops, i, scratch)
            if r < 0:
                return IO_FAILED
            if r > 0:
                moved = True
            if ops[i, OP_STATE] == ST_PENDING:
                pollfds[npoll, 0] = ops[i, OP_FD]
                pollfds[npoll, 1] = _POLLOUT if ops[i, OP_KIND] == KIND_SEND else _POLLIN
                npoll += 1
            else:
                pending -= 1
        if pending == 0:
            return IO_OK
        if moved:
            idle = 0
            continue
        idle += 1
        if idle == 1 and spin > 0:
            busy = busy_window(state_addr, monotonic_ns(), yield_ns)
            if busy >= 0:
                spin, yield_ns = 0, busy
        if idle <= spin:
            continue
        now = monotonic_ns()
        if started == 0:
            started = now
            last_poke = now
        left_ms = (timeout_ns - (now - started)) // 1_000_000
        if now - started > timeout_ns:
            return IO_TIMEOUT
        if now - started < yield_ns:
            sched_yield()  # the peer may be the rank this core runs next
            continue
        if sigint_arrived(hook_addr):
            return IO_INTERRUPTED
        if now - last_poke > SLEEP_POKE_NS:
            poke(hook_addr)
            last_poke = now
        if npoll > 0:
            _poll(pollfds.ctypes.data, npoll, max(1, min(left_ms, _POLL_SLICE_MS)))
