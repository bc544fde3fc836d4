"""Draw a PNG timeline of a few steps from a harmpi profile trace.

    python -m harmpi.report trace.json -o timeline.png [--window last|slowest]
        [--count 40] [--first N] [--calls-per-step K]

One row per rank (the trace's tracks); each collective is a bar: the part
spent waiting for the last arrival in orange, the collective's own part in
blue; the gaps between bars are the caller's compute. The window is
``--count`` collectives of rank 0 (their time span on rank 0's clock, the
same for every row): by default the last ones (the steady state: a slow
first call, compiling or connecting, would squeeze the rest into slivers);
``--window slowest`` centres it on rank 0's slowest collective after the
first; ``--first N`` starts at collective N. The title says which window
it drew; rank 0's row numbers its collectives, or its steps with
``--calls-per-step K`` (K collectives per step, e.g. 2 x layers + 1 in a
decode step).
"""

from __future__ import annotations

import argparse
import json
import sys

from . import cliout

__all__ = ["main", "draw", "window"]

WINDOWS = ("last", "slowest")


def _calls(events):
    """Rank 0's collectives in time order (every track's if rank 0 has none)."""
    calls = sorted((e for e in events if e.get("ph") == "X" and e["pid"] == 0
                    and not e["name"].startswith("wait")), key=lambda e: e["ts"])
    if not calls:
        calls = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])
    if not calls:
        raise SystemExit("the trace holds no collectives")
    return calls


def window(events, first=None, count=40, how="last"):
    """(t0, t1, start, calls drawn, calls in all, what the window is): the
    time span of ``count`` consecutive collectives of rank 0 chosen by
    ``first`` (an index) or else by ``how`` ("last" or "slowest")."""
    calls = _calls(events)
    count = max(1, min(count, len(calls)))
    if first is not None:
        start = max(0, min(first, len(calls) - 1))
        what = f"from --first {first}"
    elif how == "slowest":
        later = range(1, len(calls)) if len(calls) > 1 else range(1)
        slowest = max(later, key=lambda i: calls[i]["dur"])
        start = max(0, min(slowest - count // 2, len(calls) - count))
        what = (f"around the slowest after the first (collective {slowest + 1}, "
                f"{calls[slowest]['dur'] / 1e3:.3g} ms)")
    elif how == "last":
        start = len(calls) - count
        what = "the last ones"
    else:
        raise ValueError(f"window must be one of {', '.join(WINDOWS)}, not {how!r}")
    part = calls[start:start + count]
    return part[0]["ts"], part[-1]["ts"] + part[-1]["dur"], start, part, len(calls), what


def _labels(part, start, t0, calls_per_step):
    """(x positions in ms, labels) on rank 0's collectives: every one's number,
    or each step's first collective with ``calls_per_step``; at most ~12."""
    marks = []
    for i, e in enumerate(part, start):
        if calls_per_step:
            if i % calls_per_step == 0:
                marks.append(((e["ts"] - t0) / 1e3, f"step {i // calls_per_step + 1}"))
        else:
            marks.append(((e["ts"] - t0) / 1e3, f"#{i + 1}"))
    stride = max(1, -(-len(marks) // 12))
    marks = marks[::stride]
    return [x for x, _ in marks], [text for _, text in marks]


def draw(doc, out, first=None, count=40, how="last", calls_per_step=0):
    """Write the timeline of ``doc`` (a trace dict) to the PNG ``out``."""
    import matplotlib  # noqa: PLC0415 - only this CLI needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    events = doc["traceEvents"]
    t0, t1, start, part, total, what = window(events, first, count, how)
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "process_name"}
    pids = sorted(names) or sorted({e["pid"] for e in events})
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(pids) + 1.8))
    for row, pid in enumerate(pids):
        own, wait = [], []
        for e in events:
            if e.get("ph") != "X" or e["pid"] != pid or e["ts"] + e["dur"] < t0 or e["ts"] > t1:
                continue
            (wait if e["name"].startswith("wait") else own).append(
                ((e["ts"] - t0) / 1e3, e["dur"] / 1e3))
        ax.broken_barh(own, (row - 0.35, 0.7), facecolors="tab:blue")
        ax.broken_barh(wait, (row - 0.35, 0.7), facecolors="tab:orange")
    ax.set_yticks(range(len(pids)), [names.get(p, f"rank {p}") for p in pids])
    ax.invert_yaxis()
    ax.set_xlim(0, (t1 - t0) / 1e3)
    ax.set_xlabel("ms (rank 0's clock)")
    top = ax.secondary_xaxis("top")
    top.set_xticks(*_labels(part, start, t0, calls_per_step))
    top.tick_params(labelsize=8)
    unit = "steps' " if calls_per_step else ""
    ax.set_title(f"harmpi collectives {start + 1}-{start + len(part)} of {total} on rank 0: "
                 f"{what}\norange = waiting for the last arrival, blue = own time, gaps = "
                 f"compute; {unit}numbers above", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m harmpi.report", description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("trace", help="a trace written by HARMPI_TRACE or Profile.write_trace")
    ap.add_argument("-o", "--output", default="timeline.png", help="the PNG to write")
    ap.add_argument("--window", choices=WINDOWS, default="last",
                    help="which collectives of rank 0 to draw: the last ones, or those "
                         "around the slowest after the first")
    ap.add_argument("--count", type=int, default=40, help="collectives to draw")
    ap.add_argument("--first", type=int, default=None,
                    help="start at this collective of rank 0 (0: the first) instead of "
                         "--window")
    ap.add_argument("--calls-per-step", type=int, default=0, metavar="K",
                    help="number steps of K collectives above the bars (0: number the "
                         "collectives)")
    args = ap.parse_args(argv)
    if args.count < 1 or (args.first is not None and args.first < 0) or args.calls_per_step < 0:
        ap.error("--count must be >= 1, --first and --calls-per-step >= 0")
    with open(args.trace) as f:
        doc = json.load(f)
    draw(doc, args.output, args.first, args.count, args.window, args.calls_per_step)
    cliout.log.info("wrote %s", args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
