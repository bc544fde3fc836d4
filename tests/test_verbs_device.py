"""The verbs transport on a real RDMA device (``make test-verbs``; a
Soft-RoCE device will do, README "RDMA verbs transport"). Skipped, with the
reason, where there is no pyverbs or no device with an ACTIVE port."""

import time

import numpy as np
import pytest
from support.verbs_double import run_ranks

from harmpi import HarmpiTransportError
from harmpi.base.kind import rail_tag
from harmpi.transports import verbs_probe

pytestmark = pytest.mark.verbs_device

CHOICE, WHY = verbs_probe()
if CHOICE is None:
    pytest.skip(f"no usable RDMA port: {WHY}", allow_module_level=True)

from harmpi.transports.verbs_nic import PyverbsNic  # noqa: E402


def nic():
    return PyverbsNic(CHOICE)


def test_the_port_in_use(capsys):
    with capsys.disabled():
        print(f"\n  verbs: {WHY} (link layer {CHOICE.link_layer}, LID {CHOICE.lid}, "
              f"MTU code {CHOICE.mtu})")


@pytest.mark.parametrize("nbytes", [0, 8, 10240, 1 << 20, 3 * (1 << 20) + 5])
def test_exchange_over_the_device(tmp_path, nbytes):
    """Two queue pairs on this device, connected to each other, carry
    chunked messages both ways; three rounds (the rings wrap)."""
    def fn(t, r):
        ok = []
        for rep in range(3):
            x = np.random.default_rng([r, rep]).integers(0, 256, nbytes, dtype=np.uint8)
            recv = np.zeros(nbytes, np.uint8)
            tag = rail_tag(nbytes, rep)
            (got,) = t.complete(t.post_exchange(1 - r, x, tag, recv), 30.0, "exchange")
            want = np.random.default_rng([1 - r, rep]).integers(0, 256, nbytes, dtype=np.uint8)
            ok.append(got == (nbytes, tag) and np.array_equal(recv, want))
        return ok

    out, errs, _ = run_ranks(2, fn, tmp_path, nic=nic, chunk=256 << 10, nslots=4)
    for e in errs:
        if e is not None:
            raise e
    assert out == [[True] * 3] * 2


def test_latency_and_poll_cost(tmp_path, capsys):
    """What one 10 KB exchange and one empty CQ poll cost from Python here."""
    def fn(t, r):
        x, recv = np.ones(10240, np.uint8), np.zeros(10240, np.uint8)
        for _ in range(50):
            t.complete(t.post_exchange(1 - r, x, 1, recv), 30.0, "warm-up")
        t0 = time.perf_counter()
        for _ in range(500):
            t.complete(t.post_exchange(1 - r, x, 1, recv), 30.0, "timed")
        ex_us = (time.perf_counter() - t0) / 500 * 1e6
        t0 = time.perf_counter()
        for _ in range(2000):
            t.nic.poll(16)
        return ex_us, (time.perf_counter() - t0) / 2000 * 1e6

    out, errs, _ = run_ranks(2, fn, tmp_path, nic=nic)
    for e in errs:
        if e is not None:
            raise e
    with capsys.disabled():
        print(f"\n  verbs: 10 KB exchange {out[0][0]:.1f} us (two threads of one process), "
              f"empty poll {out[0][1]:.2f} us")


def test_a_peer_that_is_gone_is_named(tmp_path):
    def fn(t, r):
        barrier = t.comm.shared.barrier
        if r == 0:
            t.nic.close()
            barrier.wait()
            return None
        barrier.wait()
        try:
            t.complete(t.post([(0, np.ones(8, np.uint8), 1)], []), 30.0, "step")
        except HarmpiTransportError as exc:
            return exc

    out, errs, _ = run_ranks(2, fn, tmp_path, nic=nic, close=False)
    assert isinstance(out[1], HarmpiTransportError), (out, errs)
    assert "rank 0" in str(out[1]) and "RETRY_EXC_ERR" in str(out[1])
