"""The launcher's errors.

Every mistake the launcher detects before starting anything is a
:class:`LaunchError` whose message says what is wrong and how to fix it; the
CLI turns it into ``Error: <message>`` and a non-zero exit, never a traceback.

The launcher deliberately does not import :mod:`harmpi` (it must start fast and
work before the library's dependencies are importable), so these errors do not
derive from ``harmpi.errors.HarmpiError``.
"""

__all__ = ["LaunchError", "MpiNotFoundError", "TooManyRanksError"]


class LaunchError(ValueError):
    """The requested launch cannot work (bad option combination, too many ranks...)."""


class MpiNotFoundError(LaunchError):
    """No usable ``mpirun``/``mpiexec`` was found (an environment problem, not a usage one)."""


class TooManyRanksError(LaunchError):
    """More ranks than slots without ``--oversubscribe`` (``info`` shows the plan anyway)."""
