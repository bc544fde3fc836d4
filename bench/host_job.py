"""One layout of ``make bench-host`` (``bench.host``): every collective asked
for, every size, every implementation, in one MPI job.

    mpirun -np 4 python -m mpi4py -m bench.host_job --collectives allreduce,alltoall \
        --sizes 2K,10K,1M --impl harmpi,mpi --json out.json

It runs the cells of ``bench.osu`` (its check pass, timing and per-rank
statistics, one ``bench.report.Row`` per implementation and size), with the
adapters made once for the whole job: one job start-up per layout instead of
one per collective, and no re-initialised library between collectives (a
fresh one makes the next first size cold). Iterations are set per cell so
that each cell moves about the same bytes (``cell_iterations``): by default
500 calls of an all-reduce up to 512 KB, 10 of a 4 MB all-to-all over 16
ranks (64 MB a call).

Rank 0 prints each collective's OSU-layout table into the job's log and
rewrites ``--json`` after every size, so a job killed by its time limit
still leaves the cells it finished.

Before a collective's first cell, every implementation makes
``--settle-calls`` untimed calls of it (``settle``): harmpi's first few
hundred calls in a job are slower (issue 37's cold first size: a 2 KB
all-reduce at 2 ranks took 4.7-5.0 us after 50 warm-up calls, 1.8 after
1000), and the table compares steady states. ``--settle-calls 0`` shows the
cold first size.
"""

from __future__ import annotations

import json
import os

import click

from bench import harness, job, osu, report
from bench.harness import ALLGATHER, ALLREDUCE, ALLTOALL, DTYPES
from bench.impls import ImplUnavailable, close_impls, harmpi_info_of, make_impls, parse_impls

__all__ = ["COLLECTIVES", "cell_iterations", "bytes_per_call", "settle", "run", "main"]

#: --collectives names, in the order a job runs them
COLLECTIVES = {"allreduce": ALLREDUCE, "allgather": ALLGATHER, "alltoall": ALLTOALL}


def cell_iterations(bytes_per_call: int, budget_bytes: int, max_iters: int,
                    min_iters: int) -> tuple[int, int]:
    """(timed calls, warm-up calls) of one cell: as many calls as move
    ``budget_bytes`` through each rank (``bytes_per_call`` each), within
    [min_iters, max_iters]; warm-up a tenth of that, at least 2 (pure).

    >>> cell_iterations(2048, 1 << 30, 1000, 10)  # a 2 KB all-reduce
    (1000, 100)
    >>> cell_iterations(64 << 20, 1 << 30, 1000, 10)  # a 4 MB all-to-all, 16 ranks
    (16, 2)
    """
    iters = max(min_iters, min(max_iters, budget_bytes // max(1, bytes_per_call)))
    return iters, max(2, iters // 10)


def bytes_per_call(collective, nbytes: int, n_ranks: int) -> int:
    """Bytes one call moves through each rank: the message for an all-reduce,
    the n-times larger output of an all-gather or all-to-all."""
    return nbytes * (1 if collective is ALLREDUCE else n_ranks)


def _settings(collective, dtype, iters: int, warmup: int, check: bool, stat: str, seed: int):
    """``bench.osu``'s settings of one cell (it sets iterations per run, here per cell)."""
    return osu._Settings(collective, dtype, iters, warmup, False, check, stat, seed)


def _write(path: str, meta: dict, rows: list[dict], done: bool) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(report.jsonable({"meta": {**meta, "done": done}, "rows": rows}), fh, indent=1)
        fh.write("\n")
    os.replace(tmp, path)  # a reader never sees half a document


def settle(comm, collective, impls, nbytes: int, options: dict) -> None:
    """Up to ``options['settle_calls']`` untimed calls of ``collective`` at
    ``nbytes`` by every implementation (within the cell's byte budget, and
    gloo's cap); one that cannot run it is left to its cell to report."""
    dtype = DTYPES[options["dtype"]]
    for impl in impls:
        wire = impl.wire_dtype(collective.op, dtype)
        count = max(1, nbytes // wire.itemsize)
        prepared, error = None, ""
        try:
            values = collective.timing_values(options["seed"], comm.Get_rank(), count, wire,
                                              comm.Get_size())
            prepared = impl.prepare(collective.op, values, wire)
        except ImplUnavailable as exc:
            error = str(exc) or type(exc).__name__
        if any(comm.allgather(error)):  # every rank skips alike
            continue
        # no more calls than the cell's byte budget allows (a 4 MB first size)
        budget_calls, _ = cell_iterations(bytes_per_call(collective, nbytes, comm.Get_size()),
                                          options["budget_bytes"], options["settle_calls"], 1)
        calls = min(budget_calls, impl.max_iterations or budget_calls)
        harness.time_op(prepared.run, comm.Barrier, 0, calls)


def _collective_rows(comm, collective, impls, impl_names, options: dict, say,
                     on_size) -> list[dict]:
    """Every size of one collective, every implementation, as JSON dicts; rank
    0 prints OSU's table as it goes. ``on_size(rows so far)`` after each size."""
    dtype = DTYPES[options["dtype"]]
    n = comm.Get_size()
    say(f"# {collective.name}, {dtype.name}, {n} ranks: per-rank {options['stat']}, "
        "average over ranks (Min/Max over ranks in the JSON)")
    header = report.format_table([], impl_names, full=False, check=options["check"],
                                 stat=options["stat"], width=report.WIDTH)
    for line in header:
        say(line)
    if options["settle_calls"] and options["sizes"]:
        settle(comm, collective, impls, options["sizes"][0], options)
    rows, notes = [], {}
    for nbytes in options["sizes"]:
        iters, warmup = cell_iterations(bytes_per_call(collective, nbytes, n),
                                        options["budget_bytes"], options["max_iters"],
                                        options["min_iters"])
        settings = _settings(collective, dtype, iters, warmup, options["check"],
                             options["stat"], options["seed"])
        size_rows = [osu._run_cell(comm, settings, impl, nbytes, notes) for impl in impls]
        for line in report.format_table(size_rows, impl_names, full=False,
                                        check=options["check"], stat=options["stat"],
                                        width=report.WIDTH)[len(header):]:
            say(line)
        rows += [{"collective": collective.op, **row.to_json()} for row in size_rows]
        on_size(rows)
    for (name, message), sizes in notes.items():
        say(f"# note: {name} ({', '.join(map(str, sizes))} B): {message}")
    return rows


def run(options: dict) -> int:
    """The whole job (collective); rank 0 prints and writes ``options['json']``.
    Returns 1 if a check pass (``--check``) failed anywhere, else 0."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()

    def say(text=""):
        if rank == 0:
            print("\n".join(report.fit_lines([text])), flush=True)

    impls = make_impls(options["impls"], comm, gloo_max_iterations=options["gloo_max_iters"])
    try:
        topo = job.topology(comm)
        info = harmpi_info_of(impls)
        env_lines = job.environment_lines(comm, topo, info)
        meta = {"benchmark": "host_job", "version": job.bench_version(), "topology": topo,
                "impls": options["impls"], "stat": options["stat"],
                "settle_calls": options["settle_calls"],
                "latency_fields": report.latency_fields(options["stat"]),
                "environment": [line.lstrip("# ") for line in env_lines],
                "harmpi_info": info}
        say(f"# harmpi bench.host_job v{meta['version']}")
        for line in env_lines:
            say(line)
        rows: list[dict] = []
        for name in options["collectives"]:
            def on_size(new_rows, before=list(rows)):  # the JSON so far, after each size
                if rank == 0 and options["json"]:
                    _write(options["json"], meta, before + new_rows, False)

            rows += _collective_rows(comm, COLLECTIVES[name], impls, options["impls"],
                                     options, say, on_size)
        if rank == 0 and options["json"]:
            _write(options["json"], meta, rows, True)
        failed = any(row["valid"] is False for row in rows)
        return int(comm.allreduce(1 if failed else 0, op=MPI.MAX))
    finally:
        close_impls(impls)


@click.command(name="host_job", help=(
    "One layout of make bench-host: the collectives asked for at every size, harmpi against "
    "its rivals in one job. Run under MPI: mpirun -np N python -m mpi4py -m bench.host_job "
    "[options]. Only rank 0 prints."))
@job.help_option()
@click.option("--collectives", default=",".join(COLLECTIVES), show_default=True,
              help="Comma list of allreduce, allgather, alltoall.")
@click.option("--sizes", default="2K,4K,8K,10K,16K,32K,64K,128K,256K,512K,1M,2M,4M",
              show_default=True, help="Bytes per rank (K/M suffixes), comma list.")
@click.option("--impl", "impl_spec", default="harmpi,mpi", show_default=True,
              help="Comma list, as bench.osu_allreduce --impl takes it.")
@click.option("--dtype", "dtype_name", type=click.Choice(["bf16", "f16", "f32"]),
              default="bf16", show_default=True)
@click.option("--stat", type=click.Choice(["mean", "median"]), default="median",
              show_default=True)
@click.option("--budget-mb", type=click.FloatRange(min=0.001), default=256, show_default=True,
              help="MiB each cell moves through each rank (sets its calls).")
@click.option("--max-iters", type=click.IntRange(min=1), default=500, show_default=True)
@click.option("--min-iters", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--settle-calls", type=click.IntRange(min=0), default=1000, show_default=True,
              help="Untimed calls of each collective by each implementation before its first "
                   "cell (0: time harmpi's cold first size).")
@click.option("--gloo-max-iters", type=click.IntRange(min=1), default=20, show_default=True,
              help="Cap on gloo's timed calls per cell (milliseconds each).")
@click.option("-c", "--check", is_flag=True,
              help="bench.osu's check pass before each cell (costly at many ranks: every "
                   "rank rebuilds every rank's input).")
@click.option("--seed", type=int, default=20240607, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True),
              default=None, help="Write every row as JSON (rank 0), rewritten after each size.")
def main(collectives, sizes, impl_spec, dtype_name, stat, budget_mb, max_iters, min_iters,
         settle_calls, gloo_max_iters, check, seed, json_path):
    try:
        names = harness.parse_names(collectives, COLLECTIVES)
        nbytes = [harness.parse_nbytes(text) for text in sizes.split(",") if text.strip()]
        impls = parse_impls(impl_spec)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    options = dict(collectives=names, sizes=nbytes, impls=impls, dtype=dtype_name, stat=stat,
                   budget_bytes=int(budget_mb * harness.MIB), max_iters=max_iters,
                   min_iters=min(min_iters, max_iters), settle_calls=settle_calls,
                   gloo_max_iters=gloo_max_iters,
                   check=check, seed=seed, json=json_path)
    job.exit_all(job.run_or_abort(run, options))


if __name__ == "__main__":
    main()
