"""``harmpi.allreduce``, callable as a module too (see harmpi._callable)."""

from ._callable import make_module_callable
from .api import allreduce

make_module_callable(__name__, allreduce)
