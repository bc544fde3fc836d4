"""Single-node all-reduce, large messages: reduce-scatter + allgather in the arena.

Steps (per chunk of at most one slot of m elements):
  1. copy x into my slot, post (size, kind), publish, wait for all, check;
  2. reduce-scatter: rank l sums share l (cache-line aligned 1/L of the
     chunk) of every slot, in rank order, into share l of its own slot —
     only rank l ever reads share l of other slots, so writing in place is safe;
  3. publish and wait again (phase 2);
  4. allgather: copy share j from slot j into x, for every j.

Invariants: each share is summed exactly once, by one rank, then copied, so
every rank holds the same bits. Two phases per step, still no trailing
barrier (the double-buffering argument of harmpi.node holds per step).

Cost (L ranks, m bytes per rank): copy-in m + sum reads m (L shares of m/L)
+ writes m/L + copy-out m: ~3m of memory traffic per rank instead of L*m,
at the price of a second flag round. In harmpi.algorithms.model: 2*F(L) +
copy*2m + sum*m + bus*L*3m. Wins above the model's crossover with shm (auto's
small_max_nbytes), which falls as L grows.
"""

from __future__ import annotations

from .shm import ShmAllreduce

__all__ = ["ShmRsagAllreduce"]


class ShmRsagAllreduce(ShmAllreduce):
    name = "shm_rsag"
    needs = "one node"

    small_max_nbytes = -1  # every step takes the reduce-scatter branch
