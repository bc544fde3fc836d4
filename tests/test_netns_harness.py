"""The two-host test harness (tests/support/netns.py): a real 2-node Open MPI job on
one machine through two network namespaces, and complete clean-up."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from support import netns

OK, REASON = netns.can_make_namespaces()
pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not OK, reason=f"two-host netns harness unavailable: {REASON}"),
]

RANK_SCRIPT = textwrap.dedent(
    """
    import json, socket, sys
    import numpy as np
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    # shared-memory window on the node comm: every rank writes its slot,
    # every rank reads all slots of its node
    win = MPI.Win.Allocate_shared(8, 8, comm=node)
    win.Fence()
    mine, _ = win.Shared_query(node.rank)
    np.frombuffer(mine, dtype=np.int64)[0] = 1000 + world.rank
    win.Fence()
    seen = [int(np.frombuffer(win.Shared_query(r)[0], dtype=np.int64)[0])
            for r in range(node.size)]
    win.Fence()
    win.Free()

    x = np.full(2560, world.rank + 1, dtype=np.float32)   # 10 KB
    y = np.empty_like(x)
    world.Allreduce(x, y, op=MPI.SUM)
    node_ranks = node.allgather(world.rank)
    rec = dict(rank=world.rank, size=world.size, node_size=node.size,
               node_rank=node.rank, node_ranks=node_ranks,
               host=socket.gethostname(), proc=MPI.Get_processor_name(),
               shm_seen=seen, allreduce=float(y[0]),
               allreduce_uniform=bool((y == y[0]).all()))
    print("REC " + json.dumps(rec), flush=True)
    """
)


def _records(proc: subprocess.CompletedProcess) -> list[dict]:
    recs = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("REC ")]
    return sorted(recs, key=lambda r: r["rank"])


def _fail_msg(proc: subprocess.CompletedProcess) -> str:
    return f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


def test_four_ranks_on_two_hosts(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    with netns.TwoHosts(ranks_per_host=2) as hosts:
        a, b = hosts.names
        before = hosts.veth_bytes()
        proc = hosts.mpirun([sys.executable, str(script)], np=4, timeout_s=90)
        after = hosts.veth_bytes()
    assert proc.returncode == 0, _fail_msg(proc)
    recs = _records(proc)
    assert [r["rank"] for r in recs] == [0, 1, 2, 3], _fail_msg(proc)
    assert all(r["size"] == 4 for r in recs)
    # COMM_TYPE_SHARED splits 2 + 2, by host
    assert [r["node_size"] for r in recs] == [2, 2, 2, 2]
    groups = {tuple(r["node_ranks"]) for r in recs}
    assert groups == {(0, 1), (2, 3)}
    hosts_of = {g: {recs[i]["host"] for i in g} for g in groups}
    assert all(len(h) == 1 for h in hosts_of.values())       # one host per group
    assert hosts_of[(0, 1)] != hosts_of[(2, 3)]              # and they differ
    assert {r["host"] for r in recs} == {a, b}
    assert all(r["proc"] == r["host"] for r in recs)
    # the shared window is really shared within each host
    for r in recs:
        assert r["shm_seen"] == [1000 + i for i in r["node_ranks"]]
    # 1 + 2 + 3 + 4
    assert all(r["allreduce"] == 10.0 and r["allreduce_uniform"] for r in recs)
    # bytes really crossed the veth pair (TCP BTL between the hosts)
    assert after[a][1] - before[a][1] > 10_000
    assert after[b][1] - before[b][1] > 10_000
    assert hosts.last_cleanup == {}


def _assert_clean(hosts: "netns.TwoHosts") -> None:
    assert hosts.last_cleanup == {}
    assert hosts.leftovers() == {}
    ip = netns.find_tool("ip")
    listed = subprocess.run([ip, "netns", "list"], capture_output=True, text=True).stdout
    for n in hosts.names:
        assert n not in listed
        assert not os.path.exists(f"/etc/netns/{n}")
        assert not os.path.exists(f"/sys/class/net/v{n}")
        assert not [e for e in os.listdir("/dev/shm") if n in e]
    assert hosts.pids() == []
    assert not os.path.exists(hosts.tmpdir)


def test_cleanup_after_timeout_and_error(tmp_path):
    """A hung job is killed at its timeout, an exception in the with-block
    still tears everything down, and nothing of either is left."""
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent(
        """
        import time
        from mpi4py import MPI
        w = MPI.COMM_WORLD
        n = w.Split_type(MPI.COMM_TYPE_SHARED)
        win = MPI.Win.Allocate_shared(1 << 16, 1, comm=n)
        w.Barrier()
        print("started", w.rank, flush=True)
        time.sleep(600)
        """
    ))
    hosts = netns.TwoHosts(ranks_per_host=2)
    with pytest.raises(RuntimeError, match="boom"):
        with hosts:
            with pytest.raises(subprocess.TimeoutExpired) as exc_info:
                hosts.mpirun([sys.executable, str(script)], timeout_s=8)
            assert hosts.pids() == []       # every rank and prted killed
            out = exc_info.value.output or ""
            assert out.count("started") == 4, out
            # the hosts stay usable after a killed job
            proc = hosts.run(hosts.names[1], ["cat", "/proc/sys/kernel/hostname"])
            assert proc.stdout.strip() == hosts.names[1]
            raise RuntimeError("boom")
    _assert_clean(hosts)


def test_agent_refuses_other_hosts():
    with netns.TwoHosts(ranks_per_host=1) as hosts:
        bad = subprocess.run([hosts.agent, "localhost", "echo", "hi"],
                             capture_output=True, text=True, timeout=30)
        assert bad.returncode == 255 and "refusing" in bad.stderr
        good = subprocess.run([hosts.agent, hosts.names[1], "cat", "/proc/sys/kernel/hostname"],
                              capture_output=True, text=True, timeout=30)
        assert good.returncode == 0 and good.stdout.strip() == hosts.names[1]
        # host b resolves host a by name, through /etc/netns/<b>/hosts
        res = hosts.run(hosts.names[1], ["getent", "hosts", hosts.names[0]])
        assert res.stdout.split()[0] == hosts.addresses[0]
    _assert_clean(hosts)
