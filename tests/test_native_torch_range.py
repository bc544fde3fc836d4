"""harmpi._C builds and runs on the oldest and the newest torch that
pyproject.toml declares (issue 36, finding 1): the oldest in
.venv-torch-oldest (make torch-oldest-venv), the newest in this venv (.venv,
requirements.txt's pin). The oldest is built here, from a copy of the
checkout (the checkout's own harmpi/_C*.so belongs to .venv's editable
install and is never rewritten here) seeded with the checkout's numba
cache; the newest is make setup's own in-place build. Then that venv's
Python runs tests/support/native_range_check.py at one rank: the module
loads, serves harmpi.allreduce, both operators and dist.all_reduce on
backend harmpi, and a bf16 tensor keeps its values.

Without .venv-torch-oldest the oldest case skips, unless
HARMPI_TORCH_OLDEST_REQUIRED=1 (make unit-parallel sets it): then it fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO
from support.jobs import job_env

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                reason="no C++ compiler: harmpi._C cannot be built here")

OLDEST_VENV = REPO / ".venv-torch-oldest"
CHECK = REPO / "tests" / "support" / "native_range_check.py"
#: what setup.py prints when the build failed (the install goes on without it)
NOT_BUILT = "harmpi: the torch extension harmpi._C is not built"


def declared_torch() -> tuple[tuple[int, int], tuple[int, int]]:
    """(lowest, cap) of pyproject.toml's ``torch>=A.B,<C.D`` extra, as (major, minor)."""
    text = (REPO / "pyproject.toml").read_text()
    found = re.search(r'^torch = \["torch>=(\d+)\.(\d+),<(\d+)\.(\d+)"\]$', text, re.M)
    assert found, "pyproject.toml's torch extra is not torch = [\"torch>=A.B,<C.D\"]"
    a, b, c, d = map(int, found.groups())
    return (a, b), (c, d)


def minor_of(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def oldest_python() -> str:
    """The venv's Python once make torch-oldest-venv finished (its stamp): a
    venv whose install broke off (a lost download, a full disk) has a Python
    but no working torch, and is named as such, not tried."""
    python = OLDEST_VENV / "bin" / "python"
    if not (OLDEST_VENV / ".installed").exists():
        why = (f"{OLDEST_VENV} did not finish installing" if python.exists()
               else f"{OLDEST_VENV} is missing")
        if os.environ.get("HARMPI_TORCH_OLDEST_REQUIRED") == "1":
            pytest.fail(f"{why}: make torch-oldest-venv installs it (in make test, its "
                        f"output is in the set-up's; disk free: {free_disk()})")
        pytest.skip(f"{why} (make torch-oldest-venv)")
    return str(python)


def free_disk() -> str:
    return f"{shutil.disk_usage(OLDEST_VENV.parent).free / 2**30:.1f} GiB"


def torch_of(python: str) -> str:
    done = subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (
        f"{python} cannot import torch (rc {done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout.strip()


def seeded_copy(dst: Path) -> Path:
    """The sources setup.py builds from, with their mtimes; harmpi's with its
    numba cache (numba keys it on a source's mtime and size), no .so."""
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dst / name)
    for package in ("harmpi", "launch", "harmpi_vllm"):
        def skip(_, names, package=package):
            return [n for n in names if n.endswith((".so", ".pyc"))
                    or (n == "__pycache__" and package != "harmpi")]
        shutil.copytree(REPO / package, dst / package, ignore=skip)
    return dst


def build_and_run(python: str, tmp_path: Path) -> dict:
    root = seeded_copy(tmp_path)
    env = job_env({"PYTHONPATH": str(root)})
    env.pop("NUMBA_CACHE_DIR", None)
    env.pop("HARMPI_NATIVE", None)
    build = subprocess.run([python, "setup.py", "-q", "build_ext", "--inplace"], cwd=root,
                           env=env, capture_output=True, text=True, timeout=600)
    out = build.stdout + build.stderr
    assert build.returncode == 0 and NOT_BUILT not in out, out[-4000:]
    assert list((root / "harmpi").glob("_C.*.so")), out[-4000:]
    run = subprocess.run([python, str(CHECK)], cwd=root, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["harmpi"].startswith(str(root)), seen
    return seen


def check_seen(seen: dict, version: str) -> None:
    assert seen["torch"] == version, seen
    assert seen["loaded"] and seen["status"] == "loaded", seen
    assert seen["built_against"] == version, seen
    assert seen["info_native"].startswith("serving harmpi.allreduce"), seen
    assert seen["allreduce"] and seen["ops"] and seen["dist"], seen
    assert seen["inplace_op_returns_x"], seen


def test_this_venv_has_the_newest_declared_torch():
    _, (cap_major, cap_minor) = declared_torch()
    assert minor_of(torch.__version__) == (cap_major, cap_minor - 1), (
        f"pyproject.toml declares torch below {cap_major}.{cap_minor}; this venv, which the "
        f"tests build against as the newest, has {torch.__version__}")


@pytest.mark.timeout(900)
def test_builds_and_runs_on_the_oldest_declared_torch(tmp_path):
    python = oldest_python()
    version = torch_of(python)
    lowest, _ = declared_torch()
    assert minor_of(version) == lowest, (
        f"{OLDEST_VENV} has torch {version}, pyproject.toml's oldest is "
        f"{lowest[0]}.{lowest[1]} (make torch-oldest-venv reinstalls it)")
    check_seen(build_and_run(python, tmp_path), version)


@pytest.mark.timeout(300)
def test_the_setup_build_runs_on_the_newest_declared_torch(tmp_path):
    """The newest: make setup's own build (pip install -e . against this
    venv's torch, in place) is the one checked here, not built again in a
    copy (that took ~56 s of make test's unit-parallel)."""
    env = job_env({"PYTHONPATH": str(REPO)})
    env.pop("NUMBA_CACHE_DIR", None)
    env.pop("HARMPI_NATIVE", None)
    run = subprocess.run([sys.executable, str(CHECK)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["harmpi"].startswith(str(REPO)), seen
    check_seen(seen, torch.__version__)
