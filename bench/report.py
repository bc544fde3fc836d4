"""The report of the OSU-style benchmarks: result rows, OSU-layout tables,
the ``--json`` document and the ``--plot`` figure (pure: numbers in, lines and
files out; rank 0 calls it)."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from typing import Iterable, Sequence

import numpy as np

from bench.harness import format_nbytes

__all__ = [
    "WIDTH",
    "Row",
    "latency_fields",
    "ratio",
    "reference_impl",
    "format_table",
    "format_tables",
    "alltoall_table",
    "fit_lines",
    "rows_to_json",
    "jsonable",
    "plot_rows",
    "plot_panels",
]

FIELD_WIDTH = 18
SIZE_WIDTH = 9  # "4194304" and two spaces: a median -f table is then 100 wide
#: what every printed line fits by default (a terminal); --wide lifts it
WIDTH = 100

# --------------------------------------------------------------------------
# Rows, tables, JSON
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    """One (implementation, size) result; ``avg_us`` is None if not run."""

    impl: str
    dtype: str  # the dtype asked for (bf16)
    size: int  # bytes per rank
    avg_us: float | None
    min_us: float | None
    max_us: float | None
    iterations: int
    valid: bool | None  # None: not checked
    wire_dtype: str = ""  # what the implementation reduced (mpi: f32 for bf16)
    count: int = 0  # elements per rank in the wire dtype
    warmup: int = 0
    stat: str = "mean"
    busbw_gbps: float | None = None
    note: str = ""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def latency_fields(stat: str) -> dict:
    """What each latency field of a row holds, for the JSON's meta (``stat``: mean or median)."""
    _stat_label(stat)  # rejects an unknown statistic
    per_rank = f"each rank's {stat} of its timed calls"
    return {
        "avg_us": f"mean over ranks of {per_rank}, microseconds "
                  f"(the table's '{_stat_label(stat)} Latency(us)')",
        "min_us": f"smallest over ranks of {per_rank}, microseconds",
        "max_us": f"largest over ranks of {per_rank}, microseconds",
        "busbw_gbps": "bytes per rank / avg_us x busbw_factor, GB/s",
    }


def _stat_label(stat: str) -> str:
    return {"mean": "Avg", "median": "Median"}[stat]


def _fmt_us(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _fmt_valid(valid: bool | None) -> str:
    return {True: "Pass", False: "Fail", None: "-"}[valid]


def ratio(value_us: float | None, reference_us: float | None) -> float | None:
    """value / reference, or None if either is missing or the reference is 0."""
    if value_us is None or reference_us is None or reference_us <= 0:
        return None
    return value_us / reference_us


def reference_impl(impls: Sequence[str]) -> str:
    """The column ratios are taken against: plain 'harmpi', else the first
    harmpi*, else the first."""
    if "harmpi" in impls:
        return "harmpi"
    for name in impls:
        if name.startswith("harmpi"):
            return name
    return impls[0]


def _row_cells(row: Row | None, full: bool, check: bool) -> list[str]:
    """One implementation's cells on one size's line (row None: not run)."""
    cells = [_fmt_us(row.avg_us if row else None)]
    if full:
        cells += [
            _fmt_us(row.min_us if row else None),
            _fmt_us(row.max_us if row else None),
            str(row.iterations) if row and row.avg_us is not None else "n/a",
            "n/a" if row is None or row.busbw_gbps is None else f"{row.busbw_gbps:.3f}",
        ]
    if check:
        cells += [_fmt_valid(row.valid) if row else "n/a"]
    return cells


def _names_line(impls: Sequence[str], group_widths: Sequence[int], first_widths: Sequence[int],
                extra: str = "") -> str:
    """The line naming the implementation above each group of columns."""
    top = f"{'#':<{SIZE_WIDTH}}"
    for name, group_width, width in zip(impls, group_widths, first_widths):
        if group_width == width:
            top += f"{name:>{width}}"
        else:  # a dashed rule over the group's columns, name in the middle
            top += "    " + f" {name} ".center(group_width - 4, "-")
    return (top + extra).rstrip()


def _group_labels(stat: str, full: bool, check: bool, compact: bool) -> list[str]:
    """One implementation's column labels: OSU's, or short ones under a names line."""
    if not compact:
        group = [f"{_stat_label(stat)} Latency(us)"]
        if full:
            group += ["Min Latency(us)", "Max Latency(us)", "Iterations", "BusBW(GB/s)"]
        return group + (["Validation"] if check else [])
    group = [f"{_stat_label(stat)}(us)"]
    if full:
        group += ["Min(us)", "Max(us)", "Iters", "BusBW"]
    return group + (["Check"] if check else [])


def _group_widths(group: Sequence[str], name: str, compact: bool) -> list[int]:
    """Column widths of one implementation's group; wide enough for its name above."""
    if compact:
        widths = [max(10, len(group[0]) + 2)] + [len(col) + 2 for col in group[1:]]
        need = len(name) + (6 if len(group) > 1 else 2)  # the dashed rule or the name alone
    else:
        widths = [max(FIELD_WIDTH, len(group[0]) + 2)] + [max(12, len(col) + 2)
                                                            for col in group[1:]]
        need = len(name) + 6 if len(group) > 1 else 0
    widths[0] += max(0, need - sum(widths))
    return widths


def _side_by_side(rows, impls, full, check, stat, compact) -> list[str]:
    """Several implementations: a names line, then each one's group of columns
    and one ratio column per other implementation (against the reference)."""
    group = _group_labels(stat, full, check, compact)
    widths = {name: _group_widths(group, name, compact) for name in impls}
    reference = reference_impl(impls)
    ratio_impls = [name for name in impls if name != reference]
    if compact:  # the names line says "/ harmpi" over the ratio columns
        ratio_labels = list(ratio_impls)
        ratio_widths = [max(8, len(text) + 2) for text in ratio_labels]
        rule = f" / {reference} "
        span = sum(ratio_widths) - 2
        extra = "  " + rule.center(span, "-") if span >= len(rule) + 2 else f"  /{reference}"
    else:
        ratio_labels = [f"{name}/{reference}" for name in ratio_impls]
        ratio_widths = [max(FIELD_WIDTH, len(text) + 2) for text in ratio_labels]
        extra = ""
    lines = [_names_line(impls, [sum(widths[n]) for n in impls], [widths[n][0] for n in impls],
                         extra)]
    header = f"{'# Size':<{SIZE_WIDTH}}"
    header += "".join(f"{col:>{w}}" for name in impls for col, w in zip(group, widths[name]))
    header += "".join(f"{text:>{w}}" for text, w in zip(ratio_labels, ratio_widths))
    lines.append(header)
    by_key = {(row.impl, row.size): row for row in rows}
    for size in sorted({row.size for row in rows}):
        line = f"{size:<{SIZE_WIDTH}}"
        for name in impls:
            cells = _row_cells(by_key.get((name, size)), full, check)
            line += "".join(f"{cell:>{w}}" for cell, w in zip(cells, widths[name]))
        ref_row = by_key.get((reference, size))
        for name, w in zip(ratio_impls, ratio_widths):
            row = by_key.get((name, size))
            value = ratio(row.avg_us if row else None, ref_row.avg_us if ref_row else None)
            line += f"{'n/a' if value is None else f'{value:.2f}':>{w}}"
        lines.append(line)
    return lines


def _stacked(rows, impls, full, check, stat) -> list[str]:
    """Several implementations, one line each per size: what fits when their
    columns side by side would not."""
    group = _group_labels(stat, full, check, compact=full)  # -f: short labels
    widths = ([max(11, len(col) + 2) for col in group[:3]] + [7, 9, 7])[:len(group)]
    if not full:
        widths = [max(FIELD_WIDTH, len(group[0]) + 2)] + [len(col) + 2 for col in group[1:]]
    name_width = max(16, max(len(name) for name in impls) + 2)
    reference = reference_impl(impls)
    ratio_label = "ratio"  # to the reference: the '# Ratios:' line names it
    ratio_width = 8
    header = f"{'# Size':<{SIZE_WIDTH}}{'Implementation':<{name_width}}"
    header += "".join(f"{col:>{w}}" for col, w in zip(group, widths))
    lines = [header + f"{ratio_label:>{ratio_width}}"]
    by_key = {(row.impl, row.size): row for row in rows}
    for size in sorted({row.size for row in rows}):
        ref_row = by_key.get((reference, size))
        for name in impls:
            row = by_key.get((name, size))
            cells = _row_cells(row, full, check)
            value = ratio(row.avg_us if row else None, ref_row.avg_us if ref_row else None)
            lines.append(f"{size:<{SIZE_WIDTH}}{name:<{name_width}}"
                         + "".join(f"{cell:>{w}}" for cell, w in zip(cells, widths))
                         + f"{'n/a' if value is None else f'{value:.2f}':>{ratio_width}}")
    return lines


def format_table(
    rows: Sequence[Row],
    impls: Sequence[str],
    *,
    full: bool = False,
    check: bool = False,
    stat: str = "mean",
    width: int | None = WIDTH,
) -> list[str]:
    """Lines of the OSU-layout table (without the title and '#' header lines).

    One implementation: exactly OSU's columns, ``# Size  Avg Latency(us)``
    [Min Latency(us)  Max Latency(us)  Iterations] [Validation], with
    ``-f`` adding BusBW(GB/s) after Iterations (100 columns at most).
    Several: side by side, a names line above each one's group of short
    columns (``Avg(us)``, ``Check``), then one ratio column per other
    implementation under ``/ <reference>`` = its latency divided by the
    reference's (above 1: the reference is faster).  When that would be
    wider than ``width``, one line per implementation and size instead
    (``# Size  Implementation  Avg Latency(us) ...  /<reference>``), so the
    table always fits.  ``width`` None (``--wide``): side by side with OSU's
    column labels, however wide.
    """
    if len(impls) == 1:
        group = _group_labels(stat, full, check, compact=False)
        widths = _group_widths(group, impls[0], compact=False)
        lines = [f"{'# Size':<{SIZE_WIDTH}}" + "".join(f"{col:>{w}}"
                                                        for col, w in zip(group, widths))]
        by_size = {row.size: row for row in rows if row.impl == impls[0]}
        for size in sorted({row.size for row in rows}):
            cells = _row_cells(by_size.get(size), full, check)
            lines.append(f"{size:<{SIZE_WIDTH}}"
                         + "".join(f"{cell:>{w}}" for cell, w in zip(cells, widths)))
        return lines
    if width is None:
        return _side_by_side(rows, impls, full, check, stat, compact=False)
    side = _side_by_side([], impls, full, check, stat, compact=True)
    if max(len(line) for line in side) <= width:
        return _side_by_side(rows, impls, full, check, stat, compact=True)
    return _stacked(rows, impls, full, check, stat)


def format_tables(rows: Sequence[Row], impls: Sequence[str], *, check: bool = False,
                  stat: str = "mean") -> list[str]:
    """``-f`` with several implementations: one OSU ``-f`` table per
    implementation, each under a ``# <impl>`` line, as the OSU suite prints
    one table per run (a single grouped table would not fit a terminal)."""
    lines: list[str] = []
    for name in impls:
        own = [row for row in rows if row.impl == name]
        lines += ["#", f"# {name}"]
        lines += format_table(own, [name], full=True, check=check, stat=stat)
    return lines


def fit_lines(lines: Iterable[str], width: int | None = WIDTH) -> list[str]:
    """``#`` lines longer than ``width`` wrapped at spaces onto ``#   ``
    continuation lines (tables are laid out to fit on their own; a line
    without ``#`` is left alone).  ``width`` None: every line as it is."""
    out: list[str] = []
    for line in lines:
        if width is None or len(line) <= width or not line.startswith("#"):
            out.append(line)
            continue
        out += textwrap.wrap(line, width, subsequent_indent="#   ", break_long_words=False,
                             break_on_hyphens=False)
    return out


def rows_to_json(rows: Sequence[Row], meta: dict) -> str:
    """The ``--json`` document: {"meta": {...}, "rows": [{impl, dtype, size, avg_us, ...}]}."""
    document = {"meta": meta, "rows": [row.to_json() for row in rows]}
    return json.dumps(document, indent=2, sort_keys=False) + "\n"


def alltoall_table(rows, impls: Sequence[str]) -> list[str]:
    """``bench.osu_alltoall``'s table: per size (rows of (size, {impl: us},
    calls)), each implementation's latency, its ratio to mpi's, the calls timed.
    Each column as wide as its name needs: four impls and three ratios fit 100."""
    ratios = [name for name in impls if name != "mpi"] if "mpi" in impls else []
    widths = {name: max(9, len(name) + 1) for name in impls}
    ratio_widths = {name: max(8, len(name) + 5) for name in ratios}
    lines = [f"{'# size':<8}" + "".join(f"{name:>{widths[name]}}" for name in impls)
             + "".join(f"{name + '/mpi':>{ratio_widths[name]}}" for name in ratios)
             + f"{'calls':>7}"]
    for size, med, calls in rows:
        lines.append(
            f"{format_nbytes(size):<8}"
            + "".join(f"{med[name]:>{widths[name]}.1f}" for name in impls)
            + "".join(f"{med[name] / med['mpi']:>{ratio_widths[name]}.2f}" for name in ratios)
            + f"{calls:>7}")
    return lines


def jsonable(value):
    """``value`` with numpy scalars as Python numbers, keys as strings and
    anything else unknown as its str(), so json.dump takes it."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def plot_rows(rows: Sequence[Row], impls: Sequence[str], path: str, title: str) -> None:
    """Latency vs size, log-log, one line per implementation (needs matplotlib)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name in impls:
        points = sorted(
            (row.size, row.avg_us) for row in rows if row.impl == name and row.avg_us is not None
        )
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", markersize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    size_labels = matplotlib.ticker.FuncFormatter(lambda x, _pos: format_nbytes(int(round(x))))
    ax.xaxis.set_major_formatter(size_labels)
    ax.set_xlabel("message size per rank (bytes)")
    stat = rows[0].stat if rows else "mean"
    ax.set_ylabel(f"{_stat_label(stat).lower()} latency (us)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_panels(panels, path: str, title: str) -> None:
    """Latency against size, log-log, one panel per (label, {impl: [(size, us)]})
    and one line per implementation, as a PNG at ``path`` (needs matplotlib)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5.0 * max(1, len(panels)), 4.4),
                             squeeze=False, sharey=True)
    for ax, (label, series) in zip(axes[0], panels):
        for name, points in series.items():
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, marker="o", markersize=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(
            matplotlib.ticker.FuncFormatter(lambda x, _pos: format_nbytes(int(round(x)))))
        ax.set_xlabel("message size per rank (bytes)")
        ax.set_title(label, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("latency (us)")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
