"""harmpi across two real hosts: two network namespaces on this machine, so
Open MPI itself sees two nodes (COMM_TYPE_SHARED splits 2 + 2) and the rail
exchange crosses a veth pair over TCP. Skips where namespaces can't be made."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from support import REPO, netns

OK, REASON = netns.can_make_namespaces()
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not OK, reason=f"two-host netns harness unavailable: {REASON}"),
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
    results = {}
    for algorithm in ("auto", "har_latency", "har_bandwidth", "leader", "flat_ring"):
        for count in (0, 1, 5120, 300_001):
            for rep in range(2):
                rng = np.random.default_rng([rep, r, count])
                ref = rng.standard_normal(count)
                x = torch.from_numpy(ref).to(torch.bfloat16)
                mine = x.to(torch.float64).numpy()
                exact = np.sum(world.allgather(mine), axis=0) if count else np.zeros(0)
                mag = np.sum(np.abs(world.allgather(mine)), axis=0) if count else np.zeros(0)
                harmpi.allreduce(x, algorithm=algorithm)
                got = x.to(torch.float64).numpy()
                stages = (n - 1) if algorithm == "flat_ring" else 3
                ok = bool(np.all(np.abs(got - exact) <= (stages * 2.0**-8 + n * 2.0**-24) * mag))
                digests = world.allgather(zlib.crc32(x.view(torch.int16).numpy().tobytes()))
                results[f"{algorithm}/{count}/{rep}"] = ok and len(set(digests)) == 1
    g = harmpi.allgather(torch.full((3, 2), float(r)))
    results["allgather"] = bool(torch.equal(g[::3, 0], torch.arange(float(n))))
    # a size mismatch across the hosts fails on every rank, cleanly
    try:
        harmpi.allreduce(torch.ones(10 + (r == n - 1)))
        results["mismatch"] = False
    except harmpi.HarmpiMismatchError:
        results["mismatch"] = True
    harmpi.finalize()
    print("REC " + json.dumps(dict(rank=r, info={k: info[k] for k in
          ("nodes", "ranks_per_node", "hostname", "transport", "transport_reason")},
          results=results)), flush=True)
    """
)


@pytest.mark.parametrize("transport", ["auto", "mpi"])
def test_harmpi_on_two_hosts(tmp_path, transport):
    script = tmp_path / "two_hosts.py"
    script.write_text(SCRIPT)
    env = {"PYTHONPATH": str(REPO), "HARMPI_TIMEOUT_S": "60", "HARMPI_TRANSPORT": transport}
    with netns.TwoHosts(ranks_per_host=2) as hosts:
        proc = hosts.mpirun([sys.executable, str(script)], np=4, timeout_s=240, env=env)
        names = hosts.names
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("REC ")]
    assert sorted(r["rank"] for r in recs) == [0, 1, 2, 3], proc.stdout
    for rec in recs:
        info = rec["info"]
        assert info["nodes"] == 2 and info["ranks_per_node"] == [2, 2], info
        assert info["hostname"] in names
        if transport == "auto":
            # no RDMA here; the two hosts reach each other over the veth pair
            assert info["transport"] == "tcp", info
            assert ("no RDMA device" in info["transport_reason"]
                    or "pyverbs" in info["transport_reason"]), info
        else:
            assert info["transport"] == "mpi", info
        bad = [k for k, ok in rec["results"].items() if not ok]
        assert not bad, f"rank {rec['rank']} failed: {bad}"
    assert len({rec["info"]["hostname"] for rec in recs}) == 2
