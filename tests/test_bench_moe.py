"""bench.moe_decode (and bench.osu_alltoall's uneven counts): the routing, weight
and layout helpers without MPI, a whole decode in one process through stand-in
comms, then one short run under mpirun at 2 ranks."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.have import HAVE_HARMPI, HAVE_TORCH

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed")

if HAVE_TORCH:
    import torch

    from bench.model import FFN_UNIT
    from bench.moe_decode import decode_round, format_table, parse_comms, summarize
    from bench.moe_model import (
        MoEConfig,
        MoEDecoder,
        combine_pairs,
        dispatch_plan,
        ep_shard,
        expert_weights,
        route,
        run_experts,
        tp_shard,
    )

TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, experts=4, topk=2, expert_ffn=128,
            vocab=512)


def test_route_takes_the_top_k_of_the_softmax_and_renormalises():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 8, generator=gen).to(torch.bfloat16)
    weights, experts = route(logits, 3)
    probs = torch.softmax(logits.float(), dim=-1)
    assert experts.shape == weights.shape == (6, 3) and experts.dtype == torch.int64
    for t in range(6):
        top = torch.argsort(probs[t], descending=True)[:3]
        assert experts[t].tolist() == top.tolist()
        expect = probs[t][top] / probs[t][top].sum()
        torch.testing.assert_close(weights[t], expect)
    torch.testing.assert_close(weights.sum(-1), torch.ones(6))
    # top-1: weight 1 exactly
    w1, e1 = route(logits, 1)
    assert torch.equal(w1, torch.ones(6, 1)) and torch.equal(e1[:, 0], probs.argmax(-1))


def test_dispatch_plan_groups_pairs_by_owner_stably():
    experts = torch.tensor([[5, 0], [1, 4], [7, 6], [2, 3]])  # 8 experts, 2 per rank, 4 ranks
    order, counts = dispatch_plan(experts, 4, 2)
    owners = (experts.reshape(-1) // 2)[order]
    assert counts == [2, 2, 2, 2] and owners.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert order.tolist() == [1, 2, 6, 7, 0, 3, 4, 5]  # pair order kept within an owner
    # a rank that receives nothing, a rank that receives everything
    order, counts = dispatch_plan(torch.tensor([[0, 1], [1, 0]]), 2, 2)
    assert counts == [4, 0] and order.tolist() == [0, 1, 2, 3]


def test_combine_pairs_is_the_weighted_sum_rounded_once():
    gen = torch.Generator().manual_seed(5)
    pair_out = torch.randn(3, 2, 16, generator=gen).to(torch.bfloat16)
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.9, 0.1]])
    got = combine_pairs(pair_out, weights)
    ref = (pair_out.double() * weights.double()[..., None]).sum(1)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), ref, rtol=2**-8, atol=1e-6)
    assert torch.equal(got, (pair_out[:, 0].float() * weights[:, :1]
                             + pair_out[:, 1].float() * weights[:, 1:]).to(torch.bfloat16))


def test_expert_slices_are_the_whole_experts_units():
    cfg = MoEConfig(**TINY)
    units = list(range(cfg.expert_ffn // FFN_UNIT))
    gate_up, down = expert_weights(7, 1, 2, units, cfg)
    assert gate_up.shape == (2 * cfg.expert_ffn, cfg.hidden)
    assert down.shape == (cfg.hidden, cfg.expert_ffn)
    halves = [expert_weights(7, 1, 2, units[:1], cfg), expert_weights(7, 1, 2, units[1:], cfg)]
    f = cfg.expert_ffn
    assert torch.equal(gate_up[:f], torch.cat([h[0][:FFN_UNIT] for h in halves]))
    assert torch.equal(gate_up[f:], torch.cat([h[0][FFN_UNIT:] for h in halves]))
    assert torch.equal(down, torch.cat([h[1] for h in halves], dim=1))
    assert not torch.equal(expert_weights(7, 1, 3, units, cfg)[0], gate_up)  # another expert

    # the FFN in float64: the whole expert = the sum of its slices (what TP all-reduces)
    def ffn(w, x):
        g, u = (x @ w[0].double().T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(g) * u) @ w[1].double().T

    x = torch.randn(3, cfg.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ffn((gate_up, down), x), ffn(halves[0], x) + ffn(halves[1], x))


def test_run_experts_sends_each_row_through_its_expert():
    cfg = MoEConfig(**TINY)
    experts = {e: expert_weights(1, 0, e, [0, 1], cfg) for e in (4, 9)}
    rows = torch.randn(5, cfg.hidden, generator=torch.Generator().manual_seed(2)).to(
        torch.bfloat16)
    ids = torch.tensor([9, 4, 9, 9, 4])
    got = run_experts(experts, rows, ids)
    F = torch.nn.functional
    for i, e in enumerate(ids.tolist()):  # row by row, the same bf16 ops
        g, u = F.linear(rows[i:i + 1], experts[e][0]).chunk(2, dim=-1)
        ref = F.linear(F.silu(g) * u, experts[e][1]).double()
        scale = float(ref.abs().max())
        torch.testing.assert_close(got[i:i + 1].double(), ref, rtol=0, atol=2**-7 * scale)
    assert run_experts(experts, rows[:0], ids[:0]).shape == (0, cfg.hidden)


def test_shards_cover_the_model_once():
    cfg = MoEConfig(**TINY)
    ep = [ep_shard(cfg, 2, r, 4) for r in range(2)]
    tp = [tp_shard(cfg, 2, r, 4) for r in range(2)]
    assert ep[0].experts + ep[1].experts == tuple(range(4))
    assert ep[0].sequences == (0, 1) and ep[1].sequences == (2, 3)
    assert ep[1].q_heads == tuple(range(4)) and len(ep[1].ffn_units) == 2
    assert tp[0].ffn_units + tp[1].ffn_units == (0, 1) and tp[1].experts == tuple(range(4))
    assert tp[0].q_heads == (0, 1) and tp[0].kv_heads == (0,) and tp[1].kv_heads == (1,)
    assert tp[0].sequences == tuple(range(4))
    assert len(tp[0].vocab_units) + len(tp[1].vocab_units) == 2
    for bad, text in ((dict(experts=3), "experts 3"), (dict(expert_ffn=64), "expert-ffn"),
                      (dict(topk=5), "topk 5"), (dict(heads=3), "hidden 64")):
        with pytest.raises(ValueError, match=text):
            MoEConfig(**(TINY | bad)).check(2, 4)
    with pytest.raises(ValueError, match="batch 3"):
        MoEConfig(**TINY).check(2, 3)


def test_parse_comms():
    assert parse_comms("ep:harmpi, tp:harmpi,ep:torch:harmpi") == [
        "ep:harmpi", "tp:harmpi", "ep:torch:harmpi"]
    for bad in ("harmpi", "ep:nccl", "ep:mpi,ep:mpi", ""):
        with pytest.raises(ValueError, match="--comm"):
            parse_comms(bad)


class _OneRankEP:
    """All-to-all on one rank (an adapter's alltoall): what is sent comes back."""

    def alltoall(self, rows, send_counts=None, recv_counts=None, out=None):
        if recv_counts is not None:
            assert list(send_counts) == list(recv_counts)
        return rows.clone(), list(send_counts)


class _OneRankTP:
    def allreduce(self, tensor):
        pass

    def allgather(self, tensor):
        return tensor.clone()


def test_one_rank_ep_and_tp_decode_the_same_tokens():
    # one rank: both layouts hold the whole model and run the whole batch, the
    # dispatch plan keeps pair order, so the arithmetic is the same op for op
    cfg = MoEConfig(**TINY)
    prompt = torch.randint(0, cfg.vocab, (2, 3), generator=torch.Generator().manual_seed(4))
    runs = {}
    for mode, shard, comm in (("ep", ep_shard(cfg, 1, 0, 2), _OneRankEP()),
                              ("tp", tp_shard(cfg, 1, 0, 2), _OneRankTP())):
        model = MoEDecoder(cfg, shard, seed=9, max_len=16)
        runs[mode] = decode_round(model, comm, prompt, 1, 5, lambda: None)
    ep, tp = runs["ep"], runs["tp"]
    assert ep.tokens.shape == (2, 7) and np.array_equal(ep.tokens, tp.tokens)
    assert np.array_equal(ep.prefill_logits, tp.prefill_logits)
    assert ep.calls_per_step == 2 * cfg.layers and tp.calls_per_step == 2 * cfg.layers + 1
    assert ep.margin_ulps.shape == (2, 7) and (ep.margin_ulps >= 0).all()
    assert (ep.expert_rows == 2 * cfg.topk).all()  # one rank: every pair comes here
    assert ep.enter_ns.shape == (5, 2 * cfg.layers) and tp.exit_ns.shape == (5, 2 * cfg.layers + 1)
    assert (tp.exit_ns >= tp.enter_ns).all() and (tp.enter_ns > 0).all()
    # a second round from the prompt repeats the first
    again = decode_round(MoEDecoder(cfg, ep_shard(cfg, 1, 0, 2), 9, 16), _OneRankEP(), prompt,
                         1, 5, lambda: None)
    assert np.array_equal(again.tokens, ep.tokens)


def test_summarize_and_table():
    step_ns = np.array([[10e6, 20e6, 10e6, 10e6], [10e6, 20e6, 10e6, 30e6]])
    comm_ns = step_ns / 4
    s = summarize(step_ns, comm_ns, batch=4, per_round=[1, 3])
    assert s["ms_per_step"] == pytest.approx(15.0) and s["tokens_per_s"] == pytest.approx(4e3 / 15)
    assert s["comm_share"] == pytest.approx(0.25)
    assert s["compute_ms_per_step"] + s["comm_ms_per_step"] == pytest.approx(15.0)
    assert s["tokens_per_s_min"] == pytest.approx(4e3 / 20)  # round 2: median of 20, 10, 20
    assert s["tokens_per_s_max"] == pytest.approx(4e3 / 10)
    rows = [dict(s, comm=name, mode=name[:2], calls_per_step=9, tokens_agree=agree)
            for name, agree in (("ep:torch:harmpi", True), ("tp:harmpi", False))]
    lines = format_table(rows)
    assert max(len(line) for line in lines) <= 100
    assert lines[1].split()[0] == "ep:torch:harmpi" and lines[1].split()[-1] == "yes"
    assert lines[2].split()[-1] == "no"


def test_osu_alltoall_uneven_counts_and_cases():
    from bench.osu_alltoall import Case, count_schedule

    sched = count_schedule(3, 4096, seed=1)
    assert sched.shape == (16, 3, 3) and sched.min() >= 0 and sched.max() <= 2048
    assert abs(sched.mean() - 1024) < 150  # a size is the mean
    assert np.array_equal(sched, count_schedule(3, 4096, seed=1))
    counts = np.array([[1, 0, 2], [3, 1, 0], [0, 2, 2]])
    cases = [Case(r, 3, counts) for r in range(3)]
    assert cases[0].inp.tolist() == [0, 2, 2]
    assert cases[2].expected.tolist() == [2, 2, 8, 8]  # from rank 0, none from 1, from 2
    # what every rank receives is what the others cut for it
    for r in range(3):
        pieces = [cases[s].inp.split(cases[s].send_counts)[r] for s in range(3)]
        assert torch.equal(torch.cat(pieces), cases[r].expected)


# --------------------------------------------------------------------------
# Under mpirun
# --------------------------------------------------------------------------


@pytest.mark.timeout(360)
@pytest.mark.parametrize("ranks_per_node", [None, 1], ids=["1x2", "2x1"])
def test_moe_decode_under_mpirun(tmp_path, ranks_per_node):
    from support.jobs import run_module

    env = {} if ranks_per_node is None else {"HARMPI_RANKS_PER_NODE": str(ranks_per_node)}
    json_path = tmp_path / "moe.json"
    comms = ("ep:harmpi,ep:mpi,ep:gloo,ep:torch:harmpi,tp:harmpi" if HAVE_HARMPI
             else "ep:mpi,ep:gloo")
    args = ["--comm", comms, "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads",
            "2", "--experts", "4", "--expert-ffn", "128", "--vocab", "512", "--batch", "4",
            "--prompt-len", "4", "--steps", "6", "--rounds", "2", "--warmup", "1",
            "--json", str(json_path)]
    proc = run_module(2, "bench.moe_decode", args, env=env, timeout_s=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert [line.split()[0] for line in lines if line.split()[:1]
            and line.split()[0] in comms.split(",")] == comms.split(",")
    doc = json.loads(json_path.read_text())
    rows = {row["comm"]: row for row in doc["rows"]}
    assert set(rows) == set(comms.split(","))
    assert doc["meta"]["topology"]["nodes"] == (1 if ranks_per_node is None else 2)
    for name, row in rows.items():
        assert row["tokens_identical_across_ranks"] is True
        assert row["tokens_per_s"] > 0 and 0 <= row["comm_share"] <= 1
        assert 0 <= row["own_ms_per_step"] <= row["comm_ms_per_step"]
        assert np.asarray(row["tokens"]).shape == (4, 1 + 1 + 3)  # the longest round's
        if name.startswith("ep:"):  # the all-to-alls move bytes: bitwise the same tokens
            assert row["tokens_agree"] is True and row["prefill_logits_gap_ulps"] == 0
            assert row["calls_per_step"] == 2 * 2
            # batch 4 x top-2 rows over 2 ranks: 4 each on average, the busiest 4..8
            assert row["expert_rows_mean"] == 4.0 and 4 <= row["expert_rows_busiest"] <= 8
        else:
            assert row["calls_per_step"] == 2 * 2 + 1
