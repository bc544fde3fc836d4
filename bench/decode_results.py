"""What a decode run measured -> the numbers and the table it reports (pure numpy).

Shared by the decode benchmarks (``bench.decode``, ``bench.moe_decode``):
how timed steps split into rounds, where two backends' greedy tokens part
and how near a tie the logits were there, the collectives' own latency
after the last rank arrived, and the dense benchmark's per-backend summary
and result table.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = [
    "round_steps",
    "first_divergence",
    "NEAR_TIE_ULPS",
    "top2_margin_ulps",
    "logits_gap_ulps",
    "divergence_note",
    "collective_latency_ns",
    "round_tokens_per_s",
    "summarize_backend",
    "format_decode_table",
]


def round_steps(steps: int, rounds: int) -> list[int]:
    """Split ``steps`` timed steps over at most ``rounds`` rounds, as evenly as
    possible (no empty round)."""
    rounds = max(1, min(rounds, steps))
    return [steps // rounds + (1 if i < steps % rounds else 0) for i in range(rounds)]


def first_divergence(a: np.ndarray, b: np.ndarray) -> int | None:
    """First generated position (column) where two [batch, steps] token arrays
    differ, or None."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return 0
    differ = (a != b).any(axis=0)
    return int(np.argmax(differ)) if differ.any() else None


#: a greedy token whose top two logits are this many bf16 ulps apart or fewer
#: is a near tie: reductions summing bf16 in another order may flip it
NEAR_TIE_ULPS = 16


def top2_margin_ulps(logits: np.ndarray) -> float:
    """[batch, vocab] logits -> the smallest gap between the top two logits of
    a row, in bf16 ulps of that row's top logit (ulp = 2^(exponent - 7))."""
    logits = np.asarray(logits, dtype=np.float64)
    top2 = -np.sort(-logits, axis=-1)[:, :2]
    exponent = np.floor(np.log2(np.maximum(np.abs(top2[:, 0]), 2.0**-126)))
    return float(((top2[:, 0] - top2[:, 1]) / 2.0 ** (exponent - 7)).min())


def logits_gap_ulps(reference: np.ndarray, other: np.ndarray) -> float:
    """Largest |difference| of two [batch, vocab] logit arrays, in bf16 ulps of
    the reference's largest |logit| (ulp = 2^(exponent - 7))."""
    reference = np.asarray(reference, dtype=np.float64)
    scale = max(float(np.abs(reference).max()), 2.0**-126)
    ulp = 2.0 ** (np.floor(np.log2(scale)) - 7)
    return float(np.abs(reference - np.asarray(other, dtype=np.float64)).max() / ulp)


def divergence_note(position: int | None, margin_ulps: float | None) -> str:
    """Why two backends' greedy tokens differ from ``position`` on (or that they do not)."""
    if position is None:
        return "yes"
    text = f"no (first divergence at generated token {position}"
    if margin_ulps is None:
        return text + ")"
    if margin_ulps <= NEAR_TIE_ULPS:
        return (text + f": there the reference's top two logits were {margin_ulps:.1f} bf16 "
                f"ulps apart, a near tie (<= {NEAR_TIE_ULPS}) that bf16 sums in another order "
                "flip; the tokens after it follow another path, not a wrong result)")
    return (text + f": CHECK, the reference's top two logits were {margin_ulps:.1f} bf16 ulps "
            f"apart there, more than summation order explains (> {NEAR_TIE_ULPS}))")


def collective_latency_ns(enter_ns: np.ndarray, exit_ns: np.ndarray) -> np.ndarray:
    """Each rank's time in each collective after the last rank arrived.

    ``enter_ns``/``exit_ns`` [ranks, steps, calls] are clock readings around
    every collective call on every rank (one host: one monotonic clock).
    Whatever a rank spends inside a call before the last rank arrives is
    waiting for that rank (load imbalance, or a peer that is not scheduled
    when ranks outnumber cores); what it spends after is the collective's own
    latency.  Returns the latter, >= 0, summed over the calls of each step:
    [ranks, steps].
    """
    enter_ns = np.asarray(enter_ns, dtype=np.int64)
    exit_ns = np.asarray(exit_ns, dtype=np.int64)
    last_arrival = enter_ns.max(axis=0, keepdims=True)
    own = np.maximum(exit_ns - np.maximum(enter_ns, last_arrival), 0)
    return own.sum(axis=2)


def round_tokens_per_s(step_ns: np.ndarray, per_round: Sequence[int], batch: int) -> list[float]:
    """tok/s of each round: batch / the median of its rank-averaged step times."""
    mean_ns = np.asarray(step_ns, dtype=np.float64).mean(axis=0)
    bounds = np.cumsum([0, *per_round])
    return [float(batch * 1e9 / np.median(mean_ns[a:b])) for a, b in zip(bounds, bounds[1:])]


def summarize_backend(step_ns: np.ndarray, comm_ns: np.ndarray, batch: int,
                      latency_ns: np.ndarray | None = None,
                      per_round: Sequence[int] | None = None,
                      cpu_ns: np.ndarray | None = None) -> dict:
    """Per-rank step and communication times [ranks, steps] -> the reported numbers.

    ms_per_token: median over steps of the rank-averaged step time (each step
    yields one token per sequence); tokens_per_s = batch / that;
    tokens_per_s_rounds: min, median and max of the rounds' tok/s
    (``per_round``: the steps of each round, in order; default one round).
    The split of a step is in means, so its columns add up:
    compute_ms_per_token + comm_ms_per_token = mean_ms_per_token (mean over
    steps and ranks), and comm_share = comm_ms_per_token / mean_ms_per_token.
    comm_share_min: the smallest per-rank share (the rank that waits least).
    comm_latency_*: the same for the time after the last rank arrived
    (see :func:`collective_latency_ns`), None when not measured.
    cpu_ms_per_token: the mean CPU time a rank's process used per step
    (``cpu_ns`` [ranks, steps]), cpu_share: that over the mean step, the
    part of a core a rank got; None when not measured.
    compute_ms_per_token differs between backends when their waiting slows
    the compute (busy-polling a core that shares a physical core or a CPU
    quota with the computing one).
    """
    step_ns = np.asarray(step_ns, dtype=np.float64)
    comm_ns = np.asarray(comm_ns, dtype=np.float64)
    step_ms = np.median(step_ns.mean(axis=0)) / 1e6
    mean_ms = step_ns.mean() / 1e6
    comm_ms = comm_ns.mean() / 1e6
    rounds = round_tokens_per_s(step_ns, per_round or [step_ns.shape[1]], batch)
    summary = {
        "ms_per_token": float(step_ms),
        "tokens_per_s": float(batch * 1e3 / step_ms),
        "tokens_per_s_rounds": {"min": min(rounds), "median": float(np.median(rounds)),
                                "max": max(rounds), "each": rounds},
        "mean_ms_per_token": float(mean_ms),
        "compute_ms_per_token": float(mean_ms - comm_ms),
        "comm_ms_per_token": float(comm_ms),
        "comm_share": float(comm_ms / mean_ms),
        "comm_share_min": float((comm_ns.sum(axis=1) / step_ns.sum(axis=1)).min()),
        "comm_latency_share": None,
        "comm_latency_ms_per_token": None,
        "cpu_ms_per_token": None,
        "cpu_share": None,
    }
    if cpu_ns is not None:
        cpu_ms = np.asarray(cpu_ns, dtype=np.float64).mean() / 1e6
        summary["cpu_ms_per_token"] = float(cpu_ms)
        summary["cpu_share"] = float(cpu_ms / mean_ms)
    if latency_ns is not None:
        latency_ms = np.asarray(latency_ns, dtype=np.float64).mean() / 1e6
        summary["comm_latency_ms_per_token"] = float(latency_ms)
        summary["comm_latency_share"] = float(latency_ms / mean_ms)
    return summary


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _spread(row: dict) -> str:
    spread = row.get("tokens_per_s_rounds")
    return "-" if not spread else f"{spread['min']:.1f}-{spread['max']:.1f}"


def _agree(row: dict) -> str:
    return {None: "-", True: "yes", False: "NO"}[row.get("tokens_identical_across_ranks")]


#: a cell of the decode table: what it shows of a row
_CELLS = {
    "tok/s": lambda row: f"{row['tokens_per_s']:.1f}",
    "rounds": _spread,
    "median": lambda row: f"{row['ms_per_token']:.2f}",
    "mean": lambda row: _ms(row.get("mean_ms_per_token")),
    "compute": lambda row: _ms(row.get("compute_ms_per_token")),
    "collect": lambda row: _ms(row["comm_ms_per_token"]),
    "share": lambda row: _pct(row["comm_share"]),
    "min rank": lambda row: _pct(row["comm_share_min"]),
    "after": lambda row: _ms(row.get("comm_latency_ms_per_token")),
    "after share": lambda row: _pct(row.get("comm_latency_share")),
    "prefill": lambda row: f"{row['prefill_ms']:.1f}",
    "agree": _agree,
}

#: (label, width, cell) after the comm column; 100 columns, then --wide's
_NARROW = (("tok/s", 8, "tok/s"), ("rounds", 14, "rounds"), ("ms/tok", 8, "median"),
           ("compute", 9, "compute"), ("collect.", 9, "collect"), ("share", 7, "share"),
           ("min rank", 9, "min rank"), ("ms/tok", 8, "after"), ("share", 7, "after share"),
           ("agree", 6, "agree"))
_WIDE = (("tok/s", 8, "tok/s"), ("rounds min-max", 15, "rounds"), ("ms/token", 9, "median"),
         ("mean ms", 9, "mean"), ("compute", 9, "compute"), ("collect.", 10, "collect"),
         ("share", 8, "share"), ("min rank", 10, "min rank"), ("ms/token", 12, "after"),
         ("share", 10, "after share"), ("prefill ms", 12, "prefill"), ("ranks agree", 13, "agree"))


def format_decode_table(rows: Sequence[dict], wide: bool = False) -> list[str]:
    """The result table (rank 0 prints it): tok/s and its rounds' range from
    median steps; the split of the mean step (compute + collectives = mean).
    100 columns; ``wide`` adds the mean step and the prefill time (both are
    in the JSON too) with longer labels."""
    if wide:
        name_width, columns = 14, _WIDE
        groups = (f"{'#':<14}{' median step '.center(30, '-'):>32}"
                  f"{' mean step = compute + collectives '.center(44, '-'):>46}"
                  f"{' after last arrival '.center(22, '-'):>22}")
    else:
        name_width, columns = 13, _NARROW
        groups = (f"{'#':<13}{' median step '.center(28, '-'):>30}"
                  f"{' mean step: compute + coll. '.center(32, '-'):>34}"
                  f"{' after last '.center(14, '-'):>15}")
    lines = [groups, f"{'# comm':<{name_width}}"
             + "".join(f"{label:>{width}}" for label, width, _ in columns)]
    for row in rows:
        lines.append(f"{row['comm']:<{name_width}}"
                     + "".join(f"{_CELLS[cell](row):>{width}}" for _, width, cell in columns))
    return lines
