"""harmpi.platform.worldenv without MPI: which variables are set, from what, and when not."""

import logging

from harmpi.platform import worldenv


class _Comm:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size


OMPI = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
HYDRA = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}


def test_open_mpi_and_hydra():
    env = dict(OMPI)
    assert worldenv.export(env, _Comm(3, 4)) == {"RANK": "3", "WORLD_SIZE": "4",
                                                  "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert env["RANK"] == "3" and env["LOCAL_WORLD_SIZE"] == "2"
    env = dict(HYDRA)
    worldenv.export(env, _Comm(5, 8))
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == \
        ("5", "8", "1", "4")


def test_what_the_caller_set_stays():
    env = dict(OMPI, RANK="7", LOCAL_RANK="0")
    assert worldenv.export(env, _Comm(3, 4)) == {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    assert env["RANK"] == "7" and env["LOCAL_RANK"] == "0"


def test_nothing_outside_a_launcher():
    env = {"PATH": "/bin"}
    assert worldenv.export(env, _Comm(0, 1)) == {} and env == {"PATH": "/bin"}


def test_no_local_rank_from_the_launcher_is_said(caplog):
    env = {"PMIX_RANK": "1"}
    with caplog.at_level(logging.INFO, logger="harmpi"):
        assert worldenv.export(env, _Comm(1, 2)) == {"RANK": "1", "WORLD_SIZE": "2"}
    assert "LOCAL_RANK and LOCAL_WORLD_SIZE left unset" in caplog.text


def test_the_torchrun_hint():
    assert worldenv.torchrun_hint({}, ["job.py"]) == ""
    one = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1"}
    assert "`harmpi-launch --nproc-per-node 2 job.py --lr '1e-3 x'`" in \
        worldenv.torchrun_hint(one, ["job.py", "--lr", "1e-3 x"])
    two = dict(one, GROUP_WORLD_SIZE="2")
    assert "`harmpi-launch --nproc-per-node 2 --hosts HOST1,HOST2 job.py`" in \
        worldenv.torchrun_hint(two, ["job.py"])
