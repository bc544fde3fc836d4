"""What every benchmark adapter is: the ``Impl`` contract (``prepare`` for the
OSU harness, ``allreduce`` / ``allgather`` / ``alltoall`` on torch tensors for
the decode benchmarks), ``Prepared`` and ``ImplUnavailable``, and the torch
helpers the adapters share.  ``bench.impls`` lists the adapters."""

from __future__ import annotations

from typing import Callable

import numpy as np

from bench.harness import DTYPES, DType

__all__ = [
    "Impl",
    "Prepared",
    "ImplUnavailable",
    "torch_from_storage",
    "storage_from_torch",
    "tensor_dtype",
    "gathered_shape",
    "import_harmpi",
]


class ImplUnavailable(Exception):
    """An implementation cannot run this collective here (raised by ``prepare``).

    The harness asks every rank, and skips the cell on all of them if any
    rank raised; the message goes into the table's notes.
    """


class Prepared:
    """One prepared collective: ``run()`` moves data, ``result()`` reads it back."""

    def __init__(self, run: Callable[[], object], result: Callable[[], np.ndarray]):
        self.run = run
        self.result = result


class Impl:
    """Base adapter.  ``name`` is the column name in tables and JSON rows."""

    name = ""
    #: cap on timed iterations (None: the harness's count)
    max_iterations: int | None = None

    def wire_dtype(self, op: str, dtype: DType) -> DType:
        """The dtype this implementation actually reduces when asked for ``dtype``."""
        return dtype

    def describe(self, op: str, dtype: DType) -> str:
        """One header line saying what is timed."""
        raise NotImplementedError

    def prepare(self, op: str, values: np.ndarray, dtype: DType) -> Prepared:
        raise NotImplementedError

    def describe_tensors(self, dtype: DType) -> str:
        """One header line saying what ``allreduce`` / ``allgather`` call on tensors."""
        raise NotImplementedError

    def describe_alltoall(self, uneven: bool) -> str:
        """One header line saying what ``alltoall`` calls (``uneven``: with counts)."""
        raise NotImplementedError

    def allreduce(self, tensor) -> None:
        """Sum a contiguous CPU torch tensor over the ranks, in place.

        Rank r holds x_r before; every rank holds x_0 + ... + x_{n-1} after.
        """
        raise NotImplementedError

    def allgather(self, tensor):
        """Every rank's tensor (same shape on all), concatenated along dim 0 in rank order.

        Rank r holds x_r of shape [m, ...]; every rank gets [x_0; ...; x_{n-1}]
        of shape [n m, ...].  The result may be a buffer that the next call
        with the same shape overwrites: consume it first.
        """
        raise NotImplementedError

    def alltoall(self, tensor, send_counts=None, recv_counts=None, out=None):
        """Rows of ``tensor`` (dim 0) cut into one block per rank, exchanged.

        Rank r holds x_r, block j (``send_counts[j]`` rows; None: equal
        blocks) for rank j; every rank gets the blocks sent to it,
        concatenated in rank order.  Returns (output, recv_counts):
        recv_counts None for equal blocks, else the rows from each rank
        (learned from the peers unless given, as a MoE combine knows them).
        ``out``: a preallocated output the adapter writes into where its
        call takes one (equal blocks).
        """
        raise NotImplementedError

    def prepare_alltoall(self, values: np.ndarray, dtype: DType) -> Prepared:
        """The OSU harness's all-to-all: equal blocks of ``values``, into a
        preallocated output where the adapter's call takes one."""
        tensor = torch_from_storage(values, dtype)
        last = [tensor.new_empty(tensor.shape)]
        out = last[0]

        def run(tensor=tensor, out=out, alltoall=self.alltoall):
            last[0] = alltoall(tensor, out=out)[0]

        return Prepared(run, lambda: storage_from_torch(last[0], dtype))

    def info(self) -> dict | None:
        """harmpi.info() of the communicator this adapter runs on, None if not on harmpi."""
        return None

    def close(self) -> None:
        """Release resources; called once, in reverse order of creation."""


# --------------------------------------------------------------------------
# torch helpers (torch is imported lazily: the mpi adapter does not need it)
# --------------------------------------------------------------------------


def torch_from_storage(values: np.ndarray, dtype: DType):
    import torch

    storage = np.ascontiguousarray(values)
    if dtype.name == "bf16":
        return torch.from_numpy(storage.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(storage.copy())


def storage_from_torch(tensor, dtype: DType) -> np.ndarray:
    import torch

    flat = tensor.detach().reshape(-1)
    if dtype.name == "bf16":
        return flat.view(torch.int16).numpy().view(np.uint16).copy()
    return flat.numpy().copy()


_DTYPE_BY_TORCH_NAME = {f"torch.{dtype.torch_name}": dtype for dtype in DTYPES.values()}


def tensor_dtype(tensor) -> DType:
    """The benchmarks' DType of a torch tensor; ValueError for a dtype they do not know."""
    try:
        return _DTYPE_BY_TORCH_NAME[str(tensor.dtype)]
    except KeyError:
        raise ValueError(f"no benchmark dtype for {tensor.dtype} tensors") from None


def gathered_shape(tensor, n_ranks: int) -> tuple[int, ...]:
    """Shape of n_ranks tensors like ``tensor`` concatenated along dim 0."""
    return (n_ranks * tensor.shape[0],) + tuple(tensor.shape[1:])


def import_harmpi():
    try:
        import harmpi
    except ImportError as exc:  # the library is optional while benchmarking rivals
        raise SystemExit(
            f"harmpi is not importable ({exc}); leave harmpi out of the implementations "
            "to compare (--impl, or --comm for the decode benchmark)"
        ) from exc
    return harmpi
