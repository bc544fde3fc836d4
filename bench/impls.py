"""Adapters for the implementations a benchmark compares.

One adapter class per implementation, shared by every benchmark:

* the OSU harness (``bench.osu``) asks it to turn "a collective of ``count``
  elements of ``dtype``" into a prepared operation whose ``run()`` only moves
  data (allocation happens in ``prepare``, as in Gloo's algorithm classes),
  plus ``result()`` to read the output back as a numpy storage array (bf16
  as uint16 bits);
* the decode benchmark (``bench.decode``) calls ``allreduce(tensor)`` and
  ``allgather(tensor)`` on the torch tensors of its model, as a script would.

``make_impls`` creates the adapters (and sets harmpi up once),
``close_impls`` releases them.  The contract is ``bench.impl_base``; the
adapters are ``impl_harmpi``, ``impl_mpi``, ``impl_torch`` and
``deepspeed_op``, which import the contract, never this module.

``harmpi`` / ``harmpi:<algorithm>``
    ``harmpi.allreduce(t)`` / ``harmpi.allgather(t)`` on a torch tensor of the
    requested dtype (bf16 by default); ``:<algorithm>`` forces one of
    ``harmpi.ALGORITHMS``.
``mpi``
    mpi4py on the same ranks.  Allreduce: ``comm.Allreduce(MPI.IN_PLACE, buf,
    MPI.SUM)``; MPI has no bf16 (Open MPI) and no portable f16, so bf16 and
    f16 are compared against **float32 with the same bytes** (half as many
    elements; a 2-byte message sends one float32).  Allgather moves bytes, so
    it uses the requested dtype as is.  On tensors, bf16 and f16 are
    converted to float32 and back around ``MPI_Allreduce``.
``gloo`` (also ``torch:gloo``) / ``torch:harmpi``
    ``torch.distributed`` on the same ranks, called as an engine calls it:
    ``dist.all_reduce(t, group=g)`` and ``dist.all_gather_single(out, t,
    group=g)`` on a process group of backend gloo or harmpi (one adapter,
    ``TorchImpl``, with the backend word as its only difference).  One job
    may hold both: the first backend asked for gets the default group (rank
    0 starts a TCPStore on a free port and broadcasts it through MPI), the
    other a ``dist.new_group`` over all ranks (``TorchGroups``).  Tensors of
    the requested dtype.  Gloo takes milliseconds per call, so its
    iterations are capped (``--gloo-max-iters``).
``gloo:unbound``
    gloo again, on a group of its own whose threads were started with every
    CPU of the host allowed (the calling thread stays bound like every other
    implementation's).  Gloo works in threads of its own that, under
    mpirun's default binding, share the rank's one core with the caller;
    comparing the two says what the binding costs gloo.
``deepspeed``
    DeepSpeed's CPU shared-memory all-reduce, the closest rival:
    ``torch.ops.deepspeed.inference_all_reduce_(t)``; its adapter, and the
    build of DeepSpeed's op it needs, are ``bench.deepspeed_op``.
"""

from __future__ import annotations

from typing import Sequence

from bench.deepspeed_op import DeepSpeedImpl
from bench.impl_base import (
    Impl,
    ImplUnavailable,
    Prepared,
    storage_from_torch,
    tensor_dtype,
    torch_from_storage,
)
from bench.impl_harmpi import HarmpiImpl
from bench.impl_mpi import MpiImpl
from bench.impl_torch import GLOO_UNBOUND, TORCH_BACKENDS, FuncolImpl, TorchGroups, TorchImpl

__all__ = [
    "Impl",
    "Prepared",
    "ImplUnavailable",
    "parse_impls",
    "make_impls",
    "close_impls",
    "HarmpiImpl",
    "MpiImpl",
    "TorchImpl",
    "TorchGroups",
    "DeepSpeedImpl",
    "harmpi_info_of",
    "torch_backend",
    "torch_from_storage",
    "storage_from_torch",
    "tensor_dtype",
    "IMPL_KINDS",
    "FuncolImpl",
    "TORCH_BACKENDS",
    "GLOO_UNBOUND",
]

IMPL_KINDS = ("harmpi", "mpi", "gloo", "torch", "funcol", "deepspeed")


def torch_backend(name: str) -> str | None:
    """'gloo' and 'torch:gloo' -> 'gloo', 'torch:harmpi' -> 'harmpi'; None for the others."""
    kind, _, rest = name.partition(":")
    if kind == "gloo" and rest in ("", "unbound"):
        return "gloo"
    return rest if kind == "torch" else None


def parse_impls(spec: str) -> list[str]:
    """'harmpi,harmpi:shm,mpi,gloo,torch:harmpi' -> names, checked for kind and duplicates.

    ``gloo`` is short for ``torch:gloo`` (the two are one implementation)."""
    names = [part.strip() for part in spec.split(",") if part.strip()]
    if not names:
        raise ValueError("--impl needs at least one implementation")
    for name in names:
        kind, _, algorithm = name.partition(":")
        if kind not in IMPL_KINDS:
            raise ValueError(
                f"unknown implementation {name!r}; choose from harmpi, harmpi:<algorithm>, "
                f"mpi, gloo, {', '.join(f'torch:{b}' for b in TORCH_BACKENDS)}, "
                f"{', '.join(f'funcol:{b}' for b in TORCH_BACKENDS)}, deepspeed"
            )
        if kind in ("torch", "funcol") and algorithm not in TORCH_BACKENDS:
            raise ValueError(f"{kind} takes a backend, one of {', '.join(TORCH_BACKENDS)}, "
                             f"not {name!r}")
        if kind == "gloo" and algorithm not in ("", "unbound"):
            raise ValueError(f"gloo takes no option but unbound, not {name!r}")
        if algorithm and kind not in ("harmpi", "torch", "funcol", "gloo"):
            raise ValueError(f"only harmpi takes an algorithm, not {name!r}")
        if kind in ("mpi", "deepspeed") and ":" in name:
            raise ValueError(f"{kind} takes no option, not {name!r}")
        if kind == "harmpi" and ":" in name and not algorithm:
            raise ValueError(f"empty algorithm in {name!r}")
    keys = [("torch", torch_backend(n), n == GLOO_UNBOUND) if torch_backend(n) else n
            for n in names]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate implementation in {spec!r}")
    return names


def make_impls(names: Sequence[str], comm, *, gloo_max_iterations: int | None = 50) -> list[Impl]:
    """Create the adapters (collectively: every rank must call this with the same names)."""
    impls: list[Impl] = []
    harmpi_module = None
    groups = None
    for name in names:
        kind, _, algorithm = name.partition(":")
        backend = torch_backend(name)
        if kind == "funcol":
            groups = groups or TorchGroups(comm)
            impls.append(FuncolImpl(name, algorithm, groups))
        elif backend is not None:
            groups = groups or TorchGroups(comm)
            cap = gloo_max_iterations if backend == "gloo" else None
            impls.append(TorchImpl(name, backend, groups, cap, unbound=name == GLOO_UNBOUND))
        elif kind == "harmpi":
            impl = HarmpiImpl(comm, algorithm or None)
            if harmpi_module is None:
                harmpi_module = impl._harmpi
                harmpi_module.init(comm=comm)
            impls.append(impl)
        elif kind == "mpi":
            impls.append(MpiImpl(comm))
        elif kind == "deepspeed":
            # gloo's cap: an oversubscribed DeepSpeed takes milliseconds per call too
            impls.append(DeepSpeedImpl(comm, max_iterations=gloo_max_iterations))
    return impls


def harmpi_info_of(impls: Sequence[Impl]) -> dict | None:
    """harmpi.info() of the first adapter that runs on harmpi (for the header), else None."""
    for impl in impls:
        info = impl.info()
        if info is not None:
            return info
    return None


def close_impls(impls: Sequence[Impl]) -> None:
    """Close in reverse order, then finalize harmpi once if it was used."""
    harmpi_module = None
    for impl in reversed(impls):
        impl.close()
        if isinstance(impl, HarmpiImpl):
            harmpi_module = impl._harmpi
    if harmpi_module is not None:
        harmpi_module.finalize()
