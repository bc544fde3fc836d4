"""Choosing, per message size, how ranks move data through the shared slots.

Three modes for a slot that the other local ranks read next:

* MODE_PLAIN: plain stores; the lines stay Modified in the writer's private
  cache and each reader pulls them core to core. Fastest when the cores
  share a last-level cache (one core complex).
* MODE_STREAM: streaming (non-temporal) stores; the lines go to memory and
  the readers' prefetchers stream them back. Can win when a core-to-core
  pull is slow (cores on different core complexes or sockets).
* MODE_FLUSH: plain stores, and every reader flushes (clflushopt) the peer
  lines it has read. Rewriting a line that another core still holds costs
  the writer an invalidation round trip per line; on this VM in its slow
  phases that made rewriting 512 KB take 233 us instead of 13 us, and the
  reader's flush brings it to 42 us (plus ~25 us of flushing).

Which one wins depends on where the ranks' cores are and, on a VM, on what
the host does from one minute to the next (measured on the 2-vCPU EPYC VM
this was written on, 10 KB calls: 7.4 us plain vs 4.0 us streaming in one
phase, 2.7 vs 3.3 us in another). So local rank 0 measures and decides, for
each size bucket (bit length of the collective's byte count), and publishes
the choice in a shared word of the arena that every local rank reads at the
start of a call. Correctness does not depend on the choice: a rank that
reads a stale word only moves its bytes another way.

The decision (local rank 0 only, per bucket), in cycles of ``cycle`` calls:

1. calls [0, SKIP + PROBE): the next other mode in turn; the last PROBE
   calls are timed;
2. calls [SKIP + PROBE, 2 * (SKIP + PROBE)): the current mode, timed the same way;
3. then keep the current mode unless the probe's median was at least
   SWITCH_GAIN faster. A switch resets ``cycle`` to CYCLE_MIN calls; once
   every other mode has lost in turn, ``cycle`` doubles up to CYCLE_MAX, so
   a stable machine probes rarely.

The first SKIP calls of each phase are not timed: the other ranks pick up a
new word one call late. Times are the rank's own whole-call time in
timestamp-counter ticks (a few ns to read; only ratios are used).

Cost: two counter reads and a few array updates per call on rank 0, and a
24-element median once per phase.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .sync import load_acquire, store_release

__all__ = ["MODE_PLAIN", "MODE_STREAM", "MODE_FLUSH", "NMODES", "NBUCKETS", "STATE_WORDS",
           "TABLE_NBYTES", "read_ticks", "bucket_of", "choose", "record", "init_state"]

MODE_PLAIN, MODE_STREAM, MODE_FLUSH = 0, 1, 2
NMODES = 3
#: buckets by bit length of the byte count (0 .. 63)
NBUCKETS = 64
TABLE_NBYTES = NBUCKETS * 8
SKIP = 2
PROBE = 24
#: switch when probe median < SWITCH_GAIN * current median
SWITCH_GAIN = 0.92
CYCLE_MIN = 256
CYCLE_MAX = 8192

# per-bucket words of rank 0's private state, then the sample buffers
_S_MODE, _S_CALLS, _S_CYCLE, _S_NEXT = 0, 1, 2, 3
_S_WORDS = 4
_SAMPLES = 2 * PROBE
STATE_WORDS = NBUCKETS * (_S_WORDS + _SAMPLES)


@intrinsic
def read_ticks(typingctx):
    """The CPU's cycle/timestamp counter (rdtsc on x86): cheap, monotonic on
    one core, unit unknown — only for comparing durations on one rank."""
    sig = types.int64()

    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic("llvm.readcyclecounter", (),
                                              ir.FunctionType(ir.IntType(64), []))
        return builder.call(fn, [])

    return sig, codegen


@numba.njit(cache=True, nogil=True)
def bucket_of(nbytes):
    b = 0
    while nbytes > 0 and b < NBUCKETS - 1:
        nbytes >>= 1
        b += 1
    return b


def init_state(state, table, mode):
    """Fill rank 0's private state and the shared table with ``mode``."""
    state[:] = 0
    for b in range(NBUCKETS):
        state[b * _S_WORDS + _S_MODE] = mode
        state[b * _S_WORDS + _S_CYCLE] = CYCLE_MIN
        state[b * _S_WORDS + _S_NEXT] = 1
    if table is not None:
        table[:] = mode


@numba.njit(cache=True, nogil=True)
def choose(state, table_addr, leader, tuning, nbytes):
    """Mode for this call. The leader (when tuning) advances the bucket's
    cycle and publishes the mode in the shared table; others read it."""
    b = bucket_of(nbytes)
    word = table_addr + b * 8
    if not (leader and tuning):
        return load_acquire(word)
    s = b * _S_WORDS
    mode = state[s + _S_MODE]
    calls = state[s + _S_CALLS]
    if calls < SKIP + PROBE:
        mode = (mode + state[s + _S_NEXT]) % NMODES
    if load_acquire(word) != mode:
        store_release(word, mode)
    return mode


@numba.njit(cache=True, nogil=True)
def record(state, nbytes, ticks):
    """Leader only, after a tuned call: file its duration and maybe decide."""
    b = bucket_of(nbytes)
    s = b * _S_WORDS
    calls = state[s + _S_CALLS]
    phase_len = SKIP + PROBE
    samples = NBUCKETS * _S_WORDS + b * _SAMPLES
    if calls < 2 * phase_len:
        k = calls % phase_len
        if k >= SKIP:
            state[samples + (calls // phase_len) * PROBE + k - SKIP] = ticks
        if calls == 2 * phase_len - 1:
            probe = np.median(state[samples: samples + PROBE].astype(np.float64))
            current = np.median(state[samples + PROBE: samples + _SAMPLES].astype(np.float64))
            nxt = state[s + _S_NEXT]
            if probe < SWITCH_GAIN * current:
                state[s + _S_MODE] = (state[s + _S_MODE] + nxt) % NMODES
                state[s + _S_CYCLE] = CYCLE_MIN
                state[s + _S_NEXT] = 1
            elif nxt + 1 < NMODES:
                state[s + _S_NEXT] = nxt + 1        # probe the next mode next cycle
            else:
                state[s + _S_NEXT] = 1
                state[s + _S_CYCLE] = min(2 * state[s + _S_CYCLE], CYCLE_MAX)
    calls += 1
    if calls >= max(state[s + _S_CYCLE], 2 * phase_len):
        calls = 0
    state[s + _S_CALLS] = calls
