"""The node arena: one MPI shared-memory window per node communicator.

Layout (offsets from the window base; L ranks on the node)::

    [0, L*64)                 flag lines, one 64-byte line per local rank
    [L*64, L*64 + 512)        copy-mode table (copytune: one word per size
                              bucket, written by local rank 0)
    [T, T + L*64)             stamp lines, one per local rank, T = L*64 + 512
                              (harmpi.profile; written only while profiling)
    [Z, Z + L*64)             sleeper lines, one per local rank, Z = T + L*64:
                              word 0 counts the ranks asleep on that rank's
                              epoch word (harmpi.base.sync's futex waits)
    [F, F + 2*L*S)            payload slots, F = flags rounded up to 4 KiB,
                              slot(p, l) = F + (p*L + l) * S

where S = ``slot_nbytes`` and p = the parity of the collective step. Slots
of one parity are contiguous, so a step sees them as one C-contiguous
(L, S/itemsize) array: row l is rank l's slot.

Flag line of rank l, int64 words:

    0      EPOCH    last published phase number (monotonic, starts at 0);
                    ABANDONED (-1) once a rank gave up on the node's collective
    1, 2   meta of parity 0: total bytes of the collective, kind code
    3, 4   meta of parity 1
    5, 6   step status of parity 0, 1 (non-zero: this rank's part failed)
    7      CULPRIT  after giving up: the rank it waited for (-1: unknown)

Stamp line of rank l, int64 words, by the parity p of the epoch they go
with: word 3p the epoch (the tag), 3p+1 an arrival time (monotonic ns),
3p+2 the communicator rank it is of (-1: none). A rank writes them before
it publishes that epoch and its peers read them after their wait for it;
it writes the same parity again only two epochs later, after every peer
has published the epoch between (so has read them).

The meta words are double-buffered like the slots: a rank may write the
next step's meta while a slow peer still checks this step's.

The window is allocated once per communicator and freed by
:meth:`Arena.free` (``comm.Free()``, ``harmpi.finalize()``, or at the end,
:func:`free_remaining`); MPI unlinks its backing segment then, so nothing
remains in /dev/shm.

Windows still allocated at the end are freed by :func:`free_remaining`, in
the order they were allocated, not left to MPI_Finalize: Open MPI frees
leftover windows in the order of its handle table, whose freed entries are
reused, so two ranks that share two windows can reach them in opposite
orders, and each window's free waits in a barrier for the other rank (seen
at 3 ranks with overlapping groups: every rank in MPI_Finalize forever).
Allocation order is the same on every rank that shares two windows (each
allocation waits for all of its ranks), so the frees meet.
"""

from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

from .copytune import TABLE_NBYTES
from .topology import barrier_polled

__all__ = ["Arena", "free_remaining", "FLAG_LINE_NBYTES", "W_EPOCH", "W_META", "W_STATUS",
           "W_CULPRIT", "STAMP_WORDS"]

FLAG_LINE_NBYTES = 64
W_EPOCH = 0   # word index of the epoch in a flag line
W_META = 1    # first meta word; parity p uses words W_META + 2p, W_META + 2p + 1
W_STATUS = 5  # parity p uses word W_STATUS + p
W_CULPRIT = 7  # written before the epoch word turns ABANDONED (until then: node.flags.ENTERED_BASE)
STAMP_WORDS = 3  # words per parity in a stamp line: epoch, time, rank
_PAGE = 4096

#: windows allocated and not yet freed, in allocation order (free_remaining)
_LIVE = []


class Arena:
    """Shared flags and double-buffered slots of one node (collective over ``node_comm``)."""

    def __init__(self, node_comm, slot_nbytes: int, timeout_s: float):
        self.local_size = node_comm.Get_size()
        self.local_rank = node_comm.Get_rank()
        self.slot_nbytes = int(slot_nbytes)
        self.tune_offset = self.local_size * FLAG_LINE_NBYTES
        self.stamps_offset = self.tune_offset + TABLE_NBYTES
        self.sleepers_offset = self.stamps_offset + self.local_size * FLAG_LINE_NBYTES
        lines_end = self.sleepers_offset + self.local_size * FLAG_LINE_NBYTES
        self.flags_nbytes = -(-lines_end // _PAGE) * _PAGE
        self.nbytes = self.flags_nbytes + 2 * self.local_size * self.slot_nbytes
        self._win = MPI.Win.Allocate_shared(
            self.nbytes if self.local_rank == 0 else 0, 1, comm=node_comm)
        buf, _ = self._win.Shared_query(0)
        self.mem = np.frombuffer(buf, dtype=np.uint8, count=self.nbytes)
        self.base_addr = self.mem.ctypes.data
        self.flags_addr = self.base_addr
        self.slots_addr = self.base_addr + self.flags_nbytes
        self.tune_addr = self.base_addr + self.tune_offset
        self.stamps_addr = self.base_addr + self.stamps_offset
        self.sleepers_addr = self.base_addr + self.sleepers_offset
        # The window is not guaranteed zeroed: the owner clears the flags and
        # the barrier orders that before any rank's first wait.
        self._win.Lock_all()
        if self.local_rank == 0:
            self.mem[: self.flags_nbytes] = 0
        # Map every page of the window in this process now, not in the first
        # collectives (a first 1 MB call took a minor fault per 4 KiB page of
        # the slot it used: ~256 per parity, milliseconds). Each rank writes
        # its own slots first, so a page lands on its writer's NUMA node
        # (first touch), and reads the rest after the barrier. A slot's
        # contents mean nothing until its owner publishes.
        for parity in (0, 1):
            _touch(self.slot(parity, self.local_rank), write=True)
        self._win.Sync()
        barrier_polled(node_comm, timeout_s, "setting up the node's shared memory")
        self._win.Sync()
        self._win.Unlock_all()
        _touch(self.mem, write=False)
        self._pid = os.getpid()
        _LIVE.append(self)

    def slot_offset(self, parity: int, local_rank: int) -> int:
        return self.flags_nbytes + (parity * self.local_size + local_rank) * self.slot_nbytes

    def slot(self, parity: int, local_rank: int, dtype=np.uint8) -> np.ndarray:
        off = self.slot_offset(parity, local_rank)
        return self.mem[off: off + self.slot_nbytes].view(dtype)

    def tune_table(self) -> np.ndarray:
        """int64 view of the copy-mode table (see copytune)."""
        return self.mem[self.tune_offset: self.tune_offset + TABLE_NBYTES].view(np.int64)

    def flags(self) -> np.ndarray:
        """(L, 8) int64 view of the flag lines (for diagnostics and tests)."""
        lines = self.mem[: self.local_size * FLAG_LINE_NBYTES].view(np.int64)
        return lines.reshape(self.local_size, 8)

    @property
    def freed(self) -> bool:
        return self._win is None

    def free(self):
        """Release the window (collective over the node communicator)."""
        if self._win is not None:
            self.mem = None
            self._win.Free()
            self._win = None
        if self in _LIVE:
            _LIVE.remove(self)


def _touch(buf, write):
    """Fault in every page of the uint8 array ``buf``: one access per 4 KiB
    (any 4 KiB window holds one of them) and one at the end (a partial last page)."""
    if buf.size == 0:
        return 0
    if write:
        buf[::_PAGE] = 0
        buf[-1] = 0
        return 0
    return int(buf[::_PAGE].max()) | int(buf[-1])  # (the value only makes the reads)


def free_remaining():
    """Free every window still allocated, in allocation order (collective,
    blocking, as MPI_Finalize's own free of them would be; see the module
    docstring for why not leave them to it). For the end of the process
    only: the windows of broken contexts too, whose memory nothing may read
    afterwards. A forked child frees nothing (the windows are its parent's)."""
    while _LIVE:
        arena = _LIVE.pop(0)
        if arena._pid == os.getpid() and arena._win is not None:
            arena.mem = None
            arena._win.Free()
            arena._win = None
