"""The torch-suite adapter's pure parts (tests/torch_suite): the job's command
line, how ranks' lines combine, when a job goes on, what the check compares."""

import os
import sys

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_suite")
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import rank  # noqa: E402
import suite  # noqa: E402
from suite import FAIL, PASS, SKIP, Layout, Result  # noqa: E402


def test_layouts_and_the_command_line():
    assert Layout.parse("3") == Layout(3, None) and Layout.parse("2x2") == Layout(4, 2)
    argv = suite.mpirun_argv("/m/mpirun", Layout(4, 2), "/py", "harmpi", "/w/methods", "/w", 90)
    assert argv[:3] == ["/m/mpirun", "-np", "4"] and "HARMPI_RANKS_PER_NODE" in argv
    assert argv[-6:] == ["/py", suite.RANK_SCRIPT, "harmpi", "/w/methods", "/w", "90"]
    assert "HARMPI_RANKS_PER_NODE" not in suite.mpirun_argv("m", Layout(2, None), "p", "gloo",
                                                            "f", "d", 1)


def _line(method, outcome, detail=""):
    return {"method": method, "outcome": outcome, "detail": detail, "s": 0.5}


def test_ranks_lines_combine():
    assert suite.combine([_line("m", PASS), _line("m", PASS)]).outcome == PASS
    assert suite.combine([_line("m", PASS), _line("m", SKIP)]).outcome == PASS  # outside a group
    assert suite.combine([_line("m", SKIP, "why"), _line("m", SKIP, "why")]) == \
        Result(SKIP, "why", 0.5)
    assert suite.combine([_line("m", PASS), _line("m", FAIL, "boom")]) == \
        Result(FAIL, "rank 1: boom", 0.5)


def test_only_methods_every_rank_reported_are_done():
    ranks = [[_line("a", PASS), _line("b", FAIL, "x")], [_line("a", PASS)]]
    assert list(suite.completed(ranks, ["a", "b", "c"])) == ["a"]


def test_a_job_goes_on_only_when_the_ranks_agree():
    assert rank.uniform([(PASS, ""), (PASS, "")]) and rank.uniform([(SKIP, "r"), (SKIP, "r")])
    assert rank.uniform([(FAIL, "rank 0: not supported"), (FAIL, "rank 1: not supported")])
    assert not rank.uniform([(FAIL, "timed out"), (PASS, "")])
    assert not rank.uniform([(FAIL, "timed out"), (FAIL, "wrong value")])


def test_the_check_compares_with_gloo_or_the_committed_list():
    gloo = {"a": Result(PASS), "b": Result(PASS), "c": Result(FAIL),
            "test_monitored_barrier_gloo": Result(PASS)}
    harmpi = {"a": Result(PASS), "b": Result(FAIL), "c": Result(FAIL),
              "test_monitored_barrier_gloo": Result(FAIL)}
    assert suite.regressions({"gloo": gloo, "harmpi": harmpi}) == ["b"]  # the exempt one aside
    assert suite.regressions({"harmpi": harmpi}, ["a", "b"]) == ["b"]
    assert suite.regressions({"harmpi": harmpi}, None) == []
    assert set(suite.EXEMPT) <= set(suite.METHODS)


def test_the_small_world_guard_comes_off_at_three_ranks():
    from torch.testing._internal.common_distributed import skip_if_small_worldsize

    def method(self):
        return "ran"

    guarded = skip_if_small_worldsize(method)
    assert rank.unguarded(guarded, 3) is method and rank.unguarded(guarded, 4) is method
    assert rank.unguarded(guarded, 2) is guarded          # torch's skip stands at 2 ranks
    assert rank.unguarded(method, 3) is method


def test_disagreements_that_leave_nothing_open_are_known_methods():
    assert set(rank.NOTHING_LEFT_OPEN) <= set(suite.METHODS)
    assert set(rank.NOTHING_LEFT_OPEN) <= set(suite.EXEMPT)  # torch refuses them, not harmpi
