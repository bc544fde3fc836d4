"""Unit tests without mpirun: config, flag waits, node steps on a private
arena, tags, topology and the arena in a singleton MPI process."""

import subprocess
import sys
import time

import numpy as np
import pytest
from support.arena import FakeArena

from harmpi import node
from harmpi.base import control, kind
from harmpi.base.control import MISMATCH, OK
from harmpi.base.dtypes import F32, F64
from harmpi.base.kind import MAX_TAG, POISON_TAG, rail_tag
from harmpi.base.sync import wait_flags_ge
from harmpi.config import ALGORITHMS, Config
from harmpi.errors import HarmpiArgumentError


def test_config_defaults_and_env():
    cfg = Config.from_env({})
    assert cfg == Config()
    cfg = Config.from_env({"HARMPI_TIMEOUT_S": "2.5", "HARMPI_SPIN_COUNT": "0",
                           "HARMPI_SLOT_BYTES": "4096", "HARMPI_ALGORITHM": "Leader",
                           "HARMPI_TRANSPORT": "mpi", "HARMPI_RANKS_PER_NODE": "2"})
    assert (cfg.timeout_s, cfg.spin_count, cfg.slot_nbytes) == (2.5, 0, 4096)
    assert (cfg.algorithm, cfg.transport, cfg.ranks_per_node) == ("leader", "mpi", 2)


@pytest.mark.parametrize("env, match", [
    ({"HARMPI_TIMEOUT_S": "soon"}, "HARMPI_TIMEOUT_S"),
    ({"HARMPI_TIMEOUT_S": "0"}, "must be a finite number of seconds > 0"),
    ({"HARMPI_SLOT_BYTES": "100"}, "multiple of 64"),
    ({"HARMPI_ALGORITHM": "butterfly"}, "unknown algorithm"),
    ({"HARMPI_TRANSPORT": "carrier-pigeon"}, "unknown transport"),
    ({"HARMPI_RANKS_PER_NODE": "0"}, "HARMPI_RANKS_PER_NODE"),
])
def test_config_rejects_bad_values(env, match):
    with pytest.raises(HarmpiArgumentError, match=match):
        Config.from_env(env)


def test_config_algorithm_names_are_the_algorithms():
    from harmpi.algorithms import ALGORITHM_IDS, ALLREDUCE
    assert tuple(ALGORITHMS) == tuple(ALLREDUCE)  # (the ids follow this order)
    # every id fits the kind word's algo field, and ids are distinct
    assert len(set(ALGORITHM_IDS.values())) == len(ALGORITHM_IDS)
    for i in ALGORITHM_IDS.values():
        assert kind.decode(kind.encode(algo=i))["algo"] == i


def test_wait_returns_when_all_flags_reached():
    flags = np.zeros(8 * 4, np.int64)
    flags[::8] = 7
    assert wait_flags_ge(flags.ctypes.data, 64, 4, 7, 10, 10 ** 9, 0, 0, 0) == -1


def test_wait_times_out_naming_the_late_flag():
    flags = np.zeros(8 * 3, np.int64)
    flags[::8] = 5
    flags[8] = 4                     # flag 1 is one step behind
    t0 = time.perf_counter()
    assert wait_flags_ge(flags.ctypes.data, 64, 3, 5, 10, 50_000_000, 0, 0, 0) == 1
    assert 0.04 < time.perf_counter() - t0 < 2.0


_TUNE_STATES = []  # kept alive while the control blocks point at them


def _control(arena, small_max_nbytes=1 << 40, stream_stores="auto"):
    from harmpi.base import copytune
    ctl = control.new()
    _TUNE_STATES.append(np.zeros(copytune.STATE_WORDS, np.int64))
    node.init_control(ctl, arena, 10, 1.0, 0, small_max_nbytes, stream_stores,
                      tune_state=_TUNE_STATES[-1])
    return ctl


@pytest.mark.parametrize("stream_stores", ["auto", "on", "off", "flush"])
def test_node_steps_single_rank_roundtrip(stream_stores):
    arena = FakeArena()
    ctl = _control(arena, stream_stores=stream_stores)
    w = np.empty(0, np.float32)
    x = np.arange(2500, dtype=np.float32)     # 10000 bytes: three 4 KiB chunks
    assert node.shm_allreduce(ctl, x.ctypes.data, x.size, 3, F32, 1 << 40, w) == OK
    assert np.array_equal(x, np.arange(2500, dtype=np.float32))
    assert ctl[0]["steps"] == 3 and ctl[0]["epoch"] == 3
    # a single rank never takes the reduce-scatter branch: one epoch per step
    assert node.shm_allreduce(ctl, x.ctypes.data, x.size, 3, F32, -1, w) == OK
    assert ctl[0]["steps"] == 6 and ctl[0]["epoch"] == 6
    assert np.array_equal(x, np.arange(2500, dtype=np.float32))


def test_one_node_entry_and_its_c_twin_run_the_same_step():
    """The entry a context calls and the cfunc the native module calls are
    one step: the same counters move, the same status comes back."""
    import ctypes
    arena = FakeArena()
    ctl = _control(arena)
    x = np.arange(100, dtype=np.float64)
    assert node.ONE_NODE_STEP(ctl, x.ctypes.data, x.size, F64) == OK
    cfunc = ctypes.CFUNCTYPE(ctypes.c_int64, *[ctypes.c_int64] * 4)(node.ONE_NODE_CFUNC)
    assert cfunc(ctl.ctypes.data, x.ctypes.data, x.size, F64) == OK
    assert ctl[0]["steps"] == 2 and np.array_equal(x, np.arange(100.0))


def test_poisoned_stage_fails_even_alone():
    arena = FakeArena()
    ctl = _control(arena)
    w = np.empty(0, np.float64)
    x = np.ones(4)
    assert node.stage(ctl, x.ctypes.data, 4, 32, kind.POISON, w) == MISMATCH


def test_control_block_fields_are_int64_words_in_order():
    names = [name for name, _ in control.FIELDS]
    assert len(set(names)) == len(names)
    assert [control.offset(n) for n in names] == [8 * i for i in range(len(names))]
    assert control.CONTROL.itemsize == 8 * len(names)


def test_add_into_and_part_bounds():
    a = np.arange(100, dtype=np.float64)
    b = np.ones(100)
    node.add_into(a.ctypes.data, b.ctypes.data, 100, F64, np.empty(0, np.float64))
    assert np.array_equal(a, np.arange(100) + 1)
    for m in (0, 1, 17, 1000, 4097):
        for L in (1, 2, 3, 4):
            parts = [node.part_bounds(m, L, j, 2) for j in range(L)]
            assert parts[0][0] == 0 and parts[-1][1] == m
            assert all(p[1] == q[0] for p, q in zip(parts, parts[1:]))
            assert all((lo * 2) % 64 == 0 for lo, hi in parts if hi > lo)


def test_tags_stay_in_mpi_range_and_differ():
    tags = {rail_tag(n, c) for n in range(0, 4000, 4) for c in (0, 1, 2, 3)}
    assert all(1 <= t <= MAX_TAG for t in tags) and POISON_TAG > MAX_TAG
    assert len(tags) > 3900
    # every field of the kind word reaches the tag, the high ones included
    base = kind.encode(fmt=1, op=1, coll=1)
    for name, shift, width in kind.FIELDS:
        other = base ^ (1 << (shift + width - 1))
        assert rail_tag(10240, other) != rail_tag(10240, base), name


def test_singleton_process_arena_and_topology(mpi_env):
    """Without mpirun MPI starts as a singleton: one node, one rank, no /dev/shm left."""
    code = ("import harmpi, numpy as np, torch\n"
            "x = torch.ones(10, dtype=torch.bfloat16); assert harmpi.allreduce(x) is x\n"
            "i = harmpi.info(); assert i['nodes'] == 1 and i['ranks'] == 1, i\n"
            "g = harmpi.allgather(np.arange(3.0)); assert g.tolist() == [0.0, 1.0, 2.0]\n"
            "harmpi.finalize(); print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], env=mpi_env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_mpi_progress_hook_calls_mpi_iprobe():
    from mpi4py import MPI

    from harmpi.base.sync import poke
    from harmpi.platform import mpiprogress
    hook = mpiprogress.new_hook()
    assert hook[0] != 0, "MPI_Iprobe not found in the loaded MPI library"
    assert hook[1] == MPI._handleof(MPI.COMM_SELF)
    assert (hook[2], hook[3]) == (MPI.ANY_SOURCE, MPI.ANY_TAG)
    # a message to self is what Iprobe would see: the call must not consume it
    req = MPI.COMM_SELF.isend(b"x", dest=0, tag=5)
    for _ in range(3):
        poke(hook.ctypes.data)
    poke(0)                                   # no hook: nothing happens
    assert MPI.COMM_SELF.recv(source=0, tag=5) == b"x"
    req.wait()


def test_kind_fields_do_not_overlap_and_round_trip():
    spans = sorted((shift, shift + width) for _, shift, width in kind.FIELDS)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    assert spans[-1][1] <= 63, "bit 63 stays clear: a kind is never negative (POISON)"
    values = {name: (1 << width) - 1 for name, _, width in kind.FIELDS}
    assert kind.decode(kind.encode(**values)) == values
    for name, _, width in kind.FIELDS:
        one = kind.encode(**{name: (1 << width) - 1})
        assert kind.decode(one) == {n: (values[n] if n == name else 0) for n in values}
        with pytest.raises(ValueError):
            kind.encode(**{name: 1 << width})
    assert kind.decode(kind.POISON) == {}


def test_ring_position_rides_in_the_kind_word_and_comes_off():
    code = kind.encode(fmt=2, op=1, coll=1, algo=3)
    for pos in (0, 64, 4096, 64 * kind.ring_lines_max()):
        with_pos = kind.with_ring(code, pos)
        assert kind.decode(with_pos)["ring"] == pos // 64
        assert kind.without_ring(with_pos) == code
    assert kind.with_ring(kind.POISON, 640) == kind.POISON
