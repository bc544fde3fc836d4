"""Does ``dist.all_reduce(t, async_op=True)`` overlap with compute? Wall time, same job.

    mpirun -np 2 python -m mpi4py -m bench.torch_overlap [--nbytes 10240] [--mm 384]

Per backend (the harmpi default group and a gloo group over the same
ranks), each iteration starts aligned (an MPI barrier) and rank 0 times:

* ``blocking``: ``dist.all_reduce(x)``, then an independent matmul;
* ``async``: ``w = dist.all_reduce(x, async_op=True)``, the matmul, ``w.wait()``;
* ``matmul``: the matmul alone (the floor).

In the "skewed" rows the other ranks run their matmul *before* their
all-reduce, so they arrive late by one matmul, as a rank out of phase in
tensor-parallel decode does: a blocking call makes rank 0 wait for them and
then compute; an async call lets rank 0 compute while it waits. With a core
per rank there is no idle core for a progress thread, so in the "aligned"
rows (everyone arrives together) the two orders should cost the same.
Prints medians in microseconds.
"""

from __future__ import annotations

import time

import click
import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import harmpi.distributed  # noqa: F401  (registers the backend and mpi://)
from bench import job


def _run(group, x, a, b, mode, skewed, iters):
    comm = MPI.COMM_WORLD
    late = skewed and comm.Get_rank() != 0
    out = []
    for _ in range(iters):
        comm.Barrier()
        t0 = time.perf_counter()
        if mode == "matmul":
            torch.mm(a, b)
        elif late:
            torch.mm(a, b)
            dist.all_reduce(x, group=group)
        elif mode == "blocking":
            dist.all_reduce(x, group=group)
            torch.mm(a, b)
        else:
            work = dist.all_reduce(x, group=group, async_op=True)
            torch.mm(a, b)
            work.wait()
        out.append(time.perf_counter() - t0)
    return float(np.median(out)) * 1e6


@click.command(name="torch_overlap", help=__doc__.splitlines()[0] + " Run under MPI: mpirun "
               "-np 2 python -m mpi4py -m bench.torch_overlap. Only rank 0 prints.")
@job.help_option()
@click.option("--nbytes", type=int, default=10240, show_default=True,
              help="All-reduce size (bf16).")
@click.option("--mm", type=int, default=384, show_default=True,
              help="Square matmul size (f32).")
@click.option("--iters", type=int, default=200, show_default=True)
def main(nbytes, mm, iters):
    job.exit_all(job.run_or_abort(_main, nbytes, mm, iters))


def _main(nbytes: int, mm: int, iters: int) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("harmpi", init_method="mpi://")  # rendezvous over MPI
    groups = {"harmpi": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    x = torch.zeros(nbytes // 2, dtype=torch.bfloat16)
    a = torch.randn(mm, mm)
    b = torch.randn(mm, mm)
    rows = []
    for skewed in (False, True):
        for name, group in groups.items():
            for _ in range(2):  # warm-up pass, then the measured one
                cells = {m: _run(group, x, a, b, m, skewed, iters)
                         for m in ("matmul", "blocking", "async")}
            rows.append((name, "skewed" if skewed else "aligned", cells))
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"# {MPI.COMM_WORLD.Get_size()} ranks, all-reduce {nbytes} B bf16, "
              f"matmul {mm}x{mm} f32, 1 thread per rank; rank 0's median wall "
              f"time per iteration over {iters}, us")
        print(f"{'# backend':<10}{'arrival':<9}{'matmul':>10}{'blocking':>10}{'async':>10}"
              f"{'async/blocking':>16}")
        for name, arrival, c in rows:
            print(f"{name:<10}{arrival:<9}{c['matmul']:>10.1f}{c['blocking']:>10.1f}"
                  f"{c['async']:>10.1f}{c['async'] / c['blocking']:>16.2f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    main()
