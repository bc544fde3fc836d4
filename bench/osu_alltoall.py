"""OSU-style all-to-all latency: ``dist.all_to_all_single`` on backend harmpi
against ``MPI_Alltoall`` (mpi4py) on the same ranks, in the same job.

    mpirun -np 2 python -m mpi4py -m bench.osu_alltoall [--sizes 4K,64K,1M]
    HARMPI_RANKS_PER_NODE=2 mpirun -np 4 -x HARMPI_RANKS_PER_NODE \
        python -m mpi4py -m bench.osu_alltoall

A size is what every rank sends to each rank (OSU's convention): the input
and output tensors hold ranks x size bytes (float32). Per size, the
implementations take turns in rounds (so a change in the machine's load
hits them alike); every call starts aligned (an MPI barrier on a
communicator of the benchmark's own) and each rank times its own calls.
Printed: the slowest rank's median per call, in microseconds, and the
ratio to MPI. Every implementation's output is checked once per size
(rank r's block for rank j holds r * ranks + j). ``--impl`` adds
``gloo`` (a gloo group over the same ranks) for reference.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import harmpi
from bench.harness import fit_lines, parse_names, parse_nbytes
from bench.load import host_load

IMPLS = ("harmpi", "mpi", "gloo")


def _pattern(rank: int, n: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s input: block j (size bytes, float32) holds rank * n + j."""
    per = size // 4
    return torch.arange(n, dtype=torch.float32).add_(rank * n).repeat_interleave(per)


def _expected(rank: int, n: int, size: int) -> torch.Tensor:
    per = size // 4
    return (torch.arange(n, dtype=torch.float32) * n + rank).repeat_interleave(per)


class Impl:
    """One implementation's call on prepared buffers: ``call()`` runs it once,
    ``output()`` is what it received."""

    def __init__(self, name: str, n: int, size: int, groups: dict, comm):
        self.name = name
        rank = comm.Get_rank()
        self.inp = _pattern(rank, n, size)
        self.out = torch.full_like(self.inp, -1.0)
        if name == "mpi":
            send, recv = self.inp.numpy().view(np.uint8), self.out.numpy().view(np.uint8)
            self.call = lambda: comm.Alltoall([send, MPI.BYTE], [recv, MPI.BYTE])
        else:
            group = groups[name]
            self.call = lambda: dist.all_to_all_single(self.out, self.inp, group=group)


def _time(impl: Impl, comm, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        comm.Barrier()
        t0 = time.perf_counter()
        impl.call()
        out.append(time.perf_counter() - t0)
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4K,64K,1M",
                   help="bytes each rank sends to each rank (K/M suffixes)")
    p.add_argument("--impl", default="harmpi,mpi", help=f"comma list of {', '.join(IMPLS)}")
    p.add_argument("--iters", type=int, default=400, help="timed calls per size and impl "
                   "(a quarter of it above 256 KiB)")
    p.add_argument("--rounds", type=int, default=8, help="turns the impls take per size")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--load", type=int, default=0, metavar="N",
                   help="N busy processes (unbound spin loops) on each host while measuring, "
                        "started by the host's first rank")
    args = p.parse_args(argv)
    try:
        args.impls = parse_names(args.impl, IMPLS)
        args.sizes = [parse_nbytes(s) for s in args.sizes.split(",")]
    except ValueError as exc:
        p.error(f"--impl {args.impl!r} / --sizes {args.sizes!r}: {exc}")
    if args.load < 0:
        p.error(f"--load {args.load}: the number of busy processes must be >= 0")
    if any(size % 4 for size in args.sizes):
        p.error("every size must be a multiple of 4 bytes (float32)")
    return args


def measure(size, args, groups, comm):
    """{impl: the slowest rank's median per call, us} at one size, and the calls timed."""
    n, rank = comm.Get_size(), comm.Get_rank()
    prepared = [Impl(name, n, size, groups, comm) for name in args.impls]
    for impl in prepared:
        for _ in range(args.warmup):
            impl.call()
        impl.out.fill_(-1.0)
        impl.call()
        if not torch.equal(impl.out, _expected(rank, n, size)):
            raise SystemExit(f"rank {rank}: {impl.name} all-to-all of {size} B: wrong output")
    iters = args.iters if size <= 256 << 10 else max(args.iters // 4, 20)
    per_round = max(iters // args.rounds, 1)
    samples = {impl.name: [] for impl in prepared}
    for _ in range(args.rounds):
        for impl in prepared:
            samples[impl.name] += _time(impl, comm, per_round)
    medians = {name: float(np.median(s)) * 1e6 for name, s in samples.items()}
    every = comm.allgather(medians)
    return {name: max(m[name] for m in every) for name in medians}, per_round * args.rounds


def report(rows, impls, n):
    info = harmpi.info()
    header = [
        f"# all_to_all_single vs MPI_Alltoall: {n} ranks, {info['nodes']} node(s) of "
        f"{info['ranks_per_node']} ranks ({'virtual, ' if info['virtual_nodes'] else ''}"
        f"transport {info['transport']}), {info['mpi_library']}",  # MPI's own ends in a NUL
        "# the slowest rank's median per call, us (each call starts aligned); "
        "size = bytes each rank sends to each rank",
    ]
    print("\n".join(fit_lines(header)))
    ratios = [name for name in impls if name != "mpi"] if "mpi" in impls else []
    print(f"{'# size':<10}" + "".join(f"{name:>12}" for name in impls)
          + "".join(f"{name + '/mpi':>14}" for name in ratios) + f"{'calls':>8}")
    for size, med, calls in rows:
        print(f"{_fmt(size):<10}" + "".join(f"{med[name]:>12.1f}" for name in impls)
              + "".join(f"{med[name] / med['mpi']:>14.2f}" for name in ratios)
              + f"{calls:>8}")


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("harmpi")
    comm = MPI.COMM_WORLD.Dup()  # the benchmark's barriers and MPI_Alltoall, apart from harmpi's
    groups = {"harmpi": dist.group.WORLD}
    if "gloo" in args.impls:
        groups["gloo"] = dist.new_group(backend="gloo")
    rows = []
    with host_load(comm, args.load) as busy:
        for size in args.sizes:
            medians, calls = measure(size, args, groups, comm)
            rows.append((size, medians, calls))
    if comm.Get_rank() == 0:
        report(rows, args.impls, comm.Get_size())
        if args.load:
            print(busy.summary())
    comm.Free()
    dist.destroy_process_group()


def _fmt(size: int) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


if __name__ == "__main__":
    main()
