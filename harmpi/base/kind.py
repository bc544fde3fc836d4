"""The kind word: what every rank of a collective must agree on, as one int64.

Ranks post (total bytes, kind) with each step and compare them with every
peer's, and the rails hash both into their message tags, so a rank that
called another collective, dtype, op or algorithm, or passed another shape,
is detected before any data is combined. This module is the only place that
packs or unpacks the word.

=========  =====  =====  ============================================
field      shift  width  holds
=========  =====  =====  ============================================
fmt        0      4      storage format id (harmpi.base.dtypes)
op         4      4      reduction op (OP_SUM; 0 for allgather)
coll       8      4      collective (COLL_ALLREDUCE, COLL_ALLGATHER,
                         COLL_ALLTOALL)
algo       12     4      forced algorithm id (0: auto)
digest     16     24     allgather: crc of the shape; alltoall: of
                         the row shape (x.shape[1:])
ring       40     23     single node: slot position of the step, in
                         64-byte lines (see node.ring_pos)
=========  =====  =====  ============================================

Bit 63 stays clear, so a kind is never negative: ``POISON`` (-1) is what a
rank posts when its part of the collective already failed.

A rank that refuses its own arguments still takes part in the call its
peers are in, as a one-element auto all-reduce whose op is ``OP_REFUSED``
and whose digest names the collective it refused (``refusal_code``): no real
call has that kind, so the peers see a disagreement at their first flag
round or in their rail tags, and every rank's step counters stay paired.
"""

from __future__ import annotations

import zlib

import numba

__all__ = ["FIELDS", "field", "POISON", "OP_SUM", "COLL_ALLREDUCE", "COLL_ALLGATHER",
           "COLL_ALLTOALL", "encode", "decode",
           "with_ring", "without_ring", "allgather_code", "ring_lines_max", "shape_digest",
           "rail_tag", "MAX_TAG", "ABANDON_TAG",
           "POISON_TAG", "OP_REFUSED", "refusal_code", "refused_coll"]

#: (name, shift, width) of every field, low bits first
FIELDS = (
    ("fmt", 0, 4),
    ("op", 4, 4),
    ("coll", 8, 4),
    ("algo", 12, 4),
    ("digest", 16, 24),
    ("ring", 40, 23),
)
_SHIFT = {name: shift for name, shift, _ in FIELDS}
_WIDTH = {name: width for name, _, width in FIELDS}

POISON = -1
OP_SUM = 1
#: the op of a refusal (see the module docstring): no collective reduces with it
OP_REFUSED = 15
COLL_ALLREDUCE, COLL_ALLGATHER, COLL_ALLTOALL = 1, 2, 3
#: the collective names a refusal's digest carries (0: another call)
COLL_NAMES = {COLL_ALLREDUCE: "allreduce", COLL_ALLGATHER: "allgather",
              COLL_ALLTOALL: "alltoall"}

RING_SHIFT = _SHIFT["ring"]
_RING_MASK = ((1 << _WIDTH["ring"]) - 1) << RING_SHIFT

#: rail tags: MPI guarantees tags up to 32767
MAX_TAG = 32000
POISON_TAG = MAX_TAG + 1
#: the message a rank sends its rail peers when it gives up on a collective
ABANDON_TAG = MAX_TAG + 2


def encode(**fields) -> int:
    """The kind word of the given fields (unnamed fields are 0)."""
    code = 0
    for name, value in fields.items():
        width = _WIDTH[name]
        if not 0 <= value < (1 << width):
            raise ValueError(f"kind field {name}={value} does not fit in {width} bits")
        code |= value << _SHIFT[name]
    return code


def decode(code: int) -> dict:
    """{field: value} of a kind word (or {} for POISON)."""
    if code < 0:
        return {}
    return {name: (code >> shift) & ((1 << width) - 1) for name, shift, width in FIELDS}


def field(name: str) -> tuple:
    """(shift, width) of a field (for the C++ side, which makes one kind word)."""
    return _SHIFT[name], _WIDTH[name]


def refusal_code(coll: int, auto_code: int) -> int:
    """The kind of a refusal of collective ``coll``, run as the auto
    all-reduce whose kind (without format) is ``auto_code``."""
    return ((auto_code & ~(((1 << _WIDTH["op"]) - 1) << _SHIFT["op"]))
            | (OP_REFUSED << _SHIFT["op"]) | (coll << _SHIFT["digest"]))


def refused_coll(code: int):
    """None if ``code`` is not a refusal's kind, else the name of the
    collective refused ("a collective" when it does not say)."""
    fields = decode(code)
    if fields.get("op") != OP_REFUSED:
        return None
    return COLL_NAMES.get(fields["digest"], "a collective")


def ring_lines_max() -> int:
    """Largest ring position (in 64-byte lines) the word can carry."""
    return (1 << _WIDTH["ring"]) - 1


@numba.njit(cache=True, nogil=True)
def with_ring(code, pos_nbytes):
    """``code`` carrying ring position ``pos_nbytes`` (a multiple of 64)."""
    if code < 0:
        return code
    return code | ((pos_nbytes >> 6) << RING_SHIFT)


@numba.njit(cache=True, nogil=True)
def without_ring(code):
    if code < 0:
        return code
    return code & ~_RING_MASK


_FMT_SHIFT, _COLL_SHIFT, _DIGEST_SHIFT = _SHIFT["fmt"], _SHIFT["coll"], _SHIFT["digest"]


@numba.njit(cache=True, nogil=True)
def allgather_code(fmt, digest):
    """encode(fmt=fmt, coll=COLL_ALLGATHER, digest=digest), for compiled callers."""
    return (fmt << _FMT_SHIFT) | (COLL_ALLGATHER << _COLL_SHIFT) | (digest << _DIGEST_SHIFT)


def shape_digest(shape) -> int:
    """The digest field of an allgather of ``shape``."""
    return zlib.crc32(repr(tuple(shape)).encode()) & ((1 << _WIDTH["digest"]) - 1)


@numba.njit(cache=True, nogil=True)
def rail_tag(nbytes, code):
    """A rail message tag in [1, MAX_TAG] that differs when (nbytes, code)
    differ (almost always); compiled and Python callers get the same value.
    (int64 products wrap; only their low 32 bits are used.)"""
    folded = code ^ (code >> 32)
    h = (nbytes * 0x9E3779B1 + folded * 0x85EBCA77) & 0xFFFFFFFF
    return 1 + h % MAX_TAG
