"""One rank of a vLLM offline generation at TP=N, for bench/vllm_demo.py and
tests/test_vllm_generation.py (run by harmpi-launch with the vLLM venv's Python):

    HARMPI_VLLM=1 harmpi-launch -np 2 -- python bench/vllm_job.py --model DIR \\
        --comm harmpi,vllm,gloo --mode compiled --out result.json

Every rank builds the same ``LLM`` with ``distributed_executor_backend=
"external_launcher"`` (vLLM runs its worker in this process; harmpi-launch
exported RANK, WORLD_SIZE, MASTER_ADDR... from MPI) and generates greedily.

``--comm`` names the arms, the TP all-reduce/all_gather paths one engine
takes in turn: ``harmpi`` (needs HARMPI_VLLM=1, the plug-in); ``vllm``,
vLLM's own CPU communicator as vLLM set it up (its shared-memory op where
its AVX-512 library has one and the ranks share a node, else
torch.distributed over Gloo); ``gloo``, torch.distributed over Gloo even
where the shm op exists (vLLM's path between machines). In eager mode the
arms switch between generations, in the communicator vLLM calls for every
collective, so every arm runs in the same engine, the same memory and the
same bound cores: ``--warmup`` untimed generations per arm, then ``--runs``
rounds of one timed generation per arm, the order reversed every other
round (ABC CBA ...), so a machine that drifts during the job drifts for
every arm alike. (Separate jobs moved ~8% from job to job on a quiet
2-vCPU VM, more than the gap measured.) A ``gloo`` arm beside a ``vllm``
arm that is Gloo already is dropped.

A compiled job builds one engine per arm, in the same process, one after
the other: vLLM compiles while it builds an engine, and dynamo traces
through the communicator's Python into the operator of the arm in use
then (harmpi's, vLLM's shm op, or torch.distributed's over Gloo), which
that engine's graph keeps whatever arm is switched to later (vLLM's
compiled model keeps no guards that would retrace). The first engine
takes the communicator as vLLM made it; before each further build the
arm is switched (vLLM reuses its TP group, so every engine shares one
communicator). Each engine's graph is checked by one profiled generation
to call its own arm's all-reduce operator and no other's (a compile
cache that handed one engine another's graph would fail the job). The
timed rounds then alternate engines as eager mode alternates arms, so the
compiled arms too run side by side in one process: separate jobs drifted
~8-20% from job to job on a 2-vCPU VM (tokens/s of identical jobs), the
arms of one job ~1-4% from round to round.

Rank 0 writes ``--out``: per arm the sampled token ids (and whether every
run sampled the same), the seconds of each timed run and which path it
took; the collectives one generation made by kind and size (``--count``);
with ``--profile``, harmpi's share of a decode step and a microbenchmark
of the same calls through every arm; with ``--trace``, each arm's busiest
operators per decode step; and torch.compile's graph-break count.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types
from collections import Counter

import click
import vllm_model  # this directory (sys.path[0]), not the checkout's root
from vllm_model import prompts

#: the TP all-reduce paths one engine can take (see the docstring)
ARMS = ("harmpi", "vllm", "gloo")


@click.command(help=__doc__.splitlines()[0], context_settings={"help_option_names": []})
@vllm_model.help_option()
@click.option("--model", required=True)
@click.option("--comm", required=True, callback=vllm_model.comma_list(ARMS, "arm"),
              help="comma list of the arms: harmpi, vllm, gloo")
@click.option("--mode", type=click.Choice(["eager", "compiled"]), required=True)
@click.option("--tp", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--prompts", "n_prompts", type=click.IntRange(min=1), default=4, show_default=True,
              help="sequences per generation")
@click.option("--prompt-len", type=click.IntRange(min=1), default=16, show_default=True,
              help="words per prompt")
@click.option("--max-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="tokens generated per sequence")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True,
              help="rounds of one timed generation per arm")
@click.option("--count", is_flag=True, help="count collectives (eager only)")
@click.option("--profile", is_flag=True,
              help="one more generation on the harmpi arm under harmpi.profile(); its "
                   "collectives' time per step beside a microbenchmark of the same calls "
                   "through every arm")
@click.option("--trace", is_flag=True,
              help="one more generation per arm under torch.profiler on every rank: rank 0's "
                   "operators by self CPU time per decode step, and its allocations")
@click.option("--out", required=True)
def _command(**options):
    return types.SimpleNamespace(**options)


def _args(argv):
    return vllm_model.parse(_command, argv)


class Arms:
    """This rank's TP communicator, switched between the arms between
    generations: vLLM's CPU communicator calls harmpi where its ``harmpi``
    group is set (the plug-in's HarmpiCpuCommunicator), else its
    ``dist_module``: the shm op's wrapper as vLLM made it, or torch.distributed
    (Gloo)."""

    def __init__(self):
        import torch.distributed as dist  # noqa: PLC0415
        from vllm.distributed.parallel_state import get_tp_group  # noqa: PLC0415

        self.dc = get_tp_group().device_communicator
        self.group = getattr(self.dc, "harmpi", None)
        self.own = getattr(self.dc, "dist_module", None)
        self.gloo = dist

    def kind(self, arm: str) -> str | None:
        """Which all-reduce ``arm`` runs on this rank (a key of _GRAPH_OP, or
        "none" with one rank), or None where it cannot run."""
        if self.dc is None:
            return "none"
        if arm == "harmpi":
            return "harmpi" if self.group is not None else None
        module = self.gloo if arm == "gloo" else self.own
        return "vllm shm op" if type(module).__name__ == "_CPUSHMDistributed" else "gloo"

    def path(self, arm: str) -> str | None:
        """What ``arm`` runs on this rank in words, or None where it cannot run."""
        kind = self.kind(arm)
        if kind == "none":
            return "none (one rank)"
        if kind == "harmpi":
            return f"harmpi ({type(self.dc).__name__})"
        return kind

    def built_path(self) -> str:
        """The path of the communicator as vLLM made it: the one its
        compiled graph calls, whichever arm is in use."""
        return self.path("harmpi" if self.group is not None else "vllm")

    def use(self, arm: str) -> None:
        if self.dc is None:
            return
        if self.group is not None:
            self.dc.harmpi = self.group if arm == "harmpi" else None
        self.dc.dist_module = self.gloo if arm == "gloo" else self.own

    def choose(self, wanted) -> list[str]:
        """The arms of ``wanted`` that run here; a harmpi arm without the
        plug-in is an error (the result would silently be vLLM's)."""
        if "harmpi" in wanted and self.path("harmpi") is None:
            sys.exit("vllm_job.py: --comm harmpi needs HARMPI_VLLM=1 (the plug-in) and a TP "
                     "group that harmpi carries")
        arms = []
        for arm in dict.fromkeys(wanted):
            if arm == "gloo" and "vllm" in wanted and self.path("vllm") == "gloo":
                continue  # vLLM's own choice is Gloo already
            arms.append(arm)
        return arms


#: the all-reduce operator each path puts in a compiled graph
_GRAPH_OP = {"harmpi": "harmpi::all_reduce_inplace", "vllm shm op": "_C::shm_allreduce",
             "gloo": "c10d::allreduce_"}


def _engines(make, mode: str, wanted, batch, params):
    """(arms, names, {arm: engine}): eager, one engine that every arm
    uses; compiled, one engine per arm (see the docstring), each checked
    to call its arm's all-reduce operator and no other."""
    first = make()
    arms = Arms()
    names = arms.choose(wanted)
    if mode == "eager":
        return arms, names, {arm: first for arm in names}
    engines = {}
    built = arms.built_path()
    as_made = next((arm for arm in names if arms.path(arm) == built), None)
    if as_made is not None:
        engines[as_made] = first
    for arm in names:
        if arm in engines:
            continue
        arms.use(arm)
        engines[arm] = make()
        if Arms().dc is not arms.dc:
            sys.exit("vllm_job.py: a second engine made a TP communicator of its own; the "
                     "arms cannot share one process here")
    for arm in names:
        if arms.kind(arm) == "none":
            continue   # one rank: no all-reduce in the graph
        arms.use(arm)
        ops = _collective_ops(engines[arm], batch, params)
        want = _GRAPH_OP[arms.kind(arm)]
        others = [op for op in _GRAPH_OP.values() if op != want and ops.get(op)]
        if not ops.get(want) or others:
            sys.exit(f"vllm_job.py: the {arm} engine's graph calls {ops}, not {want} alone")
    return arms, names, engines


def _collective_ops(llm, batch, params) -> dict:
    """Calls of each communicator operator in one generation (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(batch, params, use_tqdm=False)
    return {e.key: e.count for e in prof.key_averages() if e.key in _COMM_OPS}


def _force_gloo():
    """vLLM's own fallback, chosen before the engine exists: its CPU
    communicator uses torch.distributed (the Gloo device group) when the
    group's ranks do not share a shm group name. A compiled job's "gloo" arm
    needs it: vLLM compiles its graph while it builds the engine, through the
    communicator as it was made, before any arm could be switched."""
    from vllm.distributed.device_communicators import cpu_communicator as cc  # noqa: PLC0415

    cc.CpuCommunicator._all_group_ranks_share_shm_group_name = lambda self: False


def _count_collectives(llm, batch, params) -> Counter:
    """The TP all_reduce and all_gather calls of one generation, by (kind, bytes)
    (eager: a compiled graph does not call back into Python)."""
    from vllm.distributed.parallel_state import GroupCoordinator  # noqa: PLC0415

    counts = Counter()
    saved = GroupCoordinator.all_reduce, GroupCoordinator.all_gather

    def wrap(kind, fn):
        def counted(self, input_, *args, **kwargs):
            if self.unique_name.startswith("tp"):
                counts[(kind, input_.numel() * input_.element_size())] += 1
            return fn(self, input_, *args, **kwargs)
        return counted

    GroupCoordinator.all_reduce = wrap("all_reduce", saved[0])
    GroupCoordinator.all_gather = wrap("all_gather", saved[1])
    try:
        llm.generate(batch, params, use_tqdm=False)
    finally:
        GroupCoordinator.all_reduce, GroupCoordinator.all_gather = saved
    return counts


def _micro_us(fn, iters=400) -> float:
    """Median µs of ``fn()`` (a collective; every rank runs the same loop)."""
    import statistics  # noqa: PLC0415

    for _ in range(50):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _harmpi_share(llm, batch, params, steps, arms: Arms, names) -> dict:
    """harmpi's share of a decode step: one generation on the harmpi arm under
    harmpi.profile() (its collectives' mean time per step on a rank: waiting
    for the last rank's arrival, then their own work), and the same calls
    timed back to back through vLLM's communicator on every arm of ``names``
    (the microbenchmark: mean sizes from the profile; zeros, since vLLM's own
    arms reduce in place)."""
    import torch  # noqa: PLC0415

    import harmpi  # noqa: PLC0415

    arms.use("harmpi")
    with harmpi.profile(arms.group.comm) as prof:
        llm.generate(batch, params, use_tqdm=False)
    st = prof.stats()
    ranks = st["ranks"]
    out = {"steps": steps, "calls_per_step": st["calls"] / steps,
           "wait_us_per_step": st["wait_s"] / ranks / steps * 1e6,
           "own_us_per_step": st["own_s"] / ranks / steps * 1e6,
           "own_by_size": prof.own_by_size(), "micro": [],
           "micro_us_per_step": {}}
    for name, c in sorted(st["collectives"].items()):
        if not c["calls"]:
            continue
        nbytes = int(round(c["bytes"] / c["calls"]))
        x = torch.zeros(max(1, nbytes // 2), dtype=torch.bfloat16)
        per_step = c["calls"] / steps
        us = {}
        for arm in names:
            arms.use(arm)
            call = (lambda: arms.dc.all_reduce(x)) if name == "allreduce" else \
                (lambda: arms.dc.all_gather(x, 0))
            us[arm] = _micro_us(call)
            out["micro_us_per_step"][arm] = out["micro_us_per_step"].get(arm, 0.0) + \
                us[arm] * per_step
        out["micro"].append([name, nbytes, per_step, us])
    return out


#: operators a trace always reports (the TP collectives of each communicator)
_COMM_OPS = ("harmpi::all_reduce_inplace", "harmpi::all_reduce", "_C::shm_allreduce",
             "_C::shm_all_gather", "c10d::allreduce_", "c10d::allgather_",
             "c10d::_allgather_base_", "gloo:all_reduce", "gloo:all_gather")
#: allocations: how many tensors a step makes, per arm
_ALLOC_OPS = ("aten::empty", "aten::empty_like", "aten::empty_strided")


def _trace(llm, batch, params, steps, top=12) -> dict:
    """One generation under torch.profiler (CPU): per decode step, the
    operators with the most self CPU time, the communicators' operators
    whatever their rank, and the allocating ones."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(batch, params, use_tqdm=False)
    rows = [(e.key, e.count, e.self_cpu_time_total) for e in prof.key_averages()]
    rows.sort(key=lambda r: -r[2])
    keep = rows[:top] + [r for r in rows[top:] if r[0] in _COMM_OPS + _ALLOC_OPS]
    return {"steps": steps,
            "ops": [[name, count / steps, self_us / steps] for name, count, self_us in keep],
            "allocs_per_step": sum(count for name, count, _ in rows if name in _ALLOC_OPS)
            / steps}


def _graph_breaks() -> dict:
    """torch.compile's counters in this process (vLLM compiles the model
    here): graph breaks by reason, and the graphs dynamo made."""
    from torch._dynamo.utils import counters  # noqa: PLC0415

    return {"graph_breaks": sum(counters["graph_break"].values()),
            "reasons": sorted(counters["graph_break"])[:5],
            "unique_graphs": counters["stats"].get("unique_graphs", 0)}


def _generate(llm, batch, params):
    """(seconds, token ids per sequence) of one generation."""
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


def _rounds(engines, batch, params, arms: Arms, names, rounds: int) -> dict:
    """Per arm: its path, and the seconds and tokens of one timed generation
    per round on the arm's engine (the order of the arms reversed every
    other round)."""
    runs = {arm: {"comm": arm, "path": arms.path(arm), "seconds": [], "runs_tokens": []}
            for arm in names}
    for r in range(rounds):
        for arm in names if r % 2 == 0 else names[::-1]:
            arms.use(arm)
            seconds, tokens = _generate(engines[arm], batch, params)
            runs[arm]["seconds"].append(seconds)
            runs[arm]["runs_tokens"].append(tokens)
    return runs


def main(argv=None):
    a = _args(argv)
    if not a.comm:
        sys.exit("vllm_job.py: --comm names no arm")
    if a.mode == "compiled" and a.comm == ["gloo"]:
        _force_gloo()  # (no engine of vLLM's own choice to build first)
    from vllm import LLM, SamplingParams  # noqa: PLC0415

    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    batch = prompts(a.n_prompts, a.prompt_len)
    arms, names, engines = _engines(
        lambda: LLM(model=a.model, tokenizer=a.model, tensor_parallel_size=a.tp,
                    dtype="bfloat16", distributed_executor_backend="external_launcher",
                    enforce_eager=a.mode == "eager", seed=0, max_model_len=256,
                    max_num_seqs=max(a.n_prompts, 1), kv_cache_memory_bytes=256 << 20),
        a.mode, a.comm, batch, params)
    for arm in names:
        arms.use(arm)
        for _ in range(a.warmup):
            engines[arm].generate(batch, params, use_tqdm=False)
    arms.use(names[0])
    counts = _count_collectives(engines[names[0]], batch, params) if a.count else Counter()
    runs = _rounds(engines, batch, params, arms, names, a.runs)
    # the microbenchmark goes through every arm this engine has (a call
    # from Python, not from a graph, takes the arm in use in either mode)
    share = _harmpi_share(engines["harmpi"], batch, params, a.max_tokens, arms,
                          arms.choose(ARMS)) if a.profile and "harmpi" in names else None
    for arm in names:
        arms.use(arm)
        runs[arm]["trace"] = _trace(engines[arm], batch, params, a.max_tokens) \
            if a.trace else None
    if int(os.environ.get("RANK", "0")) == 0:
        for r in runs.values():
            every = r.pop("runs_tokens")
            r.update(tokens=every[-1], stable=all(t == every[-1] for t in every),
                     output_tokens=sum(map(len, every[-1])))
        with open(a.out, "w") as f:
            json.dump({"mode": a.mode, "arms": list(runs.values()), "share": share,
                       "counts": [[k, n, c] for (k, n), c in sorted(counts.items())],
                       "prompts": a.n_prompts, "max_tokens": a.max_tokens,
                       "compile": _graph_breaks()}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
