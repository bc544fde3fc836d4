"""Output of harmpi's command-line modules (``python -m harmpi.report``,
``python -m harmpi.precompile``): the library itself never prints, it logs;
these modules log their results to the logger ``harmpi.cli``, which writes
each message as one line to the standard output current at the time (so a
caller that swaps sys.stdout, pytest's capture say, gets it)."""

from __future__ import annotations

import logging
import sys

__all__ = ["log"]


class _Stdout(logging.Handler):
    def emit(self, record):
        try:
            sys.stdout.write(self.format(record) + "\n")
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - logging's own convention
            self.handleError(record)


log = logging.getLogger("harmpi.cli")
if not any(isinstance(h, _Stdout) for h in log.handlers):
    log.addHandler(_Stdout())
log.setLevel(logging.INFO)
log.propagate = False  # a CLI's result, not a library message for the "harmpi" handlers
