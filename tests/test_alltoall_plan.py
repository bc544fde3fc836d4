"""The all-to-all plan's named fields: PLAN_FIELDS, the accessors and the
offsets harmpi/_native.cpp writes and reads agree (no MPI, no kernels run)."""

import re
from pathlib import Path

import numpy as np

from harmpi.algorithms.alltoall import plan

NATIVE = Path(__file__).resolve().parents[1] / "harmpi" / "_native.cpp"
VIEWS = {"send": plan.send, "expect": plan.expect, "recv": plan.recv,
         "send_off": plan.send_off, "recv_off": plan.recv_off}
WORDS = {"steps": plan.steps_at, "bad_pair": plan.bad_pair_at, "even_rows": plan.even_rows_at}


def test_the_accessors_follow_plan_fields_in_order():
    for P in (1, 2, 3, 8):
        p = np.arange(plan.plan_words(P), dtype=np.int64)
        at = 0
        for name, words in plan.PLAN_FIELDS:
            if words == "P":
                view = VIEWS[name](p, P)
                assert view.tolist() == list(range(at, at + P)), (name, P)
                assert np.shares_memory(view, p), name
                at += P
            else:
                assert WORDS[name](P) == at, (name, P)
                at += words
        assert at == plan.plan_words(P) == plan.new_plan(P).size


def test_native_cpp_uses_the_same_offsets():
    text = NATIVE.read_text()
    assert "scratch.resize(static_cast<size_t>(5 * n + 3))" in text
    assert set(re.findall(r"plan\[5 \* n \+ (\d)\]", text)) == {"1", "2"}
    P = 5
    assert plan.plan_words(P) == 5 * P + 3
    assert plan.bad_pair_at(P) == 5 * P + 1 and plan.even_rows_at(P) == 5 * P + 2


def test_an_even_split_fills_send_and_expect():
    P = 3
    p = plan.new_plan(P)
    p[plan.even_rows_at(P)] = 4
    plan.spread_even_rows(p, P)
    assert plan.send(p, P).tolist() == plan.expect(p, P).tolist() == [4] * P
    p[plan.even_rows_at(P)] = -1
    plan.send(p, P)[:] = [1, 2, 3]
    plan.spread_even_rows(p, P)
    assert plan.send(p, P).tolist() == [1, 2, 3]
    assert plan.prefix(plan.send(p, P), plan.send_off(p, P), P) == 6
    assert plan.send_off(p, P).tolist() == [0, 1, 3]
    assert plan.pair_mismatch(p, P) == (0, 0)  # (a zeroed bad_pair word names pair 0)
    p[plan.bad_pair_at(P)] = -1
    assert plan.pair_mismatch(p, P) is None


def test_many_node_turns_pair_every_node_once_doubling_partners_first():
    """many_nodes_tcp.partner: in every turn the nodes pair off (g's partner's
    partner is g); over the G - 1 turns each node meets every other once;
    the first log2 G turns are the all-reduce's doubling partners g ^ 1,
    g ^ 2, ... (a refusal's all-reduce meets them in the same order)."""
    from harmpi.algorithms.alltoall.many_nodes_tcp import alltoall_compiled, partner

    assert [G for G in range(1, 40) if alltoall_compiled(G)] == [2, 4, 8, 16, 32]
    for G in (2, 4, 8, 16, 32):
        k = G.bit_length() - 1
        for g in range(G):
            met = [partner(G, g, t) for t in range(G - 1)]
            assert sorted(met) == [h for h in range(G) if h != g], (G, g, met)
            assert met[:k] == [g ^ (1 << b) for b in range(k)], (G, g, met)
            for t, h in enumerate(met):
                assert partner(G, h, t) == g, (G, g, t)
