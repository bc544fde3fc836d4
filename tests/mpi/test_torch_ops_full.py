"""Every c10d op gloo serves on CPU, on backend "harmpi", under mpirun at any
rank count and layout (1-4 ranks, virtual nodes).

Rank r's input is a closed-form function of r, so every rank computes every
other rank's input and the exact reference locally (in int64 or float64, with
small integers that every dtype holds exactly); results must be bitwise
identical on every rank of the group. Groups: the default (world) group and
a subgroup of the even ranks (it spans virtual nodes when
HARMPI_RANKS_PER_NODE splits the host).
"""

import functools

import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_everywhere, harmpi_process_group
from mpi4py import MPI

import harmpi

pytestmark = pytest.mark.timeout(240)

R = dist.ReduceOp
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
#: the exact reduction of rank inputs, in int64/float64 (None: not defined for floats)
REFERENCE = {
    R.SUM: lambda xs: functools.reduce(torch.add, xs),
    R.PRODUCT: lambda xs: functools.reduce(torch.mul, xs),
    R.MIN: lambda xs: functools.reduce(torch.minimum, xs),
    R.MAX: lambda xs: functools.reduce(torch.maximum, xs),
    R.BAND: lambda xs: functools.reduce(torch.bitwise_and, xs),
    R.BOR: lambda xs: functools.reduce(torch.bitwise_or, xs),
    R.BXOR: lambda xs: functools.reduce(torch.bitwise_xor, xs),
}
BITWISE = (R.BAND, R.BOR, R.BXOR)


@pytest.fixture(scope="module")
def groups():
    """[(group, its world ranks)]: the default group and the even ranks."""
    harmpi_process_group()
    n = dist.get_world_size()
    evens = list(range(0, n, 2))
    sub = dist.new_group(evens)          # every rank calls new_group, members or not
    out = [(dist.group.WORLD, list(range(n)))]
    if dist.get_rank() in evens:
        out.append((sub, evens))
    yield out
    dist.destroy_process_group()


def _comm(group):
    return group.comm


def _ints(r, k=7):
    """Rank r's integer input: small positive values (a product over 4 ranks fits int8)."""
    return (torch.arange(k) + r) % 3 + 1


def _same(group, x):
    assert_same_everywhere(_comm(group), x)


def _reduced(op, dtype, ranks, k=7):
    """(this rank's input, the exact result) of all_reduce(op) over ``ranks``."""
    if dtype == torch.bool:
        xs = [((torch.arange(k) + q) % 3 == 0) for q in range(len(ranks))]
        logical = {R.SUM: R.BOR, R.MAX: R.BOR, R.PRODUCT: R.BAND, R.MIN: R.BAND}
        ref = REFERENCE[logical.get(op, op)](xs)
    else:
        xs = [_ints(q, k).to(torch.int64) for q in range(len(ranks))]
        ref = REFERENCE[op](xs)
    return xs, ref


@pytest.mark.parametrize("dtype", INTS + [torch.bool], ids=str)
@pytest.mark.parametrize("op", list(REFERENCE), ids=lambda o: o.name)
@pytest.mark.parametrize("async_op", [False, True])
def test_all_reduce_integer_and_bool_exact(groups, dtype, op, async_op):
    for group, ranks in groups:
        me = dist.get_rank(group)
        xs, ref = _reduced(op, dtype, ranks)
        for _ in range(2):  # twice on one group
            x = xs[me].to(dtype, copy=True)
            work = dist.all_reduce(x, op=op, group=group, async_op=async_op)
            if async_op:
                assert work.wait()
            assert torch.equal(x, ref.to(dtype)), (op, dtype, x, ref)
            _same(group, x)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("op", [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX], ids=lambda o: o.name)
@pytest.mark.parametrize("async_op", [False, True])
def test_all_reduce_float_ops_exact(groups, dtype, op, async_op):
    for group, ranks in groups:
        me = dist.get_rank(group)
        xs = [_ints(q, 300).to(torch.float64) for q in range(len(ranks))]
        if op == R.AVG:  # the exact sum, divided once in the dtype (as harmpi does)
            ref = REFERENCE[R.SUM](xs).to(dtype) / len(ranks)
        else:
            ref = REFERENCE[op](xs)
        x = xs[me].to(dtype, copy=True)
        work = dist.all_reduce(x, op=op, group=group, async_op=async_op)
        if async_op:
            work.wait()
        assert torch.equal(x, ref.to(dtype)), (op, dtype)
        _same(group, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool], ids=str)
def test_zero_size_tensors(groups, dtype):
    for group, ranks in groups:
        empty = torch.empty(0, dtype=dtype)
        for op in ((R.SUM, R.MAX) if dtype != torch.bool else (R.BOR,)):
            dist.all_reduce(empty, op=op, group=group)
        dist.broadcast(empty, src=ranks[0], group=group)
        outs = [torch.empty(0, dtype=dtype) for _ in ranks]
        dist.all_gather(outs, empty, group=group)
        dist.all_to_all_single(torch.empty(0, dtype=dtype), empty, group=group)
        dist.scatter(empty, [empty] * len(ranks) if dist.get_rank() == ranks[0] else None,
                     src=ranks[0], group=group)


def test_bitwise_ops_on_floats_and_premul_sum_are_refused_by_name(groups):
    with pytest.raises(harmpi.HarmpiArgumentError, match="BXOR of torch.float32 is not"):
        dist.all_reduce(torch.ones(4), op=R.BXOR)
    with pytest.raises(harmpi.HarmpiArgumentError, match="AVG of torch.int64 is not"):
        dist.all_reduce(torch.ones(4, dtype=torch.int64), op=R.AVG)
    x = torch.ones(4)
    dist.all_reduce(x)  # the group still works
    assert bool((x == dist.get_world_size()).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool,
                                   torch.uint8], ids=str)
@pytest.mark.parametrize("async_op", [False, True])
def test_rooted_collectives_exact(groups, dtype, async_op):
    def done(work):
        if async_op:
            work.wait()

    for group, ranks in groups:
        k, me = len(ranks), dist.get_rank(group)
        for root_index in {0, k - 1}:
            root = ranks[root_index]
            # broadcast (a non-contiguous tensor too)
            x = _ints(me, 10).to(dtype)
            done(dist.broadcast(x, src=root, group=group, async_op=async_op))
            assert torch.equal(x, _ints(root_index, 10).to(dtype))
            y = _ints(me, 12).to(dtype).view(3, 4).t()
            done(dist.broadcast(y, src=root, group=group, async_op=async_op))
            assert torch.equal(y, _ints(root_index, 12).to(dtype).view(3, 4).t())
            # scatter
            chunks = [torch.full((3,), q % 2 if dtype == torch.bool else q + 1).to(dtype)
                      for q in range(k)] if me == root_index else None
            out = torch.zeros(3, dtype=dtype)
            done(dist.scatter(out, chunks, src=root, group=group, async_op=async_op))
            expected = me % 2 if dtype == torch.bool else me + 1
            assert torch.equal(out, torch.full((3,), expected).to(dtype))
            # gather
            outs = [torch.empty(5, dtype=dtype) for _ in range(k)] if me == root_index \
                else None
            done(dist.gather(_ints(me, 5).to(dtype), outs, dst=root, group=group,
                             async_op=async_op))
            if me == root_index:
                for q, o in enumerate(outs):
                    assert torch.equal(o, _ints(q, 5).to(dtype))
            # reduce: the root gets the result, the others keep their input
            if dtype != torch.bool:
                z = _ints(me, 6).to(dtype)
                done(dist.reduce(z, dst=root, op=R.MAX, group=group, async_op=async_op))
                expected = REFERENCE[R.MAX]([_ints(q, 6) for q in range(k)]) \
                    if me == root_index else _ints(me, 6)
                assert torch.equal(z, expected.to(dtype))


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float64], ids=str)
@pytest.mark.parametrize("async_op", [False, True])
def test_gathers_of_any_dtype(groups, dtype, async_op):
    for group, ranks in groups:
        k, me = len(ranks), dist.get_rank(group)
        x = _ints(me, 6).to(dtype).view(2, 3)
        outs = [torch.empty(2, 3, dtype=dtype) for _ in range(k)]
        work = dist.all_gather(outs, x, group=group, async_op=async_op)
        if async_op:
            work.wait()
        for q, o in enumerate(outs):
            assert torch.equal(o, _ints(q, 6).to(dtype).view(2, 3))
        single = torch.empty(2 * k, 3, dtype=dtype)
        work = dist.all_gather_into_tensor(single, x, group=group, async_op=async_op)
        if async_op:
            work.wait()
        assert torch.equal(single, torch.cat(outs))
        _same(group, single)


def test_all_gather_coalesced(groups):
    import warnings

    for group, ranks in groups:
        k, me = len(ranks), dist.get_rank(group)
        inputs = [_ints(me, 4).to(torch.float32), _ints(me + 1, 2).to(torch.float32)]
        outs = [[torch.empty(4), torch.empty(2)] for _ in range(k)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's deprecation notice
            dist.all_gather_coalesced(outs, inputs, group=group)
        for q in range(k):
            assert torch.equal(outs[q][0], _ints(q, 4).to(torch.float32))
            assert torch.equal(outs[q][1], _ints(q + 1, 2).to(torch.float32))
    assert dist.group.WORLD._get_backend(torch.device("cpu")) is dist.group.WORLD


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
@pytest.mark.parametrize("op", [R.SUM, R.MAX], ids=lambda o: o.name)
def test_reduce_scatter_exact(groups, dtype, op):
    for group, ranks in groups:
        k, me = len(ranks), dist.get_rank(group)
        full = REFERENCE[op]([_ints(q, 4 * k) for q in range(k)])
        out = torch.empty(4, dtype=dtype)
        dist.reduce_scatter_tensor(out, _ints(me, 4 * k).to(dtype), op=op, group=group)
        assert torch.equal(out, full[4 * me:4 * me + 4].to(dtype))
        listed = torch.empty(4, dtype=dtype)
        dist.reduce_scatter(listed, list(_ints(me, 4 * k).to(dtype).split(4)), op=op,
                            group=group)
        assert torch.equal(listed, out)


def _rows_for(src, dst, k):
    """Rows that group rank src sends to group rank dst (uneven, some zero)."""
    return (src + 2 * dst) % (k + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
@pytest.mark.parametrize("async_op", [False, True])
def test_all_to_all_single_even_and_uneven(groups, dtype, async_op):
    for group, ranks in groups:
        k, me = len(ranks), dist.get_rank(group)
        # even: row block q of rank me's input goes to rank q
        x = (torch.arange(2 * k * 3) + 1000 * me).to(dtype).view(2 * k, 3)
        out = torch.empty(2 * k, 3, dtype=dtype)
        work = dist.all_to_all_single(out, x, group=group, async_op=async_op)
        if async_op:
            work.wait()
        expected = torch.cat([(torch.arange(2 * k * 3) + 1000 * q).view(2 * k, 3)
                              [2 * me:2 * me + 2] for q in range(k)])
        assert torch.equal(out, expected.to(dtype))
        # uneven splits, values naming (sender, receiver, row)
        send = [_rows_for(me, q, k) for q in range(k)]
        recv = [_rows_for(q, me, k) for q in range(k)]
        x = torch.cat([torch.full((s, 2), 100 * me + q) for q, s in enumerate(send)]).to(dtype)
        out = torch.empty(sum(recv), 2, dtype=dtype)
        work = dist.all_to_all_single(out, x, recv, send, group=group, async_op=async_op)
        if async_op:
            work.wait()
        expected = torch.cat([torch.full((s, 2), 100 * q + me) for q, s in enumerate(recv)])
        assert torch.equal(out, expected.to(dtype))


def test_all_to_all_of_tensor_lists(groups):
    for group, ranks in groups:
        k, me = len(ranks), dist.get_rank(group)
        inputs = [torch.full((_rows_for(me, q, k),), 10 * me + q) for q in range(k)]
        outs = [torch.empty(_rows_for(q, me, k), dtype=torch.int64) for q in range(k)]
        dist.all_to_all(outs, inputs, group=group)
        for q, o in enumerate(outs):
            assert torch.equal(o, torch.full((_rows_for(q, me, k),), 10 * q + me))


def test_point_to_point_with_tags_and_any_source(groups):
    n, r = dist.get_world_size(), dist.get_rank()
    if n < 2:
        pytest.skip("point to point needs two ranks")
    right, left = (r + 1) % n, (r - 1) % n
    # isend/irecv around the ring, two tags received in the opposite order
    a, b = torch.empty(3), torch.empty(3)
    works = [dist.irecv(b, src=left, tag=2), dist.irecv(a, src=left, tag=1),
             dist.isend(torch.full((3,), float(r)), dst=right, tag=1),
             dist.isend(torch.full((3,), float(r + 100)), dst=right, tag=2)]
    for w in works:
        w.wait()
    assert torch.equal(a, torch.full((3,), float(left)))
    assert torch.equal(b, torch.full((3,), float(left + 100)))
    # blocking send/recv; rank 0 receives from any source and learns who sent
    if r == 0:
        got = set()
        for _ in range(n - 1):
            x = torch.empty(2, dtype=torch.int64)
            src = dist.recv(x, tag=5)
            assert torch.equal(x, torch.full((2,), src))
            got.add(src)
        assert got == set(range(1, n))
    else:
        dist.send(torch.full((2,), r), dst=0, tag=5)
    # batch_isend_irecv
    out = torch.empty(4, dtype=torch.int32)
    ops = [dist.P2POp(dist.isend, torch.full((4,), r, dtype=torch.int32), right),
           dist.P2POp(dist.irecv, out, left)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(out, torch.full((4,), left, dtype=torch.int32))
    dist.barrier()


def test_a_message_of_another_size_is_refused(groups):
    n, r = dist.get_world_size(), dist.get_rank()
    if n < 2:
        pytest.skip("point to point needs two ranks")
    if r == 0:
        dist.send(torch.ones(3), dst=1, tag=9)
    elif r == 1:
        with pytest.raises(harmpi.HarmpiMismatchError, match="sent 12 bytes"):
            dist.recv(torch.empty(5), src=0, tag=9)
    dist.barrier()


def test_object_collectives(groups):
    for group, ranks in groups:
        k, me = len(ranks), dist.get_rank(group)
        mine = {"rank": me, "data": list(range(me + 1))}
        objs = [None] * k
        dist.all_gather_object(objs, mine, group=group)
        assert objs == [{"rank": q, "data": list(range(q + 1))} for q in range(k)]
        box = [mine, "x" * me] if me == 0 else [None, None]
        dist.broadcast_object_list(box, src=ranks[0], group=group)
        assert box == [{"rank": 0, "data": [0]}, ""]
        gathered = [None] * k if me == 0 else None
        dist.gather_object(mine, gathered, dst=ranks[0], group=group)
        if me == 0:
            assert gathered == objs
        got = [None]
        dist.scatter_object_list(got, [("to", q) for q in range(k)] if me == 0 else None,
                                 src=ranks[0], group=group)
        assert got == [("to", me)]
    n, r = dist.get_world_size(), dist.get_rank()
    if n > 1 and r < 2:
        if r == 0:
            dist.send_object_list([{"hello": 1}], dst=1)
        else:
            got = [None]
            dist.recv_object_list(got, src=0)
            assert got == [{"hello": 1}]


def test_barriers(groups):
    import datetime

    for group, _ranks in groups:
        dist.barrier(group=group)
        group.monitored_barrier(datetime.timedelta(seconds=60), wait_all_ranks=True)


# -- disagreements: every rank raises, data untouched, the group goes on ---------------------

def _raises_everywhere(group, call, match):
    with pytest.raises(harmpi.HarmpiError, match=match):
        call()
    x = torch.ones(3, dtype=torch.int64)
    dist.all_reduce(x, group=group)             # still usable
    assert bool((x == group.size()).all())


def test_broadcast_and_scatter_disagreements_raise_on_every_rank(groups):
    for group, ranks in groups:
        k, me = len(ranks), dist.get_rank(group)
        if k < 2:
            continue
        # the size differs on the last rank
        x = torch.full((4 + (me == k - 1),), float(me))
        _raises_everywhere(group, lambda: dist.broadcast(x, src=ranks[0], group=group),
                           "ranks disagree")
        assert bool((x == me).all())
        # the dtype differs
        y = torch.full((4,), me, dtype=torch.int32 if me == k - 1 else torch.float32)
        _raises_everywhere(group, lambda: dist.broadcast(y, src=ranks[0], group=group),
                           "ranks disagree")
        assert bool((y == me).all())
        # scatter: a receiver's output is shorter
        out = torch.full((3 - (me == k - 1),), -1.0)
        chunks = [torch.ones(3) for _ in range(k)] if me == 0 else None
        _raises_everywhere(group, lambda: dist.scatter(out, chunks, src=ranks[0], group=group),
                           "ranks disagree")
        assert bool((out == -1).all())
        # scatter: the root's list is wrong; every rank hears of it
        out = torch.full((3,), -1.0)
        bad = [torch.ones(2) for _ in range(k)] if me == 0 else None
        _raises_everywhere(group, lambda: dist.scatter(out, bad, src=ranks[0], group=group),
                           "refused|root needs")
        assert bool((out == -1).all())


def test_all_to_all_split_disagreement_raises_on_every_rank(groups):
    for group, ranks in groups:
        k, me = len(ranks), dist.get_rank(group)
        if k < 2:
            continue
        send = [1] * k
        recv = [1] * k
        if me == 0:
            recv[k - 1] = 2        # rank 0 expects 2 rows from the last rank, which sends 1
        x = torch.zeros(sum(send))
        out = torch.full((sum(recv),), -1.0)
        _raises_everywhere(group, lambda: dist.all_to_all_single(out, x, recv, send,
                                                                 group=group),
                           "split sizes disagree")
        assert bool((out == -1).all())


def test_destroyed_groups_free_their_communicators(groups):
    """Create, use and destroy subgroups: no communicator or context is kept."""
    n = dist.get_world_size()
    for _ in range(5):
        g = dist.new_group(list(range(n)))
        x = torch.ones(4)
        dist.all_reduce(x, group=g)
        assert bool((x == n).all())
        comm = g.comm
        dist.destroy_process_group(g)
        assert comm == MPI.COMM_NULL
        with pytest.raises(harmpi.HarmpiError, match="destroyed"):
            g.broadcast([torch.ones(2)], dist.BroadcastOptions())


# -- sparse all_reduce, a group's timeout=, monitored_barrier's messages ---------------------

def _sparse_input(r, dtype):
    """Rank r's sparse 6x3 input (uncoalesced: index (r % 3, 0) twice), and its dense form."""
    idx = torch.tensor([[r % 3, r % 3, 5, r % 6], [0, 0, 1, 2]])
    vals = torch.tensor([1, 2, 3, r + 1]).to(dtype)
    return (torch.sparse_coo_tensor(idx, vals, (6, 3), check_invariants=True),
            torch.sparse_coo_tensor(idx, vals.to(torch.float64), (6, 3),
                                    check_invariants=True).to_dense())


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_sparse_all_reduce_sum(groups, dtype):
    """As gloo: the coalesced sum of every rank's sparse tensor replaces it."""
    for group, ranks in groups:
        k, me = len(ranks), dist.get_rank(group)
        x, _ = _sparse_input(me, dtype)
        dist.all_reduce(x, group=group)
        ref = sum(_sparse_input(q, dtype)[1] for q in range(k))
        assert x.is_sparse and x.is_coalesced() and x.dtype == dtype
        assert torch.equal(x.to_dense().to(torch.float64), ref)
        _same(group, x.to_dense())
        with pytest.raises(harmpi.HarmpiArgumentError, match="SUM only"):
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
        if k > 1:  # a shape that differs on the last rank: every rank raises
            y = torch.sparse_coo_tensor(torch.zeros((2, 1), dtype=torch.int64), torch.ones(1),
                                        (6, 3 + (me == k - 1)), check_invariants=True)
            with pytest.raises(harmpi.HarmpiError, match="disagree"):
                dist.all_reduce(y, group=group)


def _full_group(**kwargs):
    return dist.new_group(list(range(dist.get_world_size())), **kwargs)


def test_a_groups_timeout_is_its_deadline(groups):
    """new_group(timeout=1 s): a barrier and an MPI op that rank 0 alone calls
    raise after ~1 s (not HARMPI_TIMEOUT_S), saying ' timeout ' as gloo does."""
    import datetime
    import time

    if dist.get_world_size() < 2:
        pytest.skip("needs a peer that does not come")
    one_s = datetime.timedelta(seconds=1)
    barrier_group, bcast_group = _full_group(timeout=one_s), _full_group(timeout=one_s)
    if dist.get_rank() == 0:
        for call, match in ((lambda: dist.barrier(group=barrier_group), " timeout after 1 s"),
                            (lambda: dist.broadcast(torch.ones(3), src=0, group=bcast_group),
                             "within 1 s")):
            t0 = time.monotonic()
            with pytest.raises(harmpi.HarmpiTimeoutError, match=match):
                call()
            assert 0.9 <= time.monotonic() - t0 < 10
    dist.barrier()
    for g in (barrier_group, bcast_group):
        dist.destroy_process_group(g)


def test_monitored_barrier_errors_read_as_gloos(groups):
    """Rank 0 names the group ranks that did not come in gloo's words (the first,
    or all of them), or that its own time ran out; a rank rank 0 never
    releases says so as gloo does."""
    import datetime

    n = dist.get_world_size()
    if n < 2:
        pytest.skip("needs a rank that does not come")
    short = datetime.timedelta(seconds=0.3)
    g = _full_group()
    if dist.get_rank() == 0:
        with pytest.raises(harmpi.HarmpiTimeoutError,
                           match=r"\[Rank 0\]: Rank 1 failed to pass monitoredBarrier in 300 ms"):
            g.monitored_barrier(short)
        others = ", ".join(map(str, range(1, n)))
        with pytest.raises(harmpi.HarmpiTimeoutError,
                           match=f"Ranks? {others} failed to pass monitoredBarrier"):
            g.monitored_barrier(short, wait_all_ranks=True)
        with pytest.raises(harmpi.HarmpiTimeoutError,
                           match="Rank 0 timed out in monitoredBarrier after 0 ms"):
            g.monitored_barrier(datetime.timedelta(seconds=0))
    dist.barrier()
    lonely = _full_group()  # a group of its own: its token to rank 0 may stay unreceived
    if dist.get_rank() == n - 1:
        with pytest.raises(harmpi.HarmpiTimeoutError,
                           match=f"Rank {n - 1} successfully reached monitoredBarrier, but "
                           "received errors while waiting for send/recv from rank 0"):
            lonely.monitored_barrier(short)
    dist.barrier()
    g.monitored_barrier(datetime.timedelta(seconds=60))  # still usable
    for group in (g, lonely):
        dist.destroy_process_group(group)
