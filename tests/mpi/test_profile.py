"""harmpi.profile under mpirun: the last arrival is named, counts match the
calls, the trace is a valid merged Chrome trace, results do not change,
memory stays bounded. Runs at any -np and with HARMPI_RANKS_PER_NODE."""

import json
import time

import numpy as np
import pytest
from conftest import torch
from mpi4py import MPI

import harmpi
from harmpi.record import recorder

#: injected lateness; large against this machine's scheduling noise
SLEEP_S = 0.1


def _x(rank, n=2560):
    return np.full(n, rank + 1, np.float32)


def test_sleeper_is_named_last(world, tmp_path_factory):
    """On every topology: in band where the collective hears every rank
    (one node; two equal nodes over tcp), merged from the ranks' records
    elsewhere (stats and trace)."""
    size, rank = world.Get_size(), world.Get_rank()
    if size < 2:
        pytest.skip("needs two ranks")
    info = harmpi.info()
    in_band = info["nodes"] == 1 or (info["nodes"] == 2 and info["transport"] == "tcp"
                                     and len(set(info["ranks_per_node"])) == 1)
    late = size - 1
    chosen = {3, 7, 11}
    x = _x(rank)
    harmpi.allreduce(x)
    with harmpi.profile() as p:
        for i in range(14):
            if i in chosen:
                world.Barrier()  # the others then enter at once, not after a deschedule
                if rank == late:
                    time.sleep(SLEEP_S)
            harmpi.allreduce(x)
    s = p.stats()
    rec = p.records()
    assert s["last_arrival_count"][late] >= len(chosen)
    assert s["last_arrival_delay_s"][late] >= 0.9 * SLEEP_S * len(chosen)
    assert s["last_arrival_unattributed"] == 0
    if in_band:
        assert s["last_arrival_in_band"] == 14 and s["last_arrival_from_records"] == 0
        for i in sorted(chosen):
            r = rec[i]
            assert r["last_rank"] == late, (i, r)
            delay = (r["last_ns"] - r["first_ns"]) / 1e9
            assert 0.9 * SLEEP_S <= delay <= SLEEP_S + 0.5, (i, delay)
            if rank != late:  # it waited for the sleeper at least that long
                assert (r["last_ns"] - r["enter_ns"]) / 1e9 >= 0.8 * SLEEP_S
    else:
        assert s["last_arrival_in_band"] == 0 and s["last_arrival_from_records"] == 14
        assert "merged from the ranks' records" in p.summary()
    _check_trace_names(world, p, tmp_path_factory, late, chosen)
    # rank 0's own time per call by size: the sleeper's 0.1 s is waiting,
    # on every topology (merged from the records where the path hears its
    # own node only), not own time
    own = p.own_by_size()
    if rank != 0:
        assert own is None
    else:
        assert [(nb, n) for nb, n, _, _ in own] == [(x.nbytes, 14)], own
        assert own[0][3] < 0.5 * SLEEP_S * 1e6, own  # p90 (us): no sleep in it


def _check_trace_names(world, p, tmp_path_factory, late, chosen):
    """Every other rank's trace shows the chosen calls waiting for ``late``."""
    rank = world.Get_rank()
    path = str(tmp_path_factory.mktemp("sleeper") / "trace.json") if rank == 0 else None
    path = world.bcast(path)
    p.write_trace(path)
    if rank == 0:
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        calls = [e for e in events if e["ph"] == "X" and e["name"] == "allreduce"
                 and e["pid"] != late]
        for pid in {e["pid"] for e in calls}:
            mine = [e for e in calls if e["pid"] == pid]
            for i in sorted(chosen):
                assert mine[i]["args"]["last_rank"] == late, (pid, i, mine[i])
                assert mine[i]["args"]["wait_us"] >= 0.5 * SLEEP_S * 1e6, (pid, i, mine[i])
    world.Barrier()


def test_counts_equal_calls(world):
    rank = world.Get_rank()
    x = _x(rank)
    with harmpi.profile() as p:
        for _ in range(25):
            harmpi.allreduce(x)
        for _ in range(5):
            harmpi.allgather(x)
    s = p.stats()
    assert s["calls"] == 30
    assert s["calls_by_rank"] == [30] * world.Get_size()
    assert s["collectives"]["allreduce"] == {"calls": 25, "bytes": 25 * x.nbytes}
    assert s["collectives"]["allgather"] == {"calls": 5, "bytes": 5 * x.nbytes}
    assert sum(s["last_arrival_count"].values()) <= 30
    text = p.summary()
    assert "allreduce" in text and str(30) in text


def test_torch_backend_is_recorded(world):
    """dist.all_reduce on a harmpi process group is one recorded collective
    of the world context (the group is made here when no test made it)."""
    dist = torch.distributed
    made = not dist.is_initialized()
    if made:
        harmpi.init(config=harmpi.Config.from_env())
        from harmpi import distributed  # noqa: F401, PLC0415 - backend "harmpi", mpi://

        dist.init_process_group("harmpi", init_method="mpi://")
    try:
        x = torch.ones(64)
        with harmpi.profile() as p:
            dist.all_reduce(x)
        assert torch.all(x == world.Get_size())
        s = p.stats()
        assert s["calls"] == 1
        assert s["collectives"]["allreduce"] == {"calls": 1, "bytes": x.nbytes}
    finally:
        if made:
            dist.destroy_process_group()


def test_trace_is_valid(world, tmp_path_factory):
    size, rank = world.Get_size(), world.Get_rank()
    x = _x(rank)
    path = world.bcast(str(tmp_path_factory.mktemp("trace") / "t.json") if rank == 0 else None)
    with harmpi.profile(trace=path):
        for _ in range(10):
            harmpi.allreduce(x)
    world.Barrier()
    if rank == 0:
        with open(path) as f:
            doc = json.load(f)
        events = doc["traceEvents"]
        tracks = {e["pid"] for e in events}
        assert tracks == set(range(size))
        for pid in tracks:
            calls = [e for e in events if e["pid"] == pid and e["name"] == "allreduce"]
            assert len(calls) == 10
            for a, b in zip(calls, calls[1:]):
                assert a["ts"] + a["dur"] <= b["ts"] + 1e-3
            assert all(e["dur"] >= 0 for e in calls)


def test_results_bitwise_identical(world):
    rank = world.Get_rank()
    rng = np.random.default_rng(rank)
    base = rng.standard_normal(5000).astype(np.float32)
    off = base.copy()
    harmpi.allreduce(off)
    on = base.copy()
    with harmpi.profile():
        harmpi.allreduce(on)
    assert off.tobytes() == on.tobytes()


def test_memory_bounded(world):
    """100,000 calls keep 64 records: on a one-rank communicator of every
    rank (the ring is per rank; 100k calls across 6 oversubscribed ranks
    took 36 s), and 3000 calls on the world, whose ring wraps many times."""
    x = np.zeros(1, np.float32)
    solo = MPI.COMM_SELF.Dup()  # its context lives until harmpi.finalize at exit
    for comm, calls in ((solo, 100_000), (world, 3000)):
        with harmpi.profile(comm, records=64) as p:
            before = p.state.nbytes
            for _ in range(calls):
                harmpi.allreduce(x, comm=comm)
        assert p.state.nbytes == before
        assert p.state.nbytes < 64 * recorder.REC_WORDS * 8 + 16384
        assert len(p.records()) == 64
        assert p.stats()["calls"] == calls


def test_clock_offsets_across_hosts_within_their_bound(world, monkeypatch):
    """Hosts simulated two ranks each (their own boot ids), host h's
    CLOCK_MONOTONIC 1000*h s ahead: every rank gets its host's offset to
    rank 0's clock within the bound it states (half the best round trip),
    and the ranks of a host share one estimate."""
    from harmpi.record import breakdown as hprofile

    rank = world.Get_rank()
    host = rank // 2
    skew = host * 1000 * 10**9
    real_mono = hprofile._mono
    monkeypatch.setattr(hprofile, "_machine", lambda: f"test-host-{host}")
    monkeypatch.setattr(hprofile, "_mono", lambda: real_mono() + skew)
    offsets = hprofile.clock_offsets(world)
    assert len(offsets) == world.Get_size()
    for r, (mono_off, rt_off, bound) in enumerate(offsets):
        h = r // 2
        if h == 0:
            assert (mono_off, rt_off, bound) == (0, 0, 0)
            continue
        assert 0 < bound < 10**9, (r, bound)
        # rank 0's clock minus this host's: -1000*h s, within the bound
        assert abs(mono_off + h * 1000 * 10**9) <= bound + 1000, (r, mono_off, bound)
        # realtime is one clock here: the estimate of its offset is ~0
        assert abs(rt_off) <= bound + 1000, (r, rt_off, bound)
        assert offsets[r] == offsets[2 * h], "a host's ranks share its estimate"


def test_a_rank_that_never_starts_the_profile_is_a_timeout_not_a_hang():
    """harmpi.profile's own exchanges (the clock offsets, stats, the trace)
    start with a polled meeting under the deadline: the ranks that came
    raise HarmpiTimeoutError instead of waiting in a blocking allgather for
    a rank that never does (issue 21's review). On a private communicator,
    given up afterwards (its stranded request stays with it)."""
    comm = MPI.COMM_WORLD
    if comm.size < 2:
        pytest.skip("needs a peer that stays away")
    c = comm.Dup()
    harmpi.init(c, config=harmpi.Config(timeout_s=1.0))
    if comm.rank != comm.size - 1:
        t0 = time.monotonic()
        with pytest.raises(harmpi.HarmpiTimeoutError, match="starting a profile"):
            harmpi.profile(c)
        assert time.monotonic() - t0 < 30
    comm.Barrier()
