"""The scheduler slice a context asks for on its thread (harmpi.platform.schedslice):
held and given back in pairs, counted per thread, never on a thread it
cannot serve, and set from HARMPI_SCHED_SLICE_US."""

from __future__ import annotations

import os
import threading

import pytest

from harmpi.config import Config
from harmpi.errors import HarmpiArgumentError
from harmpi.platform import schedslice

NOW = schedslice.current()
CUSTOM = NOW is not None and NOW[0] == 0 and NOW[2] > schedslice.SLICE_MIN_US * 1000
needs_custom = pytest.mark.skipif(not CUSTOM, reason="this kernel has no custom slices")


def _in_thread(fn):
    """fn() on a new thread (the test's own thread keeps its slice)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@needs_custom
def test_hold_sets_the_slice_and_release_gives_the_threads_own_back():
    def body():
        own = schedslice.current()
        token = schedslice.hold(100)
        assert isinstance(token, int), token
        assert schedslice.current() == (own[0], own[1], 100_000)
        schedslice.release(token)
        return own, schedslice.current()

    own, after = _in_thread(body)
    assert after == own


@needs_custom
def test_holds_on_one_thread_are_counted_and_the_last_release_restores():
    def body():
        own = schedslice.current()
        a = schedslice.hold(100)
        b = schedslice.hold(300)  # the first request stands
        assert a == b == threading.get_native_id()
        assert schedslice.held_us(b) == 100
        schedslice.release(a)
        still = schedslice.current()[2]
        schedslice.release(b)
        return own, still, schedslice.current()

    own, still, after = _in_thread(body)
    assert still == 100_000 and after == own


@needs_custom
def test_release_from_another_thread_restores_the_holders_slice():
    token = {}
    go, done = threading.Event(), threading.Event()
    seen = {}

    def holder():
        seen["own"] = schedslice.current()
        token["t"] = schedslice.hold(200)
        go.set()
        done.wait(10)
        seen["after"] = schedslice.current()

    t = threading.Thread(target=holder)
    t.start()
    assert go.wait(10)
    assert schedslice.current(token["t"])[2] == 200_000
    schedslice.release(token["t"])  # from this thread, as a free() at exit would
    done.set()
    t.join()
    assert seen["after"] == seen["own"]


@needs_custom
def test_the_nice_value_survives_the_slice():
    def body():
        os.setpriority(os.PRIO_PROCESS, 0, 5)  # this thread only (Linux)
        token = schedslice.hold(100)
        during = schedslice.current()
        schedslice.release(token)
        return during, schedslice.current()

    during, after = _in_thread(body)
    assert during[1] == 5 and after[1] == 5


def test_a_thread_of_another_policy_keeps_its_scheduling():
    def body():
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        before = schedslice.current()
        token = schedslice.hold(100)
        return before, token, schedslice.current()

    before, token, after = _in_thread(body)
    assert isinstance(token, str)
    if NOW is not None:
        assert "SCHED_OTHER" in token and after == before
    assert schedslice.held_us(token) is None
    schedslice.release(token)  # a reason, not a hold: ignored


@needs_custom
def test_a_slice_no_shorter_than_the_threads_own_is_not_asked_for():
    def body():
        own = schedslice.current()
        token = schedslice.hold(schedslice.SLICE_MAX_US)  # 100 ms, above the default
        return own, token, schedslice.current()

    own, token, after = _in_thread(body)
    assert isinstance(token, str) and "already" in token and after == own


@pytest.mark.parametrize("raw, value", [(None, None), ("auto", None), ("AUTO", None),
                                        ("0", 0), ("100", 100), ("2500", 2500)])
def test_the_setting(raw, value):
    env = {} if raw is None else {"HARMPI_SCHED_SLICE_US": raw}
    assert Config.from_env(env).sched_slice_us == value


@pytest.mark.parametrize("raw", ["50", "100001", "-1", "short"])
def test_a_slice_the_kernel_would_not_take_is_refused_by_name(raw):
    with pytest.raises(HarmpiArgumentError, match="HARMPI_SCHED_SLICE_US"):
        Config.from_env({"HARMPI_SCHED_SLICE_US": raw})
