"""Tensor-parallel decode benchmark: a Qwen2.5-shaped decoder, one run per backend.

    mpirun -np 4 python -m mpi4py -m bench.decode --comm harmpi,gloo,mpi
    HARMPI_RANKS_PER_NODE=2 mpirun --oversubscribe -np 4 python -m mpi4py -m bench.decode
    mpirun -np 2 python -m mpi4py -m bench.decode --comm harmpi,torch:harmpi,gloo,mpi
    mpirun -np 2 python -m mpi4py -m bench.decode --tp-api --comm torch:harmpi,gloo

The model (``bench.model``) is Qwen2.5's decoder layer with random bf16
weights: RMSNorm, rotary attention with grouped KV heads (q/k/v bias, no o
bias) and a KV cache, SwiGLU MLP.  It is sharded Megatron-style over the ranks:

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
from bench.decode_results import (
    collective_latency_ns,
    divergence_note,
    first_divergence,
    format_decode_table,
    logits_gap_ulps,
    round_steps,
    summarize_backend,
    top2_margin_ulps,
)
from bench.harness import DTYPES
from bench.impls import close_impls, harmpi_info_of, make_impls, parse_impls, torch_backend
from bench.load import host_load
from bench.model import DTensorDecoder, ModelConfig, TPDecoder, shard_layout
from bench.threads import Threads, set_threads

__all__ = [
    "COMM_KINDS",
    "run",
    "main",
]

#: --comm names: harmpi's API, torch.distributed on a harmpi or a gloo process group
#: (gloo is short for torch:gloo), mpi4py
COMM_KINDS = ("harmpi", "torch:harmpi", "gloo", "torch:gloo", "mpi")


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
    cpu_ns: np.ndarray  # [steps]: CPU time of this process (all its threads) per step


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
        cpu_ns = np.zeros(steps, dtype=np.int64)
        for i in range(warmup_steps + steps):
            timed = i - warmup_steps
            comm.begin_step(timed)  # negative: not recorded
            # the CPU a rank got per step (its waits' spinning included) shows
            # who won the core on a shared host, beside the wall time
            c0 = time.process_time_ns()
            t0 = time.perf_counter_ns()
            token = model.forward(token.view(-1, 1), position, comm)
            elapsed = time.perf_counter_ns() - t0
            cpu = time.process_time_ns() - c0
            position += 1
            generated.append(token)
            margins.append(top2_margin_ulps(model.last_logits.float().numpy()))
            if timed >= 0:
                step_ns[timed] = elapsed
                comm_ns[timed] = comm.ns
                cpu_ns[timed] = cpu
    tokens = torch.stack(generated, dim=1).numpy()
    return _Round(tokens, step_ns, comm_ns, comm.enter_ns, comm.exit_ns, prefill_ns,
                  np.array(margins), prefill_logits, cpu_ns)

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


def _threads_line(threads: Threads, interop_threads: int) -> str:
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
    step_ns, comm_ns, enter_ns, exit_ns, cpu_ns = (
        comm.gather(measured.concatenated(field), root=0)
        for field in ("step_ns", "comm_ns", "enter_ns", "exit_ns", "cpu_ns")
    )
    prefill_ns = comm.gather(np.median([r.prefill_ns for r in measured.rounds]), root=0)
    if comm.Get_rank() != 0:
        return None
    latency_ns = None
    if same_host:
        latency_ns = collective_latency_ns(np.stack(enter_ns), np.stack(exit_ns))
    row = {"comm": name}
    row.update(summarize_backend(np.stack(step_ns), np.stack(comm_ns), plan.batch, latency_ns,
                                 [len(r.step_ns) for r in measured.rounds],
                                 cpu_ns=np.stack(cpu_ns)))
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
    from harmpi.runtime.registry import STATE

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
    cpu = [f"{row['comm']} {row['cpu_ms_per_token']:.1f} ms ({row['cpu_share'] * 100:.0f}%)"
           for row in rows if row.get("cpu_ms_per_token") is not None]
    if cpu:
        lines.append("# CPU per rank and step (the process, all its threads; % of the mean step): "
                     + "; ".join(cpu))
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
    threads_used = set_threads(comm, threads)
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


def _run_backends(plan: _Plan, models: dict, prompt, impls, comm, *, threads: Threads,
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
