"""Measure this host once for auto's cost model, fit its constants, keep them.

    python -m harmpi.tune             # measure (mpirun jobs), fit, write the file, print
    python -m harmpi.tune --show      # the constants in use, and auto's choice per size
    mpirun -np 4 python -m mpi4py -m harmpi.tune --info    # harmpi.info() of that job

Steps of a measurement (about a minute on 2 cores):
  1. one mpirun job per layout this host runs without sharing cores (one
     node of 2, 4, 8 ... up to the usable CPUs; two virtual nodes of one
     rank, and of half the CPUs each from 4 CPUs on), ranks bound to cores;
  2. in each job (``--worker``), both algorithms of auto's pair (shm and
     shm_rsag on one node, har_latency and har_bandwidth across nodes),
     each through the entry auto runs it with (a context whose switch is
     forced to 0 or to never), on bf16 zeros, at every size of ``--sizes``
     interleaved: per rank the median of the timed calls (a barrier before
     each), then the mean over ranks, as bench.osu_allreduce --stat median;
  3. harmpi.algorithms.model.fit of all the rows, each constant pulled
     lightly towards model.PRIOR, as the built-in constants were (a host's
     few layouts cannot tell every constant apart: those stay near it);
  4. the file (harmpi.algorithms.model_file: HARMPI_MODEL_FILE, else the
     per-user, per-host cache file, or ``--output``), written atomically;
     its rows are kept in it, so a fit can be checked or redone.

Run it on a quiet host: what it measures is what auto will believe.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from ..algorithms import model, model_file
from ..config import Config
from ..runtime import switches

__all__ = ["layouts", "worker_argv", "measure", "fit_rows", "report_lines", "main"]

#: sizes measured by default (bytes per rank): the first size of a job is
#: warmed up like the others, and 2 KiB, often slow as a job's first call, is left out
SIZES = (4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 1 << 20)
#: the time limit of one measuring job (start-up included)
JOB_LIMIT_S = 300


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def layouts(cpus: int) -> list[tuple[int, int | None]]:
    """(ranks, ranks per virtual node or None: one node) of each job, every
    rank on a core of its own."""
    out = []
    L = 2
    while L <= cpus:
        out.append((L, None))
        L *= 2
    if cpus >= 3 and cpus & (cpus - 1):
        out.append((cpus, None))
    if cpus >= 2:
        out.append((2, 1))
    if cpus >= 4:
        out.append((2 * (cpus // 2), cpus // 2))
    return out


def worker_argv(mpirun: str, np: int, ranks_per_node: int | None, out: str,
                sizes=SIZES, iterations: int = 200, python: str = sys.executable) -> list[str]:
    """The mpirun command line of one measuring job (pure)."""
    argv = [mpirun, "-np", str(np), "--bind-to", "core"]
    if ranks_per_node is not None:
        argv += ["-x", "HARMPI_RANKS_PER_NODE"]
    return argv + [python, "-m", "mpi4py", "-m", "harmpi.tune", "--worker", out,
                   "--sizes", ",".join(str(s) for s in sizes), "--iterations", str(iterations)]


# -- the worker (under mpirun) ------------------------------------------------------


def _pair(config, nodes):
    """((algorithm, config that makes auto run it at every size), ...)."""
    if nodes == 1:
        return (("shm", dataclasses.replace(config, small_max_nbytes=model.NEVER_NBYTES)),
                ("shm_rsag", dataclasses.replace(config, small_max_nbytes=0)))
    return (("har_latency", dataclasses.replace(config, har_latency_max_nbytes=model.NEVER_NBYTES)),
            ("har_bandwidth", dataclasses.replace(config, har_latency_max_nbytes=0)))


def _time_us(comm, call, iterations, warmup):
    """Mean over ranks of each rank's median time of ``call`` (us)."""
    import numpy as np  # noqa: PLC0415

    for _ in range(warmup):
        call()
    t = np.empty(iterations)
    for i in range(iterations):
        comm.Barrier()
        t0 = time.perf_counter_ns()
        call()
        t[i] = time.perf_counter_ns() - t0
    medians = comm.allgather(float(np.median(t)) / 1e3)  # (a one-thread worker)
    return sum(medians) / len(medians)


def measure(comm, sizes=SIZES, iterations: int = 200) -> list[model.Row]:
    """Rows of both algorithms of auto's pair on ``comm``'s layout (collective)."""
    import numpy as np  # noqa: PLC0415

    from .. import api  # noqa: PLC0415 - the worker's collectives

    base = dataclasses.replace(Config.from_env(), algorithm="auto")
    facts = api.info(comm)
    L, N = max(facts["ranks_per_node"]), facts["nodes"]
    if N > 1 and len(set(facts["ranks_per_node"])) > 1:
        raise SystemExit("harmpi.tune: uneven nodes run the leader algorithm: nothing to tune")
    contexts = []
    for name, config in _pair(base, N):
        c = comm.Dup()
        ctx = api.init(c, config)
        compiled = N == 1 or (name == "har_latency" and ctx.har2() is not None)
        contexts.append((name, c, "compiled" if compiled else "python"))
    # a job's first calls are slow (pages, caches, the tuner's first
    # probes): a pass at the first size, not recorded, takes them
    x = np.zeros(sizes[0] // 2, np.uint16)
    for _name, c, _entry in contexts:
        _time_us(comm, lambda c=c: api.allreduce(x, comm=c, dtype="bf16"), 20, 200)
    rows = []
    for nbytes in sizes:
        x = np.zeros(nbytes // 2, np.uint16)  # bf16 zeros: the sums stay zero
        for name, c, entry in contexts:
            small = nbytes <= (64 << 10)
            iters = iterations if small else max(20, iterations // 4)
            # warm-up: enough for the slot-store tuner's first probes of a
            # size (harmpi.base.copytune) before any call is timed
            t_us = _time_us(comm, lambda c=c: api.allreduce(x, comm=c, dtype="bf16"),
                            iters, 100 if small else 20)
            rows.append(model.Row(name, L, N, entry, nbytes, round(t_us, 3)))
    return rows


def _worker(args) -> int:
    from mpi4py import MPI  # noqa: PLC0415

    comm = MPI.COMM_WORLD
    sizes = tuple(int(s) for s in args.sizes.split(","))
    rows = measure(comm, sizes, args.iterations)
    if comm.Get_rank() == 0:
        with open(args.worker, "w", encoding="utf-8") as f:
            json.dump([list(r) for r in rows], f)
    return 0


# -- the driver ---------------------------------------------------------------------


def fit_rows(rows) -> model.CostConstants:
    """This host's constants: the fit of its rows, with the prior the
    built-in constants were fitted with (model.PRIOR) where they say nothing."""
    return model.fit(rows, prior=model.PRIOR, prior_weight=model.PRIOR_WEIGHT)


def _run_jobs(cpus, iterations, log) -> list[model.Row]:
    from harmpi_launch.mpienv import find_mpirun, mpi_env  # noqa: PLC0415 - the launcher's

    mpirun = find_mpirun()
    rows = []
    with tempfile.TemporaryDirectory(prefix="harmpi-tune-") as tmp:
        for np_, rpn in layouts(cpus):
            out = os.path.join(tmp, f"rows-{np_}-{rpn}.json")
            extra = {"HARMPI_RANKS_PER_NODE": str(rpn)} if rpn else {}
            env = mpi_env(extra=extra)
            if not rpn:
                env.pop("HARMPI_RANKS_PER_NODE", None)
            where = f"{np_ // rpn} virtual nodes x {rpn}" if rpn else f"1 node x {np_}"
            log(f"measuring {where} ...")
            proc = subprocess.run(worker_argv(mpirun, np_, rpn, out, iterations=iterations),
                                  env=env, capture_output=True, text=True, timeout=JOB_LIMIT_S)
            if proc.returncode != 0 or not os.path.exists(out):
                raise SystemExit(f"harmpi.tune: the job for {where} failed (exit "
                                 f"{proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
            with open(out, encoding="utf-8") as f:
                rows += [model.Row(*r) for r in json.load(f)]
    return rows


def report_lines(constants, source, problem, shown) -> list[str]:
    """The text --show and a measurement print: constants, source, choices."""
    lines = [f"cost model: {source}"]
    if problem:
        lines.append(f"  problem: {problem}")
    lines += [f"  {name} = {value:g}" for name, value in constants.as_dict().items()]
    sizes = model.SHOWN_NBYTES
    lines.append("auto's choice per size (bytes per rank; predicted us of the pair):")
    lines.append("  layout     switch at   " + " ".join(f"{_size(s):>6}" for s in sizes))
    for L, N in shown:
        t = switches.modelled(model_file.LoadedModel(constants, source, problem), L, N)
        limit = t.small_max_nbytes if N == 1 else t.har_latency_max_nbytes
        short = {"shm": "shm", "shm_rsag": "rsag", "har_latency": "harl", "har_bandwidth": "harb"}
        picks = model.choices(constants, L, N, t)
        lines.append(f"  {N:>2} x {L:<4}  {_size(limit):>9}   "
                     + " ".join(f"{short[p['algorithm']]:>6}" for p in picks))
    return lines


def _size(nbytes):
    if nbytes >= model.NEVER_NBYTES:
        return "never"
    for unit, shift in (("M", 20), ("K", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.4g}{unit}"
    return str(nbytes)


def _shown(cpus, args):
    if args.ranks_per_node or args.nodes:
        return [(args.ranks_per_node or 1, args.nodes or 1)]
    return [(L, 1) for L in (2, 4, 8, 16) if L <= max(cpus, 16)] + [(1, 2), (2, 2), (8, 2),
                                                                    (4, 4)]


def _info() -> int:
    from mpi4py import MPI  # noqa: PLC0415

    from .. import api  # noqa: PLC0415
    from . import cliout  # noqa: PLC0415

    info = api.info()

    if MPI.COMM_WORLD.Get_rank() == 0:
        cliout.log.info("%s", json.dumps(info, indent=1, default=str))
    return 0


def main(argv=None) -> int:
    from . import cliout  # noqa: PLC0415

    ap = argparse.ArgumentParser(prog="python -m harmpi.tune", description=__doc__.split("\n")[0])
    ap.add_argument("--show", action="store_true",
                    help="print the constants in use and auto's choices; measure nothing")
    ap.add_argument("--info", action="store_true", help="print harmpi.info() (rank 0)")
    ap.add_argument("--ranks-per-node", type=int, default=0, help="--show: this layout only")
    ap.add_argument("--nodes", type=int, default=0, help="--show: this layout only")
    ap.add_argument("--output", default=None,
                    help="the file to write (default: HARMPI_MODEL_FILE, else the cache file)")
    ap.add_argument("--iterations", type=int, default=200, help="timed calls per size up to 64K")
    ap.add_argument("--max-ranks", type=int, default=0, help="measure up to this many ranks")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)
    if args.info:
        return _info()
    cfg = Config.from_env()
    cpus = min(usable_cpus(), args.max_ranks or usable_cpus())
    if args.show:
        loaded = model_file.load(cfg.model_file)
        for line in report_lines(loaded.constants, loaded.source, loaded.problem,
                                 _shown(cpus, args)):
            cliout.log.info("%s", line)
        return 1 if loaded.problem else 0
    if cpus < 2:
        raise SystemExit("harmpi.tune: this host gives 1 CPU: no layout to measure")
    rows = _run_jobs(cpus, args.iterations, lambda m: cliout.log.info("%s", m))
    constants = fit_rows(rows)
    path = args.output or model_file.model_path(cfg.model_file)[0]
    host = {"hostname": socket.gethostname(), "cpus": cpus}
    written = model_file.write(path, constants, rows, host,
                               time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    for line in report_lines(constants, str(written), None, _shown(cpus, args)):
        cliout.log.info("%s", line)
    return 0
