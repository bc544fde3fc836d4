"""The all-to-all across equal nodes of L ranks: HierAlltoall, the context's entry.

Rank (g, l)'s rail peer on node h is (h, l), local rank l there; the
nodes' ranks may be numbered in any order (``ranks``: [g, l] -> rank).
Over a compiled tcp rail on 2^k nodes (two included) the steps are
many_nodes_tcp's, compiled: a call sized from the counts this rank
expects (an even split, recv_counts) is one compiled call (A2AG_RUN; from
C++, A2AG_CFUNC), else one per step and one for its copies. Other node
counts, or nodes of different sizes, take MpiAlltoall (mpi_fallback).
Over any other transport, two nodes run the Python loop below
(HierAlltoall._run_loop), per step:
  1. as on one node: header and blocks into my slot, one flag round;
  2. pack one message for (g', l) (rail_message): does node g have more
     steps, the rows each local rank sends (g', l), my expectations from
     each rank of g'; then the chunk of every local rank's block for
     (g', l), read from their slots;
  3. one rail exchange; the message from g' carries exactly the rows node
     g' sends me;
  4. a status round on the node (a rail that failed or saw a peer that
     disagrees makes every rank of the node fail);
  5. copy out: local senders from their slots, remote senders from the
     message, my own rows from x.

Invariants (the loop): node g's "more" flag reaches every rank of both
nodes, so all ranks run the same number of steps. Both ends of a rail check the counts
that cross it against the receiver's expectation. A bad pair inside a
node is seen by that node's ranks only: they run every step without
copying out, then raise. A late rank: its node's ranks time out in step
1, before their messages, while their rail peers wait in step 3; so a rank
that gives up before its message sends a *told* message instead (the
rank it waited for), and a rail wait gives its peer one more deadline to
send it: every rank of both nodes names the late rank, as the
all-reduce's ranks do.

Cost per step (the loop): two flag rounds and one message to the other
node per rank (all rails in parallel): rows cross the network once. Every byte is
copied into my slot, packed from the slots into the message, and copied
out of the message (local rows: out of the slot).
"""

from __future__ import annotations

import numpy as np

from ... import node
from ...base.arena import FLAG_LINE_NBYTES
from ...base.control import MISMATCH, OK, POISONED, RAIL_FAILED, RAIL_TIMEOUT, RAISED
from ...base.kind import POISON_TAG, rail_tag
from ...errors import HarmpiError, HarmpiMismatchError, HarmpiTimeoutError, HarmpiTransportError
from ..rail_turns import RAIL_ROWS
from . import many_nodes_tcp as many
from . import rail_message as rail
from .one_node import fill_slot, own_rows
from .plan import (
    bad_pair_at,
    expect,
    geometry,
    new_plan,
    pair_error,
    prefix,
    recv,
    recv_off,
    send,
    send_off,
    spread_even_rows,
)

__all__ = ["HierAlltoall", "warm_up"]

_W = np.empty(0, np.uint16)  # (one_node's witness of the flag rounds)


class HierAlltoall:
    """The all-to-all across equal nodes (module docstring), as a context's
    entry: 2^k nodes over a compiled tcp rail, or two over another rail.
    Every node holds L ranks (the context offers MPI_Alltoallv otherwise);
    they may be numbered in any order (``ranks``)."""

    name = "hier_alltoall"

    def __init__(self, ctx):
        self.ctx = ctx
        topo = ctx.topo
        self.G, self.g, self.L, self.l = (topo.node_count, topo.node_index, topo.local_size,
                                          topo.local_rank)
        self.P = self.G * self.L
        self.ranks = np.array(topo.node_ranks, np.int64)  # [g, l] -> rank
        self.me = topo.rank
        self.transport = ctx.rail_transport()
        self.head, self.block = geometry(ctx.config.slot_nbytes, self.P)
        self.msg_head = rail.msg_head_nbytes(self.L)
        self.peers = [p for p in range(self.G) if p != self.g]
        #: over tcp: the steps run compiled, on the rail the compiled
        #: all-reduce set up in the control block (its rows too); on 2^k > 2
        #: nodes they are many_nodes_tcp's (no other path takes more than two)
        har2 = ctx.har2()
        self.compiled = har2 is not None and har2.compiled
        self.many = self.compiled and many.alltoall_compiled(self.G)
        if self.G > 2 and not self.many:
            raise ValueError(f"the rail all-to-all on {self.G} nodes needs a compiled tcp rail "
                             "and 2^k nodes (harmpi.runtime.entries picks MpiAlltoall otherwise)")
        cap = self.msg_head + self.L * self.block
        self.state = np.zeros(many.STATE_WORDS, np.int64)
        self.cfunc = 0
        if self.many:
            cap = many.msg_nbytes(ctx.config.slot_nbytes, self.G, self.L)
            #: my message of a turn, and each node's message to me
            self.msg = np.empty(cap, np.uint8)
            self.bufs = np.empty((self.G, cap), np.uint8)
            #: every rank's send and expect rows ([sender, receiver], [receiver, sender])
            self.send_tab = np.zeros((self.P, self.P), np.int64)
            self.expect_tab = np.zeros((self.P, self.P), np.int64)
            #: the whole call compiled, for harmpi._C's even split (the
            #: control block points at the arrays it reads)
            self.cfunc = many.A2AG_CFUNC
            self.args = np.array([self.send_tab.ctypes.data, self.expect_tab.ctypes.data,
                                  self.ranks.ctypes.data, self.state.ctypes.data,
                                  self.msg.ctypes.data, self.bufs.ctypes.data, self.G, self.g,
                                  cap], np.int64)
            assert self.args.size == many.ARGS_WORDS
            ctx.ctl[0]["a2a_args"] = self.args.ctypes.data
        else:
            self.send_bufs = {p: np.empty(cap, np.uint8) for p in self.peers}
            self.recv_bufs = {p: np.empty(cap, np.uint8) for p in self.peers}
        self.recv = np.zeros(self.P, np.int64)
        self.counts = np.zeros((self.L, self.P), np.int64)
        self.roff = np.zeros(self.P, np.int64)
        #: the told message this rank sends when it gives up before its rail
        #: message (the Python path), and the sends posted, kept to their end
        self.told = np.zeros(rail.TOLD_WORDS, np.int64)
        self.told_sent = []

    def run(self, call, row_nb, plan, make_out):
        """The whole collective (``call``: x and the kind word); ``make_out(
        total_rows)`` -> (out, address) once the receive counts are known.
        Returns out."""
        if self.many:
            return self._run_many(call, row_nb, plan, make_out)
        return self._run_loop(call, row_nb, plan, make_out)

    def _run_loop(self, call, row_nb, plan, make_out):
        """run() over a transport other than tcp: Python around compiled copies."""
        ctx, ctl, P, L, g, me = self.ctx, self.ctx.ctl, self.P, self.L, self.g, self.me
        x_addr, code = call.addr, call.code
        self._send_offsets(plan)
        tag = rail_tag(row_nb, code)
        out = out_addr = failed = None
        k = 0
        while True:
            fill_slot(ctl[0], x_addr, row_nb, plan, P, me, k, self.head, self.block, k == 0)
            rc = node.stage_meta(ctl, 0, row_nb, code, _W)
            if rc not in (OK, MISMATCH):
                self._tell_peers(rc)
                ctx.fail(rc, call)  # a timeout or a peer that gave up: no going on
            local = ctx.error_state() if rc else None
            if k == 0 and local is None:
                counts = self.counts
                longest, bad = rail.scan_headers(ctl[0], counts, self.ranks, g, P, L, me, self.recv)
                longest *= row_nb
            more = int(local is None and longest > (k + 1) * self.block)
            status, anyone_more = self._exchange(call, k, row_nb, tag, plan, counts if
                                                 local is None else None, more)
            # every rank of the node fails alike: a disagreement here, or on a rail
            rc = node.publish_wait_status(ctl, status)
            ctx.settle_status(rc if rc != POISONED else OK, call, local)
            if rc == POISONED:
                raise self._rail_mismatch(call, int(ctl[0]["err_a"]), int(ctl[0]["err_peer"]))
            if k == 0:
                failed, out, out_addr = self._after_first_step(call, row_nb, plan, bad, make_out)
            if failed is None:
                self._copy_out(out_addr, row_nb, k)
            k += 1
            if not anyone_more:
                if failed is not None:
                    raise failed
                return out

    def run_sized(self, call, row_nb, plan, out_addr):
        """run() into an output already sized from the counts this rank
        expects (an even split, or recv_counts): on 2^k nodes over tcp one
        compiled call (many_nodes_tcp.A2AG_RUN); None."""
        if not self.many:
            self.run(call, row_nb, plan, lambda _total: (None, out_addr))
            return
        rc = many.A2AG_RUN(self.ctx.ctl, call.addr, out_addr, row_nb, plan, call.code)
        if rc:
            self._round_failed(call, rc)
        bad = int(plan[bad_pair_at(self.P)])
        if bad >= 0:
            raise pair_error(self.ctx.topo.rank, call.op, *divmod(bad, self.P))

    def _run_many(self, call, row_nb, plan, make_out):
        """run() on 2^k nodes over tcp (many_nodes_tcp): per step one
        compiled call for the rounds and the G - 1 turns, one for the copies.
        A bad pair is seen by every rank after step 0, and none goes on."""
        ctx, ctl, P, state = self.ctx, self.ctx.ctl, self.P, self.state
        self._send_offsets(plan)
        tag = rail_tag(row_nb, call.code)
        bufs, cap, msg = self.args[many.A_BUFS], self.args[many.A_CAP], self.args[many.A_MSG]
        out = out_addr = None
        k = 0
        while True:
            rc = many.A2AG_ROUND(ctl, call.addr, out_addr or 0, row_nb, plan, call.code, k,
                                 self.send_tab, self.expect_tab, self.ranks, self.g, msg, bufs,
                                 cap, tag, state)
            if rc:
                self._round_failed(call, rc)
            if k == 0:
                if state[1] >= 0:
                    raise pair_error(ctx.topo.rank, call.op, *divmod(int(state[1]), P))
                out, out_addr = make_out(int(recv(plan, P).sum()))
            many.A2AG_COPY(ctl, call.addr, out_addr, row_nb, plan, k, self.ranks, self.g, bufs,
                           cap)
            k += 1
            if not state[2]:
                return out

    def _turn_peer(self):
        """The node whose rail peer the failed step waited for or heard from."""
        world = self.ranks[:, self.l]
        return int(np.flatnonzero(world == self.ctx.ctl[0]["rail_peer"])[0])

    def native_failed(self, call, rc):
        """The status to raise for the compiled whole call (harmpi._C's even
        split, many_nodes_tcp.A2AG_CFUNC) that failed with ``rc``: as the
        Python path's, RAISED with the context's pending error."""
        try:
            self._round_failed(call, rc)
        except HarmpiError as exc:
            self.ctx.pending_error = exc
            return RAISED
        return rc

    def _round_failed(self, call, rc):
        """Raise for A2AG_ROUND's (A2AG_RUN's, A2AG_CFUNC's) failed status ``rc``."""
        ctx, state = self.ctx, self.state
        if rc == POISONED:
            raise self._rail_mismatch(call, int(state[3]), int(ctx.ctl[0]["err_peer"]))
        if rc == RAIL_FAILED and state[4]:
            raise self._told_error(call, int(state[5]), int(state[6]),
                                   self._turn_peer() if self.many else None)
        if rc == RAIL_TIMEOUT:  # (after the extra deadline: say how long it waited)
            peer = self._turn_peer() if self.many else self.peers[0]
            # (turn t of many_nodes_tcp waits t + 2 deadlines from its step's start)
            waited_s = (int(state[7]) + 2 if self.many else 2) * ctx.config.timeout_s
            self.transport.raise_timeout(RAIL_ROWS, (peer, peer), waited_s, call,
                                         ops=ctx.har2().ops)
        ctx.fail(rc, call)

    def _send_offsets(self, plan):
        """The plan's send counts (one count for every rank if the plan
        says so) and their offsets."""
        P = self.P
        spread_even_rows(plan, P)
        prefix(send(plan, P), send_off(plan, P), P)

    def _after_first_step(self, call, row_nb, plan, bad, make_out):
        """Step 0 has read every rank's counts: (the error to raise once every
        step has run, out, its address). A bad pair (``bad`` >= 0) is seen
        by the node's ranks only, not by the other nodes: run every step
        (without copying out), then raise. Else out is made, the plan gets
        the receive counts and offsets, and this rank's own rows are copied."""
        P = self.P
        if bad >= 0:
            return pair_error(self.ctx.topo.rank, call.op, *divmod(int(bad), P)), None, None
        total = prefix(self.recv, self.roff, P)
        out, out_addr = make_out(int(total))
        recv(plan, P)[:] = self.recv
        recv_off(plan, P)[:] = self.roff
        own_rows(call.addr, out_addr, row_nb, plan, P, self.me)
        return None, out, out_addr

    def _copy_out(self, out_addr, row_nb, k):
        """Step k's rows into out: this node's from the slots, the other
        nodes' from their messages."""
        rail.local_out(self.ctx.ctl[0], out_addr, self.L, self.g, self.ranks, self.me, row_nb, k,
                       self.head, self.block, self.recv, self.roff)
        for p in self.peers:
            rail.unpack_message(self.recv_bufs[p].ctypes.data, out_addr, self.L, p, self.ranks,
                                row_nb, k, self.block, self.recv, self.roff)

    def _exchange(self, call, k, row_nb, tag, plan, counts, more):
        """Step k's rail exchange with every other node: (status to post,
        whether any node has more steps). ``counts`` None: this node
        disagreed in its flag round; the peers get the poison tag, so that
        they fail too, and their messages are still received (the rails
        stay clean for the next call)."""
        ctx, P, L = self.ctx, self.P, self.L
        rc = node.peers_abandoned(ctx.ctl)  # (ctx.guard, telling the rail peers first)
        if rc != OK:
            self._tell_peers(rc)
            ctx.fail(rc, call)
        sends, recvs = [], []
        for p in self.peers:
            if counts is None:
                sends.append((p, np.empty(0, np.uint8), POISON_TAG))
            else:
                nb = rail.pack_message(ctx.ctl[0], self.send_bufs[p].ctypes.data, p, L, self.l,
                                       self.ranks, row_nb, k, self.head, self.block, counts,
                                       expect(plan, P), more)
                sends.append((p, self.send_bufs[p][:nb], tag))
            recvs.append((p, self.recv_bufs[p]))
            self.recv_bufs[p][:8] = 0  # (no told magic left from an earlier step)
        pending = self.transport.post(sends, recvs)
        try:
            # one more deadline: a peer that gave up first tells why (_tell_peers)
            got = self.transport.complete(pending, 2 * ctx.config.timeout_s, call)
        except (HarmpiTimeoutError, HarmpiTransportError) as exc:
            # (its notice may end this wait before its told message is looked at)
            told = self._told_in(call, self.peers)
            if told is None:
                raise
            raise told from exc
        told = self._told_in(call, [p for p, (nb, t) in zip(self.peers, got)
                                    if t == POISON_TAG and nb == rail.TOLD_NBYTES])
        if told is not None:
            raise told
        status, anyone_more = 0, more
        for p, (nb, t) in zip(self.peers, got):
            if t != tag or nb < self.msg_head:
                status = rail.RAIL_TAG_BAD
                continue
            theirs_more, bad = rail.take_header(self.recv_bufs[p], p, L, self.l, self.ranks,
                                                plan, counts if counts is not None else self.counts,
                                                self.recv, k == 0 and counts is not None)
            anyone_more |= theirs_more
            if bad:
                status = status or rail.RAIL_COUNTS_BAD
        return status, anyone_more

    def _tell_peers(self, rc):
        """This rank gives up on the step (status ``rc``) before its rail
        messages: send each rail peer the told message instead (best effort:
        the give-up that follows tells them anyway, without the culprit)."""
        rail.told_words(self.ctx.ctl[0], rc, self.told)
        for p in self.peers:
            try:
                self.told_sent.append(self.transport.post([(p, self.told.view(np.uint8),
                                                            POISON_TAG)], []))
            except HarmpiError:
                return

    def _told_in(self, call, peers):
        """The error for a told message in the receive buffer of one of
        ``peers``, else None. The culprit this rank's give-up posts is the
        rank the teller waited for, or the rank that gave up first if that
        is not a rank (an interrupt, a refusal)."""
        for p in peers:
            words = self.recv_bufs[p][:rail.TOLD_NBYTES].view(np.int64)
            if words[0] == rail.TOLD_MAGIC:
                return self._told_error(call, int(words[1]), int(words[2]), p)
        return None

    def _told_error(self, call, culprit, giver, p=None):
        """A rail peer (of node ``p``) told this rank that ``giver`` gave up
        first, waiting for ``culprit`` (its culprit word)."""
        topo = self.ctx.topo
        peer = self.ranks[self.peers[0] if p is None else p, self.l]
        if culprit >= 0:
            why = f"rank {giver} gave up waiting for rank {culprit}: it did not arrive in time"
        elif culprit == node.CULPRIT_INTERRUPTED:
            why = f"rank {giver} was interrupted (SIGINT) while it waited"
        elif culprit == node.CULPRIT_REFUSED:
            why = (f"rank {giver} refused its own arguments to this call (its "
                   "HarmpiArgumentError says why) while a peer made it for real")
        elif culprit == node.CULPRIT_DISAGREED:
            why = (f"rank {giver} saw the ranks disagree (another size, dtype, op, collective "
                   "or algorithm) and gave up")
        else:
            why = f"rank {giver} gave up (its transport failed, it timed out or was interrupted)"
        text = (f"rank {topo.rank} (node {topo.node_index}, local rank {topo.local_rank}): "
                f"{call}: {why}; its rail peer rank {peer} told this rank so instead of "
                "sending its part. No rank completes this collective")
        if culprit in (node.CULPRIT_REFUSED, node.CULPRIT_DISAGREED):
            err = HarmpiMismatchError(
                f"{text}; this context is unusable now (the ranks' step counters may differ). "
                "Every rank must make the same calls, with the same sizes and dtypes, in the "
                "same order.", culprit=giver)
            err.unclean = True  # (the context gives up: its peers are mid-collective)
            return err
        return HarmpiTimeoutError(f"{text} (HARMPI_TIMEOUT_S sets the deadline); this context "
                                  "is unusable now.", culprit=culprit if culprit >= 0 else giver)

    def _rail_mismatch(self, call, status, peer):
        topo = self.ctx.topo
        if status == rail.RAIL_COUNTS_BAD:
            why = ("split sizes disagree: the rows a rank of another node sends differ from "
                   "what its receiver expects (recv_counts / output split sizes)")
        else:
            why = ("a rank of another node passed rows of another size or dtype, or refused "
                   "its own arguments")
        return HarmpiMismatchError(
            f"rank {topo.rank} (node {topo.node_index}, local rank {topo.local_rank}): "
            f"{call.op}: ranks disagree: {why} (seen by local rank {peer}). This rank's output "
            "is not complete (every rank that raises this leaves its output unwritten); every "
            "rank must pass the same row shape and dtype, and counts that match what their "
            "receivers expect.")




def warm_up():
    """Compile the kernels HierAlltoall calls from Python (typed at their
    first call) with the types it passes, on scratch memory: harmpi's
    precompile runs this, so a job's first multi-node all-to-all does not."""
    from ...base import control  # noqa: PLC0415

    P, L, slot = 2, 1, 4096
    scratch = np.zeros(2 * slot, np.uint8)
    ctl = control.new()
    c = ctl[0]
    c["slots"], c["slot_nbytes"], c["local_size"], c["steps"] = scratch.ctypes.data, slot, L, 1
    plan = new_plan(P)
    send(plan, P)[:] = 1
    head, block = geometry(slot, P)
    x, out = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
    fill_slot(ctl[0], x.ctypes.data, 8, plan, P, 0, 0, head, block, True)
    ranks = np.arange(P, dtype=np.int64).reshape(P, L)
    counts = np.ones((L, P), np.int64)
    msg = np.zeros(slot, np.uint8)
    rail.pack_message(ctl[0], msg.ctypes.data, 1, L, 0, ranks, 8, 0, head, block, counts,
                      expect(plan, P), 0)
    rows_in, roff = np.zeros(P, np.int64), np.zeros(P, np.int64)
    rail.unpack_message(msg.ctypes.data, out.ctypes.data, L, 1, ranks, 8, 0, block, rows_in, roff)
    rail.local_out(ctl[0], out.ctypes.data, L, 0, ranks, 0, 8, 0, head, block, rows_in, roff)
    own_rows(x.ctypes.data, out.ctypes.data, 8, plan, P, 0)
    rail.scan_headers(ctl[0], counts, ranks, 0, P, L, 0, rows_in)
    rail.take_header(msg, 1, L, 0, ranks, plan, counts, rows_in, True)
    prefix(send(plan, P), send_off(plan, P), P)
    prefix(rows_in, roff, P)
    flags = np.zeros(FLAG_LINE_NBYTES * L // 8, np.int64)
    c["flags"] = flags.ctypes.data
    rail.told_words(ctl[0], OK, np.zeros(rail.TOLD_WORDS, np.int64))
