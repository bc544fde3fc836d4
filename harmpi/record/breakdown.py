"""Where a step's time goes: a per-collective profile, the last arrival, a trace.

The machinery below harmpi.runtime.context (which profiles from HARMPI_PROFILE);
the call ``harmpi.profile()`` is harmpi.profile, above the registry.

    with harmpi.profile() as p:          # collective over COMM_WORLD
        for _ in range(steps):
            decode_step()
    text = p.summary()                   # collective; every rank gets the text
    s = p.stats()                        # the same figures as a dict
    p.write_trace("trace.json")          # collective; rank 0 writes the file

``HARMPI_PROFILE=1`` profiles every collective of a context from its
creation, and rank 0 prints the summary when harmpi.finalize() frees it;
``HARMPI_TRACE=FILE`` also writes the trace then. Off (the default), an
entry pays one load and one branch of the control block's ``profile`` word.

What each rank records per collective (harmpi.record.recorder, in compiled code):
entry and exit times, the first and the last arrival it heard of and who
arrived last (from the flag rounds the collective runs anyway, see
harmpi.node; across two nodes over tcp from the rail message's header),
bytes and the kind word (dtype, collective, forced algorithm). From them:

- *waiting for the last arrival* = last arrival - own entry (0 if this rank
  was last), and *own work after it* = exit - last arrival: "is the
  library slow, or is a rank late?";
- per rank, how often it arrived last and, summed over those collectives,
  the time from the first rank's arrival to its own.

Which arrivals a rank hears of: every rank of its node (every entry), and
on two equal nodes over tcp (the compiled two-node step) every rank of the
other node too. Other multi-node paths (the mpi transport, more nodes,
forced algorithms) see their own node only.

Clocks: CLOCK_MONOTONIC is one clock per host (and per kernel: "hosts" that
are containers or namespaces of one machine share it, recognised by the
kernel's boot id). Another host's offset to rank 0's clock is estimated once,
when profiling starts, by 16 ping-pongs with rank 0 over MPI; the offset of
the fastest round trip is kept and its error is at most half that round trip
(``clock_bound_s`` in stats). A rail peer's arrival is converted through
both hosts' CLOCK_REALTIME the same way.

Memory: a ring of the last ``records`` collectives per rank
(HARMPI_PROFILE_RECORDS, default 16384, 64 bytes each) and fixed-size
aggregates (counts, sums, a latency histogram of 1/8-octave buckets for
p50/p99): a million collectives take no more memory than a thousand.
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np
from mpi4py import MPI

from ..base import dtypes, kind
from ..base.topology import arrive
from ..config import ALGORITHM_NAMES
from ..platform.machine import boot_id
from . import recorder

log = logging.getLogger("harmpi")

__all__ = ["Profile", "SUMMARY_WIDTH", "clock_offsets", "finish", "format_summary",
           "merged_arrivals", "trace_events", "last_arrivals", "own_by_size"]

_PINGS = 16
_TAG = 0x4852


def _machine():
    """This rank's machine (its boot id; the processor name where there is none)."""
    return boot_id() or MPI.Get_processor_name()


def _mono():
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def clock_offsets(comm):
    """Per rank of ``comm``: (monotonic offset, realtime offset, bound), ns,
    where offset = rank 0's clock minus that rank's (collective). Ranks on
    rank 0's kernel get (0, 0, 0), exact; one rank per other kernel runs
    the ping-pongs and the others of its kernel share its figures."""
    rank = comm.Get_rank()
    boots = comm.allgather(_machine())
    reps = {}
    for r, b in enumerate(boots):
        reps.setdefault(b, r)
    mine = (0, 0, 0)
    for b, rep in reps.items():
        if rep == 0:
            continue
        if rank == 0:
            for _ in range(_PINGS):
                comm.recv(source=rep, tag=_TAG)
                comm.send((_mono(), time.time_ns()), dest=rep, tag=_TAG)
        elif rank == rep:
            best = None
            for _ in range(_PINGS):
                t1 = _mono()
                comm.send(None, dest=0, tag=_TAG)
                m0, r0 = comm.recv(source=0, tag=_TAG)
                t2 = _mono()
                rt_minus_mono = time.time_ns() - _mono()
                rtt = t2 - t1
                if best is None or rtt < best[2]:
                    mid = (t1 + t2) // 2
                    best = (m0 - mid, r0 - (mid + rt_minus_mono), (rtt + 1) // 2)
            mine = best
    by_rep = comm.allgather(mine if rank in reps.values() else None)
    return [by_rep[reps[b]] for b in boots]


class Profile:
    """One profiling session of a context (collective to make: it times
    the clocks). ``records``: ring size per rank."""

    def __init__(self, ctx, records=None, trace=None):
        self.ctx = ctx
        topo = ctx.topo
        self.records_cap = ctx.config.profile_records if records is None else int(records)
        self.trace_path = trace
        self.state = recorder.new_state(topo.size, self.records_cap)
        self.offsets = clock_offsets(self._meet("starting a profile (clock offsets)"))
        self._prev = 0
        self.active = False
        c = ctx.ctl[0]
        mono_off, rt_off, _ = self.offsets[topo.rank]
        peer = int(c["rail_peer"])
        # peer realtime - my realtime = my offset to rank 0 - the peer's
        c["prof_rt_skew_ns"] = rt_off - self.offsets[peer][1] if peer >= 0 else 0
        c["prof_rt_mono_ns"] = time.time_ns() - _mono()

    # -- switching ------------------------------------------------------------

    def start(self):
        """Record every collective of the context from now on."""
        c = self.ctx.ctl[0]
        self._prev = int(c["profile"])
        c["profile"] = self.state.ctypes.data
        self.active = True
        return self

    def stop(self):
        """Stop recording (the previous session, if any, records again)."""
        if self.active:
            self.ctx.ctl[0]["profile"] = self._prev
            self.active = False

    def __enter__(self):
        return self if self.active else self.start()

    def __exit__(self, *exc):
        self.stop()
        if self.trace_path and exc[0] is None:
            self.write_trace(self.trace_path)

    # -- this rank's figures ----------------------------------------------------

    def local(self):
        """This rank's aggregates (no communication)."""
        st = self.state
        lay = recorder.layout(int(st[recorder.H_SIZE]), self.records_cap)
        size = int(st[recorder.H_SIZE])
        coll = st[lay["coll"]:lay["coll"] + 2 * recorder.NCOLL].reshape(-1, 2)
        names = {kind.COLL_ALLREDUCE: "allreduce", kind.COLL_ALLGATHER: "allgather"}
        return {
            "rank": self.ctx.topo.rank,
            "calls": int(st[recorder.H_CALLS]),
            "bytes": int(st[recorder.H_BYTES]),
            "wait_ns": int(st[recorder.H_WAIT_NS]),
            "own_ns": int(st[recorder.H_OWN_NS]),
            "total_ns": int(st[recorder.H_TOTAL_NS]),
            "straggled": int(st[recorder.H_STRAGGLED]),
            "last_count": st[lay["count"]:lay["count"] + size].copy(),
            "last_delay_ns": st[lay["delay"]:lay["delay"] + size].copy(),
            "hist": st[lay["hist"]:lay["hist"] + recorder.NBUCKETS].copy(),
            "collectives": {names.get(k, f"coll{k}"): (int(coll[k, 0]), int(coll[k, 1]))
                            for k in range(recorder.NCOLL) if coll[k, 0]},
        }

    def records(self):
        """This rank's ring, oldest first: a structured array with the fields
        of recorder.REC_FIELDS, times on rank 0's monotonic clock."""
        st = self.state
        cap = self.records_cap
        written = int(st[recorder.H_WRITTEN])
        ring_at = recorder.layout(int(st[recorder.H_SIZE]), cap)["ring"]
        ring = st[ring_at:ring_at + cap * recorder.REC_WORDS].reshape(cap, recorder.REC_WORDS)
        n = min(written, cap)
        order = (np.arange(written - n, written) % cap) if cap else np.arange(0)
        rows = ring[order].copy()
        off = self.offsets[self.ctx.topo.rank][0]
        for f in (recorder.R_ENTER, recorder.R_FIRST, recorder.R_LAST, recorder.R_EXIT):
            rows[:, f] = np.where(rows[:, f] != 0, rows[:, f] + off, 0)
        dt = np.dtype([(name, np.int64) for name, _ in recorder.REC_FIELDS])
        return rows.view(dt).reshape(-1)

    # -- collective views -------------------------------------------------------

    def _meet(self, what):
        """The communicator a profile's own exchanges run on (the context's
        private duplicate: never the user's, where they could meet the
        user's collectives), once every rank has come to ``what`` (a polled
        meeting under the context's deadline; the blocking exchanges that
        follow then complete: a rank that never comes is a timeout on every
        rank that did, not a hang)."""
        comm = self.ctx.setup_comm or self.ctx.comm
        arrive(comm, self.ctx.config.timeout_s, what)
        return comm

    def stats(self):
        """Figures of every rank (collective over the context's communicator;
        every rank gets the same dict). ``calls``: collectives recorded (as
        rank 0 counts them; ``calls_by_rank`` for each); ``last_arrival_count``
        and ``last_arrival_delay_s``: rank -> how often it arrived last, and
        the summed time from the first rank's arrival to its own then, as
        rank 0 saw them: heard by the collective itself where it hears every
        rank (one node; two equal nodes over tcp), else merged from the
        ranks' records (``last_arrival_in_band`` / ``_from_records`` /
        ``_unattributed`` count the calls of each kind); ``wait_s`` /
        ``own_s``: summed over ranks."""
        every = self._meet("profile stats").allgather((self.local(), self._arrivals()))
        return _merge([p for p, _ in every], self.ctx, self.offsets, [a for _, a in every])

    def _arrivals(self):
        """(calls written, entry times on rank 0's clock, arrivals heard) of
        this rank's ring: what the ranks' records say about arrivals the
        collective itself did not hear (see merged_arrivals)."""
        rec = self.records()
        return (int(self.state[recorder.H_WRITTEN]), rec["enter_ns"].copy(),
                rec["arrivals"].copy())

    def own_by_size(self):
        """This context's rank 0 own time per call by size, [bytes, calls,
        median, p90 (us)], with last arrivals merged from every rank's
        records where its path heard its own node only (a wait for another
        node is not own time). Collective; None on the other ranks."""
        every = self._gather_rings("the profile's own times")
        if every is None:
            return None
        every.sort(key=lambda e: e[0])
        _, last = last_arrivals(every, self.ctx.topo.size)[0]
        return own_by_size(every[0][2], last)

    def _gather_rings(self, what):
        """Every rank's (rank, node index, records, calls written), gathered
        to this context's rank 0 (collective; None on the other ranks)."""
        comm = self._meet(what)
        mine = (self.ctx.topo.rank, self.ctx.topo.node_index, self.records(),
                int(self.state[recorder.H_WRITTEN]))
        every = comm.gather(mine, root=0)
        return every if comm.Get_rank() == 0 else None

    def summary(self):
        """The stats as a table (collective)."""
        return format_summary(self.stats())

    def write_trace(self, path):
        """Chrome trace / Perfetto JSON of every rank's ring, merged by rank 0
        (collective; one track per rank). Returns the path on rank 0."""
        every = self._gather_rings("writing the profile's trace")
        if every is None:
            return None
        with open(path, "w") as f:
            json.dump(trace_events(every, self.ctx), f)
        return path


def merged_arrivals(rings, size):
    """Last arrivals from the ranks' records, for the collectives whose
    path did not hear every rank (the mpi transport, more than two nodes,
    uneven nodes, forced algorithms: each rank hears its own node only).

    ``rings``: per rank, (calls written, entry times on one clock, arrivals
    heard) of its ring, oldest first. Every rank records every collective of
    the context in the same order, so the i-th call of one rank is the i-th
    of every other: the calls all rings still hold are aligned by number.
    Returns (first call number, mask of the calls to attribute here: rank
    0 did not hear every rank in them, and every entry time is known; last
    rank, first and last entry time per aligned call), or None."""
    if size < 2 or len(rings) != size:
        return None
    start = max(w - len(e) for w, e, _ in rings)
    end = min(w for w, _, _ in rings)
    if end <= start:
        return None
    enters = np.stack([e[start - (w - len(e)):end - (w - len(e))] for w, e, _ in rings])
    heard = np.stack([a[start - (w - len(e)):end - (w - len(e))] for w, e, a in rings])
    # a call in which rank 0 heard every rank is in its in-band count
    # (recorder.record; the stats take rank 0's view): leave it there
    todo = (heard[0] < size) & (enters > 0).all(axis=0)
    return (start, todo, enters.argmax(axis=0), enters.min(axis=0), enters.max(axis=0))


def _merge(parts, ctx, offsets, rings=None):
    topo = ctx.topo
    size = topo.size
    # rank 0's view: across nodes each rank places the peer node's arrival
    # by its own clocks, so two ranks may name different ranks last in a
    # close call; one view counts every call once
    count = parts[0]["last_count"].copy()
    delay = parts[0]["last_delay_ns"].copy()
    attributed = parts[0]["straggled"]
    merged = merged_arrivals(rings, size) if rings is not None else None
    from_records = 0
    if merged is not None:
        _, todo, who, first, last = merged
        from_records = int(todo.sum())
        if from_records:
            count = count + np.bincount(who[todo], minlength=size)
            delay = delay + np.bincount(who[todo], weights=(last - first)[todo],
                                        minlength=size).astype(np.int64)
    unattributed = max(0, parts[0]["calls"] - attributed - from_records) if size > 1 else 0
    hist = np.sum([p["hist"] for p in parts], axis=0)
    node_of = {r: g for g, ranks in enumerate(topo.node_ranks) for r in ranks}
    rail_of = {r: lr for ranks in topo.node_ranks for lr, r in enumerate(ranks)}
    per_node, per_rail = {}, {}
    for r in range(size):
        for table, key in ((per_node, node_of[r]), (per_rail, rail_of[r])):
            n, d = table.get(key, (0, 0.0))
            table[key] = (n + int(count[r]), d + delay[r] / 1e9)
    colls = {}
    for name, (n, nb) in parts[0]["collectives"].items():
        colls[name] = {"calls": n, "bytes": nb}
    return {
        "ranks": size,
        "nodes": topo.node_count,
        "calls": parts[0]["calls"],
        "calls_by_rank": [p["calls"] for p in parts],
        "bytes": parts[0]["bytes"],
        "collectives": colls,
        "p50_s": _quantile(hist, 0.5),
        "p99_s": _quantile(hist, 0.99),
        "p50_s_by_rank": [_quantile(p["hist"], 0.5) for p in parts],
        "p99_s_by_rank": [_quantile(p["hist"], 0.99) for p in parts],
        "total_s_by_rank": [p["total_ns"] / 1e9 for p in parts],
        "wait_s_by_rank": [p["wait_ns"] / 1e9 for p in parts],
        "own_s_by_rank": [p["own_ns"] / 1e9 for p in parts],
        "wait_s": sum(p["wait_ns"] for p in parts) / 1e9,
        "own_s": sum(p["own_ns"] for p in parts) / 1e9,
        "last_arrival_count": {r: int(count[r]) for r in range(size)},
        "last_arrival_delay_s": {r: float(delay[r]) / 1e9 for r in range(size)},
        "last_arrival_by_node": {g: v[0] for g, v in sorted(per_node.items())},
        "last_arrival_by_rail": {lr: v[0] for lr, v in sorted(per_rail.items())},
        "clock_bound_s": max(o[2] for o in offsets) / 1e9,
        # how the last arrivals were found: heard by the collective itself
        # (every call, aggregated), or merged from the ranks' records after
        # the fact (the calls still in every ring), or neither (older calls
        # of a path that hears its own node only)
        "last_arrival_in_band": int(attributed),
        "last_arrival_from_records": from_records,
        "last_arrival_unattributed": unattributed,
    }


def _quantile(hist, q):
    total = int(np.sum(hist))
    if total == 0:
        return 0.0
    b = int(np.searchsorted(np.cumsum(hist), q * total))
    return recorder.bucket_value_ns(b) / 1e9


def format_summary(s):
    """The text of :meth:`Profile.summary` from a stats dict."""
    us = 1e6
    lines = [f"# harmpi profile: {s['ranks']} ranks on {s['nodes']} node(s), "
             f"{s['calls']} collectives per rank; clocks within {s['clock_bound_s'] * us:.1f} us"]
    lines.append(f"{'collective':<12}{'calls':>9}{'bytes':>14}{'p50 us':>10}{'p99 us':>10}")
    for name, c in s["collectives"].items():
        lines.append(f"{name:<12}{c['calls']:>9}{c['bytes']:>14}"
                     f"{s['p50_s'] * us:>10.1f}{s['p99_s'] * us:>10.1f}")
    lines.append(f"{'rank':<6}{'calls':>8}{'mean us':>9}{'wait us':>9}{'own us':>9}"
                 f"{'wait %':>8}{'p99 us':>9}{'last':>7}{'late by ms':>11}")
    for r in range(s["ranks"]):
        n = max(1, s["calls_by_rank"][r])
        tot = s["total_s_by_rank"][r]
        wait = s["wait_s_by_rank"][r]
        own = s["own_s_by_rank"][r]
        lines.append(f"{r:<6}{s['calls_by_rank'][r]:>8}{tot / n * us:>9.1f}{wait / n * us:>9.1f}"
                     f"{own / n * us:>9.1f}{100 * wait / tot if tot else 0:>8.1f}"
                     f"{s['p99_s_by_rank'][r] * us:>9.1f}{s['last_arrival_count'][r]:>7}"
                     f"{s['last_arrival_delay_s'][r] * 1e3:>11.3f}")
    if s["nodes"] > 1:
        lines.append("last arrivals by node: " + ", ".join(
            f"{g}: {n}" for g, n in s["last_arrival_by_node"].items()))
        lines.append("last arrivals by rail: " + ", ".join(
            f"{lr}: {n}" for lr, n in s["last_arrival_by_rail"].items()))
    if s.get("last_arrival_from_records"):
        lines.append(f"last arrivals of {s['last_arrival_from_records']} collectives merged "
                     "from the ranks' records (their path hears its own node's arrivals only; "
                     "wait/own there count from the node's last arrival)")
    if s.get("last_arrival_unattributed"):
        lines.append(f"{s['last_arrival_unattributed']} older collectives left the record "
                     "ring unattributed (HARMPI_PROFILE_RECORDS keeps more)")
    lines.append("wait: from entry to the last rank's arrival; own: from then to exit; "
                 "last: collectives where the rank arrived last; late by: summed time from "
                 "the first rank's arrival to its own then")
    return "\n".join(_fit(lines))


#: the summary's width: longer prose lines wrap (the tables are narrower)
SUMMARY_WIDTH = 100


def _fit(lines, width=SUMMARY_WIDTH):
    """Wrap lines longer than ``width`` at spaces, continuations indented."""
    import textwrap  # noqa: PLC0415 - only the printed summary needs it

    out = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
            continue
        lead = "#   " if line.startswith("#") else "    "
        out += textwrap.wrap(line, width, subsequent_indent=lead, break_long_words=False,
                             break_on_hyphens=False)
    return out


def _describe_code(code):
    f = kind.decode(code) or {}
    coll = {kind.COLL_ALLREDUCE: "allreduce", kind.COLL_ALLGATHER: "allgather"}.get(
        f.get("coll"), "collective")
    fmt = f.get("fmt", 0)
    dtype = dtypes.FORMATS[fmt].name if 0 <= fmt < len(dtypes.FORMATS) else "?"
    algo = ALGORITHM_NAMES.get(f.get("algo", 0), "?") if coll == "allreduce" else "allgather"
    return coll, dtype, algo


def last_arrivals(every, size):
    """Per entry of ``every`` = [(rank, node, records[, calls written]),
    ...]: (last rank, last arrival time) arrays of its records, as the call
    heard them, or, where its path heard its own node only and every ring
    still holds the call, merged from the ranks' records (merged_arrivals).
    A call that heard no other rank has its own entry as last arrival time."""
    merged = None
    if every and all(len(e) > 3 for e in every):
        merged = merged_arrivals([(e[3], e[2]["enter_ns"], e[2]["arrivals"]) for e in every],
                                 size)
    out = []
    for entry in every:
        rec = entry[2]
        enter = rec["enter_ns"].astype(np.int64)
        heard = rec["arrivals"] >= 2
        last = np.where(heard, rec["last_ns"].astype(np.int64), enter)
        who = rec["last_rank"].astype(np.int64)
        if merged is not None:
            start, todo, m_who, _, m_last = merged
            first_call = entry[3] - len(rec)
            for j in np.flatnonzero(todo):
                i = start + int(j) - first_call
                who[i], last[i] = int(m_who[j]), int(m_last[j])
        out.append((who, last))
    return out


def own_by_size(rec, last):
    """[bytes, calls, median, p90 (us)] of one rank's own time per call
    (exit - max(last arrival, entry)), by size, from its records and
    their last arrivals (see last_arrivals)."""
    enter = rec["enter_ns"].astype(np.int64)
    own = (rec["exit_ns"].astype(np.int64) - np.maximum(last, enter)) / 1e3
    rows = []
    for nbytes in sorted(set(rec["nbytes"].tolist())):
        o = own[rec["nbytes"] == nbytes]
        rows.append([int(nbytes), len(o), float(np.median(o)), float(np.percentile(o, 90))])
    return rows


def trace_events(every, ctx):
    """The Chrome trace dict of ``every`` = [(rank, node, records[, calls
    written]), ...]: one track (pid) per rank; per collective an event for
    the whole call and one for its wait for the last arrival (with the
    calls written, collectives whose path heard its own node only get their
    last arrival from the merged records: see merged_arrivals)."""
    every = sorted(every, key=lambda e: e[0])
    starts = [int(e[2]["enter_ns"][0]) for e in every if len(e[2])]
    t0 = min(starts) if starts else 0
    transport = ctx.rail_transport()
    events = []
    for entry, (who, lasts) in zip(every, last_arrivals(every, ctx.topo.size)):
        rank, node, rec = entry[:3]
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank} (node {node})"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        for i, row in enumerate(rec):
            enter, exit_ = int(row["enter_ns"]), int(row["exit_ns"])
            last, last_rank = int(lasts[i]), int(who[i])
            coll, dtype, algo = _describe_code(int(row["code"]))
            args = {"bytes": int(row["nbytes"]), "dtype": dtype, "algorithm": algo,
                    "transport": transport.name if transport else "none",
                    "last_rank": last_rank,
                    "wait_us": max(0, last - enter) / 1e3,
                    "own_us": (exit_ - max(last, enter)) / 1e3}
            events.append({"name": coll, "ph": "X", "pid": rank, "tid": 0,
                           "ts": (enter - t0) / 1e3, "dur": (exit_ - enter) / 1e3, "args": args})
            if last > enter:
                events.append({"name": f"wait for rank {last_rank}", "ph": "X",
                               "pid": rank, "tid": 0, "ts": (enter - t0) / 1e3,
                               "dur": (min(last, exit_) - enter) / 1e3,
                               "args": {}})
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"harmpi": "profile", "ranks": ctx.topo.size,
                          "nodes": ctx.topo.node_count, "clock": "rank 0 CLOCK_MONOTONIC"}}


def finish(prof):
    """At finalize of a context profiled from HARMPI_PROFILE/HARMPI_TRACE
    (collective): write the trace, and rank 0 prints the summary."""
    prof.stop()
    if prof.trace_path:
        prof.write_trace(prof.trace_path)
    text = prof.summary()
    if prof.ctx.comm.Get_rank() == 0 and prof.ctx.config.profile:
        # a warning-level record: shown on stderr even where the program set
        # up no logging (Python's last-resort handler), routable where it did
        log.warning("harmpi profile (HARMPI_PROFILE=1):\n%s", text)

