"""Shared by every test run (tests/mpi adds its own conftest.py for its ranks).

pytest puts this directory on sys.path (the tests are not a package), so
test files import the helpers as ``support.<module>`` (tests/support). The
checkout goes first on sys.path too: bench/ and launch/ are imported from it
(neither is installed under that name), also under a bare ``pytest``.
Nothing here imports harmpi.
"""

import sys

import pytest
from support import REPO

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from support.jobs import job_env, mpirun_or_skip  # noqa: E402  (imports launch)


@pytest.fixture
def mpirun():
    """launch's mpirun (beside this Python, else on PATH); the test skips without one."""
    return mpirun_or_skip()


@pytest.fixture
def mpi_env():
    """A job's environment: Open MPI's settings (launch.mpienv; the caller's
    values win) and the checkout on PYTHONPATH. Tests add their own variables."""
    return job_env()
