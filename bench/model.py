"""The decode benchmarks' models: a Qwen2.5-shaped decoder with seeded bf16
weights, sharded for tensor parallelism, and what the MoE model
(``bench.moe_model``) shares with it.

The layer is Qwen2.5's: RMSNorm, rotary attention with grouped KV heads
(q/k/v bias, no o bias) and a KV cache, SwiGLU MLP.  ``TPDecoder`` shards it
Megatron-style over the ranks:

* QKV and gate/up are column-parallel (each rank owns whole heads and a slice
  of the FFN), O and down are row-parallel, so every layer ends its
  attention and its MLP with one all-reduce of the hidden state
  (batch x hidden bf16);
* the LM head is vocab-parallel: each step gathers every rank's slice of the
  logits (one allgather) and takes the greedy argmax over the vocabulary;
* the embedding is replicated (rows generated from the seed on demand).

``DTensorDecoder`` is the same model with its tensor-parallel layers built by
torch (``parallelize_module`` on a ``DeviceMesh`` of a process group).

Weights are generated per unit (one attention head, 64 FFN rows/columns, 256
vocabulary rows) from a seed that names the unit (``unit_seed``), so each
rank generates only its shard and the model does not depend on the number
of ranks.  A model calls its communicator's ``allreduce(tensor)`` (in place)
and ``allgather(tensor)``; the runners (``bench.decode``,
``bench.moe_decode``) time those calls.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time

__all__ = [
    "FFN_UNIT",
    "VOCAB_UNIT",
    "unit_seed",
    "seeded_randn",
    "kv_groups_problem",
    "vocab_in_order",
    "SeededDecoder",
    "ModelConfig",
    "ShardLayout",
    "shard_layout",
    "TPDecoder",
    "DTensorDecoder",
]

FFN_UNIT = 64  # FFN rows (gate/up) / columns (down) generated per seed
VOCAB_UNIT = 256  # LM-head rows generated per seed


# --------------------------------------------------------------------------
# Seeded weights and what both models share
# --------------------------------------------------------------------------


def unit_seed(seed: int, *parts) -> int:
    """A 63-bit seed naming one unit of weights, e.g. (seed, layer, 'q', head)."""
    text = repr((seed,) + tuple(parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def seeded_randn(torch, seed: int, shape, std: float):
    """bf16 normal(0, std) values of ``shape`` drawn (in float32) from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator, dtype=torch.float32) * std).to(torch.bfloat16)


def kv_groups_problem(heads: int, kv_heads: int, tp: int) -> str | None:
    """Why ``tp`` ranks' blocks of q heads do not fit the KV groups, None when they do:
    a rank's heads must cover whole groups or lie inside one."""
    local, group = heads // tp, heads // max(1, kv_heads)
    if local % group and group % local:
        return (f"each rank's {local} q heads must cover whole KV groups of {group} "
                "(or lie inside one)")
    return None


def vocab_in_order(gathered, n_ranks: int, batch: int):
    """Every rank's [batch, vocab / n] logits gathered along dim 0 in rank
    order -> [batch, vocab]."""
    return gathered.view(n_ranks, batch, -1).permute(1, 0, 2).reshape(batch, -1)


class SeededDecoder:
    """What both benchmark models do alike: weight blocks generated per unit,
    the embedding (rows generated on demand, replicated), RMSNorm, rotary
    embeddings and attention over a KV cache.

    A subclass calls ``_start(cfg, seed, max_len, n_q, n_kv)`` first; its
    layers have ``k_cache`` and ``v_cache`` [batch, n_kv, max_len, head_dim].
    ``cfg`` has hidden, head_dim, rope_theta and rms_eps.
    """

    def _start(self, cfg, seed: int, max_len: int, n_q: int, n_kv: int) -> None:
        import torch

        self.torch, self.cfg, self.seed, self.max_len = torch, cfg, seed, max_len
        self.n_q, self.n_kv = n_q, n_kv
        self._embedding: dict[int, object] = {}
        self.last_logits = None
        hd = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)
        self.cos = angles.cos().to(torch.bfloat16)
        self.sin = angles.sin().to(torch.bfloat16)

    def _blocks(self, name: tuple, units, shape, std: float, dim: int = 0):
        """One random block per unit, seeded by (seed, *name, unit), concatenated along ``dim``."""
        torch = self.torch
        blocks = [seeded_randn(torch, unit_seed(self.seed, *name, unit), shape, std)
                  for unit in units]
        return torch.cat(blocks, dim=dim).contiguous()

    def _norm_weight(self, size: int, *name):
        """An RMSNorm weight of ``size``: 1 + noise seeded by (seed, *name)."""
        noise = seeded_randn(self.torch, unit_seed(self.seed, *name), (size,), 0.05)
        return (1.0 + noise.float()).to(self.torch.bfloat16)

    def no_autograd(self):
        """The context the model runs in: torch.inference_mode()."""
        return self.torch.inference_mode()

    def embed(self, tokens):
        """[B, S] ids -> [B, S, hidden] bf16; row t is generated from (seed, 'embed', t)."""
        rows = []
        for token in tokens.reshape(-1).tolist():
            row = self._embedding.get(token)
            if row is None:
                row = seeded_randn(self.torch, unit_seed(self.seed, "embed", token),
                                   (self.cfg.hidden,), 1.0)
                self._embedding[token] = row
            rows.append(row)
        return self.torch.stack(rows).view(tokens.shape[0], tokens.shape[1], self.cfg.hidden)

    def _embed_at(self, tokens, start: int):
        """``embed(tokens)`` for positions start..start+S-1; ValueError past the KV cache."""
        end = start + tokens.shape[1]
        if end > self.max_len:
            raise ValueError(f"position {end} beyond the KV cache ({self.max_len})")
        return self.embed(tokens)

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

    def _attend(self, layer, q, k, v, start: int):
        """Causal attention of this rank's heads over the KV cache.

        q [B, n_q, S, head_dim] and k [B, n_kv, S, head_dim] before rotary
        embeddings, v [B, S, n_kv x head_dim] at positions start..start+S-1:
        k and v go into ``layer``'s cache; returns [B, S, n_q x head_dim].
        """
        torch = self.torch
        batch, _, length, hd = q.shape
        end = start + length
        cos, sin = self.cos[start:end], self.sin[start:end]
        layer.k_cache[:, :, start:end] = self._rope(k, cos, sin)
        layer.v_cache[:, :, start:end] = v.view(batch, length, self.n_kv, hd).transpose(1, 2)
        mask = None
        if length > 1 and start > 0:
            mask = torch.ones(length, end, dtype=torch.bool).tril(diagonal=start)
        attn = torch.nn.functional.scaled_dot_product_attention(
            self._rope(q, cos, sin), layer.k_cache[:, :, :end], layer.v_cache[:, :, :end],
            attn_mask=mask, is_causal=(length > 1 and start == 0),
            enable_gqa=self.n_q != self.n_kv,
        )
        return attn.transpose(1, 2).reshape(batch, length, -1)


# --------------------------------------------------------------------------
# The dense model: configuration and sharding (pure)
# --------------------------------------------------------------------------


class HeadsShape:
    """What a decoder config derives from its hidden size and heads."""

    hidden: int
    heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclasses.dataclass(frozen=True)
class ModelConfig(HeadsShape):
    """Qwen2.5-style decoder dimensions."""

    hidden: int = 1280
    layers: int = 8
    heads: int = 16
    kv_heads: int = 4
    ffn: int = 3584
    vocab: int = 32768
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6

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
        elif problem := kv_groups_problem(self.heads, self.kv_heads, tp):
            problems.append(problem)
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


# --------------------------------------------------------------------------
# The dense model (torch)
# --------------------------------------------------------------------------


class _Layer:
    __slots__ = ("ln1", "w_qkv", "b_qkv", "w_o", "ln2", "w_gate_up", "w_down", "k_cache", "v_cache")


class TPDecoder(SeededDecoder):
    """One rank's shard of the model, with its KV cache.

    ``forward(tokens, start, comm)`` runs [batch, S] token ids at positions
    start..start+S-1 and returns the greedy next token of every sequence,
    identical on every rank.
    """

    def __init__(self, cfg: ModelConfig, layout: ShardLayout, seed: int, batch: int,
                 max_len: int):
        self._start(cfg, seed, max_len, len(layout.q_heads), len(layout.kv_heads))
        self.layout, self.batch = layout, batch
        self.layers = [self._make_layer(i) for i in range(cfg.layers)]
        self.ln_f = self._norm_weight(cfg.hidden, "ln_f")
        self.w_lm = self._blocks(("lm_head",), layout.vocab_units, (VOCAB_UNIT, cfg.hidden),
                                 cfg.hidden**-0.5)

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
        layer.ln1 = self._norm_weight(hidden, i, "ln1")
        layer.ln2 = self._norm_weight(hidden, i, "ln2")
        cache_shape = (self.batch, self.n_kv, self.max_len, hd)
        layer.k_cache = torch.zeros(cache_shape, dtype=torch.bfloat16)
        layer.v_cache = torch.zeros(cache_shape, dtype=torch.bfloat16)
        return layer

    def shard_bytes(self) -> int:
        tensors = [self.w_lm] + [
            t
            for layer in self.layers
            for t in (layer.w_qkv, layer.b_qkv, layer.w_o, layer.w_gate_up, layer.w_down)
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, tokens, start: int, comm):
        hd = self.cfg.head_dim
        batch, length = tokens.shape
        x = self._embed_at(tokens, start)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(i, self._rms(x, layer.ln1))
            q = q.view(batch, length, self.n_q, hd).transpose(1, 2)
            k = k.view(batch, length, self.n_kv, hd).transpose(1, 2)
            x = x + self._attn_out(i, self._attend(layer, q, k, v, start), comm)
            x = x + self._mlp(i, self._rms(x, layer.ln2), comm)
        last = self._rms(x[:, -1], self.ln_f)
        self.last_logits = self._logits(last, comm)  # read after the timed step (bench.decode)
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
        return vocab_in_order(gathered, self.layout.tp, batch)


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
