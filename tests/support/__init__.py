"""What the tests share; no tests here (pytest collects nothing in this package).

* ``jobs``: whole ``mpirun`` jobs started by the unit tests (the mpirun, its
  environment, command line, time limits and runners).
* ``netns``: two network-namespace "hosts" on this machine, for real
  two-node Open MPI jobs (tests/test_netns_harness.py, test_multihost.py).
* ``verbs_double``: a shared-memory stand-in for an RDMA NIC (tests/test_verbs.py,
  test_verbs_device.py, tests/mpi/test_verbs_rail.py).
* ``have``: which optional packages are installed (torch, harmpi).
* ``arena``: a one-rank arena in private memory (node steps without MPI).
* ``reduce_oracle``: the reduce kernels' references and dtype tables.
* ``native_range_check``: a one-process program tests/test_native_torch_range.py
  runs in each declared torch's venv (harmpi._C loads, serves, sums).
* ``bench_adapters_check``, ``deepspeed_check``: rank programs that tests
  start under mpirun from the checkout (``python -m mpi4py -m
  tests.support.deepspeed_check``).

Test files import these as ``support.<module>``: pytest puts tests/ on
sys.path (tests/conftest.py and the test files are not in a package). This
file imports nothing, as tests/conftest.py imports it for every test run,
tests/mpi's under mpirun included.
"""

from pathlib import Path

#: the checkout's root (bench/ and launch/ are imported from it)
REPO = Path(__file__).resolve().parents[2]
