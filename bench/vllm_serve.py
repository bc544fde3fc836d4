"""vLLM's OpenAI server at TP=2, started with vLLM's own executor and with
harmpi's (harmpi_vllm.executor.MpiExecutor): output tokens/s, time to first
token, same tokens.

    .venv-vllm/bin/python bench/vllm_serve.py                  # 1 node x 2, 8 requests
    .venv-vllm/bin/python bench/vllm_serve.py --layouts 1x2,2x1 --requests 16 --json r.json

Run with the vLLM venv's Python (`make vllm-venv`); it starts each server
with that venv's ``harmpi-vllm serve`` (vLLM's own CLI: README "vLLM"), on
the random Llama of bench/vllm_model.py (no model hub), and for each one:
waits for ``/health`` (the time is reported), sends one untimed request,
then ``--requests`` streamed ``/v1/completions`` of ``--max-tokens`` tokens
each (temperature 0, ``ignore_eos``; ``--concurrency`` at a time, distinct
prompts), and stops it with SIGTERM. Reported per server: output tokens/s
(all tokens over the wall time of all requests), time to first token
(median, min-max), and, one request at a time, whether every request's
token ids equal those of vLLM's own executor (with several in flight,
which share a step varies run to run, and so does the rounding: not
compared).

The rivals: vLLM's own executor (``mp``; its workers bound to the host's
cores split in two with VLLM_CPU_OMP_THREADS_BIND, one core kept for the
server where the host has more than two; vLLM's TP all-reduce is its
shared-memory op where its library has one, AVX-512 hosts, else Gloo), and
harmpi's executor with HARMPI_VLLM=1 at each layout: ``1x2`` one node of 2
ranks, ``2x1`` two virtual nodes of 1 rank (harmpi's tcp rail between
them; vLLM's own executor has no such layout, so its 1-node server is the
reference there too).

Importable without vLLM: :class:`Server` (start, wait for /health,
complete, stop, what was left) is what tests/test_vllm_serve.py drives.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
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

EXECUTOR = "harmpi_vllm.executor.MpiExecutor"
#: HARMPI_VLLM_LAUNCH of harmpi's executor per layout
LAYOUTS = {"1x2": "", "2x1": "--virtual-nodes 1 --transport tcp"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def omp_bind(tp: int, cpus=None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for vLLM's own workers: the CPUs split in
    ``tp`` runs, one CPU kept for the server where there are more than ``tp``."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(cpus) > tp:
        cpus = cpus[:-1]
    per = max(1, len(cpus) // tp)
    runs = [cpus[i * per:(i + 1) * per] or cpus[-1:] for i in range(tp)]
    return "|".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _process_rows() -> list[tuple[int, int, int, bytes]]:
    """(pid, ppid, sid, cmdline) of every process (Linux /proc)."""
    rows = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if fields[0] != "Z":
            rows.append((int(name), int(fields[1]), int(fields[3]), cmd))
    return rows


def job_processes(root: int) -> set[int]:
    """``root``'s live descendants, harmpi's keepers of any of them (outside
    the tree: harmpi_vllm.keeper) with theirs, and the other processes of
    all their sessions."""
    rows = _process_rows()
    kids: dict[int, list[int]] = {}
    for pid, ppid, _, _ in rows:
        kids.setdefault(ppid, []).append(pid)

    def tree(roots) -> set[int]:
        seen: set[int] = set()
        todo = list(roots)
        while todo:
            pid = todo.pop()
            if pid not in seen:
                seen.add(pid)
                todo += kids.get(pid, [])
        return seen

    seen = tree([root])
    keepers = [pid for pid, _, _, cmd in rows if b"harmpi_vllm.keeper" in cmd
               and any(f"harmpi_vllm.keeper\0{p}\0".encode() in cmd for p in seen)]
    seen |= tree(keepers)
    sids = {sid for pid, _, sid, _ in rows if pid in seen} - {0, 1, os.getsid(0)}
    return seen | {pid for pid, _, sid, _ in rows if sid in sids}


def shm_files(pids) -> set[str]:
    """/dev/shm files mapped by ``pids`` (the keeper's own reading of them)."""
    from harmpi_vllm.keeper import shm_mapped  # noqa: PLC0415 - installed beside vLLM

    return shm_mapped(pids)


def alive(pids) -> list[int]:
    live = {pid for pid, _, _, _ in _process_rows()}
    return sorted(set(pids) & live)


class Server:
    """One ``harmpi-vllm serve`` (vLLM's CLI) on the bench model, in a session of its own."""

    def __init__(self, python: str, model: str, log_path: str, *, executor: str = "harmpi",
                 launch: str = "", tp: int = 2, mode: str = "eager", max_num_seqs: int = 4,
                 seed: int = 0, extra_env=None, prefix=()):
        self.python, self.model, self.log_path = python, model, log_path
        self.executor, self.launch, self.tp, self.mode = executor, launch, tp, mode
        self.max_num_seqs, self.seed = max_num_seqs, seed
        self.extra_env = dict(extra_env or {})
        self.prefix = list(prefix)  # what runs the server (e.g. in a network namespace)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def argv(self) -> list[str]:
        cli = os.path.join(os.path.dirname(self.python), "harmpi-vllm")
        argv = [*self.prefix, cli, "serve", self.model, "--tensor-parallel-size", str(self.tp),
                "--dtype", "bfloat16", "--max-model-len", "256", "--max-num-seqs",
                str(self.max_num_seqs), "--kv-cache-memory-bytes", str(256 << 20),
                "--seed", str(self.seed), "--port", str(self.port)]
        if self.mode == "eager":
            argv.append("--enforce-eager")
        if self.executor == "harmpi":
            argv += ["--distributed-executor-backend", EXECUTOR]
        return argv

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("HARMPI_", "OMPI_COMM_WORLD", "PMIX_"))}
        if self.executor == "harmpi":
            env.update(HARMPI_VLLM="1", HARMPI_VLLM_LAUNCH=self.launch)
        else:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", omp_bind(self.tp))
        env.setdefault("NO_COLOR", "1")
        # each server compiles through its own executor's all-reduce: vLLM's
        # compile cache keys the graph by configuration alone (see
        # vllm_demo.run_job), and the two executors' graphs differ
        env["VLLM_DISABLE_COMPILE_CACHE"] = "1"
        env.update(self.extra_env)
        return env

    def start(self) -> "Server":
        log = open(self.log_path, "wb")
        self.started = time.monotonic()
        # from the log's directory, not the checkout: its ranks run `python -m`,
        # which would import the checkout's harmpi (see vllm_demo.run_job)
        self.proc = subprocess.Popen(self.argv(), env=self.env(), stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True,
                                     cwd=os.path.dirname(os.path.abspath(self.log_path)))
        log.close()
        return self

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def _request(self, method: str, path: str, body=None, timeout: float = 600):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"})
        return conn, conn.getresponse()

    def health(self) -> int:
        """/health's status (0: no answer)."""
        try:
            conn, resp = self._request("GET", "/health", timeout=5)
            resp.read()
            conn.close()
            return resp.status
        except OSError:
            return 0

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds from start to /health 200; RuntimeError if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.health() == 200:
                return time.monotonic() - self.started
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}) before /health "
                                   f"answered:\n{self.log()[-6000:]}")
            time.sleep(1.0)
        raise RuntimeError(f"no /health 200 within {timeout_s:.0f} s:\n{self.log()[-6000:]}")

    def complete(self, prompt, max_tokens: int) -> dict:
        """One /v1/completions (``prompt``: a string or a list of them), not
        streamed: the response's JSON."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        conn, resp = self._request("POST", "/v1/completions", body)
        data = json.loads(resp.read())
        conn.close()
        if resp.status != 200:
            raise RuntimeError(f"/v1/completions: {resp.status} {data}")
        return data

    def stream(self, prompt: str, max_tokens: int) -> dict:
        """One streamed /v1/completions: token ids, seconds to the first token and in all."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
                "stream": True}
        t0 = time.perf_counter()
        conn, resp = self._request("POST", "/v1/completions", body)
        if resp.status != 200:
            raise RuntimeError(f"/v1/completions: {resp.status} {resp.read()[:2000]!r}")
        tokens, first = [], None
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
            if ids and first is None:
                first = time.perf_counter() - t0
            tokens += ids
        conn.close()
        return {"tokens": tokens, "ttft_s": first, "seconds": time.perf_counter() - t0}

    def stop(self, sig=signal.SIGTERM, group: bool = False, timeout_s: float = 60) -> int:
        """Send ``sig`` (to the server, or its process group as a Ctrl-C
        does) and wait for it to exit; its exit status."""
        if self.proc.poll() is None:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()


def _prompts(n: int) -> list[str]:
    return vllm_model.prompts(n + 1, 16)  # the first is the untimed warm-up's


def run_server(a, layout: str, executor: str, tmp: str) -> dict:
    """Start one server, time it, stop it: its result."""
    srv = Server(sys.executable, a.model, os.path.join(tmp, f"{layout}-{executor}.log"),
                 executor=executor, launch=LAYOUTS[layout], mode=a.mode,
                 max_num_seqs=max(a.concurrency, 1))
    srv.start()
    try:
        health_s = srv.wait_healthy(a.timeout)
        prompts = _prompts(a.requests)
        srv.stream(prompts[0], a.max_tokens)
        results = [None] * a.requests
        t0 = time.perf_counter()
        from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

        with ThreadPoolExecutor(a.concurrency) as pool:
            futures = {pool.submit(srv.stream, p, a.max_tokens): i
                       for i, p in enumerate(prompts[1:])}
            for fut, i in futures.items():
                results[i] = fut.result()
        wall = time.perf_counter() - t0
        log = srv.log()
    finally:
        pids = job_processes(srv.proc.pid)
        files = shm_files(pids)
        srv.stop()
    deadline = time.monotonic() + 30
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = sorted(f for f in files if os.path.exists(f))
    for f in left:  # this server's own files: reported, not left behind
        os.unlink(f)
    path = ("harmpi" if "harmpi carries vLLM's all-reduce" in log else
            "gloo" if "CPU SHM communicator disabled for group tp" in log else "vllm shm op")
    return {"layout": layout, "executor": executor, "path": path, "health_s": health_s,
            "wall_s": wall, "output_tokens": sum(len(r["tokens"]) for r in results),
            "ttft_s": [r["ttft_s"] for r in results], "tokens": [r["tokens"] for r in results],
            "left_shm": left}


def _cpu() -> str:
    model, flags = "?", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "?":
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags") and not flags:
                    flags = [x for x in line.split(":", 1)[1].split()
                             if x.startswith(("avx512", "amx")) or x == "avx2"]
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs, {' '.join(flags) or 'no AVX2/AVX-512 flags'}"


def report(a, rows) -> int:
    print(f"\n{'layout':7}{'executor':34}{'/health s':>10}{'tok/s':>9}"
          f"{'TTFT ms median (min-max)':>28}  tokens")
    by = {(r["layout"], r["executor"]): r for r in rows}
    bad = 0
    for r in rows:
        ref = by.get((r["layout"], "vllm")) or by.get(("1x2", "vllm"))
        ttft = [t * 1e3 for t in r["ttft_s"]]
        rate = r["output_tokens"] / r["wall_s"]
        same = "-" if r is ref else "identical" if r["tokens"] == ref["tokens"] else "DIFFERENT"
        if a.concurrency > 1 and r is not ref:
            same = "not compared"  # which requests share a step varies run to run
        bad += same == "DIFFERENT"
        ratio = ""
        if r is not ref and ref is not None:
            ratio = f" ({rate / (ref['output_tokens'] / ref['wall_s']):.2f}x)"
        name = f"{'vLLM mp' if r['executor'] == 'vllm' else 'harmpi MpiExecutor'}: {r['path']}"
        print(f"{r['layout']:7}{name:34}{r['health_s']:10.0f}{rate:9.1f}"
              f"{statistics.median(ttft):12.0f} ({min(ttft):.0f}-{max(ttft):.0f})"
              f"{'':>4}  {same}{ratio}")
        if r["left_shm"]:
            print(f"        left in /dev/shm after SIGTERM (removed): {', '.join(r['left_shm'])}")
    if a.concurrency > 1:
        print("tokens not compared: with requests in flight together, which of them share a "
              "step varies from run to run, and with it the rounding (vLLM's own executor "
              "against itself: 8 of 16 requests differed at --concurrency 4)")
    return 1 if bad else 0


@click.command(help=__doc__.splitlines()[0], context_settings={"help_option_names": []})
@vllm_model.help_option()
@click.option("--layouts", default="1x2", show_default=True,
              callback=vllm_model.comma_list(tuple(LAYOUTS), "layout"),
              help="comma list of 1x2, 2x1")
@click.option("--requests", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--mode", type=click.Choice(["eager", "compiled"]), default="eager",
              show_default=True)
@click.option("--model", default=os.path.join(tempfile.gettempdir(), "harmpi-vllm-model"),
              show_default=True)
@click.option("--timeout", type=float, default=900, show_default=True,
              help="seconds to /health")
@click.option("--json", "json_path", help="also write every server's result here")
def _command(**options):
    return types.SimpleNamespace(**options)


def _args(argv):
    return vllm_model.parse(_command, argv)


def main(argv=None) -> int:
    a = _args(argv)
    vllm_model.make(a.model)
    print(f"vLLM serve TP=2, random Llama {vllm_model.SHAPE['num_hidden_layers']} layers x "
          f"hidden {vllm_model.SHAPE['hidden_size']} bf16, {a.mode}; {a.requests} requests x "
          f"{a.max_tokens} tokens, {a.concurrency} at a time; {_cpu()}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(run_server(a, "1x2", "vllm", tmp))
        for layout in a.layouts:
            rows.append(run_server(a, layout, "harmpi", tmp))
    code = report(a, rows)
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
