"""auto's cost model (harmpi.algorithms.model), its file and the tune command's
pure parts: choices per topology and size, the fit, overrides, bad files.
No MPI job, no timing: the rows are recorded measurements."""

import dataclasses
import json
import math

import pytest

from harmpi.algorithms import model, model_file, model_rows
from harmpi.cli import tune
from harmpi.config import Config
from harmpi.errors import HarmpiArgumentError

K = 1024
D = model.DEFAULT


def pick(c, L, N, nbytes):
    return model.choose(c, L, N, nbytes)


# -- the choice per topology and size --------------------------------------------------


@pytest.mark.parametrize("nbytes", [10 * K, 32 * K, 64 * K, 1 << 20])
def test_sixteen_ranks_per_node_take_shm_rsag_where_it_was_measured_faster(nbytes):
    """The 16-core host (issue 37): at 16 ranks shm_rsag 26 us against shm's
    33-39 at 10 KiB, 55 against 142-210 at 64 KiB."""
    assert pick(D, 16, 1, nbytes) == "shm_rsag"
    assert pick(model.fit(model_rows.HOST16_ROWS, model.PRIOR, model.PRIOR_WEIGHT),
                16, 1, nbytes) == "shm_rsag"


def test_the_recorded_sixteen_rank_rows_are_ordered_as_the_model_orders_them():
    rows = {(r[0], r[4]): r[5] for r in model_rows.HOST16_ROWS if r[1] == 16}
    for nbytes in (10 * K, 64 * K):
        measured_faster = rows[("shm_rsag", nbytes)] < rows[("shm", nbytes)]
        predicted = model.cost_us(D, "shm_rsag", 16, 1, nbytes, "python") < \
            model.cost_us(D, "shm", 16, 1, nbytes)
        assert measured_faster and predicted


@pytest.mark.parametrize("L", [2, 4])
def test_two_and_four_ranks_keep_shm_for_small_and_shm_rsag_for_large(L):
    """Today's choices where the measurements back them: the all-read step
    for the smallest messages, reduce-scatter from 64 KiB on (this
    machine at 2 ranks: shm_rsag 10.7 us against shm 19.5 at 64 KiB)."""
    assert pick(D, L, 1, 2 * K) == "shm"
    for nbytes in (64 * K, 256 * K, 1 << 20, 4 << 20):
        assert pick(D, L, 1, nbytes) == "shm_rsag"


def test_two_ranks_keep_shm_at_the_decode_size():
    """10 KiB (hidden 5120 x bf16) at 2 ranks stays on the all-read step."""
    assert pick(D, 2, 1, 10 * K) == "shm"


def test_the_switch_moves_down_as_ranks_per_node_grow():
    switches = [model.thresholds(D, L, 1).small_max_nbytes for L in (2, 4, 8, 16, 32)]
    assert switches == sorted(switches, reverse=True) and switches[0] > switches[-1]


def test_one_rank_nodes_never_switch_to_har_bandwidth():
    """L=1: har_bandwidth sends the same bytes and pays a flag round more
    (this machine, 2 x 1: har_latency 721 us against 935 at 1 MiB)."""
    for N in (2, 3, 4, 8):
        assert model.thresholds(D, 1, N).har_latency_max_nbytes == model.NEVER_NBYTES
        assert pick(D, 1, N, 4 << 20) == "har_latency"


@pytest.mark.parametrize("L, N", [(2, 2), (8, 2), (16, 2), (4, 4), (2, 8), (16, 4)])
def test_several_nodes_take_har_latency_small_and_har_bandwidth_large(L, N):
    """Across nodes of several ranks: the whole tensor on every rail for
    the smallest messages (one flag round fewer), one share per rail for
    large ones (the 16-core host: 2 x 8 at 64 KiB 209 us on har_latency)."""
    assert pick(D, L, N, 256) == "har_latency"
    assert pick(D, L, N, 1 << 20) == "har_bandwidth"


def test_the_multi_node_switch_moves_down_with_ranks_per_node_and_nodes():
    for N in (2, 4):
        by_L = [model.thresholds(D, L, N).har_latency_max_nbytes for L in (2, 4, 8, 16)]
        assert by_L == sorted(by_L, reverse=True)
    by_N = [model.thresholds(D, 4, N).har_latency_max_nbytes for N in (2, 4, 8)]
    assert by_N == sorted(by_N, reverse=True)
    # two nodes of two: the decode size stays on har_latency (compiled, one exchange)
    assert pick(D, 2, 2, 10 * K) == "har_latency"


def test_rail_exchanges_fold_non_powers_of_two():
    assert [model.rail_exchanges(n) for n in (1, 2, 3, 4, 5, 8)] == [0, 1, 3, 2, 4, 3]


def test_choices_cover_two_kib_to_four_mib_and_follow_the_switch():
    rows = model.choices(D, 16, 1)
    assert [r["nbytes"] for r in rows] == [2 * K << k for k in range(12)]
    limit = model.thresholds(D, 16, 1).small_max_nbytes
    for r in rows:
        assert r["algorithm"] == ("shm" if r["nbytes"] <= limit else "shm_rsag")
        assert set(r["predicted_us"]) == {"shm", "shm_rsag"}
    forced = model.choices(D, 16, 1, model.Thresholds(1 << 30, 0))
    assert {r["algorithm"] for r in forced} == {"shm"}


def test_crossover_edges():
    zero = dataclasses.replace(D, flag_us=0.0, flag_rank_us=0.0)
    # no extra cost for the second flag round: reduce-scatter from the first byte
    assert model.crossover_nbytes(zero, "shm", "shm_rsag", 4, 1) == 0
    no_sum = dataclasses.replace(D, sum_us_per_mib=0.0, bus_us_per_mib=0.0)
    # sums free: shm reads L slots at no cost and never loses
    assert model.crossover_nbytes(no_sum, "shm", "shm_rsag", 4, 1) == model.NEVER_NBYTES
    t = model.crossover_nbytes(D, "shm", "shm_rsag", 4, 1)
    assert model.cost_us(D, "shm", 4, 1, t) <= model.cost_us(D, "shm_rsag", 4, 1, t)
    assert model.cost_us(D, "shm", 4, 1, t + 1) > model.cost_us(D, "shm_rsag", 4, 1, t + 1)


def test_terms_reject_what_the_model_does_not_price():
    for bad in (("leader", 2, 2, "compiled"), ("shm", 0, 1, "compiled"),
                ("shm", 2, 1, "jit")):
        with pytest.raises(ValueError):
            model.terms(*bad)


# -- the fit --------------------------------------------------------------------------


def test_the_default_constants_are_the_fit_of_the_recorded_rows():
    fitted = model.fit(model_rows.DEFAULT_ROWS, model.PRIOR, model.PRIOR_WEIGHT)
    for name, value in D.as_dict().items():
        assert math.isclose(getattr(fitted, name), value, rel_tol=2e-3, abs_tol=1e-3), name


def test_the_fit_recovers_constants_from_their_own_predictions():
    truth = model.CostConstants(call_us=2.0, python_us=6.0, python_round_us=1.0, flag_us=0.4,
                                flag_rank_us=0.2, rail_us=9.0, copy_us_per_mib=40.0,
                                sum_us_per_mib=90.0, bus_us_per_mib=4.0,
                                rail_us_per_mib=150.0, link_us_per_mib=60.0)
    rows = []
    for algorithm, N in (("shm", 1), ("shm_rsag", 1), ("har_latency", 2),
                         ("har_bandwidth", 2), ("har_latency", 4), ("har_bandwidth", 4)):
        for L in (1, 2, 4, 8, 16):
            for entry in ("compiled", "python"):
                for nbytes in (2 * K, 64 * K, 1 << 20):
                    rows.append((algorithm, L, N, entry, nbytes,
                                 model.cost_us(truth, algorithm, L, N, nbytes, entry)))
    fitted = model.fit(rows)
    for name, value in truth.as_dict().items():
        assert math.isclose(getattr(fitted, name), value, rel_tol=1e-2), name


def test_the_fit_refuses_bad_rows():
    with pytest.raises(ValueError, match="no rows"):
        model.fit([])
    with pytest.raises(ValueError, match="finite number > 0"):
        model.fit([("shm", 2, 1, "compiled", 4096, 0.0)])


def test_constants_must_be_finite_and_not_negative():
    for bad in (-1.0, math.nan, math.inf, "3"):
        with pytest.raises(ValueError, match="flag_us"):
            dataclasses.replace(D, flag_us=bad)


# -- the file -------------------------------------------------------------------------


def test_a_written_file_reads_back(tmp_path):
    c = dataclasses.replace(D, rail_us=42.0)
    rows = model_rows.HOST2_ROWS[:3]
    path = model_file.write(tmp_path / "sub" / "m.json", c, rows, {"hostname": "h", "cpus": 2},
                            "2026-12-05T00:00:00Z")
    got, got_rows, host = model_file.read(path)
    assert got == c and got_rows == [model.Row(*r) for r in rows] and host["cpus"] == 2
    loaded = model_file.load(str(path))
    assert loaded == model_file.LoadedModel(c, str(path), None)
    assert not list(path.parent.glob(".*tmp"))  # the temporary file was renamed


def test_the_default_file_is_per_user_cache_and_per_host(tmp_path):
    path = model_file.default_path({"XDG_CACHE_HOME": str(tmp_path)})
    assert path.parent == tmp_path / "harmpi" and path.name.startswith("cost-model-")
    # no file there: the built-in constants, no problem to report
    assert model_file.load(None, {"XDG_CACHE_HOME": str(tmp_path)}) == \
        model_file.LoadedModel(D, model_file.BUILT_IN, None)


def _bad(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, says", [
    ("{ not json", "not JSON"),
    ('{"format": "other"}', "not a harmpi cost-model file"),
    ('{"format": "harmpi-cost-model", "version": 99}', "version 99"),
    ('{"format": "harmpi-cost-model", "version": 1, "constants": {"call_us": 1}}',
     "expected"),
    (json.dumps({"format": "harmpi-cost-model", "version": 1,
                 "constants": {**D.as_dict(), "flag_us": -2}}), "flag_us=-2"),
    (json.dumps({"format": "harmpi-cost-model", "version": 1,
                 "constants": D.as_dict(), "rows": [[1, 2]]}), "rows"),
])
def test_a_bad_file_means_the_built_in_constants_and_says_why(tmp_path, text, says):
    path = _bad(tmp_path, text)
    with pytest.raises(model_file.ModelFileError, match=says):
        model_file.read(path)
    loaded = model_file.load(str(path))
    assert loaded.constants == D and loaded.source == model_file.BUILT_IN
    assert str(path) in loaded.problem and says in loaded.problem
    assert loaded.problem.startswith("HARMPI_MODEL_FILE ")


def test_a_named_file_that_is_missing_is_a_problem_the_default_one_is_not(tmp_path):
    loaded = model_file.load(str(tmp_path / "missing.json"))
    assert loaded.constants == D and "cannot read it" in loaded.problem
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    model_file.default_path(env).parent.mkdir(parents=True)
    model_file.default_path(env).write_text("[]")
    loaded = model_file.load(None, env)
    assert loaded.constants == D and not loaded.problem.startswith("HARMPI_MODEL_FILE")


# -- Config: unset means the model, a value overrides it --------------------------------


def test_config_tells_unset_from_set():
    assert Config().small_max_nbytes is None and Config().har_latency_max_nbytes is None
    assert Config.from_env({}) == Config()
    cfg = Config.from_env({"HARMPI_SMALL_MAX_BYTES": "4096", "HARMPI_HAR_LATENCY_MAX_BYTES": "0",
                           "HARMPI_MODEL_FILE": " /x/m.json "})
    assert (cfg.small_max_nbytes, cfg.har_latency_max_nbytes, cfg.model_file) == \
        (4096, 0, "/x/m.json")
    # what ranks compare: unset is its own value, not a number
    assert dict(Config().must_match())["HARMPI_SMALL_MAX_BYTES"] == "unset (cost model)"
    assert dict(cfg.must_match())["HARMPI_SMALL_MAX_BYTES"] == 4096
    assert Config.from_env({"HARMPI_SMALL_MAX_BYTES": ""}).small_max_nbytes is None


def test_config_refuses_a_negative_switch():
    with pytest.raises(HarmpiArgumentError, match="HARMPI_SMALL_MAX_BYTES"):
        Config(small_max_nbytes=-1)
    with pytest.raises(HarmpiArgumentError, match="HARMPI_HAR_LATENCY_MAX_BYTES"):
        Config.from_env({"HARMPI_HAR_LATENCY_MAX_BYTES": "-3"})


# -- the tune command's pure parts --------------------------------------------------------


def test_tune_layouts_give_every_rank_a_core():
    assert tune.layouts(2) == [(2, None), (2, 1)]
    assert tune.layouts(16) == [(2, None), (4, None), (8, None), (16, None), (2, 1), (16, 8)]
    assert tune.layouts(6) == [(2, None), (4, None), (6, None), (2, 1), (6, 3)]
    assert tune.layouts(1) == []


def test_tune_worker_command_line():
    argv = tune.worker_argv("/bin/mpirun", 4, 2, "/tmp/out.json", sizes=(4096, 8192),
                            iterations=50, python="/py")
    assert argv == ["/bin/mpirun", "-np", "4", "--bind-to", "core", "-x", "HARMPI_RANKS_PER_NODE",
                    "/py", "-m", "mpi4py", "-m", "harmpi.tune", "--worker", "/tmp/out.json",
                    "--sizes", "4096,8192", "--iterations", "50"]


def test_tune_show_prints_constants_source_and_choices(tmp_path):
    path = model_file.write(tmp_path / "m.json", D, [], {}, "2026-12-05T00:00:00Z")
    lines = tune.report_lines(D, str(path), None, [(16, 1), (2, 2)])
    assert lines[0] == f"cost model: {path}"
    assert any(line.strip().startswith("flag_us = ") for line in lines)
    row16 = next(line for line in lines if line.strip().startswith("1 x 16"))
    assert row16.split()[-10:] == ["rsag"] * 10  # 8 KiB .. 4 MiB
    assert next(line for line in lines if line.strip().startswith("2 x 2")).split()[-1] == "harb"


def test_tune_show_exits_non_zero_on_a_bad_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HARMPI_MODEL_FILE", str(_bad(tmp_path, "{ not json")))
    assert tune.main(["--show", "--ranks-per-node", "4", "--nodes", "1"]) == 1
    out = capsys.readouterr().out
    assert "problem:" in out and "not JSON" in out and "1 x 4" in out


def test_tune_fit_of_this_machines_rows_keeps_one_rank_nodes_on_har_latency():
    c = tune.fit_rows(model_rows.HOST2_ROWS)
    assert model.thresholds(c, 1, 2).har_latency_max_nbytes == model.NEVER_NBYTES
    assert model.choose(c, 2, 1, 2 * K) == "shm" and model.choose(c, 2, 1, 64 * K) == "shm_rsag"


def test_built_in_constants_keep_the_measured_switch_across_nodes_of_several_ranks():
    """The built-in constants hold no same-size pair of har_latency and
    har_bandwidth on nodes of more than one rank, and their extrapolation
    was wrong at 2 x 2 (see harmpi.runtime.switches): not below 256 KiB
    there; a host's own tuned file, and one-rank nodes, as the model says."""
    from harmpi.runtime import switches
    built_in = model_file.LoadedModel(D, model_file.BUILT_IN, None)
    for L, N in ((2, 2), (8, 2), (4, 4), (2, 8)):
        assert model.thresholds(D, L, N).har_latency_max_nbytes < 256 << 10, (L, N)
        t = switches.modelled(built_in, L, N)
        assert t.har_latency_max_nbytes == 256 << 10, (L, N)
        assert t.small_max_nbytes == model.thresholds(D, L, N).small_max_nbytes
        tuned = model_file.LoadedModel(D, "/some/tuned.json", None)
        assert switches.modelled(tuned, L, N) == model.thresholds(D, L, N)
    assert switches.modelled(built_in, 1, 2) == model.thresholds(D, 1, 2)
    assert switches.modelled(built_in, 16, 1) == model.thresholds(D, 16, 1)
