"""What a context runs for a collective: its entries, chosen once, when it is made.

=========================================  ====================================
topology and settings                      allreduce entry
=========================================  ====================================
one rank                                   node.SOLO_STEP (compiled)
one node, algorithm auto                   node.ONE_NODE_STEP (compiled)
two equal nodes over tcp, algorithm auto   har_latency.HAR2_STEP (compiled) up
                                           to har_latency_max, PythonEntry above
anything else, or a forced algorithm       PythonEntry (the algorithm objects)
=========================================  ====================================

Every entry is ``entry(ctl, x_addr, n, fmt) -> status``; the compiled ones
also have a C address (``entry_cfunc``, 0 for the others) that the native
module calls. The allgather entry is ``gather(ctl, x_addr, out_addr, n,
fmt, digest) -> status``.
"""

from __future__ import annotations

import os

from .. import node
from ..algorithms import ALGORITHM_IDS, ALLREDUCE, HierAllgather
from ..algorithms.allgather import gather_table
from ..algorithms.allgather_tcp import GATHER_TCP_STEP, gathers_compiled
from ..algorithms.alltoall import HierAlltoall, MpiAlltoall
from ..algorithms.alltoall.many_nodes_tcp import alltoall_compiled
from ..algorithms.base import Call
from ..algorithms.har_latency import HAR2_FINISH, HAR2_START, HAR2_STEP, rail_chunk_nbytes
from ..base import dtypes, kind
from ..errors import HarmpiArgumentError, HarmpiError
from ..node import cma

__all__ = ["PythonEntry", "SizeSwitch", "AutoEntry", "auto_entry", "forced_entry",
           "gather_entry", "alltoall_entry"]

_ITEMSIZE = tuple(f.itemsize for f in dtypes.FORMATS)


class PythonEntry:
    """An all-reduce algorithm written in Python, behind the entry signature.
    ``name``: a forced algorithm, or "auto" (chosen per call by size)."""

    def __init__(self, ctx, name):
        self.ctx = ctx
        self.name = name
        self.code = kind.encode(op=kind.OP_SUM, coll=kind.COLL_ALLREDUCE,
                                algo=ALGORITHM_IDS[name])

    def __call__(self, ctl, x_addr, n, fmt):
        # auto's kind comes from the control block, as the compiled entries'
        # does (a refusal runs this entry with its own: Context.refuse)
        code = int(ctl[0]["auto_code"]) if self.name == "auto" else self.code
        call = Call(x_addr, n, fmt, code | fmt, "allreduce")
        try:
            algo = self.ctx.allreduce_algorithm(self.name, call.nbytes)
        except HarmpiArgumentError:
            raise  # decided by the topology, the same on every rank; nothing moved
        except (HarmpiError, KeyboardInterrupt) as exc:
            # a set-up inside the call (the flat ring's transport) failed on
            # this rank: its peers may be inside this call, so they must fail
            # too, not pair their step with this rank's next call
            self.ctx.setup_failed(call, exc)
            raise
        return self.ctx.run_python(algo.run, call)


class SizeSwitch:
    """A compiled entry up to ``max_nbytes``, another entry above."""

    def __init__(self, small, max_nbytes, large):
        self.small, self.max_nbytes, self.large = small, max_nbytes, large

    def __call__(self, ctl, x_addr, n, fmt):
        if n * _ITEMSIZE[fmt] <= self.max_nbytes:
            return self.small(ctl, x_addr, n, fmt)
        return self.large(ctl, x_addr, n, fmt)


class AutoEntry:
    """Algorithm "auto" on a topology: its entry (and C address, 0 when it
    has none), the split-phase all-reduce ((start, finish, max bytes) for
    async calls, harmpi.node; None: none on this topology) and whether it
    runs the compiled two-node step (har_latency)."""

    def __init__(self, entry, cfunc=0, split=None, har2=False):
        self.entry, self.cfunc, self.split, self.har2 = entry, cfunc, split, har2


def auto_entry(ctx):
    """The :class:`AutoEntry` of ``ctx``'s topology and rail."""
    topo = ctx.topo
    if topo.size == 1:
        return AutoEntry(node.SOLO_STEP, node.SOLO_CFUNC)
    if topo.node_count == 1:
        return AutoEntry(node.ONE_NODE_STEP, node.ONE_NODE_CFUNC,
                         (node.ONE_NODE_START, node.ONE_NODE_FINISH, 1 << 62))
    python = PythonEntry(ctx, "auto")
    rail = ctx.rail_transport()
    if topo.uniform and rail is not None and rail.compiled_rail:
        # har_latency compiled (two nodes: the split-phase pair too; more:
        # its recursive doubling, one call per all-reduce)
        har_max = ctx.thresholds.har_latency_max_nbytes
        split_max = min(har_max, rail_chunk_nbytes(ctx.config.slot_nbytes))
        split = (HAR2_START, HAR2_FINISH, split_max) if topo.node_count == 2 else None
        return AutoEntry(SizeSwitch(HAR2_STEP, har_max, python), 0, split, True)
    return AutoEntry(python)


def forced_entry(ctx, name):
    """The entry of algorithm ``name`` (not "auto"): a :class:`PythonEntry`."""
    if name not in ALLREDUCE:
        raise HarmpiArgumentError(
            f"unknown algorithm {name!r}; choose 'auto' or one of {', '.join(ALLREDUCE)}")
    return node.SOLO_STEP if ctx.topo.size == 1 else PythonEntry(ctx, name)


def gather_entry(ctx):
    """(entry, what its control block points into, or None): the compiled
    one-node allgather where it applies, else the algorithm object."""
    if ctx.topo.node_count == 1 and ctx.topo.uniform:
        table = HierAllgather(ctx).table  # kept alive: ctl holds its address
        # large calls read the peers directly where the kernel lets every
        # local rank (a collective over the node: each rank tries each other)
        ok, why = cma.probe(ctx.node_comm, ctx.config.timeout_s)
        ctx.ctl[0]["cma_pid"] = os.getpid() if ok else 0
        ctx.cma_note = "single copy (process_vm_readv) from " \
            f"{cma.CMA_MIN_NBYTES >> 10} KiB per rank" if ok else f"through the slots ({why})"
        return node.GATHER_STEP, table
    ctx.cma_note = "through the slots (several nodes)"
    if gathers_compiled(ctx.topo.node_count) and ctx.topo.uniform and ctx.har2() is not None:
        # the compiled all-reduce's rail (control block): on 2^k nodes the
        # allgather's steps run compiled on it too
        ctx.cma_note = "through the slots, compiled recursive doubling over the tcp rail"
        return GATHER_TCP_STEP, gather_table(ctx)
    return HierAllgather(ctx), None


def alltoall_entry(ctx):
    """All-to-all: None on one node (the compiled steps of
    harmpi.algorithms.alltoall), else the algorithm object."""
    if ctx.topo.node_count == 1:
        return None
    # two nodes: one rail exchange per step; 2^k > 2 nodes over a compiled
    # tcp rail: G - 1 turns per step whose messages carry every node's
    # counts, so every rank checks every pair (many_nodes_tcp). Elsewhere a
    # disagreeing pair would be seen by its two nodes only: MPI_Ialltoallv's
    # path checks every pair on every rank
    har2 = ctx.har2()
    compiled = har2 is not None and har2.compiled
    if ctx.topo.uniform and (ctx.topo.node_count == 2 or (
            compiled and alltoall_compiled(ctx.topo.node_count))):
        return HierAlltoall(ctx)
    return MpiAlltoall(ctx)
