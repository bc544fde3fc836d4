"""Set-up and teardown faults as whole mpirun jobs (issue 21): every
collective of harmpi has a deadline, set-up included, and every fault ends
in a clear error on every rank. Each job runs at the layouts where the fault
was seen: one node, and 2 virtual nodes x 2 over tcp and over the mpi
transport (one job per layout holds several cases: a job's start-up is most
of its cost)."""

import pytest
from support.jobs import run_job

pytestmark = pytest.mark.timeout(400)

LAYOUTS = {
    "one-node": {},
    "2x2-tcp": {"HARMPI_RANKS_PER_NODE": "2", "HARMPI_TRANSPORT": "tcp"},
    "2x2-mpi": {"HARMPI_RANKS_PER_NODE": "2", "HARMPI_TRANSPORT": "mpi"},
}
VARIABLES = ("HARMPI_RANKS_PER_NODE", "HARMPI_TRANSPORT", "HARMPI_SLOT_BYTES",
             "HARMPI_SMALL_MAX_BYTES")

SET_UP = """
    import dataclasses, os, time, harmpi, numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD

    # settings set on rank 1 only
    base = dict(os.environ)
    for name, value in [("HARMPI_RANKS_PER_NODE", "1"), ("HARMPI_TRANSPORT", "{other}"),
                        ("HARMPI_SLOT_BYTES", "65536"), ("HARMPI_SMALL_MAX_BYTES", "1024")]:
        if comm.rank == 1:
            os.environ[name] = value
        c = comm.Dup()
        try:
            harmpi.allreduce(np.ones(2560, np.float32), comm=c)
            print(f"rank {{comm.rank}} {{name}}: no error", flush=True)
        except harmpi.HarmpiMismatchError as exc:
            named = name in str(exc) and repr(value) in str(exc)
            print(f"rank {{comm.rank}} {{name}}: mismatch named={{named}} {{exc}}", flush=True)
        os.environ.clear()
        os.environ.update(base)
        c.Free()

    # the last rank comes more than the deadline late to init; the others
    # catch their timeout and go on (a barrier)
    c = comm.Dup()
    cfg = dataclasses.replace(harmpi.Config.from_env(), timeout_s=1.5)
    if comm.rank == comm.size - 1:
        time.sleep(5.0)
    t0 = time.monotonic()
    try:
        harmpi.init(c, config=cfg)
        print(f"rank {{comm.rank}} late init: set up", flush=True)
    except harmpi.HarmpiError as exc:
        print(f"rank {{comm.rank}} late init: failed after {{time.monotonic() - t0:.3f}} s: "
              f"{{type(exc).__name__}}: {{exc}}", flush=True)
    comm.Barrier()

    # flat_ring on rank 0, auto on the others: rank 0's transport set-up
    # times out (1.5 s; the others wait 6 s), rank 0 catches it and goes on
    c = comm.Dup()
    cfg = dataclasses.replace(harmpi.Config.from_env(), timeout_s=1.5 if comm.rank == 0 else 6.0)
    harmpi.init(c, config=cfg)
    for call, algorithm in ((0, "flat_ring" if comm.rank == 0 else None), (1, None)):
        x = np.full(8, (comm.rank + 1.0) * 10 ** call, np.float32)
        t0 = time.monotonic()
        try:
            harmpi.allreduce(x, comm=c, algorithm=algorithm)
            print(f"rank {{comm.rank}} forced {{call}}: returned {{x[0]}}", flush=True)
        except (harmpi.HarmpiError, KeyboardInterrupt) as exc:
            print(f"rank {{comm.rank}} forced {{call}}: failed after "
                  f"{{time.monotonic() - t0:.3f}} s: {{type(exc).__name__}}: {{exc}}", flush=True)
    comm.Barrier()

    x = np.full(8, comm.rank + 1.0, np.float32)
    c = comm.Dup()
    harmpi.allreduce(x, comm=c)
    c.Free()
    harmpi.allreduce(x)
    print(f"rank {{comm.rank}} after: {{x[0]}}", flush=True)
"""


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_set_up_faults_fail_on_every_rank_within_the_deadline(tmp_path, layout):
    """Settings that differ between ranks (HARMPI_RANKS_PER_NODE,
    HARMPI_TRANSPORT, HARMPI_SLOT_BYTES, HARMPI_SMALL_MAX_BYTES on rank 1
    only) raise HarmpiMismatchError at set-up on every rank, naming the
    variable and the values (they used to hang with raw MPI errors, or raise
    a size mismatch that named neither). A rank that comes to init more than
    the deadline late fails at once, the others at their deadline (the late
    one used to complete the polled barrier the others had posted and then
    block forever in the split that follows). A forced algorithm on one rank
    whose set-up times out there (flat_ring on rank 0, auto elsewhere) fails
    the call on every rank and every later call on that communicator (rank
    0's next call used to pair with the others' first one: wrong sums).
    harmpi works afterwards."""
    env = LAYOUTS[layout]
    other = "mpi" if env.get("HARMPI_TRANSPORT") == "tcp" else "tcp"
    proc = run_job(tmp_path, SET_UP.format(other=other), work_s=20, np=4, extra_env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for r in range(4):
        for name in VARIABLES:
            ln = next(ln for ln in lines if ln.startswith(f"rank {r} {name}:"))
            assert "mismatch named=True" in ln, ln
        ln = next(ln for ln in lines if ln.startswith(f"rank {r} late init:"))
        assert "failed after" in ln and "HarmpiTimeoutError" in ln, ln
        took = float(ln.split()[6])
        if r == 3:
            assert took < 1.5 and "too late" in ln, ln        # at once, and says why
        else:
            assert took < 1.5 + 20, ln                         # generous: a loaded machine
        for call in (0, 1):   # never a sum: the call that failed on rank 0 fails everywhere
            ln = next(ln for ln in lines if ln.startswith(f"rank {r} forced {call}:"))
            assert "failed after" in ln, ln
            assert float(ln.split()[6]) < 1.5 + 20, ln
        assert f"rank {r} after: 40.0" in lines, proc.stdout
