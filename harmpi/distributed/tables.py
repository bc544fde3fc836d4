"""What the ranks of a harmpi process group agree on, and every fact about a
dtype or a reduction the backend needs, in one place: the torch dtypes
harmpi reduces itself (``FLOATS``), the codes ranks exchange in their
headers (calls, dtypes), and the reductions MPI does for integers and bools."""

from __future__ import annotations

import torch
import torch.distributed as dist
from mpi4py import MPI

__all__ = ["AVG", "BOOL_OPS", "CALLS", "CALL_NAMES", "DTYPES", "DTYPE_BY_CODE", "FLOATS",
           "FLOAT_REDUCE", "HEADER_TAG", "INT_OPS", "MONITOR_TAG", "RED", "STRIDED", "SUM",
           "SYNC_SUM", "dtype_code", "op_name", "reduce_opts"]

#: the dtypes harmpi itself reduces and gathers (its format names)
FLOATS = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32",
          torch.float64: "f64"}
RED = dist.ReduceOp.RedOpType
#: the hot path compares ops and layouts with these (no lookup per call)
SUM = dist.ReduceOp.SUM
AVG = dist.ReduceOp.AVG
#: the options of a plain dist.all_reduce(t), when torch passes none
SYNC_SUM = dist.AllreduceOptions()
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
    """torch dtype -> (code agreed between ranks, MPI datatype for MPI's own
    reductions or None). Floats reduce in harmpi or in rank order here, never
    in MPI (whose float reductions may differ between ranks)."""
    ints = [(torch.int8, MPI.INT8_T), (torch.uint8, MPI.UINT8_T), (torch.int16, MPI.INT16_T),
            (torch.int32, MPI.INT32_T), (torch.int64, MPI.INT64_T), (torch.bool, MPI.C_BOOL)]
    for name, mpi_type in (("uint16", MPI.UINT16_T), ("uint32", MPI.UINT32_T),
                           ("uint64", MPI.UINT64_T)):
        if hasattr(torch, name):
            ints.append((getattr(torch, name), mpi_type))
    others = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.complex64,
              torch.complex128, getattr(torch, "float8_e4m3fn", None),
              getattr(torch, "float8_e5m2", None)]
    table = {dt: (code, mpi_type) for code, (dt, mpi_type) in enumerate(ints, 1)}
    for dt in others:
        if dt is not None:
            table[dt] = (len(table) + 1, None)
    return table


#: every fact about a dtype the MPI channel needs, in one table
DTYPES = _dtype_table()
DTYPE_BY_CODE = {code: dt for dt, (code, _) in DTYPES.items()}

#: reductions MPI does for integers and bools (torch op -> MPI op); AVG has no
#: integer meaning (gloo refuses it too)
INT_OPS = {RED.SUM: MPI.SUM, RED.PRODUCT: MPI.PROD, RED.MIN: MPI.MIN, RED.MAX: MPI.MAX,
           RED.BAND: MPI.BAND, RED.BOR: MPI.BOR, RED.BXOR: MPI.BXOR}
#: the same on bool tensors, as gloo computes them (a sum of bools is their OR)
BOOL_OPS = {RED.SUM: MPI.LOR, RED.PRODUCT: MPI.LAND, RED.MIN: MPI.LAND, RED.MAX: MPI.LOR,
            RED.BAND: MPI.LAND, RED.BOR: MPI.LOR, RED.BXOR: MPI.LXOR}
#: float reductions other than SUM/AVG: gather every rank's tensor, reduce in rank order
FLOAT_REDUCE = {RED.MIN: lambda g: g.amin(dim=0), RED.MAX: lambda g: g.amax(dim=0),
                RED.PRODUCT: lambda g: g.prod(dim=0, dtype=g.dtype)}


def dtype_code(dtype):
    """The code ranks compare for ``dtype`` (one outside the table: a code of its name's length)."""
    entry = DTYPES.get(dtype)
    return entry[0] if entry is not None else 1000 + len(str(dtype))


def op_name(kind):
    """A reduction's name for errors (``SUM``)."""
    return getattr(kind, "name", str(kind))


def reduce_opts(opts):
    """Synchronous all-reduce options with ``opts``' op (SUM when None): what
    the calls built on all_reduce (reduce, reduce_scatter, coalesced) pass on."""
    out = dist.AllreduceOptions()
    out.reduceOp = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
    out.asyncOp = False
    return out
