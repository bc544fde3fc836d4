"""torch.distributed backend "harmpi": existing torch code runs on harmpi with one word changed.

    import harmpi.distributed                       # registers the backend
    import torch.distributed as dist
    dist.init_process_group("harmpi")               # env:// (the launcher sets MASTER_ADDR)
    dist.all_reduce(t)                              # harmpi's all-reduce

``import harmpi`` registers it as well when the program imported torch
before harmpi; harmpi never imports torch on its own.

How it plugs in. torch lets a backend be a ``dist.ProcessGroup`` subclass
written in Python: the creator given to ``dist.Backend.register_backend``
returns :class:`ProcessGroupHarmpi`, and torch uses it as the group itself.
torch's Python collectives (``dist.all_reduce``...) call its methods
directly; its C++ side (functional collectives, DTensor) reaches the same
methods through torch's trampoline class. Each group is one MPI
communicator and one harmpi context: the default group is MPI.COMM_WORLD
(shared with ``harmpi.allreduce``, so the two may be mixed in program
order), a ``new_group`` gets a communicator of its own ranks (a TP group
inside a larger world, a group spanning virtual nodes).

Rank and world size come from MPI. torch's env:// rendezvous needs
MASTER_ADDR and MASTER_PORT, which harmpi's launcher (and torchrun) set;
under plain mpirun, ``init_method="mpi://"`` (any backend) rendezvouses
over MPI instead.

The package, one concept a module:

==========  ===========================================================
group       ProcessGroupHarmpi: the collectives, what each call does
mpicolls    its base: the collectives MPI carries (broadcast, p2p, ...), barriers
channel     their base: the group's state, MPI channel, headers, lifetime
work        the work objects the calls return
waits       every wait on MPI, under the group's deadline
tables      dtype, op and call codes the ranks agree on
tensors     argument checks and the tensors' memory as MPI buffers
creation    the group torch's creator asks for
rendezvous  ``init_method="mpi://"``
==========  ===========================================================

Versions: written against torch 2.13's ``ProcessGroup`` Python API and
checked there; the creator refuses torch older than 2.6 with a clear
error (``MIN_TORCH``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import HarmpiError
from ..platform import worldenv
from .channel import BACKEND
from .creation import create_group
from .group import ProcessGroupHarmpi
from .rendezvous import RENDEZVOUS, install_rendezvous

__all__ = ["BACKEND", "MIN_TORCH", "RENDEZVOUS", "ProcessGroupHarmpi", "register"]

#: oldest torch whose ProcessGroup Python API this package relies on
MIN_TORCH = (2, 6)


def _torch_version():
    parts = torch.__version__.split("+")[0].split(".")
    return tuple(int(p) if p.isdigit() else 0 for p in parts[:2])


def _create(backend_opts, pg_options=None):
    """The creator torch calls (extended API) for every group of backend
    "harmpi" (harmpi.distributed.creation). It reads ``MIN_TORCH`` here, at
    each call, so a program (or a test) that sets it is obeyed."""
    if _torch_version() < MIN_TORCH:
        raise HarmpiError(f"harmpi backend needs torch >= {'.'.join(map(str, MIN_TORCH))}; "
                          f"this is torch {torch.__version__}")
    return create_group(backend_opts)


_registered = False


def register():
    """Register backend "harmpi" for CPU with torch.distributed (idempotent;
    importing this package calls it, and so does ``import harmpi`` when torch
    is imported already), the MPI rendezvous ``mpi://``, and the torch op
    ``torch.ops.harmpi.all_reduce_`` when the native module is built; under
    an MPI launcher, RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE where
    unset (harmpi.platform.worldenv)."""
    global _registered
    if _registered:
        return
    _registered = True
    worldenv.export()
    if not dist.is_available():
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    install_rendezvous()


register()  # importing this package is how a program asks for the backend
