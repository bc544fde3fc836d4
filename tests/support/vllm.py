"""The vLLM venv of the vLLM tests (.venv-vllm, `make vllm-venv`): where its
Python is, whether it is there, and the environment its MPI jobs get.

`make test` sets HARMPI_VLLM_REQUIRED=1, so there a missing venv or package
fails; a bare pytest run without them skips, saying why."""

import os
import subprocess

import pytest

from . import REPO

VLLM_PY = os.path.join(REPO, ".venv-vllm", "bin", "python")


def need_vllm_venv(imports=()):
    """Skip (fail under HARMPI_VLLM_REQUIRED=1) unless .venv-vllm is built,
    harmpi is installed in it, and its Python imports every module of
    ``imports``."""
    msg = None
    if not (os.access(VLLM_PY, os.X_OK) and os.path.exists(
            os.path.join(REPO, ".venv-vllm", ".harmpi-installed"))):
        msg = f"{VLLM_PY} (with harmpi installed) is missing: `make vllm-venv` builds it"
    elif imports:
        probe = subprocess.run([VLLM_PY, "-c", "import " + ", ".join(imports)],
                               capture_output=True, text=True, timeout=120,
                               cwd=os.path.dirname(VLLM_PY))
        if probe.returncode != 0:
            msg = (f"{VLLM_PY} cannot import {', '.join(imports)} (`make vllm-venv` installs "
                   f"them): {probe.stderr.strip().splitlines()[-1:]}")
    if msg is None:
        return
    if os.environ.get("HARMPI_VLLM_REQUIRED") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


def vllm_env(**extra):
    """This environment for a job of the vLLM venv: no harmpi setting and no
    MPI rank identity of the test's own, that venv's bin first on PATH, Open
    MPI's settings as harmpi-launch gives them (root allowed, no UCX), and
    ``extra``."""
    from launch.mpienv import mpi_env  # noqa: PLC0415

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HARMPI_", "OMPI_COMM_WORLD", "PMIX_"))}
    return mpi_env(env, {"PATH": os.path.dirname(VLLM_PY) + os.pathsep + env.get("PATH", ""),
                         **extra}, yield_when_idle=False)
