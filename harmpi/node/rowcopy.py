"""Rows of raw memory copied by a plan: the strided copies of harmpi.logits.

A *plan* is int64[5, k], one column per segment: segment r copies
plan[SEG, r] bytes of every row from src_addr + plan[SRC_OFF, r] +
i*plan[SRC_ROW, r] to dst_addr + plan[DST_OFF, r] + i*plan[DST_ROW, r]. The
copies compile once (explicit signatures) and each call is one compiled call.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types

from ..base.control import voidptr as _voidptr
from .copy import copy_bytes

__all__ = ["SEG", "SRC_OFF", "SRC_ROW", "DST_OFF", "DST_ROW", "make_plan", "copy_rows",
           "pad_rows", "same_bytes"]

#: rows of a copy plan (int64[5, k], one column per segment; see copy_rows)
SEG, SRC_OFF, SRC_ROW, DST_OFF, DST_ROW = range(5)


def make_plan(seg, src_off, src_row, dst_off, dst_row):
    """A copy_rows plan: each argument one value per segment (or one for all)."""
    cols = np.broadcast_arrays(*(np.asarray(v, np.int64) for v in
                                 (seg, src_off, src_row, dst_off, dst_row)))
    return np.ascontiguousarray(np.stack(cols).reshape(5, -1))


@numba.njit(types.void(types.intp, types.intp, types.int64, types.Array(types.int64, 2, "C")),
            cache=True, nogil=True)
def copy_rows(src_addr, dst_addr, rows, plan):
    """For i < rows and each segment r (column of ``plan``): copy
    plan[SEG, r] bytes from src_addr + plan[SRC_OFF, r] + i*plan[SRC_ROW, r]
    to dst_addr + plan[DST_OFF, r] + i*plan[DST_ROW, r] (row-major over the
    destination). One array argument: each array numba types costs ~0.2 us."""
    for i in range(rows):
        for r in range(plan.shape[1]):
            copy_bytes(dst_addr + plan[DST_OFF, r] + i * plan[DST_ROW, r],
                            src_addr + plan[SRC_OFF, r] + i * plan[SRC_ROW, r], plan[SEG, r])


@numba.njit(types.void(types.intp, types.intp, types.intp, types.int64, types.int64, types.int64,
                       types.int64, types.intp, types.int64), cache=True, nogil=True)
def pad_rows(dst_addr, src_addr, pat_addr, rows, row_nbytes, off_nbytes, seg_nbytes, tail_addr,
             tail_nbytes):
    """dst row i = pat[:off] | src row i (seg bytes) | pat[:rest], for i < rows;
    then tail_nbytes from tail_addr after the last row."""
    rest = row_nbytes - off_nbytes - seg_nbytes
    for i in range(rows):
        d = dst_addr + i * row_nbytes
        copy_bytes(d, pat_addr, off_nbytes)
        copy_bytes(d + off_nbytes, src_addr + i * seg_nbytes, seg_nbytes)
        copy_bytes(d + off_nbytes + seg_nbytes, pat_addr, rest)
    copy_bytes(dst_addr + rows * row_nbytes, tail_addr, tail_nbytes)


@numba.njit(types.boolean(types.intp, types.intp, types.int64), cache=True, nogil=True)
def same_bytes(a_addr, b_addr, nbytes):
    """Whether nbytes bytes at a_addr and b_addr are equal."""
    if nbytes <= 0:
        return True
    a = numba.carray(_voidptr(a_addr), (nbytes,), np.uint8)
    b = numba.carray(_voidptr(b_addr), (nbytes,), np.uint8)
    for i in range(nbytes):
        if a[i] != b[i]:
            return False
    return True
