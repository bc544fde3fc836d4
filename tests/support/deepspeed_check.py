"""bench.deepspeed_op's adapter, checked under MPI.

    mpirun -np 2 python -m mpi4py -m tests.support.deepspeed_check     # runs it
    HARMPI_RANKS_PER_NODE=1 mpirun -np 2 python -m mpi4py -m tests.support.deepspeed_check refused

tests/test_bench_deepspeed.py runs both.  Rank 0 prints one line:
``deepspeed ok: ...``, ``deepspeed unavailable: <reason>`` (not installed or
not built: the test skips) or ``deepspeed refused: <reason>``.

The timed path (``prepare``/``run``) is checked as the OSU harness checks
it: seeded values, the float64 sum within the rounding bound, the same bits
on every rank; each size twice on one adapter (DeepSpeed double-buffers its
slots), below and above its 1 MiB switch between its two algorithms.  The
tensor path (``allreduce(t)``) uses small integers, exact in every dtype,
with a closed form: rank r holds (r + 1) x, the sum is n(n + 1)/2 x.
"""

from __future__ import annotations

import sys

import torch
from mpi4py import MPI

from bench import harness
from bench.deepspeed_op import DeepSpeedImpl, cpu_flags
from bench.harness import ALLREDUCE, DTYPES
from bench.impls import ImplUnavailable, make_impls

#: elements per rank: a few, the decode size (10 KB of bf16), and more than 1 MiB of bf16
COUNTS = (7, 5120, 600_000)


def check_prepared(comm, impl, dtype_name: str) -> None:
    wire = impl.wire_dtype("allreduce", DTYPES[dtype_name])
    for count in COUNTS:
        for seed in (1, 2):  # two calls on one adapter: slot reuse
            values = ALLREDUCE.init_values(seed, comm.Get_rank(), count, wire)
            prepared = impl.prepare("allreduce", values, wire)
            prepared.run()
            result = prepared.result()
            ok, detail = ALLREDUCE.check(result, seed, comm.Get_size(), count, wire)
            assert ok, (impl.name, dtype_name, wire.name, count, seed, detail)
            digests = comm.allgather(harness.digest(result))
            assert len(set(digests)) == 1, ("results differ across ranks", wire.name, count)


def check_tensors(comm, impl) -> None:
    rank, n_ranks = comm.Get_rank(), comm.Get_size()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for call in range(2):
            base = (torch.arange(4 * 1280) % 16 + call).reshape(4, 1280)
            x = (base * (rank + 1)).to(dtype)
            impl.allreduce(x)
            assert torch.equal(x, (base * (n_ranks * (n_ranks + 1) // 2)).to(dtype)), (dtype, x)
    for bad in (torch.ones(8, dtype=torch.float64),  # the op would return it unreduced
                torch.ones(4, 6, dtype=torch.bfloat16).t()):  # it would reduce a copy
        try:
            impl.allreduce(bad)
        except (ValueError, ImplUnavailable):
            continue
        raise AssertionError(f"deepspeed allreduce accepted {bad.dtype} {tuple(bad.stride())}")


def check_without_avx512bw(comm) -> str:
    """bf16 on a CPU without avx512bw: float32 of the same bytes (the same processes'
    shm world, reused)."""
    impl = DeepSpeedImpl(comm, flags=cpu_flags() - {"avx512bw"})
    assert impl.unavailable is None, impl.unavailable
    bf16 = DTYPES["bf16"]
    assert impl.wire_dtype("allreduce", bf16).name == "f32"
    line = impl.describe("allreduce", bf16)
    assert "float32, same bytes" in line and "avx512bw" in line, line
    check_prepared(comm, impl, "bf16")
    check_tensors(comm, impl)
    return line


def main(expect: str) -> None:
    comm = MPI.COMM_WORLD
    say = print if comm.Get_rank() == 0 else (lambda *a, **k: None)
    (impl,) = make_impls(["deepspeed"], comm)
    if expect == "refused":
        assert impl.unavailable, "deepspeed ran under virtual nodes"
        try:
            impl.prepare("allreduce", ALLREDUCE.init_values(1, 0, 8, DTYPES["f32"]), DTYPES["f32"])
        except ImplUnavailable as exc:
            assert str(exc) == impl.unavailable
        else:
            raise AssertionError("prepare did not refuse")
        say(f"deepspeed refused: {impl.unavailable}", flush=True)
        return
    if impl.unavailable:
        say(f"deepspeed unavailable: {impl.unavailable}", flush=True)
        return
    line = impl.describe("allreduce", DTYPES["bf16"])
    assert line.startswith("deepspeed: torch.ops.deepspeed.inference_all_reduce_"), line
    for dtype_name in ("bf16", "f32"):
        check_prepared(comm, impl, dtype_name)
    check_tensors(comm, impl)
    try:
        impl.prepare("allgather", ALLREDUCE.init_values(1, 0, 8, DTYPES["f32"]), DTYPES["f32"])
    except ImplUnavailable:
        pass
    else:
        raise AssertionError("deepspeed prepared an allgather")
    fallback = check_without_avx512bw(comm)
    comm.Barrier()
    say(f"deepspeed ok: {line}", flush=True)
    say(f"deepspeed ok without avx512bw: {fallback}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "run")
