"""The report of ``make bench-host`` (``bench.host``): cells from the jobs'
JSON documents, one table of harmpi/MPI ratios that fits 100 columns, and
the ``--json`` document (pure: documents in, cells and lines out).

A cell is one (layout, collective, size), or one decode layout. Its ratio is
harmpi's time over MPI's (below 1: harmpi faster); a decode cell's is
harmpi's tok/s over MPI's (above 1: harmpi faster). A cell the jobs did not
deliver is ``failed`` with the reason: the job's time limit, its exit status
and last error line, or the note its row carries.
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Iterable, Sequence

from bench.harness import format_nbytes

__all__ = ["WIDTH", "Cell", "collective_cells", "decode_cells", "ratio_text", "table_lines",
           "failure_lines", "document"]

WIDTH = 100
#: the table's short names of the collectives
SHORT = {"allreduce": "ar", "allgather": "ag", "alltoall": "a2a", "decode": "dec"}
_LABEL, _BIND, _COLL, _CELL = 10, 5, 4, 6  # column widths


@dataclasses.dataclass
class Cell:
    """One figure of the matrix; ``harmpi``/``mpi``/``gloo`` are us per call
    (decode: tok/s), None where not measured."""

    layout: str
    nodes: int
    ranks_per_node: int
    bind: str  # "core": a core per rank; "none": oversubscribed, unbound
    mpi_btl: str  # "self,tcp" on virtual nodes, "" = Open MPI's choice
    collective: str
    size: int | None  # bytes per rank; None for decode
    harmpi: float | None = None
    mpi: float | None = None
    gloo: float | None = None
    unit: str = "us"
    iterations: dict | None = None
    slowest_us: dict | None = None  # per implementation: the slowest rank's figure
    status: str = "failed"
    reason: str = ""

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def ratio(self) -> float | None:
        if self.harmpi is None or not self.mpi:
            return None
        return self.harmpi / self.mpi

    def to_json(self, host: dict) -> dict:
        out = dataclasses.asdict(self)
        out.update(ranks=self.ranks, ratio=self.ratio, host_cores=host.get("cores"),
                   host_cpus=host.get("cpus"), cpu_model=host.get("cpu_model"),
                   cpu_flags=host.get("flags"))
        return out


def _job_reason(outcome: dict | None) -> str:
    """Why a job's missing cells are missing, from its outcome (see bench.host)."""
    if outcome is None:
        return "not run"
    if outcome.get("skipped"):
        return outcome["skipped"]
    if outcome.get("timed_out"):
        return (f"job timed out after {outcome['limit_s']:.0f} s "
                "(bench.host --timeout; --deadline)")
    if outcome.get("exit") not in (0, None):
        last = outcome.get("last_error") or "no error line in its log"
        return f"job exit {outcome['exit']}: {last}"
    return "no result in the job's JSON"


def collective_cells(layout: dict, collectives: Sequence[str], sizes: Sequence[int],
                     doc: dict | None, outcome: dict | None) -> list[Cell]:
    """Every (collective, size) cell of one layout from its job's document
    (``bench.host_job --json``; None if it wrote none)."""
    rows = {}
    for row in (doc or {}).get("rows", []):
        rows[(row["collective"], row["size"], row["impl"])] = row
    cells = []
    for name in collectives:
        for size in sizes:
            cell = Cell(layout["name"], layout["nodes"], layout["per_node"], layout["bind"],
                        layout["btl"], name, size)
            found = {impl: rows.get((name, size, impl)) for impl in ("harmpi", "mpi", "gloo")}
            for impl, row in found.items():
                if row is not None:
                    setattr(cell, impl, row.get("avg_us"))
            timed = {impl: row for impl, row in found.items()
                     if row is not None and row.get("avg_us") is not None}
            cell.iterations = {impl: row["iterations"] for impl, row in timed.items()}
            cell.slowest_us = {impl: row.get("max_us") for impl, row in timed.items()}
            _judge(cell, found, outcome)
            cells.append(cell)
    return cells


def _judge(cell: Cell, found: dict, outcome: dict | None) -> None:
    """Set a cell's status and reason from its rows."""
    bad = [(impl, row) for impl, row in found.items() if row is not None
           and row.get("valid") is False]
    if bad:
        cell.reason = "; ".join(f"{impl} failed its check: {row.get('note') or 'wrong values'}"
                                for impl, row in bad)
    elif cell.harmpi is not None and cell.mpi is not None:
        cell.status = "ok"
    else:
        missing = [impl for impl in ("harmpi", "mpi") if getattr(cell, impl) is None]
        notes = [f"{impl}: {found[impl]['note']}" for impl in missing
                 if found[impl] is not None and found[impl].get("note")]
        cell.reason = "; ".join(notes) or _job_reason(outcome)


def decode_cells(layout: dict, doc: dict | None, outcome: dict | None) -> list[Cell]:
    """The one decode cell of a decode layout (``bench.decode --json``)."""
    cell = Cell(layout["name"], 1, layout["per_node"], layout["bind"], layout["btl"], "decode",
                None, unit="tok/s")
    for row in (doc or {}).get("rows", []):
        name = "gloo" if row["comm"] in ("gloo", "torch:gloo") else row["comm"]
        if name in ("harmpi", "mpi", "gloo"):
            setattr(cell, name, row.get("tokens_per_s"))
    # bench.decode exits 1 when a backend's ranks generated different tokens:
    # figures or not, the cell failed then
    if outcome and outcome.get("exit") not in (0, None):
        cell.reason = _job_reason(outcome)
    elif cell.harmpi is not None and cell.mpi is not None:
        cell.status = "ok"  # its ratio, harmpi / mpi tok/s, reads the other way round
    else:
        cell.reason = _job_reason(outcome)
    return [cell]


def ratio_text(ratio: float | None, status: str = "ok") -> str:
    """A ratio in at most 5 characters: 0.53, 12.3, 123, >999; FAIL; - (none)."""
    if status != "ok":
        return "FAIL"
    if ratio is None:
        return "-"
    if ratio < 10:
        return f"{ratio:.2f}"
    if ratio < 100:
        return f"{ratio:.1f}"
    return f"{ratio:.0f}" if ratio < 1000 else ">999"


def _size_chunks(sizes: Sequence[int], width: int) -> list[list[int]]:
    """Sizes in groups of as many columns as fit beside the row labels."""
    per_line = max(1, (width - _LABEL - _BIND - _COLL) // _CELL)
    return [list(sizes[i:i + per_line]) for i in range(0, len(sizes), per_line)] or [[]]


def _prefix(cell: Cell) -> str:
    return f"{cell.layout:<{_LABEL}}{cell.bind:<{_BIND}}{SHORT[cell.collective]:<{_COLL}}"


def table_lines(cells: Sequence[Cell], width: int = WIDTH) -> list[str]:
    """The table: a line per (layout, collective) with a ratio per size, then
    a line per decode layout; more than fit in ``width`` sizes: one block per
    group of sizes."""
    sizes = sorted({c.size for c in cells if c.size is not None})
    keys = list(dict.fromkeys((c.layout, c.collective) for c in cells if c.size is not None))
    by_key = {(c.layout, c.collective, c.size): c for c in cells if c.size is not None}
    lines = []
    for chunk in _size_chunks(sizes, width):
        lines.append(f"{'# layout':<{_LABEL}}{'bind':<{_BIND}}{'op':<{_COLL}}"
                     + "".join(f"{format_nbytes(s):>{_CELL}}" for s in chunk))
        for layout, collective in keys:
            row = [by_key.get((layout, collective, s)) for s in chunk]
            first = next(c for c in row if c is not None) if any(row) else None
            if first is None:
                continue
            lines.append(_prefix(first) + "".join(
                f"{ratio_text(c.ratio, c.status) if c else '':>{_CELL}}" for c in row))
    for cell in (c for c in cells if c.size is None):
        figures = ", ".join(f"{name} {value:.1f}" for name, value in
                            (("harmpi", cell.harmpi), ("mpi", cell.mpi), ("gloo", cell.gloo))
                            if value is not None)
        lines.append(_prefix(cell) + f"{ratio_text(cell.ratio, cell.status):>{_CELL}}"
                     + (f"  tok/s: {figures}" if figures else ""))
    return [line[:width] for line in lines]


def _sizes_text(sizes: Iterable[int], all_sizes: Sequence[int]) -> str:
    sizes = sorted(sizes)
    if list(sizes) == sorted(all_sizes):
        return "every size"
    return ",".join(format_nbytes(s) for s in sizes)


def failure_lines(cells: Sequence[Cell], logs: dict | None = None,
                  width: int = WIDTH) -> list[str]:
    """'# FAIL ...' lines under the table: per layout and reason, which cells."""
    logs = logs or {}
    all_sizes = sorted({c.size for c in cells if c.size is not None})
    groups: dict[tuple[str, str], dict[str, list]] = {}
    for cell in cells:
        if cell.status == "ok":
            continue
        where = groups.setdefault((cell.layout, cell.reason), {})
        where.setdefault(cell.collective, []).append(cell.size)
    lines = []
    for (layout, reason), where in groups.items():
        parts = [SHORT[name] if None in sizes else
                 f"{SHORT[name]} {_sizes_text(sizes, all_sizes)}" for name, sizes in where.items()]
        log = f" (log: {logs[layout]})" if layout in logs else ""
        text = f"# FAIL {layout} {'; '.join(parts)}: {reason}{log}"
        lines += textwrap.wrap(text, width, subsequent_indent="#   ", break_long_words=True,
                               break_on_hyphens=False)
    return lines


def document(meta: dict, cells: Sequence[Cell], jobs: Sequence[dict]) -> dict:
    """The --json document: meta (host, options, time), every cell, every job."""
    host = meta.get("host", {})
    return {"meta": meta, "cells": [cell.to_json(host) for cell in cells], "jobs": list(jobs)}
