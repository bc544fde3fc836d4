"""What the decode benchmarks (``bench.decode``, ``bench.moe_decode``) share:
the plan of a run (rounds, KV-cache length, the prompt), the timed wrapper
around a comm, one backend's rounds on a rank, the progress line, and the
command-line options of the model's shape and of the run."""

from __future__ import annotations

import dataclasses
import sys
import time

import click
import numpy as np

from bench.decode_results import round_steps

__all__ = [
    "RunPlan",
    "TimedComm",
    "Rounds",
    "progress",
    "shape_options",
    "run_options",
]


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What one run does, fixed before it starts (the same on every rank)."""

    cfg: object  # the model's config (ModelConfig, MoEConfig)
    n_ranks: int
    batch: int
    prompt_len: int
    steps: int
    warmup_steps: int
    rounds: int
    seed: int

    @property
    def per_round(self) -> list[int]:
        return round_steps(self.steps, self.rounds)

    @property
    def max_len(self) -> int:
        """KV-cache positions a round needs."""
        return self.prompt_len + self.warmup_steps + max(self.per_round) + 1

    def prompt(self):
        """[batch, prompt_len] token ids, the same on every rank."""
        import torch

        rng = np.random.default_rng([self.seed, 7])
        return torch.from_numpy(rng.integers(0, self.cfg.vocab, (self.batch, self.prompt_len)))


class TimedComm:
    """Wraps a comm (an adapter of ``bench.impls``): adds up the ns spent
    inside its collectives in a step, counts the calls, and during timed steps
    (``begin_step(i)``, i >= 0) records each call's entry and exit times."""

    def __init__(self, inner, steps: int, calls_per_step: int):
        self.inner = inner
        self.ns = self.calls = 0
        self.step = -1  # not recording (prefill, warm-up)
        self.enter_ns = np.zeros((steps, calls_per_step), dtype=np.int64)
        self.exit_ns = np.zeros((steps, calls_per_step), dtype=np.int64)
        #: EP: rows each dispatch brought this rank (its experts' work), per timed step
        self.expert_rows = np.zeros((steps, max(calls_per_step // 2, 1)), dtype=np.int64)

    def begin_step(self, step: int) -> None:
        self.step, self.ns, self.calls = step, 0, 0

    def record(self, t0: int, t1: int) -> None:
        """One collective call from t0 to t1 (perf_counter_ns); DTensor's
        layers (``--tp-api``) report theirs here."""
        if 0 <= self.step and self.calls < self.enter_ns.shape[1]:
            self.enter_ns[self.step, self.calls], self.exit_ns[self.step, self.calls] = t0, t1
        self.ns += t1 - t0
        self.calls += 1

    def _time(self, fn, *args):
        t0 = time.perf_counter_ns()
        result = fn(*args)
        self.record(t0, time.perf_counter_ns())
        return result

    def allreduce(self, tensor):
        return self._time(self.inner.allreduce, tensor)

    def allgather(self, tensor):
        return self._time(self.inner.allgather, tensor)

    def dispatch(self, rows, send_counts):
        """EP: each (token, expert) row to the expert's owner; the counts learned."""
        recv, recv_counts = self._time(self.inner.alltoall, rows, send_counts)
        if 0 <= self.step:
            self.expert_rows[self.step, self.calls // 2] = recv.shape[0]
        return recv, recv_counts

    def combine(self, rows, send_counts, recv_counts):
        """EP: the experts' outputs back to the rows' senders, the counts known."""
        return self._time(self.inner.alltoall, rows, send_counts, recv_counts)[0]


@dataclasses.dataclass
class Rounds:
    """One backend's rounds on this rank (each a NamedTuple with ``tokens``)."""

    rounds: list = dataclasses.field(default_factory=list)
    #: every rank generated the same tokens in every round so far
    identical: bool = True

    def longest(self):
        return max(self.rounds, key=lambda r: r.tokens.shape[1])

    def longest_tokens(self) -> np.ndarray:
        return self.longest().tokens

    def concatenated(self, field: str) -> np.ndarray:
        return np.concatenate([getattr(r, field) for r in self.rounds])


def progress(command: str, text: str) -> None:
    """A progress line on stderr (rank 0), so stdout keeps only the report."""
    print(f"# {command}: {text}", file=sys.stderr, flush=True)


def _apply(options):
    def decorate(fn):
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


def shape_options(cfg):
    """--hidden, --layers, --heads, --kv-heads with ``cfg``'s defaults."""
    return _apply([
        click.option(f"--{name.replace('_', '-')}", type=click.IntRange(min=low),
                     default=getattr(cfg, name), show_default=True)
        for name, low in (("hidden", 2), ("layers", 1), ("heads", 1), ("kv_heads", 1))
    ])


def run_options(prompt_len: int, threads_help: str, load_help: str, json_help: str):
    """--prompt-len, --rounds, --warmup, --threads, --seed, --load, --json."""
    return _apply([
        click.option("--prompt-len", type=click.IntRange(min=1), default=prompt_len,
                     show_default=True),
        click.option("--rounds", type=click.IntRange(min=1), default=4, show_default=True,
                     help="Backends take turns this many times, each round restarting from "
                          "the prompt."),
        click.option("--warmup", "warmup_steps", type=click.IntRange(min=0), default=2,
                     show_default=True, help="Untimed decode steps at the start of each round."),
        click.option("--threads", type=click.IntRange(min=1), default=None, help=threads_help),
        click.option("--seed", type=int, default=1234, show_default=True),
        click.option("--load", type=click.IntRange(min=0), default=0, show_default=True,
                     metavar="N", help=load_help),
        click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True),
                     default=None, help=json_help),
    ])
