"""``make demo``: the runs behind the README's results, then a summary with ratios.

    python -m bench.demo [--out out/demo] [--impls harmpi,torch:harmpi,mpi,gloo]

1. all-reduce table, 2 ranks on one node, harmpi vs torch:harmpi (dist.all_reduce on a harmpi
   process group) vs mpi vs gloo, bound as mpirun binds the ranks and unbound
   (``gloo:unbound``: its threads may use every CPU), vs DeepSpeed's shm all-reduce
   (``deepspeed``, when installed: ``pip install 'harmpi[deepspeed]'``; else the demo
   says it left it out) (bf16, 2 KiB .. 4 MiB and 10240 B);
2. the same with 4 ranks as 2 virtual nodes x 2 (HARMPI_RANKS_PER_NODE=2, --oversubscribe),
   once with MPI on shared memory (its best case on one host) and once with
   MPI over TCP (``btl tcp,self``: what it does between nodes without RDMA);
   deepspeed refuses virtual nodes (its op sums over the whole host), and the
   tables' notes say so;
3. the decode benchmark on 4 ranks as 2 virtual nodes x 2, harmpi vs torch:harmpi vs gloo vs
   mpi, with MPI
   on shared memory and with MPI over TCP.

Each job is an ``mpirun`` started from here (the one next to the running
Python, else the one on PATH) with the environment a root container needs;
its output goes to ``<job>.log`` in ``--out`` (one line here per job; a
failed job's last lines too) and its ``--json`` file feeds the summary.
The demo ends with one table (``glance_lines``: harmpi against each rival
per layout and size, and decode tok/s), writes every note to
``summary.txt`` and the latencies to ``latency.png`` (one panel per
layout), whose path the last line names.  Exit status: non-zero if any job
failed.

Time limits: each job gets BASE_TIMEOUT_S times the processes that want
each CPU when it starts (its ranks plus the load average), so a busy
machine gets more time; ``--timeout SECONDS`` sets one limit for every job,
and a job that runs out says so and names that option. The lines the demo
prints itself fit 100 columns; the jobs' own tables (in their logs) come
from bench.osu_allreduce and bench.decode.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Sequence

import click

from launch.errors import MpiNotFoundError
from launch.mpienv import find_mpirun, mpi_env

__all__ = ["mpirun_argv", "demo_jobs", "default_impls", "summary_lines", "glance_lines",
           "plot_latency", "loss_reasons", "main"]

SUMMARY_SIZES = (10240, 4 * 1024 * 1024)

#: the all-reduce tables' implementations; deepspeed joins them when installed
BASE_IMPLS = "harmpi,torch:harmpi,mpi,gloo,gloo:unbound"


def default_impls(have_deepspeed: bool | None = None) -> tuple[str, str]:
    """(the demo's --impl list, a note saying why deepspeed is left out, or "")."""
    if have_deepspeed is None:
        have_deepspeed = importlib.util.find_spec("deepspeed") is not None
    if have_deepspeed:
        return f"{BASE_IMPLS},deepspeed", ""
    return BASE_IMPLS, ("# deepspeed left out: it is not installed "
                        "(pip install 'harmpi[deepspeed]'; make setup installs it)")


def mpirun_argv(n_ranks: int, module: str, args: Sequence[str], *, mpirun: str = "mpirun",
                python: str = sys.executable, host_cpus: int | None = None) -> list[str]:
    """The mpirun command line of one benchmark job (pure; tests check it).

    ``--oversubscribe`` when ranks outnumber ``host_cpus``;
    ``python -m mpi4py -m MODULE`` so an exception on one rank aborts the job
    instead of leaving the others in a barrier.
    """
    if host_cpus is None:
        host_cpus = os.cpu_count() or 1
    argv = [mpirun, "-np", str(n_ranks)]
    if n_ranks > host_cpus:
        argv.append("--oversubscribe")
    return argv + [python, "-m", "mpi4py", "-m", module, *args]


def demo_jobs(out_dir: Path, impls: str, decode_comms: str) -> list[dict]:
    """The demo's jobs: name, ranks, module, args, extra env, json path."""
    # 1000 timed calls at every size (OSU's default drops to 100 above 8 KiB,
    # which leaves the 10 KB decode-size row at the mercy of a few slow calls)
    sizes = ["-m", "2K:4M", "-i", "1000", "-x", "100", "--stat", "median", "-c", "--dtype", "bf16",
             "--impl", impls]
    return [
        {
            "name": "allreduce, 1 node x 2 ranks",
            "label": "1 node x 2",
            "ranks": 2,
            "module": "bench.osu_allreduce",
            "args": sizes + ["--json", str(out_dir / "allreduce_1x2.json")],
            "env": {},
            "json": out_dir / "allreduce_1x2.json",
            "log": out_dir / "allreduce_1x2.log",
        },
        {
            "name": "allreduce, 2 virtual nodes x 2 ranks, MPI on shared memory",
            "label": "2 vnodes x 2, MPI on shm",
            "ranks": 4,
            "module": "bench.osu_allreduce",
            "args": sizes + ["--json", str(out_dir / "allreduce_2x2.json")],
            "env": {"HARMPI_RANKS_PER_NODE": "2"},
            "json": out_dir / "allreduce_2x2.json",
            "log": out_dir / "allreduce_2x2.log",
        },
        {
            # what MPI does between real nodes without RDMA: TCP (here for
            # every pair, as one host cannot split its BTLs per virtual node)
            "name": "allreduce, 2 virtual nodes x 2 ranks, MPI over TCP (btl tcp,self)",
            "label": "2 vnodes x 2, MPI on TCP",
            "ranks": 4,
            "module": "bench.osu_allreduce",
            "args": sizes + ["--json", str(out_dir / "allreduce_2x2_tcp.json")],
            "env": {"HARMPI_RANKS_PER_NODE": "2", "OMPI_MCA_btl": "tcp,self"},
            "json": out_dir / "allreduce_2x2_tcp.json",
            "log": out_dir / "allreduce_2x2_tcp.log",
        },
        {
            "name": "decode, 2 virtual nodes x 2 ranks, MPI on shared memory",
            "label": "MPI on shm",
            "ranks": 4,
            "module": "bench.decode",
            "args": ["--comm", decode_comms, "--json", str(out_dir / "decode_2x2.json")],
            "env": {"HARMPI_RANKS_PER_NODE": "2"},
            "json": out_dir / "decode_2x2.json",
            "log": out_dir / "decode_2x2.log",
        },
        {
            "name": "decode, 2 virtual nodes x 2 ranks, MPI over TCP (btl tcp,self)",
            "label": "MPI on TCP",
            "ranks": 4,
            "module": "bench.decode",
            "args": ["--comm", decode_comms, "--json", str(out_dir / "decode_2x2_tcp.json")],
            "env": {"HARMPI_RANKS_PER_NODE": "2", "OMPI_MCA_btl": "tcp,self"},
            "json": out_dir / "decode_2x2_tcp.json",
            "log": out_dir / "decode_2x2_tcp.log",
        },
    ]


def _fmt_us(value) -> str:
    return "n/a" if value is None else (f"{value:.1f}" if value < 1000 else f"{value:.0f}")


#: the summary's columns, in order (those no job ran are left out)
SUMMARY_IMPLS = ("harmpi", "torch:harmpi", "mpi", "gloo", "gloo:unbound", "deepspeed")


#: the width every line the demo prints itself fits in (its jobs' tables are theirs)
WIDTH = 100
_CELL = 16  # "1234.5 (12.34x)" and a space


def _cell(value, base) -> str:
    """One other implementation's latency and its ratio to harmpi's."""
    if value is None:
        return "n/a"
    ratio = value / base if base else None
    if ratio is None:
        return _fmt_us(value)
    return f"{_fmt_us(value)} ({ratio:.0f}x)" if ratio >= 1000 else \
        f"{_fmt_us(value)} ({ratio:.2f}x)"


def _short_cell(value, base) -> str:
    """``_cell`` with fewer digits in a ratio of 10 or more, to fit any latency."""
    if value is None or not base or value / base < 10:
        return _cell(value, base)
    ratio = value / base
    return f"{_fmt_us(value)} ({ratio:.0f}x)" if ratio >= 100 else \
        f"{_fmt_us(value)} ({ratio:.1f}x)"


def _allreduce_table(allreduce_docs: Sequence[tuple[str, dict]],
                     sizes: Sequence[int] = SUMMARY_SIZES, cell=_cell) -> list[str]:
    """One block per job: ``sizes`` as rows, each implementation a column
    holding the median latency and, in brackets, other/harmpi (fits WIDTH)."""
    present = {row["impl"] for _, doc in allreduce_docs for row in doc.get("rows", [])}
    impl_order = [name for name in SUMMARY_IMPLS if name in present] or ["harmpi", "mpi", "gloo"]
    others = [name for name in impl_order if name != "harmpi"]
    lines = ["# Summary: all-reduce, bf16, median latency (us); (r) = other/harmpi, "
             "above 1: harmpi faster"]
    header = (f"{'# size (B)':<10}{'harmpi':>9}"
              + "".join(f"{name:>{_CELL}}" for name in others))
    for label, doc in allreduce_docs:
        rows = {(row["impl"], row["size"]): row for row in doc.get("rows", [])}
        lines += [f"# {label}", header]
        for size in sizes:
            values = {name: (rows.get((name, size)) or {}).get("avg_us") for name in impl_order}
            base = values["harmpi"]
            lines.append(f"{size:>10}{_fmt_us(base):>9}"
                         + "".join(f"{cell(values[name], base):>{_CELL}}" for name in others))
    return lines


def _allreduce_summary(allreduce_docs: Sequence[tuple[str, dict]]) -> list[str]:
    """The table at SUMMARY_SIZES, then each job's notes (losses, gloo's binding)."""
    notes = []
    for label, doc in allreduce_docs:
        rows = {(row["impl"], row["size"]): row for row in doc.get("rows", [])}
        notes += _allreduce_notes(label, rows, doc)
    return _allreduce_table(allreduce_docs) + notes


def loss_reasons(doc: dict) -> list[str]:
    """What about a job's set-up, from its JSON document, puts harmpi at a
    disadvantage that is not the library's speed (pure)."""
    meta = doc.get("meta", {})
    topo = meta.get("topology", {})
    info = meta.get("harmpi_info", {})
    env = doc.get("demo", {}).get("env", {})
    reasons = []
    if topo.get("virtual") and topo.get("hosts") == 1 and "tcp" not in env.get("OMPI_MCA_btl", ""):
        reasons.append(
            "MPI sees one host and moves every byte through shared memory, while harmpi's "
            "virtual nodes exchange over loopback TCP as two hosts would (every rail message "
            "goes through the kernel's socket copies): harmpi's multi-node path against MPI's "
            "one-host path, not like for like; the 'MPI on TCP' rows put both on TCP")
    if info.get("oversubscribed"):
        reasons.append(
            f"{topo.get('ranks', 'the')} ranks share this host's cores: a collective ends only "
            "after every rank has had a time slice, so at small sizes the latency is mostly "
            "waiting for descheduled ranks, and it swings from run to run; speed is judged "
            "with a core per rank (the 1 node x 2 rows, and the 2-rank decode in the README)")
    return reasons


def _allreduce_notes(label: str, rows: dict, doc: dict | None = None) -> list[str]:
    """Lines naming every size where another implementation beat harmpi, and
    what binding cost gloo (gloo vs gloo:unbound), from one job's rows."""
    def latency(name, size):
        return (rows.get((name, size)) or {}).get("avg_us")

    sizes = sorted({size for _, size in rows})
    losses = []
    for name in sorted({impl for impl, _ in rows} - {"harmpi"}):
        lost = [size for size in sizes
                if latency(name, size) and latency("harmpi", size)
                and latency(name, size) < latency("harmpi", size)]
        if lost:
            losses.append(f"{name} at " + ", ".join(
                f"{size} B ({latency(name, size) / latency('harmpi', size):.2f}x)"
                for size in lost))
    lines = []
    if losses:
        lines.append(f"# {label}: harmpi is slower than " + "; ".join(losses)
                     + " (other/harmpi below 1; on a loaded machine a ratio near 1 can "
                       "flip from run to run, so rerun before reading it as a trend)")
        lines += [f"# {label}: why: {why}" for why in loss_reasons(doc or {})]
    both = [size for size in sizes if latency("gloo", size) and latency("gloo:unbound", size)]
    if both:
        size = 10240 if 10240 in both else both[-1]
        lines.append(f"# {label}: gloo bound as the ranks / gloo:unbound at {size} B: "
                     f"{latency('gloo', size) / latency('gloo:unbound', size):.2f}x "
                     "(bound, gloo's own threads share the rank's core with the caller)")
    return lines


def _decode_summary(label: str, decode_doc: dict) -> list[str]:
    rows = {row["comm"]: row for row in decode_doc.get("rows", [])}
    ranks = decode_doc.get("meta", {}).get("ranks")
    lines = [f"# Summary: decode, {ranks} ranks as 2 virtual nodes x 2"
             + (f", {label}" if label else "") + "; tok/s = batch / median step time"]
    present = [rows[name] for name in ("harmpi", "torch:harmpi", "gloo", "mpi") if name in rows]
    harmpi = rows.get("harmpi")
    parts = []
    for row in present:
        name = row["comm"]
        text = f"{name} {row['tokens_per_s']:.1f} tok/s ({row['ms_per_token']:.1f} ms/token)"
        if harmpi is not None and name != "harmpi":
            text += f", harmpi/{name} {harmpi['tokens_per_s'] / row['tokens_per_s']:.2f}x"
        parts.append(text)
    lines.append("# " + "; ".join(parts))
    for row in present:
        latency = row.get("comm_latency_share")
        lines.append(
            f"# {row['comm']}: compute {row.get('compute_ms_per_token', float('nan')):.1f} "
            f"ms/token; {row['comm_share'] * 100:.1f}% of the step inside collectives"
            + ("" if latency is None else
               f", {latency * 100:.1f}% after the last rank arrived "
               "(the collectives' own latency)")
        )
    lines += _decode_losses(harmpi, present)
    compared = list(rows.values())
    if len(compared) > 1:
        agree = [
            f"{row['comm']} "
            + ("yes" if row.get("tokens_agree")
               else row.get("divergence_note")
               or f"no (first divergence at generated token {row.get('first_divergence')})")
            for row in compared[1:]
        ]
        lines.append(f"# tokens agree with {compared[0]['comm']}: " + "; ".join(agree))
        gaps = [f"{row['comm']} {row['prefill_logits_gap_ulps']:.1f}" for row in compared[1:]
                if row.get("prefill_logits_gap_ulps") is not None]
        if gaps:
            lines.append(f"# logits from the same prompt vs {compared[0]['comm']}, largest "
                         "difference in bf16 ulps of the largest logit: " + "; ".join(gaps))
    return lines


def _decode_losses(harmpi: dict | None, present: Sequence[dict]) -> list[str]:
    """Where harmpi decodes slower than another backend, why, from the run's own numbers."""
    lines = []
    for row in present:
        if harmpi is None or row is harmpi or row["tokens_per_s"] <= harmpi["tokens_per_s"]:
            continue
        mine, theirs = harmpi.get("tokens_per_s_rounds"), row.get("tokens_per_s_rounds")
        text = (f"# harmpi loses to {row['comm']} here ({harmpi['tokens_per_s']:.1f} vs "
                f"{row['tokens_per_s']:.1f} tok/s): ")
        d_compute = harmpi.get("compute_ms_per_token", 0) - row.get("compute_ms_per_token", 0)
        d_comm = harmpi["comm_ms_per_token"] - row["comm_ms_per_token"]
        if mine and theirs and mine["max"] >= theirs["min"]:
            text += (f"within the spread across rounds (harmpi {mine['min']:.1f}-"
                     f"{mine['max']:.1f}, {row['comm']} {theirs['min']:.1f}-"
                     f"{theirs['max']:.1f} tok/s): the ranges overlap, so this run "
                     "cannot tell them apart")
        elif d_compute > d_comm:
            text += (f"its compute is {d_compute:.2f} ms/token slower while its collectives "
                     f"differ by {d_comm:+.2f} ms: ranks waiting in harmpi slow the computing "
                     "ones (they share cores)")
        else:
            text += (f"its collectives take {d_comm:.2f} ms/token more (see 'after last "
                     "arrival' in the table: their own latency vs waiting for a late rank)")
        lines.append(text)
    return lines


def summary_lines(allreduce_docs: Sequence[tuple[str, dict]], decode_docs) -> list[str]:
    """The closing summary from the jobs' JSON documents (pure). ``decode_docs``:
    None, one decode document, or a list of (label, document)."""
    if decode_docs is None:
        decode_docs = []
    elif isinstance(decode_docs, dict):
        decode_docs = [("", decode_docs)]
    lines = _allreduce_summary(allreduce_docs)
    for label, decode_doc in decode_docs:
        lines += _decode_summary(label, decode_doc)
    return lines  # main() folds the long comment lines as it prints them


#: the sizes of the closing table (the JSON files hold every size)
GLANCE_SIZES = (2048, 10240, 65536, 1024 * 1024, 4 * 1024 * 1024)
#: the most lines the closing table may take
GLANCE_LINES = 40
DECODE_COMMS = ("harmpi", "torch:harmpi", "gloo", "mpi")


def _decode_table(decode_docs: Sequence[tuple[str, dict]]) -> list[str]:
    """One line per decode run: each backend's tok/s and, in brackets,
    harmpi/other (above 1: harmpi faster)."""
    present = [name for name in DECODE_COMMS
               if any(row["comm"] == name for _, doc in decode_docs for row in doc["rows"])]
    lines = ["# Summary: decode tok/s (batch / median step); (r) = harmpi/other",
             f"{'# run':<14}" + "".join(f"{name:>{_CELL}}" for name in present)]
    for label, doc in decode_docs:
        rows = {row["comm"]: row["tokens_per_s"] for row in doc.get("rows", [])}
        base = rows.get("harmpi")
        cells = []
        for name in present:
            value = rows.get(name)
            if value is None:
                cells.append("n/a")
            elif name == "harmpi" or not base:
                cells.append(f"{value:.1f}")
            else:
                cells.append(f"{value:.1f} ({base / value:.2f}x)")
        lines.append(f"{label[:13]:<14}" + "".join(f"{cell:>{_CELL}}" for cell in cells))
    return lines


def glance_lines(allreduce_docs: Sequence[tuple[str, dict]],
                 decode_docs: Sequence[tuple[str, dict]]) -> list[str]:
    """The demo's closing table (pure, at most GLANCE_LINES lines of at most
    WIDTH): harmpi against each rival per layout and size, then decode tok/s."""
    lines = _allreduce_table(allreduce_docs, GLANCE_SIZES, _short_cell) if allreduce_docs else []
    if decode_docs:
        lines += _decode_table(decode_docs)
    return lines[:GLANCE_LINES]


def plot_latency(allreduce_docs: Sequence[tuple[str, dict]], path: Path) -> int:
    """Latency against size per implementation, one panel per layout, as a PNG
    at ``path`` (needs matplotlib).  Returns the number of panels drawn."""
    from bench.report import plot_panels

    panels = []
    for label, doc in allreduce_docs:
        series: dict[str, list[tuple[int, float]]] = {}
        for row in doc.get("rows", []):
            if row.get("avg_us") is not None:
                series.setdefault(row["impl"], []).append((row["size"], row["avg_us"]))
        panels.append((label, series))
    stat = next((doc.get("meta", {}).get("stat") for _, doc in allreduce_docs), None) or "median"
    plot_panels(panels, str(path), f"all-reduce, bf16: {stat} latency per call")
    return len(panels)


def fold(line: str, width: int = WIDTH) -> list[str]:
    """A comment line longer than ``width`` as several, each a comment (pure)."""
    if len(line) <= width or not line.startswith("#"):
        return [line]
    return textwrap.wrap(line, width, subsequent_indent="#   ", break_on_hyphens=False)


def shown_command(env: dict, argv: Sequence[str], width: int = WIDTH) -> list[str]:
    """A job's command line as the shell would take it, continued with a
    backslash so that no line is longer than ``width`` (pure)."""
    words = [f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.quote(a) for a in argv]
    lines, line = [], "$"
    for word in words:
        if len(line) + 1 + len(word) + 2 > width and line not in ("$", "   "):
            lines.append(line + " \\")
            line = "   "
        line += " " + word
    return lines + [line]


#: seconds a job may take with a CPU per rank and nothing else running (the
#: slowest, a 4-rank decode, took ~60-90 s on an idle 2-core VM): scaled up
#: by job_timeout_s for the ranks and the other work sharing the CPUs
BASE_TIMEOUT_S = 240.0


def job_timeout_s(ranks: int, cpus: int, load1: float, base_s: float = BASE_TIMEOUT_S) -> float:
    """A job's time limit: ``base_s`` times the processes that will want each
    CPU (the job's ranks plus the 1-minute load average), at least 1 (pure)."""
    return base_s * max(1.0, (ranks + max(load1, 0.0)) / max(cpus, 1))


def timeout_note(timeout_s: float, scaled: str) -> str:
    """What a job that ran out of time prints: the limit, how it was set and
    the option that raises it (pure)."""
    return (f"timed out after {timeout_s:.0f} s ({scaled}); give the jobs more time with "
            f"python -m bench.demo --timeout SECONDS")


def _say(line: str) -> None:
    print("\n".join(fold(line)), flush=True)


def _run_job(job: dict, mpirun: str, timeout_s: float | None) -> tuple[int, float]:
    """Run one job, its output into its log file (the command line first);
    returns (exit code, seconds)."""
    argv = mpirun_argv(job["ranks"], job["module"], job["args"], mpirun=mpirun)
    # Open MPI's settings from the launcher (the caller's win); ranks yield
    # while waiting only when the caller says so (`make demo` does)
    env = mpi_env(extra=job["env"], yield_when_idle=False)
    if timeout_s is None:
        cpus, load1 = os.cpu_count() or 1, os.getloadavg()[0]
        limit_s = job_timeout_s(job["ranks"], cpus, load1)
        scaled = (f"{BASE_TIMEOUT_S:.0f} s scaled for {job['ranks']} ranks on {cpus} CPUs "
                  f"at load {load1:.1f}")
    else:
        limit_s, scaled = timeout_s, "--timeout"
    log = Path(job["log"])
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w") as fh:
        fh.write(f"## {job['name']}\n" + "\n".join(shown_command(job["env"], argv)) + "\n")
        fh.flush()
        try:
            code = subprocess.run(argv, env=env, timeout=limit_s, stdout=fh,
                                  stderr=subprocess.STDOUT).returncode
        except subprocess.TimeoutExpired:
            _say(f"## {job['name']}: {timeout_note(limit_s, scaled)}")
            code = 124
    return code, time.monotonic() - t0


def _log_tail(path: Path, lines: int = 15) -> list[str]:
    """The last lines of a job's log, to show why it failed."""
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def _read_docs(jobs: Sequence[dict]):
    """(all-reduce documents, decode documents) as (label, document), of the jobs that wrote one."""
    docs, decode_docs = [], []
    for job in jobs:
        if not job["json"].exists():
            continue
        doc = json.loads(job["json"].read_text())
        doc["demo"] = {"env": job["env"]}  # how the demo ran it (loss_reasons reads it)
        if job["module"] == "bench.decode":
            decode_docs.append((job["label"], doc))
        else:
            docs.append((job["label"], doc))
    return docs, decode_docs


def _finish(jobs, out: Path, failures, t_start: float) -> None:
    """The closing table, the notes file, the plot (the last line names it), the exit."""
    docs, decode_docs = _read_docs(jobs)
    notes = out / "summary.txt"  # every note: where harmpi loses and why, tokens, logits
    notes.write_text("\n".join(line for text in summary_lines(docs, decode_docs)
                               for line in fold(text)) + "\n")
    print()
    for line in glance_lines(docs, decode_docs):
        _say(line)
    _say(f"# every figure: {out}/*.json; every table: {out}/*.log; notes: {notes}")
    _say(f"# demo took {time.monotonic() - t_start:.0f} s"
         + (f"; FAILED: {', '.join(failures)}" if failures else ""))
    plot = out / "latency.png"
    try:
        plot_latency(docs, plot)
        _say(f"# plot: {plot}")
    except ImportError as exc:  # matplotlib is optional
        _say(f"# no plot ({exc}); pip install matplotlib")
    sys.exit(1 if failures else 0)


@click.command(name="demo", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="out/demo",
              show_default=True, help="Directory for the jobs' JSON files.")
@click.option("--impls", default=None,
              help=f"Implementations of the all-reduce tables (mpi,gloo runs the rivals alone). "
                   f"Default: {BASE_IMPLS}, plus deepspeed when it is installed.")
@click.option("--decode-comms", default=None,
              help="Backends of the decode run (default: --impls reordered "
                   "harmpi,torch:harmpi,gloo,mpi).")
@click.option("--timeout", "timeout_s", type=float, default=None,
              help=f"Seconds allowed to each job. Default: {BASE_TIMEOUT_S:.0f} s times the "
                   "processes per CPU when the job starts (its ranks plus the load average).")
def main(out_dir, impls, decode_comms, timeout_s):
    """Run the README's benchmarks on this machine and print a summary with ratios."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    left_out = ""
    if impls is None:
        impls, left_out = default_impls()
    names = [name.strip() for name in impls.split(",") if name.strip()]
    if decode_comms is None:
        decode_comms = ",".join(name for name in ("harmpi", "torch:harmpi", "gloo", "mpi")
                                if name in names)
    try:
        mpirun = find_mpirun()
    except MpiNotFoundError as exc:
        raise click.ClickException(str(exc)) from None
    load = os.getloadavg()
    _say(f"# harmpi demo: {os.cpu_count()} CPUs, load average "
         f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
         f"(other work on the machine slows every number below)")
    if left_out:
        _say(left_out)
    t_start = time.monotonic()
    # numba's kernels, every one a job uses, in this one process before the
    # jobs (make setup has done it: then ~2 s), not inside a job's time limit
    subprocess.run([sys.executable, "-m", "harmpi.precompile"], check=True)
    failures = []
    jobs = demo_jobs(out, impls, decode_comms)
    for job in jobs:
        if job["json"].exists():
            job["json"].unlink()
        code, elapsed_s = _run_job(job, mpirun, timeout_s)
        _say(f"## {job['name']}: exit {code}, {elapsed_s:.0f} s; log {job['log']}")
        if code != 0:
            failures.append(job["name"])
            for line in _log_tail(job["log"]):
                print(f"   | {line}", flush=True)

    _finish(jobs, out, failures, t_start)


if __name__ == "__main__":
    main()
