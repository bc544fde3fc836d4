"""Which optional packages this environment has, found without importing
them (importing torch or harmpi's kernels takes seconds)."""

import importlib.util
from pathlib import Path

__all__ = ["HAVE_TORCH", "HAVE_HARMPI"]

HAVE_TORCH = importlib.util.find_spec("torch") is not None
_HARMPI_SPEC = importlib.util.find_spec("harmpi")
#: harmpi importable as a package with its API (not a stray directory)
HAVE_HARMPI = _HARMPI_SPEC is not None and (Path(_HARMPI_SPEC.origin).parent / "api.py").exists()
