"""Keep llvmlite's C library handle readable by vLLM's module scan.

vLLM's CPU worker, at start-up, walks every module in ``sys.modules`` and
calls ``vars(obj).get("kernel")`` on each module-level object that has a
``__dict__`` (vllm.triton_utils.dispatcher). llvmlite's ``binding.ffi.lib``
answers any attribute, ``__dict__`` included, with a wrapper of a C
function, so that scan raises AttributeError and the worker dies whenever
llvmlite was imported first - which ``import harmpi`` (numba) and
``python -m harmpi.run`` (harmpi's runner, the launcher's default) do.
:func:`install` gives that one object a class whose ``__dict__`` is an
empty mapping (a subclass with no new fields: llvmlite's own calls are
unchanged), only where vLLM is installed.
"""

from __future__ import annotations

import importlib.util
import sys

__all__ = ["install"]


def install() -> bool:
    """Apply the fix if vLLM is installed and llvmlite is loaded; True if applied."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    if ffi is None or importlib.util.find_spec("vllm") is None:
        return False
    lib = getattr(ffi, "lib", None)
    base = type(lib)
    if lib is None or getattr(base, "_harmpi_scannable", False):
        return False

    class ScannableLib(base):
        __slots__ = ()
        _harmpi_scannable = True
        __dict__ = property(lambda self: {})

    lib.__class__ = ScannableLib
    return True
