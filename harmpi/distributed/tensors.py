"""The tensors torch passes to a harmpi process group: the argument checks
every call makes before anything moves, and the tensors' memory as the
buffers MPI reads and writes (no copy)."""

from __future__ import annotations

import math

import torch
from mpi4py import MPI

from ..errors import HarmpiArgumentError
from .tables import FLOATS

__all__ = ["bytes_of", "contiguous_cpu", "copy_back", "cpu_tensor", "float_tensor", "is_async",
           "mpi_buffer", "one_tensor", "split_bytes", "user_tag"]

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
