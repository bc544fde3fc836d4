"""Draw a PNG timeline of a few steps from a harmpi profile trace.

    python -m harmpi.report trace.json -o timeline.png [--first 100] [--count 40]

One row per rank (the trace's tracks); each collective is a bar: the part
spent waiting for the last arrival in orange, the collective's own part in
blue; the gaps between bars are the caller's compute. ``--first`` skips
that many collectives of rank 0 and ``--count`` draws the next ones (the
window is their time span on rank 0's clock, the same for every row).
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main", "draw"]


def _window(events, first, count):
    calls = sorted((e for e in events if e.get("ph") == "X" and e["pid"] == 0
                    and not e["name"].startswith("wait")), key=lambda e: e["ts"])
    if not calls:
        calls = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])
    if not calls:
        raise SystemExit("the trace holds no collectives")
    part = calls[min(first, len(calls) - 1):][:max(1, count)]
    return part[0]["ts"], part[-1]["ts"] + part[-1]["dur"]


def draw(doc, out, first=0, count=40):
    """Write the timeline of ``doc`` (a trace dict) to the PNG ``out``."""
    import matplotlib  # noqa: PLC0415 - only this CLI needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    events = doc["traceEvents"]
    t0, t1 = _window(events, first, count)
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "process_name"}
    pids = sorted(names) or sorted({e["pid"] for e in events})
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(pids) + 1.5))
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
    ax.set_title("harmpi collectives: orange = waiting for the last arrival, blue = own "
                 "time, gaps = compute")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m harmpi.report", description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="a trace written by HARMPI_TRACE or Profile.write_trace")
    ap.add_argument("-o", "--output", default="timeline.png")
    ap.add_argument("--first", type=int, default=0, help="collectives of rank 0 to skip")
    ap.add_argument("--count", type=int, default=40, help="collectives to draw")
    args = ap.parse_args(argv)
    with open(args.trace) as f:
        doc = json.load(f)
    draw(doc, args.output, args.first, args.count)
    return 0


if __name__ == "__main__":
    sys.exit(main())
