"""torch integration: the only module of harmpi that imports torch.

Today: describing a CPU tensor as raw memory for the collectives (no copy:
the collective reads and writes the tensor's own storage), and allocating
output tensors. The api imports this module only when it meets a tensor, so
harmpi itself never pulls torch in.
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import HarmpiArgumentError
from .node import ALLGATHER_NODE, FMT_BF16, FMT_F16, FMT_F32, FMT_F64

__all__ = ["KINDS", "FAST_GATHER", "Tensor", "describe", "empty_like_gathered"]

Tensor = torch.Tensor

#: torch dtype -> (storage format, zero-length witness of the storage dtype, itemsize)
KINDS = {
    torch.bfloat16: (FMT_BF16, np.empty(0, np.uint16), 2),
    torch.float16: (FMT_F16, np.empty(0, np.uint16), 2),
    torch.float32: (FMT_F32, np.empty(0, np.float32), 4),
    torch.float64: (FMT_F64, np.empty(0, np.float64), 8),
}


#: torch dtype -> (compiled one-node allgather, storage format, itemsize, witness)
FAST_GATHER = {dt: (ALLGATHER_NODE[w.dtype], fmt, isz, w) for dt, (fmt, w, isz) in KINDS.items()}


def describe(t, writable=True):
    """(addr, numel, fmt, witness, itemsize, True) of a tensor, or HarmpiArgumentError."""
    kind = KINDS.get(t.dtype)
    if kind is None:
        raise HarmpiArgumentError(
            f"unsupported tensor dtype {t.dtype}; harmpi reduces torch.bfloat16, torch.float16, "
            "torch.float32 and torch.float64")
    if not t.is_cpu:
        raise HarmpiArgumentError(f"tensor is on {t.device}; harmpi works on CPU tensors")
    if not t.is_contiguous():
        raise HarmpiArgumentError(
            f"tensor of shape {tuple(t.shape)} with strides {t.stride()} is not contiguous; "
            "pass t.contiguous() (and copy the result back if you need it in place)")
    if writable and t.requires_grad:
        raise HarmpiArgumentError(
            "tensor requires grad; an in-place collective would bypass autograd. Call it under "
            "torch.no_grad() or pass t.detach()")
    fmt, w, itemsize = kind
    return t.data_ptr(), t.numel(), fmt, w, itemsize, True


def empty_like_gathered(t, nranks):
    """Uninitialised tensor of t's dtype with the first dimension times nranks."""
    shape = tuple(t.shape) or (1,)
    return torch.empty((shape[0] * nranks,) + shape[1:], dtype=t.dtype)
