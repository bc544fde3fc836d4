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
machine's load hits them alike); every call starts aligned (an MPI barrier,
outside the timed region: ``bench.harness.time_op``) and each rank times its
own calls. Printed: the slowest rank's median per call, in microseconds, and
the ratio to MPI. Every implementation's output is checked once per size
and schedule entry (rank r's block for rank j holds r * ranks + j). The
implementations are the adapters of ``bench.impls`` (their ``alltoall``);
``bench.osu.command(ALLTOALL)`` times the same calls in OSU's layout.
"""

from __future__ import annotations

import click
import numpy as np

from bench import job, report
from bench.harness import parse_names, parse_nbytes, rank_stat_us, summarize_ranks, time_op
from bench.impls import close_impls, harmpi_info_of, make_impls
from bench.job import topology
from bench.load import host_load

IMPLS = ("harmpi", "torch:harmpi", "mpi", "gloo")
SCHEDULE = 16  # count matrices an --uneven run steps through


def count_schedule(n: int, size: int, seed: int, entries: int = SCHEDULE) -> np.ndarray:
    """[entries, n, n] float32 counts: entry k's [i, j] is what rank i sends rank j
    in call k (mod entries), uniform in 0 .. 2 * size / 4 (mean: size bytes)."""
    rng = np.random.default_rng([seed, n, size])
    return rng.integers(0, 2 * (size // 4) + 1, size=(entries, n, n))


class Case:
    """One call's data on this rank: input, send and receive counts (float32
    elements per rank), the expected output."""

    def __init__(self, rank: int, n: int, counts: np.ndarray):
        import torch

        values = torch.arange(n, dtype=torch.float32)
        self.send_counts = counts[rank].tolist()
        self.recv_counts = counts[:, rank].tolist()
        self.inp = (values + rank * n).repeat_interleave(torch.tensor(self.send_counts))
        self.expected = (values * n + rank).repeat_interleave(torch.tensor(self.recv_counts))


def _cases(rank: int, n: int, size: int, uneven: bool, seed: int) -> list[Case]:
    if not uneven:
        return [Case(rank, n, np.full((n, n), size // 4))]
    return [Case(rank, n, counts) for counts in count_schedule(n, size, seed)]


class Caller:
    """One adapter's all-to-all on prepared buffers: ``call()`` runs it once on
    the next case, ``output()`` is what that call received."""

    def __init__(self, adapter, cases: list[Case], uneven: bool):
        import torch

        self.name, self.cases, self.uneven = adapter.name, cases, uneven
        self.index = -1
        self.outs = [torch.full_like(c.expected, -1.0) for c in cases]
        self._alltoall = adapter.alltoall

    def call(self):
        self.index = i = (self.index + 1) % len(self.cases)
        case = self.cases[i]
        counts = case.send_counts if self.uneven else None
        self.outs[i] = self._alltoall(case.inp, counts, out=self.outs[i])[0]

    def output(self):
        return self.outs[self.index]


def measure(size: int, settings: dict, adapters, comm):
    """{impl: the slowest rank's median per call, us} at one size, and the calls timed."""
    import torch

    n, rank = comm.Get_size(), comm.Get_rank()
    cases = _cases(rank, n, size, settings["uneven"], settings["seed"])
    callers = [Caller(adapter, cases, settings["uneven"]) for adapter in adapters]
    for caller in callers:
        for _ in range(max(settings["warmup"], len(cases))):
            caller.call()
        for _ in cases:  # one checked call per case
            caller.outs[(caller.index + 1) % len(cases)].fill_(-1.0)
            caller.call()
            if not torch.equal(caller.output(), cases[caller.index].expected):
                raise SystemExit(f"rank {rank}: {caller.name} all-to-all of {size} B "
                                 f"(case {caller.index}): wrong output")
    iters = settings["iters"]
    iters = iters if size <= 256 << 10 else max(iters // 4, 20)
    per_round = max(iters // settings["rounds"], 1)
    samples = {caller.name: [] for caller in callers}
    for _ in range(settings["rounds"]):
        for caller in callers:
            samples[caller.name].append(time_op(caller.call, comm.Barrier, per_round, 0))
    medians = {name: rank_stat_us(np.concatenate(s), "median") for name, s in samples.items()}
    every = comm.allgather(medians)
    slowest = {name: summarize_ranks([m[name] for m in every])[2] for name in medians}
    return slowest, per_round * settings["rounds"]


def _header(comm, adapters, uneven: bool) -> list[str]:
    """The lines above the table (collective: every rank calls it)."""
    from mpi4py import MPI

    info = harmpi_info_of(adapters)
    library = MPI.Get_library_version().strip().splitlines()[0].split(",")[0]
    if info is None:  # no harmpi adapter: the topology as bench.job sees it
        topo = topology(comm)
        info = {"nodes": topo["nodes"], "ranks_per_node": topo["ranks_per_node"],
                "virtual_nodes": topo["virtual"], "transport": "n/a (no harmpi)"}
    described = "; ".join(adapter.describe_alltoall(uneven) for adapter in adapters)
    return [
        f"# all-to-all latency{' (uneven counts)' if uneven else ''}: {comm.Get_size()} ranks, "
        f"{info['nodes']} node(s) of {info['ranks_per_node']} ranks "
        f"({'virtual, ' if info['virtual_nodes'] else ''}transport {info['transport']}), "
        f"{library}",
        f"# {described}",
        "# the slowest rank's median per call, us (each call starts aligned); "
        + ("size = mean bytes each rank sends to each rank (seeded counts 0 .. 2 x size, "
           f"{SCHEDULE} matrices in turn)" if uneven
           else "size = bytes each rank sends to each rank"),
    ]


def run(settings: dict) -> int:
    """Every size, every implementation (collective); rank 0 prints.  Returns 0."""
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    adapters = make_impls(settings["impls"], comm)
    try:
        header = _header(comm, adapters, settings["uneven"])
        rows = []
        with host_load(comm, settings["load"]) as busy:
            for size in settings["sizes"]:
                medians, calls = measure(size, settings, adapters, comm)
                rows.append((size, medians, calls))
        if comm.Get_rank() == 0:
            lines = report.fit_lines(header) + report.alltoall_table(rows, settings["impls"])
            print("\n".join(lines + ([busy.summary()] if settings["load"] else [])), flush=True)
        return 0
    finally:
        close_impls(adapters)


@click.command(name="osu_alltoall", help=(
    "All-to-all latency of harmpi.alltoall against MPI_Alltoall (and torch.distributed on "
    "harmpi and gloo) on the same ranks. Run under MPI: mpirun -np N python -m mpi4py -m "
    "bench.osu_alltoall [options]. Only rank 0 prints."))
@job.help_option()
@click.option("--sizes", default="4K,64K,1M", show_default=True,
              help="Bytes each rank sends to each rank (K/M suffixes), comma list.")
@click.option("--impl", "impl_spec", default="harmpi,mpi", show_default=True,
              help=f"Comma list of {', '.join(IMPLS)}.")
@click.option("--iters", type=int, default=400, show_default=True,
              help="Timed calls per size and impl (a quarter of it above 256 KiB).")
@click.option("--rounds", type=click.IntRange(min=1), default=8, show_default=True,
              help="Turns the impls take per size.")
@click.option("--warmup", type=int, default=20, show_default=True)
@click.option("--uneven", is_flag=True,
              help="Counts differ per call and per rank pair (seeded, mean = size); "
                   "MPI_Alltoallv, with the counts exchanged first.")
@click.option("--seed", type=int, default=1, show_default=True, help="--uneven's counts.")
@click.option("--load", type=click.IntRange(min=0), default=0, show_default=True, metavar="N",
              help="N busy processes (unbound spin loops) on each host while measuring, "
                   "started by the host's first rank.")
def main(sizes, impl_spec, iters, rounds, warmup, uneven, seed, load):
    try:
        impls = parse_names(impl_spec, IMPLS)
        nbytes = [parse_nbytes(text) for text in sizes.split(",")]
    except ValueError as exc:
        raise click.UsageError(f"--impl {impl_spec!r} / --sizes {sizes!r}: {exc}") from exc
    if any(size % 4 for size in nbytes):
        raise click.UsageError("every size must be a multiple of 4 bytes (float32)")
    settings = dict(sizes=nbytes, impls=impls, iters=iters, rounds=rounds, warmup=warmup,
                    uneven=uneven, seed=seed, load=load)
    job.exit_all(job.run_or_abort(run, settings))


if __name__ == "__main__":
    main()
