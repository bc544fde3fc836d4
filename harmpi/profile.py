"""``harmpi.profile()``: profile every collective of a communicator in a
``with`` block; callable as a module too (see harmpi._callable). What is
recorded and how: harmpi.record.breakdown."""

from typing import Any

from ._callable import make_module_callable
from .record.breakdown import (
    SUMMARY_WIDTH,
    Profile,
    clock_offsets,
    finish,
    format_summary,
    merged_arrivals,
    trace_events,
)
from .runtime.registry import STATE

__all__ = ["profile", "Profile", "SUMMARY_WIDTH", "clock_offsets", "finish", "format_summary",
           "merged_arrivals", "trace_events"]


def profile(comm: Any = None, records: int | None = None, trace: str | None = None) -> Profile:
    """Profile every harmpi collective on ``comm`` (default COMM_WORLD)
    inside a ``with`` block (collective on entry: it times the clocks).

    ``records``: ring size per rank (default HARMPI_PROFILE_RECORDS);
    ``trace``: a file to write the Chrome trace to on exit. The object it
    yields keeps its figures after the block: ``p.summary()``,
    ``p.stats()``, ``p.write_trace(path)`` (all collective)."""
    return Profile(STATE.get(comm), records, trace)


make_module_callable(__name__, profile)
