"""Unit tests without mpirun: config, flag waits, node steps on a private
arena, tags, topology and the arena in a singleton MPI process."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from harmpi import node
from harmpi.config import ALGORITHMS, Config
from harmpi.errors import HarmpiArgumentError
from harmpi.sync import wait_flags_ge
from harmpi.transports import POISON_TAG, MAX_TAG, tag_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    ({"HARMPI_TIMEOUT_S": "0"}, "must be > 0"),
    ({"HARMPI_SLOT_BYTES": "100"}, "multiple of 64"),
    ({"HARMPI_ALGORITHM": "butterfly"}, "unknown algorithm"),
    ({"HARMPI_TRANSPORT": "carrier-pigeon"}, "unknown transport"),
    ({"HARMPI_RANKS_PER_NODE": "0"}, "HARMPI_RANKS_PER_NODE"),
])
def test_config_rejects_bad_values(env, match):
    with pytest.raises(HarmpiArgumentError, match=match):
        Config.from_env(env)


def test_algorithm_names_are_known():
    assert set(ALGORITHMS) == {"shm", "shm_rsag", "har_latency", "har_bandwidth", "leader",
                               "flat_ring"}


def test_wait_returns_when_all_flags_reached():
    flags = np.zeros(8 * 4, np.int64)
    flags[::8] = 7
    assert wait_flags_ge(flags.ctypes.data, 64, 4, 7, 10, 10 ** 9, 0) == -1


def test_wait_times_out_naming_the_late_flag():
    flags = np.zeros(8 * 3, np.int64)
    flags[::8] = 5
    flags[8] = 4                     # flag 1 is one step behind
    t0 = time.perf_counter()
    assert wait_flags_ge(flags.ctypes.data, 64, 3, 5, 10, 50_000_000, 0) == 1
    assert 0.04 < time.perf_counter() - t0 < 2.0


class _FakeArena:
    """A private arena for one rank (L = 1): the node steps without MPI."""

    def __init__(self, slot_nbytes=4096):
        self.mem = np.zeros(4096 + 2 * slot_nbytes, np.uint8)
        self.flags_addr = self.mem.ctypes.data
        self.slots_addr = self.flags_addr + 4096
        self.slot_nbytes = slot_nbytes
        self.local_size, self.local_rank = 1, 0
        self.tune_addr = self.flags_addr + 64

    def tune_table(self):
        return self.mem[64:64 + 512].view(np.int64)


def test_node_steps_single_rank_roundtrip():
    arena = _FakeArena()
    ctl = node.new_ctl(arena, 10, 1.0)
    w = np.empty(0, np.float32)
    x = np.arange(2500, dtype=np.float32)     # 10000 bytes: three 4 KiB chunks
    assert node.shm_allreduce(ctl, x.ctypes.data, x.size, 3, node.FMT_F32, 1 << 40, w) == node.OK
    assert np.array_equal(x, np.arange(2500, dtype=np.float32))
    assert ctl[node.C_STEPS] == 3 and ctl[node.C_EPOCH] == 3
    # a single rank never takes the reduce-scatter branch: one epoch per step
    assert node.shm_allreduce(ctl, x.ctypes.data, x.size, 3, node.FMT_F32, -1, w) == node.OK
    assert ctl[node.C_STEPS] == 6 and ctl[node.C_EPOCH] == 6
    assert np.array_equal(x, np.arange(2500, dtype=np.float32))


def test_poisoned_stage_fails_even_alone():
    arena = _FakeArena()
    ctl = node.new_ctl(arena, 10, 1.0)
    w = np.empty(0, np.float64)
    x = np.ones(4)
    assert node.stage(ctl, x.ctypes.data, 4, 32, node.POISON_CODE, node.FMT_F64, w) == \
        node.MISMATCH


def test_add_into_and_part_bounds():
    a = np.arange(100, dtype=np.float64)
    b = np.ones(100)
    node.add_into(a.ctypes.data, b.ctypes.data, 100, node.FMT_F64, np.empty(0, np.float64))
    assert np.array_equal(a, np.arange(100) + 1)
    for m in (0, 1, 17, 1000, 4097):
        for L in (1, 2, 3, 4):
            parts = [node.part_bounds(m, L, j, 2) for j in range(L)]
            assert parts[0][0] == 0 and parts[-1][1] == m
            assert all(p[1] == q[0] for p, q in zip(parts, parts[1:]))
            assert all((lo * 2) % 64 == 0 for lo, hi in parts if hi > lo)


def test_tags_stay_in_mpi_range_and_differ():
    tags = {tag_for(n, c) for n in range(0, 4000, 4) for c in (0, 1, 2, 3)}
    assert all(1 <= t <= MAX_TAG for t in tags) and POISON_TAG > MAX_TAG
    assert len(tags) > 3900


def test_singleton_process_arena_and_topology():
    """Without mpirun MPI starts as a singleton: one node, one rank, no /dev/shm left."""
    code = ("import harmpi, numpy as np, torch\n"
            "x = torch.ones(10, dtype=torch.bfloat16); assert harmpi.allreduce(x) is x\n"
            "i = harmpi.info(); assert i['nodes'] == 1 and i['ranks'] == 1, i\n"
            "g = harmpi.allgather(np.arange(3.0)); assert g.tolist() == [0.0, 1.0, 2.0]\n"
            "harmpi.finalize(); print('ok')\n")
    env = dict(os.environ, PYTHONPATH=REPO, OMPI_MCA_osc="^ucx", OMPI_MCA_pml="ob1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_mpi_progress_hook_calls_mpi_iprobe():
    from mpi4py import MPI

    from harmpi import mpiprogress
    from harmpi.sync import poke
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


def test_compiled_tag_matches_the_transports_tag():
    # the compiled two-node step and the Python loop must put the same tag
    # on the wire, or ranks on the two paths would see a mismatch
    from harmpi.algorithms.har_latency import _tag
    from harmpi.transports import tag_for
    for nbytes in (0, 1, 10240, 2 ** 31 + 7, 2 ** 40 + 3):
        for code in (0, 1, 0x10100, 0x110203, 2 ** 30 + 5):
            assert _tag(nbytes, code) == tag_for(nbytes, code), (nbytes, code)
