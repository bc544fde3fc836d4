"""MoE decode benchmark: expert parallelism against tensor parallelism on CPUs.

    mpirun -np 2 python -m mpi4py -m bench.moe_decode
    HARMPI_RANKS_PER_NODE=1 mpirun -np 2 -x HARMPI_RANKS_PER_NODE \\
        python -m mpi4py -m bench.moe_decode
    mpirun -np 2 python -m mpi4py -m bench.moe_decode --comm ep:harmpi,tp:harmpi --experts 16

The model (``bench.moe_model``) is a Qwen3-MoE-shaped decoder at small
scale with random bf16 weights: per layer RMSNorm, rotary attention with grouped KV heads and
per-head q/k RMSNorm (no biases) and a KV cache, then a mixture-of-experts
block: a router (hidden -> E logits, softmax, top-k, the k weights
renormalised to sum 1) and E SwiGLU experts (gate/up/down); a token's
output is the weighted sum of its k experts' outputs. No shared expert.
Weights are generated per unit from a seed that names it (one attention
head, 64 rows/columns of one expert's FFN, 256 vocabulary rows), so each
rank generates only what it holds, the model does not depend on the number
of ranks, and every backend routes the same tokens to the same experts.

The same model runs in two parallel layouts (``--comm``):

* ``ep:<comm>``, expert parallelism with data-parallel attention (the usual
  EP decode design): rank r owns experts r*E/n .. (r+1)*E/n - 1 whole, and
  batch/n of the sequences, for which it runs attention with all heads (the
  attention weights and the LM head are replicated) and keeps the KV cache.
  Per MoE block the rank routes its tokens, sends each (token, expert) pair's
  hidden state to the expert's owner (all-to-all #1, uneven: the counts
  change every step; the expert id rides in an extra column of the row),
  runs its experts on what arrived, sends the outputs back (all-to-all #2,
  the counts known from #1) and takes the weighted sum.  The greedy token of
  each sequence comes from its own rank's full LM head: no collective.
  Comms: ``harmpi`` (``harmpi.alltoall``: the counts travel with the rows),
  ``mpi`` (``MPI_Alltoall`` of the counts, then ``MPI_Alltoallv``, as an
  mpi4py user writes it), ``gloo`` and ``torch:harmpi``
  (``dist.all_to_all_single`` of the counts, then of the rows with split
  sizes, on a process group of that backend).
* ``tp:<comm>``, tensor parallelism: every rank holds heads/n attention
  heads and a 1/n slice of every expert's FFN (gate/up column-parallel, down
  row-parallel) and runs the whole batch; the router is replicated.  One
  all-reduce ends each attention block and one each MoE block (bf16,
  batch x hidden); the LM head is vocab-parallel, its logits gathered (one
  allgather per step).  Comms: any of ``bench.decode``'s (harmpi, mpi, gloo,
  torch:harmpi).

Reported per comm: tok/s (batch / median step), the median step, the mean
step split into compute + collectives (time inside the collectives,
waiting for peers included) and the collectives' share.  Every EP comm
must generate the same tokens bitwise (the all-to-alls move bytes, and the
arithmetic is the same): exit 1 otherwise, or if a TP comm's ranks
disagree.  EP and TP round differently (TP adds bf16 partial sums of each
expert's FFN slices and of the attention heads in its all-reduces, EP adds
nothing across ranks), so EP-vs-TP agreement is reported, not required:
the first position where the tokens part, and how close the reference's
top two logits were there.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import NamedTuple, Sequence

import click
import numpy as np

from bench import job, report
from bench.decode_common import (
    Rounds,
    RunPlan,
    TimedComm,
    progress,
    run_options,
    shape_options,
)
from bench.decode_results import (
    collective_latency_ns,
    first_divergence,
    logits_gap_ulps,
    top2_margin_ulps,
)
from bench.harness import DTYPES
from bench.impls import close_impls, harmpi_info_of, make_impls, parse_impls
from bench.load import host_load
from bench.moe_model import EXTRA_COLUMNS, MoEConfig, MoEDecoder, ep_shard, tp_shard
from bench.threads import set_threads

__all__ = [
    "decode_round",
    "row_margins_ulps",
    "summarize",
    "parse_comms",
    "format_table",
    "EP_COMMS",
    "TP_COMMS",
    "main",
]

#: the EP comms (all-to-all) and the TP comms (bench.impls adapters: all-reduce, allgather)
EP_COMMS = ("harmpi", "mpi", "gloo", "torch:harmpi")
TP_COMMS = ("harmpi", "mpi", "gloo", "torch:harmpi")
DEFAULT_COMMS = "ep:harmpi,ep:mpi,ep:gloo,ep:torch:harmpi,tp:harmpi"



# --------------------------------------------------------------------------
# Communication, timed
# --------------------------------------------------------------------------


# --------------------------------------------------------------------------
# Comm names
# --------------------------------------------------------------------------


def parse_comms(spec: str) -> list[str]:
    """'ep:harmpi,tp:harmpi' -> the names, known and distinct (ValueError otherwise)."""
    names = [part.strip() for part in spec.split(",") if part.strip()]
    known = [f"ep:{c}" for c in EP_COMMS] + [f"tp:{c}" for c in TP_COMMS]
    bad = [name for name in names if name not in known]
    if not names or bad or len(set(names)) != len(names):
        raise ValueError(f"--comm takes a comma list of distinct {', '.join(known)}; "
                         f"got {spec!r}")
    return names


def base_comms(names: Sequence[str]) -> list[str]:
    """The bench.impls adapters the comms need, in first-use order ('ep:gloo' -> 'gloo')."""
    bases = []
    for name in names:
        base = name.split(":", 1)[1]
        if base not in bases:
            bases.append(base)
    parse_impls(",".join(bases))
    return bases


def _describe(name: str, adapter) -> str:
    if name.startswith("ep:"):
        return name + ": " + adapter.describe_alltoall(uneven=True).split(": ", 1)[1]
    return name + ": " + adapter.describe_tensors(DTYPES["bf16"]).split(": ", 1)[1]


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------


#: what one run does (the same on every rank): bench.decode_common's plan
Plan = RunPlan


class Round(NamedTuple):
    """One comm's decode from the prompt, on one rank."""

    tokens: np.ndarray  # [this rank's sequences, 1 + warmup + steps]
    step_ns: np.ndarray  # [steps]
    comm_ns: np.ndarray  # [steps]
    calls_per_step: int
    enter_ns: np.ndarray  # [steps, calls per step]: each collective's entry, perf_counter_ns
    exit_ns: np.ndarray  # [steps, calls per step]
    expert_rows: np.ndarray  # [steps, layers]: EP, rows each dispatch brought this rank
    margin_ulps: np.ndarray  # [its sequences, 1 + warmup + steps]: top-two logit gaps
    prefill_logits: np.ndarray  # [this rank's sequences, vocab] float32


def decode_round(model: MoEDecoder, comm, prompt, warmup_steps: int, steps: int,
                 barrier) -> Round:
    """Prefill + warm-up + timed steps of this rank's sequences."""
    torch = model.torch
    cfg = model.cfg
    timed = TimedComm(comm, steps, 2 * cfg.layers + (model.shard.mode == "tp"))
    prompt = prompt[list(model.shard.sequences)]
    barrier()
    with torch.inference_mode():
        token = model.forward(prompt, 0, timed)
        prefill_logits = model.last_logits.float().numpy().copy()
        generated, margins = [token], [row_margins_ulps(prefill_logits)]
        step_ns = np.zeros(steps, dtype=np.int64)
        comm_ns = np.zeros(steps, dtype=np.int64)
        position = prompt.shape[1]
        for i in range(warmup_steps + steps):
            timed.begin_step(i - warmup_steps)  # negative: not recorded
            t0 = time.perf_counter_ns()
            token = model.forward(token.view(-1, 1), position, timed)
            elapsed = time.perf_counter_ns() - t0
            position += 1
            generated.append(token)
            margins.append(row_margins_ulps(model.last_logits.float().numpy()))
            if i >= warmup_steps:
                step_ns[i - warmup_steps], comm_ns[i - warmup_steps] = elapsed, timed.ns
    return Round(torch.stack(generated, dim=1).numpy(), step_ns, comm_ns, timed.calls,
                 timed.enter_ns, timed.exit_ns, timed.expert_rows, np.stack(margins, axis=1),
                 prefill_logits)


#: one comm's rounds on this rank
Measured = Rounds


def row_margins_ulps(logits: np.ndarray) -> np.ndarray:
    """[b, vocab] logits -> each row's gap between its top two logits, in bf16 ulps of
    its top logit (ulp = 2^(exponent - 7)); near 0, bf16 sums in another order may
    flip the greedy token."""
    return np.array([top2_margin_ulps(row[None]) for row in np.asarray(logits)])


def summarize(step_ns: np.ndarray, comm_ns: np.ndarray, batch: int,
              per_round: Sequence[int]) -> dict:
    """Every rank's step and collective times [ranks, steps] -> the reported numbers:
    tok/s = batch / median of the rank-averaged step; the mean step split into
    compute + collectives (so they add up) and the collectives' share of it; the
    rounds' lowest and highest tok/s."""
    step_ns, comm_ns = np.asarray(step_ns, dtype=float), np.asarray(comm_ns, dtype=float)
    mean_step = step_ns.mean(axis=0)
    median_ms = float(np.median(mean_step)) / 1e6
    bounds = np.cumsum([0, *per_round])
    rounds = [batch * 1e9 / float(np.median(mean_step[a:b])) for a, b in zip(bounds, bounds[1:])]
    mean_ms, comm_ms = step_ns.mean() / 1e6, comm_ns.mean() / 1e6
    return {"tokens_per_s": batch * 1e3 / median_ms, "ms_per_step": median_ms,
            "tokens_per_s_min": min(rounds), "tokens_per_s_max": max(rounds),
            "mean_ms_per_step": float(mean_ms), "compute_ms_per_step": float(mean_ms - comm_ms),
            "comm_ms_per_step": float(comm_ms), "comm_share": float(comm_ms / mean_ms)}


def _gather_tokens(measured: Measured, mode: str, comm):
    """The whole batch's tokens, top-two margins and prefill logits (EP: every
    rank's sequences, in rank order), and whether every TP rank generated the
    same tokens (collective)."""
    longest = measured.longest()
    parts = comm.allgather((longest.tokens, longest.margin_ulps, longest.prefill_logits))
    if mode == "ep":
        return (*(np.concatenate([p[i] for p in parts]) for i in range(3)), True)
    identical = all(np.array_equal(p[0], parts[0][0]) for p in parts)
    return parts[0][0], parts[0][1], parts[0][2], identical


def _row(name: str, measured: Measured, plan: Plan, comm, same_host: bool) -> dict:
    """One comm's result row (collective; every rank gets it)."""
    from mpi4py import MPI

    step_ns, comm_ns, enter_ns, exit_ns = (
        np.stack(comm.allgather(measured.concatenated(field)))
        for field in ("step_ns", "comm_ns", "enter_ns", "exit_ns"))
    mode = name.split(":", 1)[0]
    tokens, margins, logits, identical = _gather_tokens(measured, mode, comm)
    repeat = all(np.array_equal(r.tokens, measured.longest().tokens[:, :r.tokens.shape[1]])
                 for r in measured.rounds)
    row = {"comm": name, "mode": mode,
           "calls_per_step": comm.allreduce(measured.rounds[0].calls_per_step, op=MPI.MAX),
           **summarize(step_ns, comm_ns, plan.batch, [len(r.step_ns) for r in measured.rounds]),
           "own_ms_per_step": None,
           "tokens_identical_across_ranks": identical, "tokens_repeat_across_rounds": repeat}
    if mode == "ep":  # the experts' work per MoE block: every rank's mean, the busiest's
        rows_each = np.stack(comm.allgather(measured.concatenated("expert_rows")))
        row["expert_rows_mean"] = float(rows_each.mean())
        row["expert_rows_busiest"] = float(rows_each.max(axis=0).mean())
    if same_host:  # one clock: the part of each call after the last rank entered it
        row["own_ms_per_step"] = float(collective_latency_ns(enter_ns, exit_ns).mean() / 1e6)
    return row | {"_tokens": tokens, "_margins": margins, "_logits": logits}


def mark_agreement(rows: list[dict]) -> bool:
    """Compare each row's tokens with the first EP row's (else the first row's);
    True when every EP row agrees with it bitwise and every TP row's ranks agree."""
    reference = next((r for r in rows if r["mode"] == "ep"), rows[0])
    ok = True
    for row in rows:
        position = first_divergence(reference["_tokens"], row["_tokens"])
        row["agrees_with"] = reference["comm"]
        row["first_divergence"] = position
        row["tokens_agree"] = position is None
        row["margin_ulps_there"] = None
        if position is not None:  # the closest call among the sequences that parted there
            parted = reference["_tokens"][:, position] != row["_tokens"][:, position]
            row["margin_ulps_there"] = float(reference["_margins"][parted, position].min())
        row["prefill_logits_gap_ulps"] = logits_gap_ulps(reference["_logits"], row["_logits"])
        if row["mode"] == "ep" and not row["tokens_agree"]:
            ok = False
        ok = ok and row["tokens_identical_across_ranks"]
    return ok


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


def format_table(rows: Sequence[dict]) -> list[str]:
    """The result table, within 100 columns."""
    lines = [f"{'# comm':<17}{'tok/s':>8}{'rounds':>13}{'ms/step':>9}{'compute':>9}"
             f"{'collect.':>9}{'share':>7}{'own':>7}{'calls':>6}{'agree':>7}"]
    for row in rows:
        agree = "yes" if row.get("tokens_agree") else ("NO" if row["mode"] == "ep" else "no")
        spread = f"{row['tokens_per_s_min']:.1f}-{row['tokens_per_s_max']:.1f}"
        own = "-" if row.get("own_ms_per_step") is None else f"{row['own_ms_per_step']:.2f}"
        lines.append(
            f"{row['comm']:<17}{row['tokens_per_s']:>8.1f}{spread:>13}{row['ms_per_step']:>9.2f}"
            f"{row['compute_ms_per_step']:>9.2f}{row['comm_ms_per_step']:>9.2f}"
            f"{row['comm_share'] * 100:>6.1f}%{own:>7}{row['calls_per_step']:>6}{agree:>7}")
    return lines


def _notes(rows: Sequence[dict]) -> list[str]:
    lines = []
    for row in rows:
        if not row["tokens_identical_across_ranks"]:
            lines.append(f"# ERROR: {row['comm']}: ranks generated different tokens")
        if not row["tokens_repeat_across_rounds"]:
            lines.append(f"# note: {row['comm']}: rounds from the same prompt differ")
        if row["mode"] == "ep" and not row["tokens_agree"]:
            lines.append(f"# ERROR: {row['comm']}: EP tokens differ from {row['agrees_with']}'s "
                         f"from generated token {row['first_divergence']}")
    parts = []
    for row in (r for r in rows if r["comm"] != r["agrees_with"]):
        text = "bitwise" if row["tokens_agree"] else (
            f"parted at token {row['first_divergence']} (top-2 margin there "
            f"{row['margin_ulps_there']:.1f} bf16 ulps)")
        parts.append(f"{row['comm']} {text}, prefill logits within "
                     f"{row['prefill_logits_gap_ulps']:.1f} ulps")
    if parts:
        lines.append(f"# tokens vs {rows[0]['agrees_with']}: " + "; ".join(parts))
    ep = next((row for row in rows if row["mode"] == "ep"), None)
    if ep is not None:
        lines.append(f"# EP load: a rank's experts got {ep['expert_rows_mean']:.2f} (token, "
                     f"expert) rows per MoE block on average, the busiest rank "
                     f"{ep['expert_rows_busiest']:.2f} (the step waits for it)")
    by_name = {row["comm"]: row for row in rows}
    for base in ("ep:harmpi", "tp:harmpi"):
        if base in by_name and len(rows) > 1:
            ref = by_name[base]["tokens_per_s"]
            lines.append(f"# tok/s ratio {base} / other: " + "; ".join(
                f"{r['comm']} {ref / r['tokens_per_s']:.2f}x" for r in rows if r["comm"] != base))
    return lines


def _header(plan: Plan, models: dict, descriptions: dict, env_lines, threads: int,
            build_s: float) -> list[str]:
    cfg, n, b = plan.cfg, plan.n_ranks, plan.batch
    row_nbytes = (cfg.hidden + EXTRA_COLUMNS) * 2
    nbytes = {mode: model.weight_nbytes() / 2**20 for mode, model in models.items()}
    return [
        "# harmpi MoE decode benchmark: expert vs tensor parallelism (Qwen3-MoE-shaped, "
        "random bf16 weights)",
        *env_lines,
        f"# Model: hidden {cfg.hidden}, layers {cfg.layers}, heads {cfg.heads} (kv "
        f"{cfg.kv_heads}, head_dim {cfg.head_dim}, q/k norm, rotary), {cfg.experts} experts "
        f"top-{cfg.topk} (SwiGLU, ffn {cfg.expert_ffn}), vocab {cfg.vocab}: "
        f"{cfg.params() / 1e6:.0f} M parameters, {cfg.active_params() / 1e6:.0f} M active "
        f"per token; built in {build_s:.1f} s",
        *(f"# {mode.upper()} weights per rank: {mib:.0f} MiB" for mode, mib in nbytes.items()),
        f"# EP over {n} ranks: {cfg.experts // n} experts and {b // n} of the {b} sequences "
        f"per rank (attention, KV cache and LM head replicated); per step and layer two "
        f"all-to-alls of uneven rows of {row_nbytes} B (hidden + expert id), "
        f"{b * cfg.topk} rows in all",
        f"# TP over {n} ranks: {cfg.heads // n} heads and 1/{n} of every expert's FFN per "
        f"rank; per step {2 * cfg.layers} all-reduces of {b * cfg.hidden * 2} B and one "
        f"logits allgather of {b * cfg.vocab // n * 2} B per rank",
        f"# Decode: batch {b}, prompt {plan.prompt_len}, greedy; {plan.steps} timed steps "
        f"per comm in {len(plan.per_round)} rounds, comms taking turns, each round from "
        f"the prompt after {plan.warmup_steps} warm-up steps; {threads} torch thread(s) "
        "per rank",
        *(f"# {text}" for text in descriptions.values()),
        "# tok/s = batch / median step; rounds: lowest-highest round's tok/s; compute + "
        "collect. = mean step (ms, means over steps and ranks); share = collect. / mean "
        "step, waiting for peers included; own: ms of collect. after the last rank entered "
        "each call (one host, one clock: the collectives' own latency, without waiting for "
        "a slower peer); calls: collectives per step and rank",
    ]


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------


def _build(plan: Plan, names, comm) -> tuple[dict, float]:
    from mpi4py import MPI

    t0 = time.perf_counter()
    makers = {"ep": ep_shard, "tp": tp_shard}
    modes = sorted({name.split(":", 1)[0] for name in names})
    models = {mode: MoEDecoder(plan.cfg, makers[mode](plan.cfg, plan.n_ranks, comm.Get_rank(),
                                                       plan.batch), plan.seed, plan.max_len)
              for mode in modes}
    return models, comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def _run_rounds(plan: Plan, models: dict, comms: dict, comm) -> dict[str, Measured]:
    """Comms take turns, round by round, each round from the prompt."""
    prompt = plan.prompt()
    measured = {name: Measured() for name in comms}
    for index, steps in enumerate(plan.per_round):
        for name, inner in comms.items():
            t0 = time.perf_counter()
            model = models[name.split(":", 1)[0]]
            result = decode_round(model, inner, prompt, plan.warmup_steps, steps, comm.Barrier)
            measured[name].rounds.append(result)
            if comm.Get_rank() == 0:
                tok_s = plan.batch * 1e9 / np.median(result.step_ns)
                progress("moe_decode", f"round {index + 1}/{len(plan.per_round)} {name}: "
                         f"{steps} steps, {tok_s:.1f} tok/s on rank 0, "
                         f"{time.perf_counter() - t0:.1f} s")
    return measured


def run(plan: Plan, names: Sequence[str], *, threads: int | None = None, load: int = 0,
        json_path: str | None = None, comm=None) -> int:
    """Run the benchmark on every rank of ``comm`` (default the world); rank 0
    prints.  Returns the exit code, the same on every rank."""
    from mpi4py import MPI

    from bench.job import environment_lines, topology

    comm = MPI.COMM_WORLD if comm is None else comm
    threads_used = set_threads(comm, threads)
    models, build_s = _build(plan, names, comm)
    bases = base_comms(names)
    adapters = dict(zip(bases, make_impls(bases, comm)))
    try:
        comms = {name: adapters[name.split(":", 1)[1]] for name in names}
        descriptions = {name: _describe(name, comms[name]) for name in names}
        topo = topology(comm)
        env_lines = environment_lines(comm, topo, harmpi_info_of(adapters.values()))
        if comm.Get_rank() == 0:
            lines = _header(plan, models, descriptions, env_lines, threads_used.count, build_s)
            print("\n".join(report.fit_lines(lines)), flush=True)
        with host_load(comm, load) as busy:
            measured = _run_rounds(plan, models, comms, comm)
        rows = [_row(name, measured[name], plan, comm, topo["hosts"] == 1) for name in names]
        ok = mark_agreement(rows)
        if comm.Get_rank() == 0:
            lines = format_table(rows) + _notes(rows) + ([busy.summary()] if load else [])
            print("\n".join(report.fit_lines(lines)), flush=True)
            if json_path:
                _write_json(json_path, plan, rows, topo)
        return 0 if ok else 1
    finally:
        close_impls(list(adapters.values()))


def _write_json(path: str, plan: Plan, rows: Sequence[dict], topo: dict) -> None:
    meta = {"benchmark": "moe_decode", "model": dataclasses.asdict(plan.cfg),
            "ranks": plan.n_ranks, "batch": plan.batch, "steps": plan.steps,
            "topology": {k: v for k, v in topo.items() if isinstance(v, (int, str, list))}}
    out = [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows]
    for row, full in zip(out, rows):
        row["tokens"] = np.asarray(full["_tokens"]).tolist()
    with open(path, "w") as fh:
        json.dump({"meta": meta, "rows": out}, fh, indent=2)
        fh.write("\n")


@click.command(name="moe_decode", help=(
    "Greedy decode of a Qwen3-MoE-shaped model with random bf16 weights, expert-parallel "
    "(all-to-all) and tensor-parallel (all-reduce), one run per comm. Run under MPI: "
    "mpirun -np 2 python -m mpi4py -m bench.moe_decode"))
@job.help_option()
@click.option("--comm", "comm_spec", default=DEFAULT_COMMS, show_default=True,
              help="Comma list of ep:<c> (expert parallel, all-to-all over c) and tp:<c> "
                   f"(tensor parallel, all-reduce over c); c one of {', '.join(EP_COMMS)}.")
@shape_options(MoEConfig)
@click.option("--experts", type=click.IntRange(min=1), default=MoEConfig.experts,
              show_default=True)
@click.option("--topk", type=click.IntRange(min=1), default=MoEConfig.topk, show_default=True)
@click.option("--expert-ffn", type=click.IntRange(min=1), default=MoEConfig.expert_ffn,
              show_default=True)
@click.option("--vocab", type=click.IntRange(min=1), default=MoEConfig.vocab,
              show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=4, show_default=True,
              help="Sequences decoded together (EP: batch / ranks per rank).")
@click.option("--steps", type=click.IntRange(min=1), default=64, show_default=True,
              help="Timed decode steps per comm, split over the rounds.")
@run_options(8, threads_help="torch threads per rank (default: host CPUs / ranks on the host).",
             load_help="N busy processes (unbound spin loops) on each host during the rounds.",
             json_help="Write the rows (and tokens) as JSON (rank 0).")
def main(comm_spec, hidden, layers, heads, kv_heads, experts, topk, expert_ffn, vocab, batch,
         prompt_len, steps, rounds, warmup_steps, threads, seed, load, json_path):
    from mpi4py import MPI

    cfg = MoEConfig(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                    experts=experts, topk=topk, expert_ffn=expert_ffn, vocab=vocab)
    n_ranks = MPI.COMM_WORLD.Get_size()
    try:
        names = parse_comms(comm_spec)
        cfg.check(n_ranks, batch)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    plan = Plan(cfg, n_ranks, batch, prompt_len, steps, warmup_steps, rounds, seed)
    code = job.run_or_abort(run, plan, names, threads=threads, load=load,
                                json_path=json_path)
    job.exit_all(code)


if __name__ == "__main__":
    main()
