"""``harmpi.allgather`` as a module that can be called.

Research scripts write both ``import harmpi; harmpi.allgather(t)`` and
``import harmpi.allgather``. Importing a submodule binds it as the package
attribute of the same name, which would shadow the function; making the
module itself callable keeps both spellings working.
"""

import sys
import types

from .api import allgather as _allgather


class _CallableModule(types.ModuleType):
    def __call__(self, x, comm=None, dtype=None):
        return _allgather(x, comm=comm, dtype=dtype)


allgather = _allgather
__doc__ = _allgather.__doc__
sys.modules[__name__].__class__ = _CallableModule
