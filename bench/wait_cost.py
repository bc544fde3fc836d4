"""What a wait for a late peer costs: CPU of the waiting rank, and how soon
it returns once the peer arrives, per wait policy, in one job.

    mpirun -np 2 python -m mpi4py -m bench.wait_cost [--late-s 1.0] [--repeats 5]

Each policy (HARMPI_WAIT: spin, auto, sleep) gets a communicator of its own
(``harmpi.init`` with that Config). Per repeat, after a barrier, every rank
but the last starts a 10 KB all-reduce at once; the last rank sleeps
``--late-s`` first. The early ranks report the CPU time they used during
the call (getrusage: user + system) as a share of a core, and the time from
the late rank's entry (CLOCK_MONOTONIC, comparable on one host) to their
own return: the wake-up. The late rank spins its last 50 ms, so it
arrives on a running core; its own call ("late own", from its entry to
its return) is printed too, since the wake-up includes the late rank's
path up to its publish: after a second away from it, that path runs with
cold caches and TLB (on the VMs this was measured on, ~0.1-0.3 ms for
harmpi's Python entry alone, with no page fault and no context switch).
Printed: medians (and ranges) over the repeats, rank 0's view. Policies
take turns per repeat. ``--load N`` adds N busy processes on each host
(bench.load).

Two rows without harmpi give the machine's own floor, measured the same
way between rank 0 and the late rank (a FIFO in a private temporary
directory, so one host only): ``pipe-block``, rank 0 blocks in read(2) and
the late rank's write(2) wakes it (what any waiter that sleeps in the
kernel can reach, the futex included), and ``pipe-poll``, rank 0 polls a
non-blocking read without pause (a full core: what the pure spin of a
waiter can reach). On a VM the second is not a few microseconds: its vCPU
is itself scheduled by the host.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import statistics
import tempfile
import time
from types import SimpleNamespace

import click
import numpy as np
from mpi4py import MPI

import harmpi
from bench import job
from bench.load import host_load

POLICIES = ("spin", "auto", "sleep")
FLOORS = ("pipe-block", "pipe-poll")


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _one(comm, x, late_s, late_rank):
    """One late-peer all-reduce: (cpu share, wake-up us) on an early rank, None on the late one."""
    comm.Barrier()
    if comm.Get_rank() == late_rank:
        # sleep, then spin the last 50 ms: the late rank arrives hot, so the
        # wake-up measured is the waiter's, not this rank's own return from sleep
        t_in = _arrive_late(late_s)
        harmpi.allreduce(x, comm=comm)
        comm.bcast((t_in, time.monotonic_ns()), root=late_rank)
        return None
    c0, t0 = _cpu_s(), time.monotonic_ns()
    harmpi.allreduce(x, comm=comm)
    t_out = time.monotonic_ns()
    cpu = _cpu_s() - c0
    t_in, t_late = comm.bcast(None, root=late_rank)
    return cpu / ((t_out - t0) / 1e9), (t_out - t_in) / 1e3, (t_late - t_in) / 1e3


def _arrive_late(late_s):
    """Sleep, then spin the last 50 ms (see _one); the arrival time."""
    t_end = time.monotonic() + late_s
    time.sleep(max(0.0, late_s - 0.05))
    while time.monotonic() < t_end:
        pass
    return time.monotonic_ns()


def _one_pipe(world, fd, late_s, late_rank, poll):
    """The machine's floor: rank 0 waits for one byte from the late rank."""
    world.Barrier()
    rank = world.Get_rank()
    if rank == late_rank:
        t_in = _arrive_late(late_s)
        os.write(fd, b"x")
        world.bcast((t_in, time.monotonic_ns()), root=late_rank)
        return None
    got = None
    if rank == 0:
        c0, t0 = _cpu_s(), time.monotonic_ns()
        if poll:
            while True:
                try:
                    if os.read(fd, 1):
                        break
                except BlockingIOError:
                    pass
        else:
            os.read(fd, 1)
        t_out = time.monotonic_ns()
        got = (_cpu_s() - c0) / ((t_out - t0) / 1e9), t_out
    t_in, t_late = world.bcast(None, root=late_rank)
    return None if got is None else (got[0], (got[1] - t_in) / 1e3, (t_late - t_in) / 1e3)


class _Fifo:
    """A FIFO from the late rank to rank 0 (both on one host): rank 0 makes
    it in a private directory; each end opens its side, rank 0's without
    blocking so the open needs no partner. ``for_mode(poll)`` sets rank 0's
    mode and gives this rank's end."""

    def __init__(self, world, late_rank):
        self.rank = world.Get_rank()
        path = tmp = None
        if self.rank == 0:
            tmp = tempfile.mkdtemp(prefix="harmpi-wait-cost-")
            path = os.path.join(tmp, "fifo")
            os.mkfifo(path, 0o600)
        path = world.bcast(path, root=0)
        self.fd = -1
        if self.rank == 0:
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        world.Barrier()
        if self.rank == late_rank:
            self.fd = os.open(path, os.O_WRONLY)
        world.Barrier()
        if tmp is not None:
            shutil.rmtree(tmp)  # both ends are open: the name is no longer needed

    def for_mode(self, poll):
        if self.rank == 0:
            os.set_blocking(self.fd, not poll)
        return self.fd

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)


def _print(results, size, args, busy):
    print(f"# bench.wait_cost: {size} ranks, rank {size - 1} comes {args.late_s} s late, "
          f"10 KB all-reduce, {args.repeats} repeats; rank 0's view")
    if args.load:
        print(busy.summary())
    print(f"{'wait':<11}{'CPU share of the wait':>22}{'wake-up after arrival (us)':>30}"
          f"{'late own (us)':>16}")
    for name, got in results.items():
        cpu = [100 * c for c, _, _ in got]
        wake = [w for _, w, _ in got]
        own = [o for _, _, o in got]
        print(f"{name:<11}{statistics.median(cpu):>6.2f} % ({min(cpu):.2f}-{max(cpu):.2f})"
              f"{statistics.median(wake):>14.0f} ({min(wake):.0f}-{max(wake):.0f})"
              f"{statistics.median(own):>9.0f} ({min(own):.0f}-{max(own):.0f})")


def _measure(world, comms, x, args):
    """Every repeat: each policy's communicator, then each floor row, in turn."""
    late = world.Get_size() - 1
    hosts = world.allgather(MPI.Get_processor_name())
    if args.floors and hosts[0] != hosts[late]:
        if world.Get_rank() == 0:
            print(f"# no floor rows: rank 0 and rank {late} are on different hosts")
        args.floors = []
    results = {name: [] for name in [*comms, *args.floors]}
    fifo = _Fifo(world, late) if args.floors else None
    with host_load(world, args.load) as busy:
        for _ in range(args.repeats):
            for name, comm in comms.items():
                results[name].append(_one(comm, x, args.late_s, late))
            for name in args.floors:
                poll = name == "pipe-poll"
                results[name].append(_one_pipe(world, fifo.for_mode(poll), args.late_s, late, poll))
    if fifo is not None:
        fifo.close()
    return {name: [g for g in got if g is not None] for name, got in results.items()}, busy


def run(args) -> int:
    """Every policy and floor row (collective); rank 0 prints."""
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
    results, busy = _measure(world, comms, x, args)
    if world.Get_rank() == 0:
        _print(results, size, args, busy)
    for comm in comms.values():
        comm.Free()
    return 0


@click.command(name="wait_cost", help=(__doc__.split("\n")[0] + " Run under MPI: mpirun -np 2 "
               "python -m mpi4py -m bench.wait_cost. Only rank 0 prints."))
@job.help_option()
@click.option("--late-s", type=float, default=1.0, show_default=True,
              help="How late the last rank comes (s).")
@click.option("--repeats", type=int, default=5, show_default=True)
@click.option("--policies", default=",".join(POLICIES), show_default=True)
@click.option("--floors", default=",".join(FLOORS), show_default=True,
              help="The machine's floor rows to add (pipe-block, pipe-poll; '' for none).")
@click.option("--load", type=click.IntRange(min=0), default=0, show_default=True, metavar="N",
              help="N busy processes on each host for the run (bench.load).")
def main(late_s, repeats, policies, floors, load):
    floor_rows = [s.strip() for s in floors.split(",") if s.strip()]
    for name in floor_rows:
        if name not in FLOORS:
            raise click.UsageError(f"--floors: unknown row {name!r} (known: {', '.join(FLOORS)})")
    args = SimpleNamespace(late_s=late_s, repeats=repeats, policies=policies, floors=floor_rows,
                           load=load)
    job.exit_all(job.run_or_abort(run, args))


if __name__ == "__main__":
    main()
