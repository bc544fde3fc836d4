"""``harmpi.allreduce`` as a module that can be called.

Research scripts write both ``import harmpi; harmpi.allreduce(t)`` and
``import harmpi.allreduce``. Importing a submodule binds it as the package
attribute of the same name, which would shadow the function; making the
module itself callable keeps both spellings working.
"""

import sys
import types

from .api import allreduce as _allreduce


class _CallableModule(types.ModuleType):
    # a staticmethod __call__ is invoked without the module as first
    # argument and without an extra Python frame on the hot path
    __call__ = staticmethod(_allreduce)


allreduce = _allreduce
__doc__ = _allreduce.__doc__
sys.modules[__name__].__class__ = _CallableModule
