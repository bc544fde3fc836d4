"""Nothing leaks: after a normal run and after a rank dies with an error,
no shared-memory segment, session directory or rank process is left."""

import os
import subprocess
import sys
import textwrap

import pytest
from support.jobs import SHM_VARIABLES, job_argv, shm_env

SCRIPT = textwrap.dedent("""
    import os, sys, torch, harmpi
    from mpi4py import MPI
    x = torch.ones(300_000, dtype=torch.bfloat16)
    harmpi.allreduce(x)
    if MPI.COMM_WORLD.rank == 0:
        print("segments during:", len(os.listdir(sys.argv[1])), flush=True)
    MPI.COMM_WORLD.Barrier()
    if sys.argv[2] == "crash" and MPI.COMM_WORLD.rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    harmpi.allreduce(x)
    if sys.argv[2] == "crash":
        harmpi.allreduce(x)   # rank 0 waits here until the job is aborted
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["normal", "crash"])
def test_no_segments_or_processes_left(tmp_path, mode, mpirun):
    session = tmp_path / "tmp"
    session.mkdir()
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    # Open MPI's shared-memory backing files go to tmp_path/shm, where we can look
    env, shm = shm_env(tmp_path, {"TMPDIR": str(session)})
    argv = job_argv(2, [sys.executable, "-m", "mpi4py", str(script), str(shm), mode],
                    forward=[*SHM_VARIABLES, "PYTHONPATH"], mpirun=mpirun)
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=150)
    if mode == "normal":
        assert proc.returncode == 0, proc.stderr[-2000:]
    else:
        assert proc.returncode != 0
        assert "rank 1 fails on purpose" in proc.stderr
        # rank 1's exit aborts the job at once: no collective free at exit
        # holds it until rank 0's wait for it reaches its deadline
        assert "HarmpiTimeoutError" not in proc.stderr, proc.stderr[-2000:]
    assert "segments during: " in proc.stdout and "segments during: 0" not in proc.stdout
    assert os.listdir(shm) == [], "shared-memory segments left behind"
    assert os.listdir(session) == [], "session directories left behind"
    left = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True)
    assert left.stdout.strip() == "", "rank processes left behind"


@pytest.mark.timeout(330)
def test_singleton_leaves_no_segment(tmp_path, mpi_env):
    """A script run without mpirun (an MPI singleton) must not leave Open
    MPI's shared-memory segment in /dev/shm (harmpi keeps that BTL off)."""
    env = {k: v for k, v in mpi_env.items()
           if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "OMPI_MCA_btl"))}
    # the sm BTL's segment would be made in this private directory (not in
    # /dev/shm, where jobs of tests running beside this one make theirs)
    env.update(OMPI_MCA_btl_sm_backing_directory=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", "import torch, harmpi; x = torch.ones(8); harmpi.allreduce(x); "
                               "print(harmpi.info()['ranks'], float(x.sum()))"],
        # one process, ~10 s on a quiet machine; room for a loaded one that
        # also compiles harmpi's kernels (a cold numba cache: ~80 s alone)
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["1", "8.0"]
    left = [name for name in os.listdir(tmp_path) if name.startswith("sm_segment")]
    assert left == [], f"singleton left {left} in its shared-memory directory"


def test_singleton_setting_does_not_reach_child_processes():
    import harmpi  # noqa: F401  (this pytest process is a singleton)
    assert os.environ.get("OMPI_MCA_btl") != "^sm,ofi"
