"""What the ranks of a harmpi process group agree on, and every fact about a
dtype or a reduction the backend needs, in one place: the torch dtypes
harmpi reduces itself (``FLOATS``), the codes ranks exchange in their
headers (calls, dtypes), and the element-wise torch ops that fold every
other reduction in rank order (``FOLDS``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["AVG", "CALLS", "CALL_NAMES", "DTYPES", "DTYPE_BY_CODE", "FLOATS", "HEADER_TAG",
           "MONITOR_TAG", "RED", "STRIDED", "SUM", "SYNC_SUM", "dtype_code", "fold_of",
           "op_name", "reduce_opts"]

#: the dtypes harmpi itself reduces and gathers (its format names)
FLOATS = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32",
          torch.float64: "f64"}
RED = dist.ReduceOp.RedOpType
#: the hot path compares ops and layouts with these (no lookup per call)
SUM = dist.ReduceOp.SUM
AVG = dist.ReduceOp.AVG
#: whether torch's all-reduce options carry async_op (2.8 on): on 2.6 and 2.7
#: they do not, torch waits on the returned Work itself, and every call is
#: synchronous here (tensors.is_async reads False)
OPTS_ASYNC = hasattr(dist.AllreduceOptions(), "asyncOp")
#: the options of a plain dist.all_reduce(t), when torch passes none
SYNC_SUM = dist.AllreduceOptions()
if OPTS_ASYNC:
    SYNC_SUM.asyncOp = False
STRIDED = torch.strided


#: the calls that agree on a header first (the codes ranks compare)
CALL_NAMES = dict(enumerate(("all_reduce", "broadcast", "scatter", "gather", "all_gather",
                             "all_gather_into_tensor", "all_to_all", "all_to_all_single",
                             "all_reduce (sparse)"), 1))
CALLS = {name: code for code, name in CALL_NAMES.items()}
#: tags of the backend's own messages on its private communicator (users'
#: messages travel on another one)
HEADER_TAG = 1
MONITOR_TAG = 2


def _dtype_table():
    """torch dtype -> the code ranks agree on (1, 2, ... in this order)."""
    names = ("int8", "uint8", "int16", "int32", "int64", "bool", "uint16", "uint32", "uint64",
             "bfloat16", "float16", "float32", "float64", "complex64", "complex128",
             "float8_e4m3fn", "float8_e5m2")
    dts = [getattr(torch, name) for name in names if hasattr(torch, name)]
    return {dt: code for code, dt in enumerate(dts, 1)}


#: every fact about a dtype the MPI channel needs, in one table
DTYPES = _dtype_table()
DTYPE_BY_CODE = {code: dt for dt, code in DTYPES.items()}

#: all_reduce ops other than harmpi's float SUM/AVG: the element-wise torch
#: op each rank folds the gathered tensors with, in rank order. Never MPI's
#: reduction ops: Open MPI 5.0's AVX component saturates int8 sums, where
#: torch (and gloo) wrap; a torch op of the tensor's own dtype wraps as torch
#: does, and every rank folds the same bytes in the same order, so every
#: rank gets the same bits. AVG has no integer meaning (gloo refuses it too).
FOLDS = {RED.SUM: torch.add, RED.PRODUCT: torch.mul, RED.MIN: torch.minimum,
         RED.MAX: torch.maximum, RED.BAND: torch.bitwise_and, RED.BOR: torch.bitwise_or,
         RED.BXOR: torch.bitwise_xor}
#: the same on bool tensors, as gloo computes them (a sum of bools is their OR)
BOOL_FOLDS = {RED.SUM: torch.logical_or, RED.PRODUCT: torch.logical_and,
              RED.MIN: torch.logical_and, RED.MAX: torch.logical_or,
              RED.BAND: torch.logical_and, RED.BOR: torch.logical_or,
              RED.BXOR: torch.logical_xor}
#: floats: harmpi sums them (SUM, AVG); these fold in rank order
FLOAT_FOLDS = {RED.PRODUCT: torch.mul, RED.MIN: torch.minimum, RED.MAX: torch.maximum}



def _works(fold, dtype):
    """Whether torch has ``fold`` for ``dtype`` (uint32 has no minimum, for
    one), tried on empty tensors."""
    try:
        empty = torch.empty(0, dtype=dtype)
        return fold(empty, empty).dtype == dtype
    except (RuntimeError, TypeError):
        return False


#: (dtype, op) -> the element-wise op all_reduce folds it with: the pairs
#: torch serves, so a call is refused before anything moves
_FOLD_BY_DTYPE = {
    (dt, kind): fold
    for dt in DTYPES if dt in FLOATS or not (dt.is_floating_point or dt.is_complex)
    for kind, fold in (FLOAT_FOLDS if dt in FLOATS else
                       BOOL_FOLDS if dt == torch.bool else FOLDS).items()
    if _works(fold, dt)}


def fold_of(dtype, kind):
    """The element-wise op all_reduce ``kind`` folds ``dtype`` with, or None."""
    return _FOLD_BY_DTYPE.get((dtype, kind))


def dtype_code(dtype):
    """The code ranks compare for ``dtype`` (one outside the table: a code of its name's length)."""
    code = DTYPES.get(dtype)
    return code if code is not None else 1000 + len(str(dtype))


def op_name(kind):
    """A reduction's name for errors (``SUM``)."""
    return getattr(kind, "name", str(kind))


def reduce_opts(opts):
    """Synchronous all-reduce options with ``opts``' op (SUM when None): what
    the calls built on all_reduce (reduce, reduce_scatter, coalesced) pass on."""
    out = dist.AllreduceOptions()
    out.reduceOp = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
    if OPTS_ASYNC:
        out.asyncOp = False
    return out
