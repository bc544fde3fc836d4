"""What a wait for a late peer costs: CPU of the waiting rank, and how soon
it returns once the peer arrives, per wait policy, in one job.

    mpirun -np 2 python -m mpi4py -m bench.wait_cost [--late-s 1.0] [--repeats 5]

Each policy (HARMPI_WAIT: spin, auto, sleep) gets a communicator of its own
(``harmpi.init`` with that Config). Per repeat, after a barrier, every rank
but the last starts a 10 KB all-reduce at once; the last rank sleeps
``--late-s`` first. The early ranks report the CPU time they used during
the call (getrusage: user + system) as a share of a core, and the time from
the late rank's entry (CLOCK_MONOTONIC, comparable on one host) to their
own return: the wake-up (the late rank spins its last 50 ms, so it arrives
hot and the figure is the waiter's). Printed: medians (and ranges) over the repeats,
rank 0's view. Policies take turns per repeat. ``--load N`` adds N busy
processes on each host (bench.load).
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import time

import numpy as np
from mpi4py import MPI

import harmpi
from bench.load import host_load

POLICIES = ("spin", "auto", "sleep")


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _one(comm, x, late_s, late_rank):
    """One late-peer all-reduce: (cpu share, wake-up us) on an early rank, None on the late one."""
    comm.Barrier()
    if comm.Get_rank() == late_rank:
        # sleep, then spin the last 50 ms: the late rank arrives hot, so the
        # wake-up measured is the waiter's, not this rank's own return from sleep
        t_end = time.monotonic() + late_s
        time.sleep(max(0.0, late_s - 0.05))
        while time.monotonic() < t_end:
            pass
        t_in = time.monotonic_ns()
        harmpi.allreduce(x, comm=comm)
        comm.bcast(t_in, root=late_rank)
        return None
    c0, t0 = _cpu_s(), time.monotonic_ns()
    harmpi.allreduce(x, comm=comm)
    t_out = time.monotonic_ns()
    cpu = _cpu_s() - c0
    t_in = comm.bcast(None, root=late_rank)
    return cpu / ((t_out - t0) / 1e9), (t_out - t_in) / 1e3


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.wait_cost",
                                description=__doc__.split("\n")[0])
    p.add_argument("--late-s", type=float, default=1.0, help="how late the last rank comes (s)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--load", type=int, default=0, metavar="N",
                   help="N busy processes on each host for the run (bench.load)")
    return p.parse_args(argv)


def _print(results, size, args, busy):
    print(f"# bench.wait_cost: {size} ranks, rank {size - 1} comes {args.late_s} s late, "
          f"10 KB all-reduce, {args.repeats} repeats; rank 0's view")
    if args.load:
        print(busy.summary())
    print(f"{'wait':<7}{'CPU share of the wait':>26}{'wake-up after arrival (us)':>32}")
    for name, got in results.items():
        cpu = [100 * c for c, _ in got]
        wake = [w for _, w in got]
        print(f"{name:<7}{statistics.median(cpu):>10.2f} % ({min(cpu):.2f}-{max(cpu):.2f})"
              f"{statistics.median(wake):>16.0f} ({min(wake):.0f}-{max(wake):.0f})")


def main(argv=None):
    args = _parse(argv)
    world = MPI.COMM_WORLD
    size = world.Get_size()
    if size < 2:
        raise SystemExit("bench.wait_cost needs at least 2 ranks")
    base = harmpi.Config.from_env()
    comms = {}
    for name in (s.strip() for s in args.policies.split(",") if s.strip()):
        comms[name] = world.Dup()
        harmpi.init(comms[name], config=dataclasses.replace(base, wait=name))
    x = np.ones(2560, np.float32)  # 10 KB
    for comm in comms.values():
        for _ in range(20):  # warm: kernels, tuner, the auto policy's learned wait
            harmpi.allreduce(x, comm=comm)
    results = {name: [] for name in comms}
    with host_load(world, args.load) as busy:
        for _ in range(args.repeats):
            for name, comm in comms.items():
                got = _one(comm, x, args.late_s, size - 1)
                if got is not None:
                    results[name].append(got)
    if world.Get_rank() == 0:
        _print(results, size, args, busy)
    for comm in comms.values():
        comm.Free()


if __name__ == "__main__":
    main()
