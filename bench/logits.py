"""gather_logits: the allgather route vs the allreduce route, same ranks, same run.

    mpirun -np 2 python -m mpi4py -m bench.logits
    HARMPI_RANKS_PER_NODE=1 mpirun -np 2 -x HARMPI_RANKS_PER_NODE python -m mpi4py -m bench.logits

Per (batch, vocab): the vocabulary is split over the ranks as a tensor-parallel
model splits it (the first vocab % n ranks one column wider), each rank gathers
its (batch, vocab_r) shard with each route in turn (interleaved, so drift of
a noisy machine hits both alike), every iteration fenced by an MPI barrier
outside the timed region. Each rank takes the median of its samples (or,
with ``--stat min``, the minimum: the least disturbed sample on a busy host); the
table shows the slowest rank's median (the rank the next decode step waits
for) and the ratio allreduce / allgather. A check pass first compares every
route's result bitwise with torch.cat of the shards (each rank regenerates
every shard) and across ranks; a wrong value exits non-zero.
"""

from __future__ import annotations

import time
import zlib

import click
import numpy as np

from bench import harness

ROUTES = ("allgather", "allreduce")
DTYPES = ("bf16", "f16", "f32")


def split_vocab(vocab: int, n: int) -> list[int]:
    """Widths of n shards of ``vocab`` columns, the first vocab % n one wider."""
    return [vocab // n + (1 if r < vocab % n else 0) for r in range(n)]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _shard(torch, dtype, rank, batch, width, seed=0):
    g = torch.Generator().manual_seed(zlib.crc32(repr((seed, rank, batch, width)).encode()))
    return (torch.randn(batch, width, generator=g) * 8).to(dtype)


def _check(harmpi, torch, comm, dtype, batch, widths):
    r = comm.Get_rank()
    shards = [_shard(torch, dtype, q, batch, w) for q, w in enumerate(widths)]
    expect = torch.cat(shards, -1).view(torch.uint8) if shards[0].numel() else None
    bad = 0
    for route in ROUTES:
        got = harmpi.gather_logits(shards[r], route=route)
        same = torch.equal(got.contiguous().view(torch.uint8), expect) if expect is not None \
            else got.numel() == 0
        digests = comm.allgather(zlib.crc32(got.contiguous().view(torch.uint8).numpy().tobytes()))
        bad += (not same) + (len(set(digests)) != 1)
    return comm.allreduce(bad)


def _time(harmpi, comm, shard, iters, warmup, stat):
    """{route: this rank's median (or min) us}: routes interleaved per iteration."""
    samples = {route: [] for route in ROUTES}
    for i in range(warmup + iters):
        for route in ROUTES:
            comm.Barrier()
            t0 = time.perf_counter_ns()
            harmpi.gather_logits(shard, route=route)
            t1 = time.perf_counter_ns()
            if i >= warmup:
                samples[route].append((t1 - t0) / 1e3)
    reduce = np.min if stat == "min" else np.median
    return {route: float(reduce(v)) for route, v in samples.items()}


@click.command()
@harness.help_option()
@click.option("--batch", "batches", default="1,2,4", help="batch sizes, comma separated")
@click.option("--vocab", "vocabs", default="32768,65536,152064", help="vocabulary sizes")
@click.option("--dtype", "dtype_name", type=click.Choice(DTYPES), default="bf16")
@click.option("--iters", default=200, show_default=True, help="timed iterations per route")
@click.option("--warmup", default=20, show_default=True)
@click.option("--stat", type=click.Choice(["median", "min"]), default="median", show_default=True,
              help="per rank: median of the samples, or min (the least disturbed on a busy host)")
def main(batches, vocabs, dtype_name, iters, warmup, stat):
    """Time both gather_logits routes; rank 0 prints the table."""
    import torch
    from mpi4py import MPI

    import harmpi

    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[dtype_name]
    isz = torch.empty(0, dtype=dtype).element_size()
    info = harmpi.info()
    if rank == 0:
        print(f"# harmpi gather_logits, {dtype_name}, {n} ranks: {info['nodes']} node(s) x "
              f"{info['ranks_per_node']}, transport {info['transport']}, "
              f"auto threshold {info['thresholds']['logits_allreduce_max_nbytes']} B")
        print(f"# slowest rank's {stat} of {iters} iterations (us); ratio = allreduce/allgather")
        print(f"{'# batch':>7} {'vocab':>7} {'bytes':>8} {'allgather':>10} {'allreduce':>10} "
              f"{'ratio':>6}")
    wrong = 0
    for vocab in _ints(vocabs):
        widths = split_vocab(vocab, n)
        for batch in _ints(batches):
            wrong += _check(harmpi, torch, comm, dtype, batch, widths)
            shard = _shard(torch, dtype, rank, batch, widths[rank])
            med = _time(harmpi, comm, shard, iters, warmup, stat)
            worst = {route: comm.reduce(med[route], op=MPI.MAX, root=0) for route in ROUTES}
            if rank == 0:
                ag, ar = worst["allgather"], worst["allreduce"]
                print(f"{batch:>7} {vocab:>7} {batch * vocab * isz:>8} {ag:>10.1f} {ar:>10.1f} "
                      f"{ar / ag:>6.2f}", flush=True)
    if wrong:
        if rank == 0:
            print(f"# {wrong} wrong results (bitwise against torch.cat, or across ranks)")
    harness.exit_all(1 if wrong else 0)


if __name__ == "__main__":
    main()
