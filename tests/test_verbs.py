"""The verbs rail without an RDMA device: protocol pieces, selection, and the
transport itself over the loopback stand-in NIC (tests/support/verbs_double.py)."""

import ctypes

import numpy as np
import pytest
from mpi4py import MPI
from support.verbs_double import (
    REM_ACCESS_ERR,
    RETRY_EXC_ERR,
    RNR_RETRY_EXC_ERR,
    LoopbackNic,
    loop_port,
    run_ranks,
)

from harmpi import Config, HarmpiArgumentError, HarmpiTimeoutError, HarmpiTransportError, transports
from harmpi.base.kind import ABANDON_TAG, POISON_TAG, rail_tag
from harmpi.transports import verbs_proto as proto
from harmpi.transports.verbs import VerbsTransport

# -- protocol pieces ----------------------------------------------------------


def test_conn_info_round_trips_and_rejects_foreign_records():
    info = proto.ConnInfo(qpn=0x123456, psn=0xABCDEF, lid=17, gid=bytes(range(16)), mtu=5,
                          land_addr=0x7F00_0000_1000, land_rkey=0xDEADBEEF,
                          credit_addr=0x7F00_0000_0040, credit_rkey=0x1234, nslots=4,
                          chunk_nbytes=1 << 18, port=2)
    raw = info.encode()
    assert len(raw) == proto.ConnInfo.NBYTES
    assert proto.ConnInfo.decode(raw) == info
    with pytest.raises(HarmpiTransportError, match="another format"):
        proto.ConnInfo.decode(b"\0" * len(raw))
    with pytest.raises(HarmpiTransportError, match="bytes"):
        proto.ConnInfo.decode(raw[:-1])


def test_immediate_carries_tag_last_bit_and_sequence():
    for tag in (1, rail_tag(10240, 7), 32000, POISON_TAG, ABANDON_TAG):
        for last in (False, True):
            for seq in (0, 1, proto.SEQ_MOD - 1, proto.SEQ_MOD + 5):
                imm = proto.encode_imm(tag, last, seq)
                assert 0 <= imm < 1 << 32
                assert proto.decode_imm(imm) == (tag, last, seq % proto.SEQ_MOD)
    assert POISON_TAG < ABANDON_TAG < 1 << proto.TAG_BITS
    with pytest.raises(ValueError):
        proto.encode_imm(1 << 16, False, 0)


@pytest.mark.parametrize("n, chunk, expect", [
    (0, 64, [0]), (1, 64, [1]), (64, 64, [64]), (65, 64, [64, 1]), (200, 64, [64, 64, 64, 8])])
def test_chunk_sizes(n, chunk, expect):
    assert proto.chunk_sizes(n, chunk) == expect
    assert sum(proto.chunk_sizes(n, chunk)) == n


def test_registration_layout_sections_do_not_overlap():
    lay = proto.Layout(npeers=3, nslots=4, chunk_nbytes=4096)
    spans = []
    for p in range(3):
        spans.append((lay.credit(p), 8))
        spans.append((lay.consumed(p), 8))
        for s in range(4):
            spans.append((lay.landing(p, s), 4096))
            spans.append((lay.staging(p, s), 4096))
    spans.sort()
    for (a, n), (b, _) in zip(spans, spans[1:]):
        assert a + n <= b
    assert spans[-1][0] + spans[-1][1] <= lay.nbytes
    assert lay.landing(1, 5) == lay.landing(1, 1)       # slot = sequence mod slots
    assert lay.landing_off % 4096 == 0 and lay.staging_off % 4096 == 0
    with pytest.raises(ValueError):
        proto.Layout(1, 2, 100)


def _port(num, state=proto.PORT_ACTIVE, ll=proto.LINK_LAYER_ETHERNET, gids=()):
    return proto.PortInfo(num=num, state=state, link_layer=ll, lid=num, mtu=3, gids=gids)


V4 = bytes(10) + b"\xff\xff" + bytes([192, 168, 0, 2])
V6 = bytes([0xFE, 0x80]) + bytes(13) + b"\x01"


def test_port_choice_first_active_port_and_roce_v2_gid():
    devs = [proto.DeviceInfo("mlx5_0", (_port(1, state=1),
                                        _port(2, gids=((0, V6, 0), (1, V6, 1), (3, V4, 1))))),
            proto.DeviceInfo("rxe0", (_port(1, gids=((1, V4, 1),)),))]
    choice, wanted, found = proto.choose_port(devs)
    assert (choice.device, choice.port, choice.gid_index, choice.gid) == ("mlx5_0", 2, 3, V4)
    assert "port 1 DOWN" in found
    # asked for a device, a port, a GID index
    choice, _, _ = proto.choose_port(devs, device="rxe0")
    assert (choice.device, choice.gid_index) == ("rxe0", 1)
    choice, _, _ = proto.choose_port(devs, gid_index=1)
    assert (choice.port, choice.gid_index, choice.gid) == (2, 1, V6)
    # InfiniBand: no GRH, the LID addresses the port
    ib = [proto.DeviceInfo("mlx5_1", (_port(1, ll=proto.LINK_LAYER_INFINIBAND),))]
    choice, _, _ = proto.choose_port(ib)
    assert choice.gid_index == -1 and choice.lid == 1


def test_port_choice_says_what_it_looked_for_and_found():
    devs = [proto.DeviceInfo("rxe0", (_port(1, gids=((0, V6, 0),)), _port(2, state=1)))]
    choice, wanted, found = proto.choose_port(devs)
    assert choice is None
    assert "first ACTIVE" in wanted and "RoCE v2" in wanted
    assert "rxe0 port 1 ACTIVE, Ethernet, no RoCE v2 GID" in found
    assert "rxe0 port 2 DOWN" in found
    choice, wanted, found = proto.choose_port(devs, device="mlx5_0")
    assert choice is None and "mlx5_0" in wanted and "rxe0" in found


def test_per_local_rank_lists():
    assert proto.pick_for_local_rank((), 3) is None
    assert proto.pick_for_local_rank(("a", "b"), 3) == "b"
    cfg = Config.from_env({"HARMPI_IB_DEVICE": "mlx5_0, mlx5_1", "HARMPI_IB_PORT": "1,2",
                           "HARMPI_IB_GID_INDEX": "3"})
    assert cfg.ib_devices == ("mlx5_0", "mlx5_1") and cfg.ib_ports == (1, 2)
    assert cfg.ib_gid_indexes == (3,)
    assert transports._local_settings(cfg, 1) == ("mlx5_1", 2, 3)
    assert Config.from_env({}).ib_devices == ()
    with pytest.raises(HarmpiArgumentError, match="HARMPI_IB_PORT"):
        Config.from_env({"HARMPI_IB_PORT": "0"})
    with pytest.raises(HarmpiArgumentError, match="HARMPI_IB_GID_INDEX"):
        Config.from_env({"HARMPI_IB_GID_INDEX": "x"})


def test_completion_error_names_peer_operation_and_status():
    err = proto.completion_error(3, "allreduce of 5 f32", 7, "RDMA_WRITE_WITH_IMM", 12, 0x81)
    assert isinstance(err, HarmpiTransportError) and err.culprit == 7
    msg = str(err)
    for part in ("rank 3", "allreduce of 5 f32", "rank 7", "RDMA_WRITE_WITH_IMM",
                 "RETRY_EXC_ERR", "(12", "0x81", "exited or crashed"):
        assert part in msg, msg
    assert "REM_ACCESS_ERR" in str(proto.completion_error(0, "x", 1, 1, 10))
    assert "RDMA_WRITE " in str(proto.completion_error(0, "x", 1, 1, 10))
    assert "status 99" in str(proto.completion_error(0, "x", 1, 1, 99))
    for status, (name, meaning) in proto.WC_STATUS.items():
        assert name and meaning


# -- selection ----------------------------------------------------------------


def test_verbs_status_without_pyverbs(monkeypatch):
    import builtins
    real = builtins.__import__

    def no_pyverbs(name, *a, **k):
        if name == "pyverbs" or name.startswith("pyverbs."):
            raise ImportError("No module named 'pyverbs'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_pyverbs)
    usable, why = transports.verbs_status()
    assert not usable and "pyverbs is not importable" in why


def test_verbs_status_without_a_device(monkeypatch):
    pytest.importorskip("pyverbs")  # Debian's python3-pyverbs via make setup
    usable, why = transports.verbs_status()
    assert not usable and "no RDMA device" in why, why


def test_forced_verbs_fails_at_select_saying_what_was_found(monkeypatch):
    monkeypatch.setattr(transports, "verbs_probe",
                        lambda config, local_rank: (None, "looked for X; found Y"))
    comm = MPI.COMM_SELF.Dup()
    try:
        with pytest.raises(HarmpiTransportError,
                           match="HARMPI_TRANSPORT=verbs cannot be used: .*rank 0: looked for "
                                 "X; found Y"):
            transports.select("verbs", comm, 1, 5.0)
        # auto says why verbs was not taken, then takes tcp
        t, why = transports.select("auto", comm, 1, 5.0)
        try:
            assert t.name == "tcp"
            assert why.startswith("auto: verbs not usable on every rank: rank 0: looked for X")
        finally:
            t.close()
    finally:
        comm.Free()


def test_auto_takes_verbs_when_every_rank_has_a_port(monkeypatch, tmp_path):
    monkeypatch.setattr(transports, "verbs_probe",
                        lambda config, local_rank: (loop_port(), "loop0 port 1 is ACTIVE"))
    monkeypatch.setattr(transports, "_open_verbs", lambda choice, comm, spin, timeout_s:
                        VerbsTransport(comm, spin, timeout_s, LoopbackNic(str(tmp_path))))
    comm = MPI.COMM_SELF.Dup()
    try:
        t, why = transports.select("auto", comm, 1, 5.0)
        assert t.name == "verbs" and "every rank has an ACTIVE port" in why, why
        t.close()
        t, why = transports.select("verbs", comm, 1, 5.0)
        assert t.name == "verbs" and why.startswith("HARMPI_TRANSPORT=verbs"), why
        t.close()
    finally:
        comm.Free()


def test_the_stand_in_is_not_selectable():
    with pytest.raises(HarmpiArgumentError):
        Config(transport="loopback")
    assert not hasattr(transports, "LoopbackNic")


# -- the transport over the loopback NIC ------------------------------------------


def _check(errs):
    for e in errs:
        if e is not None:
            raise e


@pytest.mark.parametrize("nbytes", [0, 8, 4096, 4096 * 2, 50_000, 200_001])
def test_exchange_with_chunking(tmp_path, nbytes):
    """Messages up to ~50 chunks through 2 landing slots (credit flow)."""
    def fn(t, r):
        peer = 1 - r
        results = []
        for rep in range(3):   # the rings wrap and the sequence numbers go on
            x = np.random.default_rng([r, rep]).integers(0, 256, nbytes, dtype=np.uint8)
            recv = np.zeros(nbytes + 64, np.uint8)
            tag = rail_tag(nbytes, rep)
            (got,) = t.complete(t.post_exchange(peer, x, tag, recv), 10.0, "exchange")
            want = np.random.default_rng([peer, rep]).integers(0, 256, nbytes, dtype=np.uint8)
            results.append((got == (nbytes, tag), np.array_equal(recv[:nbytes], want)))
        return results

    out, errs, _ = run_ranks(2, fn, tmp_path)
    _check(errs)
    assert out == [[(True, True)] * 3] * 2


def test_a_larger_message_is_counted_not_raised(tmp_path):
    """A peer that sends more than the receive buffer holds: the receiver
    gets what fits and the full count (recv_check then poisons the step on
    every rank); the next exchange is still aligned."""
    def fn(t, r):
        n = 10_000 if r == 0 else 3_000
        x = np.full(n, r + 1, np.uint8)
        recv = np.zeros(3_000, np.uint8)
        (got,) = t.complete(t.post_exchange(1 - r, x, 5, recv), 10.0, "mismatch")
        y = np.full(100, 10 + r, np.uint8)
        recv2 = np.zeros(100, np.uint8)
        (got2,) = t.complete(t.post_exchange(1 - r, y, 6, recv2), 10.0, "after")
        return got, int(recv[-1]), got2, int(recv2[0])

    out, errs, _ = run_ranks(2, fn, tmp_path)
    _check(errs)
    assert out[1] == ((10_000, 5), 1, (100, 6), 10)
    assert out[0] == ((3_000, 5), 2, (100, 6), 11)


def test_one_way_messages_and_many_peers(tmp_path):
    """Recursive-doubling-like patterns: a send without a receive, receives
    posted before the data arrives, and three peers at once."""
    def fn(t, r):
        got = []
        if r == 0:
            t.complete(t.post([(1, np.full(5000, 7, np.uint8), 9)], []), 10.0, "one way")
        elif r == 1:
            buf = np.zeros(5000, np.uint8)
            got.append((t.complete(t.post([], [(0, buf)]), 10.0, "one way"), int(buf.sum())))
        bufs = {p: np.zeros(64, np.uint8) for p in range(4) if p != r}
        pend = t.post([(p, np.full(64, r, np.uint8), 20 + r) for p in bufs],
                      [(p, b) for p, b in bufs.items()])
        res = t.complete(pend, 10.0, "all to all")
        got.append((res, [int(b[0]) for b in bufs.values()]))
        return got

    out, errs, _ = run_ranks(4, fn, tmp_path)
    _check(errs)
    assert out[1][0] == ([(5000, 9)], 35000)
    for r in range(4):
        res, firsts = out[r][-1]
        peers = [p for p in range(4) if p != r]
        assert res == [(64, 20 + p) for p in peers] and firsts == peers


def test_a_completion_error_names_peer_operation_and_status(tmp_path):
    def fn(t, r):
        if r == 0:
            t.nic.inject("write_imm", RETRY_EXC_ERR)
        try:
            t.complete(t.post_exchange(1 - r, np.ones(100, np.uint8), 3, np.zeros(100, np.uint8)),
                       1.0, "allreduce of 25 f32")
        except (HarmpiTransportError, HarmpiTimeoutError) as exc:
            return exc
        return None

    out, errs, _ = run_ranks(2, fn, tmp_path, close=False)
    _check(errs)
    e0 = out[0]
    assert isinstance(e0, HarmpiTransportError), e0
    assert "rank 0: allreduce of 25 f32: verbs RDMA_WRITE_WITH_IMM with rank 1" in str(e0)
    assert "RETRY_EXC_ERR" in str(e0) and e0.culprit == 1
    # rank 1 got rank 0's nothing: a timeout naming rank 0
    assert isinstance(out[1], HarmpiTimeoutError) and "a message from rank 0" in str(out[1])


@pytest.mark.parametrize("kind, status, name", [("recv", REM_ACCESS_ERR, "RECV_RDMA_WITH_IMM"),
                                                ("write", RNR_RETRY_EXC_ERR, "credit")])
def test_receive_and_credit_errors(tmp_path, kind, status, name):
    def fn(t, r):
        if r == 1:
            t.nic.inject(kind, status)
        try:
            for _ in range(2):
                t.complete(t.post_exchange(1 - r, np.ones(100, np.uint8), 3,
                                           np.zeros(100, np.uint8)), 1.0, "step")
        except (HarmpiTransportError, HarmpiTimeoutError) as exc:
            return exc
        return None

    out, errs, _ = run_ranks(2, fn, tmp_path)
    _check(errs)
    assert isinstance(out[1], HarmpiTransportError), out[1]
    assert name in str(out[1]) and proto.WC_STATUS[status][0] in str(out[1])
    # a failed transport refuses further posts with the same error
    assert out[1] is not None


def test_a_peer_that_is_gone_and_a_peer_that_gave_up(tmp_path):
    def fn(t, r):
        if r == 0:
            t.give_up()
            return None
        try:
            t.complete(t.post([], [(0, np.zeros(8, np.uint8))]), 5.0, "step")
        except HarmpiTimeoutError as exc:
            return exc

    out, errs, _ = run_ranks(2, fn, tmp_path, close=False)
    _check(errs)
    assert "rank 0 gave up on this collective" in str(out[1])

    def fn2(t, r):
        barrier = t.comm.shared.barrier
        if r == 0:
            t.nic.close()   # as if the process had exited
            barrier.wait()
            return None
        barrier.wait()
        try:
            t.complete(t.post([(0, np.ones(8, np.uint8), 1)], []), 5.0, "step")
        except HarmpiTransportError as exc:
            return exc

    out, errs, _ = run_ranks(2, fn2, tmp_path)
    _check(errs)
    assert "RETRY_EXC_ERR" in str(out[1]) and "rank 0" in str(out[1])


def test_a_timeout_names_the_late_peer(tmp_path):
    def fn(t, r):
        if r == 1:
            try:
                t.complete(t.post_exchange(0, np.ones(8, np.uint8), 1, np.zeros(8, np.uint8)),
                           0.2, "allreduce of 2 f32")
            except HarmpiTimeoutError as exc:
                return exc
        return None

    out, errs, _ = run_ranks(2, fn, tmp_path, close=False)
    _check(errs)
    msg = str(out[1])
    assert "rank 1: allreduce of 2 f32: waited 0.2 s for a message from rank 0" in msg
    assert "verbs transport" in msg and out[1].culprit == 0


def test_landing_view_is_the_registered_slot(tmp_path):
    def fn(t, r):
        t.complete(t.post_exchange(1 - r, np.full(64, 5 + r, np.uint8), 1,
                                   np.zeros(64, np.uint8)), 10.0, "x")
        v = t.landing_view(1 - r, 0)
        return int(v[0]), v.ctypes.data == t.region.addr + t.layout.landing(1 - r, 0)

    out, errs, _ = run_ranks(2, fn, tmp_path)
    _check(errs)
    assert out == [(6, True), (5, True)]


def test_copy_cost_is_small_beside_the_python_poll(tmp_path, capsys):
    """What the landing copy costs (the module docstring quotes it)."""
    import time
    for nbytes in (10 << 10, 1 << 20):
        a = np.ones(nbytes, np.uint8)
        b = np.empty_like(a)
        t0 = time.perf_counter()
        for _ in range(200):
            ctypes.memmove(b.ctypes.data, a.ctypes.data, nbytes)
        us = (time.perf_counter() - t0) / 200 * 1e6
        with capsys.disabled():
            print(f"\n  landing copy {nbytes} B: {us:.2f} us", end="")
        assert us < 5_000


# -- the adapter's pyverbs objects, built without a device ------------------------

def test_the_adapter_builds_valid_pyverbs_work_requests_and_attributes():
    """Everything PyverbsNic hands to pyverbs that needs no device: the QP
    attributes of INIT/RTR/RTS (RoCE with a GRH, InfiniBand by LID), the
    receive of a WRITE WITH IMM (pyverbs refuses one without a scatter
    entry) and both writes. Runs wherever pyverbs imports (make setup
    installs Debian's)."""
    pytest.importorskip("pyverbs")
    from pyverbs import enums

    from harmpi.transports import verbs_nic as nic

    remote = proto.ConnInfo(qpn=0x1234, psn=0x55, lid=7, gid=bytes(range(16)), mtu=3,
                            land_addr=0x10000, land_rkey=9, credit_addr=0x20000, credit_rkey=10,
                            nslots=2, chunk_nbytes=4096)
    for gid_index, lid in ((1, 0), (-1, 7)):
        port = proto.PortChoice(device="dev0", port=1, gid_index=gid_index, gid=bytes(16),
                                lid=lid, mtu=5, link_layer=1)
        attr = nic.qp_attr(port.port, min(port.mtu, remote.mtu))
        assert (attr.port_num, attr.path_mtu, attr.pkey_index) == (1, 3, 0)
        assert attr.qp_access_flags == (enums.IBV_ACCESS_LOCAL_WRITE
                                        | enums.IBV_ACCESS_REMOTE_WRITE)
        nic.set_rtr(attr, port, remote)
        assert (attr.dest_qp_num, attr.rq_psn) == (0x1234, 0x55)
        assert attr.min_rnr_timer == proto.QP_MIN_RNR_TIMER
        nic.set_rts(attr, 0x77)
        assert (attr.sq_psn, attr.timeout, attr.retry_cnt, attr.rnr_retry) == (
            0x77, proto.QP_TIMEOUT, proto.QP_RETRY_CNT, proto.QP_RNR_RETRY)
    assert nic.recv_wr(5, 0x3000, 11).wr_id == 5
    w = nic.write_wr(6, 0x4000, 128, 12, 0x5000, 13, imm=0xABCD)
    assert (w.wr_id, w.opcode, w.imm_data) == (6, enums.IBV_WR_RDMA_WRITE_WITH_IMM, 0xABCD)
    assert nic.write_wr(7, 0x4000, 8, 12, 0x6000, 14, imm=None).opcode == enums.IBV_WR_RDMA_WRITE
    # the GID round trip of the connection record
    assert nic._gid_bytes(nic._gid_str(bytes(range(16)))) == bytes(range(16))
