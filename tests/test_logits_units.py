"""harmpi.logits' pure helpers and compiled copies, against numpy (no MPI)."""

import numpy as np
import pytest

from harmpi import Config, gatherdim, logits
from harmpi.base import dtypes
from harmpi.errors import HarmpiArgumentError
from harmpi.node import rowcopy

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dim, ndim, expect", [(0, 1, 0), (-1, 1, 0), (1, 3, 1), (-1, 3, 2),
                                               (-3, 3, 0), (0, 0, 0), (-1, 0, 0),
                                               (np.int64(1), 2, 1)])
def test_normalize_dim(dim, ndim, expect):
    assert gatherdim.normalize_dim(dim, ndim) == expect


@pytest.mark.parametrize("dim, ndim", [(1, 1), (-2, 1), (3, 3), (-4, 3), (1, 0), (1.0, 2),
                                       (None, 2), (True, 2), ("0", 2)])
def test_normalize_dim_rejects(dim, ndim):
    with pytest.raises(HarmpiArgumentError, match="dim"):
        gatherdim.normalize_dim(dim, ndim)


def test_choose_route():
    c = logits.choose_route
    assert c(None, "auto", 1, 10, 1 << 20) == "allgather"  # one node: always allgather
    assert c(None, "auto", 2, 1 << 20, 1 << 20) == "allreduce"
    assert c(None, "auto", 2, (1 << 20) + 1, 1 << 20) == "allgather"
    assert c(None, "allreduce", 1, 1 << 30, 0) == "allreduce"  # config forces
    assert c("allgather", "allreduce", 2, 0, 1 << 20) == "allgather"  # the call overrides
    assert c("auto", "allgather", 2, 0, 1 << 20) == "allreduce"
    with pytest.raises(HarmpiArgumentError, match="route"):
        c("ring", "auto", 2, 0, 0)
    logits.check_route(None)
    with pytest.raises(HarmpiArgumentError, match="route"):
        logits.check_route("Allgather")


def test_config_logits_fields():
    assert Config.from_env({}).logits_route == "auto"
    cfg = Config.from_env({"HARMPI_LOGITS_ROUTE": " AllReduce ",
                           "HARMPI_LOGITS_ALLREDUCE_MAX_BYTES": "65536"})
    assert (cfg.logits_route, cfg.logits_allreduce_max_nbytes) == ("allreduce", 65536)
    with pytest.raises(HarmpiArgumentError, match="HARMPI_LOGITS_ROUTE"):
        Config.from_env({"HARMPI_LOGITS_ROUTE": "ring"})
    with pytest.raises(HarmpiArgumentError, match="HARMPI_LOGITS_ALLREDUCE_MAX_BYTES"):
        Config.from_env({"HARMPI_LOGITS_ALLREDUCE_MAX_BYTES": "-1"})


@pytest.mark.parametrize("np_dtype", [np.float16, np.float32, np.float64])
def test_negzero_bytes_are_negative_zeros(np_dtype):
    isz = np.dtype(np_dtype).itemsize
    z = logits.negzero_bytes(isz, 5).view(np_dtype)
    assert z.shape == (5,) and np.all(z == 0) and np.all(np.signbit(z))
    x = np.array([1.5, -0.0, 0.0, np.inf, -np.inf, 1e-45 if isz == 4 else 6e-8], np_dtype)
    assert np.array_equal((x + z[:1]).view(f"u{isz}"), x.view(f"u{isz}"))  # the identity


def _as_f64(raw, fmt):
    """Values of storage bytes of format fmt, as float64 (via torch for bf16)."""
    if fmt == dtypes.BF16:
        return torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16).double().numpy()
    return raw.view({dtypes.F16: np.float16, dtypes.F32: np.float32,
                     dtypes.F64: np.float64}[fmt]).astype(np.float64)


@pytest.mark.parametrize("fmt", [f.id for f in dtypes.FORMATS])
@pytest.mark.parametrize("nranks", [1, 2, 5])
def test_tail_patterns_sum_to_expected(fmt, nranks):
    """Summing every rank's tail (as the all-reduce does) gives ``expected``
    when the digests agree, and something else when one differs."""
    digest = 0xA5003C
    tails = [logits.tail_patterns(digest, r, nranks, fmt) for r in range(nranks)]
    total = sum(_as_f64(mine, fmt) for mine, _ in tails)
    for _, expected in tails:
        assert np.array_equal(total, _as_f64(expected, fmt))
        assert np.array_equal(_as_f64(expected, fmt),
                              np.tile([0x3C, 0x00, 0xA5], nranks).astype(np.float64))
    if nranks > 1:
        other = logits.tail_patterns(digest ^ 0x100, 1, nranks, fmt)[0]
        total = sum(_as_f64(m, fmt) for m, _ in [tails[0], (other, None)] + tails[2:])
        assert not np.array_equal(total, _as_f64(tails[0][1], fmt))


def test_copy_rows_assembles_uneven_blocks():
    """The allgather route's assembly: rank blocks of (rows, W) -> (rows, V)."""
    rows, widths, isz = 3, (4, 0, 6, 2), 2
    table = logits._Table(widths, 0)
    W, V = table.wmax, table.total
    rng = np.random.default_rng(0)
    shards = [rng.integers(0, 1 << 16, (rows, w), dtype=np.uint16) for w in widths]
    gathered = np.zeros((len(widths), rows, W), np.uint16)
    for q, s in enumerate(shards):
        gathered[q, :, :s.shape[1]] = s
    out = np.full((rows, V), 0xFFFF, np.uint16)
    _, assemble = table.plan(rows, isz)
    rowcopy.copy_rows(gathered.ctypes.data, out.ctypes.data, rows, assemble)
    assert np.array_equal(out, np.concatenate(shards, -1))


def test_copy_rows_pads_and_dim_plans():
    rows, w, W = 4, 3, 5
    table = logits._Table((W, w), 1)
    src = np.arange(rows * w, dtype=np.float32).reshape(rows, w)
    dst = np.full((rows, W), -1, np.float32)
    pad, _ = table.plan(rows, 4)
    rowcopy.copy_rows(src.ctypes.data, dst.ctypes.data, rows, pad)
    assert np.array_equal(dst[:, :w], src) and np.all(dst[:, w:] == -1)
    # allgather along dim 1 of (2, 3, 4) over 3 ranks: blocks (3, 2, 12) -> (2, 9, 4)
    n, shape = 3, (2, 3, 4)
    blocks = [np.arange(24, dtype=np.float64).reshape(shape) + 100 * q for q in range(n)]
    scratch = np.stack(blocks)
    out = np.empty((2, 9, 4))
    plan = gatherdim._dim_plan(logits._State(), 3 * 4 * 8, 2, n)
    rowcopy.copy_rows(scratch.ctypes.data, out.ctypes.data, 2, plan)
    assert np.array_equal(out, np.concatenate(blocks, 1))


@pytest.mark.parametrize("off, w, V", [(0, 3, 8), (2, 3, 8), (5, 3, 8), (0, 0, 4), (0, 4, 4)])
def test_pad_rows_writes_negative_zeros_around_the_shard(off, w, V):
    rows = 3
    src = np.arange(1, rows * w + 1, dtype=np.float32).reshape(rows, w)
    tail = np.array([7.0, 8.0], np.float32)
    pat = logits.negzero_bytes(4, V)
    dst = np.full(rows * V + 2, 99.0, np.float32)
    rowcopy.pad_rows(dst.ctypes.data, src.ctypes.data, pat.ctypes.data, rows, V * 4, off * 4,
                    w * 4, tail.ctypes.data, tail.nbytes)
    body = dst[:rows * V].reshape(rows, V)
    assert np.array_equal(body[:, off:off + w], src)
    rest = np.concatenate([body[:, :off], body[:, off + w:]], 1)
    assert np.all(rest == 0) and np.all(np.signbit(rest))
    assert np.array_equal(dst[rows * V:], tail)


def test_make_plan_broadcasts():
    plan = rowcopy.make_plan([2, 4], 0, [8, 9], 16, 32)
    assert plan.dtype == np.int64 and plan.flags.c_contiguous
    assert plan.tolist() == [[2, 4], [0, 0], [8, 9], [16, 16], [32, 32]]
    assert rowcopy.make_plan(3, 0, 3, 0, 5).shape == (5, 1)


def test_same_bytes():
    a = np.arange(10, dtype=np.uint8)
    b = a.copy()
    assert rowcopy.same_bytes(a.ctypes.data, b.ctypes.data, 10)
    b[9] = 0
    assert not rowcopy.same_bytes(a.ctypes.data, b.ctypes.data, 10)
    assert rowcopy.same_bytes(a.ctypes.data, b.ctypes.data, 9)
    assert rowcopy.same_bytes(0, 0, 0)


def test_table_offsets_and_digest():
    t = logits._Table((5, 0, 7, 3), 2)
    assert (t.mine, t.total, t.wmax, t.offsets, t.uniform) == (7, 15, 7, (0, 5, 5, 12), False)
    assert t.digest((2,)) != t.digest((1, 2))  # the leading shape counts
    assert t.digest((2,)) == logits._Table((5, 0, 7, 3), 0).digest((2,))  # rank-independent
    assert t.digest((2,)) != logits._Table((5, 1, 6, 3), 2).digest((2,))
    assert logits._Table((4, 4), 1).uniform
