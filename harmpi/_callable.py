"""Modules that can be called like the function they are named after.

Research scripts write both ``import harmpi; harmpi.allreduce(t)`` and
``import harmpi.allreduce``. Importing a submodule binds it as the package
attribute of the same name, which would shadow the function; making the
module itself callable keeps both spellings working.
"""

import sys
import types


def make_module_callable(module_name, fn):
    """Let ``sys.modules[module_name](...)`` call ``fn(...)``."""

    class _CallableModule(types.ModuleType):
        # a staticmethod __call__ is invoked without the module as first
        # argument and without an extra Python frame on the hot path
        __call__ = staticmethod(fn)

    module = sys.modules[module_name]
    module.__class__ = _CallableModule
    module.__doc__ = fn.__doc__
