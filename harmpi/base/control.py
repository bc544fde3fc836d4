"""The control block: one rank's per-context state, as one typed record.

Every compiled step receives it (a one-element numpy structured array; in
compiled code ``c = ctl[0]`` and then ``c.epoch``), so a step's arguments
stay (control, address, count, format). It holds the arena geometry, this
rank's counters, the settings the steps read, the state of the last failure
and the rail resources of the compiled two-node step. The C++ entry point
(harmpi/_native.cpp) reads one field, ``gate``, at the offset it is given.

This module also owns the status codes every step returns.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

__all__ = ["FIELDS", "CONTROL", "RECORD", "ARRAY", "new", "offset", "control_at", "STATUS_NAMES",
           "OK", "TIMEOUT", "MISMATCH", "POISONED", "RAIL_TIMEOUT", "RAIL_FAILED", "RAISED",
           "ABANDONED", "BUSY", "INTERRUPTED", "RAIL_LATE", "WRONG_THREAD", "voidptr"]

#: (field, meaning); every field is an int64
FIELDS = (
    ("epoch", "flag rounds this rank has published"),
    ("steps", "steps started; slot parity of step k is k % 2"),
    ("flags", "address of the node's flag lines"),
    ("slots", "address of the node's first slot"),
    ("slot_nbytes", "bytes per slot"),
    ("local_size", "ranks on this node (L)"),
    ("local_rank", "this rank's index on the node"),
    ("spin", "busy polls of a wait before it yields (wait policy spin)"),
    ("sleepers", "address of the node's sleeper lines (0: waits never sleep)"),
    ("wait_policy", "wait state (7 adjacent words, harmpi.base.sync WS_*): sync.WAIT_*"),
    ("wait_gap", "the running mean of recent waits (ns; policy auto)"),
    ("wait_floor", "the least a wait spins before it sleeps (ns; policy auto)"),
    ("wait_cap", "the most a wait spins before it sleeps (ns; policy auto)"),
    ("wait_slice", "longest futex sleep between looks (ns; 0: sync.SLEEP_SLICE_NS)"),
    ("wait_expired", "sleeps that lasted a whole slice (not woken by a publish)"),
    ("wait_yield", "after the spin, how long a wait polls with sched_yield before it sleeps (ns)"),
    ("wait_busy_fd", "busy-host look: /proc/loadavg's fd + 1 (0: waits never look)"),
    ("wait_busy_buf", "busy-host look: address of its 64-byte read buffer"),
    ("wait_busy_cpus", "busy-host look: the host's CPUs"),
    ("wait_busy_at", "busy-host look: when a wait last looked (ns, monotonic)"),
    ("wait_busy", "busy-host look: running score, 0-1024 (busy from sync.BUSY_SCORE)"),
    ("timeout_ns", "deadline of every wait"),
    ("err_peer", "failed step: the local rank (or rail op) concerned"),
    ("err_a", "failed step: epoch awaited, or the peer's byte count"),
    ("err_b", "failed step: value seen, or the peer's kind"),
    ("saved_peer", "a node mismatch kept while the step ends poisoned"),
    ("saved_a", ""),
    ("saved_b", ""),
    ("auto_code", "kind of an auto all-reduce, without its format"),
    ("small_max_nbytes", "one node: steps up to this size sum every slot"),
    ("mode", "how this call moves slot data (copytune.MODE_*: plain, stream, flush)"),
    ("tuning", "1: the mode comes from the copy-mode tuner (local rank 0 decides)"),
    ("tune_table", "address of the node's shared mode table (one word per size bucket)"),
    ("tune_state", "address of local rank 0's tuner state (int64[copytune.STATE_WORDS])"),
    ("ring", "slot byte position of the next small step (the same on every local rank)"),
    ("gate", "1 while the native entry point may run this context"),
    ("abandoned", "non-zero once this rank gave up on a collective (every entry refuses)"),
    ("busy", "1 while an entry runs (a second thread's call is refused)"),
    ("coll_epoch", "epoch when the running collective started (a peer past it is inside it)"),
    ("local_ranks", "address of int64[L]: communicator rank of each local rank"),
    ("rail_peer", "two-node step: communicator rank of the rail peer"),
    ("rail_fd", "two-node step: socket to the rail peer"),
    ("rail_recv", "two-node step: receive buffer address"),
    ("rail_recv_cap", "two-node step: its size"),
    ("rail_spin", "two-node step: transport polls before sleeping"),
    ("rail_ops", "two-node step: sockio op rows (2 x OP_WORDS int64)"),
    ("rail_pollfds", "two-node step: struct pollfd[2]"),
    ("rail_scratch", "two-node step: sockio scratch"),
    ("rail_scratch_len", "two-node step: its length in int64 words"),
    ("rail_node", "rail step: this rank's node index"),
    ("rail_nodes", "rail step: the node count G"),
    ("rail_fds", "rail step, G > 2: address of int64[G], the socket to each node's rail peer"),
    ("rail_world", "rail step, G > 2: address of int64[G], each rail peer's communicator rank"),
    ("split", "a started split-phase all-reduce (node.SPLIT_*): what its finish does"),
    ("split_pos", "its slot position (small one-node step)"),
    ("gather_table", "allgather: int64[L, G] communicator rank of (local rank, node)"),
    ("gather_nodes", "allgather: G"),
    ("a2a_args", "all-to-all over the tcp rail: address of its int64 words "
                 "(harmpi.algorithms.alltoall.many_nodes_tcp.ARGS_WORDS)"),
    ("cma_pid", "one-node allgather: this rank's pid when local ranks read each other's memory "
                "(harmpi.node.cma), else 0"),
    ("hook_fn", "mpiprogress hook (4 adjacent words): MPI_Iprobe's address"),
    ("hook_comm", ""),
    ("hook_source", ""),
    ("hook_tag", ""),
    ("hook_sigfd", "Python's signal wakeup fd that harmpi reads (-1: none)"),
    ("profile", "0: profiling off; else the address of its int64 state (harmpi.record.recorder)"),
    ("stamps", "address of the node's stamp lines (harmpi.base.arena)"),
    ("prof_enter_ns", "profiling: entry time of the running collective (monotonic)"),
    ("prof_nbytes", "profiling: its bytes"),
    ("prof_code", "profiling: its kind word"),
    ("prof_stamp", "profiling: the arrival time the next publish posts (0: none)"),
    ("prof_who", "profiling: the communicator rank that arrival is of"),
    ("prof_first_ns", "profiling: first arrival heard of in this collective"),
    ("prof_last_ns", "profiling: last arrival heard of"),
    ("prof_last_rank", "profiling: who arrived last"),
    ("prof_arrivals", "profiling: how many arrivals were heard of"),
    ("prof_rt_skew_ns", "profiling: the rail peer's CLOCK_REALTIME minus this rank's"),
    ("prof_rt_mono_ns", "profiling: this host's CLOCK_REALTIME minus CLOCK_MONOTONIC"),
    ("owner", "pthread_self() of the thread that made the context: the one thread whose "
              "calls run (0: any; harmpi.runtime.registry)"),
)

CONTROL = np.dtype([(name, np.int64) for name, _ in FIELDS])
RECORD = numba.from_dtype(CONTROL)
#: numba type of a control block (a one-element array)
ARRAY = RECORD[::1]

#: step statuses (OK = 0; every other value is a failure the context explains)
(OK, TIMEOUT, MISMATCH, POISONED, RAIL_TIMEOUT, RAIL_FAILED, RAISED, ABANDONED, BUSY,
 INTERRUPTED, RAIL_LATE, WRONG_THREAD) = range(12)
STATUS_NAMES = ("ok", "timeout", "mismatch", "poisoned", "rail timeout", "rail failed", "raised",
                "abandoned", "busy", "interrupted", "rail late", "wrong thread")


def offset(name: str) -> int:
    """Byte offset of a field in the block."""
    return CONTROL.fields[name][1]


#: the mpiprogress hook's words are read at one address (sync.poke)
HOOK_OFFSET = offset("hook_fn")
assert [offset(f) - HOOK_OFFSET
        for f in ("hook_fn", "hook_comm", "hook_source", "hook_tag", "hook_sigfd")] \
    == [0, 8, 16, 24, 32]
#: and the wait state's (sync.WS_*)
WAIT_OFFSET = offset("wait_policy")
assert [offset(f) - WAIT_OFFSET for f in ("wait_policy", "wait_gap", "wait_floor", "wait_cap",
                                         "wait_slice", "wait_expired", "wait_yield",
                                         "wait_busy_fd", "wait_busy_buf", "wait_busy_cpus",
                                         "wait_busy_at", "wait_busy")] \
    == [8 * i for i in range(12)]


def new() -> np.ndarray:
    """A zeroed control block."""
    return np.zeros(1, CONTROL)


@intrinsic
def voidptr(typingctx, addr):
    sig = types.voidptr(types.intp)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return sig, codegen


@numba.njit(cache=True, nogil=True)
def control_at(addr):
    """The control block at ``addr`` (for C callers, which pass an address)."""
    return numba.carray(voidptr(addr), (1,), CONTROL)
