"""Tests of bench/: the pure harness parts without MPI, then short runs under mpirun."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from support.have import HAVE_HARMPI, HAVE_TORCH
from support.jobs import run_module

from bench import harness, report
from bench.decode import COMM_KINDS
from bench.decode_results import (
    collective_latency_ns,
    divergence_note,
    first_divergence,
    format_decode_table,
    logits_gap_ulps,
    round_steps,
    round_tokens_per_s,
    summarize_backend,
    top2_margin_ulps,
)
from bench.demo import mpirun_argv, summary_lines
from bench.harness import ALLGATHER, ALLREDUCE, ALLTOALL, DTYPES
from bench.impls import HarmpiImpl, Impl, MpiImpl, TorchImpl, parse_impls, torch_backend
from bench.model import FFN_UNIT, VOCAB_UNIT, ModelConfig, shard_layout, unit_seed
from bench.report import Row
from bench.threads import threads_per_rank

# --------------------------------------------------------------------------
# Sizes and iterations
# --------------------------------------------------------------------------


def test_default_sizes_double_from_2_bytes_to_4_mib_plus_decode_size():
    sizes = harness.parse_sizes(None)
    assert sizes[0] == 2 and sizes[-1] == 4 * 1024 * 1024
    assert 10240 in sizes
    powers = [s for s in sizes if s != 10240]
    assert all(b == 2 * a for a, b in zip(powers, powers[1:]))
    assert len(sizes) == 22 + 1


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("1024:4096", [1024, 2048, 4096]),
        ("1K:4K", [1024, 2048, 4096]),
        ("8K:16K", [8192, 10240, 16384]),
        ("8", [2, 4, 8]),
        ("3:20", [3, 6, 12]),
    ],
)
def test_parse_sizes(spec, expected):
    assert harness.parse_sizes(spec) == expected


def test_parse_sizes_open_ended_and_no_extra():
    assert harness.parse_sizes("2M:")[-1] == 4 * 1024 * 1024
    assert harness.parse_sizes("8K:16K", extra=()) == [8192, 16384]


@pytest.mark.parametrize("spec", ["0:8", "16:8", "abc", "4Q"])
def test_parse_sizes_rejects_bad_ranges(spec):
    with pytest.raises(ValueError):
        harness.parse_sizes(spec)


def test_parse_nbytes_binary_suffixes():
    assert harness.parse_nbytes("10240") == 10240
    assert harness.parse_nbytes("4k") == 4096
    assert harness.parse_nbytes("4MiB") == 4 * 1024 * 1024
    for n in (3, 1024, 10240, 4 * 1024 * 1024, 1536):
        assert harness.parse_nbytes(harness.format_nbytes(n)) == n
    assert harness.format_nbytes(4 * 1024 * 1024) == "4M"


def test_iteration_defaults_follow_osu_collectives():
    assert harness.iterations_for(8192) == (1000, 100)
    assert harness.iterations_for(8193) == (100, 10)
    assert harness.iterations_for(10240) == (100, 10)
    assert harness.iterations_for(2, iterations=5, warmup=2) == (5, 2)
    assert harness.iterations_for(1 << 20, iterations=7) == (7, 10)


def test_iteration_cap_for_slow_implementations():
    assert harness.capped_iterations(1000, 100, 50) == (50, 5)
    assert harness.capped_iterations(20, 3, 50) == (20, 3)
    assert harness.capped_iterations(1000, 100, None) == (1000, 100)


# --------------------------------------------------------------------------
# Timing and statistics
# --------------------------------------------------------------------------


def test_time_op_fences_every_iteration_with_a_barrier():
    calls = []
    samples = harness.time_op(lambda: calls.append("op"), lambda: calls.append("barrier"),
                              iterations=4, warmup=2)
    assert calls == ["barrier", "op"] * 6
    assert samples.shape == (4,) and (samples >= 0).all()


def test_rank_stats_and_summary():
    samples_ns = np.array([1000, 2000, 9000])
    assert harness.rank_stat_us(samples_ns, "mean") == pytest.approx(4.0)
    assert harness.rank_stat_us(samples_ns, "median") == pytest.approx(2.0)
    with pytest.raises(ValueError):
        harness.rank_stat_us(samples_ns, "mode")
    assert harness.summarize_ranks([1.0, 2.0, 6.0]) == (3.0, 1.0, 6.0)


def test_busbw_factors():
    # 1 MB in 1 ms is 1 GB/s of algorithm bandwidth.
    assert harness.busbw_gbps(1_000_000, 1000.0, ALLREDUCE.busbw_factor(4)) == pytest.approx(1.5)
    assert harness.busbw_gbps(1_000_000, 1000.0, ALLREDUCE.busbw_factor(2)) == pytest.approx(1.0)
    assert harness.busbw_gbps(1_000_000, 1000.0, ALLGATHER.busbw_factor(4)) == pytest.approx(3.0)


# --------------------------------------------------------------------------
# Data and checks
# --------------------------------------------------------------------------


def test_bf16_rounding_is_nearest_even():
    one = 1.0
    halfway_down = one + 2.0**-8  # between 1 and 1 + 2^-7: ties to the even 1.0
    halfway_up = one + 3 * 2.0**-8  # between 1 + 2^-7 and 1 + 2^-6: ties to even 1 + 2^-6
    values = np.array([one, halfway_down, halfway_up, -2.5], dtype=np.float32)
    bits = harness.bf16_bits_from_f32(values)
    back = harness.f32_from_bf16_bits(bits)
    assert back.tolist() == [1.0, 1.0, 1.0 + 2.0**-6, -2.5]


@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_bf16_rounding_matches_torch():
    import torch

    values = np.random.default_rng(0).normal(size=4096).astype(np.float32)
    ours = harness.bf16_bits_from_f32(values)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert (ours == theirs).all()


def _bf16_ring_sum(inputs):
    """Sum in bf16 with a rounding after every add (gloo's worst case)."""
    acc = harness.f32_from_bf16_bits(inputs[0])
    for x in inputs[1:]:
        exact = acc + harness.f32_from_bf16_bits(x)
        acc = harness.f32_from_bf16_bits(harness.bf16_bits_from_f32(exact))
    return harness.bf16_bits_from_f32(acc)


@pytest.mark.parametrize("n_ranks", [1, 2, 3, 4, 8])
def test_allreduce_check_accepts_rounded_sums_and_rejects_wrong_ones(n_ranks):
    dtype, count, seed = DTYPES["bf16"], 1000, 5
    inputs = [ALLREDUCE.init_values(seed, r, count, dtype) for r in range(n_ranks)]
    good = _bf16_ring_sum(inputs)
    ok, detail = ALLREDUCE.check(good, seed, n_ranks, count, dtype)
    assert ok, detail
    if n_ranks > 1:
        missing = _bf16_ring_sum(inputs[:-1])  # one rank's contribution lost
        ok, detail = ALLREDUCE.check(missing, seed, n_ranks, count, dtype)
        assert not ok and "outside the bound" in detail
    nan = good.copy()
    nan[3] = 0x7FC0
    assert not ALLREDUCE.check(nan, seed, n_ranks, count, dtype)[0]


@pytest.mark.parametrize("name", ["f16", "f32"])
def test_allreduce_check_other_dtypes(name):
    dtype, count, seed, n_ranks = DTYPES[name], 257, 1, 3
    inputs = [ALLREDUCE.init_values(seed, r, count, dtype) for r in range(n_ranks)]
    result = np.sum(inputs, axis=0, dtype=dtype.storage)
    assert ALLREDUCE.check(result, seed, n_ranks, count, dtype)[0]
    assert not ALLREDUCE.check(result[:-1], seed, n_ranks, count, dtype)[0]


def test_allgather_check_is_exact():
    dtype, count, seed, n_ranks = DTYPES["bf16"], 10, 3, 4
    expected = np.concatenate(
        [ALLGATHER.init_values(seed, r, count, dtype) for r in range(n_ranks)]
    )
    assert ALLGATHER.check(expected, seed, n_ranks, count, dtype) == (True, "")
    tampered = expected.copy()
    tampered[25] ^= 1  # one bit, in rank 2's block
    ok, detail = ALLGATHER.check(tampered, seed, n_ranks, count, dtype)
    assert not ok and "from rank 2" in detail


def test_init_data_depends_on_rank_and_seed_only():
    dtype = DTYPES["f32"]
    a = ALLREDUCE.init_values(1, 0, 64, dtype)
    assert (a == ALLREDUCE.init_values(1, 0, 64, dtype)).all()
    assert not (a == ALLREDUCE.init_values(1, 1, 64, dtype)).all()
    assert (ALLREDUCE.timing_values(1, 0, 64, dtype) == 0).all()
    timed = ALLGATHER.timing_values(1, 2, 64, dtype)
    assert (timed == ALLGATHER.init_values(1, 2, 64, dtype)).all()


# --------------------------------------------------------------------------
# Tables and JSON
# --------------------------------------------------------------------------


def _row(impl, size, avg, valid=None):
    return Row(impl=impl, dtype="bf16", size=size, avg_us=avg, min_us=avg * 0.9 if avg else None,
               max_us=avg * 1.1 if avg else None, iterations=100, valid=valid,
               busbw_gbps=1.25 if avg else None)


def test_single_impl_table_has_osu_columns():
    rows = [_row("mpi", 1024, 1.5, True), _row("mpi", 2048, 2.25, True)]
    lines = report.format_table(rows, ["mpi"])
    assert lines[0].split() == ["#", "Size", "Avg", "Latency(us)"]
    assert lines[1].split() == ["1024", "1.50"]
    full = report.format_table(rows, ["mpi"], full=True, check=True)
    assert full[0].split("  ")[0] == "# Size"
    for column in ("Avg Latency(us)", "Min Latency(us)", "Max Latency(us)", "Iterations",
                   "BusBW(GB/s)", "Validation"):
        assert column in full[0]
    assert full[1].split() == ["1024", "1.50", "1.35", "1.65", "100", "1.250", "Pass"]


def test_full_tables_one_per_implementation_fit_a_terminal():
    rows = [_row(name, size, 2.0, True) for name in ("harmpi", "mpi") for size in (8, 10240)]
    lines = report.format_tables(rows, ["harmpi", "mpi"], check=True, stat="median")
    assert lines[1] == "# harmpi" and lines[6] == "# mpi"
    assert lines[2].startswith("# Size") and "Median Latency(us)" in lines[2]
    assert lines[8].split() == ["8", "2.00", "1.80", "2.20", "100", "1.250", "Pass"]
    assert max(len(line) for line in lines) <= 100


def test_median_header():
    lines = report.format_table([_row("mpi", 8, 1.0)], ["mpi"], stat="median")
    assert "Median Latency(us)" in lines[0]
    assert "  Median" in lines[0]  # still separated from the Size column


def test_multi_impl_table_has_ratio_columns_against_harmpi():
    rows = [_row("harmpi", 10240, 2.0, True), _row("mpi", 10240, 5.0, True),
            _row("gloo", 10240, 1000.0, False), _row("harmpi", 20480, 4.0),
            Row("mpi", "bf16", 20480, None, None, None, 0, None, note="not run")]
    lines = report.format_table(rows, ["harmpi", "mpi", "gloo"], check=True)
    assert "harmpi" in lines[0] and "gloo" in lines[0]  # implementation names above their columns
    assert lines[0].endswith("- / harmpi --")  # over the ratio columns
    assert lines[1].startswith("# Size")
    assert lines[1].split()[-2:] == ["mpi", "gloo"]
    assert max(len(line) for line in lines) <= 100
    first = lines[2].split()
    assert first == ["10240", "2.00", "Pass", "5.00", "Pass", "1000.00", "Fail", "2.50", "500.00"]
    second = lines[3].split()
    assert second == ["20480", "4.00", "-", "n/a", "-", "n/a", "n/a", "n/a", "n/a"]
    # --wide: OSU's labels and named ratio columns, however wide
    wide = report.format_table(rows, ["harmpi", "mpi", "gloo"], check=True, width=None)
    assert wide[1].split()[-2:] == ["mpi/harmpi", "gloo/harmpi"]
    assert "Avg Latency(us)" in wide[1] and "Validation" in wide[1]
    assert wide[2].split() == first


def test_reference_impl_choice():
    assert report.reference_impl(["mpi", "harmpi", "gloo"]) == "harmpi"
    assert report.reference_impl(["mpi", "harmpi:shm"]) == "harmpi:shm"
    assert report.reference_impl(["mpi", "gloo"]) == "mpi"


def test_json_rows_have_the_documented_keys():
    doc = json.loads(report.rows_to_json([_row("harmpi", 10240, 2.0, True)], {"ranks": 2}))
    assert doc["meta"] == {"ranks": 2}
    row = doc["rows"][0]
    for key in ("impl", "dtype", "size", "avg_us", "min_us", "max_us", "iterations", "valid",
                "busbw_gbps", "wire_dtype"):
        assert key in row
    assert row["impl"] == "harmpi" and row["size"] == 10240 and row["valid"] is True


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib not installed")
def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "lat.png"
    rows = [_row("mpi", 8, 1.0), _row("mpi", 16, 2.0), _row("gloo", 8, 900.0)]
    report.plot_rows(rows, ["mpi", "gloo"], str(path), "t")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_parse_impls():
    assert parse_impls("harmpi, harmpi:shm,mpi,gloo") == ["harmpi", "harmpi:shm", "mpi", "gloo"]
    assert parse_impls("torch:harmpi,torch:gloo") == ["torch:harmpi", "torch:gloo"]
    assert parse_impls("gloo,gloo:unbound") == ["gloo", "gloo:unbound"]
    assert parse_impls("torch:harmpi,funcol:harmpi") == ["torch:harmpi", "funcol:harmpi"]
    assert torch_backend("gloo:unbound") == "gloo"
    for bad in ("gloo:x", "gloo:unbound,gloo:unbound", "torch:gloo:unbound"):
        with pytest.raises(ValueError):
            parse_impls(bad)
    for bad in ("", "nccl", "mpi:ring", "mpi,mpi", "harmpi:", "torch", "torch:nccl",
                "gloo,torch:gloo", "torch:harmpi,torch:harmpi", "funcol", "funcol:nccl",
                "funcol:harmpi,funcol:harmpi"):
        with pytest.raises(ValueError):
            parse_impls(bad)


def test_torch_backend_of_each_name():
    assert [torch_backend(n) for n in ("gloo", "torch:gloo", "torch:harmpi", "harmpi", "mpi",
                                       "harmpi:shm")] == ["gloo", "gloo", "harmpi", None, None,
                                                          None]


def test_decode_backends_are_the_osu_adapters():
    for kind in COMM_KINDS:  # no adapter left without the decode benchmark's tensor calls
        assert parse_impls(kind) == [kind]
        adapter = {"harmpi": HarmpiImpl, "mpi": MpiImpl}.get(kind, TorchImpl)
        assert (adapter is TorchImpl) == (torch_backend(kind) is not None)
        for method in ("describe_tensors", "allreduce", "allgather"):
            assert getattr(adapter, method) is not getattr(Impl, method), (kind, method)


def test_decode_comms_refused_with_tp_api():
    import click

    from bench.decode import _parse_comms

    assert _parse_comms("torch:harmpi,gloo", tp_api=True) == ["torch:harmpi", "gloo"]
    assert _parse_comms("harmpi,torch:harmpi,mpi") == ["harmpi", "torch:harmpi", "mpi"]
    with pytest.raises(click.UsageError, match="torch.distributed comms only.*not harmpi, mpi"):
        _parse_comms("harmpi,torch:harmpi,mpi", tp_api=True)
    for bad in ("gloo,torch:gloo", "nccl", "harmpi:shm", ""):
        with pytest.raises(click.UsageError):
            _parse_comms(bad)


def test_tp_api_needs_whole_kv_heads_per_rank():
    cfg = ModelConfig(hidden=64, heads=4, kv_heads=2, ffn=FFN_UNIT * 4, vocab=VOCAB_UNIT * 4)
    cfg.check(4)  # the hand-written path replicates a KV head over 2 ranks
    with pytest.raises(ValueError, match="--tp-api shards k/v evenly"):
        cfg.check(4, even_kv=True)
    cfg.check(2, even_kv=True)


# --------------------------------------------------------------------------
# Decode benchmark, pure parts
# --------------------------------------------------------------------------


def test_shards_partition_heads_ffn_and_vocab():
    cfg = ModelConfig(hidden=256, layers=1, heads=8, kv_heads=2, ffn=FFN_UNIT * 8,
                      vocab=VOCAB_UNIT * 8)
    for tp in (1, 2, 4, 8):
        layouts = [shard_layout(cfg, tp, r) for r in range(tp)]
        assert sorted(h for lay in layouts for h in lay.q_heads) == list(range(8))
        assert sorted(u for lay in layouts for u in lay.ffn_units) == list(range(8))
        assert sorted(u for lay in layouts for u in lay.vocab_units) == list(range(8))
        for lay in layouts:  # each rank holds the KV heads its q heads read
            assert set(lay.kv_heads) == {h // 4 for h in lay.q_heads}
    assert shard_layout(cfg, 8, 5).kv_heads == (1,)  # replicated when ranks outnumber KV heads


def test_model_config_rejects_unshardable_sizes():
    with pytest.raises(ValueError, match="heads"):
        ModelConfig(hidden=256, heads=6, kv_heads=2, ffn=1024, vocab=4096).check(4)
    with pytest.raises(ValueError, match="ffn"):
        ModelConfig(hidden=256, heads=8, kv_heads=2, ffn=100, vocab=4096).check(2)
    with pytest.raises(ValueError, match="vocab"):
        ModelConfig(hidden=256, heads=8, kv_heads=2, ffn=1024, vocab=1000).check(2)
    ModelConfig().check(4)  # the defaults fit the demo's 4 ranks


def test_unit_seeds_are_stable_and_distinct():
    assert unit_seed(1, 0, "q", 3) == unit_seed(1, 0, "q", 3)
    seeds = {
        unit_seed(1, layer, kind, unit)
        for layer in range(3) for kind in ("q", "k") for unit in range(4)
    }
    assert len(seeds) == 24
    assert all(0 <= s < 2**63 for s in seeds)


def test_threads_per_rank():
    assert threads_per_rank(host_cpus=2, local_ranks=4, allowed_cpus=2) == 1
    assert threads_per_rank(host_cpus=8, local_ranks=2, allowed_cpus=8) == 4
    assert threads_per_rank(host_cpus=8, local_ranks=2, allowed_cpus=1) == 1  # bound to one core
    assert threads_per_rank(host_cpus=2, local_ranks=4, allowed_cpus=2, override=3) == 3


def test_round_steps_split_evenly_without_empty_rounds():
    assert round_steps(96, 3) == [32, 32, 32]
    assert round_steps(10, 3) == [4, 3, 3]
    assert round_steps(2, 3) == [1, 1]
    assert sum(round_steps(97, 4)) == 97


def test_first_divergence():
    a = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert first_divergence(a, a.copy()) is None
    b = a.copy()
    b[1, 2] = 0
    assert first_divergence(a, b) == 2
    assert first_divergence(a, a[:, :3]) == 0


def test_collective_latency_excludes_waiting_for_the_last_rank():
    # 2 ranks, 1 step, 2 calls.  Call 0: rank 0 enters at 0, rank 1 at 10; both leave at 12.
    # Call 1: both enter at 20; rank 0 leaves at 25, rank 1 at 23.
    enter = np.array([[[0, 20]], [[10, 20]]])
    exit_ = np.array([[[12, 25]], [[12, 23]]])
    assert collective_latency_ns(enter, exit_).tolist() == [[2 + 5], [2 + 3]]
    # A rank that leaves before the last one enters (a non-blocking leg) counts 0, never negative.
    early = collective_latency_ns(np.array([[[0]], [[10]]]), np.array([[[5]], [[11]]]))
    assert early.tolist() == [[0], [1]]


def test_summarize_backend_and_table():
    step_ns = np.array([[10e6, 12e6, 11e6], [10e6, 12e6, 11e6]])
    comm_ns = np.array([[1e6, 1e6, 1e6], [3e6, 3e6, 3e6]])
    latency_ns = np.array([[0.5e6, 0.5e6, 0.5e6], [1e6, 1e6, 1e6]])
    summary = summarize_backend(step_ns, comm_ns, batch=4, latency_ns=latency_ns,
                                per_round=[2, 1])
    assert summary["ms_per_token"] == pytest.approx(11.0)
    assert summary["tokens_per_s"] == pytest.approx(4000 / 11)
    # rounds: steps [10, 12] (median 11) and [11]
    rounds = summary["tokens_per_s_rounds"]
    assert rounds["each"] == pytest.approx([4000 / 11, 4000 / 11])
    assert rounds["min"] <= rounds["median"] <= rounds["max"]
    # the split of the mean step adds up, and the shares are its columns' ratios
    assert summary["mean_ms_per_token"] == pytest.approx(11.0)
    assert summary["comm_ms_per_token"] == pytest.approx(2.0)
    assert summary["compute_ms_per_token"] == pytest.approx(9.0)
    assert summary["comm_share"] == pytest.approx(2.0 / 11.0)
    assert summary["comm_share_min"] == pytest.approx(3 / 33)
    assert summary["comm_latency_ms_per_token"] == pytest.approx(0.75)
    assert summary["comm_latency_share"] == pytest.approx(0.75 / 11.0)
    assert summarize_backend(step_ns, comm_ns, batch=1)["comm_latency_share"] is None
    # CPU per step: the mean over ranks and steps, and its part of the mean step
    assert summary["cpu_ms_per_token"] is None and summary["cpu_share"] is None
    cpu_ns = np.array([[5e6, 6e6, 4e6], [10e6, 12e6, 11e6]])
    cpu = summarize_backend(step_ns, comm_ns, batch=4, cpu_ns=cpu_ns)
    assert cpu["cpu_ms_per_token"] == pytest.approx(8.0)
    assert cpu["cpu_share"] == pytest.approx(8.0 / 11.0)
    row = dict(summary, comm="harmpi", prefill_ms=5.0, tokens_identical_across_ranks=True)
    lines = format_decode_table([row])
    assert lines[1].startswith("# comm") and "tok/s" in lines[1]
    assert lines[2].split()[0] == "harmpi" and lines[2].split()[-1] == "yes" and "18.2%" in lines[2]
    assert "363.6-363.6" in lines[2]


def test_round_spread_of_tokens_per_s():
    step_ns = np.array([[10e6, 20e6, 40e6, 40e6]])  # one rank, rounds of 1, 1 and 2 steps
    assert round_tokens_per_s(step_ns, [1, 1, 2], batch=2) == pytest.approx([200, 100, 50])


@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_model_weights_do_not_depend_on_the_rank_count():
    import torch

    from bench.model import TPDecoder

    cfg = ModelConfig(hidden=64, layers=1, heads=4, kv_heads=2, ffn=FFN_UNIT * 4,
                      vocab=VOCAB_UNIT * 4)
    whole = TPDecoder(cfg, shard_layout(cfg, 1, 0), seed=9, batch=1, max_len=4)
    halves = [TPDecoder(cfg, shard_layout(cfg, 2, r), seed=9, batch=1, max_len=4) for r in range(2)]
    assert torch.equal(torch.cat([h.w_lm for h in halves]), whole.w_lm)
    assert torch.equal(torch.cat([h.layers[0].w_o for h in halves], dim=1), whole.layers[0].w_o)
    w_down = torch.cat([h.layers[0].w_down for h in halves], dim=1)
    assert torch.equal(w_down, whole.layers[0].w_down)
    gate = torch.cat([h.layers[0].w_gate_up.chunk(2)[0] for h in halves])
    assert torch.equal(gate, whole.layers[0].w_gate_up.chunk(2)[0])


@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_single_rank_decode_is_deterministic():
    import torch

    from bench.model import TPDecoder

    class NoComm:
        def allreduce(self, tensor):
            pass

        def allgather(self, tensor):
            return tensor

    cfg = ModelConfig(hidden=64, layers=2, heads=4, kv_heads=2, ffn=FFN_UNIT * 2,
                      vocab=VOCAB_UNIT * 2)
    runs = []
    for _ in range(2):
        model = TPDecoder(cfg, shard_layout(cfg, 1, 0), seed=3, batch=2, max_len=8)
        prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
        with torch.inference_mode():
            token = model.forward(prompt, 0, NoComm())
            tokens = [token]
            for pos in range(3, 6):
                token = model.forward(token.view(-1, 1), pos, NoComm())
                tokens.append(token)
        runs.append(torch.stack(tokens, 1))
    assert torch.equal(runs[0], runs[1])
    assert runs[0].shape == (2, 4) and int(runs[0].max()) < cfg.vocab


# --------------------------------------------------------------------------
# Demo, pure parts
# --------------------------------------------------------------------------


def test_mpirun_argv_oversubscribes_only_when_needed():
    argv = mpirun_argv(2, "bench.osu_allreduce", ["-c"], mpirun="mpirun", python="py", host_cpus=2)
    assert argv == ["mpirun", "-np", "2", "py", "-m", "mpi4py", "-m", "bench.osu_allreduce", "-c"]
    argv = mpirun_argv(4, "bench.decode", [], mpirun="mpirun", python="py", host_cpus=2)
    assert argv[:4] == ["mpirun", "-np", "4", "--oversubscribe"]


def test_summary_lines_from_json_documents():
    rows = [{"impl": impl, "size": size, "avg_us": us} for impl, size, us in
            [("harmpi", 10240, 4.0), ("mpi", 10240, 8.0), ("gloo", 10240, 1600.0),
             ("harmpi", 4194304, 1000.0)]]
    decode = {"meta": {"ranks": 4}, "rows": [
        {"comm": "harmpi", "tokens_per_s": 80.0, "ms_per_token": 12.5, "comm_share": 0.2,
         "comm_latency_share": 0.05, "compute_ms_per_token": 9.0,
         "tokens_agree": True},
        {"comm": "gloo", "tokens_per_s": 10.0, "ms_per_token": 100.0, "comm_share": 0.8,
         "comm_latency_share": None, "compute_ms_per_token": 20.0,
         "tokens_agree": False, "first_divergence": 7},
    ]}
    text = "\n".join(summary_lines([("1 node x 2 ranks", {"rows": rows})], decode))
    assert "2.00x" in text and "400.00x" in text  # mpi/harmpi and gloo/harmpi at 10 KB
    assert "harmpi/gloo 8.00x" in text
    assert "gloo no (first divergence at generated token 7)" in text
    decode["rows"][1]["prefill_logits_gap_ulps"] = 2.0
    text_gap = "\n".join(summary_lines([], decode))
    assert "largest difference in bf16 ulps of the largest logit: gloo 2.0" in text_gap
    assert ("harmpi: compute 9.0 ms/token; 20.0% of the step inside collectives, "
            "5.0% after the last rank arrived") in text
    # several decode runs, each under its label
    text = "\n".join(summary_lines([], [("MPI on shm", decode), ("MPI on TCP", decode)]))
    assert text.count("harmpi/gloo 8.00x") == 2
    assert "2 virtual nodes x 2, MPI on TCP;" in text and "2 virtual nodes x 2, MPI on shm;" in text


# --------------------------------------------------------------------------
# Under mpirun
# --------------------------------------------------------------------------


def _impls():
    return ("harmpi,torch:harmpi,mpi,gloo,gloo:unbound" if HAVE_HARMPI
            else "mpi,gloo,gloo:unbound")


@pytest.mark.timeout(180)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_osu_allreduce_under_mpirun(tmp_path):
    json_path = tmp_path / "ar.json"
    proc = run_module(2, "bench.osu_allreduce",
                      ["-m", "1024:4096", "-i", "5", "-x", "2", "-c", "-f", "--impl", _impls(),
                       "--json", str(json_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    title = f"Allreduce Latency Test v{_version()}"
    assert any(line.startswith("# ") and line.endswith(title) for line in lines), proc.stdout
    assert any(line.startswith("# Datatype: bf16") for line in lines)
    assert any(line.startswith("# Size") and "Avg Latency(us)" in line and "Validation" in line
               for line in lines)
    assert "# mpi: MPI_Allreduce(MPI_IN_PLACE, SUM) float32, same bytes" in proc.stdout
    # -f with several implementations: the compact table (one line per implementation
    # when side by side would not fit 100 columns), then one OSU table per implementation
    compact = lines[: lines.index("#")]
    table = [line.split() for line in compact if line[:1].isdigit()]
    names = _impls().split(",")
    assert sorted({int(row[0]) for row in table}) == [1024, 2048, 4096]
    if len(table) == 3:  # side by side
        assert all(row.count("Pass") == len(names) for row in table), proc.stdout
    else:
        assert [row[1] for row in table] == names * 3 and all(row[-2] == "Pass" for row in table)
    for name in _impls().split(","):
        at = lines.index(f"# {name}")
        assert "Min Latency(us)" in lines[at + 1] and "BusBW(GB/s)" in lines[at + 1]
        assert [line.split()[-1] for line in lines[at + 2: at + 5]] == ["Pass"] * 3
    assert max(len(line) for line in lines) <= 100
    doc = json.loads(json_path.read_text())
    assert doc["meta"]["latency_fields"]["avg_us"].startswith("mean over ranks")
    assert {row["impl"] for row in doc["rows"]} == set(_impls().split(","))
    assert all(row["valid"] is True and row["avg_us"] > 0 for row in doc["rows"])


@pytest.mark.timeout(180)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_osu_allgather_under_mpirun():
    proc = run_module(2, "bench.osu_allgather",
                      ["-m", "2:64", "-i", "3", "-x", "1", "-c", "--impl", _impls()])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Allgather Latency Test" in proc.stdout
    table = [line.split() for line in proc.stdout.splitlines() if line[:1].isdigit()]
    names = _impls().split(",")
    sides = 1 if len(table) == 6 else len(names)  # side by side, else a line per implementation
    assert len(table) == 6 * sides and all("Fail" not in row for row in table)
    assert sum(row.count("Pass") for row in table) == 6 * len(names)
    assert max(len(line) for line in proc.stdout.splitlines()) <= 100


@pytest.mark.timeout(180)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_adapters_on_tensors_under_mpirun():
    # allreduce(tensor) / allgather(tensor), the calls the decode benchmark makes
    proc = run_module(2, "tests.support.bench_adapters_check", [_impls()])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"adapters ok: {_impls()}" in proc.stdout


def _decode_args(comms, json_path):
    """A tiny model, a few steps."""
    return ["--comm", comms, "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
            "--ffn", "256", "--vocab", "1024", "--batch", "2", "--prompt-len", "4",
            "--tokens", "4", "--warmup", "1", "--json", str(json_path)]


@pytest.mark.timeout(180)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_decode_under_mpirun(tmp_path):
    json_path = tmp_path / "decode.json"
    comms = "harmpi,torch:harmpi,gloo,mpi" if HAVE_HARMPI else "gloo,mpi"
    proc = run_module(2, "bench.decode", _decode_args(comms, json_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Threads per rank:" in proc.stdout
    doc = json.loads(json_path.read_text())
    rows = {row["comm"]: row for row in doc["rows"]}
    assert set(rows) == set(comms.split(","))
    for name in comms.split(","):
        row = rows[name]
        assert row["tokens_identical_across_ranks"] is True
        assert row["tokens_per_s"] > 0 and 0 <= row["comm_share"] <= 1
        assert 0 <= row["comm_latency_share"] <= row["comm_share"]
        assert "ms_per_token" in row and "tokens_agree" in row
        assert row["cpu_ms_per_token"] > 0 and row["cpu_share"] > 0
    assert "# CPU per rank and step" in proc.stdout
    if HAVE_HARMPI:
        # the same harmpi sums through torch.distributed: the same tokens
        assert rows["torch:harmpi"]["tokens_agree"] is True
        assert rows["torch:harmpi"]["tokens_sha"] == rows["harmpi"]["tokens_sha"]


@pytest.mark.timeout(180)
@pytest.mark.skipif(not HAVE_TORCH or not HAVE_HARMPI, reason="torch or harmpi not installed")
def test_decode_tp_api_under_mpirun(tmp_path):
    # torch's parallelize_module on a harmpi and on a gloo group, one job. At 2
    # ranks each all-reduce adds two bf16 partial sums and rounds once, which
    # is the same whichever rank's comes first, and the gathers move bytes, so
    # the two backends must give the same tokens exactly (not just logits
    # within a bf16 bound).
    json_path = tmp_path / "decode.json"
    proc = run_module(2, "bench.decode",
                      ["--tp-api"] + _decode_args("torch:harmpi,torch:gloo", json_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "parallelize_module" in proc.stdout
    doc = json.loads(json_path.read_text())
    rows = {row["comm"]: row for row in doc["rows"]}
    assert set(rows) == {"torch:harmpi", "torch:gloo"} and doc["meta"]["tp_api"] is True
    for row in rows.values():
        assert row["tokens_identical_across_ranks"] is True and row["tp_api"] is True
        assert row["tokens_per_s"] > 0 and 0 < row["comm_share"] <= 1
    assert rows["torch:gloo"]["tokens_agree"] is True
    assert rows["torch:gloo"]["tokens_sha"] == rows["torch:harmpi"]["tokens_sha"]
    # DTensor's layers hold the hand-written path's shards, and per output element
    # a split q/k/v or gate/up product is the fused one's dot product: the
    # hand-written model's tokens (observed exact here, also for the default
    # model over 96 tokens)
    hand_path = tmp_path / "hand.json"
    proc = run_module(2, "bench.decode", _decode_args("torch:harmpi", hand_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    hand = json.loads(hand_path.read_text())["rows"][0]
    assert hand["tp_api"] is False and hand["tokens_sha"] == rows["torch:harmpi"]["tokens_sha"]


@pytest.mark.timeout(120)
@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")
def test_decode_tp_api_refuses_other_comms():
    proc = run_module(1, "bench.decode", ["--tp-api", "--comm", "harmpi,gloo"], timeout_s=60)
    assert proc.returncode != 0
    assert "torch.distributed comms only" in proc.stderr and "not harmpi" in proc.stderr


def _version():
    from bench.job import bench_version

    return bench_version()


# --------------------------------------------------------------------------
# Command-line behaviour shared by the bench tools
# --------------------------------------------------------------------------


def test_json_meta_says_which_statistic_each_latency_field_holds():
    fields = report.latency_fields("median")
    assert "each rank's median" in fields["avg_us"] and "mean over ranks" in fields["avg_us"]
    assert "Median Latency(us)" in fields["avg_us"]
    assert "smallest over ranks" in fields["min_us"] and "largest" in fields["max_us"]
    with pytest.raises(KeyError):
        report.latency_fields("p99")


@pytest.mark.parametrize("rank, shown", [("0", True), ("1", False)])
def test_help_prints_on_rank_0_only(monkeypatch, rank, shown):
    from click.testing import CliRunner

    from bench.osu_allreduce import main

    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", rank)
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    assert ("--message-size" in result.output) is shown


def test_divergence_is_explained_by_a_near_tie_or_flagged():
    # top logit 4.0: a bf16 ulp there is 2^(2-7) = 1/32
    assert top2_margin_ulps(np.array([[4.0, 4.0 - 2 / 32, 0.0], [1.0, -1.0, 0.0]])) == 2.0
    assert divergence_note(None, None) == "yes"
    assert "near tie" in divergence_note(5, 2.0) and "token 5" in divergence_note(5, 2.0)
    assert "CHECK" in divergence_note(5, 100.0)


def test_demo_says_why_harmpi_loses_a_decode():
    def row(comm, tok_s, low, high, compute_ms, comm_ms):
        return {"comm": comm, "tokens_per_s": tok_s, "ms_per_token": 4000 / tok_s,
                "comm_share": 0.1, "compute_ms_per_token": compute_ms,
                "comm_ms_per_token": comm_ms, "tokens_agree": True,
                "tokens_per_s_rounds": {"min": low, "median": tok_s, "max": high}}

    noisy = {"meta": {"ranks": 4}, "rows": [row("harmpi", 90.0, 80.0, 100.0, 9.0, 1.0),
                                            row("mpi", 95.0, 85.0, 105.0, 9.0, 1.0)]}
    text = "\n".join(summary_lines([], noisy))
    assert "harmpi loses to mpi here" in text and "within the spread across rounds" in text
    slower = {"meta": {"ranks": 4}, "rows": [row("harmpi", 50.0, 49.0, 51.0, 12.0, 1.0),
                                             row("mpi", 90.0, 89.0, 91.0, 9.0, 1.5)]}
    assert "its compute is 3.00 ms/token slower" in "\n".join(summary_lines([], slower))
    faster = {"meta": {"ranks": 4}, "rows": [row("harmpi", 90.0, 89.0, 91.0, 9.0, 1.0),
                                             row("mpi", 50.0, 49.0, 51.0, 9.0, 1.5)]}
    assert "loses" not in "\n".join(summary_lines([], faster))


def test_demo_names_allreduce_losses_and_what_binding_costs_gloo():
    rows = [{"impl": impl, "size": size, "avg_us": us} for impl, size, us in
            [("harmpi", 10240, 4.0), ("mpi", 10240, 8.0), ("gloo", 10240, 3000.0),
             ("gloo:unbound", 10240, 1000.0), ("harmpi", 4194304, 1000.0),
             ("mpi", 4194304, 800.0)]]
    text = "\n".join(summary_lines([("1 node x 2", {"rows": rows})], None))
    assert "harmpi is slower than mpi at 4194304 B (0.80x)" in text
    assert "gloo bound as the ranks / gloo:unbound at 10240 B: 3.00x" in text
    assert "1000 (250.00x)" in text  # gloo:unbound: its latency (gloo:unbound/harmpi)


def test_logits_gap_in_bf16_ulps_of_the_largest_logit():
    reference = np.array([[4.0, -1.0], [0.5, 2.0]])  # largest 4.0: ulp 1/32
    assert logits_gap_ulps(reference, reference) == 0.0
    assert logits_gap_ulps(reference, reference + [[0, 3 / 32], [0, 0]]) == pytest.approx(3.0)


def test_demo_says_why_harmpi_loses_in_set_ups_that_are_not_like_for_like():
    """Virtual nodes against MPI on shared memory, and more ranks than
    cores, are named as the reason next to the sizes harmpi lost."""
    from bench.demo import loss_reasons

    meta = {"topology": {"ranks": 4, "hosts": 1, "virtual": True},
            "harmpi_info": {"oversubscribed": True}}
    rows = [{"impl": "harmpi", "size": 2048, "avg_us": 50.0},
            {"impl": "mpi", "size": 2048, "avg_us": 25.0}]
    shm = {"meta": meta, "rows": rows, "demo": {"env": {"HARMPI_RANKS_PER_NODE": "2"}}}
    tcp = {"meta": meta, "rows": rows,
           "demo": {"env": {"HARMPI_RANKS_PER_NODE": "2", "OMPI_MCA_btl": "tcp,self"}}}
    assert len(loss_reasons(shm)) == 2 and "shared memory" in loss_reasons(shm)[0]
    assert len(loss_reasons(tcp)) == 1 and "time slice" in loss_reasons(tcp)[0]
    quiet = {"meta": {"topology": {"ranks": 2, "hosts": 1, "virtual": False},
                      "harmpi_info": {"oversubscribed": False}}}
    assert loss_reasons(quiet) == []
    text = "\n".join(summary_lines([("2 vnodes x 2, MPI on shm", shm)], None))
    assert "harmpi is slower than mpi at 2048 B (0.50x)" in text
    assert "why: MPI sees one host" in text and "why: 4 ranks share" in text


def test_wait_cost_under_mpirun():
    """bench.wait_cost: every policy gets a row with a CPU share and a
    wake-up, and a waiting rank asleep (auto, sleep) uses far less of a
    core than one spinning (the late rank is 0.5 s late); the machine's
    floor rows come too, a read(2) asleep and one polled."""
    result = run_module(2, "bench.wait_cost", ["--late-s", "0.5", "--repeats", "2"],
                        timeout_s=300)
    assert result.returncode == 0, result.stdout + result.stderr
    names = ("spin", "auto", "sleep", "pipe-block", "pipe-poll")
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()
            if line.split()[:1] and line.split()[0] in names}
    assert set(rows) == set(names), result.stdout
    share = {name: float(cols[1]) for name, cols in rows.items()}
    assert share["auto"] < 5 and share["sleep"] < 5, result.stdout
    assert share["pipe-block"] < 5 < share["pipe-poll"], result.stdout
    assert all(float(cols[4]) > 0 and float(cols[6]) > 0 for cols in rows.values()), result.stdout
    assert all(len(line) <= 100 for line in result.stdout.splitlines())


def test_alltoall_descriptor_checks_each_ranks_blocks():
    """ALLTOALL: rank q gets block q of every rank's input, in rank order; any
    other block, or a block from the wrong rank, fails the check."""
    dtype, n, count = DTYPES["bf16"], 3, 5
    inputs = [ALLTOALL.init_values(7, r, count, dtype, n) for r in range(n)]
    assert all(len(x) == n * count for x in inputs)
    for q in range(n):
        got = np.concatenate([x[q * count:(q + 1) * count] for x in inputs])
        assert ALLTOALL.check(got, 7, n, count, dtype, rank=q) == (True, "")
        ok, detail = ALLTOALL.check(got, 7, n, count, dtype, rank=(q + 1) % n)
        assert not ok and "values differ" in detail
    swapped = np.concatenate([inputs[1][:count], inputs[0][:count], inputs[2][:count]])
    ok, detail = ALLTOALL.check(swapped, 7, n, count, dtype, rank=0)
    assert not ok and "from rank 0" in detail
    assert ALLTOALL.busbw_factor(4) == 3.0 and ALLTOALL.blocks(4) == 4
