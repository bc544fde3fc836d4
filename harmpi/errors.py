"""The one exception family of harmpi.

Every error harmpi raises derives from :class:`HarmpiError`, so callers can
catch the library's failures without catching unrelated ones.
"""

__all__ = [
    "HarmpiError",
    "HarmpiArgumentError",
    "HarmpiMismatchError",
    "HarmpiTimeoutError",
    "HarmpiTransportError",
]


class HarmpiError(RuntimeError):
    """Base class of every error raised by harmpi. ``culprit``: the rank
    (in COMM_WORLD) a failed wait was waiting for, when one is known (-1
    otherwise); the giving-up rank posts it for its peers' messages."""

    def __init__(self, *args, culprit=-1):
        super().__init__(*args)
        self.culprit = culprit


class HarmpiArgumentError(HarmpiError, ValueError):
    """A caller passed something harmpi cannot use (dtype, layout, op, ...).

    Raised on the calling rank before any data moves.
    """


class HarmpiMismatchError(HarmpiError):
    """Ranks disagreed about a collective (size, dtype, op); raised on every rank."""


class HarmpiTimeoutError(HarmpiError, TimeoutError):
    """A peer did not arrive before the deadline (HARMPI_TIMEOUT_S)."""


class HarmpiTransportError(HarmpiError):
    """A cross-node transport failed or is unavailable."""
