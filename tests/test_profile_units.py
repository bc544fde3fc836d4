"""harmpi.record.recorder / harmpi.record.breakdown / harmpi.report without MPI peers: the
compiled record against plain arithmetic, histogram buckets, the ring's
bound, the summary text, the trace and the PNG."""

import json
import types

from harmpi.base import control, kind
from harmpi.cli import report
from harmpi.config import Config
from harmpi.record import breakdown as hprofile
from harmpi.record import recorder


def test_config_fields():
    c = Config.from_env({"HARMPI_PROFILE": "1", "HARMPI_PROFILE_RECORDS": "100",
                         "HARMPI_TRACE": "/tmp/x.json"})
    assert (c.profile, c.profile_records, c.trace) == (True, 100, "/tmp/x.json")
    d = Config.from_env({})
    assert (d.profile, d.profile_records, d.trace) == (False, 16384, None)


def test_buckets_monotonic_and_close():
    values = [1, 2, 3, 7, 8, 9, 100, 1000, 12345, 10**6, 3 * 10**9]
    buckets = [recorder.bucket_of(v) for v in values]
    assert buckets == sorted(buckets)
    for v, b in zip(values[3:], buckets[3:]):
        mid = recorder.bucket_value_ns(b)
        assert abs(mid - v) / v < 0.1, (v, mid)


def _control(state, enter, first, last, who, arrivals, nbytes=10240, code=None):
    ctl = control.new()
    c = ctl[0]
    c["profile"] = state.ctypes.data
    c["prof_enter_ns"] = enter
    c["prof_first_ns"] = first
    c["prof_last_ns"] = last
    c["prof_last_rank"] = who
    c["prof_arrivals"] = arrivals
    c["prof_nbytes"] = nbytes
    c["prof_code"] = kind.encode(op=kind.OP_SUM, coll=kind.COLL_ALLREDUCE) if code is None \
        else code
    return ctl


def test_record_aggregates_and_ring_bound():
    st = recorder.new_state(3, 4)
    words = st.size
    base = 10**12
    for i in range(10):
        recorder.record(_control(st, base + i, base + i - 5, base + i + 100, i % 3, 3))
    assert st.size == words
    assert st[recorder.H_CALLS] == 10 and st[recorder.H_WRITTEN] == 10
    assert st[recorder.H_BYTES] == 10 * 10240
    assert st[recorder.H_WAIT_NS] == 10 * 100
    lay = recorder.layout(3, 4)
    assert list(st[lay["count"]:lay["count"] + 3]) == [4, 3, 3]
    assert list(st[lay["delay"]:lay["delay"] + 3]) == [4 * 105, 3 * 105, 3 * 105]
    assert st[lay["hist"]:lay["hist"] + recorder.NBUCKETS].sum() == 10
    ring = st[lay["ring"]:].reshape(4, recorder.REC_WORDS)
    # the last four records, in ring order (record 8 and 9 wrapped to rows 0 and 1)
    assert sorted(ring[:, recorder.R_ENTER] - base) == [6, 7, 8, 9]


def test_record_alone_waits_nothing():
    st = recorder.new_state(1, 2)
    recorder.record(_control(st, 10**12, 0, 0, -1, 0))
    assert st[recorder.H_WAIT_NS] == 0
    assert st[recorder.H_STRAGGLED] == 0


def _fake_ctx():
    topo = types.SimpleNamespace(size=2, node_count=1, rank=0, node_ranks=((0, 1),))
    return types.SimpleNamespace(topo=topo, rail_transport=lambda: None)


def _stats():
    parts = []
    for r in range(2):
        st = recorder.new_state(2, 8)
        for i in range(5):
            recorder.record(_control(st, 10**12 + 1000 * i, 10**12, 10**12 + 500, 1, 2))
        p = hprofile.Profile.__new__(hprofile.Profile)
        p.state, p.records_cap = st, 8
        p.ctx = types.SimpleNamespace(topo=types.SimpleNamespace(rank=r))
        parts.append(p.local())
    return hprofile._merge(parts, _fake_ctx(), [(0, 0, 0), (0, 0, 0)])


def test_merge_and_summary():
    s = _stats()
    assert s["calls"] == 5 and s["last_arrival_count"] == {0: 0, 1: 5}
    assert abs(s["last_arrival_delay_s"][1] - 5 * 500e-9) < 1e-12
    assert s["collectives"]["allreduce"]["calls"] == 5
    text = hprofile.format_summary(s)
    assert "allreduce" in text and "rank" in text


def test_trace_and_png(tmp_path):
    st = recorder.new_state(2, 8)
    for i in range(5):
        recorder.record(_control(st, 10**12 + 10**5 * i, 10**12 + 10**5 * i,
                                10**12 + 10**5 * i + 300, 1, 2))
    p = hprofile.Profile.__new__(hprofile.Profile)
    p.state, p.records_cap, p.offsets = st, 8, [(0, 0, 0), (0, 0, 0)]
    p.ctx = _fake_ctx()
    rec = p.records()
    assert len(rec) == 5 and list(rec["last_rank"]) == [1] * 5
    doc = hprofile.trace_events([(0, 0, rec), (1, 0, rec)], _fake_ctx())
    json.dumps(doc)
    assert {e["pid"] for e in doc["traceEvents"]} == {0, 1}
    out = report.draw(doc, str(tmp_path / "t.png"), count=3)
    assert (tmp_path / "t.png").stat().st_size > 1000 and out.endswith(".png")


def test_merged_arrivals_align_calls_and_skip_heard_ones():
    """Rings of different lengths are aligned by call number; calls rank 0
    heard in band are left to its in-band count."""
    import numpy as np  # noqa: PLC0415

    size = 3
    # call k: rank (k % 3) enters last, 10*k ns after the first
    enters = {r: np.array([1000 * k + (10 * k if k % 3 == r else 0) for k in range(10)])
              for r in range(size)}
    heard = {r: np.full(10, 2) for r in range(size)}
    heard[0][9] = 3  # call 9: rank 0 heard every rank (its in-band count has it)
    heard[1][8] = 3  # another rank's view does not count
    # rank 0 keeps its last 6 calls, the others their last 8
    rings = [(10, enters[0][4:], heard[0][4:]), (10, enters[1][2:], heard[1][2:]),
             (10, enters[2][2:], heard[2][2:])]
    start, todo, who, first, last = hprofile.merged_arrivals(rings, size)
    assert start == 4 and len(todo) == 6
    assert list(todo) == [True] * 5 + [False]
    assert list(who[:5]) == [k % 3 for k in range(4, 9)]
    assert list((last - first)[:5]) == [10 * k for k in range(4, 9)]
    assert hprofile.merged_arrivals(rings[:2], size) is None
    assert hprofile.merged_arrivals([(5, enters[0][:0], heard[0][:0])] * 3, size) is None


def _two_node_records(arrivals_heard):
    """Two ranks, one per node, 4 allreduces of 2 KB and 2 allgathers of
    4 KB: rank 1 enters 300 ns after rank 0 and both leave 400 ns after
    rank 1's entry; each record heard ``arrivals_heard`` ranks (1: its own
    node only, so its last arrival is its own entry)."""
    gather = kind.encode(op=kind.OP_SUM, coll=kind.COLL_ALLGATHER)
    every = []
    for r in range(2):
        st = recorder.new_state(2, 8)
        for i in range(6):
            t0 = 10**12 + 10**5 * i
            mine = t0 + 300 * r
            last = t0 + 300 if arrivals_heard == 2 else mine
            recorder.record(_control(st, mine, t0, last, 1 if arrivals_heard == 2 else r,
                                     arrivals_heard, nbytes=2048 if i < 4 else 4096,
                                     code=None if i < 4 else gather))
            # (record reads exit from the clock; give every call the same exit)
            ring_at = recorder.layout(2, 8)["ring"]
            st[ring_at + i * recorder.REC_WORDS + recorder.R_EXIT] = t0 + 700
        p = hprofile.Profile.__new__(hprofile.Profile)
        p.state, p.records_cap, p.offsets = st, 8, [(0, 0, 0), (0, 0, 0)]
        p.ctx = _fake_ctx()
        every.append((r, r, p.records(), 6))
    return every


def test_own_time_per_size_counts_a_wait_for_the_other_node_as_waiting():
    """A path that hears its own node only (arrivals 1): rank 0's records
    alone would count the 300 ns it waited for rank 1 as its own time; the
    last arrival merged from both rings leaves 400 ns own per call, as a
    path that heard rank 1 in band says."""
    for heard in (1, 2):
        every = _two_node_records(heard)
        who, last = hprofile.last_arrivals(every, 2)[0]
        assert list(who) == [1] * 6, (heard, who)
        rows = hprofile.own_by_size(every[0][2], last)
        assert [(nb, n) for nb, n, _, _ in rows] == [(2048, 4), (4096, 2)]
        assert all(abs(med - 0.4) < 1e-9 and abs(p90 - 0.4) < 1e-9 for _, _, med, p90 in rows), \
            (heard, rows)
