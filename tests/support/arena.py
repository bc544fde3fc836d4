"""A one-rank arena in private memory: the node steps and the copy tuner
run on it without MPI or a shared window (tests/test_core_units.py,
test_copytune.py)."""

import numpy as np

__all__ = ["FakeArena"]


class FakeArena:
    """A private arena for one rank (L = 1): the node steps without MPI."""

    def __init__(self, slot_nbytes=4096):
        self.mem = np.zeros(4096 + 2 * slot_nbytes, np.uint8)
        self.flags_addr = self.mem.ctypes.data
        self.slots_addr = self.flags_addr + 4096
        self.slot_nbytes = slot_nbytes
        self.local_size, self.local_rank = 1, 0
        self.tune_addr = self.flags_addr + 64

    def tune_table(self):
        return self.mem[64:64 + 512].view(np.int64)
