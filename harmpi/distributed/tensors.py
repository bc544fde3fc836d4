"""The tensors torch passes to a harmpi process group: the argument checks
every call makes before anything moves, and the tensors' memory as the
buffers MPI reads and writes (no copy)."""

from __future__ import annotations

import math

import torch
from mpi4py import MPI

from ..errors import HarmpiArgumentError
from .tables import FLOATS

__all__ = ["RowUnits", "as_units", "bytes_of", "columns", "contiguous_cpu", "copy_back",
           "cpu_tensor", "float_tensor", "is_async", "last_units", "mpi_buffer", "one_tensor",
           "split_bytes", "user_tag"]

_WORLD = MPI.COMM_WORLD


def one_tensor(tensors, what):
    """The one tensor of a list torch passes (one device per process)."""
    if len(tensors) != 1:
        raise HarmpiArgumentError(
            f"harmpi backend: {what} takes one tensor per rank (got {len(tensors)}); "
            "harmpi serves one CPU device per process")
    return tensors[0]


def float_tensor(t, what):
    """``t``, a CPU tensor of a dtype harmpi reduces, or HarmpiArgumentError."""
    if t.dtype not in FLOATS:
        raise HarmpiArgumentError(
            f"harmpi backend: {what} of {t.dtype} is not supported; it reduces and gathers "
            "torch.bfloat16, float16, float32 and float64 (use a gloo group, "
            "dist.new_group(backend='gloo'), for other dtypes)")
    if not t.is_cpu:
        raise HarmpiArgumentError(f"harmpi backend: {what}: tensor is on {t.device}; harmpi "
                                  "works on CPU tensors")
    return t


def contiguous_cpu(t, what):
    """``t``, a contiguous CPU tensor (an output written in place), or HarmpiArgumentError."""
    if not t.is_cpu:
        raise HarmpiArgumentError(f"harmpi backend: {what}: tensor is on {t.device}; harmpi "
                                  "works on CPU tensors")
    if not t.is_contiguous():
        raise HarmpiArgumentError(f"harmpi backend: {what}: tensor of shape {tuple(t.shape)} is "
                                  "not contiguous")
    return t


def cpu_tensor(t, what):
    """``t``, a CPU tensor, or HarmpiArgumentError."""
    if not t.is_cpu:
        raise HarmpiArgumentError(f"harmpi backend: {what}: tensor is on {t.device}; harmpi "
                                  "works on CPU tensors")
    return t


def is_async(opts):
    """Whether torch asked for a work object to wait on later (``async_op=True``)."""
    return bool(opts is not None and getattr(opts, "asyncOp", False))


def copy_back(buf, t):
    """What completes an op that worked on a contiguous copy of ``t`` (None: no copy)."""
    if buf is t:
        return None
    return lambda _statuses: t.copy_(buf)


def split_bytes(t, splits, n, which):
    """Bytes to or from each rank of all_to_all_single: rows of dim 0."""
    if t.dim() == 0:
        raise HarmpiArgumentError(f"harmpi backend: all_to_all_single: the {which} needs at "
                                  "least one dimension")
    rows = t.size(0)
    if not splits:
        if rows % n:
            raise HarmpiArgumentError(
                f"harmpi backend: all_to_all_single: the {which} has {rows} rows, not a "
                f"multiple of the group size {n}; pass split sizes")
        return [t.nbytes // n] * n
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    splits = list(splits)
    if len(splits) != n or sum(splits) != rows or min(splits) < 0:
        raise HarmpiArgumentError(
            f"harmpi backend: all_to_all_single: {which} split sizes {splits} must be {n} "
            f"counts that add up to its {rows} rows")
    return [s * row_bytes for s in splits]


def user_tag(tag):
    """A send/recv tag MPI accepts, or HarmpiArgumentError."""
    upper = _WORLD.Get_attr(MPI.TAG_UB)
    if not 0 <= tag <= upper:
        raise HarmpiArgumentError(f"harmpi backend: tag {tag} is outside MPI's 0..{upper}")
    return tag


def bytes_of(t):
    """The tensor's memory as a writable numpy byte view (any dtype, no copy)."""
    return t.view(-1).view(torch.uint8).numpy() if t.numel() else bytearray(0)


def mpi_buffer(t):
    """A contiguous tensor's memory as an MPI buffer (no copy; ~10x cheaper
    than bytes_of's views). It holds no reference to ``t``: the caller
    keeps ``t`` alive until the request completes (the work object's ``keep``)."""
    nbytes = t.nbytes
    return MPI.buffer.fromaddress(t.data_ptr(), nbytes) if nbytes else bytearray(0)


def as_units(head, t):
    """The bytes ``head`` (uint8), then ``t``'s, zero-padded to an even
    count, in a new (1, m) bfloat16 tensor: how the backend hands raw bytes
    of any dtype to harmpi's own collectives, which move 16-bit units
    without reading them (gathered back, they are the same bytes)."""
    nbytes = t.numel() * t.element_size()
    total = head.numel() + nbytes
    buf = torch.zeros(total + total % 2, dtype=torch.uint8)
    buf[:head.numel()] = head
    if nbytes:
        buf[head.numel():total] = t.contiguous().view(-1).view(torch.uint8)
    return buf.view(torch.bfloat16).view(1, -1)


class RowUnits:
    """The rows (dim 0) of an all-to-all's contiguous input ``src`` and
    output ``dst`` of any dtype as harmpi's all-to-all takes them: bfloat16
    tensors of shape (rows, units, 1, ..., 1), one row's bytes in ``units``
    16-bit units (a row of an odd byte count padded with a zero byte, in a
    copy), the number of trailing 1s the dtype's code, so that the row
    shape's digest ranks compare differs between dtypes of one row size.
    ``finish()`` copies a padded output back into ``dst``."""

    def __init__(self, src, dst, code):
        self._dst = dst
        self._marks = (1,) * code
        self.src, _ = self._units(src, True)
        self.dst, self._padded = self._units(dst, False)

    def _units(self, t, fill):
        rows = t.size(0)
        row_nbytes = math.prod(t.shape[1:]) * t.element_size()
        raw = t.view(-1).view(torch.uint8).view(rows, row_nbytes)
        padded = row_nbytes % 2 == 1
        if padded:
            pad = torch.zeros(rows, row_nbytes + 1, dtype=torch.uint8)
            if fill:
                pad[:, :row_nbytes] = raw
            raw = pad
        return raw.view(torch.bfloat16).view(rows, raw.size(1) // 2, *self._marks), padded

    def finish(self):
        if self._padded:
            dst = self._dst
            rows = dst.size(0)
            raw = self.dst.view(rows, self.dst.size(1)).view(torch.uint8)
            dst.view(-1).view(torch.uint8).view(rows, raw.size(1) - 1).copy_(
                raw[:, :raw.size(1) - 1])


def last_units(t, fill):
    """``t`` (shape (*lead, w)) as a bfloat16 tensor of shape (*lead, u): the
    w elements' bytes in u 16-bit units. A view of ``t`` when it is
    contiguous and a row's byte count even (harmpi's gather writes through
    it); otherwise a zero-padded copy (its bytes copied when ``fill``)."""
    width = t.shape[-1] * t.element_size()
    if t.is_contiguous() and width % 2 == 0:
        return t.view(torch.uint8).view(torch.bfloat16)
    pad = torch.zeros(*t.shape[:-1], width + width % 2, dtype=torch.uint8)
    if fill:
        pad[..., :width] = t.contiguous().view(torch.uint8)
    return pad.view(torch.bfloat16)


def columns(rows, lo, hi, dtype):
    """Bytes lo..hi of every row of the uint8 matrix ``rows``, in a new
    contiguous tensor read as ``dtype`` (a copy: a slice of one row keeps
    a stride that a view to a wider dtype refuses)."""
    part = torch.empty((rows.size(0), hi - lo), dtype=torch.uint8)
    part.copy_(rows[:, lo:hi])
    return part.view(dtype)
