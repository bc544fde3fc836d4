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
"""

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
#: small integers carried in the meta code, so ranks that forced different
#: algorithms are told so instead of deadlocking
ALGORITHM_IDS = {"auto": 0, **{name: i + 1 for i, name in enumerate(ALLREDUCE)}}
ALGORITHM_NAMES = {i: name for name, i in ALGORITHM_IDS.items()}
