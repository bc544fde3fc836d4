"""``bench.decode --profile``: harmpi.profile of each harmpi backend's rounds,
and the line splitting its forward pass into compute, waiting for the last
rank and the collectives' own time."""

from __future__ import annotations

import time

import numpy as np

__all__ = ["step_profiles", "profile_lines"]


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


def step_profiles(impls) -> dict:
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


def profile_lines(profiles: dict, comm) -> list[str]:
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
