"""harmpi: hierarchical all-reduce for CPU-only tensor-parallel inference.

    import harmpi
    harmpi.allreduce(t)          # in place, every rank of MPI.COMM_WORLD
    g = harmpi.allgather(shard)  # concatenation along dim 0

Shared memory (an MPI shared window) inside each node, one cross-node
exchange per collective between nodes. See README.md.
"""

__version__ = "0.1.0"

from .api import barrier, finalize, info, init  # noqa: E402
from . import allgather, allreduce  # noqa: E402  (callable modules, see allreduce.py)
from .config import ALGORITHMS, Config  # noqa: E402
from .errors import (HarmpiArgumentError, HarmpiError, HarmpiMismatchError,  # noqa: E402
                     HarmpiTimeoutError, HarmpiTransportError)

__all__ = ["allreduce", "allgather", "barrier", "init", "finalize", "info", "ALGORITHMS",
           "Config", "HarmpiError", "HarmpiArgumentError", "HarmpiMismatchError",
           "HarmpiTimeoutError", "HarmpiTransportError", "__version__"]
