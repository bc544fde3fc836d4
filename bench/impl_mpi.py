"""The mpi adapter: mpi4py buffer collectives on the benchmark's communicator
(bf16 and f16 all-reduced as float32 of the same bytes: MPI has no bf16)."""

from __future__ import annotations

import numpy as np

from bench.harness import DTYPES, DType
from bench.impl_base import Impl, ImplUnavailable, Prepared, gathered_shape, tensor_dtype

__all__ = ["MpiImpl"]


class MpiImpl(Impl):
    """mpi4py buffer collectives on the benchmark's communicator."""

    name = "mpi"

    def __init__(self, comm):
        from mpi4py import MPI

        self._MPI = MPI
        self._comm = comm
        self._float_types = {"f32": MPI.FLOAT, "f64": MPI.DOUBLE}
        self._f32_staging: dict[int, object] = {}  # element count -> float32 tensor
        self._torch = None  # imported at the first tensor call (OSU runs need no torch)
        self._counts = np.zeros((2, comm.Get_size()), dtype=np.int32)  # alltoall's, sent, received

    def wire_dtype(self, op: str, dtype: DType) -> DType:
        if op == "allreduce" and dtype.name in ("bf16", "f16"):
            return DTYPES["f32"]
        return dtype

    def describe(self, op: str, dtype: DType) -> str:
        MPI = self._MPI
        wire = self.wire_dtype(op, dtype)
        if op == "allreduce":
            what = "MPI_Allreduce(MPI_IN_PLACE, SUM)"
            if wire is not dtype:
                what += (
                    f" float32, same bytes ({dtype.name} has no MPI type; half the elements,"
                    " a 2 B message sends 4 B)"
                )
            else:
                what += f" {wire.name}"
        else:
            what = (f"MPI_Allgather, {dtype.name} moved as bytes" if op == "allgather" else
                    f"MPI_Alltoall, {dtype.name} as MPI_FLOAT" if dtype.name == "f32" else
                    f"MPI_Alltoall, {dtype.name} moved as bytes")
        levels = {
            MPI.THREAD_SINGLE: "single",
            MPI.THREAD_FUNNELED: "funneled",
            MPI.THREAD_SERIALIZED: "serialized",
            MPI.THREAD_MULTIPLE: "multiple",
        }
        level = MPI.Query_thread()
        return f"mpi: {what}; thread level {levels.get(level, level)}"

    def describe_tensors(self, dtype: DType) -> str:
        wire = self.wire_dtype("allreduce", dtype)
        if wire is dtype:
            reduce = f"MPI_Allreduce on {dtype.torch_name}"
        else:
            reduce = f"MPI_Allreduce on {wire.torch_name} ({dtype.name} converted in and out)"
        return f"mpi: {reduce}, MPI_Allgather of {dtype.name} bytes"

    def prepare(self, op: str, values: np.ndarray, dtype: DType) -> Prepared:
        MPI = self._MPI
        comm = self._comm
        buf = np.ascontiguousarray(values).copy()
        if op == "allreduce":
            if buf.dtype not in (np.float32, np.float64):
                raise ImplUnavailable(f"mpi allreduce of {buf.dtype} is not supported here")
            target = [buf, MPI.FLOAT if buf.dtype == np.float32 else MPI.DOUBLE]

            def run(comm=comm, target=target, in_place=MPI.IN_PLACE, op=MPI.SUM):
                comm.Allreduce(in_place, target, op)

            return Prepared(run, lambda: buf.copy())
        if op == "allgather":
            out = np.empty(len(buf) * comm.Get_size(), dtype=buf.dtype)
            send = [buf.view(np.uint8), MPI.BYTE]
            recv = [out.view(np.uint8), MPI.BYTE]

            def run(comm=comm, send=send, recv=recv):
                comm.Allgather(send, recv)

            return Prepared(run, lambda: out.copy())
        if op == "alltoall":
            return self.prepare_alltoall(values, dtype)
        raise ValueError(op)

    def _torch_module(self):
        if self._torch is None:
            import torch

            self._torch = torch
        return self._torch

    def allreduce(self, tensor) -> None:
        MPI = self._MPI
        dtype = tensor_dtype(tensor)
        wire = self.wire_dtype("allreduce", dtype)
        flat = tensor.view(-1)  # a view: a non-contiguous tensor raises instead of losing the sum
        if wire is dtype:
            target = [flat.numpy(), self._float_types[wire.name]]
            self._comm.Allreduce(MPI.IN_PLACE, target, MPI.SUM)
            return
        # MPI has no bf16 (and no portable f16): sum float32 copies
        staging = self._f32_staging.get(flat.numel())
        if staging is None:
            torch = self._torch_module()
            staging = torch.empty(flat.numel(), dtype=torch.float32)
            self._f32_staging[flat.numel()] = staging
        staging.copy_(flat)
        self._comm.Allreduce(MPI.IN_PLACE, [staging.numpy(), MPI.FLOAT], MPI.SUM)
        flat.copy_(staging)

    def allgather(self, tensor):
        MPI, torch = self._MPI, self._torch_module()
        out = tensor.new_empty(gathered_shape(tensor, self._comm.Get_size()))
        send = tensor.contiguous().view(torch.uint8).numpy()
        self._comm.Allgather([send, MPI.BYTE], [out.view(torch.uint8).numpy(), MPI.BYTE])
        return out  # a new tensor per call

    def describe_alltoall(self, uneven: bool) -> str:
        if uneven:
            return ("mpi: MPI_Alltoall of the counts, then MPI_Alltoallv of the rows (as an "
                    "mpi4py user must; back: MPI_Alltoallv, the counts known)")
        return "mpi: MPI_Alltoall into a preallocated array"

    def _typed(self, tensor):
        """(flat buffer, MPI type, its items per row): float32 as MPI_FLOAT, others as bytes."""
        torch = self._torch_module()
        row_elements = int(np.prod(tensor.shape[1:], dtype=np.int64))
        if tensor.dtype == torch.float32:
            return tensor.numpy().reshape(-1), self._MPI.FLOAT, row_elements
        flat = tensor.contiguous().view(torch.uint8).numpy().reshape(-1)
        return flat, self._MPI.BYTE, row_elements * tensor.element_size()

    def alltoall(self, tensor, send_counts=None, recv_counts=None, out=None):
        if send_counts is None:
            out = tensor.new_empty(tensor.shape) if out is None else out
            send, kind, _ = self._typed(tensor)
            self._comm.Alltoall([send, kind], [self._typed(out)[0], kind])
            return out, None
        if recv_counts is None:  # the counts first, as an mpi4py user must
            self._counts[0] = send_counts
            self._comm.Alltoall(self._counts[0], self._counts[1])
            recv_counts = self._counts[1].tolist()
        rows = int(sum(recv_counts))
        out = tensor.new_empty((rows,) + tuple(tensor.shape[1:]))
        send, kind, per_row = self._typed(tensor)
        sc = np.asarray(send_counts, dtype=np.int64) * per_row
        rc = np.asarray(recv_counts, dtype=np.int64) * per_row
        self._comm.Alltoallv([send, (sc, _displs(sc)), kind],
                             [self._typed(out)[0], (rc, _displs(rc)), kind])
        return out, recv_counts


def _displs(counts: np.ndarray) -> np.ndarray:
    """Each block's offset: the sum of the counts before it."""
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(counts.dtype)
