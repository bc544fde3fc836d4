"""harmpi across four real hosts: four network namespaces on this machine
joined through a Linux bridge (tests/support/netns.py, ``Hosts``), so Open MPI
sees four nodes and harmpi takes its 4-node paths (the all-reduce's
recursive doubling, the all-to-all's compiled turns over its tcp rail)
across real veth links. Also a quick check of the bridged harness
itself. Skips where namespaces (with a bridge) can't be made."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
from support import REPO, netns

OK, REASON = netns.can_make_namespaces(bridge=True)
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not OK, reason=f"bridged netns harness unavailable: {REASON}"),
]

SCRIPT = textwrap.dedent(
    """
    import json, sys, zlib
    import numpy as np
    import torch
    from mpi4py import MPI
    import harmpi

    world = MPI.COMM_WORLD
    r, n = world.Get_rank(), world.Get_size()
    info = harmpi.info()
    results = {"nodes": info["nodes"] == 4}
    # any summation order of n terms: at most n - 1 roundings in a row
    stages = n - 1
    for name, dtype, ints, u, slack in (("bf16", torch.bfloat16, torch.int16, 2.0**-8, 2.0**-24),
                                        ("f32", torch.float32, torch.int32, 2.0**-24, 2.0**-48)):
        for count in (0, 1, 5120, 300_001):
            for rep in range(2):
                rng = np.random.default_rng([rep, r, count, len(name)])
                x = torch.from_numpy(rng.standard_normal(count)).to(dtype)
                mine = x.to(torch.float64).numpy()
                parts = world.allgather(mine)
                exact = np.sum(parts, axis=0) if count else np.zeros(0)
                mag = np.sum(np.abs(parts), axis=0) if count else np.zeros(0)
                harmpi.allreduce(x)
                got = x.to(torch.float64).numpy()
                bound = (stages * u / (1 - stages * u) + n * slack) * mag
                ok = bool(np.all(np.abs(got - exact) <= bound))
                digests = world.allgather(zlib.crc32(x.view(ints).numpy().tobytes()))
                results[f"{name}/{count}/{rep}"] = ok and len(set(digests)) == 1
    # the all-to-all's compiled turns over the four hosts' rails: an even
    # split (from C++ where harmpi._C is built), uneven counts whose rest
    # past the first chunk moves straight from x into out (one-rank hosts),
    # and an expectation one rank gets wrong, seen by every rank
    for per in (3, 40_000):
        x = torch.arange(n * per * 2, dtype=torch.float32).reshape(n * per, 2) + 1e6 * r
        want = torch.cat([torch.arange(n * per * 2, dtype=torch.float32).reshape(n * per, 2)
                          [r * per:(r + 1) * per] + 1e6 * k for k in range(n)])
        results[f"a2a/even/{per}"] = bool(torch.equal(harmpi.alltoall(x), want))
        counts = [(per + 7 * r + 3 * j) % (per + 5) for j in range(n)]
        rows = [[(per + 7 * k + 3 * j) % (per + 5) for j in range(n)] for k in range(n)]
        x = torch.arange(sum(counts), dtype=torch.float64) + 1e7 * r
        got, recv = harmpi.alltoall(x, counts)
        parts = [torch.arange(sum(rows[k]), dtype=torch.float64)[sum(rows[k][:r]):
                 sum(rows[k][:r + 1])] + 1e7 * k for k in range(n)]
        results[f"a2a/uneven/{per}"] = (recv == [rows[k][r] for k in range(n)]
                                        and bool(torch.equal(got, torch.cat(parts))))
        expect = [rows[k][r] + (r == n - 1 and k == 0) for k in range(n)]
        try:
            harmpi.alltoall(x, counts, recv_counts=expect)
            results[f"a2a/bad/{per}"] = False
        except harmpi.HarmpiMismatchError as exc:
            results[f"a2a/bad/{per}"] = "split sizes disagree" in str(exc)
    # a size mismatch across the hosts fails on every rank, cleanly
    t = torch.full((10 + (r == n - 1),), float(r + 1))
    before = t.clone()
    try:
        harmpi.allreduce(t)
        results["mismatch"] = False
    except harmpi.HarmpiMismatchError:
        results["mismatch"] = True
    results["mismatch_untouched"] = bool(torch.equal(t, before))
    harmpi.finalize()
    print("REC " + json.dumps(dict(rank=r, info={k: info[k] for k in
          ("nodes", "ranks_per_node", "hostname", "transport", "transport_reason")},
          results=results)), flush=True)
    """
)


def _fail_msg(proc: subprocess.CompletedProcess) -> str:
    return f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("ranks_per_host", [1, 2])
def test_harmpi_on_four_hosts(tmp_path, ranks_per_host):
    script = tmp_path / "four_hosts.py"
    script.write_text(SCRIPT)
    np_ = 4 * ranks_per_host
    env = {"PYTHONPATH": str(REPO), "HARMPI_TIMEOUT_S": "60"}
    with netns.Hosts(4, ranks_per_host=ranks_per_host) as hosts:
        names = hosts.names
        before = hosts.veth_bytes()
        proc = hosts.mpirun([sys.executable, str(script)], np=np_, timeout_s=240, env=env)
        after = hosts.veth_bytes()
    assert hosts.last_cleanup == {}, hosts.last_cleanup
    assert hosts.leftovers() == {}
    assert proc.returncode == 0, _fail_msg(proc)
    recs = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("REC ")]
    assert sorted(r["rank"] for r in recs) == list(range(np_)), _fail_msg(proc)
    for rec in recs:
        info = rec["info"]
        assert info["nodes"] == 4 and info["ranks_per_node"] == [ranks_per_host] * 4, info
        assert info["hostname"] in names
        # no RDMA here; the hosts reach each other over the bridge
        assert info["transport"] == "tcp", info
        bad = [k for k, ok in rec["results"].items() if not ok]
        assert not bad, f"rank {rec['rank']} failed: {bad}\n{_fail_msg(proc)}"
    assert {rec["info"]["hostname"] for rec in recs} == set(names)
    # every host really sent and received over its veth link to the bridge
    # (300_001 float32 elements are 1.2 MB)
    for n in names:
        rx = after[n][0] - before[n][0]
        tx = after[n][1] - before[n][1]
        assert rx > 100_000 and tx > 100_000, (n, rx, tx)


def _listen(addr: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((addr, 0))
    s.listen(8)
    return s


def _connect(addr: str, port: int, payload: bytes) -> str:
    with socket.create_connection((addr, port), timeout=5) as c:
        c.sendall(payload)
        return c.getsockname()[0]


def test_bridge_joins_every_host():
    """Three bridged hosts: each reaches each other one by TCP over the
    bridge, names resolve on every host, the agent refuses the switch, and
    nothing is left afterwards."""
    ok, reason = netns.can_make_namespaces(need_mpirun=False, bridge=True)
    if not ok:
        pytest.skip(reason)
    with netns.Hosts(3) as hosts:
        names, addrs, switch = hosts.names, hosts.addresses, hosts.switch
        assert len(names) == len(addrs) == 3 and switch not in names
        assert addrs == ("10.213.7.1", "10.213.7.2", "10.213.7.3")
        servers = [hosts.call_in(n, _listen, a) for n, a in zip(names, addrs)]
        try:
            for i, src in enumerate(names):
                for j, dst in enumerate(names):
                    if i == j:
                        continue
                    port = servers[j].getsockname()[1]
                    local = hosts.call_in(src, _connect, addrs[j], port, f"{i}>{j}".encode())
                    assert local == addrs[i]          # left through src's own veth
                    servers[j].settimeout(5)
                    conn, peer = servers[j].accept()
                    with conn:
                        assert conn.recv(16) == f"{i}>{j}".encode()
                    assert peer[0] == addrs[i]
        finally:
            for s in servers:
                s.close()
        res = hosts.run(names[2], ["getent", "hosts", names[0]])
        assert res.stdout.split()[0] == addrs[0]
        bad = subprocess.run([hosts.agent, switch, "true"], capture_output=True, text=True,
                             timeout=30)
        assert bad.returncode == 255 and "refusing" in bad.stderr
        good = subprocess.run([hosts.agent, names[2], "cat", "/proc/sys/kernel/hostname"],
                              capture_output=True, text=True, timeout=30)
        assert good.returncode == 0 and good.stdout.strip() == names[2]
    assert hosts.last_cleanup == {} and hosts.leftovers() == {}
    ip = netns.find_tool("ip")
    listed = subprocess.run([ip, "netns", "list"], capture_output=True, text=True).stdout
    for n in (*names, switch):
        assert n not in listed
        assert not os.path.exists(f"/etc/netns/{n}")
    assert hosts.pids() == []


STALE = textwrap.dedent(
    """
    import os, signal
    from support import netns
    h = netns.Hosts(3).open()
    print(" ".join((*h.names, h.switch, h.tmpdir)), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)   # no clean-up at all
    """
)


def test_cleanup_stale_removes_bridged_run():
    """A bridged run whose process was SIGKILLed leaves its hosts, its switch
    namespace and its temp dir; cleanup_stale() removes all of them."""
    ok, reason = netns.can_make_namespaces(need_mpirun=False, bridge=True)
    if not ok:
        pytest.skip(reason)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    proc = subprocess.run([sys.executable, "-c", STALE], capture_output=True, text=True,
                          timeout=60, env=env)
    *names, tmpdir = proc.stdout.split()
    assert len(names) == 4 and names[-1].endswith("s"), proc
    left = netns.leftovers(names, (), tmpdir)
    assert set(left["namespaces"]) == set(names) and left["tmpdir"] == tmpdir, left
    removed = netns.cleanup_stale()   # (a concurrent run's open() may have beaten us to it)
    assert netns.leftovers(names, (), tmpdir) == {}, (removed, names)
