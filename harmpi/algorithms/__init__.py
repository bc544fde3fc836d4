"""All-reduce algorithms (one module each) and the automatic choice.

=============  =================================  =================================
name           topology                           used by ``auto`` for
=============  =================================  =================================
shm            one node                           (auto uses the same loop with the
shm_rsag       one node                            size switch: <= small_max: shm)
har_latency    several nodes, same L on each      up to har_latency_max bytes
har_bandwidth  several nodes, same L on each      above har_latency_max bytes
leader         any                                nodes of different sizes
flat_ring      any (ignores shared memory)        never: a benchmark baseline
=============  =================================  =================================

The two switches, where not set, come from the cost model (``model``: every
algorithm's latency and per-byte cost in L and N; ``model_rows``: the
measurements its built-in constants are fitted to; ``model_file``: a host's
own constants, written by ``python -m harmpi.tune``). ``rail_turns`` holds
the compiled rail schedules har_latency runs over tcp (recursive doubling,
and recursive halving for large steps on 2^k one-rank nodes).
"""

from ..config import ALGORITHM_IDS, ALGORITHM_NAMES, ALGORITHMS
from .allgather import HierAllgather
from .flat_ring import FlatRingAllreduce
from .har_bandwidth import HarBandwidthAllreduce
from .har_latency import HarLatencyAllreduce
from .leader import LeaderAllreduce
from .shm import ShmAllreduce
from .shm_rsag import ShmRsagAllreduce

__all__ = ["ALLREDUCE", "HierAllgather", "ShmAllreduce", "ShmRsagAllreduce",
           "HarLatencyAllreduce", "HarBandwidthAllreduce", "LeaderAllreduce",
           "FlatRingAllreduce", "ALGORITHM_IDS", "ALGORITHM_NAMES"]

ALLREDUCE = {cls.name: cls for cls in (ShmAllreduce, ShmRsagAllreduce, HarLatencyAllreduce,
                                       HarBandwidthAllreduce, LeaderAllreduce, FlatRingAllreduce)}
if tuple(ALLREDUCE) != ALGORITHMS:  # the ids (config.ALGORITHM_IDS) follow config's order
    raise ImportError(f"harmpi.algorithms.ALLREDUCE lists {tuple(ALLREDUCE)}, "
                      f"harmpi.config.ALGORITHMS {ALGORITHMS}: one order for both")
