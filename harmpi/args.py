"""Argument checks shared by the collectives (harmpi.api, harmpi.logits).

Each check needs no communication and raises HarmpiArgumentError before
anything moves: :func:`describe` turns a numpy array or a torch tensor into
(address, element count, storage format, is it torch), :func:`context` is
the healthy context of a communicator, :func:`shape_digest` the cached
digest of a shape that the ranks compare with their first publish.
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from .base import dtypes, kind
from .errors import HarmpiArgumentError, HarmpiError
from .runtime.registry import STATE

__all__ = ["BF16_NAMES", "byte_order_refusal", "check_op", "context", "describe",
           "describe_array", "describe_subclass", "refuse", "shape_digest", "torch_module"]

#: the dtype= spellings of bfloat16 for numpy uint16 arrays
BF16_NAMES = ("bf16", "bfloat16")


def context(comm):
    """The context of ``comm`` (default COMM_WORLD, made on first use), or
    HarmpiError if a failure left it unusable."""
    ctx = STATE.get(comm)
    if ctx.broken is not None:
        raise HarmpiError(f"harmpi context is unusable: {ctx.broken}")
    return ctx


def describe_array(x, dtype, writable):
    """(addr, n, fmt) of a numpy array, or HarmpiArgumentError."""
    if not x.dtype.isnative:
        raise HarmpiArgumentError(byte_order_refusal(x.dtype))
    if dtype is None:
        f = dtypes.by_numpy_dtype(x.dtype)
    elif dtype not in BF16_NAMES:
        raise HarmpiArgumentError(f"dtype={dtype!r}: only 'bf16' may be given, for uint16 "
                                  "arrays holding bfloat16 bits")
    elif x.dtype != np.uint16:
        raise HarmpiArgumentError(f"dtype='bf16' needs a uint16 array, got {x.dtype}")
    else:
        f = dtypes.FORMATS[dtypes.BF16]
    if f is None:
        raise HarmpiArgumentError(
            f"unsupported array dtype {x.dtype}; harmpi reduces float16, float32, float64, "
            "and bfloat16 (torch.bfloat16 tensors, or uint16 arrays with dtype='bf16')")
    if not x.flags.c_contiguous:
        raise HarmpiArgumentError(
            f"array of shape {x.shape} is not C-contiguous; pass np.ascontiguousarray(x)")
    if writable and not x.flags.writeable:
        raise HarmpiArgumentError("array is read-only; the collective writes its result in "
                                  "place (pass a writable copy)")
    return x.ctypes.data, x.size, f.id


def byte_order_refusal(dt):
    order = "big" if dt.byteorder == ">" else "little"
    return (f"array of dtype {dt.str!r} stores its elements {order}-endian; harmpi sums "
            f"arrays in this machine's byte order ({sys.byteorder}-endian) and does not "
            "convert them (a sum of swapped bytes is garbage): pass "
            "x.astype(x.dtype.newbyteorder('=')) and, for an in-place result, copy it back")


def describe_subclass(x, dtype, writable):
    """(addr, n, fmt) of an instance of a numpy array subclass (np.memmap,
    np.matrix, ...): an array like any other, except a masked array, whose
    mask a sum of the raw data would ignore."""
    if isinstance(x, np.ma.MaskedArray):
        raise HarmpiArgumentError(
            "masked arrays are not supported: harmpi would sum the data under the mask too; "
            "pass x.filled(0) (or np.ma.getdata(x) to sum every element)")
    return describe_array(x, dtype, writable)


def torch_module(x):
    """harmpi.runtime.torchbuf if ``x`` is a torch tensor (imported on first sight), else None."""
    ht = STATE.torch
    if ht is None:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(x, torch.Tensor):
            return None
        from .runtime import torchbuf as ht  # noqa: PLC0415 - torch only once a tensor is seen
        STATE.torch = ht
        STATE.attach_native()
    return ht if isinstance(x, ht.Tensor) else None


def describe(x, dtype, writable):
    """(addr, n, fmt, is_torch) of x, or HarmpiArgumentError."""
    if type(x) is np.ndarray:
        return (*describe_array(x, dtype, writable), False)
    if isinstance(x, np.ndarray):  # a subclass: np.memmap and the like
        return (*describe_subclass(x, dtype, writable), False)
    ht = torch_module(x)
    if ht is None:
        raise HarmpiArgumentError(
            f"expected a numpy array or a torch tensor, got {type(x).__name__}")
    if dtype is not None:
        raise HarmpiArgumentError("dtype= is only for numpy uint16 arrays; a tensor has its own")
    return (*ht.describe(x, writable), True)


def check_op(op):
    if op != "sum" and op is not MPI.SUM:
        raise HarmpiArgumentError(f"op={op!r} is not supported; harmpi all-reduce sums (op='sum')")


_SHAPE_DIGESTS = {}


def shape_digest(shape):
    """kind.shape_digest, cached (a decode loop gathers the same shapes)."""
    digest = _SHAPE_DIGESTS.get(shape)
    if digest is None:
        if len(_SHAPE_DIGESTS) > 1024:
            _SHAPE_DIGESTS.clear()
        digest = _SHAPE_DIGESTS[shape] = kind.shape_digest(shape)
    return digest


def refuse(comm, coll, exc):
    """``exc``, a HarmpiArgumentError this rank raises before moving anything
    in a ``coll`` call (kind.COLL_*) on ``comm``: the peers may be in that
    call, so this rank takes part in it as a refusal (Context.refuse): they
    fail it at once, naming this rank, and every rank's next call pairs with
    the peers' next one. Once per error (a call that refuses inside another
    one is told once); an error about the communicator itself tells no one."""
    if getattr(exc, "refused", False):
        return
    exc.refused = True
    try:
        ctx = STATE.get(comm)
    except HarmpiError:  # no usable context (COMM_NULL, finalized, a failed set-up)
        return
    failed = ctx.refuse(coll)
    if failed is not None:
        exc.add_note(f"its peers were told, and this call ended on this rank with: {failed}")
