"""bf16 and f16 <-> float32 in scalar code, and two 16-bit values per 32-bit word.

All integer work is wrapped in _U32(...) because numba widens uint32
arithmetic to 64 bits; the explicit truncation lets LLVM use 32-bit vector
lanes and keeps the arithmetic modulo 2**32. Plain ``@numba.njit``: these
compile into the kernels that call them (harmpi.reduce.kernels).
"""

import numba
import numpy as np

from .primitives import f32_bits, f32_from_bits

__all__ = ["bf16_round_hi", "f16_hi_to_f32", "f16_bits_lo", "dec_lo", "dec_hi", "enc_pair",
           "dec_one", "enc_one"]

_U16 = np.uint16
_U32 = np.uint32


@numba.njit
def bf16_round_hi(x):
    """float32 -> uint32 whose high half is bf16(x) rounded to nearest even.

    The low half is garbage. NaN: sign and top payload kept, quiet bit set (no
    rounding increment, which could carry a NaN into Inf).
    """
    b = f32_bits(x)
    if x != x:
        return _U32(b | _U32(0x00400000))
    return _U32(b + _U32(_U32(0x7FFF) + ((b >> _U32(16)) & _U32(1))))


# f16 <-> f32 by integer and float32 arithmetic only (branch-free; after
# M. Maratyszcza's FP16 library). Widening is exact; narrowing relies on the
# float32 adder's round-to-nearest-even to round the mantissa.
_F16_EXP_OFFSET = _U32(0xE0 << 23)  # rebias exponent 15 -> 127, plus 112
_F16_EXP_SCALE = np.float32(2.0**-112)
_F16_MAGIC_MASK = _U32(126 << 23)  # float32 0.5
_F16_MAGIC_BIAS = np.float32(0.5)
_F16_DENORM_CUTOFF = _U32(1 << 27)  # (twice the) smallest normal f16, shifted
_F16_SCALE_TO_INF = np.float32(2.0**112)
_F16_SCALE_TO_ZERO = np.float32(2.0**-110)


@numba.njit
def f16_hi_to_f32(w):
    """uint32 holding an f16 in its high half (low half zero) -> exact float32."""
    sign = w & _U32(0x80000000)
    two_w = _U32(w << _U32(1))  # drop the sign
    # Normal, Inf, NaN: rebias by moving the exponent field and scaling by
    # 2**-112 (exact; for Inf/NaN the exponent field is already all ones).
    normal = f32_from_bits(_U32((two_w >> _U32(4)) + _F16_EXP_OFFSET)) * _F16_EXP_SCALE
    # Zero, subnormal: mantissa into a float32 in [0.5, 1), minus 0.5 (exact).
    subnormal = f32_from_bits(_U32((two_w >> _U32(17)) | _F16_MAGIC_MASK)) - _F16_MAGIC_BIAS
    if two_w < _F16_DENORM_CUTOFF:
        mag = f32_bits(subnormal)
    else:
        mag = f32_bits(normal)
    return f32_from_bits(_U32(sign | mag))


@numba.njit
def f16_bits_lo(x):
    """float32 -> uint32 holding f16(x) (nearest even) in its low half, high half zero.

    Overflow gives Inf, subnormals round correctly, NaN gives 0x7E00 | sign.
    """
    # Scaling by 2**112 then 2**-110 overflows exactly the values that must
    # become Inf; the sum with the bias below rounds the mantissa to 10 bits
    # (or to the subnormal grid) in the float32 adder.
    base = (abs(x) * _F16_SCALE_TO_INF) * _F16_SCALE_TO_ZERO
    w = f32_bits(x)
    shl1_w = _U32(w << _U32(1))
    sign = w & _U32(0x80000000)
    bias = shl1_w & _U32(0xFF000000)
    if bias < _U32(0x71000000):
        bias = _U32(0x71000000)
    base = f32_from_bits(_U32((bias >> _U32(1)) + _U32(0x07800000))) + base
    bits = f32_bits(base)
    exp_bits = (bits >> _U32(13)) & _U32(0x00007C00)
    mantissa_bits = bits & _U32(0x00000FFF)
    nonsign = _U32(exp_bits + mantissa_bits)
    if shl1_w > _U32(0xFF000000):  # NaN
        nonsign = _U32(0x7E00)
    return _U32((sign >> _U32(16)) | nonsign)


# Pair codecs: w is a uint32 word holding two 16-bit values (element 2p low,
# 2p+1 high). The kernels pass `f16` as a literal, so numba compiles one
# specialization per value and the test folds away.


@numba.njit
def dec_lo(w, f16):
    if f16:
        return f16_hi_to_f32(_U32(w << _U32(16)))
    return f32_from_bits(_U32(w << _U32(16)))


@numba.njit
def dec_hi(w, f16):
    if f16:
        return f16_hi_to_f32(_U32(w & _U32(0xFFFF0000)))
    return f32_from_bits(_U32(w & _U32(0xFFFF0000)))


@numba.njit
def enc_pair(x_lo, x_hi, f16):
    """Two float32 values -> one uint32 word of two rounded 16-bit values."""
    if f16:
        return _U32(f16_bits_lo(x_lo) | _U32(f16_bits_lo(x_hi) << _U32(16)))
    return _U32((bf16_round_hi(x_lo) >> _U32(16)) | (bf16_round_hi(x_hi) & _U32(0xFFFF0000)))


@numba.njit
def dec_one(h, f16):
    """One raw 16-bit value -> float32."""
    return dec_hi(_U32(_U32(h) << _U32(16)), f16)


@numba.njit
def enc_one(x, f16):
    """float32 -> one raw 16-bit value."""
    if f16:
        return _U16(f16_bits_lo(x))
    return _U16(bf16_round_hi(x) >> _U32(16))

