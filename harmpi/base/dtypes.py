"""Every fact about a reduced dtype, in one table.

A *format* is how a collective's elements are stored and summed. Each one
has an id (what the kernels, the control block, the kind code and the C++
entry point carry), a name (the key of the kernels in ``harmpi.reduce``), the
numpy dtype of its storage (numba has no 16-bit float type, so bf16 and f16
are summed from uint16 bit patterns), and the torch dtype it serves (by
name: this module must not import torch; ``harmpi.runtime.torchbuf`` resolves it).

=====  ====  =========  ========  ==============  ===========================
id     name  storage    itemsize  torch dtype     numpy dtypes accepted
=====  ====  =========  ========  ==============  ===========================
0      bf16  uint16     2         bfloat16        ml_dtypes.bfloat16; uint16
                                                  with ``dtype="bf16"``
1      f16   uint16     2         float16         float16
2      f32   float32    4         float32         float32
3      f64   float64    8         float64         float64
=====  ====  =========  ========  ==============  ===========================
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["Format", "FORMATS", "BF16", "F16", "F32", "F64", "by_numpy_dtype"]


@dataclasses.dataclass(frozen=True)
class Format:
    id: int
    name: str
    storage: np.dtype
    torch_name: str
    #: numpy dtype names that are this format as they are (not uint16 for bf16)
    numpy_names: tuple

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize

    @property
    def witness(self) -> np.ndarray:
        """A zero-length array of the storage dtype: selects a kernel's
        compiled signature (numba dispatches on it at compile time)."""
        return _WITNESS[self.storage]


_WITNESS = {np.dtype(t): np.empty(0, t) for t in (np.uint16, np.float32, np.float64)}

FORMATS = (
    Format(0, "bf16", np.dtype(np.uint16), "bfloat16", ("bfloat16",)),
    Format(1, "f16", np.dtype(np.uint16), "float16", ("float16",)),
    Format(2, "f32", np.dtype(np.float32), "float32", ("float32",)),
    Format(3, "f64", np.dtype(np.float64), "float64", ("float64",)),
)
BF16, F16, F32, F64 = (f.id for f in FORMATS)

_BY_NUMPY = {name: f for f in FORMATS for name in f.numpy_names}


def by_numpy_dtype(dtype: np.dtype) -> Format | None:
    """The format of a numpy array of ``dtype`` (bfloat16 by its name and size:
    ml_dtypes registers it with numpy), or None."""
    f = _BY_NUMPY.get(dtype.name)
    return f if f is not None and dtype.itemsize == f.itemsize else None

