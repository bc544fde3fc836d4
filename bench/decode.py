"""Tensor-parallel decode benchmark: a Qwen2.5-shaped decoder, one run per backend.

    mpirun -np 4 python -m mpi4py -m bench.decode --comm harmpi,gloo,mpi
    HARMPI_RANKS_PER_NODE=2 mpirun --oversubscribe -np 4 python -m mpi4py -m bench.decode

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
from typing import Sequence

import click
import numpy as np

from bench import harness

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

COMM_KINDS = ("harmpi", "gloo", "mpi")
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

    def check(self, tp: int) -> None:
        """Raise ValueError unless the model can be sharded over ``tp`` ranks."""
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
                problems.append(f"each rank's {local} q heads must cover whole KV groups of {group} (or lie inside one)")
        if self.ffn % (FFN_UNIT * tp):
            problems.append(f"ffn {self.ffn} is not a multiple of {FFN_UNIT} x {tp} ranks")
        if self.vocab % (VOCAB_UNIT * tp):
            problems.append(f"vocab {self.vocab} is not a multiple of {VOCAB_UNIT} x {tp} ranks")
        if problems:
            raise ValueError("; ".join(problems))

    def params(self) -> int:
        """Parameters of the whole model (embedding + layers + LM head)."""
        hd = self.head_dim
        attn = self.hidden * (self.heads * hd) * 2 + self.hidden * (self.kv_heads * hd) * 2 + (self.heads + 2 * self.kv_heads) * hd
        mlp = 3 * self.hidden * self.ffn
        return self.vocab * self.hidden * 2 + self.layers * (attn + mlp + 2 * self.hidden) + self.hidden


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


def threads_per_rank(host_cpus: int, local_ranks: int, allowed_cpus: int, override: int | None = None) -> int:
    """Compute threads for one rank: the host's CPUs shared among the ranks on it.

    At least 1, and no more than the CPUs the rank is bound to.
    """
    if override is not None:
        return max(1, override)
    return max(1, min(host_cpus // max(1, local_ranks), allowed_cpus))


def round_steps(steps: int, rounds: int) -> list[int]:
    """Split ``steps`` timed steps over at most ``rounds`` rounds, as evenly as possible (no empty round)."""
    rounds = max(1, min(rounds, steps))
    return [steps // rounds + (1 if i < steps % rounds else 0) for i in range(rounds)]


def first_divergence(a: np.ndarray, b: np.ndarray) -> int | None:
    """First generated position (column) where two [batch, steps] token arrays differ, or None."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return 0
    differ = (a != b).any(axis=0)
    return int(np.argmax(differ)) if differ.any() else None


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


def summarize_backend(step_ns: np.ndarray, comm_ns: np.ndarray, batch: int, latency_ns: np.ndarray | None = None) -> dict:
    """Per-rank step and communication times [ranks, steps] -> the reported numbers.

    ms_per_token: median over steps of the rank-averaged step time (each step
    yields one token per sequence); tokens_per_s = batch / that.
    comm_share: time inside collectives / step time, per rank over all steps,
    then the mean over ranks (comm_share_min: the smallest per-rank share).
    comm_latency_share: the same for the time after the last rank arrived
    (see :func:`collective_latency_ns`), None when not measured.
    compute_ms_per_token: the step outside the collectives; it differs between
    backends when their waiting slows the compute (busy-polling a core that
    shares a physical core or a CPU quota with the computing one).
    """
    step_ns = np.asarray(step_ns, dtype=np.float64)
    comm_ns = np.asarray(comm_ns, dtype=np.float64)
    step_ms = np.median(step_ns.mean(axis=0)) / 1e6
    step_total = step_ns.sum(axis=1)
    shares = comm_ns.sum(axis=1) / step_total
    summary = {
        "ms_per_token": float(step_ms),
        "tokens_per_s": float(batch * 1e3 / step_ms),
        "mean_ms_per_token": float(step_ns.mean() / 1e6),
        "comm_share": float(shares.mean()),
        "comm_share_min": float(shares.min()),
        "comm_ms_per_token": float(np.median(comm_ns.mean(axis=0)) / 1e6),
        "compute_ms_per_token": float(np.median((step_ns - comm_ns).mean(axis=0)) / 1e6),
        "comm_latency_share": None,
        "comm_latency_ms_per_token": None,
    }
    if latency_ns is not None:
        latency_ns = np.asarray(latency_ns, dtype=np.float64)
        summary["comm_latency_share"] = float((latency_ns.sum(axis=1) / step_total).mean())
        summary["comm_latency_ms_per_token"] = float(np.median(latency_ns.mean(axis=0)) / 1e6)
    return summary


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_decode_table(rows: Sequence[dict]) -> list[str]:
    """The result table (rank 0 prints it)."""
    lines = [
        f"{'#':<29}{'compute':>10}{'---- inside collectives ----':>30}{'- after last arrival -':>22}",
        f"{'# comm':<10}{'tok/s':>9}{'ms/token':>10}{'ms/token':>10}{'ms/token':>10}{'share':>10}{'min rank':>10}{'ms/token':>12}{'share':>10}"
        f"{'prefill ms':>12}{'ranks agree':>13}",
    ]
    for row in rows:
        agree = {None: "-", True: "yes", False: "NO"}[row.get("tokens_identical_across_ranks")]
        lines.append(
            f"{row['comm']:<10}{row['tokens_per_s']:>9.1f}{row['ms_per_token']:>10.2f}{_ms(row.get('compute_ms_per_token')):>10}"
            f"{_ms(row['comm_ms_per_token']):>10}{_pct(row['comm_share']):>10}{_pct(row['comm_share_min']):>10}"
            f"{_ms(row.get('comm_latency_ms_per_token')):>12}{_pct(row.get('comm_latency_share')):>10}"
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

    def __init__(self, cfg: ModelConfig, layout: ShardLayout, seed: int, batch: int, max_len: int):
        import torch

        self.torch = torch
        self.cfg, self.layout, self.seed = cfg, layout, seed
        self.batch, self.max_len = batch, max_len
        hd, hidden = cfg.head_dim, cfg.hidden
        in_std, ffn_std = hidden**-0.5, cfg.ffn**-0.5
        o_std = (cfg.heads * hd) ** -0.5
        self.n_q, self.n_kv = len(layout.q_heads), len(layout.kv_heads)
        self.layers = []
        for i in range(cfg.layers):
            layer = _Layer()
            q = [_randn(torch, unit_seed(seed, i, "q", h), (hd, hidden), in_std) for h in layout.q_heads]
            k = [_randn(torch, unit_seed(seed, i, "k", h), (hd, hidden), in_std) for h in layout.kv_heads]
            v = [_randn(torch, unit_seed(seed, i, "v", h), (hd, hidden), in_std) for h in layout.kv_heads]
            layer.w_qkv = torch.cat(q + k + v).contiguous()
            bq = [_randn(torch, unit_seed(seed, i, "bq", h), (hd,), 0.1) for h in layout.q_heads]
            bk = [_randn(torch, unit_seed(seed, i, "bk", h), (hd,), 0.1) for h in layout.kv_heads]
            bv = [_randn(torch, unit_seed(seed, i, "bv", h), (hd,), 0.1) for h in layout.kv_heads]
            layer.b_qkv = torch.cat(bq + bk + bv).contiguous()
            layer.w_o = torch.cat([_randn(torch, unit_seed(seed, i, "o", h), (hidden, hd), o_std) for h in layout.q_heads], dim=1).contiguous()
            gate = [_randn(torch, unit_seed(seed, i, "gate", u), (FFN_UNIT, hidden), in_std) for u in layout.ffn_units]
            up = [_randn(torch, unit_seed(seed, i, "up", u), (FFN_UNIT, hidden), in_std) for u in layout.ffn_units]
            layer.w_gate_up = torch.cat(gate + up).contiguous()
            layer.w_down = torch.cat([_randn(torch, unit_seed(seed, i, "down", u), (hidden, FFN_UNIT), ffn_std) for u in layout.ffn_units], dim=1).contiguous()
            layer.ln1 = (1.0 + _randn(torch, unit_seed(seed, i, "ln1"), (hidden,), 0.05).float()).to(torch.bfloat16)
            layer.ln2 = (1.0 + _randn(torch, unit_seed(seed, i, "ln2"), (hidden,), 0.05).float()).to(torch.bfloat16)
            layer.k_cache = torch.zeros(batch, self.n_kv, max_len, hd, dtype=torch.bfloat16)
            layer.v_cache = torch.zeros(batch, self.n_kv, max_len, hd, dtype=torch.bfloat16)
            self.layers.append(layer)
        self.ln_f = (1.0 + _randn(torch, unit_seed(seed, "ln_f"), (hidden,), 0.05).float()).to(torch.bfloat16)
        self.w_lm = torch.cat([_randn(torch, unit_seed(seed, "lm_head", u), (VOCAB_UNIT, hidden), in_std) for u in layout.vocab_units]).contiguous()
        self._embedding: dict[int, object] = {}
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)
        self.cos = angles.cos().to(torch.bfloat16)
        self.sin = angles.sin().to(torch.bfloat16)

    def shard_bytes(self) -> int:
        tensors = [self.w_lm] + [t for layer in self.layers for t in (layer.w_qkv, layer.b_qkv, layer.w_o, layer.w_gate_up, layer.w_down)]
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
        cfg, hd = self.cfg, self.cfg.head_dim
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
        for layer in self.layers:
            a = self._rms(x, layer.ln1)
            qkv = F.linear(a, layer.w_qkv, layer.b_qkv)
            q, k, v = qkv.split([self.n_q * hd, self.n_kv * hd, self.n_kv * hd], dim=-1)
            q = self._rope(q.view(batch, length, self.n_q, hd).transpose(1, 2), cos, sin)
            k = self._rope(k.view(batch, length, self.n_kv, hd).transpose(1, 2), cos, sin)
            layer.k_cache[:, :, start:end] = k
            layer.v_cache[:, :, start:end] = v.view(batch, length, self.n_kv, hd).transpose(1, 2)
            keys, values = layer.k_cache[:, :, :end], layer.v_cache[:, :, :end]
            attn = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=(length > 1 and start == 0), enable_gqa=gqa
            )
            o = F.linear(attn.transpose(1, 2).reshape(batch, length, self.n_q * hd), layer.w_o)
            comm.allreduce(o)  # row-parallel O: partial sums over heads
            x = x + o
            m = self._rms(x, layer.ln2)
            gate, up = F.linear(m, layer.w_gate_up).chunk(2, dim=-1)
            d = F.linear(F.silu(gate) * up, layer.w_down)
            comm.allreduce(d)  # row-parallel down: partial sums over the FFN slice
            x = x + d
        last = self._rms(x[:, -1], self.ln_f)
        logits = F.linear(last, self.w_lm)  # [B, vocab / tp]
        gathered = comm.allgather(logits)  # [tp * B, vocab / tp], rank blocks in order
        tp = self.layout.tp
        full = gathered.view(tp, batch, -1).permute(1, 0, 2).reshape(batch, -1)
        return full.argmax(dim=-1)


# --------------------------------------------------------------------------
# Communication backends
# --------------------------------------------------------------------------


class _TimedComm:
    """Wraps a backend; adds up the ns spent inside its collectives and, once
    ``begin_step`` was called, records each call's entry and exit times."""

    def __init__(self, backend, steps: int, calls_per_step: int):
        self.backend = backend
        self.ns = 0
        self.enter_ns = np.zeros((steps, calls_per_step), dtype=np.int64)
        self.exit_ns = np.zeros((steps, calls_per_step), dtype=np.int64)
        self.step = -1  # not recording (prefill, warm-up)
        self.call = 0

    def begin_step(self, step: int) -> None:
        self.step, self.call, self.ns = step, 0, 0

    def _record(self, t0: int, t1: int) -> None:
        self.ns += t1 - t0
        if self.step >= 0:
            self.enter_ns[self.step, self.call] = t0
            self.exit_ns[self.step, self.call] = t1
            self.call += 1

    def allreduce(self, tensor):
        t0 = time.perf_counter_ns()
        self.backend.allreduce(tensor)
        self._record(t0, time.perf_counter_ns())

    def allgather(self, tensor):
        t0 = time.perf_counter_ns()
        out = self.backend.allgather(tensor)
        self._record(t0, time.perf_counter_ns())
        return out


class HarmpiBackend:
    name = "harmpi"

    def __init__(self, comm):
        import harmpi

        self.harmpi, self.comm = harmpi, comm
        harmpi.init(comm=comm)
        forced = os.environ.get("HARMPI_ALGORITHM")
        self.description = f"harmpi: harmpi.allreduce / harmpi.allgather on bf16 tensors, algorithm {forced + ' (HARMPI_ALGORITHM)' if forced else 'auto'}"

    def allreduce(self, tensor):
        self.harmpi.allreduce(tensor, comm=self.comm)

    def allgather(self, tensor):
        return self.harmpi.allgather(tensor, comm=self.comm)

    def close(self):
        self.harmpi.finalize()


class GlooBackend:
    name = "gloo"

    def __init__(self, comm):
        import torch
        import torch.distributed as dist

        from bench.impls import gloo_allgather_function, init_gloo

        self.torch, self.dist = torch, dist
        address, port = init_gloo(comm)
        self._gather = gloo_allgather_function()
        self._outs: dict = {}
        self.description = f"gloo: torch.distributed.all_reduce / {self._gather.__name__} on bf16 tensors, tcp://{address}:{port}"

    def allreduce(self, tensor):
        self.dist.all_reduce(tensor)

    def allgather(self, tensor):
        key = tuple(tensor.shape)
        out = self._outs.get(key)
        if out is None:
            out = self._outs[key] = self.torch.empty((self.dist.get_world_size() * tensor.shape[0],) + key[1:], dtype=tensor.dtype)
        self._gather(out, tensor)
        return out  # reused by the next call; the caller consumes it first

    def close(self):
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


class MpiBackend:
    """MPI_Allreduce on float32 (bf16 converted in and out: MPI has no bf16), MPI_Allgather of the bf16 bytes."""

    name = "mpi"

    def __init__(self, comm):
        import torch
        from mpi4py import MPI

        self.torch, self.MPI, self.comm = torch, MPI, comm
        self._f32: dict = {}
        self.description = "mpi: MPI_Allreduce on float32 (bf16 converted in and out), MPI_Allgather of bf16 bytes"

    def allreduce(self, tensor):
        buf = self._f32.get(tensor.numel())
        if buf is None:
            buf = self._f32[tensor.numel()] = self.torch.empty(tensor.numel(), dtype=self.torch.float32)
        buf.copy_(tensor.reshape(-1))
        self.comm.Allreduce(self.MPI.IN_PLACE, [buf.numpy(), self.MPI.FLOAT], self.MPI.SUM)
        tensor.reshape(-1).copy_(buf)

    def allgather(self, tensor):
        torch = self.torch
        out = torch.empty((self.comm.Get_size() * tensor.shape[0],) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
        send = tensor.contiguous().view(torch.int16).numpy()
        self.comm.Allgather([send, self.MPI.BYTE], [out.view(torch.int16).numpy(), self.MPI.BYTE])
        return out

    def close(self):
        pass


_BACKENDS = {"harmpi": HarmpiBackend, "gloo": GlooBackend, "mpi": MpiBackend}


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------


def _decode(model: TPDecoder, backend, prompt, warmup_steps: int, steps: int, barrier):
    """Prefill + warm-up + timed steps.

    Returns (tokens [B, 1 + warmup + steps], step_ns [steps], comm_ns [steps],
    enter_ns and exit_ns [steps, calls], prefill_ns).
    """
    torch = model.torch
    comm = _TimedComm(backend, steps, 2 * model.cfg.layers + 1)
    barrier()
    with torch.inference_mode():
        t0 = time.perf_counter_ns()
        token = model.forward(prompt, 0, comm)
        prefill_ns = time.perf_counter_ns() - t0
        generated = [token]
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
            if timed >= 0:
                step_ns[timed] = elapsed
                comm_ns[timed] = comm.ns
    tokens = torch.stack(generated, dim=1).numpy()
    return tokens, step_ns, comm_ns, comm.enter_ns, comm.exit_ns, prefill_ns


def _host_info(comm):
    from mpi4py import MPI

    host_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local_ranks = host_comm.Get_size()
    host_comm.Free()
    return local_ranks


def run(cfg: ModelConfig, *, comms: Sequence[str], batch: int, prompt_len: int, steps: int, warmup_steps: int,
        seed: int, threads: int | None, json_path: str | None, rounds: int = 4, comm=None) -> int:
    from mpi4py import MPI

    from bench.osu import bench_version, environment_lines, topology

    comm = MPI.COMM_WORLD if comm is None else comm
    rank, tp = comm.Get_rank(), comm.Get_size()
    say = (lambda text="": print(text, flush=True)) if rank == 0 else (lambda text="": None)

    local_ranks = _host_info(comm)
    allowed = len(os.sched_getaffinity(0))
    n_threads = threads_per_rank(os.cpu_count() or 1, local_ranks, allowed, threads)
    # Before torch starts its OpenMP pool; a value the user exported wins.
    os.environ.setdefault("OMP_NUM_THREADS", str(n_threads))
    import torch

    torch.set_num_threads(n_threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or parallel work already started
        pass

    layout = shard_layout(cfg, tp, rank)
    max_len = prompt_len + warmup_steps + max(round_steps(steps, rounds)) + 1
    t0 = time.perf_counter()
    model = TPDecoder(cfg, layout, seed, batch, max_len)
    build_s = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    prompt = torch.from_numpy(np.random.default_rng([seed, 7]).integers(0, cfg.vocab, (batch, prompt_len)))

    backends = []
    try:
        for name in comms:
            backends.append(_BACKENDS[name](comm))
        topo = topology(comm)
        harmpi_info = None
        if any(b.name == "harmpi" for b in backends):
            import harmpi

            harmpi_info = dict(harmpi.info(comm=comm))
        env_lines = environment_lines(comm, topo, harmpi_info)
        same_host = topo["hosts"] == 1

        say(f"# harmpi TP decode benchmark v{bench_version()} (Qwen2.5-shaped decoder, random bf16 weights)")
        for line in env_lines:
            say(line)
        params = cfg.params()
        say(
            f"# Model: hidden {cfg.hidden}, layers {cfg.layers}, heads {cfg.heads} (kv {cfg.kv_heads}, head_dim {cfg.head_dim}), "
            f"ffn {cfg.ffn}, vocab {cfg.vocab}: {params / 1e6:.0f} M parameters, "
            f"{model.shard_bytes() / 2**20:.0f} MiB of sharded bf16 weights per rank (built in {build_s:.1f} s)"
        )
        say(f"# Sharding over {tp} ranks: column-parallel QKV and gate/up, row-parallel O and down, vocab-parallel LM head, replicated embedding")
        ar_nbytes = batch * cfg.hidden * 2
        ag_nbytes = batch * (cfg.vocab // tp) * 2
        say(
            f"# Per step: {2 * cfg.layers} all-reduces of {ar_nbytes} B (bf16 [{batch}, {cfg.hidden}]) "
            f"+ 1 allgather of {ag_nbytes} B per rank (bf16 logits [{batch}, {cfg.vocab // tp}])"
        )
        say(
            f"# Decode: batch {batch}, prompt {prompt_len} tokens, greedy; per backend {steps} timed steps in "
            f"{len(round_steps(steps, rounds))} rounds, backends taking turns, each round from the prompt with {warmup_steps} warm-up steps"
        )
        omp = os.environ.get("OMP_NUM_THREADS", "unset")
        say(
            f"# Threads per rank: {n_threads} (torch.set_num_threads: {os.cpu_count()} host CPUs / {local_ranks} ranks on the host, "
            f"{allowed} CPUs allowed to this rank; interop {torch.get_num_interop_threads()}, OMP_NUM_THREADS={omp}"
            + (f", GOMP_SPINCOUNT={os.environ['GOMP_SPINCOUNT']}" if "GOMP_SPINCOUNT" in os.environ else "")
            + ")"
        )
        for backend in backends:
            say(f"# {backend.description}")
        say("# tok/s = batch / median step time; ms/token = median step time (one token of every sequence); "
            "compute = the step outside the collectives (it grows when waiting ranks slow the computing ones)")
        say("# inside collectives: time per step in the 2 x layers all-reduces and the logits gather, and its share of the step "
            "(mean over ranks; min rank: the rank that waits least); it includes waiting for the last rank to arrive")
        if same_host:
            say("# after last arrival: the part of it after the last rank entered each call (one host, one clock): "
                "the collectives' own latency, without waiting for late or descheduled peers")
        else:
            say("# after last arrival: not measured (ranks on several hosts do not share a clock)")

        # Backends take turns, round by round, so a change in the machine's
        # load hits all of them alike; every round starts from the prompt.
        per_round = round_steps(steps, rounds)
        results = {b.name: {"step_ns": [], "comm_ns": [], "enter_ns": [], "exit_ns": [], "prefill_ns": [], "tokens": [], "identical": True}
                   for b in backends}
        for n_steps in per_round:
            for backend in backends:
                tokens, step_ns, comm_ns, enter_ns, exit_ns, prefill_ns = _decode(model, backend, prompt, warmup_steps, n_steps, comm.Barrier)
                digests = comm.allgather(hashlib.blake2b(tokens.tobytes(), digest_size=16).hexdigest())
                result = results[backend.name]
                result["identical"] = result["identical"] and len(set(digests)) == 1
                for key, value in (("tokens", tokens), ("step_ns", step_ns), ("comm_ns", comm_ns), ("enter_ns", enter_ns),
                                   ("exit_ns", exit_ns), ("prefill_ns", prefill_ns)):
                    result[key].append(value)

        rows, all_tokens, exit_code = [], {}, 0
        for backend in backends:
            result = results[backend.name]
            identical = result["identical"]
            if not identical:
                exit_code = 1
            longest = max(result["tokens"], key=lambda t: t.shape[1])
            all_tokens[backend.name] = longest
            repeatable = all((t == longest[:, : t.shape[1]]).all() for t in result["tokens"])
            steps_all = comm.gather(np.concatenate(result["step_ns"]), root=0)
            comms_all = comm.gather(np.concatenate(result["comm_ns"]), root=0)
            enter_all = comm.gather(np.concatenate(result["enter_ns"]), root=0)
            exit_all = comm.gather(np.concatenate(result["exit_ns"]), root=0)
            prefill_all = comm.gather(np.median(result["prefill_ns"]), root=0)
            if rank == 0:
                latency_ns = collective_latency_ns(np.stack(enter_all), np.stack(exit_all)) if same_host else None
                row = {"comm": backend.name}
                row.update(summarize_backend(np.stack(steps_all), np.stack(comms_all), batch, latency_ns))
                row.update(
                    prefill_ms=float(np.max(prefill_all) / 1e6),
                    tokens_identical_across_ranks=identical,
                    tokens_repeat_across_rounds=repeatable,
                    steps=steps,
                    rounds=len(per_round),
                    warmup_steps=warmup_steps,
                    batch=batch,
                    collectives_per_token=2 * cfg.layers + 1,
                    allreduce_nbytes=ar_nbytes,
                    allgather_nbytes=ag_nbytes,
                    tokens_sha=hashlib.blake2b(longest.tobytes(), digest_size=16).hexdigest(),
                )
                rows.append(row)

        if rank == 0:
            for line in format_decode_table(rows):
                print(line)
            compared = rows
            first = compared[0]["comm"]
            for row in compared:
                if not row["tokens_identical_across_ranks"]:
                    print(f"# ERROR: {row['comm']}: ranks generated different tokens")
                if not row["tokens_repeat_across_rounds"]:
                    print(f"# note: {row['comm']}: rounds from the same prompt generated different tokens")
            agreement = []
            for row in compared:
                divergence = first_divergence(all_tokens[first], all_tokens[row["comm"]])
                row["agrees_with"] = first
                row["first_divergence"] = divergence
                row["tokens_agree"] = divergence is None
                if row["comm"] != first:
                    agreement.append(f"{row['comm']} vs {first}: " + ("yes" if divergence is None else f"no (first divergence at generated token {divergence})"))
            if agreement:
                print("# tokens agree across backends: " + "; ".join(agreement))
            reference = next((row for row in compared if row["comm"] == "harmpi"), None)
            if reference is not None and len(compared) > 1:
                ratios = [f"harmpi / {row['comm']} {reference['tokens_per_s'] / row['tokens_per_s']:.2f}x" for row in compared if row is not reference]
                print("# tok/s ratio: " + "; ".join(ratios))
            sys.stdout.flush()
            if json_path:
                meta = {
                    "benchmark": "decode",
                    "model": dataclasses.asdict(cfg),
                    "ranks": tp,
                    "topology": topo,
                    "threads_per_rank": n_threads,
                    "prompt_len": prompt_len,
                    "environment": [line.lstrip("# ") for line in env_lines],
                    "descriptions": {b.name: b.description for b in backends},
                    "harmpi_info": harmpi_info,
                }
                with open(json_path, "w") as fh:
                    json.dump({"meta": _jsonable(meta), "rows": rows}, fh, indent=2)
                    fh.write("\n")
        return int(comm.allreduce(exit_code, op=MPI.MAX))
    finally:
        for backend in reversed(backends):
            backend.close()


def _jsonable(value):
    from bench.osu import _jsonable as convert

    return convert(value)


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
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.option("--comm", "comm_spec", default="harmpi,gloo,mpi", show_default=True,
              help="Comma list of harmpi, gloo, mpi.")
@click.option("--hidden", type=click.IntRange(min=2), default=ModelConfig.hidden, show_default=True)
@click.option("--layers", type=click.IntRange(min=1), default=ModelConfig.layers, show_default=True)
@click.option("--heads", type=click.IntRange(min=1), default=ModelConfig.heads, show_default=True)
@click.option("--kv-heads", type=click.IntRange(min=1), default=ModelConfig.kv_heads, show_default=True)
@click.option("--ffn", type=click.IntRange(min=1), default=ModelConfig.ffn, show_default=True)
@click.option("--vocab", type=click.IntRange(min=1), default=ModelConfig.vocab, show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=4, show_default=True,
              help="Sequences decoded together; the all-reduce carries batch x hidden bf16 (default 4 x 1280 x 2 B = 10240 B).")
@click.option("--prompt-len", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--tokens", "steps", type=click.IntRange(min=1), default=96, show_default=True,
              help="Timed decode steps per backend (each yields one token per sequence), split over the rounds.")
@click.option("--rounds", type=click.IntRange(min=1), default=4, show_default=True,
              help="Backends take turns this many times, each round restarting from the prompt.")
@click.option("--warmup", "warmup_steps", type=click.IntRange(min=0), default=2, show_default=True,
              help="Untimed decode steps at the start of each round.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="torch threads per rank (default: host CPUs / ranks on the host, at least 1).")
@click.option("--seed", type=int, default=1234, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None, help="Write the results as JSON (rank 0).")
def main(comm_spec, hidden, layers, heads, kv_heads, ffn, vocab, batch, prompt_len, steps, rounds, warmup_steps, threads, seed, json_path):
    comms = [c.strip() for c in comm_spec.split(",") if c.strip()]
    bad = [c for c in comms if c not in COMM_KINDS]
    if not comms or bad or len(set(comms)) != len(comms):
        raise click.UsageError(f"--comm takes a comma list of distinct {', '.join(COMM_KINDS)}; got {comm_spec!r}")
    cfg = ModelConfig(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab)
    from mpi4py import MPI

    try:
        cfg.check(MPI.COMM_WORLD.Get_size())
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    code = harness.run_or_abort(run, cfg, comms=comms, batch=batch, prompt_len=prompt_len, steps=steps,
                                warmup_steps=warmup_steps, seed=seed, threads=threads,
                                json_path=json_path, rounds=rounds)
    sys.exit(code)


if __name__ == "__main__":
    main()
