"""python -m harmpi.report: the window it draws by default (the last
collectives, not a slow first call), the other windows, step labels, and
--help with every default (issue 22)."""

from __future__ import annotations

import json
import sys

import pytest
from support import REPO  # noqa: E402 (the checkout, one definition)

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from harmpi.cli import report  # noqa: E402


def _doc(n=100, slow=(0, 60)):
    """Two ranks, n collectives of 0.1 ms every 1 ms; collective 0 takes 500 ms
    (a first call that compiles), collective 60 takes 5 ms."""
    events = []
    for rank in (0, 1):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank} (node 0)"}})
        ts = 0.0
        for i in range(n):
            dur = 500_000.0 if i == slow[0] else 5_000.0 if i == slow[1] else 100.0
            events.append({"name": "allreduce", "ph": "X", "pid": rank, "tid": 0,
                           "ts": ts, "dur": dur, "args": {}})
            if rank == 1:
                events.append({"name": "wait for rank 0", "ph": "X", "pid": rank, "tid": 0,
                               "ts": ts, "dur": dur / 2, "args": {}})
            ts += dur + 1000.0
    return {"traceEvents": events}


def test_default_window_is_the_last_collectives():
    events = _doc()["traceEvents"]
    t0, t1, start, part, total, what = report.window(events)
    assert (start, len(part), total) == (60, 40, 100) and what == "the last ones"
    assert t1 - t0 < 100_000  # not stretched by the 500 ms first call


def test_slowest_window_skips_the_first_call_and_first_overrides():
    events = _doc()["traceEvents"]
    _, _, start, part, _, what = report.window(events, how="slowest", count=10)
    assert start == 55 and len(part) == 10 and "collective 61" in what
    _, _, start, part, _, what = report.window(events, first=0, count=5)
    assert start == 0 and "--first 0" in what
    _, _, start, part, _, _ = report.window(events, count=1000)
    assert (start, len(part)) == (0, 100)
    with pytest.raises(ValueError, match="last, slowest"):
        report.window(events, how="middle")


def test_labels_number_collectives_or_steps():
    events = _doc()["traceEvents"]
    t0, _, start, part, _, _ = report.window(events, count=12)
    _, labels = report._labels(part, start, t0, 0)
    assert labels[0] == "#89" and labels[-1] == "#100"
    _, labels = report._labels(part, start, t0, 4)  # 4 collectives per step
    assert labels == ["step 23", "step 24", "step 25"]


def test_help_shows_options_and_defaults(capsys):
    with pytest.raises(SystemExit) as exc:
        report.main(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for piece in ("--window {last,slowest}", "(default: last)", "--count COUNT",
                  "(default: 40)", "--first FIRST", "(default: None)", "--calls-per-step K",
                  "(default: 0)", "(default: timeline.png)"):
        assert piece in text, piece


def test_main_writes_the_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(_doc()))
    out = tmp_path / "t.png"
    assert report.main([str(trace), "-o", str(out), "--calls-per-step", "4"]) == 0
    assert out.stat().st_size > 1000 and f"wrote {out}" in capsys.readouterr().out
