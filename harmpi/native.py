"""The native entry point of ``harmpi.allreduce(t)`` (``_native.cpp``).

Why: on one node a 10 KB all-reduce takes ~3 us, and Python spent ~0.7 us of
it reaching the kernel (torch attribute calls at ~50 ns each, numba's
argument unboxing). The C++ module checks the tensor on its C++ side and
calls the numba kernel through a function pointer in ~0.05 us.

What it serves: the world communicator's context when its default entry is
compiled (one node, or one rank; harmpi.context), torch tensors only. It
calls that entry, the one every path calls; everything else, and every
tensor it declines, takes the Python path, which has the same checks and
raises the errors. The control block's ``gate`` field is 1 while the module
may use the context; Context clears it when the context breaks or is freed.
The dtype -> format pairs come from harmpi.dtypes at attach time (the C++
side has no table of its own).

Building: ``python -m launch.build_native`` (``make`` runs it) compiles the module
with the system C++ compiler against the installed torch's headers into
``harmpi/_native_build/<tag>/``; the tag hashes the source, the torch
version and the Python ABI, so a changed torch or source is never loaded
stale. Nothing is compiled at run time: without a build (no compiler, or
``HARMPI_NATIVE=0``, i.e. ``Config(native=False)``) the API simply keeps
the Python path, and
``harmpi.info()["native"]`` says why.

This module imports torch (through the C++ module), so only harmpi.torch
and the API's torch branch use it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import subprocess
import sysconfig
from pathlib import Path

from . import control

log = logging.getLogger("harmpi")

__all__ = ["SOURCE", "build", "load", "attach", "detach", "status"]

SOURCE = Path(__file__).with_name("_native.cpp")
BUILD_ROOT = Path(__file__).with_name("_native_build")
MODULE_NAME = "_harmpi_native"

#: compiler flags beyond include and library paths (torch 2.13's headers use C++20)
CXXFLAGS = ("-O2", "-fPIC", "-shared", "-std=c++20")


def _tag() -> str:
    import torch

    h = hashlib.sha256()
    h.update(SOURCE.read_bytes())
    h.update(" ".join(CXXFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(str(sysconfig.get_config_var("EXT_SUFFIX")).encode())
    return h.hexdigest()[:16]


def _library_path() -> Path:
    return BUILD_ROOT / _tag() / (MODULE_NAME + sysconfig.get_config_var("EXT_SUFFIX"))


def build() -> Path:
    """Compile the module for the installed torch (idempotent); its path.
    Raises RuntimeError with the compiler's output when it cannot."""
    import torch
    from torch.utils.cpp_extension import include_paths

    out = _library_path()
    if out.exists():
        return out
    cxx = os.environ.get("CXX", "g++")
    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    tmp = out.with_suffix(".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [cxx, *CXXFLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           *[f"-I{p}" for p in include_paths()], f"-I{sysconfig.get_paths()['include']}",
           str(SOURCE), "-o", str(tmp), f"-L{torch_lib}", "-ltorch_python", "-ltorch",
           "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_lib}"]
    log.debug("building the native entry point: %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise RuntimeError(f"no C++ compiler ({cxx}): {exc}") from exc
    if proc.returncode != 0:
        raise RuntimeError(f"{cxx} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    os.replace(tmp, out)  # atomic: a concurrent loader never sees half a file
    return out


_loaded = None
_status = "not loaded yet"


def load():
    """The compiled module, or None (status() says why). Never compiles."""
    global _loaded, _status
    if _loaded is not None:
        return _loaded
    try:
        path = _library_path()
    except Exception as exc:  # no torch, unreadable source
        _status = f"unavailable ({exc})"
        return None
    if not path.exists():
        _status = "not built (python -m launch.build_native builds it; make does)"
        return None
    try:
        spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except Exception as exc:
        _status = f"failed to load {path.name}: {exc}"
        return None
    _loaded = mod
    _status = "loaded"
    return mod


def attach(ctx):
    """Serve the context ``ctx`` (its default entry must be compiled: a
    non-zero ``ctx.entry_cfunc``); returns the module's ``allreduce(t)``,
    or None if the module is not available."""
    from .torch import FORMAT_IDS  # noqa: PLC0415 - torch is loaded by now

    mod = load()
    if mod is None:
        return None
    mod.attach(int(ctx.ctl.ctypes.data), control.offset("gate"), int(ctx.entry_cfunc),
               tuple(FORMAT_IDS.items()))
    ctx.ctl[0]["gate"] = 1
    return mod.allreduce


def detach() -> None:
    """Serve no context (before its control array goes away)."""
    if _loaded is not None:
        _loaded.attach(0, 0, 0, ())


def status() -> str:
    return _status
