"""OSU-style all-to-all latency: ``harmpi.alltoall`` against ``MPI_Alltoall``
(mpi4py) on the same ranks, in the same job.

    mpirun -np 2 python -m mpi4py -m bench.osu_alltoall [--sizes 4K,64K,1M]
    mpirun -np 2 python -m mpi4py -m bench.osu_alltoall --impl harmpi,torch:harmpi,mpi,gloo
    mpirun -np 2 python -m mpi4py -m bench.osu_alltoall --uneven
    HARMPI_RANKS_PER_NODE=2 mpirun -np 4 -x HARMPI_RANKS_PER_NODE \
        python -m mpi4py -m bench.osu_alltoall

A size is what every rank sends to each rank (OSU's convention): the input
and output tensors hold ranks x size bytes (float32). Implementations
(``--impl``, default harmpi,mpi):

* ``harmpi``: ``harmpi.alltoall(x)`` (``--uneven``: ``harmpi.alltoall(x,
  send_counts)``, the counts travel with the data), the call a script makes;
  it returns a new tensor;
* ``torch:harmpi``: ``dist.all_to_all_single(out, x)`` on a harmpi process
  group (the default group);
* ``mpi``: ``MPI_Alltoall`` (``--uneven``: ``MPI_Alltoall`` of the counts,
  then ``MPI_Alltoallv``, as an mpi4py user must) into a preallocated array;
* ``gloo``: ``dist.all_to_all_single`` on a gloo group (``--uneven``: the
  counts through it first, then the data with split sizes).

``--uneven``: every call sends another count to each rank, drawn with a
fixed seed (uniform in 0 .. 2 x size, so a size is the mean), from a
schedule of 16 count matrices that every call steps through; the receive
counts are learned per call as the implementation allows.

Per size, the implementations take turns in rounds (so a change in the
machine's load hits them alike); every call starts aligned (an MPI barrier
on a communicator of the benchmark's own) and each rank times its own
calls. Printed: the slowest rank's median per call, in microseconds, and
the ratio to MPI. Every implementation's output is checked once per size
and schedule entry (rank r's block for rank j holds r * ranks + j).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import harmpi
import harmpi.distributed  # noqa: F401 - backend "harmpi", mpi://
from bench.harness import parse_names, parse_nbytes
from bench.load import host_load
from bench.report import fit_lines

IMPLS = ("harmpi", "torch:harmpi", "mpi", "gloo")
SCHEDULE = 16  # count matrices an --uneven run steps through


def _pattern(rank: int, n: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s input: block j (size bytes, float32) holds rank * n + j."""
    per = size // 4
    return torch.arange(n, dtype=torch.float32).add_(rank * n).repeat_interleave(per)


def _expected(rank: int, n: int, size: int) -> torch.Tensor:
    per = size // 4
    return (torch.arange(n, dtype=torch.float32) * n + rank).repeat_interleave(per)


def count_schedule(n: int, size: int, seed: int, entries: int = SCHEDULE) -> np.ndarray:
    """[entries, n, n] float32 counts: entry k's [i, j] is what rank i sends rank j
    in call k (mod entries), uniform in 0 .. 2 * size / 4 (mean: size bytes)."""
    rng = np.random.default_rng([seed, n, size])
    return rng.integers(0, 2 * (size // 4) + 1, size=(entries, n, n))


class Case:
    """One call's data on this rank: input, send and receive counts (float32
    elements per rank), the expected output."""

    def __init__(self, rank: int, n: int, counts: np.ndarray):
        values = torch.arange(n, dtype=torch.float32)
        self.send_counts = counts[rank].tolist()
        self.recv_counts = counts[:, rank].tolist()
        self.inp = (values + rank * n).repeat_interleave(torch.tensor(self.send_counts))
        self.expected = (values * n + rank).repeat_interleave(torch.tensor(self.recv_counts))


def _cases(rank: int, n: int, size: int, uneven: bool, seed: int) -> list[Case]:
    if not uneven:
        return [Case(rank, n, np.full((n, n), size // 4))]
    return [Case(rank, n, counts) for counts in count_schedule(n, size, seed)]


class Impl:
    """One implementation's call on prepared buffers: ``call()`` runs it once on
    the next case, ``output()`` is what that call received."""

    def __init__(self, name: str, cases: list[Case], uneven: bool, groups: dict, comm):
        self.name, self.cases, self.uneven = name, cases, uneven
        self.index = -1
        self.outs = [torch.full_like(c.expected, -1.0) for c in cases]
        self._comm = comm
        if name == "harmpi":
            self._run = self._harmpi
        elif name == "mpi":
            self._counts = np.zeros((2, comm.Get_size()), dtype=np.int32)
            self._run = self._mpi
        else:
            self.group = groups[name]
            self._counts_t = torch.zeros((2, comm.Get_size()), dtype=torch.int64)
            self._run = self._torch

    def call(self):
        self.index = (self.index + 1) % len(self.cases)
        self._run(self.cases[self.index], self.index)

    def output(self) -> torch.Tensor:
        return self.outs[self.index]

    def _harmpi(self, case: Case, i: int):
        if self.uneven:
            self.outs[i], _ = harmpi.alltoall(case.inp, case.send_counts)
        else:
            self.outs[i] = harmpi.alltoall(case.inp)

    def _mpi(self, case: Case, i: int):
        send, recv = case.inp.numpy(), self.outs[i].numpy()
        if not self.uneven:
            self._comm.Alltoall([send, MPI.FLOAT], [recv, MPI.FLOAT])
            return
        self._counts[0] = case.send_counts
        self._comm.Alltoall(self._counts[0], self._counts[1])  # the counts, as users must
        rc = self._counts[1]
        self._comm.Alltoallv([send, (self._counts[0], _displs(self._counts[0])), MPI.FLOAT],
                             [recv[: int(rc.sum())], (rc, _displs(rc)), MPI.FLOAT])

    def _torch(self, case: Case, i: int):
        if not self.uneven:
            dist.all_to_all_single(self.outs[i], case.inp, group=self.group)
            return
        self._counts_t[0] = torch.tensor(case.send_counts)
        dist.all_to_all_single(self._counts_t[1], self._counts_t[0], group=self.group)
        dist.all_to_all_single(self.outs[i], case.inp, self._counts_t[1].tolist(),
                               case.send_counts, group=self.group)


def _displs(counts) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)


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
    p.add_argument("--uneven", action="store_true",
                   help="counts differ per call and per rank pair (seeded, mean = size); "
                        "MPI_Alltoallv, with the counts exchanged first")
    p.add_argument("--seed", type=int, default=1, help="--uneven's counts")
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
    cases = _cases(rank, n, size, args.uneven, args.seed)
    prepared = [Impl(name, cases, args.uneven, groups, comm) for name in args.impls]
    for impl in prepared:
        for _ in range(max(args.warmup, len(cases))):
            impl.call()
        for _ in cases:  # one checked call per case
            impl.outs[(impl.index + 1) % len(cases)].fill_(-1.0)
            impl.call()
            if not torch.equal(impl.output(), cases[impl.index].expected):
                raise SystemExit(f"rank {rank}: {impl.name} all-to-all of {size} B "
                                 f"(case {impl.index}): wrong output")
    iters = args.iters if size <= 256 << 10 else max(args.iters // 4, 20)
    per_round = max(iters // args.rounds, 1)
    samples = {impl.name: [] for impl in prepared}
    for _ in range(args.rounds):
        for impl in prepared:
            samples[impl.name] += _time(impl, comm, per_round)
    medians = {name: float(np.median(s)) * 1e6 for name, s in samples.items()}
    every = comm.allgather(medians)
    return {name: max(m[name] for m in every) for name in medians}, per_round * args.rounds


CALLS = {
    "harmpi": ("harmpi.alltoall(x)", "harmpi.alltoall(x, send_counts)"),
    "torch:harmpi": ("dist.all_to_all_single on harmpi",
                     "dist.all_to_all_single (counts, then split sizes) on harmpi"),
    "mpi": ("MPI_Alltoall", "MPI_Alltoall (counts) + MPI_Alltoallv"),
    "gloo": ("dist.all_to_all_single on gloo",
             "dist.all_to_all_single (counts, then split sizes) on gloo"),
}


def report(rows, impls, n, uneven=False):
    info = harmpi.info()
    described = ", ".join(f"{name}: {CALLS[name][uneven]}" for name in impls)
    header = [
        f"# all-to-all latency{' (uneven counts)' if uneven else ''}: {n} ranks, "
        f"{info['nodes']} node(s) of {info['ranks_per_node']} ranks "
        f"({'virtual, ' if info['virtual_nodes'] else ''}transport {info['transport']}), "
        f"{info['mpi_library']}",  # MPI's own ends in a NUL
        f"# {described}",
        "# the slowest rank's median per call, us (each call starts aligned); "
        + ("size = mean bytes each rank sends to each rank (seeded counts 0 .. 2 x size, "
           f"{SCHEDULE} matrices in turn)" if uneven
           else "size = bytes each rank sends to each rank"),
    ]
    print("\n".join(fit_lines(header)))
    ratios = [name for name in impls if name != "mpi"] if "mpi" in impls else []
    # each column as wide as its name needs: four impls and three ratios fit 100 columns
    widths = {name: max(9, len(name) + 1) for name in impls}
    ratio_widths = {name: max(8, len(name) + 5) for name in ratios}
    print(f"{'# size':<8}" + "".join(f"{name:>{widths[name]}}" for name in impls)
          + "".join(f"{name + '/mpi':>{ratio_widths[name]}}" for name in ratios)
          + f"{'calls':>7}")
    for size, med, calls in rows:
        print(f"{_fmt(size):<8}" + "".join(f"{med[name]:>{widths[name]}.1f}" for name in impls)
              + "".join(f"{med[name] / med['mpi']:>{ratio_widths[name]}.2f}" for name in ratios)
              + f"{calls:>7}")


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("harmpi", init_method="mpi://")  # rendezvous over MPI
    comm = MPI.COMM_WORLD.Dup()  # the benchmark's barriers and MPI_Alltoall, apart from harmpi's
    groups = {"torch:harmpi": dist.group.WORLD}
    if "gloo" in args.impls:
        groups["gloo"] = dist.new_group(backend="gloo")
    rows = []
    with host_load(comm, args.load) as busy:
        for size in args.sizes:
            medians, calls = measure(size, args, groups, comm)
            rows.append((size, medians, calls))
    if comm.Get_rank() == 0:
        report(rows, args.impls, comm.Get_size(), args.uneven)
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
