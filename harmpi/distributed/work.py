"""The work objects a harmpi process group returns (torch's ``dist.Work``):
one already done, a started split-phase all-reduce, and MPI requests in
flight. Completing one clears the group's pending collective (``pg._pending``:
a group holds at most one started collective; harmpi.distributed.group)."""

from __future__ import annotations

import torch.distributed as dist
from mpi4py import MPI
from torch.futures import Future

from ..errors import HarmpiError
from ..runtime.context import AUTO_CODE
from .waits import STRANDED

__all__ = ["DONE", "DoneWork", "MpiWork", "SplitWork"]


class DoneWork(dist._Work):
    """A collective that completed before its call returned."""

    def __init__(self, result=None):
        super().__init__()
        self._result = result

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def result(self):
        return self._result

    def get_future(self):
        fut = Future()
        fut.set_result(self._result)
        return fut


#: what a synchronous call returns (dist.all_reduce only waits on it)
DONE = DoneWork()


class _OnceWork(dist._Work):
    """A collective in flight that completes once, in the caller's thread:
    the first wait() (or get_future()) runs the subclass's ``_run`` (its
    finish); later calls return, or
    raise the same error again. Completing clears the group's pending slot."""

    def __init__(self, pg):
        super().__init__()
        self._pg = pg
        self._error = None
        self._done = False

    def _complete(self):
        if self._done:
            if self._error is not None:
                raise self._error
            return
        self._done = True
        if self._pg._pending is self:
            self._pg._pending = None
        self._run()

    def wait(self, timeout=None):
        self._complete()
        return True

    def is_completed(self):
        return self._done

    def is_success(self):
        return self._done and self._error is None

    def exception(self):
        return self._error

    def get_future(self):
        # completing the future means finishing the collective here
        self._complete()
        fut = Future()
        fut.set_result(self.result())
        return fut


class SplitWork(_OnceWork):
    """A started split-phase all-reduce; wait() completes it (once): the
    context's second compiled half, then the AVG's division."""

    def __init__(self, pg, finish, tensor, addr, n, fmt, scale):
        super().__init__(pg)
        self._finish = finish
        self._tensor = tensor      # keeps the memory alive until the finish
        self._args = (addr, n, fmt)
        self._scale = scale

    def _run(self):
        ctx = self._pg._ctx
        ctx.split_pending = None
        addr, n, fmt = self._args
        rc = self._finish(ctx.ctl, addr, n, fmt)
        if rc:
            try:
                ctx.raise_status(rc, addr, n, fmt, AUTO_CODE | fmt, "allreduce (async)")
            except HarmpiError as exc:
                self._error = exc
                raise
        if self._scale is not None:
            self._tensor.div_(self._scale)

    def result(self):
        return [self._tensor]


class MpiWork(_OnceWork):
    """MPI requests in flight (a collective or a message); wait() completes
    them under the deadline, then runs ``finish(statuses)`` (the copy-out), once.
    ``keep``: what the requests' buffers point into (tensors made by the
    call, buffers made from addresses), kept alive until they complete."""

    def __init__(self, pg, reqs, finish, result, what, peer=None, keep=None, nbytes=None):
        super().__init__(pg)
        self._reqs = reqs
        self._keep = keep
        self._finish = finish
        self._result = result
        self._what = what
        self._peer = peer           # a message's peer (group rank); None: a collective
        self._nbytes = nbytes       # a receive's buffer size (its truncation error says it)
        self._source = -1

    def _run(self):
        try:
            statuses = self._pg._wait(self._reqs, self._what, self._peer, self._nbytes)
            self._source = statuses[0].Get_source() if statuses else -1
            if self._finish is not None:
                self._finish(statuses)
        except HarmpiError as exc:
            self._error = exc
            self._strand()
            raise
        except KeyboardInterrupt:
            self._error = HarmpiError(f"harmpi backend: {self._what} was interrupted (Ctrl-C)")
            self._strand()
            raise
        self._keep = None

    def _strand(self):
        """Requests given up on stay with MPI, which may still write into
        their buffers: keep both alive for the life of the process."""
        if not MPI.Request.Testall(self._reqs):
            STRANDED.append((self._reqs, self._keep, self._result))

    def result(self):
        return self._result

    def _source_rank(self):
        """The group rank a receive from any source heard (dist.recv(src=None))."""
        self._complete()
        return self._source
