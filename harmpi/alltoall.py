"""``harmpi.alltoall``, callable as a module too (see harmpi._callable)."""

from ._callable import make_module_callable
from .api import alltoall

make_module_callable(__name__, alltoall)
