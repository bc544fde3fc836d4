"""The cost model behind ``auto``: a latency and a per-byte cost per algorithm.

``auto`` switches between two algorithms at one size on each topology: on one
node from ``shm`` to ``shm_rsag`` above ``small_max_nbytes``, across equal
nodes from ``har_latency`` to ``har_bandwidth`` above
``har_latency_max_nbytes``. Where the user did not set them, a context takes
both sizes from this model at its creation (:func:`thresholds`): the size
where the two algorithms' predicted times cross, for its L and N. The model
only moves a switch between two correct algorithms; it never decides
whether a call is correct.

Notation: L ranks per node, N nodes, m bytes per rank, R rail exchanges
(recursive doubling: log2 N for a power of two, floor(log2 N) + 2 when the
extra nodes fold in first and get the result last). Every cost is linear in
the constants, t = fixed . c + m . per_byte . c (:func:`terms`), so they are
fitted by a non-negative least squares over measured rows (:func:`fit`).

The constants (:class:`CostConstants`; per-byte ones in us per MiB):

=================  ==============================================================
``call_us``        one call through a compiled entry: dispatch, copy set-up
``python_us``      extra cost of a Python entry (a forced algorithm, or auto's
                   Python path: har_bandwidth on two nodes, every step on more)
``python_round_us`` a Python har_* step, per flag round: the compiled calls
                   around each round (stage, rail, settle, gather) made from
                   Python
``flag_us``        one flag round inside a node, fixed part
``flag_rank_us``   one flag round, per rank of the node (L flags to see, L
                   cache lines bouncing)
``rail_us``        one rail exchange (a message to the peer node and back)
``copy_us_per_mib`` bytes one rank copies (into its slot, out of the slots)
``sum_us_per_mib`` input bytes one rank sums (bf16: widen, add, round)
``bus_us_per_mib`` bytes the whole node copies and sums: the L ranks share
                   the memory bandwidth, so a step where each rank sums L*m
                   costs L^2*m here
``rail_us_per_mib`` bytes one rank sends over its rail
``link_us_per_mib`` bytes the node sends over all its rails together (its L
                   rails share the node's link)
=================  ==============================================================

The cost of each algorithm, besides ``call_us`` (plus ``python_us`` on a
Python entry, and ``python_round_us`` per flag round of a Python har_*
step); F(L) = flag_us + L*flag_rank_us, per-byte constants named by their
first word, B = copy + sum the bytes a rank moves:

``shm``            F(L) + (copy*1 + sum*L)*m + bus*L*(1+L)*m
                   copy in, one flag round, every rank sums all L slots
``shm_rsag``       2*F(L) + (copy*2 + sum*1)*m + bus*L*3*m
                   copy in, sum 1/L of each of the L slots, copy the L
                   shares out: ~3m per rank, one flag round more
``har_latency``    F(L) + R*(rail_us + rail*m + link*L*m)
                   + (copy*1 + sum*(L+2R))*m + bus*L*B*m
                   the whole tensor crosses every rail, R adds of two
                   inputs, node sum
``har_bandwidth``  2*F(L) + R*(rail_us + rail*m/L + link*m)
                   + (copy*2 + sum*(1+2R/L))*m + bus*L*B*m
                   node reduce-scatter, 1/L of the tensor on each rail,
                   node allgather

Hence the switches: at L=1 ``har_bandwidth`` sends as much per rail as
``har_latency`` and pays one more flag round, so two one-rank nodes never
switch; at L=16 ``shm`` reads 16 slots per rank and the whole node 256*m,
so ``shm_rsag`` wins from a few KiB.

What the model leaves out: steps above one slot (HARMPI_SLOT_BYTES) run in
chunks, each with its own flag rounds (the crossovers lie below a slot);
waits when ranks outnumber cores (a scheduler slice per round: measure on
cores the ranks own); uneven nodes (``leader``, no switch).

Default constants: :data:`DEFAULT`, ``fit(DEFAULT_ROWS, PRIOR,
PRIOR_WEIGHT)`` (harmpi.algorithms.model_rows: the 16-core host of issue 37
and this project's 2-core machine, each recorded there with how it was
taken). Two hosts' rows in one fit give one "typical" host, and the rows
hold no same-size pair of har_latency and har_bandwidth on L > 1, so the
multi-node switches are the model's extrapolation: a host measures its own
once with ``python -m harmpi.tune`` (harmpi.algorithms.model_file keeps
them), and a setting overrides either switch. What the defaults give
(small_max / har_latency_max): 1 x 2 ~11 KiB, 1 x 4 ~3.5 KiB, 1 x 8 ~1.7
KiB, 1 x 16 ~0.9 KiB (the 16-core host: shm_rsag 26 us against shm 36 at
10 KiB, 55 against 176 at 64 KiB; this machine at 2 ranks: shm_rsag
ahead from 8-16 KiB, 1.8x at 64 KiB); 2 x 1 never (har_bandwidth sends as
much and pays a round more), 2 x 2 ~42 KiB, 2 x 8 ~6 KiB, 4 x 4 ~2 KiB.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

__all__ = ["CostConstants", "Row", "Thresholds", "ALGORITHMS", "ENTRIES", "NEVER_NBYTES",
           "DEFAULT", "PRIOR", "PRIOR_WEIGHT", "SHOWN_NBYTES", "rail_exchanges", "terms",
           "cost_us", "crossover_nbytes", "thresholds", "choose", "choices", "fit"]

MIB = float(1 << 20)
#: the algorithms the model prices (the two pairs auto switches between)
ALGORITHMS = ("shm", "shm_rsag", "har_latency", "har_bandwidth")
#: how a call enters: a compiled entry, or a Python one (python_us more)
ENTRIES = ("compiled", "python")
#: a switch that never happens (the small algorithm is as fast at every size)
NEVER_NBYTES = 1 << 62


@dataclasses.dataclass(frozen=True)
class CostConstants:
    """The model's constants (see the module docstring for each)."""

    call_us: float
    python_us: float
    python_round_us: float
    flag_us: float
    flag_rank_us: float
    rail_us: float
    copy_us_per_mib: float
    sum_us_per_mib: float
    bus_us_per_mib: float
    rail_us_per_mib: float
    link_us_per_mib: float

    def __post_init__(self):
        for name, value in self.as_dict().items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"cost model constant {name}={value!r}: must be a finite "
                                 "number >= 0")

    @classmethod
    def names(cls) -> tuple:
        return tuple(f.name for f in dataclasses.fields(cls))

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.names()}

    def vector(self) -> tuple:
        return tuple(getattr(self, name) for name in self.names())


class Row(NamedTuple):
    """One measurement: ``algorithm`` on L ``ranks_per_node`` x ``nodes``,
    entered by ``entry`` ("compiled" or "python"), ``nbytes`` per rank, ``t_us``."""

    algorithm: str
    ranks_per_node: int
    nodes: int
    entry: str
    nbytes: int
    t_us: float


class Thresholds(NamedTuple):
    """The two switches of auto (bytes per rank; a size at or below takes
    the first algorithm of the pair)."""

    small_max_nbytes: int
    har_latency_max_nbytes: int


def rail_exchanges(nodes: int) -> int:
    """R: rail exchanges of recursive doubling over ``nodes`` nodes (a
    non-power of two folds its extra nodes in first and out last)."""
    if nodes <= 1:
        return 0
    low = nodes.bit_length() - 1
    return low if nodes == 1 << low else low + 2


def terms(algorithm: str, L: int, N: int, entry: str = "compiled") -> tuple[tuple, tuple]:
    """(fixed, per_mib): the coefficients of the constants (in
    CostConstants' field order) in the cost of one call, so that
    t_us = sum(fixed[i]*c[i]) + nbytes/MiB * sum(per_mib[i]*c[i])."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"the cost model prices {', '.join(ALGORITHMS)}, not {algorithm!r}")
    if entry not in ENTRIES:
        raise ValueError(f"entry {entry!r}: choose one of {', '.join(ENTRIES)}")
    if L < 1 or N < 1:
        raise ValueError(f"ranks per node {L} and nodes {N} must be >= 1")
    R = rail_exchanges(N) if algorithm.startswith("har") else 0
    python = 1.0 if entry == "python" else 0.0
    if algorithm in ("shm", "har_latency"):
        rounds, copied, summed = 1, 1, L + 2 * R      # copy in; R adds of 2 inputs, L slots
        rail_bytes, link_bytes = R, R * L             # the whole tensor on every rail
    else:
        rounds, copied, summed = 2, 2, 1 + 2 * R / L  # copy in and out; 1/L of L slots, adds
        rail_bytes, link_bytes = R / L, R             # one share per rail
    # a Python har_* step drives each flag round by a compiled call of its
    # own (the forced shm and shm_rsag run one compiled step: none)
    python_rounds = python * rounds if R else 0.0
    fixed = (1.0, python, python_rounds, rounds, rounds * L, R, 0.0, 0.0, 0.0, 0.0, 0.0)
    per_mib = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, copied, summed, L * (copied + summed), rail_bytes,
               link_bytes)
    return fixed, per_mib


def _dot(a, b):
    return sum(x * y for x, y in zip(a, b))


def cost_us(c: CostConstants, algorithm: str, L: int, N: int, nbytes: int,
            entry: str = "compiled") -> float:
    """The predicted time of one call (us)."""
    fixed, per_mib = terms(algorithm, L, N, entry)
    v = c.vector()
    return _dot(fixed, v) + nbytes / MIB * _dot(per_mib, v)


def _line(c, algorithm, L, N, entry):
    """(us at 0 bytes, us per byte) of one algorithm."""
    fixed, per_mib = terms(algorithm, L, N, entry)
    v = c.vector()
    return _dot(fixed, v), _dot(per_mib, v) / MIB


def crossover_nbytes(c: CostConstants, small: str, large: str, L: int, N: int,
                     small_entry: str = "compiled", large_entry: str = "compiled") -> int:
    """The largest size at which ``small`` is predicted no slower than
    ``large`` (0: ``large`` wins from the first byte; NEVER_NBYTES: never)."""
    a0, a1 = _line(c, small, L, N, small_entry)
    b0, b1 = _line(c, large, L, N, large_entry)
    if a1 <= b1:  # small costs no more per byte: it never loses
        return NEVER_NBYTES if a0 <= b0 else 0
    if b0 <= a0:
        return 0
    return min(NEVER_NBYTES, int(math.floor((b0 - a0) / (a1 - b1))))


def thresholds(c: CostConstants, L: int, N: int) -> Thresholds:
    """auto's switches for L ranks per node on N nodes. small_max prices
    one node of L ranks (where it is used); har_latency_max prices N nodes
    (at least two; on one node it is not used). On two nodes auto runs
    har_latency through a compiled entry and har_bandwidth through Python
    (harmpi.runtime.entries); on more nodes both through Python."""
    L = max(1, L)
    small = crossover_nbytes(c, "shm", "shm_rsag", L, 1)
    N = max(2, N)
    harl_entry = "compiled" if N == 2 else "python"
    har = crossover_nbytes(c, "har_latency", "har_bandwidth", L, N, harl_entry, "python")
    return Thresholds(small, har)


def choose(c: CostConstants, L: int, N: int, nbytes: int) -> str:
    """The algorithm auto takes for ``nbytes`` with the model's switches."""
    t = thresholds(c, L, N)
    if N == 1:
        return "shm" if nbytes <= t.small_max_nbytes else "shm_rsag"
    return "har_latency" if nbytes <= t.har_latency_max_nbytes else "har_bandwidth"


#: the sizes info() and the tune command show a choice for (2 KiB .. 4 MiB)
SHOWN_NBYTES = tuple(1 << k for k in range(11, 23))


def choices(c: CostConstants, L: int, N: int, switches: Thresholds | None = None,
            sizes=SHOWN_NBYTES) -> list[dict]:
    """Per size: the algorithm taken under ``switches`` (default: the
    model's own) and the predicted us of both algorithms of the pair."""
    t = switches or thresholds(c, L, N)
    pair = ("shm", "shm_rsag") if N == 1 else ("har_latency", "har_bandwidth")
    limit = t.small_max_nbytes if N == 1 else t.har_latency_max_nbytes
    entries = ("compiled", "compiled") if N == 1 else \
        ("compiled" if N == 2 else "python", "python")
    out = []
    for nbytes in sizes:
        out.append({"nbytes": nbytes, "algorithm": pair[0] if nbytes <= limit else pair[1],
                    "predicted_us": {name: round(cost_us(c, name, L, N, nbytes, e), 2)
                                     for name, e in zip(pair, entries)}})
    return out


# -- fitting ------------------------------------------------------------------------


def fit(rows, prior: CostConstants | None = None, prior_weight: float = 0.0) -> CostConstants:
    """Constants fitted to ``rows`` (:class:`Row`s): a non-negative least
    squares of the relative error t_model/t_measured - 1, so a 2 KiB row
    counts as much as a 4 MiB one. ``prior`` with ``prior_weight`` > 0
    pulls each constant towards the prior's, relatively: a constant the
    rows cannot tell apart (one host's few layouts) stays near its prior
    instead of taking an arbitrary split."""
    import numpy as np  # noqa: PLC0415 - only the tune command and the tests fit

    rows = [Row(*r) for r in rows]
    if not rows:
        raise ValueError("no rows to fit the cost model to")
    names = CostConstants.names()
    a, b = [], []
    for r in rows:
        if not (r.t_us > 0 and math.isfinite(r.t_us)):
            raise ValueError(f"row {r}: the time must be a finite number > 0")
        fixed, per_mib = terms(r.algorithm, r.ranks_per_node, r.nodes, r.entry)
        a.append([(f + r.nbytes / MIB * p) / r.t_us for f, p in zip(fixed, per_mib)])
        b.append(1.0)
    if prior is not None and prior_weight > 0:
        w = math.sqrt(prior_weight)
        for i, value in enumerate(prior.vector()):
            if value > 0:
                a.append([w / value if j == i else 0.0 for j in range(len(names))])
                b.append(w)
    x = _nnls(np.array(a), np.array(b))
    return CostConstants(**{n: float(f"{v:.4g}") for n, v in zip(names, x)})


def _nnls(A, b, max_iter=200):
    """min |Ax - b| subject to x >= 0 (Lawson and Hanson's active set)."""
    import numpy as np  # noqa: PLC0415

    n = A.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, bool)
    for _ in range(max_iter):
        w = A.T @ (b - A @ x)
        free = ~passive & (w > 1e-12)
        if not free.any():
            break
        passive[np.argmax(np.where(free, w, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x


#: where the rows cannot tell constants apart, the fit keeps them near
#: these rough figures of a core-per-rank x86 host (the DESIGN notes: a
#: flag seen across cores in ~0.1 us, a forced algorithm's Python entry ~5 us
#: over the compiled one, a loopback TCP round trip ~8 us, memory copies at
#: ~20 GB/s and bf16 sums at ~10 GB/s per core)
PRIOR = CostConstants(call_us=3.0, python_us=5.0, python_round_us=2.0, flag_us=0.5,
                      flag_rank_us=0.1, rail_us=8.0, copy_us_per_mib=50.0, sum_us_per_mib=100.0,
                      bus_us_per_mib=5.0, rail_us_per_mib=200.0, link_us_per_mib=100.0)
#: how strongly the fit pulls each constant towards its prior (relative
#: squared error, against one per measured row)
PRIOR_WEIGHT = 0.1

#: the constants auto uses on a host that has not measured its own:
#: fit(model_rows.DEFAULT_ROWS, PRIOR, PRIOR_WEIGHT) (tests check that the fit gives them)
DEFAULT = CostConstants(call_us=3.99, python_us=8.294, python_round_us=2.323, flag_us=0.3633,
                        flag_rank_us=0.126, rail_us=6.241, copy_us_per_mib=10.79,
                        sum_us_per_mib=66.36, bus_us_per_mib=8.052, rail_us_per_mib=0.0,
                        link_us_per_mib=193.7)
