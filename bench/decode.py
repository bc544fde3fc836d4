"""Tensor-parallel decode benchmark: a Qwen2.5-shaped decoder, one run per backend.

    mpirun -np 4 python -m mpi4py -m bench.decode --comm harmpi,gloo,mpi
    HARMPI_RANKS_PER_NODE=2 mpirun --oversubscribe -np 4 python -m mpi4py -m bench.decode
    mpirun -np 2 python -m mpi4py -m bench.decode --comm harmpi,torch:harmpi,gloo,mpi
    mpirun -np 2 python -m mpi4py -m bench.decode --tp-api --comm torch:harmpi,gloo

The model is Qwen2.5's decoder layer with random bf16 weights: RMSNorm,
rotary attention with grouped KV heads (q/k/v bias, no o bias) and a KV
cache, SwiGLU MLP.  It is sharded Megatron-style over the ranks:

* QKV and gate/up are column-parallel (each rank owns whole heads and a slice
  of the FFN), O and down are row-parallel, so every layer ends its
  attention and its MLP with one all-reduce of the hidden state
  (batch x hidden bf16);
* the LM head is vocab-parallel: each step gathers every rank's slice of the
  logits (one allgather) and takes the greedy argmax over the vocabulary;
* the embedding is replicated (rows generated from the seed on demand).

The comms (``--comm``) are the adapters of ``bench.impls``: ``harmpi``
calls ``harmpi.allreduce`` / ``harmpi.allgather``; ``torch:harmpi`` and
``gloo`` (= ``torch:gloo``) are one adapter calling
``dist.all_reduce(t, group=g)`` and ``dist.all_gather_single(out, t,
group=g)`` on a process group of that backend, as an engine calls them (the
first of them listed gets the default group, the other a ``new_group`` over
all ranks); ``mpi`` calls mpi4py.

``--tp-api`` builds the TP layers with torch instead
(``DTensorDecoder``): ``parallelize_module`` with ColwiseParallel and
RowwiseParallel on ``DeviceMesh.from_group`` of each comm's group, over the
same local weight shards, so torch:harmpi and gloo run the same model code
with one word changed and DTensor issues the collectives.  It runs torch
comms only.

No async/overlap mode: a greedy decode step is one chain of dependencies.
Each all-reduce's result is the residual stream the next layer reads, and
the logits gather feeds the argmax that picks the next step's token, so
nothing independent is left to overlap with a collective in flight (the
local half of the argmax could be, but then gathering each rank's
(max, index) replaces the gather rather than overlapping it; splitting the
batch into micro-batches would overlap, at the price of reading every
weight twice per step, which costs far more than a 10 KB all-reduce).

Weights are generated per unit (one attention head, 64 FFN rows/columns, 256
vocabulary rows) from a seed that names the unit, so each rank generates only
its shard and the model does not depend on the number of ranks.

Per backend: prefill of the prompt, ``--warmup`` untimed decode steps, then
timed steps; backends take turns in ``--rounds`` rounds (each restarting from
the prompt) so that a change in the machine's load hits all of them alike.
Reported per backend:

* ms/token: median step time (a step yields one token of every sequence),
  and tok/s = batch / ms/token;
* compute: the step outside the collectives.  It is the same work for every
  backend, yet it grows when waiting ranks slow the computing ones (on this
  project's 2-vCPU VM a busy-polling process halves the matmul rate of the
  other vCPU);
* inside collectives: time per step inside the all-reduces and the logits
  gather, and its share of the step (mean over ranks, and the rank with the
  smallest share).  With more ranks than cores this is mostly waiting for
  peers that are not scheduled, so it overstates what communication costs;
* after last arrival: the part of that time after the last rank entered each
  collective (ranks on one host read one clock): the collectives' own
  latency, the share of the step that faster collectives could remove;
* whether every rank generated identical tokens (required: exit 1
  otherwise) and whether backends agree with each other (reported only:
  bf16 sums in a different order may flip a near-tie in the argmax).

Defaults: hidden 1280 at batch 4 makes every all-reduce 10240 B, the size of
a Qwen2.5-14B (hidden 5120) all-reduce at batch 1; the rest of the model is
shrunk (8 layers, FFN 3584, vocabulary 32768: 227 M parameters) so that 4
ranks on 2 cores compare three backends in about a minute.  A layer of the
real 14B model reads ~15x more weights per all-reduce, so communication
weighs less there than here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from typing import NamedTuple, Sequence

import click
import numpy as np

from bench import harness
from bench.harness import DTYPES
from bench.impls import close_impls, harmpi_info_of, make_impls, parse_impls, torch_backend
from bench.load import host_load

__all__ = [
    "ModelConfig",
    "ShardLayout",
    "shard_layout",
    "unit_seed",
    "threads_per_rank",
    "first_divergence",
    "round_steps",
    "summarize_backend",
    "collective_latency_ns",
    "format_decode_table",
    "COMM_KINDS",
    "main",
]

#: --comm names: harmpi's API, torch.distributed on a harmpi or a gloo process group
#: (gloo is short for torch:gloo), mpi4py
COMM_KINDS = ("harmpi", "torch:harmpi", "gloo", "torch:gloo", "mpi")
FFN_UNIT = 64  # FFN rows (gate/up) / columns (down) generated per seed
VOCAB_UNIT = 256  # LM-head rows generated per seed


# --------------------------------------------------------------------------
# Configuration and sharding (pure)
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Qwen2.5-style decoder dimensions."""

    hidden: int = 1280
    layers: int = 8
    heads: int = 16
    kv_heads: int = 4
    ffn: int = 3584
    vocab: int = 32768
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def check(self, tp: int, even_kv: bool = False) -> None:
        """Raise ValueError unless the model can be sharded over ``tp`` ranks
        (``even_kv``: with every KV head on one rank, as torch's ColwiseParallel
        shards k/v, for --tp-api)."""
        problems = []
        if self.hidden % self.heads:
            problems.append(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.heads % self.kv_heads:
            problems.append(f"heads {self.heads} is not a multiple of kv-heads {self.kv_heads}")
        if self.heads % tp:
            problems.append(f"heads {self.heads} is not a multiple of the {tp} ranks")
        else:
            local, group = self.heads // tp, self.heads // max(1, self.kv_heads)
            if local % group and group % local:
                problems.append(
                    f"each rank's {local} q heads must cover whole KV groups of {group} "
                    "(or lie inside one)"
                )
        if even_kv and self.kv_heads % tp:
            problems.append(f"--tp-api shards k/v evenly: kv-heads {self.kv_heads} must be a "
                            f"multiple of the {tp} ranks")
        if self.ffn % (FFN_UNIT * tp):
            problems.append(f"ffn {self.ffn} is not a multiple of {FFN_UNIT} x {tp} ranks")
        if self.vocab % (VOCAB_UNIT * tp):
            problems.append(f"vocab {self.vocab} is not a multiple of {VOCAB_UNIT} x {tp} ranks")
        if problems:
            raise ValueError("; ".join(problems))

    def params(self) -> int:
        """Parameters of the whole model (embedding + layers + LM head)."""
        hd = self.head_dim
        q_o = self.hidden * (self.heads * hd) * 2
        k_v = self.hidden * (self.kv_heads * hd) * 2
        qkv_bias = (self.heads + 2 * self.kv_heads) * hd
        mlp = 3 * self.hidden * self.ffn
        layer = q_o + k_v + qkv_bias + mlp + 2 * self.hidden  # + two RMSNorm weights
        return self.vocab * self.hidden * 2 + self.layers * layer + self.hidden


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Which heads, FFN units and vocabulary rows one rank owns."""

    tp: int
    rank: int
    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    ffn_units: tuple[int, ...]
    vocab_units: tuple[int, ...]

    @property
    def vocab_start(self) -> int:
        return self.vocab_units[0] * VOCAB_UNIT


def shard_layout(cfg: ModelConfig, tp: int, rank: int) -> ShardLayout:
    """Megatron-style contiguous blocks: rank r owns block r of heads, FFN and vocabulary.

    KV heads are the groups its q heads read (replicated when ranks
    outnumber KV heads).
    """
    cfg.check(tp)
    local_heads = cfg.heads // tp
    q_heads = tuple(range(rank * local_heads, (rank + 1) * local_heads))
    group = cfg.heads // cfg.kv_heads
    kv_heads = tuple(sorted({h // group for h in q_heads}))
    ffn_per_rank = cfg.ffn // FFN_UNIT // tp
    vocab_per_rank = cfg.vocab // VOCAB_UNIT // tp
    return ShardLayout(
        tp=tp,
        rank=rank,
        q_heads=q_heads,
        kv_heads=kv_heads,
        ffn_units=tuple(range(rank * ffn_per_rank, (rank + 1) * ffn_per_rank)),
        vocab_units=tuple(range(rank * vocab_per_rank, (rank + 1) * vocab_per_rank)),
    )


def unit_seed(seed: int, *parts) -> int:
    """A 63-bit seed naming one unit of weights, e.g. (seed, layer, 'q', head)."""
    text = repr((seed,) + tuple(parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def threads_per_rank(host_cpus: int, local_ranks: int, allowed_cpus: int,
                     override: int | None = None) -> int:
    """Compute threads for one rank: the host's CPUs shared among the ranks on it.

    At least 1, and no more than the CPUs the rank is bound to.
    """
    if override is not None:
        return max(1, override)
    return max(1, min(host_cpus // max(1, local_ranks), allowed_cpus))


def round_steps(steps: int, rounds: int) -> list[int]:
    """Split ``steps`` timed steps over at most ``rounds`` rounds, as evenly as
    possible (no empty round)."""
    rounds = max(1, min(rounds, steps))
    return [steps // rounds + (1 if i < steps % rounds else 0) for i in range(rounds)]


def first_divergence(a: np.ndarray, b: np.ndarray) -> int | None:
    """First generated position (column) where two [batch, steps] token arrays
    differ, or None."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return 0
    differ = (a != b).any(axis=0)
    return int(np.argmax(differ)) if differ.any() else None


#: a greedy token whose top two logits are this many bf16 ulps apart or fewer
#: is a near tie: reductions summing bf16 in another order may flip it
NEAR_TIE_ULPS = 16


def top2_margin_ulps(logits: np.ndarray) -> float:
    """[batch, vocab] logits -> the smallest gap between the top two logits of
    a row, in bf16 ulps of that row's top logit (ulp = 2^(exponent - 7))."""
    logits = np.asarray(logits, dtype=np.float64)
    top2 = -np.sort(-logits, axis=-1)[:, :2]
    exponent = np.floor(np.log2(np.maximum(np.abs(top2[:, 0]), 2.0**-126)))
    return float(((top2[:, 0] - top2[:, 1]) / 2.0 ** (exponent - 7)).min())


def logits_gap_ulps(reference: np.ndarray, other: np.ndarray) -> float:
    """Largest |difference| of two [batch, vocab] logit arrays, in bf16 ulps of
    the reference's largest |logit| (ulp = 2^(exponent - 7))."""
    reference = np.asarray(reference, dtype=np.float64)
    scale = max(float(np.abs(reference).max()), 2.0**-126)
    ulp = 2.0 ** (np.floor(np.log2(scale)) - 7)
    return float(np.abs(reference - np.asarray(other, dtype=np.float64)).max() / ulp)


def divergence_note(position: int | None, margin_ulps: float | None) -> str:
    """Why two backends' greedy tokens differ from ``position`` on (or that they do not)."""
    if position is None:
        return "yes"
    text = f"no (first divergence at generated token {position}"
    if margin_ulps is None:
        return text + ")"
    if margin_ulps <= NEAR_TIE_ULPS:
        return (text + f": there the reference's top two logits were {margin_ulps:.1f} bf16 "
                f"ulps apart, a near tie (<= {NEAR_TIE_ULPS}) that bf16 sums in another order "
                "flip; the tokens after it follow another path, not a wrong result)")
    return (text + f": CHECK, the reference's top two logits were {margin_ulps:.1f} bf16 ulps "
            f"apart there, more than summation order explains (> {NEAR_TIE_ULPS}))")


def collective_latency_ns(enter_ns: np.ndarray, exit_ns: np.ndarray) -> np.ndarray:
    """Each rank's time in each collective after the last rank arrived.

    ``enter_ns``/``exit_ns`` [ranks, steps, calls] are clock readings around
    every collective call on every rank (one host: one monotonic clock).
    Whatever a rank spends inside a call before the last rank arrives is
    waiting for that rank (load imbalance, or a peer that is not scheduled
    when ranks outnumber cores); what it spends after is the collective's own
    latency.  Returns the latter, >= 0, summed over the calls of each step:
    [ranks, steps].
    """
    enter_ns = np.asarray(enter_ns, dtype=np.int64)
    exit_ns = np.asarray(exit_ns, dtype=np.int64)
    last_arrival = enter_ns.max(axis=0, keepdims=True)
    own = np.maximum(exit_ns - np.maximum(enter_ns, last_arrival), 0)
    return own.sum(axis=2)


def round_tokens_per_s(step_ns: np.ndarray, per_round: Sequence[int], batch: int) -> list[float]:
    """tok/s of each round: batch / the median of its rank-averaged step times."""
    mean_ns = np.asarray(step_ns, dtype=np.float64).mean(axis=0)
    bounds = np.cumsum([0, *per_round])
    return [float(batch * 1e9 / np.median(mean_ns[a:b])) for a, b in zip(bounds, bounds[1:])]


def summarize_backend(step_ns: np.ndarray, comm_ns: np.ndarray, batch: int,
                      latency_ns: np.ndarray | None = None,
                      per_round: Sequence[int] | None = None) -> dict:
    """Per-rank step and communication times [ranks, steps] -> the reported numbers.

    ms_per_token: median over steps of the rank-averaged step time (each step
    yields one token per sequence); tokens_per_s = batch / that;
    tokens_per_s_rounds: min, median and max of the rounds' tok/s
    (``per_round``: the steps of each round, in order; default one round).
    The split of a step is in means, so its columns add up:
    compute_ms_per_token + comm_ms_per_token = mean_ms_per_token (mean over
    steps and ranks), and comm_share = comm_ms_per_token / mean_ms_per_token.
    comm_share_min: the smallest per-rank share (the rank that waits least).
    comm_latency_*: the same for the time after the last rank arrived
    (see :func:`collective_latency_ns`), None when not measured.
    compute_ms_per_token differs between backends when their waiting slows
    the compute (busy-polling a core that shares a physical core or a CPU
    quota with the computing one).
    """
    step_ns = np.asarray(step_ns, dtype=np.float64)
    comm_ns = np.asarray(comm_ns, dtype=np.float64)
    step_ms = np.median(step_ns.mean(axis=0)) / 1e6
    mean_ms = step_ns.mean() / 1e6
    comm_ms = comm_ns.mean() / 1e6
    rounds = round_tokens_per_s(step_ns, per_round or [step_ns.shape[1]], batch)
    summary = {
        "ms_per_token": float(step_ms),
        "tokens_per_s": float(batch * 1e3 / step_ms),
        "tokens_per_s_rounds": {"min": min(rounds), "median": float(np.median(rounds)),
                                "max": max(rounds), "each": rounds},
        "mean_ms_per_token": float(mean_ms),
        "compute_ms_per_token": float(mean_ms - comm_ms),
        "comm_ms_per_token": float(comm_ms),
        "comm_share": float(comm_ms / mean_ms),
        "comm_share_min": float((comm_ns.sum(axis=1) / step_ns.sum(axis=1)).min()),
        "comm_latency_share": None,
        "comm_latency_ms_per_token": None,
    }
    if latency_ns is not None:
        latency_ms = np.asarray(latency_ns, dtype=np.float64).mean() / 1e6
        summary["comm_latency_ms_per_token"] = float(latency_ms)
        summary["comm_latency_share"] = float(latency_ms / mean_ms)
    return summary


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _decode_table_100(rows: Sequence[dict]) -> list[str]:
    """format_decode_table within 100 columns."""
    lines = [
        f"{'#':<13}{' median step '.center(28, '-'):>30}"
        f"{' mean step: compute + coll. '.center(32, '-'):>34}"
        f"{' after last '.center(14, '-'):>15}",
        f"{'# comm':<13}{'tok/s':>8}{'rounds':>14}{'ms/tok':>8}"
        f"{'compute':>9}{'collect.':>9}{'share':>7}{'min rank':>9}"
        f"{'ms/tok':>8}{'share':>7}{'agree':>6}",
    ]
    for row in rows:
        agree = {None: "-", True: "yes", False: "NO"}[row.get("tokens_identical_across_ranks")]
        lines.append(
            f"{row['comm']:<13}{row['tokens_per_s']:>8.1f}{_spread(row):>14}"
            f"{row['ms_per_token']:>8.2f}{_ms(row.get('compute_ms_per_token')):>9}"
            f"{_ms(row['comm_ms_per_token']):>9}{_pct(row['comm_share']):>7}"
            f"{_pct(row['comm_share_min']):>9}"
            f"{_ms(row.get('comm_latency_ms_per_token')):>8}"
            f"{_pct(row.get('comm_latency_share')):>7}{agree:>6}"
        )
    return lines


def _spread(row: dict) -> str:
    spread = row.get("tokens_per_s_rounds")
    return "-" if not spread else f"{spread['min']:.1f}-{spread['max']:.1f}"


def format_decode_table(rows: Sequence[dict], wide: bool = False) -> list[str]:
    """The result table (rank 0 prints it): tok/s and its rounds' range from
    median steps; the split of the mean step (compute + collectives = mean).
    100 columns; ``wide`` adds the mean step and the prefill time (both are
    in the JSON too) with longer labels."""
    if not wide:
        return _decode_table_100(rows)
    lines = [
        f"{'#':<14}{' median step '.center(30, '-'):>32}"
        f"{' mean step = compute + collectives '.center(44, '-'):>46}"
        f"{' after last arrival '.center(22, '-'):>22}",
        f"{'# comm':<14}{'tok/s':>8}{'rounds min-max':>15}{'ms/token':>9}"
        f"{'mean ms':>9}{'compute':>9}{'collect.':>10}{'share':>8}{'min rank':>10}"
        f"{'ms/token':>12}{'share':>10}{'prefill ms':>12}{'ranks agree':>13}",
    ]
    for row in rows:
        agree = {None: "-", True: "yes", False: "NO"}[row.get("tokens_identical_across_ranks")]
        lines.append(
            f"{row['comm']:<14}{row['tokens_per_s']:>8.1f}{_spread(row):>15}"
            f"{row['ms_per_token']:>9.2f}{_ms(row.get('mean_ms_per_token')):>9}"
            f"{_ms(row.get('compute_ms_per_token')):>9}"
            f"{_ms(row['comm_ms_per_token']):>10}{_pct(row['comm_share']):>8}"
            f"{_pct(row['comm_share_min']):>10}"
            f"{_ms(row.get('comm_latency_ms_per_token')):>12}"
            f"{_pct(row.get('comm_latency_share')):>10}"
            f"{row['prefill_ms']:>12.1f}{agree:>13}"
        )
    return lines


# --------------------------------------------------------------------------
# The model (torch)
# --------------------------------------------------------------------------


def _randn(torch, seed: int, shape, std: float):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator, dtype=torch.float32) * std).to(torch.bfloat16)


class _Layer:
    __slots__ = ("ln1", "w_qkv", "b_qkv", "w_o", "ln2", "w_gate_up", "w_down", "k_cache", "v_cache")


class TPDecoder:
    """One rank's shard of the model, with its KV cache.

    ``forward(tokens, start, comm)`` runs [batch, S] token ids at positions
    start..start+S-1 and returns the greedy next token of every sequence,
    identical on every rank.
    """

    def __init__(self, cfg: ModelConfig, layout: ShardLayout, seed: int, batch: int,
                 max_len: int):
        import torch

        self.torch = torch
        self.cfg, self.layout, self.seed = cfg, layout, seed
        self.batch, self.max_len = batch, max_len
        self.n_q, self.n_kv = len(layout.q_heads), len(layout.kv_heads)
        self.layers = [self._make_layer(i) for i in range(cfg.layers)]
        self.ln_f = self._norm_weight("ln_f")
        self.w_lm = self._blocks(("lm_head",), layout.vocab_units, (VOCAB_UNIT, cfg.hidden),
                                 cfg.hidden**-0.5)
        self._embedding: dict[int, object] = {}
        hd = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)
        self.cos = angles.cos().to(torch.bfloat16)
        self.sin = angles.sin().to(torch.bfloat16)

    def _blocks(self, name: tuple, units, shape, std: float, dim: int = 0):
        """One random block per unit, seeded by (seed, *name, unit), concatenated along ``dim``."""
        torch = self.torch
        blocks = [_randn(torch, unit_seed(self.seed, *name, unit), shape, std) for unit in units]
        return torch.cat(blocks, dim=dim).contiguous()

    def _norm_weight(self, *name):
        torch = self.torch
        noise = _randn(torch, unit_seed(self.seed, *name), (self.cfg.hidden,), 0.05)
        return (1.0 + noise.float()).to(torch.bfloat16)

    def _make_layer(self, i: int) -> _Layer:
        torch, cfg, layout = self.torch, self.cfg, self.layout
        hd, hidden = cfg.head_dim, cfg.hidden
        in_std, ffn_std = hidden**-0.5, cfg.ffn**-0.5
        o_std = (cfg.heads * hd) ** -0.5
        layer = _Layer()
        q = self._blocks((i, "q"), layout.q_heads, (hd, hidden), in_std)
        k = self._blocks((i, "k"), layout.kv_heads, (hd, hidden), in_std)
        v = self._blocks((i, "v"), layout.kv_heads, (hd, hidden), in_std)
        layer.w_qkv = torch.cat([q, k, v]).contiguous()
        bq = self._blocks((i, "bq"), layout.q_heads, (hd,), 0.1)
        bk = self._blocks((i, "bk"), layout.kv_heads, (hd,), 0.1)
        bv = self._blocks((i, "bv"), layout.kv_heads, (hd,), 0.1)
        layer.b_qkv = torch.cat([bq, bk, bv]).contiguous()
        layer.w_o = self._blocks((i, "o"), layout.q_heads, (hidden, hd), o_std, dim=1)
        gate = self._blocks((i, "gate"), layout.ffn_units, (FFN_UNIT, hidden), in_std)
        up = self._blocks((i, "up"), layout.ffn_units, (FFN_UNIT, hidden), in_std)
        layer.w_gate_up = torch.cat([gate, up]).contiguous()
        layer.w_down = self._blocks((i, "down"), layout.ffn_units, (hidden, FFN_UNIT), ffn_std,
                                    dim=1)
        layer.ln1 = self._norm_weight(i, "ln1")
        layer.ln2 = self._norm_weight(i, "ln2")
        cache_shape = (self.batch, self.n_kv, self.max_len, hd)
        layer.k_cache = torch.zeros(cache_shape, dtype=torch.bfloat16)
        layer.v_cache = torch.zeros(cache_shape, dtype=torch.bfloat16)
        return layer

    def no_autograd(self):
        """The context the model runs in: torch.inference_mode()."""
        return self.torch.inference_mode()

    def shard_bytes(self) -> int:
        tensors = [self.w_lm] + [
            t
            for layer in self.layers
            for t in (layer.w_qkv, layer.b_qkv, layer.w_o, layer.w_gate_up, layer.w_down)
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    def embed(self, tokens):
        """[B, S] ids -> [B, S, hidden] bf16; row t is generated from (seed, 'embed', t)."""
        torch = self.torch
        rows = []
        for token in tokens.reshape(-1).tolist():
            row = self._embedding.get(token)
            if row is None:
                row = _randn(torch, unit_seed(self.seed, "embed", token), (self.cfg.hidden,), 1.0)
                self._embedding[token] = row
            rows.append(row)
        return torch.stack(rows).view(tokens.shape[0], tokens.shape[1], self.cfg.hidden)

    def _rms(self, x, weight):
        torch = self.torch
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_eps)
        return weight * xf.to(torch.bfloat16)

    @staticmethod
    def _rope(x, cos, sin):
        half = x.shape[-1] // 2
        rotated = x.new_empty(x.shape)
        rotated[..., :half] = -x[..., half:]
        rotated[..., half:] = x[..., :half]
        return x * cos + rotated * sin

    def forward(self, tokens, start: int, comm):
        torch = self.torch
        F = torch.nn.functional
        hd = self.cfg.head_dim
        batch, length = tokens.shape
        end = start + length
        if end > self.max_len:
            raise ValueError(f"position {end} beyond the KV cache ({self.max_len})")
        cos, sin = self.cos[start:end], self.sin[start:end]
        gqa = self.n_q != self.n_kv
        x = self.embed(tokens)
        if length > 1 and start > 0:
            mask = torch.ones(length, end, dtype=torch.bool).tril(diagonal=start)
        else:
            mask = None
        for i, layer in enumerate(self.layers):
            a = self._rms(x, layer.ln1)
            q, k, v = self._qkv(i, a)
            q = self._rope(q.view(batch, length, self.n_q, hd).transpose(1, 2), cos, sin)
            k = self._rope(k.view(batch, length, self.n_kv, hd).transpose(1, 2), cos, sin)
            layer.k_cache[:, :, start:end] = k
            layer.v_cache[:, :, start:end] = v.view(batch, length, self.n_kv, hd).transpose(1, 2)
            keys, values = layer.k_cache[:, :, :end], layer.v_cache[:, :, :end]
            attn = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=(length > 1 and start == 0),
                enable_gqa=gqa,
            )
            x = x + self._attn_out(i, attn.transpose(1, 2).reshape(batch, length, -1), comm)
            x = x + self._mlp(i, self._rms(x, layer.ln2), comm)
        last = self._rms(x[:, -1], self.ln_f)
        self.last_logits = self._logits(last, comm)  # read after the timed step (_decode)
        return self.last_logits.argmax(dim=-1)

    # The tensor-parallel layers: hand-written here, torch's parallelize_module
    # in DTensorDecoder.  Each returns this rank's local tensor.

    def _qkv(self, i: int, a):
        """Column-parallel QKV: this rank's q, k, v heads, [B, S, heads x head_dim] each."""
        layer, hd = self.layers[i], self.cfg.head_dim
        qkv = self.torch.nn.functional.linear(a, layer.w_qkv, layer.b_qkv)
        return qkv.split([self.n_q * hd, self.n_kv * hd, self.n_kv * hd], dim=-1)

    def _attn_out(self, i: int, attn, comm):
        """Row-parallel O: partial sums over this rank's heads, all-reduced."""
        o = self.torch.nn.functional.linear(attn, self.layers[i].w_o)
        comm.allreduce(o)
        return o

    def _mlp(self, i: int, m, comm):
        """Column-parallel gate/up, row-parallel down (partial sums over the FFN slice),
        all-reduced."""
        F = self.torch.nn.functional
        layer = self.layers[i]
        gate, up = F.linear(m, layer.w_gate_up).chunk(2, dim=-1)
        d = F.linear(F.silu(gate) * up, layer.w_down)
        comm.allreduce(d)
        return d

    def _logits(self, last, comm):
        """Vocab-parallel LM head: [B, vocab], every rank's slice gathered in rank order."""
        batch = last.shape[0]
        logits = self.torch.nn.functional.linear(last, self.w_lm)  # [B, vocab / tp]
        gathered = comm.allgather(logits)  # [tp * B, vocab / tp], rank blocks in order
        tp = self.layout.tp
        return gathered.view(tp, batch, -1).permute(1, 0, 2).reshape(batch, -1)


#: torch's tensor-parallel plan of the layers (HF Qwen2's names): the hand-written
#: path's column- and row-parallel layers, the LM head gathered to every rank
_TP_PLAN = {
    "layers.*.q_proj": "colwise", "layers.*.k_proj": "colwise", "layers.*.v_proj": "colwise",
    "layers.*.o_proj": "rowwise",
    "layers.*.gate_proj": "colwise", "layers.*.up_proj": "colwise",
    "layers.*.down_proj": "rowwise",
    "lm_head": "colwise_gathered",
}


class DTensorDecoder(TPDecoder):
    """The same model with its tensor-parallel layers built by torch (``--tp-api``).

    ``parallelize_module`` applies ``_TP_PLAN`` (ColwiseParallel for q/k/v
    and gate/up, RowwiseParallel for o and down, ColwiseParallel with a
    Replicate output for the LM head) on ``DeviceMesh.from_group(group,
    "cpu")``, so the collectives are DTensor's: an all-reduce per row-parallel
    output and an all-gather of the logits, issued by torch on ``group``'s
    backend.  The weights are the local shards of ``base`` (same tensors, no
    copy), wrapped with ``DTensor.from_local`` before parallelize_module,
    which keeps a parameter that is already a DTensor with the plan's
    placement: nothing is re-sharded, so the model is the hand-written one's
    weight for weight.  Everything else (norms, rotary, KV cache, attention)
    is ``TPDecoder.forward`` on local tensors.

    Time inside the collectives is taken by forward hooks around torch's
    output hook of o, down and the LM head (it waits for the collective, so
    what it measures ends when the result is ready).
    """

    def __init__(self, base: TPDecoder, group):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import parallelize_module

        self.__dict__.update(base.__dict__)  # the same weights, caches and tables
        torch, hd = self.torch, self.cfg.head_dim
        self.cfg.check(self.layout.tp, even_kv=True)
        self.mesh = DeviceMesh.from_group(group, "cpu")
        layers = torch.nn.ModuleList()
        for layer in self.layers:
            q, k, v = layer.w_qkv.split([self.n_q * hd, self.n_kv * hd, self.n_kv * hd])
            bq, bk, bv = layer.b_qkv.split([self.n_q * hd, self.n_kv * hd, self.n_kv * hd])
            gate, up = layer.w_gate_up.chunk(2)
            layers.append(torch.nn.ModuleDict({
                "q_proj": self._linear(q, 0, bq), "k_proj": self._linear(k, 0, bk),
                "v_proj": self._linear(v, 0, bv), "o_proj": self._linear(layer.w_o, 1),
                "gate_proj": self._linear(gate, 0), "up_proj": self._linear(up, 0),
                "down_proj": self._linear(layer.w_down, 1),
            }))
        root = torch.nn.ModuleDict({"layers": layers, "lm_head": self._linear(self.w_lm, 0)})
        timed = [root["lm_head"]] + [m for lay in layers for m in (lay["o_proj"],
                                                                    lay["down_proj"])]
        self._t0_ns = 0
        self._timer = None
        for module in timed:  # runs before torch's output hook (registered later)
            module.register_forward_hook(self._collective_starts)
        parallelize_module(root, self.mesh, _tp_styles())
        for module in timed:  # runs after it
            module.register_forward_hook(self._collective_ends)
        self.tp_layers, self.lm_head = layers, root["lm_head"]

    def _linear(self, weight, dim: int, bias=None):
        """An nn.Linear holding this rank's shard (split along ``dim``) as a DTensor."""
        torch = self.torch
        from torch.distributed.tensor import DTensor, Shard

        def param(local, placement):
            tensor = DTensor.from_local(local, self.mesh, [placement], run_check=False)
            return torch.nn.Parameter(tensor, requires_grad=False)

        out_features, in_features = weight.shape
        scale = [1, 1]
        scale[dim] = self.layout.tp
        linear = torch.nn.Linear(in_features * scale[1], out_features * scale[0],
                                 bias=bias is not None, device="meta", dtype=weight.dtype)
        linear.weight = param(weight, Shard(dim))
        if bias is not None:
            linear.bias = param(bias, Shard(0))
        return linear

    def no_autograd(self):
        """torch.no_grad(): under inference_mode DTensor sends aten.linear (a
        CompositeImplicitAutograd op) through its slow path, a caught exception and
        a decomposition per call (torch 2.13, distributed/tensor/_dispatch.py), which
        made a step 1.5-2.4x slower than under no_grad (default model, same job,
        three runs on the 2-vCPU VM)."""
        return self.torch.no_grad()

    def _collective_starts(self, module, inputs, output):
        self._t0_ns = time.perf_counter_ns()

    def _collective_ends(self, module, inputs, output):
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        if isinstance(output, AsyncCollectiveTensor):
            output = output.wait()  # the next op would wait for it anyway
        self._timer.record(self._t0_ns, time.perf_counter_ns())
        return output

    def forward(self, tokens, start: int, comm):
        """As TPDecoder.forward; ``comm`` only times (its ``record``), torch communicates."""
        self._timer = comm
        return super().forward(tokens, start, comm)

    def _qkv(self, i: int, a):
        layer = self.tp_layers[i]
        return layer["q_proj"](a), layer["k_proj"](a), layer["v_proj"](a)

    def _attn_out(self, i: int, attn, comm):
        return self.tp_layers[i]["o_proj"](attn)

    def _mlp(self, i: int, m, comm):
        layer = self.tp_layers[i]
        F = self.torch.nn.functional
        return layer["down_proj"](F.silu(layer["gate_proj"](m)) * layer["up_proj"](m))

    def _logits(self, last, comm):
        return self.lm_head(last)


def _tp_styles() -> dict:
    """_TP_PLAN as torch ParallelStyle objects."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gathered": lambda: ColwiseParallel(output_layouts=Replicate()),
    }
    return {name: styles[kind]() for name, kind in _TP_PLAN.items()}


# --------------------------------------------------------------------------
# Communication: the benchmarks' adapters (bench.impls), timed
# --------------------------------------------------------------------------


class _TimedComm:
    """Wraps an adapter of ``bench.impls``; adds up the ns spent inside its
    collectives and, once ``begin_step`` was called, records each call's
    entry and exit times."""

    def __init__(self, backend, steps: int, calls_per_step: int):
        self.backend = backend
        self.ns = 0
        self.enter_ns = np.zeros((steps, calls_per_step), dtype=np.int64)
        self.exit_ns = np.zeros((steps, calls_per_step), dtype=np.int64)
        self.step = -1  # not recording (prefill, warm-up)
        self.call = 0

    def begin_step(self, step: int) -> None:
        self.step, self.call, self.ns = step, 0, 0

    def record(self, t0: int, t1: int) -> None:
        """One collective call from t0 to t1 (perf_counter_ns)."""
        self.ns += t1 - t0
        if self.step >= 0:
            self.enter_ns[self.step, self.call] = t0
            self.exit_ns[self.step, self.call] = t1
            self.call += 1

    def allreduce(self, tensor):
        t0 = time.perf_counter_ns()
        self.backend.allreduce(tensor)
        self.record(t0, time.perf_counter_ns())

    def allgather(self, tensor):
        t0 = time.perf_counter_ns()
        out = self.backend.allgather(tensor)
        self.record(t0, time.perf_counter_ns())
        return out


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What one run does, fixed before it starts (the same on every rank)."""

    cfg: ModelConfig
    tp: int
    batch: int
    prompt_len: int
    steps: int
    warmup_steps: int
    rounds: int
    seed: int
    tp_api: bool = False

    @property
    def per_round(self) -> list[int]:
        return round_steps(self.steps, self.rounds)

    @property
    def max_len(self) -> int:
        """KV-cache positions a round needs."""
        return self.prompt_len + self.warmup_steps + max(self.per_round) + 1

    @property
    def allreduce_nbytes(self) -> int:
        return self.batch * self.cfg.hidden * 2

    @property
    def allgather_nbytes(self) -> int:
        return self.batch * (self.cfg.vocab // self.tp) * 2

    def row_fields(self) -> dict:
        """The fields every result row repeats."""
        return dict(
            steps=self.steps,
            rounds=len(self.per_round),
            warmup_steps=self.warmup_steps,
            batch=self.batch,
            collectives_per_token=2 * self.cfg.layers + 1,
            allreduce_nbytes=self.allreduce_nbytes,
            allgather_nbytes=self.allgather_nbytes,
            tp_api=self.tp_api,
        )


@dataclasses.dataclass(frozen=True)
class _Threads:
    """torch threads of this rank and what the count was derived from."""

    count: int
    host_cpus: int | None
    local_ranks: int
    allowed_cpus: int


class _Round(NamedTuple):
    """One backend's decode from the prompt, on one rank."""

    tokens: np.ndarray  # [batch, 1 + warmup + steps]
    step_ns: np.ndarray  # [steps]
    comm_ns: np.ndarray  # [steps]
    enter_ns: np.ndarray  # [steps, calls]
    exit_ns: np.ndarray  # [steps, calls]
    prefill_ns: int
    margin_ulps: np.ndarray  # [1 + warmup + steps]: top-two logit gap (top2_margin_ulps)
    prefill_logits: np.ndarray  # [batch, vocab] float32: every backend's from the same prompt


@dataclasses.dataclass
class _Measured:
    """One backend's rounds on this rank."""

    rounds: list[_Round] = dataclasses.field(default_factory=list)
    #: every rank generated the same tokens in every round so far
    identical: bool = True

    def longest(self) -> _Round:
        return max(self.rounds, key=lambda r: r.tokens.shape[1])

    def longest_tokens(self) -> np.ndarray:
        return self.longest().tokens

    def concatenated(self, field: str) -> np.ndarray:
        return np.concatenate([getattr(r, field) for r in self.rounds])


def _tokens_digest(tokens: np.ndarray) -> str:
    return hashlib.blake2b(tokens.tobytes(), digest_size=16).hexdigest()


def _decode(model: TPDecoder, backend, prompt, warmup_steps: int, steps: int, barrier) -> _Round:
    """Prefill + warm-up + timed steps."""
    torch = model.torch
    comm = _TimedComm(backend, steps, 2 * model.cfg.layers + 1)
    barrier()
    with model.no_autograd():
        t0 = time.perf_counter_ns()
        token = model.forward(prompt, 0, comm)
        prefill_ns = time.perf_counter_ns() - t0
        generated = [token]
        prefill_logits = model.last_logits.float().numpy().copy()
        margins = [top2_margin_ulps(prefill_logits)]
        position = prompt.shape[1]
        step_ns = np.zeros(steps, dtype=np.int64)
        comm_ns = np.zeros(steps, dtype=np.int64)
        for i in range(warmup_steps + steps):
            timed = i - warmup_steps
            comm.begin_step(timed)  # negative: not recorded
            t0 = time.perf_counter_ns()
            token = model.forward(token.view(-1, 1), position, comm)
            elapsed = time.perf_counter_ns() - t0
            position += 1
            generated.append(token)
            margins.append(top2_margin_ulps(model.last_logits.float().numpy()))
            if timed >= 0:
                step_ns[timed] = elapsed
                comm_ns[timed] = comm.ns
    tokens = torch.stack(generated, dim=1).numpy()
    return _Round(tokens, step_ns, comm_ns, comm.enter_ns, comm.exit_ns, prefill_ns,
                  np.array(margins), prefill_logits)


def _host_info(comm):
    from mpi4py import MPI

    host_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local_ranks = host_comm.Get_size()
    host_comm.Free()
    return local_ranks


def _set_threads(comm, override: int | None) -> _Threads:
    """Give torch this rank's share of the host's CPUs (collective)."""
    local_ranks = _host_info(comm)
    allowed = len(os.sched_getaffinity(0))
    count = threads_per_rank(os.cpu_count() or 1, local_ranks, allowed, override)
    # Before torch starts its OpenMP pool; a value the user exported wins.
    os.environ.setdefault("OMP_NUM_THREADS", str(count))
    import torch

    torch.set_num_threads(count)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or parallel work already started
        pass
    return _Threads(count, os.cpu_count(), local_ranks, allowed)


def _build_model(plan: _Plan, comm) -> tuple[TPDecoder, float]:
    """This rank's shard and the slowest rank's build time in s (collective)."""
    from mpi4py import MPI

    layout = shard_layout(plan.cfg, plan.tp, comm.Get_rank())
    t0 = time.perf_counter()
    model = TPDecoder(plan.cfg, layout, plan.seed, plan.batch, plan.max_len)
    build_s = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    return model, build_s


def _prompt(plan: _Plan):
    """[batch, prompt_len] token ids, the same on every rank."""
    import torch

    rng = np.random.default_rng([plan.seed, 7])
    return torch.from_numpy(rng.integers(0, plan.cfg.vocab, (plan.batch, plan.prompt_len)))


# --- header ---------------------------------------------------------------


def _model_lines(plan: _Plan, shard_nbytes: int, build_s: float) -> list[str]:
    cfg, batch, tp = plan.cfg, plan.batch, plan.tp
    return [
        f"# Model: hidden {cfg.hidden}, layers {cfg.layers}, heads {cfg.heads} "
        f"(kv {cfg.kv_heads}, head_dim {cfg.head_dim}), ffn {cfg.ffn}, vocab {cfg.vocab}: "
        f"{cfg.params() / 1e6:.0f} M parameters, {shard_nbytes / 2**20:.0f} MiB of sharded "
        f"bf16 weights per rank (built in {build_s:.1f} s)",
        f"# Sharding over {tp} ranks: column-parallel QKV and gate/up, row-parallel O and down, "
        "vocab-parallel LM head, replicated embedding"
        + ("; TP layers built by torch: parallelize_module (ColwiseParallel q/k/v, gate, up and "
           "the LM head with a Replicate output; RowwiseParallel o, down) on "
           "DeviceMesh.from_group(each comm's group, 'cpu'), the same local shards"
           if plan.tp_api else "; TP layers hand-written (F.linear, then the comm's calls)"),
        f"# Per step: {2 * cfg.layers} all-reduces of {plan.allreduce_nbytes} B "
        f"(bf16 [{batch}, {cfg.hidden}]) + 1 allgather of {plan.allgather_nbytes} B per rank "
        f"(bf16 logits [{batch}, {cfg.vocab // tp}])",
        f"# Decode: batch {batch}, prompt {plan.prompt_len} tokens, greedy; per backend "
        f"{plan.steps} timed steps in {len(plan.per_round)} rounds, backends taking turns, "
        f"each round from the prompt with {plan.warmup_steps} warm-up steps",
    ]


def _threads_line(threads: _Threads, interop_threads: int) -> str:
    omp = os.environ.get("OMP_NUM_THREADS", "unset")
    gomp = os.environ.get("GOMP_SPINCOUNT")
    return (
        f"# Threads per rank: {threads.count} (torch.set_num_threads: {threads.host_cpus} host "
        f"CPUs / {threads.local_ranks} ranks on the host, {threads.allowed_cpus} CPUs allowed "
        f"to this rank; interop {interop_threads}, OMP_NUM_THREADS={omp}"
        + (f", GOMP_SPINCOUNT={gomp}" if gomp is not None else "")
        + ")"
    )


def _method_lines(same_host: bool) -> list[str]:
    lines = [
        "# tok/s = batch / median step time; ms/tok(en) = median step time (one token of every "
        "sequence); rounds (min-max): the lowest and highest round's tok/s",
        "# mean step = compute + collectives (means over steps and ranks, so they add up; "
        "the mean step and the prefill time are in --json and --wide); "
        "collect.: time in the 2 x layers all-reduces and the logits gather, waiting for the "
        "last rank included; share = collect. / mean step; min rank: the share of the rank that "
        "waits least; compute grows when waiting ranks slow the computing ones",
    ]
    if same_host:
        lines.append(
            "# after last arrival: the part of collect. after the last rank entered each call "
            "(one host, one clock): the collectives' own latency, without waiting for late or "
            "descheduled peers; share = its ms / mean ms"
        )
    else:
        lines.append(
            "# after last arrival: not measured (ranks on several hosts do not share a clock)"
        )
    return lines


# --- rounds and results ---------------------------------------------------


def _run_rounds(models: dict, impls, prompt, plan: _Plan, comm,
                profiles=None) -> dict[str, _Measured]:
    """Every backend's rounds on this rank (collective); ``profiles``: name ->
    _StepProfile of the backends --profile records."""
    # Backends take turns, round by round, so a change in the machine's
    # load hits all of them alike; every round starts from the prompt.
    measured = {impl.name: _Measured() for impl in impls}
    for round_index, n_steps in enumerate(plan.per_round):
        for impl in impls:
            t0 = time.perf_counter()
            args = (models[impl.name], impl, prompt, plan.warmup_steps, n_steps, comm.Barrier)
            prof = (profiles or {}).get(impl.name)
            result = _decode(*args) if prof is None else prof.run(
                _decode, args, 1 + plan.warmup_steps + n_steps)
            digests = comm.allgather(_tokens_digest(result.tokens))
            backend = measured[impl.name]
            backend.identical = backend.identical and len(set(digests)) == 1
            backend.rounds.append(result)
            if comm.Get_rank() == 0:
                tok_s = plan.batch * 1e9 / np.median(result.step_ns)
                _progress(f"round {round_index + 1}/{len(plan.per_round)} {impl.name}: "
                          f"{n_steps} steps, {tok_s:.1f} tok/s on rank 0, "
                          f"{time.perf_counter() - t0:.1f} s")
    return measured


def _progress(text: str) -> None:
    """A progress line on stderr (rank 0), so stdout keeps only the report."""
    print(f"# decode: {text}", file=sys.stderr, flush=True)


def _gather_row(name: str, measured: _Measured, plan: _Plan, comm, same_host: bool):
    """One backend's result row on rank 0 from every rank's rounds, None elsewhere (collective)."""
    longest = measured.longest_tokens()
    repeatable = all((r.tokens == longest[:, : r.tokens.shape[1]]).all() for r in measured.rounds)
    step_ns, comm_ns, enter_ns, exit_ns = (
        comm.gather(measured.concatenated(field), root=0)
        for field in ("step_ns", "comm_ns", "enter_ns", "exit_ns")
    )
    prefill_ns = comm.gather(np.median([r.prefill_ns for r in measured.rounds]), root=0)
    if comm.Get_rank() != 0:
        return None
    latency_ns = None
    if same_host:
        latency_ns = collective_latency_ns(np.stack(enter_ns), np.stack(exit_ns))
    row = {"comm": name}
    row.update(summarize_backend(np.stack(step_ns), np.stack(comm_ns), plan.batch, latency_ns,
                                 [len(r.step_ns) for r in measured.rounds]))
    row.update(
        prefill_ms=float(np.max(prefill_ns) / 1e6),
        tokens_identical_across_ranks=measured.identical,
        tokens_repeat_across_rounds=repeatable,
        **plan.row_fields(),
        tokens_sha=_tokens_digest(longest),
    )
    return row


class _StepProfile:
    """--profile: harmpi.profile of one backend's rounds, on only while
    they run, with the wall time and forward passes it covered."""

    def __init__(self, ctx):
        from harmpi.profile import Profile

        self.profile = Profile(ctx)  # collective: it times the clocks
        self.wall_ns = 0
        self.passes = 0

    def run(self, fn, args, passes):
        self.profile.start()
        t0 = time.perf_counter_ns()
        try:
            return fn(*args)
        finally:
            self.wall_ns += time.perf_counter_ns() - t0
            self.profile.stop()
            self.passes += passes


def _step_profiles(impls) -> dict:
    """name -> _StepProfile of every backend that runs on a harmpi context."""
    from harmpi.registry import STATE

    out = {}
    for impl in impls:
        ctx = getattr(getattr(impl, "group", None), "_ctx", None)  # torch:harmpi
        if ctx is None and getattr(impl, "_harmpi", None) is not None:
            ctx = STATE.get(impl._comm)
        if ctx is not None:
            out[impl.name] = _StepProfile(ctx)
    return out


def _profile_lines(profiles: dict, comm) -> list[str]:
    """Per profiled backend, the mean forward pass (prefill, warm-up and
    timed steps) split by harmpi.profile (collective; lines on rank 0)."""
    lines = []
    for name, sp in profiles.items():
        s = sp.profile.stats()
        walls = comm.gather(sp.wall_ns / 1e9, root=0)
        if comm.Get_rank() != 0:
            continue
        n = max(1, sp.passes)
        wall = float(np.mean(walls)) / n
        wait = float(np.mean(s["wait_s_by_rank"])) / n
        own = float(np.mean(s["own_s_by_rank"])) / n
        compute = wall - wait - own
        late = ", ".join(f"{r}: {c}" for r, c in s["last_arrival_count"].items())
        lines.append(
            f"# profile {name}: per forward pass {wall * 1e3:.3f} ms = compute "
            f"{compute * 1e3:.3f} ({100 * compute / wall:.1f}%) + waiting for the last rank "
            f"{wait * 1e3:.3f} ({100 * wait / wall:.1f}%) + collectives' own time "
            f"{own * 1e3:.3f} ({100 * own / wall:.1f}%); {s['calls'] / n:.0f} collectives per "
            f"pass; last arrivals by rank: {late} (harmpi.profile, mean over ranks)")
    return lines


def _mark_agreement(rows: list[dict], tokens: dict[str, np.ndarray],
                    margins: dict[str, np.ndarray] | None = None,
                    prefill: dict[str, np.ndarray] | None = None) -> None:
    """Compare every backend's tokens with the first backend's (rank 0); where
    they part, note how near a tie the first backend's top two logits were."""
    first = rows[0]["comm"]
    for row in rows:
        divergence = first_divergence(tokens[first], tokens[row["comm"]])
        row["agrees_with"] = first
        row["first_divergence"] = divergence
        row["tokens_agree"] = divergence is None
        row["divergence_margin_ulps"] = None
        if divergence is not None and margins is not None and divergence < len(margins[first]):
            row["divergence_margin_ulps"] = float(margins[first][divergence])
        row["divergence_note"] = divergence_note(divergence, row["divergence_margin_ulps"])
        row["prefill_logits_gap_ulps"] = None
        if prefill is not None:
            row["prefill_logits_gap_ulps"] = logits_gap_ulps(prefill[first], prefill[row["comm"]])


def _report_lines(rows: Sequence[dict], wide: bool = False) -> list[str]:
    """The table and the notes under it (rows marked by ``_mark_agreement``)."""
    lines = format_decode_table(rows, wide)
    for row in rows:
        if not row["tokens_identical_across_ranks"]:
            lines.append(f"# ERROR: {row['comm']}: ranks generated different tokens")
        if not row["tokens_repeat_across_rounds"]:
            lines.append(
                f"# note: {row['comm']}: rounds from the same prompt generated different tokens"
            )
    agreement = [f"{row['comm']} vs {row['agrees_with']}: {row['divergence_note']}"
                 for row in rows[1:]]
    if agreement:
        lines.append("# tokens agree across backends: " + "; ".join(agreement))
    gaps = [f"{row['comm']} {row['prefill_logits_gap_ulps']:.1f}" for row in rows[1:]
            if row.get("prefill_logits_gap_ulps") is not None]
    if gaps:
        lines.append(f"# logits from the same prompt (prefill, round 1) vs {rows[0]['comm']}: "
                     "largest difference in bf16 ulps of the largest logit: " + "; ".join(gaps)
                     + " (0: bitwise equal)")
    reference = next((row for row in rows if row["comm"] == "harmpi"), None)
    if reference is not None and len(rows) > 1:
        ratios = [
            f"harmpi / {row['comm']} {reference['tokens_per_s'] / row['tokens_per_s']:.2f}x"
            for row in rows
            if row is not reference
        ]
        lines.append("# tok/s ratio: " + "; ".join(ratios))
    return lines


def _write_json(path: str, meta: dict, rows: Sequence[dict]) -> None:
    with open(path, "w") as fh:
        json.dump({"meta": _jsonable(meta), "rows": list(rows)}, fh, indent=2)
        fh.write("\n")


def _jsonable(value):
    from bench.osu import _jsonable as convert

    return convert(value)


def run(cfg: ModelConfig, *, comms: Sequence[str], batch: int, prompt_len: int, steps: int,
        warmup_steps: int, seed: int, threads: int | None, json_path: str | None,
        rounds: int = 4, tp_api: bool = False, comm=None, profile: bool = False,
        load: int = 0, wide: bool = False) -> int:
    """Run the benchmark on every rank of ``comm`` (default: the world); rank 0
    prints and writes ``json_path``.  Returns the exit code, the same on every
    rank: 1 if any backend's ranks generated different tokens.  ``load``: busy
    processes on the first rank of each host while the rounds run (bench.load)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    plan = _Plan(cfg, comm.Get_size(), batch, prompt_len, steps, warmup_steps, rounds, seed,
                 tp_api)
    threads_used = _set_threads(comm, threads)
    model, build_s = _build_model(plan, comm)
    prompt = _prompt(plan)
    impls = make_impls(comms, comm)
    try:
        # --tp-api: one DTensor model per comm (a DeviceMesh is one group), same weights
        models = {impl.name: DTensorDecoder(model, impl.group) if tp_api else model
                  for impl in impls}
        identical = _run_backends(plan, models, prompt, impls, comm, threads=threads_used,
                                  build_s=build_s, json_path=json_path, profile=profile,
                                  load=load, wide=wide)
        return int(comm.allreduce(0 if identical else 1, op=MPI.MAX))
    finally:
        close_impls(impls)


def _run_backends(plan: _Plan, models: dict, prompt, impls, comm, *, threads: _Threads,
                  build_s: float, json_path: str | None, profile: bool = False,
                  load: int = 0, wide: bool = False) -> bool:
    """Print the header, run the rounds, report (rank 0).  True if every
    backend's ranks generated identical tokens."""
    from bench.osu import bench_version, environment_lines, topology

    rank = comm.Get_rank()
    topo = topology(comm)
    info = harmpi_info_of(impls)
    model = next(iter(models.values()))
    env_lines = environment_lines(comm, topo, info)
    same_host = topo["hosts"] == 1
    descriptions = {impl.name: impl.describe_tensors(DTYPES["bf16"]) for impl in impls}
    if plan.tp_api:  # torch's DTensor layers issue the collectives, not the adapter
        descriptions = {impl.name: f"{impl.name}: DTensor's functional collectives "
                        f"(all_reduce of o and down, all_gather of the logits) on "
                        f"{impl.group_description()}" for impl in impls}
    if rank == 0:
        lines = [
            f"# harmpi TP decode benchmark v{bench_version()} "
            "(Qwen2.5-shaped decoder, random bf16 weights)",
            *env_lines,
            *_model_lines(plan, model.shard_bytes(), build_s),
            _threads_line(threads, model.torch.get_num_interop_threads()),
            *(f"# {text}" for text in descriptions.values()),
            *_method_lines(same_host),
        ]
        print("\n".join(harness.fit_lines(lines, None if wide else harness.WIDTH)), flush=True)

    profiles = _step_profiles(impls) if profile else None
    with host_load(comm, load) as busy:
        measured = _run_rounds(models, impls, prompt, plan, comm, profiles)
    if rank == 0 and load:
        print(busy.summary(), flush=True)
    rows = [_gather_row(impl.name, measured[impl.name], plan, comm, same_host) for impl in impls]
    split = _profile_lines(profiles, comm) if profiles else []
    if rank == 0:
        _mark_agreement(rows, {name: m.longest_tokens() for name, m in measured.items()},
                        {name: m.longest().margin_ulps for name, m in measured.items()},
                        {name: m.rounds[0].prefill_logits for name, m in measured.items()})
        print("\n".join(harness.fit_lines(_report_lines(rows, wide) + split,
                                           None if wide else harness.WIDTH)), flush=True)
        if json_path:
            meta = {
                "benchmark": "decode",
                "model": dataclasses.asdict(plan.cfg),
                "ranks": plan.tp,
                "topology": topo,
                "threads_per_rank": threads.count,
                "prompt_len": plan.prompt_len,
                "environment": [line.lstrip("# ") for line in env_lines],
                "descriptions": descriptions,
                "harmpi_info": info,
                "tp_api": plan.tp_api,
            }
            _write_json(json_path, meta, rows)
    return all(backend.identical for backend in measured.values())


# --------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------


@click.command(
    name="decode",
    help=(
        "Tensor-parallel greedy decode of a Qwen2.5-shaped model with random bf16 weights, "
        "one run per communication backend. Run under MPI: "
        "mpirun -np N python -m mpi4py -m bench.decode --comm harmpi,gloo,mpi"
    ),
)
@harness.help_option()
@click.option("--comm", "comm_spec", default=None,
              help="Comma list of harmpi (harmpi.allreduce), torch:harmpi (torch.distributed "
                   "on a harmpi process group), gloo (= torch:gloo), mpi.  [default: "
                   "harmpi,gloo,mpi; with --tp-api torch:harmpi,gloo]")
@click.option("--tp-api", is_flag=True,
              help="Build the TP layers with torch's parallelize_module on a DeviceMesh of "
                   "each comm's process group (torch comms only).")
@click.option("--hidden", type=click.IntRange(min=2), default=ModelConfig.hidden,
              show_default=True)
@click.option("--layers", type=click.IntRange(min=1), default=ModelConfig.layers,
              show_default=True)
@click.option("--heads", type=click.IntRange(min=1), default=ModelConfig.heads,
              show_default=True)
@click.option("--kv-heads", type=click.IntRange(min=1), default=ModelConfig.kv_heads,
              show_default=True)
@click.option("--ffn", type=click.IntRange(min=1), default=ModelConfig.ffn, show_default=True)
@click.option("--vocab", type=click.IntRange(min=1), default=ModelConfig.vocab,
              show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=4, show_default=True,
              help="Sequences decoded together; the all-reduce carries batch x hidden bf16 "
                   "(default 4 x 1280 x 2 B = 10240 B).")
@click.option("--prompt-len", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--tokens", "steps", type=click.IntRange(min=1), default=96, show_default=True,
              help="Timed decode steps per backend (each yields one token per sequence), "
                   "split over the rounds.")
@click.option("--rounds", type=click.IntRange(min=1), default=4, show_default=True,
              help="Backends take turns this many times, each round restarting from the prompt.")
@click.option("--warmup", "warmup_steps", type=click.IntRange(min=0), default=2,
              show_default=True, help="Untimed decode steps at the start of each round.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="torch threads per rank (default: host CPUs / ranks on the host, at least 1).")
@click.option("--seed", type=int, default=1234, show_default=True)
@click.option("--profile", is_flag=True,
              help="Record the harmpi backends with harmpi.profile and print each one's "
                   "step split: compute, waiting for the last rank, the collective's own time.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True),
              default=None, help="Write the results as JSON (rank 0).")
@click.option("--wide", is_flag=True,
              help=f"Print the table with every column (mean step, prefill) and comment lines "
                   f"unwrapped (default: everything fits {harness.WIDTH} columns).")
@click.option("--load", type=click.IntRange(min=0), default=0, show_default=True, metavar="N",
              help="Run N busy processes (unbound spin loops) on each host during the rounds, "
                   "started by the host's first rank; a busy machine on purpose.")
def main(comm_spec, tp_api, hidden, layers, heads, kv_heads, ffn, vocab, batch, prompt_len,
         steps, rounds, warmup_steps, threads, seed, profile, json_path, wide, load):
    if comm_spec is None:
        comm_spec = "torch:harmpi,gloo" if tp_api else "harmpi,gloo,mpi"
    comms = _parse_comms(comm_spec, tp_api)
    cfg = ModelConfig(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, ffn=ffn,
                      vocab=vocab)
    from mpi4py import MPI

    try:
        cfg.check(MPI.COMM_WORLD.Get_size(), even_kv=tp_api)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    code = harness.run_or_abort(run, cfg, comms=comms, batch=batch, prompt_len=prompt_len,
                                steps=steps, warmup_steps=warmup_steps, seed=seed,
                                threads=threads, json_path=json_path, rounds=rounds,
                                tp_api=tp_api, profile=profile, load=load, wide=wide)
    harness.exit_all(code)


def _parse_comms(spec: str, tp_api: bool = False) -> list[str]:
    """'harmpi,gloo' -> the backends, distinct and known (click.UsageError otherwise);
    with ``tp_api`` torch.distributed ones only."""
    comms = [c.strip() for c in spec.split(",") if c.strip()]
    bad = [c for c in comms if c not in COMM_KINDS]
    try:
        parse_impls(spec)  # gloo and torch:gloo are one backend
    except ValueError:
        bad = bad or comms
    if not comms or bad:
        raise click.UsageError(
            f"--comm takes a comma list of distinct {', '.join(COMM_KINDS)}; got {spec!r}"
        )
    others = [c for c in comms if torch_backend(c) is None]
    if tp_api and others:
        raise click.UsageError(
            f"--tp-api builds the TP layers with torch's parallelize_module on a process group, "
            f"so it runs torch.distributed comms only (torch:harmpi, gloo / torch:gloo); "
            f"not {', '.join(others)}"
        )
    return comms

if __name__ == "__main__":
    main()
