"""Where the time of ``dist.all_reduce`` on backend harmpi goes: torch's
Python wrapper, the backend, harmpi's all-reduce, against MPI_Allreduce,
in one job.

    mpirun -np 2 --bind-to core python -m mpi4py -m bench.torch_overhead
    mpirun -np 2 --bind-to core python -m mpi4py -m bench.torch_overhead --sizes 2K,10K

Implementations (bf16 tensors of SIZE bytes; MPI: float32 of the same bytes):

=============  ==============================================================
torch:harmpi   ``dist.all_reduce(t, group=WORLD)``, the default harmpi group
torch:newgrp   ``dist.all_reduce(t, group=g)``, ``g = dist.new_group(all ranks)``
               of backend harmpi (a group of its own communicator)
torch:noop     ``dist.all_reduce(t, group=noop)``: the same torch wrapper on a
               Python ProcessGroup whose allreduce does nothing (the floor
               any backend pays, harmpi or not)
harmpi         ``harmpi.allreduce(t)``, the direct API
mpi            ``MPI_Allreduce(MPI_IN_PLACE, ..., SUM)`` on float32
=============  ==============================================================

Per size the implementations take turns in rounds (a change in the load hits
them alike); every call starts aligned (a barrier on the benchmark's own
communicator, untimed) and each rank times its own calls. Printed: the
slowest rank's median per call (us), each one's ratio to MPI, and the
attribution torch:harmpi - torch:noop - harmpi: what the backend's own
code adds beyond torch's wrapper and harmpi's all-reduce. Every
implementation's result is checked once per size (the sum of r + 1 over
the ranks, exact in bf16 for these counts).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import harmpi
import harmpi.distributed  # noqa: F401 - backend "harmpi", mpi://
from bench.harness import parse_names, parse_nbytes
from harmpi.distributed import ProcessGroupHarmpi

IMPLS = ("torch:harmpi", "torch:newgrp", "torch:noop", "harmpi", "mpi")


class _NoopWork(dist._Work):
    def wait(self, timeout=None):
        return True


class NoopGroup(dist.ProcessGroup):
    """torch's wrapper with nothing behind it: allreduce returns a done work."""

    _done = _NoopWork()

    def allreduce(self, tensors, opts=None):
        return self._done


def _caller(name, t, buf, groups, comm):
    """A no-argument function making one call of implementation ``name``."""
    if name == "mpi":
        return lambda: comm.Allreduce(MPI.IN_PLACE, [buf, MPI.FLOAT], MPI.SUM)
    if name == "harmpi":
        return lambda: harmpi.allreduce(t)
    group = groups[name]
    return lambda: dist.all_reduce(t, group=group)


def measure(size, args, groups, comm):
    """{impl: the slowest rank's median per call, us} at ``size`` bytes."""
    n, rank = comm.Get_size(), comm.Get_rank()
    count = size // 2
    t = torch.empty(count, dtype=torch.bfloat16)
    buf = np.empty(max(count // 2, 1), np.float32)
    calls = {name: _caller(name, t, buf, groups, comm) for name in args.impls}
    want = torch.full((count,), n * (n + 1) / 2, dtype=torch.bfloat16)
    for name, call in calls.items():
        for _ in range(args.warmup):
            call()
        t.fill_(rank + 1)
        buf.fill(rank + 1)
        call()
        ok = (np.all(buf == n * (n + 1) / 2) if name == "mpi" else
              True if name == "torch:noop" else torch.equal(t, want))
        if not ok:
            raise SystemExit(f"rank {rank}: {name} all-reduce of {size} B: wrong result")
    per_round = max(args.iters // args.rounds, 1)
    samples = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            for _ in range(per_round):
                comm.Barrier()
                t0 = time.perf_counter_ns()
                call()
                samples[name].append(time.perf_counter_ns() - t0)
    medians = {name: float(np.median(s)) / 1e3 for name, s in samples.items()}
    every = comm.allgather(medians)
    return {name: max(m[name] for m in every) for name in medians}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="2K,10K", help="bytes per rank (K/M suffixes)")
    p.add_argument("--impl", default=",".join(IMPLS), help=f"comma list of {', '.join(IMPLS)}")
    p.add_argument("--iters", type=int, default=4000, help="timed calls per size and impl")
    p.add_argument("--rounds", type=int, default=8, help="turns the impls take per size")
    p.add_argument("--warmup", type=int, default=200)
    args = p.parse_args(argv)
    try:
        args.impls = parse_names(args.impl, IMPLS)
        args.sizes = [parse_nbytes(s) for s in args.sizes.split(",")]
    except ValueError as exc:
        p.error(f"--impl {args.impl!r} / --sizes {args.sizes!r}: {exc}")
    if any(size % 4 or size <= 0 for size in args.sizes):
        p.error("every size must be a positive multiple of 4 bytes")
    return args


def report(rows, impls, n):
    print(f"# dist.all_reduce overhead: {n} ranks, torch {torch.__version__}, "
          f"1-min load average {os.getloadavg()[0]:.2f}")
    print("# the slowest rank's median per call, us (each call starts aligned); bf16, "
          "size = bytes per rank")
    ratios = [name for name in impls if name != "mpi"] if "mpi" in impls else []
    own = all(k in impls for k in ("torch:harmpi", "torch:noop", "harmpi"))
    print(f"{'# size':<8}" + "".join(f"{name:>14}" for name in impls)
          + "".join(f"{name + '/mpi':>18}" for name in ratios)
          + (f"{'backend own':>13}" if own else ""))
    for size, med in rows:
        line = f"{size:<8}" + "".join(f"{med[name]:>14.2f}" for name in impls)
        line += "".join(f"{med[name] / med['mpi']:>18.2f}" for name in ratios)
        if own:
            line += f"{med['torch:harmpi'] - med['torch:noop'] - med['harmpi']:>13.2f}"
        print(line)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("harmpi", init_method="mpi://")  # rendezvous over MPI
    comm = MPI.COMM_WORLD.Dup()  # the benchmark's barriers and MPI_Allreduce
    n, rank = comm.Get_size(), comm.Get_rank()
    groups = {"torch:harmpi": dist.group.WORLD, "torch:noop": NoopGroup(rank, n)}
    if "torch:newgrp" in args.impls:
        groups["torch:newgrp"] = dist.new_group(list(range(n)), backend="harmpi")
        assert isinstance(groups["torch:newgrp"], ProcessGroupHarmpi)
    rows = [(size, measure(size, args, groups, comm)) for size in args.sizes]
    if rank == 0:
        report(rows, args.impls, n)
    comm.Free()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
