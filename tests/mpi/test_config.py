"""A Config given to harmpi.init is what the context runs with: the
environment (HARMPI_*) is read only when no Config is given."""

import dataclasses
import pathlib
import tempfile

import pytest
from conftest import torch

import harmpi
from harmpi.base import copytune, sync
from harmpi.platform import schedslice


def info_wait(comm):
    return harmpi.info(comm)["wait"]

ENV = {
    "HARMPI_TIMEOUT_S": "7",
    "HARMPI_SPIN_COUNT": "3",
    "HARMPI_WAIT": "sleep",
    "HARMPI_SCHED_SLICE_US": "0",
    "HARMPI_SLOT_BYTES": "8192",
    "HARMPI_SMALL_MAX_BYTES": "128",
    "HARMPI_HAR_LATENCY_MAX_BYTES": "256",
    "HARMPI_MODEL_FILE": "/nonexistent/cost-model.json",
    "HARMPI_ALGORITHM": "flat_ring",
    "HARMPI_TRANSPORT": "mpi",
    "HARMPI_RANKS_PER_NODE": "2",
    "HARMPI_STREAM_STORES": "on",
    "HARMPI_NATIVE": "0",
    "HARMPI_LOGITS_ROUTE": "allreduce",
    "HARMPI_LOGITS_ALLREDUCE_MAX_BYTES": "4096",
    "HARMPI_ABORT_ON_EXCEPTION": "0",
    "HARMPI_PROFILE": "1",
    "HARMPI_PROFILE_RECORDS": "100",
    "HARMPI_TRACE": "/nonexistent/trace.json",
    "HARMPI_IB_DEVICE": "mlx5_0,mlx5_1",
    "HARMPI_IB_PORT": "2",
    "HARMPI_IB_GID_INDEX": "3",
}
GIVEN = harmpi.Config(timeout_s=30.0, wait="spin", spin_count=12345, sched_slice_us=250,
                      slot_nbytes=16384,
                      small_max_nbytes=4096,
                      har_latency_max_nbytes=8192, model_file="/nonexistent/other.json",
                      algorithm="leader", transport="tcp",
                      ranks_per_node=1, stream_stores="flush", native=True,
                      logits_route="allgather", logits_allreduce_max_nbytes=12345,
                      abort_on_exception=True, profile=False, profile_records=16384, trace=None,
                      ib_devices=("rxe0",), ib_ports=(1,), ib_gid_indexes=(1,))


def test_a_config_given_to_init_wins_over_the_environment(world, monkeypatch):
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    from_env = harmpi.Config.from_env()
    for field in dataclasses.fields(harmpi.Config):  # the test covers every field
        assert getattr(GIVEN, field.name) != getattr(from_env, field.name), field.name
    comm = world.Dup()
    ctx = harmpi.init(comm, config=GIVEN)
    assert ctx.config == GIVEN
    # what each field drives, as the context runs it
    c = ctx.ctl[0]
    assert ctx.spin_count == 12345 and c["spin"] == 12345  # also when oversubscribed
    assert c["wait_policy"] == sync.WAIT_SPIN and info_wait(comm).startswith("spin")
    if isinstance(ctx.sched_slice, int):  # a kernel with custom slices (schedslice)
        # 250 us unless an earlier context of this thread asked first (its request stands)
        held = schedslice.held_us(ctx.sched_slice)
        assert held in (250, schedslice.DEFAULT_US), held
        assert schedslice.current()[2] == held * 1000
        assert info_wait(comm).endswith(f"; scheduler slice {held} us"), info_wait(comm)
    else:
        assert "own scheduler slice" in info_wait(comm), info_wait(comm)
    assert c["timeout_ns"] == 30 * 10 ** 9
    assert c["slot_nbytes"] == 16384 and c["small_max_nbytes"] == 4096
    assert c["mode"] == copytune.MODE_FLUSH and c["tuning"] == 0
    assert ctx.topo.node_count == comm.Get_size()        # ranks_per_node=1
    assert ctx.profile is None and c["profile"] == 0     # profile, trace
    info = harmpi.info(comm)
    assert info["thresholds"]["har_latency_max_nbytes"] == 8192
    assert info["thresholds"]["logits_allreduce_max_nbytes"] == 12345
    assert info["logits_route"] == "allgather"
    if comm.Get_size() > 1:
        assert info["transport"] == "tcp"
        assert ctx.entry.name == "leader"
    x = torch.full((3000,), float(comm.Get_rank() + 1))
    harmpi.allreduce(x, comm=comm)
    n = comm.Get_size()
    assert torch.all(x == n * (n + 1) / 2)


def test_init_refuses_another_config_for_a_set_up_communicator(world):
    comm = world.Dup()
    harmpi.init(comm, config=dataclasses.replace(GIVEN, ranks_per_node=None, algorithm="auto"))
    with pytest.raises(harmpi.HarmpiArgumentError, match="another config"):
        harmpi.init(comm, config=dataclasses.replace(GIVEN, timeout_s=5.0))


@pytest.mark.parametrize("wait", ["auto", "sleep", "spin"])
def test_the_yield_window_is_set_only_for_auto_when_ranks_outnumber_cores(world, wait):
    from harmpi.runtime import waits
    comm = world.Dup()
    ctx = harmpi.init(comm, config=dataclasses.replace(harmpi.Config.from_env(), wait=wait))
    expected = waits.OVERSUBSCRIBED_YIELD_NS if wait == "auto" and ctx.oversubscribed else 0
    assert ctx.ctl[0]["wait_yield"] == expected
    window = f"), yield {expected // 1000} us, then futex"
    assert (window in info_wait(comm)) == (expected > 0), info_wait(comm)
    # auto looks at the host's run queue (no spin while it is busy); the others never do
    assert ("; on a busy host none, yield" in info_wait(comm)) == (wait == "auto")
    assert (ctx.ctl[0]["wait_busy_fd"] != 0) == (wait == "auto")
    x = torch.full((5000,), float(comm.Get_rank() + 1))
    for _ in range(20):  # the waits that take the window still see every peer
        y = x.clone()
        harmpi.allreduce(y, comm=comm)
        n = comm.Get_size()
        assert torch.all(y == n * (n + 1) / 2)


def test_unset_switches_come_from_the_cost_model(world):
    """Unset, both switches are the model's crossovers for this topology,
    from rank 0's model file (another rank's bad file does not matter);
    a set switch overrides the model; info() shows the model."""
    from harmpi.algorithms import model, model_file

    rank = world.Get_rank()
    constants = dataclasses.replace(model.DEFAULT, flag_us=3.0)  # not the built-in ones
    # a directory per rank (pytest's tmp_path would have the ranks clean one base at once)
    with tempfile.TemporaryDirectory(prefix=f"harmpi-model-{rank}-") as tmp:
        path = pathlib.Path(tmp) / "cost-model.json"
        if rank == 0:
            model_file.write(path, constants, [], {"hostname": "test"}, "2026-12-05T00:00:00Z")
        else:
            path.write_text("{ not json")
        _check_the_model_switches(world, constants, path)


def _check_the_model_switches(world, constants, path):
    from harmpi.algorithms import model

    rank = world.Get_rank()
    comm = world.Dup()
    base = dataclasses.replace(harmpi.Config.from_env(), small_max_nbytes=None,
                               har_latency_max_nbytes=None, model_file=str(path))
    ctx = harmpi.init(comm, config=base)
    info = harmpi.info(comm)
    L, N = max(ctx.topo.node_sizes), ctx.topo.node_count
    expect = model.thresholds(constants, L, N)
    assert info["model"]["source"] == str(world.bcast(str(path)))
    assert info["model"]["problem"] is None
    assert info["model"]["constants"]["flag_us"] == 3.0
    assert info["model"]["switches_set_by"] == {"small_max_nbytes": "cost model",
                                                "har_latency_max_nbytes": "cost model"}
    assert info["thresholds"]["small_max_nbytes"] == expect.small_max_nbytes
    assert info["thresholds"]["har_latency_max_nbytes"] == expect.har_latency_max_nbytes
    assert ctx.ctl[0]["small_max_nbytes"] == min(expect.small_max_nbytes, 2 ** 62)
    assert [c["nbytes"] for c in info["model"]["choices"]] == list(model.SHOWN_NBYTES)
    # an explicit setting wins over the model
    comm2 = world.Dup()
    harmpi.init(comm2, config=dataclasses.replace(base, small_max_nbytes=12345))
    info2 = harmpi.info(comm2)
    assert info2["thresholds"]["small_max_nbytes"] == 12345
    assert info2["thresholds"]["har_latency_max_nbytes"] == expect.har_latency_max_nbytes
    assert info2["model"]["switches_set_by"]["small_max_nbytes"].startswith(
        "HARMPI_SMALL_MAX_BYTES")
    for c in (comm, comm2):
        x = torch.full((6000,), float(rank + 1))  # 24 KB: either side of some switch
        harmpi.allreduce(x, comm=c)
        n = world.Get_size()
        assert torch.all(x == n * (n + 1) / 2)
