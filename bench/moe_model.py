"""The MoE benchmark's model: a Qwen3-MoE-shaped decoder at small scale with
seeded bf16 weights, in an expert-parallel or a tensor-parallel layout
(``bench.moe_decode`` runs it).

Per layer: RMSNorm, rotary attention with grouped KV heads and per-head q/k
RMSNorm (no biases) and a KV cache, then a mixture-of-experts block: a
router (hidden -> E logits, softmax, top-k, the k weights renormalised to
sum 1) and E SwiGLU experts (gate/up/down); a token's output is the weighted
sum of its k experts' outputs.  No shared expert.  Weights are generated per
unit from a seed that names it (one attention head, 64 rows/columns of one
expert's FFN, 256 vocabulary rows), so each rank generates only what it
holds, the model does not depend on the number of ranks, and every backend
routes the same tokens to the same experts.  The embedding, RMSNorm, rotary
tables and attention over the KV cache are ``bench.model.SeededDecoder``'s,
as in the dense model.

``ep_shard``: rank r owns experts r*E/n .. (r+1)*E/n - 1 whole and batch/n
of the sequences, with every head and the whole LM head; its MoE block
sends each (token, expert) pair's row to the expert's owner and back
(``comm.dispatch`` / ``comm.combine``).  ``tp_shard``: heads/n attention
heads and a 1/n slice of every expert's FFN on every rank, the whole batch;
one all-reduce per attention and per MoE block, the logits gathered.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from bench.model import (
    FFN_UNIT,
    VOCAB_UNIT,
    HeadsShape,
    SeededDecoder,
    kv_groups_problem,
    seeded_randn,
    unit_seed,
    vocab_in_order,
)

__all__ = [
    "MoEConfig",
    "MoEDecoder",
    "Shard",
    "ep_shard",
    "tp_shard",
    "route",
    "dispatch_plan",
    "combine_pairs",
    "expert_weights",
    "run_experts",
    "EXTRA_COLUMNS",
]

EXTRA_COLUMNS = 2  # a dispatched row: hidden, the global expert id, padding to 4 bytes


# --------------------------------------------------------------------------
# Configuration and sharding (pure)
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MoEConfig(HeadsShape):
    """Qwen3-MoE-style decoder dimensions (small by default)."""

    hidden: int = 1024
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    experts: int = 8
    topk: int = 2
    expert_ffn: int = 512
    vocab: int = 8192
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6

    def check(self, n_ranks: int, batch: int) -> None:
        """Raise ValueError unless both layouts fit ``n_ranks`` ranks and ``batch``."""
        problems = self._attention_problems(n_ranks) + self._moe_problems(n_ranks)
        if self.vocab % (VOCAB_UNIT * n_ranks):
            problems.append(f"vocab {self.vocab} is not a multiple of {VOCAB_UNIT} x "
                            f"{n_ranks} ranks")
        if batch % n_ranks:
            problems.append(f"batch {batch} is not a multiple of the {n_ranks} ranks "
                            "(EP: each rank owns batch / ranks sequences)")
        if problems:
            raise ValueError("; ".join(problems))

    def _attention_problems(self, n_ranks: int) -> list[str]:
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            return [f"hidden {self.hidden} must be heads {self.heads} x an even head_dim "
                    "(rotary)"]
        if self.heads % self.kv_heads:
            return [f"heads {self.heads} is not a multiple of kv-heads {self.kv_heads}"]
        if self.heads % n_ranks:
            return [f"heads {self.heads} is not a multiple of the {n_ranks} ranks"]
        problem = kv_groups_problem(self.heads, self.kv_heads, n_ranks)
        return [problem] if problem else []

    def _moe_problems(self, n_ranks: int) -> list[str]:
        problems = []
        if self.experts % n_ranks:
            problems.append(f"experts {self.experts} is not a multiple of the {n_ranks} ranks")
        if not 1 <= self.topk <= self.experts:
            problems.append(f"topk {self.topk} must be 1..experts {self.experts}")
        if self.expert_ffn % (FFN_UNIT * n_ranks):
            problems.append(f"expert-ffn {self.expert_ffn} is not a multiple of {FFN_UNIT} x "
                            f"{n_ranks} ranks")
        return problems

    def params(self) -> int:
        """Parameters of the whole model."""
        hd, h = self.head_dim, self.hidden
        attn = h * self.heads * hd * 2 + h * self.kv_heads * hd * 2 + 2 * hd + 2 * h
        moe = self.experts * h + self.experts * 3 * h * self.expert_ffn
        return self.vocab * h * 2 + self.layers * (attn + moe) + h

    def active_params(self) -> int:
        """Parameters one token uses (its top-k experts, not all E)."""
        idle = (self.experts - self.topk) * 3 * self.hidden * self.expert_ffn
        return self.params() - self.vocab * self.hidden - self.layers * idle


@dataclasses.dataclass(frozen=True)
class Shard:
    """What one rank holds and runs: heads, experts and their FFN units, vocabulary
    rows, and which of the batch's sequences."""

    mode: str  # "ep" or "tp"
    n_ranks: int
    rank: int
    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    experts: tuple[int, ...]
    ffn_units: tuple[int, ...]
    vocab_units: tuple[int, ...]
    sequences: tuple[int, ...]


def _block(count: int, n_ranks: int, rank: int) -> tuple[int, ...]:
    per = count // n_ranks
    return tuple(range(rank * per, (rank + 1) * per))


def ep_shard(cfg: MoEConfig, n_ranks: int, rank: int, batch: int) -> Shard:
    """Expert parallelism: block ``rank`` of the experts (whole), every head and
    vocabulary row, block ``rank`` of the sequences."""
    cfg.check(n_ranks, batch)
    return Shard("ep", n_ranks, rank, tuple(range(cfg.heads)), tuple(range(cfg.kv_heads)),
                 _block(cfg.experts, n_ranks, rank),
                 tuple(range(cfg.expert_ffn // FFN_UNIT)),
                 tuple(range(cfg.vocab // VOCAB_UNIT)), _block(batch, n_ranks, rank))


def tp_shard(cfg: MoEConfig, n_ranks: int, rank: int, batch: int) -> Shard:
    """Tensor parallelism: block ``rank`` of the heads (and the KV heads they read),
    of every expert's FFN units and of the vocabulary; every sequence."""
    cfg.check(n_ranks, batch)
    q_heads = _block(cfg.heads, n_ranks, rank)
    group = cfg.heads // cfg.kv_heads
    return Shard("tp", n_ranks, rank, q_heads, tuple(sorted({h // group for h in q_heads})),
                 tuple(range(cfg.experts)),
                 _block(cfg.expert_ffn // FFN_UNIT, n_ranks, rank),
                 _block(cfg.vocab // VOCAB_UNIT, n_ranks, rank), tuple(range(batch)))


# --------------------------------------------------------------------------
# Routing (pure torch)
# --------------------------------------------------------------------------


def route(logits, topk: int):
    """Router logits [T, E] -> (weights [T, k] float32 summing to 1 per token,
    experts [T, k] int64): softmax in float32, the top k, renormalised."""
    import torch

    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, topk, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts


def dispatch_plan(experts, n_ranks: int, experts_per_rank: int):
    """Where the (token, slot) pairs of ``experts`` [T, k] go.

    Returns (order, send_counts): ``order`` [T * k] int64 lists the pairs
    (flat index token * k + slot) grouped by owner rank, in pair order within
    a rank (a stable sort); ``send_counts[r]`` pairs go to rank r.
    """
    import torch

    owner = experts.reshape(-1) // experts_per_rank
    order = torch.argsort(owner, stable=True)
    counts = torch.bincount(owner, minlength=n_ranks)
    return order, counts.tolist()


def combine_pairs(pair_out, weights):
    """Expert outputs [T, k, hidden] bf16 and weights [T, k] -> [T, hidden] bf16:
    sum over slots 0..k-1 in that order, in float32, rounded once."""
    import torch

    acc = pair_out[:, 0].float() * weights[:, :1]
    for slot in range(1, pair_out.shape[1]):
        acc += pair_out[:, slot].float() * weights[:, slot:slot + 1]
    return acc.to(torch.bfloat16)


def expert_weights(seed: int, layer: int, expert: int, units: Sequence[int], cfg: MoEConfig):
    """One expert's FFN units ``units``: (gate_up [2 * 64 * len(units), hidden],
    down [hidden, 64 * len(units)]) bf16; gate rows first, then up rows."""
    import torch

    in_std, ffn_std = cfg.hidden**-0.5, cfg.expert_ffn**-0.5

    def blocks(kind, shape, std, dim=0):
        return torch.cat([seeded_randn(torch, unit_seed(seed, layer, kind, expert, unit), shape,
                                       std) for unit in units], dim=dim)

    gate = blocks("gate", (FFN_UNIT, cfg.hidden), in_std)
    up = blocks("up", (FFN_UNIT, cfg.hidden), in_std)
    down = blocks("down", (cfg.hidden, FFN_UNIT), ffn_std, dim=1)
    return torch.cat([gate, up]).contiguous(), down.contiguous()


def run_experts(experts: dict, rows, ids):
    """rows [R, hidden] bf16, ids [R] (keys of ``experts``: expert id -> (gate_up,
    down)) -> each row through its expert's SwiGLU FFN, [R, hidden] bf16, in row order."""
    import torch

    F = torch.nn.functional
    out = torch.empty((rows.shape[0], rows.shape[1]), dtype=rows.dtype)
    if rows.shape[0] == 0:
        return out
    sorted_ids, perm = torch.sort(ids, stable=True)
    grouped = rows[perm]
    start = 0
    for expert, count in zip(*torch.unique_consecutive(sorted_ids, return_counts=True)):
        end = start + int(count)
        gate_up, down = experts[int(expert)]
        gate, up = F.linear(grouped[start:end], gate_up).chunk(2, dim=-1)
        grouped[start:end] = F.linear(F.silu(gate) * up, down)
        start = end
    out[perm] = grouped
    return out


# --------------------------------------------------------------------------
# The model (torch)
# --------------------------------------------------------------------------


class _Layer:
    __slots__ = ("ln1", "w_qkv", "q_norm", "k_norm", "w_o", "ln2", "w_router", "experts",
                 "k_cache", "v_cache")


class MoEDecoder(SeededDecoder):
    """One rank's part of the model and its KV cache, in one layout (``shard.mode``).

    ``forward(tokens, start, comm)``: [b, S] ids of this rank's sequences at
    positions start..start+S-1 -> the greedy next token of each, [b].  ``comm``
    has dispatch/combine (EP) or allreduce/allgather (TP): bench.moe_decode
    passes its timed wrappers of them.
    """

    def __init__(self, cfg: MoEConfig, shard: Shard, seed: int, max_len: int):
        self._start(cfg, seed, max_len, len(shard.q_heads), len(shard.kv_heads))
        self.shard, self.batch = shard, len(shard.sequences)
        self.layers = [self._make_layer(i) for i in range(cfg.layers)]
        self.ln_f = self._norm_weight(cfg.hidden, "ln_f")
        self.w_lm = self._blocks(("lm_head",), shard.vocab_units, (VOCAB_UNIT, cfg.hidden),
                                 cfg.hidden**-0.5)

    def _make_layer(self, i: int) -> _Layer:
        torch, cfg, shard = self.torch, self.cfg, self.shard
        hd, hidden = cfg.head_dim, cfg.hidden
        layer = _Layer()
        q = self._blocks((i, "q"), shard.q_heads, (hd, hidden), hidden**-0.5)
        k = self._blocks((i, "k"), shard.kv_heads, (hd, hidden), hidden**-0.5)
        v = self._blocks((i, "v"), shard.kv_heads, (hd, hidden), hidden**-0.5)
        layer.w_qkv = torch.cat([q, k, v]).contiguous()
        layer.w_o = self._blocks((i, "o"), shard.q_heads, (hidden, hd),
                                 (cfg.heads * hd) ** -0.5, dim=1)
        layer.q_norm, layer.k_norm = self._norm_weight(hd, i, "q_norm"), self._norm_weight(
            hd, i, "k_norm")
        layer.ln1, layer.ln2 = self._norm_weight(hidden, i, "ln1"), self._norm_weight(
            hidden, i, "ln2")
        layer.w_router = seeded_randn(torch, unit_seed(self.seed, i, "router"),
                                      (cfg.experts, hidden), hidden**-0.5)
        layer.experts = {e: expert_weights(self.seed, i, e, shard.ffn_units, cfg)
                         for e in shard.experts}
        cache_shape = (self.batch, self.n_kv, self.max_len, hd)
        layer.k_cache = torch.zeros(cache_shape, dtype=torch.bfloat16)
        layer.v_cache = torch.zeros(cache_shape, dtype=torch.bfloat16)
        return layer

    def weight_nbytes(self) -> int:
        tensors = [self.w_lm] + [t for layer in self.layers
                                 for t in (layer.w_qkv, layer.w_o, layer.w_router)]
        tensors += [t for layer in self.layers for pair in layer.experts.values() for t in pair]
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, tokens, start: int, comm):
        b, length = tokens.shape
        x = self._embed_at(tokens, start)
        for i, layer in enumerate(self.layers):
            x = x + self._attention(i, self._rms(x, layer.ln1), start, comm)
            m = self._rms(x, layer.ln2).reshape(b * length, -1)
            x = x + self._moe(i, m, comm).view(b, length, -1)
        last = self._rms(x[:, -1], self.ln_f)
        self.last_logits = self._logits(last, comm)
        return self.last_logits.argmax(dim=-1)

    def _attention(self, i: int, a, start: int, comm):
        """This rank's heads over its sequences (q/k RMSNorm per head, then rotary);
        TP: the row-parallel O all-reduced."""
        F, layer, hd = self.torch.nn.functional, self.layers[i], self.cfg.head_dim
        b, length, _ = a.shape
        q, k, v = F.linear(a, layer.w_qkv).split(
            [self.n_q * hd, self.n_kv * hd, self.n_kv * hd], dim=-1)
        q = self._rms(q.view(b, length, self.n_q, hd), layer.q_norm).transpose(1, 2)
        k = self._rms(k.view(b, length, self.n_kv, hd), layer.k_norm).transpose(1, 2)
        o = F.linear(self._attend(layer, q, k, v, start), layer.w_o)
        if self.shard.mode == "tp":
            comm.allreduce(o)
        return o

    def _moe(self, i: int, m, comm):
        """m [T, hidden] -> the MoE block's output [T, hidden] bf16."""
        layer = self.layers[i]
        weights, experts = route(self.torch.nn.functional.linear(m, layer.w_router),
                                 self.cfg.topk)
        if self.shard.mode == "tp":
            # every pair through this rank's slice of its expert: partial sums
            rows = m.repeat_interleave(self.cfg.topk, dim=0)
            pair_out = run_experts(layer.experts, rows, experts.reshape(-1))
            out = combine_pairs(pair_out.view(*experts.shape, -1), weights)
            comm.allreduce(out)
            return out
        return combine_pairs(self._expert_parallel(layer, m, experts, comm), weights)

    def _expert_parallel(self, layer: _Layer, m, experts, comm):
        """Dispatch every (token, slot) pair to its expert's owner, run what
        arrived, bring the outputs back: [T, k, hidden] bf16."""
        torch, hidden, k = self.torch, self.cfg.hidden, self.cfg.topk
        order, send_counts = dispatch_plan(experts, self.shard.n_ranks, len(self.shard.experts))
        send = torch.zeros((order.numel(), hidden + EXTRA_COLUMNS), dtype=torch.bfloat16)
        send[:, :hidden] = m[order // k]
        send[:, hidden] = experts.reshape(-1)[order].to(torch.bfloat16)  # exact below 257
        recv, recv_counts = comm.dispatch(send, send_counts)
        out = run_experts(layer.experts, recv[:, :hidden], recv[:, hidden].long())
        back = comm.combine(out, recv_counts, send_counts)
        pair_out = torch.empty((order.numel(), hidden), dtype=torch.bfloat16)
        pair_out[order] = back
        return pair_out.view(*experts.shape, hidden)

    def _logits(self, last, comm):
        """[b, vocab] logits: EP the full LM head here; TP this rank's vocabulary
        block, every rank's gathered in rank order."""
        logits = self.torch.nn.functional.linear(last, self.w_lm)
        if self.shard.mode == "ep":
            return logits
        return vocab_in_order(comm.allgather(logits), self.shard.n_ranks, last.shape[0])
