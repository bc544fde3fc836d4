"""torch integration: the only module of harmpi that imports torch.

Today: describing a CPU tensor as raw memory for the collectives (no copy:
the collective reads and writes the tensor's own storage), and allocating
output tensors. The api imports this module only when it meets a tensor, so
harmpi itself never pulls torch in.
"""

from __future__ import annotations

import torch

from ..base import dtypes
from ..errors import HarmpiArgumentError

__all__ = ["FORMAT_IDS", "Tensor", "describe", "empty_like_gathered", "empty_rows",
           "empty_like"]

Tensor = torch.Tensor

#: torch dtype -> storage format id (harmpi.base.dtypes, the one table)
FORMAT_IDS = {getattr(torch, f.torch_name): f.id for f in dtypes.FORMATS}
_NAMES = ", ".join(f"torch.{f.torch_name}" for f in dtypes.FORMATS)


def describe(t, writable=True):
    """(addr, numel, fmt) of a tensor, or HarmpiArgumentError."""
    fmt = FORMAT_IDS.get(t.dtype)
    if fmt is None:
        raise HarmpiArgumentError(f"unsupported tensor dtype {t.dtype}; harmpi reduces {_NAMES}")
    if not t.is_cpu:
        raise HarmpiArgumentError(f"tensor is on {t.device}; harmpi works on CPU tensors")
    if t.layout != torch.strided:
        raise HarmpiArgumentError(
            f"tensor has layout {t.layout} (sparse or otherwise not dense); harmpi works on "
            "dense tensors: pass t.to_dense()")
    if not t.is_contiguous():
        raise HarmpiArgumentError(
            f"tensor of shape {tuple(t.shape)} with strides {t.stride()} is not contiguous; "
            "pass t.contiguous() (and copy the result back if you need it in place)")
    if writable and t.requires_grad:
        raise HarmpiArgumentError(
            "tensor requires grad; an in-place collective would bypass autograd. Call it under "
            "torch.no_grad() or pass t.detach()")
    return t.data_ptr(), t.numel(), fmt


#: an uninitialised tensor like a contiguous one (contiguous too)
empty_like = torch.empty_like


def empty_rows(t, rows):
    """Uninitialised tensor of t's dtype and row shape (t.shape[1:]) with ``rows`` rows."""
    return torch.empty((rows,) + tuple(t.shape[1:]), dtype=t.dtype)


def empty_like_gathered(t, nranks):
    """Uninitialised tensor of t's dtype with the first dimension times nranks."""
    shape = tuple(t.shape) or (1,)
    return torch.empty((shape[0] * nranks,) + shape[1:], dtype=t.dtype)
