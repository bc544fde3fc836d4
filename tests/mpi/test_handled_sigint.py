"""A Ctrl-C the program handles itself, outside harmpi, leaves harmpi usable
(issue 35 #4). Python's C-level handler writes each signal into harmpi's
wakeup pipe, which the compiled waits read to notice Ctrl-C; a SIGINT that
Python delivered as KeyboardInterrupt in the program's own code, between
two collectives, used to leave its byte there, and the next collective
that had to wait reported "interrupted while waiting" on that rank and
failed on every peer (with the torch backend, the barrier after it too).

Rank 0 signals itself and catches KeyboardInterrupt between two
collectives; then either rank 0 waits in the next one (the others come
late) or the others wait for it. Every later collective sums right on
every rank. A real Ctrl-C during a wait still interrupts it
(tests/test_faults.py, tests/mpi/test_faults.py).
"""

import os
import signal
import time

import numpy as np
import pytest
from conftest import harmpi_process_group

import harmpi

pytestmark = pytest.mark.timeout(240)

#: a late rank's lag: long enough that its peers' waits sleep and look at
#: the wakeup pipe (they spin far less than this)
LATE_S = 0.3
#: element counts: a small step, and one past the small/latency sizes
COUNTS = (1000, 200_000)


def handle_own_ctrl_c():
    """Rank 0's program signals itself and handles the KeyboardInterrupt."""
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # Python raises at once; the sleep only bounds a miss


def summed(comm, count, late, call):
    """x = rank + 1 on every rank, all-reduced by ``call`` after the ranks
    in ``late`` slept LATE_S; returns x."""
    r = comm.Get_rank()
    x = np.full(count, r + 1.0, np.float32)
    if r in late:
        time.sleep(LATE_S)
    call(x)
    return x


@pytest.mark.parametrize("who_waits", ["rank0-waits", "peers-wait"])
def test_a_handled_ctrl_c_does_not_interrupt_a_later_wait(world, who_waits):
    comm = world.Dup()
    n, r = comm.Get_size(), comm.Get_rank()
    harmpi.init(comm)
    total = n * (n + 1) / 2
    late = set(range(1, n)) if who_waits == "rank0-waits" else {0}
    for count in COUNTS:
        x = summed(comm, count, (), lambda x: harmpi.allreduce(x, comm=comm))
        assert np.all(x == total)
        if r == 0:
            handle_own_ctrl_c()
        for _ in range(3):
            x = summed(comm, count, late, lambda x: harmpi.allreduce(x, comm=comm))
            assert np.all(x == total), (count, x[:4])
    comm.Barrier()
    comm.Free()


def test_a_handled_ctrl_c_leaves_the_torch_backend_usable(world):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    harmpi_process_group()
    n, r = world.Get_size(), world.Get_rank()
    total = n * (n + 1) / 2
    try:
        for late in (set(range(1, n)), {0}):     # rank 0 waits, then the others do
            if r == 0:
                handle_own_ctrl_c()
            if r in late:
                time.sleep(LATE_S)
            t = torch.full((1000,), r + 1.0)
            dist.all_reduce(t)
            assert torch.all(t == total), t[:4]
            if r == 0:
                handle_own_ctrl_c()
            if r in late:
                time.sleep(LATE_S)
            dist.barrier()
            t = torch.full((1000,), r + 1.0)
            dist.all_reduce(t)
            assert torch.all(t == total), t[:4]
        world.Barrier()
    finally:
        dist.destroy_process_group()   # the torch files after this one start their own

