"""What every algorithm receives: a described buffer, and shared helpers."""

from __future__ import annotations

import ctypes

import numpy as np
from mpi4py import MPI

from .. import node
from ..base import dtypes, kind
from ..base.kind import POISON_TAG
from ..config import ALGORITHM_NAMES
from ..errors import HarmpiMismatchError

__all__ = ["Call", "RailAlgorithm", "chunks", "rail_allreduce", "recv_check", "mismatch_error"]


class Call:
    """One collective call, already validated: x[:n] at ``addr``, of storage
    format ``fmt`` (harmpi.base.dtypes), with kind word ``code`` (harmpi.base.kind)."""

    __slots__ = ("addr", "n", "itemsize", "fmt", "w", "code", "op")

    def __init__(self, addr, n, fmt, code, op):
        f = dtypes.FORMATS[fmt]
        self.addr = addr
        self.n = n
        self.itemsize = f.itemsize
        self.fmt = fmt
        self.w = f.witness
        self.code = code
        self.op = op

    @property
    def nbytes(self):
        return self.n * self.itemsize

    def __str__(self):
        return f"{self.op} of {self.n} {dtypes.FORMATS[self.fmt].name}"

    def describe_code(self, code=None):
        """A kind word in words (this call's, or a peer's)."""
        fields = kind.decode(self.code if code is None else code)
        if not fields:
            return "failed"
        fmt = fields["fmt"]
        name = dtypes.FORMATS[fmt].name if fmt < len(dtypes.FORMATS) else fmt
        return f"{name}, algorithm {ALGORITHM_NAMES.get(fields['algo'], fields['algo'])}"


class RailAlgorithm:
    """Common set-up of the algorithms whose every rank talks on its rail."""

    needs = "every node with the same number of ranks"

    def __init__(self, ctx):
        ctx.require_uniform(self.name)
        self.ctx = ctx
        self.transport = ctx.rail_transport()
        self.G = ctx.topo.node_count
        self.g = ctx.topo.node_index
        self.L = ctx.topo.local_size
        self.me = ctx.topo.local_rank
        self.recv_buf = ctx.rail_recv_buffer()
        self.recv_addr = self.recv_buf.ctypes.data


def chunks(call, chunk_elems):
    """Yield (start, address, count) of each chunk of at most ``chunk_elems``
    elements of ``call``'s data; at least one (possibly empty) chunk, so a
    zero-size collective still checks that every rank agrees."""
    start = 0
    while True:
        m = min(chunk_elems, call.n - start)
        yield start, call.addr + start * call.itemsize, m
        start += m
        if start >= call.n:
            return


def recv_check(got, expect_nbytes, expect_tag):
    """True if a received (nbytes, tag) is not what this rank expected."""
    nbytes, tag = got
    return nbytes != expect_nbytes or tag != expect_tag


def rail_allreduce(transport, comm_rank, comm_size, addr, m, call, recv_buf, tag, timeout_s,
                   poisoned=False, guard=None):
    """Sum m elements at ``addr`` over the ranks of ``transport`` in place.

    Recursive doubling, folding the ranks beyond the largest power of two P
    onto ranks [0, G-P) first and sending them the result last. At every
    doubling step both partners compute a + b from the same two values
    (fp addition commutes), so every rank ends with the same bits.
    Returns True if this collective is poisoned (a peer disagreed on size or
    kind, or sent the poison tag); the caller then fails on every rank.
    ``guard(call)``, called before every send, raises once a rank of this
    node gave up (Context.guard), so no partial sum leaves a dropped step.
    """
    G, g = comm_size, comm_rank
    if G == 1:
        return poisoned
    nbytes = m * call.itemsize
    data = MPI.buffer.fromaddress(addr, nbytes) if nbytes else np.empty(0, np.uint8)
    # receive into the whole buffer: a peer that passed a larger tensor must
    # be detected by its count and tag, not abort this rank with a truncation
    recv = recv_buf
    recv_addr = recv_buf.ctypes.data
    P = 1 << (G.bit_length() - 1)

    if g >= P:
        # extra rank: hand our data to the partner, get the total back
        send = (g - P, data, _send_tag(guard, call, poisoned, tag))
        transport.complete(transport.post([send], []), timeout_s, call)
        # the total lands in the whole receive buffer too (not in place): a
        # poisoned partner may send a larger tensor back
        (got,) = transport.complete(transport.post([], [(g - P, recv)]), timeout_s, call)
        if poisoned or recv_check(got, nbytes, tag):
            return True
        ctypes.memmove(addr, recv_addr, nbytes)
        return False
    if g < G - P:
        (got,) = transport.complete(transport.post([], [(g + P, recv)]), timeout_s, call)
        if recv_check(got, nbytes, tag):
            poisoned = True
        else:
            node.add_into(addr, recv_addr, m, call.fmt, call.w)
    k = 1
    while k < P:
        peer = g ^ k
        send = (peer, data, _send_tag(guard, call, poisoned, tag))
        (got,) = transport.complete(transport.post([send], [(peer, recv)]), timeout_s, call)
        if recv_check(got, nbytes, tag):
            poisoned = True
        elif not poisoned:
            node.add_into(addr, recv_addr, m, call.fmt, call.w)
        k <<= 1
    if g < G - P:
        send = (g + P, data, _send_tag(guard, call, poisoned, tag))
        transport.complete(transport.post([send], []), timeout_s, call)
    return poisoned


def _send_tag(guard, call, poisoned, tag):
    """The tag of rail_allreduce's next send (the poison tag once it is
    poisoned), after ``guard`` checked that no rank of this node gave up."""
    if guard is not None:
        guard(call)
    return POISON_TAG if poisoned else tag


def mismatch_error(rank, what, detail):
    return HarmpiMismatchError(
        f"rank {rank}: {what}: ranks disagree ({detail}); every rank must pass a tensor of the "
        "same size and dtype, with the same op and algorithm, in the same order")
