"""The harmpi adapter: ``harmpi.allreduce`` / ``allgather`` / ``alltoall`` on
torch tensors, ``harmpi:<algorithm>`` forcing one algorithm."""

from __future__ import annotations

import os

import numpy as np

from bench.harness import DType
from bench.impl_base import (
    Impl,
    ImplUnavailable,
    Prepared,
    import_harmpi,
    storage_from_torch,
    torch_from_storage,
)

__all__ = ["HarmpiImpl"]


class HarmpiImpl(Impl):
    """harmpi on torch tensors; ``algorithm`` None means the library's choice."""

    def __init__(self, comm, algorithm: str | None):
        harmpi = import_harmpi()
        self._harmpi = harmpi
        self._comm = comm
        self.algorithm = algorithm
        self.name = "harmpi" if algorithm is None else f"harmpi:{algorithm}"
        if algorithm is not None and algorithm not in harmpi.ALGORITHMS:
            raise SystemExit(
                f"unknown harmpi algorithm {algorithm!r}; "
                f"choose from {', '.join(harmpi.ALGORITHMS)}"
            )
        #: keyword arguments of every harmpi.allreduce call
        self._kwargs = {} if algorithm is None else {"algorithm": algorithm}
        from mpi4py import MPI

        #: comm= of harmpi.alltoall: none on the world, the call a script makes
        self._comm_kwargs = {} if comm is MPI.COMM_WORLD else {"comm": comm}

    def _algorithm_note(self) -> str:
        forced = os.environ.get("HARMPI_ALGORITHM")
        if self.algorithm is not None:
            return f"algorithm {self.algorithm} (forced per call)"
        if forced:
            return f"algorithm {forced} (HARMPI_ALGORITHM)"
        return "algorithm auto"

    def describe(self, op: str, dtype: DType) -> str:
        into = " into a preallocated tensor (out=)" if op == "allgather" else ""
        return (
            f"{self.name}: harmpi.{op} on a torch {dtype.torch_name} tensor{into}, "
            f"{self._algorithm_note()}"
        )

    def describe_tensors(self, dtype: DType) -> str:
        return (
            f"{self.name}: harmpi.allreduce / harmpi.allgather on {dtype.name} tensors, "
            f"{self._algorithm_note()}"
        )

    def prepare(self, op: str, values: np.ndarray, dtype: DType) -> Prepared:
        tensor = torch_from_storage(values, dtype)
        if op == "allreduce":
            return self._prepare_allreduce(tensor, values, dtype)
        if op == "allgather":
            return self._prepare_allgather(tensor, dtype)
        if op == "alltoall":
            return self.prepare_alltoall(values, dtype)
        raise ValueError(op)

    def _prepare_allreduce(self, tensor, values: np.ndarray, dtype: DType) -> Prepared:
        harmpi, comm, kwargs = self._harmpi, self._comm, self._kwargs
        # Argument and topology checks happen before any data moves, so a
        # mismatch (e.g. "shm" across nodes) raises on every rank alike.
        try:
            harmpi.allreduce(tensor, comm=comm, **kwargs)
        except harmpi.HarmpiArgumentError as exc:
            raise ImplUnavailable(str(exc)) from exc
        tensor.copy_(torch_from_storage(values, dtype))  # undo the probe call

        from mpi4py import MPI

        if comm is MPI.COMM_WORLD and not kwargs:
            # the call a research script makes: harmpi.allreduce(t)
            def run(tensor=tensor, allreduce=harmpi.allreduce):
                allreduce(tensor)
        else:
            def run(tensor=tensor, allreduce=harmpi.allreduce, comm=comm, kwargs=kwargs):
                allreduce(tensor, comm=comm, **kwargs)

        return Prepared(run, lambda: storage_from_torch(tensor, dtype))

    def _prepare_allgather(self, tensor, dtype: DType) -> Prepared:
        comm = self._comm
        # into a preallocated tensor (out=), as the mpi and gloo impls do
        out = tensor.new_empty(tensor.numel() * comm.Get_size())

        def run(tensor=tensor, out=out, allgather=self._harmpi.allgather, comm=comm):
            allgather(tensor, comm=comm, out=out)

        return Prepared(run, lambda: storage_from_torch(out, dtype))

    def allreduce(self, tensor) -> None:
        self._harmpi.allreduce(tensor, comm=self._comm, **self._kwargs)

    def allgather(self, tensor):
        return self._harmpi.allgather(tensor, comm=self._comm)  # a new tensor per call

    def describe_alltoall(self, uneven: bool) -> str:
        if uneven:
            return (f"{self.name}: harmpi.alltoall(x, send_counts) (the counts travel with the "
                    "data; with recv_counts= when they are known)")
        return f"{self.name}: harmpi.alltoall(x), a new tensor per call"

    def alltoall(self, tensor, send_counts=None, recv_counts=None, out=None):
        """``out`` is not used: harmpi.alltoall(x) returns a new tensor, the call a
        script makes."""
        kwargs = self._comm_kwargs
        if send_counts is None:
            return self._harmpi.alltoall(tensor, **kwargs), None
        if recv_counts is None:
            return self._harmpi.alltoall(tensor, send_counts, **kwargs)
        out, _ = self._harmpi.alltoall(tensor, send_counts, recv_counts=recv_counts, **kwargs)
        return out, recv_counts

    def info(self) -> dict | None:
        return dict(self._harmpi.info(comm=self._comm))
