"""All-to-all: rank r sends ``send[r][j]`` of its rows to rank j, through the node's slots.

Rank r holds x_r, rows along the first dimension; ``send[r][j]`` of its
rows (in order) go to rank j. Afterwards rank j holds the rows every rank
sent it, rank 0's first. The counts may change on every call (a MoE decode
step routes each token anew): they travel with the data, in the same round.

Modules, in dependency order (each docstring gives its steps, invariants
and cost):

==============  ==============================================================
plan            the per-call plan (named fields shared with _native.cpp) and
                the slot geometry
one_node        one node: compiled, one call (ALLTOALL_STEP, ALLTOALL_CFUNC)
rail_message    across nodes: the rail messages of the two-node Python loop,
                and the told message
rail_told       the compiled rail's told messages and its longer wait
many_nodes_tcp  2^k equal nodes over tcp, two included: G - 1 compiled turns
                per step, every node's counts in each message (A2AG_RUN,
                A2AG_CFUNC, A2AG_ROUND, A2AG_COPY)
two_nodes       HierAlltoall, the context's entry across equal nodes (the
                Python loop over other transports, two nodes)
mpi_fallback    nodes of different sizes, or 2^k < G over tcp, or more than
                two over another transport: MpiAlltoall, a polled
                MPI_Ialltoallv after a check of every pair
==============  ==============================================================

Steps (the entry a context picks, harmpi.runtime.entries): one node:
one_node; 2^k equal nodes over a compiled tcp rail: many_nodes_tcp; two
equal nodes over another rail: two_nodes' loop; else mpi_fallback.
Invariants: every implementation checks every (sender, receiver) count
against the receiver's expectation, and every rank that sees a bad pair
leaves its output unwritten; pure copies, nothing is rounded.
Cost: see each module; rows cross the network once on two nodes.
"""

from .many_nodes_tcp import A2AG_CFUNC, A2AG_COPY, A2AG_ROUND, A2AG_RUN
from .mpi_fallback import REFUSED_ROW_NBYTES, MpiAlltoall
from .one_node import ALLTOALL_CFUNC, ALLTOALL_FINISH, ALLTOALL_START, ALLTOALL_STEP
from .plan import PLAN_FIELDS, geometry, new_plan, pair_error, pair_mismatch, plan_words
from .rail_message import RAIL_COUNTS_BAD, RAIL_TAG_BAD, TOLD_MAGIC, TOLD_NBYTES, TOLD_WORDS
from .two_nodes import HierAlltoall, warm_up

__all__ = ["PLAN_FIELDS", "plan_words", "geometry", "ALLTOALL_STEP", "ALLTOALL_START", "warm_up",
           "ALLTOALL_FINISH", "ALLTOALL_CFUNC", "HierAlltoall", "new_plan", "pair_mismatch",
           "pair_error", "MpiAlltoall", "REFUSED_ROW_NBYTES", "A2AG_ROUND", "A2AG_COPY",
           "A2AG_RUN", "A2AG_CFUNC",
           "RAIL_TAG_BAD", "RAIL_COUNTS_BAD", "TOLD_WORDS", "TOLD_NBYTES", "TOLD_MAGIC"]
