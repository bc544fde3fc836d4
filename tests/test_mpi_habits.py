"""Habits of harmpi's own MPI calls, checked in its sources.

No object reduction on a communicator (``comm.allreduce(obj, op)``,
``reduce``, ``scan``, ``exscan``): mpi4py 4.1 holds the GIL while such a
call waits for its peers, so a second thread of the rank cannot run, and
two threads setting up two communicators deadlocked across ranks until
their deadline (harmpi.base.topology, "Set-up collectives that poll").
Set-ups use the polled collectives there instead.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [p for d in ("harmpi", "harmpi_vllm", "launch") for p in (ROOT / d).rglob("*.py")]
#: a communicator-looking receiver (comm, self.comm, node_comm, world, ...)
OBJECT_REDUCTION = re.compile(
    r"\b(\w*comm\w*|world|COMM_WORLD)\s*\.\s*(allreduce|reduce|scan|exscan)\s*\(")


def offenders(text):
    return [m.group(0) for m in OBJECT_REDUCTION.finditer(text)]


def test_no_object_reduction_on_a_communicator():
    found = {str(p.relative_to(ROOT)): offenders(p.read_text()) for p in SOURCES}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_check_finds_one():
    assert offenders("ok = self.comm.allreduce(0 if failures else 1, op=MPI.MIN)")
    assert offenders("MPI.COMM_WORLD.reduce(x, root=0)")
    assert not offenders("harmpi.allreduce(t, comm=self._harmpi_comm)")
    assert not offenders("api.allreduce(t, comm=comm)")
