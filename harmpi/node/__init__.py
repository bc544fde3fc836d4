"""Compiled node-level steps of every algorithm: stage, publish, wait, sum, copy.

Every function here is ``@njit`` with ``cache=True``; the ones Python calls
have explicit signatures (one per storage type: uint16 for bf16/f16,
float32, float64, selected by a zero-length *witness* array of that type),
so they compile once per machine and load in milliseconds afterwards. They
receive raw addresses (``tensor.data_ptr()``) and the rank's control block
(harmpi.base.control), so the Python around a collective stays at one compiled
call.

One concept per module, each using only the ones above it:

``copy``      copy intrinsics: plain, streaming and flushing copies
``dispatch``  the per-storage-type signatures and sum kernels (compile time)
``layout``    the control block's node part (init_control) and the addresses
              of flags, slots and shares
``stamps``    profiling: arrival stamps beside the epochs
``abandon``   giving up: the ABANDONED flag and the culprit word
``flags``     the flag protocol: publish, wait, stage, meta check (its
              docstring has the sequence protocol and why two slots suffice)
``steps``     sum, share and gather the slots of a step; the whole one-node
              all-reduce and allgather
``entries``   what a context runs (f(ctl, x_addr, n, fmt) -> status), and the
              enter/leave every entry starts and ends with
``rowcopy``   rows of raw memory copied by a plan (harmpi.logits' strided copies)

The names other modules use are re-exported here (``node.stage``,
``node.ONE_NODE_STEP``, ...).
"""

from __future__ import annotations

from .abandon import (
    CULPRIT_DISAGREED,
    CULPRIT_INTERRUPTED,
    CULPRIT_REFUSED,
    abandon,
    abandoned_by,
    interrupted,
    peers_abandoned,
    who_abandoned,
)
from .copy import (
    STREAM_MIN_NBYTES,
    copy_bytes,
    done_reading,
    memcpy,
    publish_copy,
    stream_copy,
    streams,
)
from .dispatch import format_itemsize, sigs
from .entries import (
    CFUNC_SIG,
    GATHER_CFUNC,
    GATHER_SIG,
    GATHER_STEP,
    ONE_NODE_CFUNC,
    ONE_NODE_FINISH,
    ONE_NODE_START,
    ONE_NODE_STEP,
    SOLO_CFUNC,
    SOLO_STEP,
    SPLIT_DONE,
    SPLIT_NONE,
    SPLIT_RSAG,
    SPLIT_SMALL,
    STEP_SIG,
    enter,
    entry_point,
    foreign_thread,
    gather_step,
    leave,
    one_node_finish,
    one_node_start,
    one_node_step,
    solo_step,
    thread_self,
)
from .flags import (
    keep_mismatch,
    publish_wait,
    publish_wait_status,
    settle_mismatch,
    stage,
    stage_at,
    stage_check,
    stage_meta,
    stage_post,
)
from .layout import (
    PART_ALIGN_NBYTES,
    flag_addr,
    hook_addr,
    init_control,
    local_rank_of,
    next_slot_addr,
    parity_slot_addr,
    part_bounds,
    ring_pos,
    slot_addr,
    slots2d,
    step_parity,
    wait_addr,
    wake,
)
from .stamps import begin, heard
from .steps import (
    NEVER_RSAG,
    add_into,
    add_publish_sum,
    add_to,
    copy_blocks,
    copy_slot,
    gather_node,
    gather_parts,
    reduce_scatter_allgather,
    shm_allreduce,
    sum_own_part,
    sum_slots,
    tune_state,
)

__all__ = [
    # the control block's node part and its addresses (layout)
    "init_control", "PART_ALIGN_NBYTES", "slots2d", "step_parity", "parity_slot_addr",
    "slot_addr", "next_slot_addr", "part_bounds", "ring_pos", "hook_addr", "wait_addr",
    "flag_addr", "wake", "local_rank_of",
    # copies (copy) and the per-type dispatch (dispatch)
    "memcpy", "stream_copy", "done_reading", "streams", "publish_copy", "copy_bytes",
    "STREAM_MIN_NBYTES", "sigs", "format_itemsize",
    # profiling stamps (stamps) and giving up (abandon)
    "begin", "heard", "abandon", "CULPRIT_INTERRUPTED", "CULPRIT_REFUSED", "CULPRIT_DISAGREED",
    "interrupted",
    "abandoned_by", "peers_abandoned", "who_abandoned",
    # the flag protocol (flags)
    "publish_wait", "publish_wait_status", "stage", "stage_meta", "stage_at", "stage_post",
    "keep_mismatch", "settle_mismatch",
    "stage_check",
    # the data steps (steps)
    "sum_slots", "sum_own_part", "gather_parts", "reduce_scatter_allgather", "tune_state",
    "shm_allreduce", "add_into", "add_to", "copy_slot", "copy_blocks", "gather_node",
    "add_publish_sum",
    "NEVER_RSAG",
    # the entries (entries)
    "thread_self", "foreign_thread", "enter", "leave", "gather_step", "one_node_step",
    "one_node_start", "one_node_finish", "solo_step", "entry_point", "STEP_SIG", "CFUNC_SIG",
    "SPLIT_NONE", "SPLIT_DONE", "SPLIT_SMALL", "SPLIT_RSAG", "ONE_NODE_STEP", "ONE_NODE_CFUNC",
    "SOLO_STEP", "SOLO_CFUNC", "GATHER_SIG", "GATHER_STEP", "GATHER_CFUNC", "ONE_NODE_START",
    "ONE_NODE_FINISH",
]
