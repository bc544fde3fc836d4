"""The native part of harmpi: the torch extension ``harmpi._C`` (``_native.cpp``).

Why: on one node a 10 KB all-reduce takes ~3 us, and Python spent ~0.7 us of
it reaching the kernel (torch attribute calls at ~50 ns each, numba's
argument unboxing). The C++ module checks the tensor on its C++ side and
calls the numba kernel through a function pointer in ~0.05 us.

What it serves: the world communicator's context when its default entry is
compiled (one node, or one rank; harmpi.runtime.context), torch tensors only, three
ways: ``allreduce(t)``, the hot path of ``harmpi.allreduce(t)`` (it returns
-1 for a tensor it does not take, and the API goes on on its Python path),
and two operators, which :func:`load` registers:

- ``torch.ops.harmpi.all_reduce_(t, group="")``: in place, returns ``t``;
- ``torch.ops.harmpi.all_reduce(x, group="")``: out of place, returns a new
  contiguous tensor holding the sum and leaves ``x`` as it was (any
  layout), the form a compiled graph that wants a value takes;
- ``torch.ops.harmpi.all_reduce_inplace(t, group="")``: in place, returns
  nothing, the form a compiled graph that mutates takes (vLLM's plug-in:
  vLLM's own shm op is written so). torch.compile functionalizes it
  generically and inductor sums the graph's buffer where it lies.

``group`` "" is MPI.COMM_WORLD; any other name must first be bound to a
communicator with :func:`name_group`. The operators' CPU kernels call the
entry themselves when they can (world, served context) and otherwise hand
the tensor to :func:`_fallback`: the Python path of ``harmpi.allreduce(t,
comm=...)`` (which also makes the context on first use), or the same
HarmpiError ``harmpi.allreduce(t)`` raises. Their Meta kernels give
torch.compile and FakeTensor the shapes.

torch.compile. The in-place operator has a Functionalize kernel of its own:
it runs the out-of-place operator and makes the result the new value of
``t``, as torch's own in-place ops are functionalized. torch's generic
route for custom ops tagged ``inplace`` (auto_functionalized_v2, torch
2.13) returns the op's result as a value of its own, no longer an alias of
``t``: after ``y = all_reduce_(x)`` an in-place update through ``y`` was not
seen through ``x`` (nor the reverse) in compiled code, though eager code
sees it (``y is x``): the compiled code read stale values (tests/test_native.py
reproduces it at one rank with no MPI at all). Inside vLLM's compiled
model the operator had sampled tokens other than Gloo's.

The control block's ``gate`` field is 1 while the module may use the
context; Context clears it when the context breaks or is freed. The
dtype -> format pairs come from harmpi.base.dtypes at attach time (the C++ side
has no table of its own).

Building: at install, by setup.py with torch's extension tooling, when torch
is importable at build time and a C++ compiler works (``pip install -e .
--no-build-isolation``, which ``make`` runs). The module records the torch
version it was built against; :func:`load` reads it from the file before
loading and refuses a module built against another torch. Nothing is
compiled at run time: without the module (not built, or built for another
torch), or with ``HARMPI_NATIVE=0`` (``Config(native=False)``), the API keeps
its Python path, there is no operator, and ``harmpi.info()["native"]`` says
why.

This module imports torch, so only harmpi.runtime.torchbuf's users (the API's torch
branch, harmpi.distributed) use it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import mmap
import sys
from pathlib import Path

from ..base import control, kind
from ..errors import HarmpiArgumentError

log = logging.getLogger("harmpi")

__all__ = ["MODULE", "load", "attach", "alltoall", "detach", "status", "built_against",
           "name_group", "unname_group", "checkout_root", "rebuild_advice"]

MODULE = "harmpi._C"
#: what precedes the torch version in the module's file (_native.cpp)
VERSION_MARKER = b"harmpi-built-against-torch="
#: _status before load() ran (status() then looks at the file, without loading)
NOT_YET = "not loaded yet"

_loaded = None
_status = NOT_YET
#: group name -> communicator, for the operators' ``group`` argument
_groups = {}
#: (allreduce, native_failed) of harmpi.api, the operators' Python path: given
#: by :func:`use_python_path` when harmpi.api loads (this module sits below
#: the api and does not import it)
_python_path = None


def use_python_path(allreduce, failed) -> None:
    """Where :func:`_fallback` goes: ``allreduce(t, comm=None)`` runs
    harmpi.allreduce's Python path, ``failed(t, rc)`` raises an entry's
    failure as harmpi.allreduce(t) raises it. harmpi.api calls this once."""
    global _python_path
    _python_path = (allreduce, failed)


def built_against(path) -> str | None:
    """The torch version the module file at ``path`` was built against (read
    from the file, without loading it), or None if it records none."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        start = data.find(VERSION_MARKER)
        if start < 0:
            return None
        start += len(VERSION_MARKER)
        end = data.find(b"\0", start, start + 256)
        return data[start:end].decode("ascii", "replace") if end > 0 else None


def _module_file():
    """The module's file, or None if it was not built."""
    spec = importlib.util.find_spec(MODULE)
    return spec.origin if spec is not None else None


def checkout_root(package_dir: Path | None = None) -> Path | None:
    """The source checkout harmpi runs from (a plain or editable ``pip install
    -e .``), or None when it runs from an installed copy (site-packages)."""
    package_dir = Path(__file__).resolve().parents[1] if package_dir is None else package_dir
    root = package_dir.parent
    if (root / "setup.py").is_file() and (root / "pyproject.toml").is_file():
        return root
    return None


def rebuild_advice(root: Path | None = None, python: str = sys.executable) -> str:
    """How to (re)build the module, for the way harmpi is installed here (pure
    given ``root``, the checkout or None for an installed copy)."""
    if root is not None:
        return (f"to build it: cd {root} && {python} -m pip install -e . --no-build-isolation "
                "(with torch installed first; make setup does it)")
    return (f"to build it: reinstall harmpi from its source with this torch installed: "
            f"{python} -m pip install --no-deps --no-build-isolation --force-reinstall "
            "/path/to/harmpi-checkout (a wheel brings the module of the torch it was built with)")


def _not_built(root: Path | None) -> str:
    return (f"not built: there is no {MODULE} (it is built at install when torch and a C++ "
            f"compiler are present; without it harmpi.allreduce keeps its Python path); "
            f"{rebuild_advice(root)}")


def _refusal():
    """Why the built module must not be loaded (None: it may)."""
    try:
        import torch
    except ImportError as exc:
        return f"unavailable (torch is not importable: {exc})"
    path = _module_file()
    if path is None:
        return _not_built(checkout_root())
    built = built_against(path)
    if built != torch.__version__:
        return (f"not loaded: {MODULE} was built against torch {built or '(unknown)'}, this is "
                f"torch {torch.__version__}; {rebuild_advice(checkout_root())}")
    return None


def load():
    """The module, loaded (registering torch.ops.harmpi's three operators), or None
    (status() says why). Idempotent; never compiles."""
    global _loaded, _status
    if _loaded is not None:
        return _loaded
    why = _refusal()
    if why is not None:
        _status = why
        return None
    try:
        mod = importlib.import_module(MODULE)
    except ImportError as exc:
        _status = f"failed to load {MODULE}: {exc}"
        return None
    mod.attach(0, 0, 0, (), _fallback)  # the operator works before any context exists
    _loaded = mod
    _status = "loaded"
    return mod


def name_group(name: str, comm) -> None:
    """Bind ``name`` to the MPI communicator ``comm`` for the operators'
    ``group`` argument: ``torch.ops.harmpi.all_reduce(x, name)`` then sums
    over ``comm``'s ranks. Every rank of ``comm`` binds the same name. A name
    may be bound again (to the same or another communicator); "" is the
    world and cannot be bound."""
    if not isinstance(name, str) or not name:
        raise HarmpiArgumentError(
            f"harmpi.native.name_group: the name must be a non-empty str, not {name!r} "
            "(\"\" is MPI.COMM_WORLD)")
    _groups[name] = comm


def unname_group(name: str) -> None:
    """Forget ``name`` (its communicator is not freed: it is the caller's)."""
    _groups.pop(name, None)


def _fallback(t, rc, group=""):
    """The operators where their kernel did not complete the all-reduce:
    rc > 0 is the entry's failure, raised as harmpi.allreduce(t) raises it;
    -1 (no world context served yet, a tensor the kernel does not take, or a
    named group) runs harmpi.allreduce(t, comm=...), which makes the
    context, checks the tensor and raises what it raises."""
    allreduce, failed = _python_path

    if rc > 0:
        failed(t, rc)  # raises
    elif not group:
        allreduce(t)
    else:
        comm = _groups.get(group)
        if comm is None:
            raise HarmpiArgumentError(
                f"torch.ops.harmpi.all_reduce: no communicator is named {group!r} on this rank; "
                "bind it first with harmpi.native.name_group(name, comm) (known: "
                f"{sorted(_groups) or 'none'})")
        allreduce(t, comm=comm)


def attach(ctx):
    """Serve the context ``ctx`` (its default entry compiled: a non-zero
    ``ctx.entry_cfunc``, or its all-to-all: ``ctx.alltoall.cfunc``; the
    module declines an all-reduce without an entry); returns the module's
    ``allreduce(t)``, or None if the module is not available."""
    from .torchbuf import FORMAT_IDS  # noqa: PLC0415 - torch is loaded by now

    mod = load()
    if mod is None:
        return None
    mod.attach(int(ctx.ctl.ctypes.data), control.offset("gate"), int(ctx.entry_cfunc),
               tuple(FORMAT_IDS.items()), _fallback)
    # one node, and 2^k nodes over the tcp rail: the all-to-all is compiled
    # too (a module built from an older _native.cpp has no attach_alltoall:
    # the API keeps its Python path)
    if hasattr(mod, "attach_alltoall"):
        from ..algorithms.alltoall import ALLTOALL_CFUNC  # noqa: PLC0415

        entry = ALLTOALL_CFUNC if ctx.alltoall is None else getattr(ctx.alltoall, "cfunc", 0)
        coll_shift, _ = kind.field("coll")
        digest_shift, digest_width = kind.field("digest")
        mod.attach_alltoall(int(entry), ctx.topo.size, kind.COLL_ALLTOALL << coll_shift,
                            digest_shift, (1 << digest_width) - 1)
    # one node: the allgather step is compiled too (node.GATHER_STEP)
    if hasattr(mod, "attach_allgather"):
        from .. import node  # noqa: PLC0415

        _, digest_width = kind.field("digest")
        entry = node.GATHER_CFUNC if ctx.gather is node.GATHER_STEP else 0
        mod.attach_allgather(int(entry), ctx.topo.size, (1 << digest_width) - 1)
    ctx.ctl[0]["gate"] = 1
    return mod.allreduce


def alltoall():
    """The module's ``alltoall(t)`` (harmpi.alltoall(t)'s hot path; it
    declines with -1 while no context is served), or None if not loaded."""
    return getattr(_loaded, "alltoall", None)


def allgather():
    """The module's ``allgather(t, out)`` (harmpi.allgather(t)'s hot path at dim 0;
    it declines with -1 while no one-node context is served), or None if not
    loaded."""
    return getattr(_loaded, "allgather", None)


def detach() -> None:
    """Serve no context (before its control array goes away); the operator
    then takes the Python path."""
    if _loaded is not None:
        _loaded.attach(0, 0, 0, (), _fallback)


def status() -> str:
    """What is true of the module now: "loaded"; why load() refused it; or,
    before any load(), whether it is built (read from its file, without
    importing torch or the module)."""
    if _loaded is not None or _status != NOT_YET:
        return _status
    path = _module_file()
    if path is None:
        return _not_built(checkout_root())
    built = built_against(path) or "(unknown)"
    return (f"built (against torch {built}), not loaded yet: it loads when this process first "
            "passes a torch tensor to harmpi and the world communicator runs on one node")
