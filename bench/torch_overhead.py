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

harmpi, torch:harmpi and mpi are the adapters of ``bench.impls``, prepared
as the OSU harness prepares them (``Impl.prepare``); torch:newgrp and
torch:noop are this benchmark's own groups. Per size the implementations
take turns in rounds (a change in the load hits them alike); every call
starts aligned (a barrier, untimed: ``bench.harness.time_op``) and each
rank times its own calls. Printed: the slowest rank's median per call (us),
each one's ratio to MPI, and the attribution torch:harmpi - torch:noop -
harmpi: what the backend's own code adds beyond torch's wrapper and
harmpi's all-reduce. Every implementation's result is checked once per size
against the harness's float64 reference (``ALLREDUCE.check``); the timed
buffers hold zeros, as the OSU harness's do.
"""

from __future__ import annotations

import os
from functools import partial

import click
import numpy as np

from bench import job
from bench.harness import (
    ALLREDUCE,
    DTYPES,
    parse_names,
    parse_nbytes,
    rank_stat_us,
    summarize_ranks,
    time_op,
)
from bench.impl_base import Prepared, storage_from_torch, torch_from_storage
from bench.impls import close_impls, make_impls

IMPLS = ("torch:harmpi", "torch:newgrp", "torch:noop", "harmpi", "mpi")
#: the adapters of bench.impls among IMPLS (the others are groups made here)
ADAPTED = ("torch:harmpi", "harmpi", "mpi")
SEED = 20240607


def _noop_group(rank: int, n: int):
    """torch's wrapper with nothing behind it: allreduce returns a done work."""
    import torch.distributed as dist

    class NoopWork(dist._Work):
        def wait(self, timeout=None):
            return True

    class NoopGroup(dist.ProcessGroup):
        _done = NoopWork()

        def allreduce(self, tensors, opts=None):
            return self._done

    return NoopGroup(rank, n)


def _on_group(group, values, dtype) -> Prepared:
    """``dist.all_reduce(t, group=group)`` on a tensor of ``values``."""
    import torch.distributed as dist

    tensor = torch_from_storage(values, dtype)

    def run(tensor=tensor, all_reduce=dist.all_reduce, group=group):
        all_reduce(tensor, group=group)

    return Prepared(run, lambda: storage_from_torch(tensor, dtype))


def _prepare(name, adapters, groups, values_of, bf16):
    """(prepared call, the dtype it reduces) of implementation ``name``."""
    if name in adapters:
        wire = adapters[name].wire_dtype("allreduce", bf16)
        return adapters[name].prepare("allreduce", values_of(wire), wire), wire
    return _on_group(groups[name], values_of(bf16), bf16), bf16


def measure(size: int, settings: dict, adapters: dict, groups: dict, comm) -> dict:
    """{impl: the slowest rank's median per call, us} at ``size`` bytes."""
    n, rank = comm.Get_size(), comm.Get_rank()
    bf16 = DTYPES["bf16"]
    calls = {}
    for name in settings["impls"]:
        def values_of(wire, values=ALLREDUCE.timing_values):  # zeros: sums stay finite
            return values(SEED, rank, size // wire.itemsize, wire)

        calls[name], wire = _prepare(name, adapters, groups, values_of, bf16)
        for _ in range(settings["warmup"]):
            calls[name].run()
        checked = _prepare(name, adapters, groups, partial(values_of, values=ALLREDUCE.init_values),
                           bf16)[0]
        checked.run()
        ok, detail = ALLREDUCE.check(checked.result(), SEED, n, size // wire.itemsize, wire)
        if not ok and name != "torch:noop":  # noop reduces nothing, by design
            raise SystemExit(f"rank {rank}: {name} all-reduce of {size} B: wrong result "
                             f"({detail})")
    per_round = max(settings["iters"] // settings["rounds"], 1)
    samples = {name: [] for name in calls}
    for _ in range(settings["rounds"]):
        for name, prepared in calls.items():
            samples[name].append(time_op(prepared.run, comm.Barrier, per_round, 0))
    medians = {name: rank_stat_us(np.concatenate(s), "median") for name, s in samples.items()}
    every = comm.allgather(medians)
    return {name: summarize_ranks([m[name] for m in every])[2] for name in medians}


def report_lines(rows, impls, n, torch_version: str) -> list[str]:
    lines = [f"# dist.all_reduce overhead: {n} ranks, torch {torch_version}, "
             f"1-min load average {os.getloadavg()[0]:.2f}",
             "# the slowest rank's median per call, us (each call starts aligned); bf16, "
             "size = bytes per rank"]
    ratios = [name for name in impls if name != "mpi"] if "mpi" in impls else []
    own = all(k in impls for k in ("torch:harmpi", "torch:noop", "harmpi"))
    lines.append(f"{'# size':<8}" + "".join(f"{name:>14}" for name in impls)
                 + "".join(f"{name + '/mpi':>18}" for name in ratios)
                 + (f"{'backend own':>13}" if own else ""))
    for size, med in rows:
        line = f"{size:<8}" + "".join(f"{med[name]:>14.2f}" for name in impls)
        line += "".join(f"{med[name] / med['mpi']:>18.2f}" for name in ratios)
        if own:
            line += f"{med['torch:harmpi'] - med['torch:noop'] - med['harmpi']:>13.2f}"
        lines.append(line)
    return lines


def run(settings: dict) -> int:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from harmpi.distributed import ProcessGroupHarmpi

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    # torch:harmpi first: the default group is harmpi's, as torch:harmpi times it
    names = ["torch:harmpi"] + [name for name in ("harmpi", "mpi") if name in settings["impls"]]
    impls = make_impls(names, comm)
    try:
        adapters = {impl.name: impl for impl in impls}
        groups = {"torch:noop": _noop_group(rank, n)}
        if "torch:newgrp" in settings["impls"]:
            groups["torch:newgrp"] = dist.new_group(list(range(n)), backend="harmpi")
            assert isinstance(groups["torch:newgrp"], ProcessGroupHarmpi)
        rows = [(size, measure(size, settings, adapters, groups, comm))
                for size in settings["sizes"]]
        if rank == 0:
            print("\n".join(report_lines(rows, settings["impls"], n, torch.__version__)),
                  flush=True)
        return 0
    finally:
        close_impls(impls)


@click.command(name="torch_overhead", help=(
    "Where the time of dist.all_reduce on backend harmpi goes: torch's wrapper, the backend, "
    "harmpi's all-reduce, against MPI_Allreduce. Run under MPI: mpirun -np 2 python -m mpi4py "
    "-m bench.torch_overhead. Only rank 0 prints."))
@job.help_option()
@click.option("--sizes", default="2K,10K", show_default=True,
              help="Bytes per rank (K/M suffixes), comma list.")
@click.option("--impl", "impl_spec", default=",".join(IMPLS), show_default=True,
              help=f"Comma list of {', '.join(IMPLS)}.")
@click.option("--iters", type=int, default=4000, show_default=True,
              help="Timed calls per size and impl.")
@click.option("--rounds", type=click.IntRange(min=1), default=8, show_default=True,
              help="Turns the impls take per size.")
@click.option("--warmup", type=int, default=200, show_default=True)
def main(sizes, impl_spec, iters, rounds, warmup):
    try:
        impls = parse_names(impl_spec, IMPLS)
        nbytes = [parse_nbytes(text) for text in sizes.split(",")]
    except ValueError as exc:
        raise click.UsageError(f"--impl {impl_spec!r} / --sizes {sizes!r}: {exc}") from exc
    if any(size % 4 or size <= 0 for size in nbytes):
        raise click.UsageError("every size must be a positive multiple of 4 bytes")
    settings = dict(sizes=nbytes, impls=impls, iters=iters, rounds=rounds, warmup=warmup)
    job.exit_all(job.run_or_abort(run, settings))


if __name__ == "__main__":
    main()
