"""harmpi's vLLM plug-in (harmpi_vllm) without vLLM: the switch, the seam it
patches (a stand-in for vLLM's platform module), the rank checks, the
communicator it picks for a group, and a TP group's collectives through
harmpi for one rank and for a group smaller than the world (an mpirun job).
The real thing, vLLM generating under harmpi-launch: tests/test_vllm_generation.py."""

import os
import subprocess
import sys
import textwrap

import pytest
from support import REPO as SUPPORT_REPO
from support.jobs import run_job

import harmpi_vllm
from harmpi_vllm import VllmLaunchError, group

REPO = str(SUPPORT_REPO)
pytestmark = pytest.mark.timeout(300)

# a stand-in for vllm.platforms: current_platform is an instance of a platform class
FAKE_VLLM = """
import sys, types
class Platform:
    def __init__(self, cpu): self.cpu = cpu
    def is_cpu(self): return self.cpu
    @classmethod
    def get_device_communicator_cls(cls): return "vllm.CpuCommunicator"
class CpuPlatform(Platform): pass
class CudaPlatform(Platform): pass
platforms = types.ModuleType("vllm.platforms")
platforms.current_platform = {cls}({cpu})
sys.modules["vllm"] = types.ModuleType("vllm")
sys.modules["vllm.platforms"] = platforms
"""


def _python(code, **env):
    """Run ``code`` in a fresh interpreter (this process may have harmpi loaded)."""
    full = dict(os.environ, PYTHONPATH=REPO)
    full.pop("HARMPI_VLLM", None)
    full.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("value", [None, "0", ""])
def test_switched_off_imports_nothing(value):
    env = {} if value is None else {"HARMPI_VLLM": value}
    proc = _python(FAKE_VLLM.format(cls="CpuPlatform", cpu=True) + """
import harmpi_vllm
harmpi_vllm.register()
p = sys.modules["vllm.platforms"].current_platform
print(p.get_device_communicator_cls(), sorted(m for m in sys.modules
      if m.split(".")[0] in ("harmpi", "mpi4py", "numba", "llvmlite", "torch")))
""", **env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["vllm.CpuCommunicator", "[]"]


def test_switched_on_names_harmpis_communicator_and_still_imports_no_harmpi():
    proc = _python(FAKE_VLLM.format(cls="CpuPlatform", cpu=True) + """
import harmpi_vllm
harmpi_vllm.register()
p = sys.modules["vllm.platforms"].current_platform
print(p.get_device_communicator_cls(), "harmpi" in sys.modules, "mpi4py" in sys.modules)
""", HARMPI_VLLM="1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [harmpi_vllm.COMMUNICATOR, "False", "False"]


def test_switched_on_outside_the_cpu_platform_is_refused():
    proc = _python(FAKE_VLLM.format(cls="CudaPlatform", cpu=False) + """
import harmpi_vllm
harmpi_vllm.register()
""", HARMPI_VLLM="1")
    assert proc.returncode != 0
    assert "serves vLLM's CPU backend; this process's vLLM platform is CudaPlatform" in proc.stderr


def test_a_misspelt_switch_is_an_error_not_off():
    assert harmpi_vllm.enabled({"HARMPI_VLLM": " 1 "}) and not harmpi_vllm.enabled({})
    with pytest.raises(ValueError, match="HARMPI_VLLM='yes': 1 switches"):
        harmpi_vllm.enabled({"HARMPI_VLLM": "yes"})


def test_the_communicator_class_is_where_the_plugin_says():
    module, _, name = harmpi_vllm.COMMUNICATOR.rpartition(".")
    path = os.path.join(REPO, *module.split(".")) + ".py"
    assert f"class {name}(CpuCommunicator)" in open(path).read()


def test_mpi_rank_from_the_launchers_environment():
    assert group.mpi_rank_from_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}) \
        == (1, 2)
    assert group.mpi_rank_from_env({"PMI_RANK": "3", "PMI_SIZE": "4"}) == (3, 4)
    assert group.mpi_rank_from_env({"RANK": "0", "WORLD_SIZE": "2"}) is None  # torchrun's


def test_vllm_ranks_that_are_mpi_ranks_pass():
    views = [group.rank_view(r, 4, {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "4"})
             for r in (2, 3)]
    group.check_ranks("tp:0", views)


def test_not_under_mpi_says_what_to_do():
    """vLLM's multiprocessing executor: workers with no MPI launcher behind them."""
    views = [group.rank_view(r, 2, {"RANK": str(r)}) for r in (0, 1)]
    with pytest.raises(VllmLaunchError) as err:
        group.check_ranks("tp:0", views)
    msg = str(err.value)
    assert "vLLM's ranks are not MPI ranks (vLLM rank 0 was not started by an MPI launcher; " \
           "vLLM rank 1 was not started" in msg
    assert 'distributed_executor_backend="external_launcher"' in msg
    assert "harmpi-launch -np N" in msg and "unset HARMPI_VLLM" in msg


def test_workers_forked_from_one_mpi_rank_are_refused():
    """The multiprocessing executor inside a one-rank MPI job: both workers
    inherit rank 0's environment."""
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
    views = [group.rank_view(r, 2, env) for r in (0, 1)]
    with pytest.raises(VllmLaunchError, match="vLLM rank 0 of 2 is MPI rank 0 of 1; "
                                              "vLLM rank 1 of 2 is MPI rank 0 of 1"):
        group.check_ranks("tp:0", views)


class FakeWorld:
    """Records what communicator_for asks of MPI.COMM_WORLD."""

    def __init__(self, size):
        self.size, self.made = size, []

    def Get_size(self):
        return self.size

    def Get_group(self):
        return self

    def Incl(self, ranks):
        return ("group", tuple(ranks))

    def Create_group(self, grp):
        self.made.append(grp)
        return ("comm", grp)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_a_group_of_every_rank_is_the_world(size):
    world = FakeWorld(size)
    assert group.communicator_for(range(size), world) == (world, "")
    assert world.made == []


def test_a_group_smaller_than_the_world_gets_a_communicator_of_its_ranks():
    world = FakeWorld(4)
    comm, name = group.communicator_for([2, 3], world)
    assert comm == ("comm", ("group", (2, 3))) and name is None
    assert world.made == [("group", (2, 3))]


ONE_RANK = """
    import os, sys, torch, harmpi
    from harmpi import native
    from harmpi_vllm import group
    if native.load() is None:
        print("no operator:", native.status()); sys.exit(0)
    views = [group.rank_view(0, 1, os.environ)]
    g = group.HarmpiGroup.make("tp:0", [0], views)
    x = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    x0 = x.clone()
    y = g.all_reduce(x)
    assert y is x and torch.equal(y, x0), (x, y)  # in place, as vLLM's own
    z = g.all_gather(x, -1)
    assert torch.equal(z, x), z
    from mpi4py import MPI
    print("ok", g.op_group == "", g.comm is MPI.COMM_WORLD)
"""


def test_one_rank(tmp_path):
    """A one-rank job (vLLM makes no communicator for a group of one rank,
    but harmpi's group of the whole one-rank world must work)."""
    proc = run_job(tmp_path, ONE_RANK, work_s=30, np=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "no operator:" in proc.stdout:
        pytest.skip(proc.stdout.strip())
    assert proc.stdout.split() == ["ok", "True", "True"], proc.stdout


SMALLER = """
    import os, torch, harmpi
    from mpi4py import MPI
    from harmpi_vllm import group
    world = MPI.COMM_WORLD
    r, n = world.Get_rank(), world.Get_size()
    # TP groups of two consecutive ranks (tp=2, pp=n/2), as vLLM makes them
    ranks = [r - r % 2, r - r % 2 + 1]
    sub = world.Split(r // 2, r)            # vLLM's Gloo group stands in for the exchange
    views = sub.allgather(group.rank_view(r, n, os.environ))
    g = group.HarmpiGroup.make("tp:0", ranks, views)
    assert g.comm.Get_size() == 2 and g.op_group == "tp:0"
    for _ in range(3):
        x = torch.full((2, 1024), float(r + 1), dtype=torch.bfloat16)
        y = g.all_reduce(x)  # in place, as vLLM's own
        assert y is x and bool((y == 2 * (r - r % 2) + 3).all()), (r, y)
    z = g.all_gather(torch.full((2, 8), float(r)), -1)
    assert z.shape == (2, 16) and z[0, 0] == ranks[0] and z[0, 8] == ranks[1], z
    print("ok", r, flush=True)
"""


def test_a_tp_group_smaller_than_the_world(tmp_path):
    proc = run_job(tmp_path, SMALLER, work_s=30, np=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(proc.stdout.split()) == sorted("ok 0 ok 1 ok 2 ok 3".split()), proc.stdout


NO_MODULE = """
    import logging, os, torch, harmpi
    from mpi4py import MPI
    from harmpi import native
    from harmpi_vllm import group
    r = MPI.COMM_WORLD.Get_rank()
    if r == 1:
        native._module_file = lambda: None   # as where harmpi._C was not built
    lines = []
    class Keep(logging.Handler):
        def emit(self, record):
            lines.append((record.levelname, record.getMessage()))
    log = logging.getLogger("vllm.harmpi")
    log.addHandler(Keep())
    log.setLevel(logging.DEBUG)
    views = MPI.COMM_WORLD.allgather(group.rank_view(r, 2, os.environ))
    assert group.HarmpiGroup.make("tp:0", [0, 1], views) is None
    assert len(lines) == 1 and "\\n" not in lines[0][1], lines
    level, line = lines[0]
    assert level == ("WARNING" if r == 0 else "DEBUG"), lines
    assert "not built: there is no harmpi._C" in line and "rank(s) [1]" in line, line
    assert "vLLM's own all-reduce and all_gather carry it" in line, line
    # the group is vLLM's now; harmpi itself still works, and says why it has no module
    x = torch.full((4,), float(r + 1), dtype=torch.bfloat16)
    harmpi.allreduce(x)
    assert bool((x == 3).all()), x
    status = harmpi.info()["native"]
    assert status.startswith("not built" if r == 1 else "serving"), status
    print("ok", r, flush=True)
"""


def test_without_the_torch_extension_vllms_own_collectives_carry_the_group(tmp_path):
    """harmpi._C absent on one member (issue 36): no member serves the group
    (the others would wait in the operator), rank 0 says why in one line,
    the communicator keeps vLLM's own collectives, harmpi.info() says why."""
    proc = run_job(tmp_path, NO_MODULE, work_s=30, np=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(proc.stdout.split()) == ["0", "1", "ok", "ok"], proc.stdout
