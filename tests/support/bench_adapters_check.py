"""The tensor calls of bench.impls' adapters, checked under MPI.

    mpirun -np 2 python -m mpi4py -m tests.support.bench_adapters_check harmpi,mpi,gloo

tests/test_bench.py runs it; rank 0 prints ``adapters ok: <names>``.  Rank r
contributes values derived from r, so every expected result has a closed
form (the sum over n ranks of (r + 1) x is n(n + 1)/2 x).  Every check runs
twice on one adapter with different data, which catches an output buffer
reused wrongly between calls.  Values are small integers: exact in bf16.
"""

from __future__ import annotations

import sys

import torch
from mpi4py import MPI

from bench.harness import DTYPES
from bench.impls import close_impls, make_impls, parse_impls

TORCH_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
SHAPES = ((2, 3), (4, 1280))  # a few elements; the decode benchmark's hidden state


def check_allreduce(impl, rank: int, n_ranks: int) -> None:
    for dtype in TORCH_DTYPES:
        for shape in SHAPES:
            for call in range(2):
                base = (torch.arange(shape[0] * shape[1]) % 16 + call).reshape(shape)
                x = (base * (rank + 1)).to(dtype)
                impl.allreduce(x)
                expected = (base * (n_ranks * (n_ranks + 1) // 2)).to(dtype)
                assert torch.equal(x, expected), (impl.name, dtype, shape, call, x)


def check_allgather(impl, rank: int, n_ranks: int) -> None:
    for dtype in TORCH_DTYPES:
        for shape in SHAPES:
            for call in range(2):
                base = (torch.arange(shape[0] * shape[1]) % 16).reshape(shape)
                x = (base + 10 * call + rank).to(dtype)
                got = impl.allgather(x)
                expected = torch.cat([(base + 10 * call + r).to(dtype) for r in range(n_ranks)])
                assert torch.equal(got, expected), (impl.name, dtype, shape, call, got)


def check_mpi_rejects_a_non_contiguous_tensor(impl) -> None:
    """Reducing a copy would leave the caller's tensor unreduced: it must raise instead."""
    x = torch.zeros(4, 6, dtype=torch.bfloat16).t()
    try:
        impl.allreduce(x)
    except RuntimeError:
        return
    raise AssertionError("mpi allreduce of a non-contiguous tensor did not raise")


def main(spec: str) -> None:
    comm = MPI.COMM_WORLD
    rank, n_ranks = comm.Get_rank(), comm.Get_size()
    names = parse_impls(spec)
    impls = make_impls(names, comm)
    try:
        for impl in impls:
            line = impl.describe_tensors(DTYPES["bf16"])
            assert line.startswith(f"{impl.name}: ") and "bf16" in line, line
            check_allreduce(impl, rank, n_ranks)
            check_allgather(impl, rank, n_ranks)
            if impl.name == "mpi":
                check_mpi_rejects_a_non_contiguous_tensor(impl)
            comm.Barrier()
    finally:
        close_impls(impls)
    if rank == 0:
        print(f"adapters ok: {','.join(names)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "harmpi,mpi,gloo")
