"""torch.distributed backend "harmpi" set-ups that need a job of their own:
harmpi beside a gloo default group, ranks that contradict MPI, an old torch,
a disagreement inside an async all-reduce. (Collectives against gloo:
tests/mpi/test_torch_backend.py.)"""

import pytest
from support.jobs import run_job

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(240)

GLOO_DEFAULT = """
    import torch, torch.distributed as dist, harmpi.distributed
    from mpi4py import MPI
    dist.init_process_group("gloo", init_method="mpi://")  # no MASTER_ADDR
    h = dist.new_group(backend="harmpi")     # harmpi beside it
    x = torch.full((5120,), float(dist.get_rank() + 1), dtype=torch.bfloat16)
    y = x.clone()
    dist.all_reduce(x, group=h)
    dist.all_reduce(y)                        # gloo
    assert torch.equal(x, y), (x, y)
    assert dist.get_backend(h) == "harmpi" and dist.get_backend() == "gloo"
    print("ok", dist.get_rank(), flush=True)
    dist.destroy_process_group()
"""


def test_harmpi_group_under_a_gloo_default_group(tmp_path):
    proc = run_job(tmp_path, GLOO_DEFAULT, work_s=30)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok") == 2


WRONG_RANK = """
    import os, sys, torch.distributed as dist, harmpi.distributed
    from mpi4py import MPI
    os.environ["RANK"] = str(1 - MPI.COMM_WORLD.Get_rank())
    try:
        dist.init_process_group("harmpi", init_method="mpi://")
    except harmpi.HarmpiArgumentError as exc:
        print("refused:", exc, flush=True)
"""


def test_a_rank_that_contradicts_mpi_is_refused(tmp_path):
    proc = run_job(tmp_path, WRONG_RANK, work_s=30)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("refused: init_process_group: rank=") == 2, proc.stdout


OLD_TORCH = """
    import torch, torch.distributed as dist, harmpi.distributed
    from harmpi import distributed
    distributed.MIN_TORCH = (99, 0)
    try:
        dist.init_process_group("harmpi", init_method="mpi://")
    except harmpi.HarmpiError as exc:
        print("refused:", exc, flush=True)
"""


def test_an_unsupported_torch_is_refused_with_its_version(tmp_path):
    proc = run_job(tmp_path, OLD_TORCH, work_s=30)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("harmpi backend needs torch >= 99.0") == 2, proc.stdout


ASYNC_MISMATCH = """
    import torch, torch.distributed as dist, harmpi.distributed
    dist.init_process_group("harmpi", init_method="mpi://")
    r = dist.get_rank()
    x = torch.ones(5 + r)                     # the ranks disagree on the size
    work = dist.all_reduce(x, async_op=True)
    try:
        work.wait()
    except harmpi.HarmpiMismatchError as exc:
        print("mismatch:", exc, flush=True)
    assert bool((x == 1).all())               # untouched
    y = torch.ones(7)
    dist.all_reduce(y)                        # the group is still usable
    assert bool((y == 2).all())
    print("usable", flush=True)
"""


@pytest.mark.parametrize("virtual", ["", "1"])
def test_a_disagreement_inside_an_async_all_reduce_fails_every_rank(tmp_path, virtual):
    extra = {"HARMPI_RANKS_PER_NODE": virtual} if virtual else None
    proc = run_job(tmp_path, ASYNC_MISMATCH, work_s=30, extra_env=extra)
    if virtual:
        # across nodes a disagreement in the rail exchange leaves the context
        # unusable: the second all-reduce fails on every rank instead
        assert proc.stdout.count("mismatch:") == 2, (proc.stdout, proc.stderr[-3000:])
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("mismatch:") == 2 and proc.stdout.count("usable") == 2
