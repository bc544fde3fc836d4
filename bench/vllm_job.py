"""One rank of a vLLM offline generation at TP=N, for bench/vllm_demo.py and
tests/test_vllm_generation.py (run by harmpi-launch with the vLLM venv's Python):

    HARMPI_VLLM=1 harmpi-launch -np 2 -- python bench/vllm_job.py --model DIR \\
        --comm harmpi --mode compiled --out result.json

Every rank builds the same ``LLM`` with ``distributed_executor_backend=
"external_launcher"`` (vLLM runs its worker in this process; harmpi-launch
exported RANK, WORLD_SIZE, MASTER_ADDR... from MPI), generates greedily
(``--warmup`` untimed runs, then ``--runs`` timed ones) and rank 0 writes
``--out``: the sampled token ids, the seconds of each timed run, the output
token count, which path vLLM's TP all-reduce took, and (``--count``) the
collectives one generation made, by kind and size.

``--comm``: ``harmpi`` needs HARMPI_VLLM=1 in the environment (the plug-in);
``vllm`` is vLLM's own CPU communicator as vLLM picks it (its shared-memory
op where its AVX-512 library has one, else torch.distributed over Gloo);
``gloo`` makes vLLM take its own Gloo path even where the shm op exists, the
way it does when its ranks disagree on the shm group's name.
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


@click.command(help=__doc__.splitlines()[0], context_settings={"help_option_names": []})
@vllm_model.help_option()
@click.option("--model", required=True)
@click.option("--comm", type=click.Choice(["harmpi", "vllm", "gloo"]), required=True)
@click.option("--mode", type=click.Choice(["eager", "compiled"]), required=True)
@click.option("--tp", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--prompts", "n_prompts", type=click.IntRange(min=1), default=4, show_default=True,
              help="sequences per generation")
@click.option("--prompt-len", type=click.IntRange(min=1), default=16, show_default=True,
              help="words per prompt")
@click.option("--max-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="tokens generated per sequence")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--count", is_flag=True, help="count collectives (eager only)")
@click.option("--profile", is_flag=True,
              help="harmpi: one more generation under harmpi.profile(); its collectives' time "
                   "per step beside a microbenchmark of the same calls")
@click.option("--trace", is_flag=True,
              help="one more generation under torch.profiler on every rank: rank 0's operators "
                   "by self CPU time per decode step, and its allocations")
@click.option("--out", required=True)
def _command(**options):
    return types.SimpleNamespace(**options)


def _args(argv):
    return vllm_model.parse(_command, argv)


def _force_gloo():
    """vLLM's own fallback: its CPU communicator uses torch.distributed (the
    Gloo device group) when the group's ranks do not share a shm group name."""
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


def _tp_path() -> str:
    """Which path this rank's TP all-reduce takes."""
    from vllm.distributed.parallel_state import get_tp_group  # noqa: PLC0415

    dc = get_tp_group().device_communicator
    if dc is None:
        return "none (one rank)"
    if getattr(dc, "harmpi", None) is not None:
        return f"harmpi ({type(dc).__name__})"
    return "vllm shm op" if type(dc.dist_module).__name__ == "_CPUSHMDistributed" else "gloo"


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


def _harmpi_share(llm, batch, params, steps) -> dict:
    """harmpi's share of a decode step: one generation under harmpi.profile()
    (its collectives' mean time per step on a rank: waiting for the last
    rank's arrival, then their own work), and the same calls timed back to
    back in this process (the microbenchmark: mean sizes from the profile,
    the vLLM TP group's all-reduce operator and harmpi.allgather)."""
    import torch  # noqa: PLC0415
    from vllm.distributed.parallel_state import get_tp_group  # noqa: PLC0415

    import harmpi  # noqa: PLC0415

    group = get_tp_group().device_communicator.harmpi
    with harmpi.profile(group.comm) as prof:
        llm.generate(batch, params, use_tqdm=False)
    st = prof.stats()
    ranks = st["ranks"]
    out = {"steps": steps, "calls_per_step": st["calls"] / steps,
           "wait_us_per_step": st["wait_s"] / ranks / steps * 1e6,
           "own_us_per_step": st["own_s"] / ranks / steps * 1e6, "micro": []}
    micro_total = 0.0
    for name, c in sorted(st["collectives"].items()):
        if not c["calls"]:
            continue
        nbytes = int(round(c["bytes"] / c["calls"]))
        x = torch.ones(max(1, nbytes // 2), dtype=torch.bfloat16)
        if name == "allreduce":
            us = _micro_us(lambda: group.all_reduce(x))
        else:
            us = _micro_us(lambda: group.all_gather(x, 0))
        per_step = c["calls"] / steps
        micro_total += us * per_step
        out["micro"].append([name, nbytes, per_step, us])
    out["micro_us_per_step"] = micro_total
    return out


#: operators a trace always reports (the TP collectives of each communicator)
_COMM_OPS = ("harmpi::all_reduce", "_C::shm_allreduce", "_C::shm_all_gather", "c10d::allreduce_",
             "c10d::allgather_", "gloo:all_reduce", "gloo:all_gather")


def _trace(llm, batch, params, steps, top=12) -> dict:
    """One generation under torch.profiler (CPU): per decode step, the
    operators with the most self CPU time, the communicators' operators
    whatever their rank, and aten::empty calls (allocations)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(batch, params, use_tqdm=False)
    rows = [(e.key, e.count, e.self_cpu_time_total) for e in prof.key_averages()]
    rows.sort(key=lambda r: -r[2])
    keep = rows[:top] + [r for r in rows[top:] if r[0] in _COMM_OPS or r[0] == "aten::empty"]
    return {"steps": steps,
            "ops": [[name, count / steps, self_us / steps] for name, count, self_us in keep]}


def main(argv=None):
    a = _args(argv)
    if a.comm == "gloo":
        _force_gloo()
    from vllm import LLM, SamplingParams  # noqa: PLC0415

    llm = LLM(model=a.model, tokenizer=a.model, tensor_parallel_size=a.tp, dtype="bfloat16",
              distributed_executor_backend="external_launcher", enforce_eager=a.mode == "eager",
              seed=0, max_model_len=256, max_num_seqs=max(a.n_prompts, 1),
              kv_cache_memory_bytes=256 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    batch = prompts(a.n_prompts, a.prompt_len)
    for _ in range(a.warmup):
        llm.generate(batch, params, use_tqdm=False)
    counts = _count_collectives(llm, batch, params) if a.count else Counter()
    seconds, outs = [], None
    for _ in range(a.runs):
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
    share = _harmpi_share(llm, batch, params, a.max_tokens) \
        if a.profile and a.comm == "harmpi" else None
    trace = _trace(llm, batch, params, a.max_tokens) if a.trace else None
    if int(os.environ.get("RANK", "0")) == 0:
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        with open(a.out, "w") as f:
            json.dump({"comm": a.comm, "mode": a.mode, "path": _tp_path(), "tokens": tokens,
                       "output_tokens": sum(map(len, tokens)), "seconds": seconds,
                       "counts": [[k, n, c] for (k, n), c in sorted(counts.items())],
                       "prompts": a.n_prompts, "max_tokens": a.max_tokens, "share": share,
                       "trace": trace}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
