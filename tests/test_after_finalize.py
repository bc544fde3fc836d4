"""After MPI.Finalize() every harmpi call raises HarmpiError; none may make
MPI abort the process (info(), init(comm=COMM_SELF) and allreduce on a
duplicate communicator used to end it with exit status 14). Each job is a
separate process: one without a launcher (a singleton) and a 2-rank mpirun,
with harmpi used before the finalize or not at all."""

import subprocess
import sys
import textwrap

import pytest
from support.jobs import job_argv

pytestmark = pytest.mark.timeout(300)

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import torch
    from mpi4py import MPI
    import harmpi

    used = sys.argv[1] == "used"
    dup = MPI.COMM_WORLD.Dup()
    if used:  # contexts on the world, a duplicate and COMM_SELF
        harmpi.allreduce(torch.ones(4))
        harmpi.allreduce(np.ones(4, np.float32), comm=dup)
        harmpi.init(MPI.COMM_SELF)
    MPI.Finalize()
    calls = {
        "info": lambda: harmpi.info(),
        "info(dup)": lambda: harmpi.info(dup),
        "init": lambda: harmpi.init(),
        "init(COMM_SELF)": lambda: harmpi.init(comm=MPI.COMM_SELF),
        "init(dup, config)": lambda: harmpi.init(dup, config=harmpi.Config()),
        "allreduce(tensor)": lambda: harmpi.allreduce(torch.ones(4)),
        "allreduce(numpy)": lambda: harmpi.allreduce(np.ones(4, np.float32)),
        "allreduce(tensor, dup)": lambda: harmpi.allreduce(torch.ones(4), comm=dup),
        "allreduce(numpy, dup)": lambda: harmpi.allreduce(np.ones(4, np.float32), comm=dup),
        "allgather(dup)": lambda: harmpi.allgather(np.ones(4, np.float32), comm=dup),
        "gather_logits(dup)": lambda: harmpi.gather_logits(torch.ones(2, 3), comm=dup),
        "barrier(dup)": lambda: harmpi.barrier(comm=dup),
        "finalize": harmpi.finalize,
    }
    for name, call in calls.items():
        try:
            call()
            print(name, "returned", flush=True)
        except harmpi.HarmpiError as exc:
            ok = "finalized" in str(exc) or "exiting" in str(exc)
            print(name, "raised" if ok else f"raised without saying why: {exc}", flush=True)
        except BaseException as exc:
            print(name, f"raised {type(exc).__name__}: {exc}", flush=True)
    print("done", flush=True)
""")


def _check(proc, ranks):
    out = proc.stdout.splitlines()
    assert proc.returncode == 0, (proc.returncode, out, proc.stderr[-3000:])
    assert out.count("done") == ranks, (out, proc.stderr[-3000:])
    bad = [ln for ln in out if ln != "done" and not ln.endswith(" raised")]
    assert not bad, bad
    assert len(out) == 14 * ranks, out


def test_calls_after_mpi_finalize_raise_in_a_singleton(tmp_path, mpi_env):
    """harmpi never used before the finalize (its MPI hooks not installed)."""
    script = tmp_path / "after.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), "unused"], env=mpi_env,
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    _check(proc, 1)


def test_calls_after_mpi_finalize_raise_under_mpirun(tmp_path, mpirun, mpi_env):
    """harmpi used on the world, a duplicate and COMM_SELF before the finalize."""
    script = tmp_path / "after.py"
    script.write_text(SCRIPT)
    argv = job_argv(2, [sys.executable, str(script), "used"], forward=["PYTHONPATH"],
                    mpirun=mpirun)
    proc = subprocess.run(argv, env=mpi_env, capture_output=True, text=True, timeout=240,
                          cwd=tmp_path)
    _check(proc, 2)
