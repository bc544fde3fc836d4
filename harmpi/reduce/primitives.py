"""Low-level primitives of the sum kernels: bit casts, stack scratch, row views.

Compiled: numba intrinsics that emit the LLVM directly. NUMBA_DISABLE_JIT=1:
numpy equivalents. ``HARDWARE_F16`` says whether the f16 conversions may be
the CPU's own (``widen`` / ``narrow_like`` on uint16).
"""

import sys

import numba
import numpy as np
from numba import types

__all__ = ["BLOCK", "HARDWARE_F16", "f32_from_bits", "f32_bits", "scratch_f32", "scratch_acc",
           "widen", "narrow_like", "view", "view_pairs", "row_view", "row_view_pairs"]

if sys.byteorder != "little":  # the two-elements-per-word trick below
    raise ImportError("harmpi.reduce needs a little-endian CPU")

# Elements per block of the stack accumulator (pairs on the 32-bit word path).
BLOCK = 256

_U16 = np.uint16
_U32 = np.uint32


def _target_has_f16_conversions():
    """Whether the code numba generates may convert f16 <-> f32 in hardware.

    x86-64 with F16C (vcvtph2ps / vcvtps2ph) and AArch64 (fcvt) do. Follows
    NUMBA_CPU_FEATURES when set, as numba does. Pure-Python mode
    (NUMBA_DISABLE_JIT=1) uses the portable bit-level path.
    """
    if numba.config.DISABLE_JIT:
        return False
    import llvmlite.binding as llb

    triple = llb.get_process_triple()
    if triple.startswith(("aarch64", "arm64")):
        return True
    if not triple.startswith("x86_64"):
        return False
    features = numba.config.CPU_FEATURES  # what numba itself targets
    if features is None:
        features = llb.get_host_cpu_features().flatten()
    return "+f16c" in features.split(",")


# f16 conversions in hardware (exact and round-to-nearest-even like the bit
# path; they differ only in NaN payloads). Fixed at import; the on-disk cache
# is per CPU model and feature set, so cached code always matches this.
HARDWARE_F16 = _target_has_f16_conversions()


if numba.config.DISABLE_JIT:

    def f32_from_bits(u):
        return np.uint32(u).view(np.float32)

    def f32_bits(x):
        return np.float32(x).view(np.uint32)

    def scratch_f32():
        return np.empty(BLOCK, np.float32)

    def scratch_acc(arr):
        return np.empty(BLOCK, np.float64 if arr.dtype == np.float64 else np.float32)

    def widen(x):
        if isinstance(x, np.uint16):  # as the hardware does: NaNs come out quiet
            y = np.float32(x.view(np.float16))
            return y if y == y else f32_from_bits(f32_bits(y) | _U32(0x00400000))
        return x

    def narrow_like(x, like):
        if like.dtype == np.uint16:
            h = np.float16(x).view(np.uint16)
            return h if x == x else _U16(h | _U16(0x0200))
        return x

    def view(arr, row, start, count):
        return (arr[row] if arr.ndim == 2 else arr)[start : start + count]

    def view_pairs(arr, row, start, count):
        return view(arr, row, start, 2 * count).view(np.uint32)

    def row_view(src, x, me, j, start, count):
        return view(x, 0, start, count) if j == me else view(src, j, start, count)

    def row_view_pairs(src, x, me, j, start, count):
        return row_view(src, x, me, j, start, 2 * count).view(np.uint32)

else:
    import llvmlite.ir as _llir
    from numba.extending import intrinsic as _intrinsic
    from numba.np.arrayobj import make_array as _make_array
    from numba.np.arrayobj import populate_array as _populate_array

    @_intrinsic
    def f32_from_bits(typingctx, u):
        """The float32 whose bit pattern is the low 32 bits of integer u."""
        if not isinstance(u, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            v = args[0]
            if v.type.width > 32:
                v = builder.trunc(v, _llir.IntType(32))
            elif v.type.width < 32:
                v = builder.zext(v, _llir.IntType(32))
            return builder.bitcast(v, _llir.FloatType())

        return types.float32(u), codegen

    @_intrinsic
    def f32_bits(typingctx, x):
        """The bit pattern of float32 x as uint32."""
        if x != types.float32:
            return None

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], _llir.IntType(32))

        return types.uint32(x), codegen

    def _alloca_array(context, builder, nbtype):
        """A C-contiguous 1-d array of BLOCK nbtype on the current stack frame.

        One uninitialised alloca in the entry block (so one per call, not per
        loop trip; cgutils.alloca_once would zero it on every call), 64-byte
        aligned, no meminfo. It must not outlive the function that made it.
        """
        elty = context.get_value_type(nbtype)
        itemsize = context.get_abi_sizeof(elty)
        lanes = 64 // itemsize
        vecty = _llir.VectorType(elty, lanes)  # a vector type has 64-byte alignment
        with builder.goto_entry_block():
            raw = builder.alloca(_llir.ArrayType(vecty, BLOCK // lanes))
        arrty = types.Array(nbtype, 1, "C")
        ary = _make_array(arrty)(context, builder)
        intp = context.get_value_type(types.intp)
        _populate_array(
            ary,
            data=builder.bitcast(raw, elty.as_pointer()),
            shape=[_llir.Constant(intp, BLOCK)],
            strides=[_llir.Constant(intp, itemsize)],
            itemsize=_llir.Constant(intp, itemsize),
            meminfo=None,
        )
        return ary._getvalue()

    @_intrinsic
    def scratch_f32(typingctx):
        """Stack scratch: BLOCK float32."""

        def codegen(context, builder, sig, args):
            return _alloca_array(context, builder, types.float32)

        return types.Array(types.float32, 1, "C")(), codegen

    def _acc_type(arrty):
        return types.float64 if arrty.dtype == types.float64 else types.float32

    @_intrinsic
    def scratch_acc(typingctx, arr):
        """Stack scratch: BLOCK accumulators for arr (float64 or float32)."""
        if not isinstance(arr, types.Array):
            return None
        accty = _acc_type(arr)

        def codegen(context, builder, sig, args):
            return _alloca_array(context, builder, accty)

        return types.Array(accty, 1, "C")(arr), codegen

    @_intrinsic
    def widen(typingctx, x):
        """Stored value -> accumulator: float32/float64 as is, uint16 as f16 in
        hardware (LLVM fpext half; use only when HARDWARE_F16)."""
        if x == types.uint16:

            def codegen(context, builder, sig, args):
                half = builder.bitcast(args[0], _llir.HalfType())
                return builder.fpext(half, _llir.FloatType())

            return types.float32(x), codegen
        if x in (types.float32, types.float64):
            return x(x), lambda context, builder, sig, args: args[0]
        return None

    @_intrinsic
    def narrow_like(typingctx, x, like):
        """Accumulator -> stored value of array `like`: identity for floats,
        f16 bits by hardware round-to-nearest-even for uint16 (fptrunc half)."""
        if not isinstance(like, types.Array):
            return None
        if like.dtype == types.uint16 and x == types.float32:

            def codegen(context, builder, sig, args):
                half = builder.fptrunc(args[0], _llir.HalfType())
                return builder.bitcast(half, _llir.IntType(16))

            return types.uint16(x, like), codegen
        if like.dtype == x:
            return x(x, like), lambda context, builder, sig, args: args[0]
        return None

    def _make_view(pairs):
        """Intrinsic view(arr, row, start, count) of arr[row, start : start + count].

        arr is a C-contiguous 1-d array (row is ignored; pass 0) or 2-d array.
        With pairs=True, arr holds uint16 and the view is uint32 over
        2*count elements, typed unaligned. The view carries no reference
        (meminfo) to arr, so making one costs no atomic refcount update, and
        there is no bounds or negative-index handling: the caller checks.
        """

        @_intrinsic
        def view(typingctx, arr, row, start, count):
            if not (
                isinstance(arr, types.Array)
                and arr.layout == "C"
                and arr.ndim in (1, 2)
                and isinstance(row, types.Integer)
                and isinstance(start, types.Integer)
                and isinstance(count, types.Integer)
            ):
                return None
            retty = _view_type(arr.dtype, pairs)
            if retty is None:
                return None

            def codegen(context, builder, sig, args):
                arrty = sig.args[0]
                a = _make_array(arrty)(context, builder, args[0])
                row_v, start_v, count_v = (
                    context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], sig.args[1:])
                )
                offset = start_v
                if arrty.ndim == 2:
                    ncols = builder.extract_value(a.shape, 1)
                    offset = builder.add(builder.mul(row_v, ncols), start_v)
                first = builder.gep(a.data, [offset])
                return _view_value(context, builder, retty, first, count_v)

            return retty(arr, row, start, count), codegen

        return view

    def _view_type(elty, pairs):
        """Type of a view of elements elty (None if pairs and elty is not uint16)."""
        if pairs:
            if elty != types.uint16:
                return None
            return types.Array(types.uint32, 1, "C", aligned=False)
        return types.Array(elty, 1, "C")

    def _view_value(context, builder, retty, first, count_v):
        """The view array (no meminfo) of count_v retty.dtype items at pointer first."""
        intp = context.get_value_type(types.intp)
        first = builder.bitcast(first, context.get_data_type(retty.dtype).as_pointer())
        itemsize = context.get_abi_sizeof(context.get_data_type(retty.dtype))
        ary = _make_array(retty)(context, builder)
        _populate_array(
            ary,
            data=first,
            shape=[count_v],
            strides=[_llir.Constant(intp, itemsize)],
            itemsize=_llir.Constant(intp, itemsize),
            meminfo=None,
        )
        return ary._getvalue()

    def _make_row_view(pairs):
        """Intrinsic row_view(src, x, me, j, start, count): like
        view(x, 0, start, count) if j == me else view(src, j, start, count).

        src is a C-contiguous 2-d array, x a C-contiguous 1-d array of the
        same dtype. The row is picked by a pointer select, not by a call: an
        njit helper returning either view would pass src and x by reference,
        with an atomic reference count update per block.
        """

        @_intrinsic
        def row_view(typingctx, src, x, me, j, start, count):
            if not (
                isinstance(src, types.Array)
                and isinstance(x, types.Array)
                and src.layout == "C"
                and x.layout == "C"
                and src.ndim == 2
                and x.ndim == 1
                and src.dtype == x.dtype
                and all(isinstance(t, types.Integer) for t in (me, j, start, count))
            ):
                return None
            retty = _view_type(src.dtype, pairs)
            if retty is None:
                return None

            def codegen(context, builder, sig, args):
                a = _make_array(sig.args[0])(context, builder, args[0])
                b = _make_array(sig.args[1])(context, builder, args[1])
                me_v, j_v, start_v, count_v = (
                    context.cast(builder, v, t, types.intp) for v, t in zip(args[2:], sig.args[2:])
                )
                ncols = builder.extract_value(a.shape, 1)
                in_src = builder.gep(a.data, [builder.add(builder.mul(j_v, ncols), start_v)])
                in_x = builder.gep(b.data, [start_v])
                first = builder.select(builder.icmp_signed("==", j_v, me_v), in_x, in_src)
                return _view_value(context, builder, retty, first, count_v)

            return retty(src, x, me, j, start, count), codegen

        return row_view

    view = _make_view(pairs=False)
    view_pairs = _make_view(pairs=True)
    row_view = _make_row_view(pairs=False)
    row_view_pairs = _make_row_view(pairs=True)

