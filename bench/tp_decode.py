"""transformers' tensor-parallel decode (tp_plan="auto") on Gloo and on
harmpi: tokens/s, and whether both generate the same tokens.

    make tp-bench                       # = .venv-vllm/bin/python bench/tp_decode.py
    .venv-vllm/bin/python bench/tp_decode.py --tokens 128 --runs 5 --rounds 2

Run with the vLLM venv's Python (transformers, accelerate, harmpi installed
there); its harmpi-launch starts the ranks. The model is bench/vllm_model.py's
random Llama (4 layers, hidden 1024, bf16, made in a temporary directory
unless ``--model`` names one to keep). For each backend one job of ``--np``
ranks runs this file with ``--job BACKEND``; every rank

1. calls ``dist.init_process_group(BACKEND)`` (torch's env:// rendezvous from
   the launcher's RANK, WORLD_SIZE, MASTER_ADDR...). transformers would call
   it itself when no group exists, always with "gloo" on a CPU
   (``transformers.distributed.utils._ensure_torch_distributed``), so the
   group must exist before the model is loaded;
2. loads the model with ``AutoModelForCausalLM.from_pretrained(path,
   distributed_config=DistributedConfig(tp_plan="auto"))`` (what the
   deprecated ``tp_plan="auto"`` argument becomes): transformers builds its
   device mesh on the default group and shards the weights as DTensors, so
   DTensor's functional collectives run on that backend;
3. generates greedily ``--tokens`` new tokens from a fixed prompt,
   ``--warmup`` times untimed, then ``--runs`` times timed (each after a
   barrier), then once more counting the collectives by kind and size.

Jobs take turns over ``--rounds`` (gloo, harmpi, gloo, harmpi, ...), so a
change in the machine's load hits every backend alike. Printed: tokens/s
(new tokens / seconds of a generation; median with min-max over all runs),
each backend's ratio to the first, whether its token ids equal the first
backend's, and the collectives of one token. Exit 1 when tokens differ
between backends or between ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter

import click

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import vllm_model  # noqa: E402 - this directory, not the checkout's root

BACKENDS = ("gloo", "harmpi")


# --------------------------------------------------------------------------
# One rank of a job (--job BACKEND)
# --------------------------------------------------------------------------


#: the torch.distributed calls transformers' TP layers make at inference (a
#: rowwise Linear ends in dist.all_reduce); DTensor's redistributions (the LM
#: head's gather) reach torch.ops._c10d_functional instead
_DIST_CALLS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "broadcast", "all_to_all_single")
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")


def _nbytes(tensors) -> int:
    tensors = tensors if isinstance(tensors, (list, tuple)) else [tensors]
    return sum(t.numel() * t.element_size() for t in tensors)


@contextlib.contextmanager
def counting_collectives(calls: Counter, seconds: Counter):
    """Adds every collective made inside to ``calls`` and the seconds spent
    in it to ``seconds``, by (call, bytes this rank contributes). A
    functional collective's time is its issue plus its wait_tensor."""
    import torch.distributed as dist  # noqa: PLC0415
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415

    issued = []  # the functional collective a wait_tensor waits for

    class Functional(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            if func.namespace == "_c10d_functional" and name not in _NOT_COLLECTIVES:
                key = (f"funcol.{name}", _nbytes(args[0]))
                calls[key] += 1
                issued.append(key)
            elif name == "wait_tensor" and issued:
                key = issued.pop(0)
            else:
                return out
            seconds[key] += time.perf_counter() - t0
            return out

    def wrap(name, fn):
        def counted(*args, **kwargs):
            # all_gather(_into_tensor)(output, input): this rank's part is the input
            contribution = args[1] if name.startswith("all_gather") else args[0]
            key = (f"dist.{name}", _nbytes(contribution))
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            seconds[key] += time.perf_counter() - t0
            calls[key] += 1
            return out
        return counted

    saved = {name: getattr(dist, name) for name in _DIST_CALLS}
    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        with Functional():
            yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _mesh_backend(model) -> str:
    """The backend of the process group that the model's DTensor weights
    communicate over."""
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    for p in model.parameters():
        if isinstance(p, DTensor):
            return dist.get_backend(p.device_mesh.get_group())
    return "none (no DTensor weight)"


def run_job(backend: str, model_dir: str, out: str, *, tokens: int, batch: int,
            prompt_len: int, warmup: int, runs: int) -> None:
    """One rank: load the model with tp_plan="auto" on a default group of
    ``backend``, generate, and (rank 0) write the result to ``out``."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    if backend == "harmpi":
        import harmpi.distributed  # noqa: F401, PLC0415 - registers the backend
    dist.init_process_group(backend)
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415
    from transformers.distributed import DistributedConfig  # noqa: PLC0415

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.bfloat16)
    load_s = time.perf_counter() - t0
    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = tok(vllm_model.prompts(batch, prompt_len), return_tensors="pt")
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                  pad_token_id=tok.pad_token_id)

    def generate():
        with torch.inference_mode():
            return model.generate(**enc, **kwargs)

    for _ in range(warmup):
        generate()
    seconds, ids = [], None
    for _ in range(runs):
        dist.barrier()
        t0 = time.perf_counter()
        ids = generate()
        seconds.append(time.perf_counter() - t0)
    calls, inside_s = Counter(), Counter()
    t0 = time.perf_counter()
    with counting_collectives(calls, inside_s):
        generate()
    counted_s = time.perf_counter() - t0
    new = ids[:, enc["input_ids"].shape[1]:].tolist()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, new)
    if dist.get_rank() == 0:
        import transformers  # noqa: PLC0415

        result = {"backend": backend, "default_group": dist.get_backend(),
                  "mesh_group": _mesh_backend(model), "tokens": new,
                  "ranks_agree": all(x == new for x in every), "seconds": seconds,
                  "new_tokens": sum(map(len, new)), "load_s": load_s,
                  "threads": torch.get_num_threads(), "torch": torch.__version__,
                  "transformers": transformers.__version__,
                  "counted_s": counted_s,
                  "counts": [[k, n, c, inside_s[(k, n)]] for (k, n), c in sorted(calls.items())]}
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------
# The driver: one job per backend and round, then the table
# --------------------------------------------------------------------------


def launcher() -> str:
    """This venv's harmpi-launch (the ranks must run this Python)."""
    path = os.path.join(os.path.dirname(sys.executable), "harmpi-launch")
    if not os.access(path, os.X_OK):
        raise click.ClickException(f"{path} not found: run with the vLLM venv's Python "
                                   "(make vllm-venv)")
    return path


def start_job(backend: str, model_dir: str, out: str, *, nprocs: int, tokens: int, batch: int,
              prompt_len: int, warmup: int, runs: int, timeout_s: float) -> dict:
    """One job of ``nprocs`` ranks under harmpi-launch; returns rank 0's result."""
    cmd = [launcher(), "-np", str(nprocs), "--", sys.executable, os.path.abspath(__file__),
           "--job", backend, "--model", model_dir, "--out", out, "--tokens", str(tokens),
           "--batch", str(batch), "--prompt-len", str(prompt_len), "--warmup", str(warmup),
           "--runs", str(runs)]
    print(f"# tp_decode: {backend} job started ({time.strftime('%H:%M:%S')})", file=sys.stderr,
          flush=True)
    t0 = time.monotonic()
    if os.path.exists(out):
        os.remove(out)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    print(f"# tp_decode: {backend} job ended in {time.monotonic() - t0:.0f} s, exit "
          f"{proc.returncode}", file=sys.stderr, flush=True)
    if proc.returncode != 0 or not os.path.exists(out):
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise click.ClickException(f"{backend} job failed ({' '.join(cmd)}), exit "
                                   f"{proc.returncode}:\n{tail}")
    with open(out) as f:
        return json.load(f)


def tokens_per_s(result: dict) -> list[float]:
    return [result["new_tokens"] / s for s in result["seconds"]]


def merge_rounds(results: list[dict]) -> dict:
    """One backend's jobs over the rounds as one result (their runs pooled)."""
    merged = dict(results[0])
    merged["seconds"] = [s for r in results for s in r["seconds"]]
    merged["ranks_agree"] = all(r["ranks_agree"] for r in results)
    merged["same_every_round"] = all(r["tokens"] == results[0]["tokens"] for r in results)
    return merged


def format_table(rows: list[dict]) -> list[str]:
    """One line per backend: tokens/s median (min-max), ratio to the first
    backend, and whether its tokens equal the first backend's."""
    ref = rows[0]
    ref_rate = statistics.median(tokens_per_s(ref))
    lines = [f"# {'backend':8} {'mesh group':11} {'tokens/s median (min-max)':27} "
             f"{'vs ' + ref['backend']:>10}  tokens"]
    for r in rows:
        rates = tokens_per_s(r)
        rate = statistics.median(rates)
        if r is ref:
            same = "(reference)"
        else:
            same = "identical" if r["tokens"] == ref["tokens"] else "DIFFERENT"
        if not r["ranks_agree"] or not r["same_every_round"]:
            same += " (ranks or rounds disagree)"
        cell = f"{rate:.1f} ({min(rates):.1f}-{max(rates):.1f})"
        lines.append(f"  {r['backend']:8} {r['mesh_group']:11} {cell:27} "
                     f"{rate / ref_rate:9.2f}x  {same}")
    return lines


def format_counts(result: dict, tokens: int, prompt_len: int) -> list[str]:
    """The collectives of one more generation (timed inside every call, so
    slower than the timed runs) on rank 0, by call and bytes."""
    inside_s = sum(row[3] for row in result["counts"])
    lines = [f"# {result['backend']}: collectives of one generation (a prefill of {prompt_len} "
             f"tokens, then {tokens - 1} decode steps) on rank 0: {inside_s * 1e3:.1f} of "
             f"{result['counted_s'] * 1e3:.1f} ms inside them"]
    for call, nbytes, n, s in result["counts"]:
        lines.append(f"  {call:32} {nbytes:>9} B  x {n:4}  {s / n * 1e6:9.1f} us per call")
    return lines


def _header(nprocs, tokens, batch, prompt_len, runs, rounds, result) -> str:
    shape = vllm_model.SHAPE
    return (f"# transformers TP decode (tp_plan=\"auto\"): random Llama "
            f"{shape['num_hidden_layers']} layers x hidden {shape['hidden_size']} bf16, vocab "
            f"{shape['vocab_size']}; {nprocs} ranks x {result['threads']} thread(s); {batch} "
            f"sequence(s) of {prompt_len} + {tokens} tokens, greedy; {runs} timed runs x "
            f"{rounds} round(s) per backend; torch {result['torch']}, transformers "
            f"{result['transformers']}, {os.cpu_count()} CPUs")


@click.command(name="tp_decode", help=__doc__.split("\n\n")[0])
@click.option("--backends", default=",".join(BACKENDS), show_default=True,
              help="comma list of torch.distributed backends; the first is the reference")
@click.option("--np", "nprocs", type=click.IntRange(min=2), default=2, show_default=True,
              help="ranks (the TP size)")
@click.option("--tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="new tokens per sequence")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="sequences per generation")
@click.option("--prompt-len", type=click.IntRange(min=1), default=16, show_default=True,
              help="words per prompt")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True,
              help="timed generations per job")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="jobs per backend, taking turns")
@click.option("--model", "model_dir", type=click.Path(file_okay=False), default=None,
              help="where the random model is made and kept (default: a temporary directory)")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=300,
              show_default=True, help="seconds per job")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="also write every job's result here")
@click.option("--job", type=click.Choice(BACKENDS), default=None, hidden=True)
@click.option("--out", type=click.Path(dir_okay=False), default=None, hidden=True)
def main(backends, nprocs, tokens, batch, prompt_len, warmup, runs, rounds, model_dir,
         timeout_s, json_path, job, out):
    if job is not None:
        if model_dir is None or out is None:
            raise click.UsageError("--job needs --model and --out")
        run_job(job, model_dir, out, tokens=tokens, batch=batch, prompt_len=prompt_len,
                warmup=warmup, runs=runs)
        return
    names = [b for b in backends.split(",") if b]
    for b in names:
        if b not in BACKENDS:
            raise click.BadParameter(f"unknown backend {b!r} ({', '.join(BACKENDS)})",
                                     param_hint="--backends")
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="harmpi-tp-") as tmp:
        model_dir = vllm_model.make(model_dir or os.path.join(tmp, "model"))
        jobs = {b: [] for b in names}
        for _ in range(rounds):
            for b in names:
                jobs[b].append(start_job(b, model_dir, os.path.join(tmp, "result.json"),
                                         nprocs=nprocs, tokens=tokens, batch=batch,
                                         prompt_len=prompt_len, warmup=warmup, runs=runs,
                                         timeout_s=timeout_s))
    load_end = os.getloadavg()[0]
    rows = [merge_rounds(jobs[b]) for b in names]
    lines = [_header(nprocs, tokens, batch, prompt_len, runs, rounds, rows[0]),
             f"# load average {load_start:.1f} at the start, {load_end:.1f} at the end "
             "(other work on the host slows the backends unequally)",
             *format_table(rows)]
    for r in rows:
        lines += format_counts(r, tokens, prompt_len)
    print("\n".join(lines), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump([r for b in names for r in jobs[b]], f, indent=1)
    bad = [r["backend"] for r in rows
           if r["tokens"] != rows[0]["tokens"] or not r["ranks_agree"]
           or not r["same_every_round"]]
    if bad:
        raise click.ClickException(f"token ids differ from {rows[0]['backend']}'s (or between "
                                   f"ranks or rounds): {', '.join(bad)}")


if __name__ == "__main__":
    main()
