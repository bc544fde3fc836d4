"""torch's own distributed tests as harmpi's conformance test (``make torch-suite``).

    python tests/torch_suite/suite.py                      # gloo and harmpi, 2, 3 and 2x2
    python tests/torch_suite/suite.py --backends harmpi --layouts 2 --methods test_broadcast

Runs the collective and point-to-point methods of torch's
``DistributedTest._DistTestBase`` (:data:`METHODS`) under mpirun, one test
rank per MPI rank (tests/torch_suite/rank.py says how the suite is adapted),
for each backend at each layout: ``2`` and ``3`` ranks on one node, ``2x2``
two virtual nodes of two ranks (``HARMPI_RANKS_PER_NODE=2``, 4 ranks).
Prints one pass/fail/skip table per layout and the counts per backend. With
``--check`` (what make runs) it exits 1 when harmpi does not pass a method
that gloo passed at the same layout on this machine.

A job whose ranks disagree about a method (one failed, one passed) is ended
by its rank 0 and started again after that method; a job that reports
nothing for ``--test-timeout`` seconds is killed and the method it was in is
recorded as a timeout; a job that dies in a method records it as a crash.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# run as a script: launch/ from the checkout, support/ from tests/
for _path in (REPO, os.path.join(REPO, "tests")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from support.jobs import job_argv, job_env  # noqa: E402

from launch.errors import MpiNotFoundError  # noqa: E402
from launch.mpienv import find_mpirun  # noqa: E402

RANK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank.py")

#: the suite's collective and point-to-point methods, in the order they run:
#: the timed-out barriers last (some ranks skip the barrier on purpose)
METHODS = (
    # all_reduce
    "test_all_reduce_sum", "test_all_reduce_sum_async", "test_all_reduce_sum_complex",
    "test_all_reduce_product", "test_all_reduce_min", "test_all_reduce_max",
    "test_all_reduce_complex_unsupported_ops",
    "test_all_reduce_group_sum", "test_all_reduce_group_product", "test_all_reduce_group_min",
    "test_all_reduce_group_max",
    "test_all_reduce_full_group_sum", "test_all_reduce_full_group_product",
    "test_all_reduce_full_group_min", "test_all_reduce_full_group_max",
    "test_sparse_all_reduce_sum",
    "test_all_reduce_coalesced_sum", "test_all_reduce_coalesced_product",
    "test_all_reduce_coalesced_min", "test_all_reduce_coalesced_max",
    "test_all_reduce_coalesced_max_complex_unsupported",
    "test_all_reduce_coalesced_group_sum", "test_all_reduce_coalesced_group_product",
    "test_all_reduce_coalesced_group_min", "test_all_reduce_coalesced_group_max",
    "test_all_reduce_coalesced_full_group_sum", "test_all_reduce_coalesced_full_group_product",
    "test_all_reduce_coalesced_full_group_min", "test_all_reduce_coalesced_full_group_max",
    # broadcast, reduce
    "test_broadcast", "test_broadcast_group", "test_broadcast_full_group",
    "test_reduce_sum", "test_reduce_product", "test_reduce_min", "test_reduce_max",
    "test_reduce_group_sum", "test_reduce_group_product", "test_reduce_group_min",
    "test_reduce_group_max",
    "test_reduce_full_group_sum", "test_reduce_full_group_product",
    "test_reduce_full_group_min", "test_reduce_full_group_max", "test_reduce_sum_twice",
    # scatter, gather, all_gather
    "test_scatter_checks", "test_scatter", "test_scatter_complex", "test_scatter_group",
    "test_scatter_full_group",
    "test_gather_checks", "test_gather", "test_gather_group", "test_gather_full_group",
    "test_all_gather", "test_all_gather_complex", "test_all_gather_group",
    "test_all_gather_full_group",
    "test_all_gather_coalesced_simple", "test_all_gather_coalesced_complex",
    "test_all_gather_coalesced_group", "test_all_gather_coalesced_full_group",
    "test_all_gather_coalesced_with_empty",
    # all_to_all
    "test_all_to_all", "test_all_to_all_complex", "test_all_to_all_group",
    "test_all_to_all_full_group",
    "test_all_to_all_single_equal_split", "test_all_to_all_single_equal_split_complex",
    "test_all_to_all_single_equal_split_group", "test_all_to_all_single_equal_split_full_group",
    "test_all_to_all_single_unequal_split", "test_all_to_all_single_unequal_split_complex",
    "test_all_to_all_single_unequal_split_group",
    "test_all_to_all_single_unequal_split_full_group",
    # barrier
    "test_barrier", "test_barrier_group", "test_barrier_full_group",
    # point to point
    "test_send_recv", "test_send_recv_autograd_profiler", "test_send_recv_torch_profiler",
    "test_send_recv_any_source", "test_send_recv_any_source_autograd_profiler",
    "test_send_recv_any_source_torch_profiler",
    "test_send_recv_with_tag", "test_send_recv_with_tag_autograd_profiler",
    "test_send_recv_with_tag_torch_profiler",
    "test_isend", "test_isend_autograd_profiler", "test_isend_torch_profiler", "test_irecv",
    "test_batch_isend_irecv_gloo", "test_batch_isend_irecv_gloo_tags",
    "test_batch_isend_irecv_op_err", "test_batch_isend_irecv_op_list_err",
    "test_batch_isend_irecv_mixed_backend_err",
    # object collectives
    "test_broadcast_object_list", "test_all_gather_object_default_pg",
    "test_all_gather_object_subgroup", "test_gather_object", "test_gather_object_subgroup",
    "test_scatter_object_list",
    # barriers that some ranks skip on purpose (one rank times out)
    "test_barrier_timeout_global", "test_barrier_timeout_group",
    "test_barrier_timeout_full_group", "test_barrier_timeout_arg",
    "test_monitored_barrier_gloo", "test_monitored_barrier_gloo_subgroup",
    "test_monitored_barrier_gloo_rank_0_timeout", "test_monitored_barrier_failure_order",
    "test_monitored_barrier_wait_all_ranks", "test_monitored_barrier_allreduce_hang",
    "test_monitored_barrier_allreduce_hang_wait_all_ranks",
)

#: methods gloo passes that harmpi is not held to, and why
EXEMPT = {
    "test_monitored_barrier_gloo": "torch's dist.monitored_barrier refuses every backend but "
    "gloo (ValueError in torch's Python, before the group is called)",
    "test_monitored_barrier_gloo_subgroup": "as test_monitored_barrier_gloo",
    "test_monitored_barrier_failure_order": "as test_monitored_barrier_gloo",
    "test_monitored_barrier_wait_all_ranks": "as test_monitored_barrier_gloo",
}

BACKENDS = ("gloo", "harmpi")
LAYOUTS = ("2", "3", "2x2")
PASS, FAIL, SKIP = "pass", "fail", "skip"
TIMEOUT, CRASH = "timeout", "crash"


@dataclass(frozen=True)
class Layout:
    """``N`` ranks on one node, or ``GxL`` virtual nodes of L ranks."""

    np: int
    ranks_per_node: int | None

    @classmethod
    def parse(cls, text: str) -> Layout:
        if "x" in text:
            nodes, per = (int(p) for p in text.split("x"))
            return cls(nodes * per, per)
        return cls(int(text), None)


@dataclass(frozen=True)
class Result:
    outcome: str  # pass, fail, skip, timeout, crash
    detail: str = ""
    seconds: float = 0.0


def mpirun_argv(mpirun: str, layout: Layout, python: str, backend: str, methods_file: str,
                results_dir: str, meet_timeout_s: float) -> list[str]:
    """The job's command line (pure)."""
    forward = ["TEMP_DIR", "HARMPI_TIMEOUT_S", "PYTHONPATH"]
    if layout.ranks_per_node is not None:
        forward.append("HARMPI_RANKS_PER_NODE")
    return job_argv(layout.np, [python, RANK_SCRIPT, backend, methods_file, results_dir,
                                str(meet_timeout_s)], forward=forward, mpirun=mpirun)


def combine(lines: list[dict]) -> Result:
    """One method's result from every rank's line: pass or skip only when every
    rank says so; else the first failing rank's error."""
    outcomes = {line["outcome"] for line in lines}
    seconds = max(line["s"] for line in lines)
    if outcomes == {PASS} or outcomes == {PASS, SKIP}:  # ranks outside a group may skip
        return Result(PASS, "", seconds)
    if outcomes == {SKIP}:
        return Result(SKIP, lines[0]["detail"], seconds)
    rank, line = next((r, li) for r, li in enumerate(lines) if li["outcome"] == FAIL)
    return Result(FAIL, f"rank {rank}: {line['detail']}", seconds)


def read_results(results_dir: str, np: int) -> list[list[dict]]:
    """Every rank's lines, in method order."""
    ranks = []
    for r in range(np):
        path = os.path.join(results_dir, f"rank{r}.jsonl")
        lines = []
        if os.path.exists(path):
            with open(path) as fh:
                for text in fh:
                    if text.endswith("\n"):
                        lines.append(json.loads(text))
        ranks.append(lines)
    return ranks


def completed(ranks: list[list[dict]], methods: list[str]) -> dict[str, Result]:
    """The leading methods every rank reported, combined."""
    done = {}
    for i, name in enumerate(methods):
        lines = [lines[i] for lines in ranks if len(lines) > i]
        if len(lines) < len(ranks):
            break
        assert all(li["method"] == name for li in lines), (name, lines)
        done[name] = combine(lines)
    return done


def _kill(proc: subprocess.Popen) -> None:
    """End mpirun (started in a session of its own) and its ranks."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


#: seconds a job may take to start (imports; numba compiles on a cold cache)
#: on top of its stall allowance, before its first method ends
STARTUP_S = 300.0


def _watch(proc: subprocess.Popen, results_dir: str, np: int, stall_s: float) -> bool:
    """Wait for the job; kill it when no rank reports for stall_s. Whether it stalled."""
    seen, last = 0, time.monotonic() + STARTUP_S
    while proc.poll() is None:
        time.sleep(0.5)
        count = sum(len(lines) for lines in read_results(results_dir, np))
        if count != seen:
            seen, last = count, time.monotonic()
        elif time.monotonic() - last > stall_s:
            _kill(proc)
            return True
    return False


def _tail(path: str, n: int = 15) -> str:
    with open(path, errors="replace") as fh:
        return "".join(fh.readlines()[-n:])


class Runner:
    """Runs the methods for one backend at one layout, restarting after a stop."""

    def __init__(self, args, workdir: str):
        self.args = args
        self.workdir = workdir
        self.mpirun = _mpirun()

    def _env(self, layout: Layout) -> dict[str, str]:
        temp = tempfile.mkdtemp(prefix="suite-", dir=self.workdir)
        for sub in ("barrier", "test_dir", "init_dir"):
            os.mkdir(os.path.join(temp, sub))
        env = job_env({"TEMP_DIR": temp,
                       "HARMPI_TIMEOUT_S": os.environ.get("HARMPI_TIMEOUT_S", "10")})
        if layout.ranks_per_node is not None:
            env["HARMPI_RANKS_PER_NODE"] = str(layout.ranks_per_node)
        else:
            env.pop("HARMPI_RANKS_PER_NODE", None)
        return env

    def _job(self, backend: str, layout: Layout, methods: list[str], attempt: int):
        """Run one job over ``methods``: (results of the methods it finished,
        what stopped it early: None, TIMEOUT or CRASH, and the log's tail)."""
        base = os.path.join(self.workdir,
                            f"{backend}-{layout.np}-{layout.ranks_per_node}-{attempt}")
        os.mkdir(base)
        methods_file = os.path.join(base, "methods")
        with open(methods_file, "w") as fh:
            fh.write("\n".join(methods) + "\n")
        log = os.path.join(base, "log")
        argv = mpirun_argv(self.mpirun, layout, sys.executable, backend, methods_file, base,
                           self.args.test_timeout)
        with open(log, "w") as out:
            proc = subprocess.Popen(argv, env=self._env(layout), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                stalled = _watch(proc, base, layout.np, self.args.test_timeout + 30)
            finally:  # interrupted (make's timeout, Ctrl-C): the job goes too
                if proc.poll() is None:
                    _kill(proc)
        done = completed(read_results(base, layout.np), methods)
        restarted = os.path.exists(os.path.join(base, "restart"))  # rank.RESTART_MARK
        stop = TIMEOUT if stalled else (None if proc.returncode == 0 or restarted else CRASH)
        if len(done) < len(methods) and stop is None and not restarted:
            stop = CRASH
        return done, stop, _tail(log)

    def run(self, backend: str, layout: Layout) -> dict[str, Result]:
        results: dict[str, Result] = {}
        remaining = list(self.args.methods)
        attempt = 0
        while remaining:
            attempt += 1
            t0 = time.monotonic()
            done, stop, tail = self._job(backend, layout, remaining, attempt)
            if self.args.verbose:
                print(f"# job {attempt}: {len(done)} of {len(remaining)} methods in "
                      f"{time.monotonic() - t0:.0f} s, stop {stop}", file=sys.stderr)
            results.update(done)
            remaining = remaining[len(done):]
            if stop is not None and remaining:
                name = remaining.pop(0)
                results[name] = Result(stop, tail.strip().splitlines()[-1][:300] if tail else "")
                if self.args.verbose:
                    print(f"--- {backend} {layout}: {name} {stop}; job log tail:\n{tail}",
                          file=sys.stderr)
        return results


def _mpirun() -> str:
    try:
        return find_mpirun()
    except MpiNotFoundError as exc:
        sys.exit(f"torch suite: {exc}")


def counts(results: dict[str, Result]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in results.values():
        out[r.outcome] = out.get(r.outcome, 0) + 1
    return out


def gloo_passes(by_backend: dict[str, dict[str, Result]], expected: list[str] | None) -> set:
    """What gloo passed at this layout: in this run, else the committed list."""
    if "gloo" in by_backend:
        return {m for m, r in by_backend["gloo"].items() if r.outcome == PASS}
    return set(expected or ())


def regressions(by_backend: dict[str, dict[str, Result]],
                expected: list[str] | None = None) -> list[str]:
    """Methods gloo passed (this run, else ``expected``) that harmpi did not."""
    harmpi = by_backend.get("harmpi")
    if harmpi is None:
        return []
    return sorted(m for m in gloo_passes(by_backend, expected) if m not in EXEMPT and m in harmpi
                  and harmpi[m].outcome != PASS)


def table(layout_name: str, by_backend: dict[str, dict[str, Result]]) -> str:
    backends = list(by_backend)
    methods = list(next(iter(by_backend.values())))
    width = max(len(m) for m in methods)
    lines = [f"# torch suite, layout {layout_name}",
             f"{'method':<{width}}  " + "  ".join(f"{b:<8}" for b in backends)
             + "  seconds  detail"]
    for m in methods:
        row = [by_backend[b].get(m, Result("-")) for b in backends]
        detail = next((r.detail for r in row if r.outcome not in (PASS, SKIP) and r.detail), "")
        if not detail and all(r.outcome == SKIP for r in row):
            detail = row[0].detail
        lines.append(f"{m:<{width}}  " + "  ".join(f"{r.outcome:<8}" for r in row)
                     + "  " + "/".join(f"{r.seconds:.1f}" for r in row) + f"  {detail[:160]}")
    for b in backends:
        c = counts(by_backend[b])
        lines.append(f"# {b} at {layout_name}: " + ", ".join(f"{v} {k}" for k, v in
                                                               sorted(c.items())))
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated method names (default: all of METHODS)")
    p.add_argument("--test-timeout", type=float, default=120.0,
                   help="seconds a job may go without finishing a method")
    p.add_argument("--check", action="store_true",
                   help="exit 1 if harmpi fails a method gloo passes at the same layout")
    p.add_argument("--json", help="write every result to this file")
    p.add_argument("--expect", metavar="FILE",
                   help="JSON {layout: [methods gloo passes]} to check harmpi against when "
                        "gloo is not run (tests/torch_suite/gloo_passes.json)")
    p.add_argument("--write-expect", metavar="FILE",
                   help="write what gloo passed at each layout as --expect reads it")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    args.layouts = [x for x in args.layouts.split(",") if x]
    args.methods = [m for m in args.methods.split(",") if m]
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    failed = []
    everything = {}
    expected = {}
    if args.expect:
        with open(args.expect) as fh:
            expected = json.load(fh)
    passes = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="harmpi-torch-suite-") as workdir:
        runner = Runner(args, workdir)
        for name in args.layouts:
            layout = Layout.parse(name)
            by_backend = {}
            for backend in args.backends:
                t1 = time.monotonic()
                by_backend[backend] = runner.run(backend, layout)
                print(f"# {backend} at {name}: {time.monotonic() - t1:.0f} s", flush=True)
            print(table(name, by_backend), flush=True)
            everything[name] = {b: {m: vars(r) for m, r in res.items()}
                                for b, res in by_backend.items()}
            failed += [f"{name}: {m}" for m in regressions(by_backend, expected.get(name))]
            passes[name] = sorted(gloo_passes(by_backend, expected.get(name)))
    print(f"# torch suite: {time.monotonic() - t0:.0f} s in all")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(everything, fh, indent=1)
    if args.write_expect:
        with open(args.write_expect, "w") as fh:
            json.dump(passes, fh, indent=1)
            fh.write("\n")
    if failed:
        print("# harmpi does not pass what gloo passes:\n  " + "\n  ".join(failed))
    return 1 if failed and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
