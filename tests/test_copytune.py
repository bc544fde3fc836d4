"""Streaming copies into shared slots, and the tuner that picks them (no MPI)."""

import numba
import numpy as np
import pytest
from support.arena import FakeArena

from harmpi import Config, node
from harmpi.base import control, copytune
from harmpi.base.dtypes import F32
from harmpi.errors import HarmpiArgumentError


def _control(arena, stream_stores="auto"):
    ctl = control.new()
    state = np.zeros(copytune.STATE_WORDS, np.int64)
    node.init_control(ctl, arena, 10, 1.0, 0, 1 << 40, stream_stores, tune_state=state)
    return ctl, state


@numba.njit
def _stream(dst, dst_off, src, src_off, nbytes):
    node.stream_copy(dst.ctypes.data + dst_off, src.ctypes.data + src_off, nbytes)


@pytest.mark.parametrize("nbytes", [0, 1, 63, 64, 65, 127, 128, 1000, 1024, 1025, 4103])
@pytest.mark.parametrize("dst_off, src_off", [(0, 0), (1, 0), (0, 3), (7, 61), (63, 1)])
def test_stream_copy_copies_exactly_the_range(nbytes, dst_off, src_off):
    rng = np.random.default_rng(nbytes)
    src = rng.integers(0, 256, nbytes + 128, dtype=np.uint8)
    dst = np.full(nbytes + 128, 0xAB, np.uint8)
    _stream(dst, dst_off, src, src_off, nbytes)
    assert np.array_equal(dst[dst_off:dst_off + nbytes], src[src_off:src_off + nbytes])
    assert np.all(dst[:dst_off] == 0xAB) and np.all(dst[dst_off + nbytes:] == 0xAB)


@pytest.mark.parametrize("setting, mode, tuning",
                         [("on", copytune.MODE_STREAM, 0), ("off", copytune.MODE_PLAIN, 0),
                          ("flush", copytune.MODE_FLUSH, 0), ("auto", copytune.MODE_PLAIN, 0)])
def test_ctl_copy_mode_from_config(setting, mode, tuning):
    # one rank alone never tunes (nobody reads its slot)
    ctl, _ = _control(FakeArena(), setting)
    assert ctl[0]["mode"] == mode and ctl[0]["tuning"] == tuning


@pytest.mark.parametrize("mode", [copytune.MODE_STREAM, copytune.MODE_PLAIN, copytune.MODE_FLUSH])
def test_single_rank_allreduce_in_either_mode(mode):
    arena = FakeArena()
    ctl, _ = _control(arena)
    ctl[0]["mode"] = mode
    w = np.empty(0, np.float32)
    x = np.arange(3001, dtype=np.float32)       # 12004 bytes: three chunks
    assert node.shm_allreduce(ctl, x.ctypes.data, x.size, 3, F32, 1 << 40, w) == control.OK
    assert np.array_equal(x, np.arange(3001, dtype=np.float32))


def test_stream_stores_setting_is_validated():
    assert Config.from_env({"HARMPI_STREAM_STORES": " Off "}).stream_stores == "off"
    assert Config.from_env({}).stream_stores == "auto"
    assert Config.from_env({"HARMPI_STREAM_STORES": "flush"}).stream_stores == "flush"
    with pytest.raises(HarmpiArgumentError, match="HARMPI_STREAM_STORES"):
        Config.from_env({"HARMPI_STREAM_STORES": "sometimes"})


def test_buckets_are_bit_lengths():
    assert [copytune.bucket_of(v) for v in (0, 1, 2, 3, 1024, 10240, 1 << 62)] == \
        [0, 1, 2, 2, 11, 14, 63]


def _tuner(mode=copytune.MODE_STREAM):
    state = np.zeros(copytune.STATE_WORDS, np.int64)
    table = np.zeros(copytune.NBUCKETS, np.int64)
    copytune.init_state(state, table, mode)
    return state, table


def _run(state, table, nbytes, calls, ticks_of_mode):
    """Drive the leader's choose/record for ``calls`` calls; return the modes used."""
    used = []
    for _ in range(calls):
        mode = copytune.choose(state, table.ctypes.data, True, True, nbytes)
        assert table[copytune.bucket_of(nbytes)] == mode       # published for the others
        used.append(mode)
        copytune.record(state, nbytes, ticks_of_mode[mode])
    return used


def test_tuner_probes_each_other_mode_in_turn_and_switches_to_the_fastest():
    state, table = _tuner(copytune.MODE_STREAM)
    phase = copytune.SKIP + copytune.PROBE
    cycle = copytune.CYCLE_MIN
    ticks = {copytune.MODE_PLAIN: 100, copytune.MODE_STREAM: 200, copytune.MODE_FLUSH: 300}
    # cycle 1: probe flush (slower than streaming): keep streaming
    used = _run(state, table, 10240, cycle, ticks)
    assert used[:phase] == [copytune.MODE_FLUSH] * phase
    assert set(used[phase:]) == {copytune.MODE_STREAM}
    # cycle 2: probe plain (faster): switch to plain, for this size only
    used = _run(state, table, 10240, cycle, ticks)
    assert used[:phase] == [copytune.MODE_PLAIN] * phase
    assert used[phase:2 * phase] == [copytune.MODE_STREAM] * phase
    assert set(used[2 * phase:]) == {copytune.MODE_PLAIN}
    assert copytune.choose(state, table.ctypes.data, False, True, 1 << 20) == copytune.MODE_STREAM
    # from plain, both others lose in turn, and probes get rarer
    used = _run(state, table, 10240, 16 * cycle, ticks)
    starts = [i for i in range(len(used)) if used[i] != copytune.MODE_PLAIN
              and (i == 0 or used[i - 1] == copytune.MODE_PLAIN)]
    assert [used[i] for i in starts[:2]] == [copytune.MODE_STREAM, copytune.MODE_FLUSH]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= 4 * gaps[0], gaps
    assert all(used[i:i + phase] == [used[i]] * phase for i in starts)


def test_tuner_keeps_its_mode_within_noise():
    state, table = _tuner(copytune.MODE_PLAIN)
    phase = copytune.SKIP + copytune.PROBE
    close = {copytune.MODE_PLAIN: 100, copytune.MODE_STREAM: 95, copytune.MODE_FLUSH: 96}
    # 5% is not enough: every probe loses, plain stays
    used = _run(state, table, 4096, 8 * copytune.CYCLE_MIN, close)
    probes = len(used) - used.count(copytune.MODE_PLAIN)
    assert probes > 0 and probes % phase == 0
    assert copytune.choose(state, table.ctypes.data, True, True, 4096) == copytune.MODE_PLAIN
    assert used[-copytune.CYCLE_MIN:].count(copytune.MODE_PLAIN) >= copytune.CYCLE_MIN - phase


def test_followers_read_the_leaders_table():
    state, table = _tuner(copytune.MODE_STREAM)
    table[copytune.bucket_of(5000)] = copytune.MODE_PLAIN
    assert copytune.choose(state, table.ctypes.data, False, True, 5000) == copytune.MODE_PLAIN
    assert copytune.choose(state, table.ctypes.data, True, False, 5000) == copytune.MODE_PLAIN
