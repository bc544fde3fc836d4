"""Deadlines of a harmpi process group: every MPI operation the backend
starts is non-blocking and completes in :func:`wait_requests`, polled under
the group's deadline; what a timed-out wait leaves behind is cancelled or
kept alive (``STRANDED``)."""

from __future__ import annotations

import os
import time

from mpi4py import MPI
from torch.distributed.constants import default_pg_timeout

__all__ = ["STRANDED", "cancel", "group_timeout", "unfinished", "wait_requests"]

#: polls of a wait before it starts yielding the core; yields before it sleeps
_SPIN_POLLS = 1000
_YIELD_S = 0.01


def wait_requests(reqs, timeout_s, on_timeout, statuses=True):
    """Wait until every MPI request in ``reqs`` completes, polling (spin,
    then yield, then short sleeps: a long wait does not burn its core), and
    call ``on_timeout(reqs)`` (which raises) once ``timeout_s`` has passed.
    The backend's one wait on MPI: every MPI operation it starts is
    non-blocking and completes here, under the deadline. Returns the
    statuses (None with ``statuses=False``: collectives need none)."""
    statuses = [MPI.Status() for _ in reqs] if statuses else None
    polls = 0
    deadline = calm = None
    pause = 1e-5
    try:
        while not MPI.Request.Testall(reqs, statuses):
            polls += 1
            if polls < _SPIN_POLLS:
                continue
            now = time.monotonic()
            if deadline is None:
                deadline, calm = now + timeout_s, now + _YIELD_S
            elif now > deadline:
                on_timeout(reqs)
                deadline = now + timeout_s  # on_timeout found everything complete after all
            if now < calm:
                os.sched_yield()
            else:
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)
    except MPI.Exception as exc:
        raise _status_error(exc, statuses) from None
    return statuses


def _status_error(exc, statuses):
    """The error a request failed with: MPI_Testall says only "an error in
    a status" (MPI_ERR_IN_STATUS); the failing request's status holds the
    real one (MPI_ERR_TRUNCATE: a message larger than the buffer). The
    returned error carries that ``status`` (its source)."""
    if exc.Get_error_class() != MPI.ERR_IN_STATUS or not statuses:
        return exc
    for status in statuses:
        code = status.Get_error()
        if code not in (MPI.SUCCESS, MPI.ERR_PENDING):
            err = MPI.Exception(code)
            err.status = status
            return err
    return exc


def unfinished(reqs):
    """Indices of the requests still incomplete after a wait timed out (the
    others complete now: Testall changes no request unless all completed)."""
    if MPI.Request.Testall(reqs):
        return []
    return [i for i, q in enumerate(reqs) if q != MPI.REQUEST_NULL and not q.Test()]


#: requests given up on (timed out or interrupted) with what their buffers point into
STRANDED = []


def cancel(reqs):
    """Cancel what is left of a wait that timed out."""
    for req in reqs:
        if req != MPI.REQUEST_NULL:
            try:
                req.Cancel()
            except MPI.Exception:
                pass  # complete by now, or a send MPI cannot cancel


def group_timeout(timeout):
    """Seconds of a timeout= given to init_process_group or new_group, or None
    when it is torch's default (given or not: torch passes its default for
    "not given"), which leaves the deadline to HARMPI_TIMEOUT_S."""
    if timeout is None or timeout == default_pg_timeout:
        return None
    return max(timeout.total_seconds(), 1e-3)  # gloo's 0 ms: every wait times out at once
