"""The backend's all_reduce hot path (harmpi.distributed: the native entry on
the default group, the context's entry called directly on other groups)
under mpirun at any rank count and layout.

What the path must never do is serve a call with what it decided for
another: every test switches dtype, size, op, call form and group from one
call to the next and checks each result exactly. Rank q of a group (its
group rank) passes ``q + 1 + (i % 3)`` at element i: sums, products, maxima
and minima of these small integers are exact in every float dtype, so the
reference is computed locally in float64 and compared bit for bit.
"""

import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_everywhere, harmpi_process_group
from mpi4py import MPI

import harmpi
from harmpi import api

pytestmark = pytest.mark.timeout(240)

R = dist.ReduceOp
FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


@pytest.fixture(scope="module")
def groups():
    """[(harmpi group, its world ranks)] this rank belongs to: the default
    group, a new group of every rank (its own communicator and context),
    consecutive pairs and the even ranks (spanning virtual nodes when
    HARMPI_RANKS_PER_NODE splits the host)."""
    harmpi_process_group()
    n, me = dist.get_world_size(), dist.get_rank()
    out = [(dist.group.WORLD, list(range(n)))]
    specs = [list(range(n))] + [[r, r + 1] for r in range(0, n - 1, 2)] + [list(range(0, n, 2))]
    for ranks in specs:
        g = dist.new_group(ranks)  # every rank calls new_group, members or not
        if me in ranks:
            out.append((g, ranks))
    yield out
    dist.destroy_process_group()


def _inputs(ranks, count):
    """Every group rank's input (float64), by group rank."""
    i = torch.arange(count, dtype=torch.float64) % 3
    return [q + 1 + i for q in range(len(ranks))]


def _expected(op, dtype, xs):
    if op == R.MAX:
        ref = torch.stack(xs).amax(0)
    elif op == R.MIN:
        ref = torch.stack(xs).amin(0)
    elif op == R.PRODUCT:
        ref = torch.stack(xs).prod(0)
    else:
        ref = torch.stack(xs).sum(0)
    ref = ref.to(dtype)
    if op == R.AVG:
        ref.div_(len(xs))  # as the backend: the sum in the dtype, then divided
    return ref


def _opts(op, async_op=False):
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    opts.asyncOp = async_op
    return opts


def _call(form, group, t, op):
    """One all-reduce of ``t`` on ``group`` in one of the ways torch code calls it."""
    if form == "dist":
        dist.all_reduce(t, op=op, group=group)
    elif form == "dist async":
        work = dist.all_reduce(t, op=op, group=group, async_op=True)
        assert work.wait()
        assert work.is_completed()
    elif form == "method, no opts":
        assert op == R.SUM
        group.allreduce([t]).wait()
    else:  # "method, opts"
        group.allreduce([t], _opts(op)).wait()


#: (dtype, count, op, call form): consecutive calls differ in dtype, size,
#: op or form, and sizes straddle the small/large thresholds
SEQUENCE = [
    (torch.bfloat16, 5120, R.SUM, "dist"),
    (torch.float32, 5120, R.SUM, "dist"),          # same bytes x 2, other dtype
    (torch.bfloat16, 10240, R.SUM, "dist"),        # same bytes as the f32 call
    (torch.bfloat16, 7, R.SUM, "method, no opts"),
    (torch.float16, 70001, R.SUM, "method, opts"),
    (torch.float16, 70001, R.MAX, "dist"),         # same tensor shape, other op
    (torch.float16, 70001, R.AVG, "dist"),
    (torch.float64, 1, R.SUM, "dist"),
    (torch.float64, 1, R.PRODUCT, "method, opts"),
    (torch.int32, 5120, R.SUM, "dist"),            # not harmpi's sum: MPI's
    (torch.bfloat16, 5120, R.MIN, "dist async"),
    (torch.bfloat16, 5120, R.SUM, "dist async"),
    (torch.float32, 300000, R.SUM, "dist"),
    (torch.bfloat16, 5120, R.SUM, "dist"),
]


def test_every_call_gets_its_own_result(groups):
    for _round in range(2):  # run twice: a second pass over warm paths
        for dtype, count, op, form in SEQUENCE:
            for group, ranks in groups:
                xs = _inputs(ranks, count)
                t = xs[group.rank()].to(dtype, copy=True)
                _call(form, group, t, op)
                want = _expected(op, dtype, xs)
                assert torch.equal(t, want), (dtype, count, op, form, ranks)
                assert_same_everywhere(group.comm, t)


def test_interleaved_groups_and_an_async_call_left_open(groups):
    """A started async all-reduce, then synchronous ones on the same and other
    groups before its wait(): each completes with its own result."""
    pending = []
    for group, ranks in groups:
        xs = _inputs(ranks, 5120)
        t = xs[group.rank()].to(torch.bfloat16, copy=True)
        pending.append((dist.all_reduce(t, group=group, async_op=True), t,
                        _expected(R.SUM, torch.bfloat16, xs)))
        ys = _inputs(ranks, 33)
        u = ys[group.rank()].to(torch.float32, copy=True)
        dist.all_reduce(u, group=group)  # completes the started one first
        assert torch.equal(u, _expected(R.SUM, torch.float32, ys))
    for work, t, want in pending:
        work.wait()
        assert torch.equal(t, want)


def test_argument_errors_and_mismatches_on_every_rank(groups):
    for group, ranks in groups:
        with pytest.raises(harmpi.HarmpiArgumentError, match="not contiguous"):
            dist.all_reduce(torch.ones(8, 4)[:, 0], group=group)
        with pytest.raises(harmpi.HarmpiArgumentError, match="requires grad"):
            dist.all_reduce(torch.ones(8, requires_grad=True), group=group)
        if len(ranks) > 1:
            # group rank 0 passes more elements (then the same bytes in another dtype)
            for dtype0, count0 in ((torch.bfloat16, 5121), (torch.float16, 5120)):
                mine = (dtype0, count0) if group.rank() == 0 else (torch.bfloat16, 5120)
                if dtype0 == torch.float16 and group.rank() != 0:
                    mine = (torch.float32, 2560)
                x = torch.full((mine[1],), 3.0, dtype=mine[0])
                with pytest.raises(harmpi.HarmpiMismatchError, match="ranks disagree"):
                    dist.all_reduce(x, group=group)
                assert bool((x == 3).all()), "the caller's tensor must not be touched"
        y = torch.ones(100, dtype=torch.bfloat16)
        dist.all_reduce(y, group=group)  # the group still works
        assert bool((y == len(ranks)).all())


def test_a_group_does_not_go_through_the_api_lookup(groups, monkeypatch):
    """The hot path of every group calls its context's entry itself: with
    harmpi.allreduce's Python path made to fail, synchronous SUMs still work
    (on the default group the native entry serves them when it is built)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the hot path went through api.allreduce")

    monkeypatch.setattr(api, "allreduce", refuse)
    for group, ranks in groups:
        if group is dist.group.WORLD and api._STATE.native is None:
            continue  # no native entry (not built, HARMPI_NATIVE=0): the API serves the world
        for dtype in FLOATS:
            xs = _inputs(ranks, 4096)
            t = xs[group.rank()].to(dtype, copy=True)
            dist.all_reduce(t, group=group)
            assert torch.equal(t, _expected(R.SUM, dtype, xs))


def test_a_broken_context_is_refused_by_every_rank(groups):
    n = dist.get_world_size()
    g = dist.new_group(list(range(n)))
    t = torch.ones(64)
    dist.all_reduce(t, group=g)
    assert bool((t == n).all())
    g._ctx.broken = "test: marked broken on purpose"  # on every rank
    with pytest.raises(harmpi.HarmpiError, match="unusable"):
        dist.all_reduce(torch.ones(64), group=g)
    MPI.COMM_WORLD.Barrier()


@pytest.mark.parametrize("splits", ["even", "uneven"])
def test_async_all_to_all_single_keeps_its_buffers(groups, splits):
    """all_to_all_single hands MPI buffers made from addresses: the contiguous
    copies of a non-contiguous input and output live only in the work object
    until wait(); memory churn in between must not reach the result."""
    import gc

    for group, ranks in groups:
        n, q = len(ranks), group.rank()
        cols = 8192  # 64 KiB rows: above the eager limit, MPI reads the input late
        # rows of group rank q for group rank j hold q * 100 + j (+ the column)
        base = torch.arange(n, dtype=torch.float32).repeat_interleave(2)
        full = (q * 100 + base)[:, None] + torch.arange(cols, dtype=torch.float32)
        inp = full.t().contiguous().t()  # the same values, not contiguous
        out = torch.full((cols, 2 * n), -1.0).t()  # not contiguous either
        sizes = [2] * n if splits == "uneven" else None
        work = dist.all_to_all_single(out, inp, output_split_sizes=sizes,
                                      input_split_sizes=sizes, group=group, async_op=True)
        del inp
        gc.collect()
        churn = [torch.full((2 * n, cols), 7.0) for _ in range(16)]
        work.wait()
        want = (torch.arange(n, dtype=torch.float32) * 100 + q).repeat_interleave(2)
        want = want[:, None] + torch.arange(cols, dtype=torch.float32)
        assert torch.equal(out, want), ranks
        assert all(bool((c == 7).all()) for c in churn)
