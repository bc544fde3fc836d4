"""The OSU-style command line shared by ``osu_allreduce`` and ``osu_allgather``
(``command(ALLTOALL)`` runs the all-to-all the same way).

``command(collective)`` builds the click command; the MPI side of the method
(checking, timing and gathering per-rank numbers, printing on rank 0) is
here.  The pure method is ``bench.harness``, the tables, JSON and plot
``bench.report``, the topology, header and exit ``bench.job``.
"""

from __future__ import annotations

import dataclasses

import click

from bench import harness, job, report
from bench.harness import DTYPES, Collective, DType
from bench.impls import ImplUnavailable, close_impls, harmpi_info_of, make_impls, parse_impls
from bench.job import bench_version, environment_lines, topology
from bench.load import host_load
from bench.report import Row

__all__ = ["command", "run"]


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------


def _all_ranks_ok(comm, ok: bool) -> bool:
    from mpi4py import MPI

    return bool(comm.allreduce(bool(ok), op=MPI.LAND))


def _check_cell(comm, collective: Collective, impl, count: int, wire,
                seed: int) -> tuple[bool, str]:
    """The untimed check pass for one (impl, size) cell; same answer on every rank."""
    rank, n_ranks = comm.Get_rank(), comm.Get_size()
    values = collective.init_values(seed, rank, count, wire, n_ranks)
    prepared = impl.prepare(collective.op, values, wire)
    prepared.run()
    result = prepared.result()
    ok, detail = collective.check(result, seed, n_ranks, count, wire, rank)
    digests = comm.allgather(harness.digest(result))
    details = comm.allgather(detail)
    all_ok = all(not d for d in details)
    identical = not collective.same_result or len(set(digests)) == 1
    notes = [f"rank {r}: {d}" for r, d in enumerate(details) if d]
    if not identical:
        groups = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        notes.append("results differ across ranks: "
                     + " | ".join(",".join(map(str, g)) for g in groups.values()))
    return all_ok and identical, "; ".join(notes)


@dataclasses.dataclass(frozen=True)
class _Settings:
    """How every (implementation, size) cell is run and shown (the same on every rank)."""

    collective: Collective
    dtype: DType
    iterations: int | None
    warmup: int | None
    full: bool
    check: bool
    stat: str
    seed: int
    width: int | None = report.WIDTH  # None: --wide

    def table_options(self) -> dict:
        return dict(full=self.full, check=self.check, stat=self.stat, width=self.width)


def _prepare_cell(comm, settings: _Settings, impl, row: Row, wire: DType, notes: dict):
    """The check pass (with -c), then the timed operation: (prepared, "") or
    (None, why) when the implementation cannot run this cell."""
    collective = settings.collective
    try:
        if settings.check:
            row.valid, detail = _check_cell(comm, collective, impl, row.count, wire, settings.seed)
            if detail:
                notes.setdefault((impl.name, detail), []).append(row.size)
        values = collective.timing_values(settings.seed, comm.Get_rank(), row.count, wire,
                                          comm.Get_size())
        return impl.prepare(collective.op, values, wire), ""
    except ImplUnavailable as exc:
        return None, str(exc) or type(exc).__name__


def _run_cell(comm, settings: _Settings, impl, nbytes: int, notes: dict) -> Row:
    """Check and time one implementation at one size (collective); rank 0's row has the times."""
    op, dtype = settings.collective.op, settings.dtype
    wire = impl.wire_dtype(op, dtype)
    count = max(1, nbytes // wire.itemsize)
    iters, warm = harness.iterations_for(nbytes, settings.iterations, settings.warmup)
    iters, warm = harness.capped_iterations(iters, warm, impl.max_iterations)
    row = Row(impl=impl.name, dtype=dtype.name, size=nbytes, avg_us=None, min_us=None,
              max_us=None, iterations=iters, valid=None, wire_dtype=wire.name, count=count,
              warmup=warm, stat=settings.stat)
    prepared, error = _prepare_cell(comm, settings, impl, row, wire, notes)
    errors = comm.allgather(error)
    if any(errors):
        row.valid = None
        row.note = next(e for e in errors if e)
        notes.setdefault((impl.name, f"not run: {row.note}"), []).append(nbytes)
        return row
    samples_ns = harness.time_op(prepared.run, comm.Barrier, iters, warm)
    del prepared
    per_rank_us = comm.gather(harness.rank_stat_us(samples_ns, settings.stat), root=0)
    if comm.Get_rank() == 0:
        row.avg_us, row.min_us, row.max_us = harness.summarize_ranks(per_rank_us)
        factor = settings.collective.busbw_factor(comm.Get_size())
        row.busbw_gbps = harness.busbw_gbps(nbytes, row.avg_us, factor)
    return row


def _run_sizes(comm, settings: _Settings, impls, impl_names, sizes, say):
    """Every cell, size by size; rank 0 prints each size's line as soon as
    every implementation has run it, as OSU does.  Returns (rows, notes):
    notes maps (implementation, message) to the sizes it applies to."""
    table = settings.table_options()
    # -f with several implementations: the compact table while running, then
    # one full table per implementation (see _full_tables)
    table["full"] = settings.full and len(impl_names) == 1
    header = report.format_table([], impl_names, **table)
    for line in header:
        say(line)
    rows: list[Row] = []
    notes: dict[tuple[str, str], list[int]] = {}
    for nbytes in sizes:
        if nbytes < settings.dtype.itemsize:
            continue
        size_rows = [_run_cell(comm, settings, impl, nbytes, notes) for impl in impls]
        rows.extend(size_rows)
        for line in report.format_table(size_rows, impl_names, **table)[len(header):]:
            say(line)
    return rows, notes


def _header_lines(settings: _Settings, env_lines, impls, impl_names) -> list[str]:
    """The '#' lines between the title and the table."""
    op, dtype, full = settings.collective.op, settings.dtype, settings.full
    lines = [f"# Datatype: {dtype.name} ({dtype.itemsize} bytes per element); "
             "Size = bytes per rank"]
    lines += env_lines
    lines += [f"# {impl.describe(op, dtype)}" for impl in impls]
    timing = (
        f"# Timing: barrier before every iteration (untimed), per-rank {settings.stat} of the "
        f"timed calls, then average over ranks{' (Min/Max: over ranks)' if full else ''}"
    )
    if full:
        timing += f"; BusBW = Size/t x {'2(n-1)/n' if op == 'allreduce' else '(n-1)'}"
        if len(impls) > 1:
            timing += ("; -f: latencies while running, then one table per "
                       "implementation with every column")
    lines.append(timing)
    if len(impls) > 1:
        reference = report.reference_impl(impl_names)
        lines.append(f"# Ratios: latency of each implementation / latency of {reference} "
                     f"(above 1: {reference} is faster)")
    return lines


def _footer_lines(notes: dict, sizes, check: bool, exit_code: int) -> list[str]:
    lines = []
    for (name, message), note_sizes in notes.items():
        if len(note_sizes) == len(sizes):
            where = "every size"
        else:
            where = ", ".join(f"{n} B" for n in note_sizes)
        lines.append(f"# note: {name} ({where}): {message}")
    if check:
        lines.append(f"# Validation: {'all Pass' if exit_code == 0 else 'FAILED'}")
    return lines


def _meta(settings: _Settings, title: str, impls, impl_names, topo: dict, env_lines,
          harmpi_info) -> dict:
    """The --json document's "meta"."""
    collective, dtype = settings.collective, settings.dtype
    return {
        "benchmark": f"osu_{collective.op}",
        "title": title.lstrip("# "),
        "dtype": dtype.name,
        "stat": settings.stat,
        "latency_fields": report.latency_fields(settings.stat),
        "impls": impl_names,
        "topology": topo,
        "environment": [line.lstrip("# ") for line in env_lines],
        "descriptions": {impl.name: impl.describe(collective.op, dtype) for impl in impls},
        "harmpi_info": harmpi_info,
        "busbw_factor": collective.busbw_factor(topo["ranks"]),
    }


def _write_outputs(rows, meta: dict, settings: _Settings, impl_names, json_path,
                   plot_path) -> None:
    """--json and --plot (rank 0)."""
    if json_path:
        with open(json_path, "w") as fh:
            fh.write(report.rows_to_json(rows, report.jsonable(meta)))
    if plot_path:
        topo = meta["topology"]
        nodes = f"{topo['nodes']} node{'s' if topo['nodes'] != 1 else ''}"
        title = (f"{settings.collective.name} {settings.dtype.name}, {topo['ranks']} ranks, "
                 f"{nodes}")
        report.plot_rows(rows, impl_names, plot_path, title)


def run(
    collective: Collective,
    *,
    sizes: list[int],
    impl_names: list[str],
    dtype_name: str,
    iterations: int | None,
    warmup: int | None,
    full: bool,
    check: bool,
    stat: str,
    json_path: str | None,
    plot_path: str | None,
    gloo_max_iters: int | None,
    seed: int,
    comm=None,
    load: int = 0,
    wide: bool = False,
) -> int:
    """Run the benchmark on every rank; rank 0 prints.  Returns the exit code.

    ``load``: busy processes started on the first rank of each host for the
    measured part of the run (``bench.load``)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    rank = comm.Get_rank()
    settings = _Settings(collective, DTYPES[dtype_name], iterations, warmup, full, check, stat,
                         seed, None if wide else report.WIDTH)

    def say(text=""):  # rank 0 prints, '#' lines wrapped to the width unless --wide
        if rank == 0:
            print("\n".join(report.fit_lines([text], settings.width)), flush=True)

    impls = make_impls(impl_names, comm, gloo_max_iterations=gloo_max_iters)
    try:
        topo = topology(comm)
        info = harmpi_info_of(impls)
        env_lines = environment_lines(comm, topo, info)

        title = f"# harmpi OSU-style {collective.name} Latency Test v{bench_version()}"
        for line in [title, *_header_lines(settings, env_lines, impls, impl_names)]:
            say(line)
        with host_load(comm, load) as busy:
            rows, notes = _run_sizes(comm, settings, impls, impl_names, sizes, say)
        if load:
            say(busy.summary())
        if settings.full and len(impl_names) > 1:
            for line in report.format_tables(rows, impl_names, check=settings.check,
                                              stat=settings.stat):
                say(line)

        exit_code = 0 if _all_ranks_ok(comm, all(row.valid is not False for row in rows)) else 1
        for line in _footer_lines(notes, sizes, check, exit_code):
            say(line)
        if rank == 0:
            meta = _meta(settings, title, impls, impl_names, topo, env_lines, info)
            _write_outputs(rows, meta, settings, impl_names, json_path, plot_path)
        return exit_code
    finally:
        close_impls(impls)


# --------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------


def _parse_arguments(message_size, extra_sizes: str, impl_spec: str, plot_path):
    """(sizes, implementation names) from the command line; click.UsageError when wrong."""
    try:
        extra = [harness.parse_nbytes(x) for x in extra_sizes.split(",") if x.strip()]
        sizes = harness.parse_sizes(message_size, extra=extra)
        impl_names = parse_impls(impl_spec)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise click.UsageError(
                f"--plot needs matplotlib ({exc}); pip install matplotlib"
            ) from exc
    return sizes, impl_names


def command(collective: Collective) -> click.Command:
    """The click command of one collective's microbenchmark."""
    path_type = click.Path(dir_okay=False, writable=True)

    @click.command(
        name=f"osu_{collective.op}",
        help=(
            f"OSU-style {collective.name} latency of harmpi, MPI and Gloo on the same ranks. "
            f"Run under MPI: mpirun -np N python -m mpi4py -m bench.osu_{collective.op} "
            "[options]. Only rank 0 prints."
        ),
    )
    @job.help_option()
    @click.option("-m", "--message-size", "message_size", default=None, metavar="[MIN:]MAX",
                  help="Sizes in bytes (K/M suffixes ok), doubling from MIN to MAX. "
                       "Default 2:4M.")
    @click.option("--extra-sizes", default=str(harness.DECODE_NBYTES), show_default=True,
                  metavar="LIST",
                  help="Comma list of sizes added when inside MIN..MAX ('' for none); "
                       "10240 = bf16 hidden 5120.")
    @click.option("-i", "--iterations", type=click.IntRange(min=1), default=None,
                  help="Timed iterations for every size "
                       "(default OSU's: 1000 up to 8 KiB, 100 above).")
    @click.option("-x", "--warmup", type=click.IntRange(min=0), default=None,
                  help="Warm-up iterations for every size (default 100 up to 8 KiB, 10 above).")
    @click.option("-f", "--full", is_flag=True,
                  help="Add Min/Max latency over ranks, Iterations and BusBW.")
    @click.option("-c", "--validation", "check", is_flag=True,
                  help="Check every size against a float64 reference and across ranks; "
                       "Pass/Fail column; exit 1 on any Fail.")
    @click.option("--impl", "impl_spec", default="harmpi,mpi,gloo", show_default=True,
                  help="Comma list of harmpi, harmpi:<algorithm>, mpi, gloo (= torch:gloo), "
                       "gloo:unbound (gloo's threads on every CPU, the caller bound), "
                       "torch:harmpi (torch.distributed on a harmpi process group), "
                       "deepspeed (DeepSpeed's CPU shared-memory all-reduce op, one host; "
                       "pip install 'harmpi[deepspeed]').")
    @click.option("--dtype", "dtype_name", type=click.Choice(["bf16", "f16", "f32"]),
                  default="bf16", show_default=True)
    @click.option("--stat", type=click.Choice(["mean", "median"]), default="mean",
                  show_default=True,
                  help="Per-rank statistic of the timed calls. mean keeps OSU's "
                       "'Avg Latency(us)' column; median prints 'Median Latency(us)'.")
    @click.option("--json", "json_path", type=path_type, default=None,
                  help="Write every row as JSON (rank 0).")
    @click.option("--plot", "plot_path", type=path_type, default=None,
                  help="Write latency vs size, log-log, one line per implementation "
                       "(PNG, needs matplotlib).")
    @click.option("--gloo-max-iters", type=click.IntRange(min=1), default=50, show_default=True,
                  help="Cap on gloo's timed iterations per size (gloo takes milliseconds "
                       "per call); deepspeed gets the same cap with more ranks than CPUs "
                       "(it spins without yielding).")
    @click.option("--seed", type=int, default=20240607, show_default=True,
                  help="Seed of the check pass's data.")
    @click.option("--wide", is_flag=True,
                  help=f"Print lines as long as they come: several implementations side by "
                       f"side with OSU's column labels, comment lines unwrapped (default: "
                       f"everything fits {report.WIDTH} columns; --json has every detail).")
    @click.option("--load", type=click.IntRange(min=0), default=0, show_default=True,
                  metavar="N",
                  help="Run N busy processes (unbound spin loops) on each host while "
                       "measuring, started by the host's first rank; a busy machine on purpose.")
    def main(message_size, extra_sizes, iterations, warmup, full, check, impl_spec, dtype_name,
             stat, json_path, plot_path, gloo_max_iters, seed, wide, load):
        sizes, impl_names = _parse_arguments(message_size, extra_sizes, impl_spec, plot_path)
        code = job.run_or_abort(
            run, collective, sizes=sizes, impl_names=impl_names, dtype_name=dtype_name,
            iterations=iterations, warmup=warmup, full=full, check=check, stat=stat,
            json_path=json_path, plot_path=plot_path, gloo_max_iters=gloo_max_iters, seed=seed,
            load=load, wide=wide)
        job.exit_all(code)

    return main
