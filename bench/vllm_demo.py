"""vLLM's CPU engine at TP=2 with harmpi's plug-in against vLLM's own
communicator: output tokens/s, collectives per step, token identity.

    make vllm-demo                      # = .venv-vllm/bin/python bench/vllm_demo.py
    .venv-vllm/bin/python bench/vllm_demo.py --runs 5 --modes compiled

Run with the vLLM venv's Python (its harmpi-launch starts the ranks). For
each layout (1 node x 2 ranks; 2 virtual nodes x 1 rank, harmpi's tcp rail
between them) and each mode (eager; compiled: vLLM's torch.compile graph)
it starts one job per communicator, each under ``harmpi-launch -np 2``
(a core per rank, bound) with ``distributed_executor_backend=
"external_launcher"``; each job generates greedily ``--warmup`` times
untimed, then ``--runs`` times timed (bench/vllm_job.py). The rivals:

- 1 node: vLLM's own choice ("vllm": its shared-memory all-reduce op where
  its AVX-512 library has one, else Gloo) and, when that was the shm op,
  Gloo too;
- 2 virtual nodes: Gloo (what vLLM uses between machines; its shm op
  would be an unfair same-host shortcut there).

Printed: median output tokens/s with min-max over the runs, harmpi's ratio
against each rival from the same layout and mode, whether the sampled
tokens equal the rival's, and (eager, counted once) the TP collectives of
one generation by kind and size, per forward step.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
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


def run_job(model, layout, mode, comm, out, *, runs, warmup, prompts, max_tokens, count,
            timeout, tp=2, profile=False, trace=False):
    """One vLLM job of ``tp`` ranks; returns bench/vllm_job.py's result (rank 0)."""
    cmd = [launcher(), "-np", str(tp), *LAYOUTS[layout], "--",
           sys.executable, os.path.join(HERE, "vllm_job.py"), "--model", model,
           "--comm", comm, "--mode", mode, "--runs", str(runs), "--warmup", str(warmup),
           "--prompts", str(prompts), "--max-tokens", str(max_tokens), "--out", out,
           "--tp", str(tp)]
    if count:
        cmd.append("--count")
    if profile:
        cmd.append("--profile")
    if trace:
        cmd.append("--trace")
    env = dict(os.environ)
    env.pop("HARMPI_VLLM", None)
    if comm == "harmpi":
        env["HARMPI_VLLM"] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    print(f"  {layout} {mode:8} {comm:6} job started ({time.strftime('%H:%M:%S')})",
          flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    print(f"  {layout} {mode:8} {comm:6} job ended in {time.monotonic() - t0:.0f} s, exit "
          f"{proc.returncode}", flush=True)
    if proc.returncode != 0 or not os.path.exists(out):
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise RuntimeError(f"job failed ({' '.join(cmd)}), exit {proc.returncode}:\n{tail}")
    with open(out) as f:
        return json.load(f)


def tokens_per_s(result) -> list[float]:
    return [result["output_tokens"] / s for s in result["seconds"]]


def _fmt(rates):
    return f"{statistics.median(rates):7.1f}  ({min(rates):.1f}-{max(rates):.1f})"


def measure(a):
    """Run every job; return (rows, results, counts). A row: (layout, mode,
    communicator, its result, harmpi's result in the same layout and mode),
    or (layout, mode, "note", None, None) where vLLM has no shm op."""
    rows, results, counts = [], [], None
    with tempfile.TemporaryDirectory() as tmp:
        for layout in a.layouts:
            for mode in a.modes:
                comms = ["vllm", "harmpi"] if layout == "1x2" else ["gloo", "harmpi"]
                done = {}
                for comm in comms:             # grows by "gloo" where the shm op exists
                    want_count = counts is None and mode == "eager" and comm == "harmpi"
                    r = run_job(a.model, layout, mode, comm, os.path.join(tmp, "r.json"),
                                runs=a.runs, warmup=a.warmup, prompts=a.prompts,
                                max_tokens=a.max_tokens, count=want_count, timeout=a.timeout,
                                profile=comm == "harmpi", trace=a.trace)
                    r["layout"] = layout
                    results.append(r)
                    done[comm] = r
                    if want_count:
                        counts = r["counts"]
                    if comm == "vllm" and r["path"] == "vllm shm op":
                        comms.append("gloo")
                rows += [(layout, mode, comm, r, done["harmpi"]) for comm, r in done.items()]
                if layout == "1x2" and all(r["path"] != "vllm shm op" for r in done.values()):
                    rows.append((layout, mode, "note", None, None))
                if layout != "1x2":
                    rows.append((layout, mode, "nodes", None, None))
    return rows, results, counts


def report(a, rows, counts):
    print(f"\n{'layout':7}{'mode':10}{'communicator':40}{'tokens/s median (min-max)':28}"
          f"{'harmpi ratio':>13}  tokens")
    for layout, mode, comm, r, h in rows:
        if comm == "nodes":
            print(f"{layout:7}{mode:10}(vLLM's shm op is no rival across nodes: it cannot "
                  "leave a host; vLLM uses Gloo there)")
            continue
        if r is None:
            print(f"{layout:7}{mode:10}(vLLM's shm all-reduce op is not in this CPU's vLLM "
                  "library (it needs AVX-512): vLLM uses Gloo here)")
            continue
        ratio = statistics.median(tokens_per_s(h)) / statistics.median(tokens_per_s(r))
        same = "-" if comm == "harmpi" else ("identical" if r["tokens"] == h["tokens"]
                                             else "DIFFERENT")
        print(f"{layout:7}{mode:10}{comm + ': ' + r['path']:40}{_fmt(tokens_per_s(r)):28}"
              f"{'' if comm == 'harmpi' else f'{ratio:.2f}x':>13}  {same}")
    shares = [(layout, mode, r["share"]) for layout, mode, comm, r, _ in rows
              if comm == "harmpi" and r.get("share")]
    if shares:
        print("\nharmpi's share of a decode step (one more generation under harmpi.profile(), "
              "rank mean) beside a microbenchmark of the same calls in the same job:")
        for layout, mode, sh in shares:
            micro = ", ".join(f"{name} {nb} B x {n:.2f} at {us:.1f} us"
                              for name, nb, n, us in sh["micro"])
            total = sh["wait_us_per_step"] + sh["own_us_per_step"]
            print(f"  {layout} {mode:9} {total:7.1f} us/step in {sh['calls_per_step']:.2f} "
                  f"collectives (waiting for the last rank {sh['wait_us_per_step']:.1f}, own "
                  f"{sh['own_us_per_step']:.1f}); microbenchmark {sh['micro_us_per_step']:.1f} "
                  f"us/step ({micro})")
    traces = [(layout, mode, comm, r["trace"]) for layout, mode, comm, r, _ in rows
              if r is not None and r.get("trace")]
    if traces:
        print("\nOne generation under torch.profiler, rank 0, per decode step: operators by "
              "self CPU time (us), calls")
        for layout, mode, comm, tr in traces:
            ops = "; ".join(f"{name} {us:.0f} ({calls:.1f})" for name, calls, us in tr["ops"])
            print(f"  {layout} {mode:9} {comm:7} {ops}")
    if counts:
        print(f"\nTP collectives of one generation ({a.prompts} sequence(s) x {a.max_tokens} "
              f"tokens = {a.max_tokens} forward steps), per rank:")
        for kind, nbytes, n in counts:
            print(f"  {kind:11} {nbytes:>9} B  x {n:5}  ({n / a.max_tokens:.2f} per step)")


def main(argv=None):
    a = _args(argv)
    vllm_model.make(a.model)
    import torch  # noqa: PLC0415 - the vLLM venv's

    print(f"vLLM TP=2, random Llama {vllm_model.SHAPE['num_hidden_layers']} layers x hidden "
          f"{vllm_model.SHAPE['hidden_size']} bf16, {a.prompts} sequence(s) x {a.max_tokens} "
          f"tokens, greedy; {a.runs} timed runs per job; torch {torch.__version__}, "
          f"{os.cpu_count()} cores", flush=True)
    rows, results, counts = measure(a)
    report(a, rows, counts)
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(results, f, indent=1)
    serve_rc = serve(a) if a.serve else 0
    bad = [(lay, m, c) for lay, m, c, r, h in rows
           if r is not None and c != "harmpi" and r["tokens"] != h["tokens"]]
    if bad:
        print(f"\nsampled tokens differ from harmpi's: {bad}")
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
