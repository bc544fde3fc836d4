"""harmpi.alltoall under mpirun: every rank checks the rows it receives, bit
for bit, against the rows every sender made (each sender's data is a seeded
function of its rank, so every rank can rebuild everyone's input).

Runs at any rank count and on virtual nodes; ``small_comm`` (4 KiB slots,
blocks of ~1-2 KiB) puts segments across several steps cheaply.
"""

import numpy as np
import pytest
from conftest import DTYPES, SMALL
from mpi4py import MPI

import harmpi
from harmpi.algorithms.alltoall import geometry

torch = pytest.importorskip("torch")


def rows_of(name, sender, count, row_shape, salt, kind):
    """``count`` rows that ``sender`` makes (seeded; exact in every dtype)."""
    rng = np.random.default_rng([salt, sender, count])
    ref = rng.integers(-512, 512, (count,) + row_shape).astype(np.float64) / 8
    tdtype, ndtype, _ = DTYPES[name]
    if kind == "torch":
        return torch.from_numpy(ref).to(tdtype)
    if ndtype is None:  # numpy bf16: uint16 bits
        return torch.from_numpy(ref).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return ref.astype(ndtype)


def cat(parts, kind):
    return torch.cat(parts) if kind == "torch" else np.concatenate(parts)


def bits(a):
    if isinstance(a, torch.Tensor):
        a = a.contiguous().view(torch.uint8).numpy() if a.numel() else np.zeros(0, np.uint8)
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


def inputs(name, matrix, rank, row_shape, salt, kind):
    """(x of rank ``rank``, the rows it should receive) for counts ``matrix``
    (matrix[i][j]: rows rank i sends rank j): sender i's segment for j is
    rows_of(i, salt + j)."""
    n = len(matrix)
    x = cat([rows_of(name, rank, int(matrix[rank][j]), row_shape, salt + j, kind)
             for j in range(n)], kind)
    want = cat([rows_of(name, i, int(matrix[i][rank]), row_shape, salt + rank, kind)
                for i in range(n)], kind)
    return x, want


def block_rows(comm, row_nbytes):
    """Rows that fill one block of a slot of ``comm``'s context."""
    _, block = geometry(harmpi.init(comm).config.slot_nbytes, comm.Get_size())
    return max(1, block // row_nbytes)


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("per", [0, 1, 3])
def test_even_split_default_call(world, name, kind, per):
    """The call users make: harmpi.alltoall(x), every argument at its default."""
    n, r = world.Get_size(), world.Get_rank()
    matrix = [[per] * n for _ in range(n)]
    x, want = inputs(name, matrix, r, (5,), 11, kind)
    x_before = bits(x)
    # (numpy has no bfloat16: uint16 bits, named by dtype=)
    y = harmpi.alltoall(x, **({"dtype": "bf16"} if x.dtype == np.uint16 else {}))
    assert type(y) is type(x) and tuple(y.shape) == tuple(x.shape)
    assert bits(y) == bits(want)
    assert bits(x) == x_before  # x is only read


@pytest.mark.parametrize("edge", [-1, 0, 1])
@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_even_split_around_block_boundaries(small_comm, edge, blocks):
    """Segments of one row less than, exactly, and one row more than 1-3
    blocks: the steps of a segment larger than a block."""
    n, r = small_comm.Get_size(), small_comm.Get_rank()
    row_shape = (4,)  # 8 bytes per bf16 row
    per = max(0, blocks * block_rows(small_comm, 8) + edge)
    matrix = [[per] * n for _ in range(n)]
    x, want = inputs("bf16", matrix, r, row_shape, 21, "torch")
    assert bits(harmpi.alltoall(x, comm=small_comm)) == bits(want)


@pytest.mark.parametrize("edge", [-1, 0, 1])
@pytest.mark.parametrize("chunks", [1, 2])
def test_one_rank_nodes_move_the_rest_straight_around_chunk_boundaries(small_comm, topo, edge,
                                                                       chunks):
    """Several one-rank nodes over tcp: step 0 moves a block per pair through
    the messages, the later steps the rest straight from x into out, in
    chunks of DIRECT_SLOTS slots (many_nodes_tcp.span). Segments one row
    short of, at and past 1-2 such chunks, each pair a different length
    (uneven), and a bad expectation of the last pair after them."""
    from harmpi.algorithms.alltoall.many_nodes_tcp import DIRECT_SLOTS

    n, r = small_comm.Get_size(), small_comm.Get_rank()
    if topo.local_size != 1 or n == 1:
        pytest.skip("one-rank nodes")
    row_nb = 8
    slot = harmpi.init(small_comm).config.slot_nbytes
    per = block_rows(small_comm, row_nb) + chunks * DIRECT_SLOTS * slot // row_nb + edge
    matrix = np.array([[per + (i + j) % 3 - 1 for j in range(n)] for i in range(n)])
    x, want = inputs("bf16", matrix, r, (4,), 31, "torch")
    got, counts = harmpi.alltoall(x, matrix[r], comm=small_comm)
    assert list(counts) == list(matrix[:, r])
    assert bits(got) == bits(want)
    expect = matrix[:, r].copy()
    if r == n - 1:
        expect[0] += 1
    out = torch.full((int(expect.sum()), 4), -7.0, dtype=torch.bfloat16)
    with pytest.raises(harmpi.HarmpiMismatchError, match="split sizes disagree"):
        harmpi.alltoall(x, matrix[r], comm=small_comm, out=out, recv_counts=expect)
    assert bool((out == -7.0).all())


def _matrix(n, seed, high):
    return np.random.default_rng(seed).integers(0, high, (n, n))


@pytest.mark.parametrize("comm_name", ["world", "small"])
@pytest.mark.parametrize("seed", range(4))
def test_uneven_counts_change_every_call(world, small_comm, comm_name, seed):
    """A MoE step's routing: new counts every call (some zero, seed 1 a rank
    that sends nothing, seed 2 a rank that receives nothing); the receive
    counts come back with the rows."""
    comm = world if comm_name == "world" else small_comm
    n, r = comm.Get_size(), comm.Get_rank()
    for call in range(6):
        matrix = _matrix(n, [seed, call], 600 if comm_name == "small" else 40)
        if seed == 1:
            matrix[0, :] = 0
        if seed == 2:
            matrix[:, n - 1] = 0
        x, want = inputs("f32", matrix, r, (3,), 100 + call, "torch")
        y, got = harmpi.alltoall(x, matrix[r].tolist(), comm=comm)
        assert got == matrix[:, r].tolist()
        assert bits(y) == bits(want), f"call {call}"


@pytest.mark.parametrize("counts_as", ["list", "numpy", "tensor"])
def test_known_receive_counts_and_out(world, counts_as):
    """recv_counts given (torch's output_split_sizes): one step call; out given."""
    n, r = world.Get_size(), world.Get_rank()
    matrix = _matrix(n, 7, 9)
    x, want = inputs("f64", matrix, r, (2, 2), 300, "numpy")
    conv = {"list": lambda a: a.tolist(), "numpy": lambda a: a,
            "tensor": lambda a: torch.from_numpy(a)}[counts_as]
    out = np.full((int(matrix[:, r].sum()), 2, 2), np.nan)
    y, got = harmpi.alltoall(x, conv(matrix[r]), out=out, recv_counts=conv(matrix[:, r]))
    assert y is out and got == matrix[:, r].tolist()
    assert bits(y) == bits(want)


def test_every_rank_sees_all_rows(world):
    """The receivers together hold exactly what the senders sent."""
    n, r = world.Get_size(), world.Get_rank()
    matrix = _matrix(n, 8, 6)
    x = torch.arange(int(matrix[r].sum()), dtype=torch.float64) + 1000 * r
    y, got = harmpi.alltoall(x, matrix[r])
    every = world.allgather(y.numpy())
    sent = np.sort(np.concatenate([np.arange(matrix[i].sum()) + 1000 * i for i in range(n)]))
    assert np.array_equal(np.sort(np.concatenate(every)), sent)


def test_row_shape_mismatch_fails_on_every_rank_then_recovers(world):
    n, r = world.Get_size(), world.Get_rank()
    if n == 1:
        pytest.skip("one rank has no peer to disagree with")
    x = torch.zeros(n * 2, 3 if r == 0 else 4)
    with pytest.raises(harmpi.HarmpiMismatchError, match="disagree"):
        harmpi.alltoall(x)
    # every rank stopped at the same round: the next call works
    x, want = inputs("f32", [[2] * n for _ in range(n)], r, (3,), 5, "torch")
    assert bits(harmpi.alltoall(x)) == bits(want)


def test_expected_counts_mismatch_fails_before_output(world, topo):
    """Rank n-1 expects one row more from rank 0 than rank 0 sends: every rank
    raises (on one node every rank checks every pair; on two nodes the pair
    crosses the rail, whose two ends fail their nodes; on more nodes the MPI
    path checks every pair on every rank), none writes its output."""
    n, r = world.Get_size(), world.Get_rank()
    if n == 1:
        pytest.skip("one rank has no peer to disagree with")
    matrix = _matrix(n, 9, 4) + 1
    expect = matrix[:, r].copy()
    if r == n - 1:
        expect[0] += 1
    x = torch.ones(int(matrix[r].sum()), 2)
    out = torch.full((int(expect.sum()), 2), -7.0)
    with pytest.raises(harmpi.HarmpiMismatchError, match="split sizes disagree"):
        harmpi.alltoall(x, matrix[r], out=out, recv_counts=expect)
    assert bool((out == -7.0).all())
    world.Barrier()
    y, _ = harmpi.alltoall(x, matrix[r])  # usable afterwards
    assert y.shape[0] == int(matrix[:, r].sum())


@pytest.mark.parametrize("bad, match", [
    (dict(send_counts=[1]), "integers"),
    (dict(send_counts="x"), "integers"),
    (dict(send_counts=-1), "integers"),
    (dict(recv_counts=[0]), "only for calls with send_counts"),
])
def test_argument_errors_before_communication(world, bad, match):
    n = world.Get_size()
    x = torch.zeros(n * 2, 2)
    if "send_counts" in bad and bad["send_counts"] == [1] and n == 1:
        bad = dict(send_counts=[1, 1])
    with pytest.raises(harmpi.HarmpiArgumentError, match=match):
        harmpi.alltoall(x, **bad)


def test_more_argument_errors(world):
    n = world.Get_size()
    if n > 1:
        with pytest.raises(harmpi.HarmpiArgumentError, match="multiple"):
            harmpi.alltoall(torch.zeros(n * 2 + 1, 2))
    with pytest.raises(harmpi.HarmpiArgumentError, match="sum to"):
        harmpi.alltoall(torch.zeros(5, 2), [1] * n)
    with pytest.raises(harmpi.HarmpiArgumentError, match=">= 0"):
        harmpi.alltoall(torch.zeros(0, 2), [-1] + [1] * (n - 1) if n > 1 else [-1])
    with pytest.raises(harmpi.HarmpiArgumentError, match="no dimensions"):
        harmpi.alltoall(torch.tensor(1.0))
    with pytest.raises(harmpi.HarmpiArgumentError, match="contiguous"):
        harmpi.alltoall(torch.zeros(2, n * 2).t())
    x = torch.zeros(n * 2, 2)
    with pytest.raises(harmpi.HarmpiArgumentError, match="elements"):
        harmpi.alltoall(x, [2] * n, out=torch.zeros(1, 2), recv_counts=[2] * n)
    with pytest.raises(harmpi.HarmpiArgumentError, match="overlaps"):
        harmpi.alltoall(x, [2] * n, out=x, recv_counts=[2] * n)
    # nothing moved: the next call pairs up on every rank
    assert tuple(harmpi.alltoall(x).shape) == (n * 2, 2)


def test_both_spellings():
    import harmpi.alltoall as mod  # noqa: PLC0415 - the module is callable too

    x = torch.zeros(MPI.COMM_WORLD.Get_size(), 2)
    assert tuple(mod(x).shape) == tuple(harmpi.alltoall(x).shape)


def test_small_slots_geometry():
    head, block = geometry(SMALL["slot_nbytes"], 4)
    # (2P + 2 words: send, expect, the pid and x address: 80 bytes in two lines)
    assert head == 128 and block % 64 == 0 and head + 4 * block <= SMALL["slot_nbytes"]


def test_default_call_runs_from_cpp_where_compiled(world, topo):
    """Where harmpi._C serves the world context's all-to-all (one node, or
    2^k nodes over the tcp rail; module built), an even split of a tensor
    runs from C++: its result, identical to the Python path's; elsewhere it
    declines (-1) and the Python path runs."""
    from harmpi.runtime.registry import STATE  # noqa: PLC0415

    n, r = world.Get_size(), world.Get_rank()
    x, want = inputs("bf16", [[3] * n for _ in range(n)], r, (2, 3), 77, "torch")
    harmpi.alltoall(x)  # (the first tensor call attaches the module)
    native = STATE.native_alltoall
    if native is None:   # (not built, HARMPI_NATIVE=0, or nothing compiled to serve)
        assert "served" not in harmpi.info()["native"]
        return
    got = native(x)
    # one node, and 2^k equal nodes over the tcp rail (the compiled steps)
    compiled = topo.node_count == 1 or getattr(STATE.world.alltoall, "many", False)
    assert isinstance(got, torch.Tensor) == compiled
    if compiled:
        assert bits(got) == bits(want)
        assert native(x[:, :1].contiguous()) is not None  # another row shape: its own kind
        if n > 1:
            assert native(torch.zeros(n * 2 + 1, 2)) == -1  # not an even split: Python's


def test_other_threads_never_disturb_the_owners_calls(world):
    """Two more threads call alltoall on the owner's communicator while it
    runs its own calls: theirs are refused, and every one of the owner's
    results is right (the counts of a call are its own, not the context's)."""
    import threading  # noqa: PLC0415

    comm = world.Dup()
    harmpi.init(comm)
    n, r = comm.Get_size(), comm.Get_rank()
    stop = threading.Event()
    refused = []

    def hammer():
        x = torch.full((n * 7, 3), -5.0)
        while not stop.wait(0.0005):
            # the wait lets go of the GIL: two threads calling back to back held
            # it for most of each 5 ms switch interval, and the owner's 60 calls
            # took 7 s at 2 x 2 on 2 cores
            try:
                harmpi.alltoall(x, [7] * n, comm=comm)
            except harmpi.HarmpiError as exc:
                refused.append(str(exc))

    threads = [threading.Thread(target=hammer, name=f"caller-{k}") for k in range(2)]
    for t in threads:
        t.start()
    try:
        # 60 calls meet the hammering threads' refusals in every run (150
        # took 22 s at 2 x 2 on 2 cores)
        for call in range(60):
            matrix = _matrix(n, [41, call], 6)
            x, want = inputs("f32", matrix, r, (3,), 500 + call, "torch")
            y, got = harmpi.alltoall(x, matrix[r], comm=comm)
            assert got == matrix[:, r].tolist() and bits(y) == bits(want), f"call {call}"
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert refused and all("thread" in m for m in refused), refused[:1]
    comm.Barrier()


def test_large_segments_go_straight_from_the_sender(small_comm, topo):
    """One node whose ranks may read each other (harmpi.node.cma): a segment
    of CMA_MIN_NBYTES or more is read from its sender's x, a smaller one goes
    through the slots (4 KiB here: several steps), both in one call, with
    uneven counts learned from the data and with recv_counts given; bitwise.
    A pair that disagrees across the switch fails every rank, output
    unwritten, and the next call is right."""
    from harmpi.node import cma
    P, me = small_comm.Get_size(), small_comm.Get_rank()
    if topo.node_count != 1 or P == 1:
        pytest.skip("one node of two ranks or more")
    big = cma.CMA_MIN_NBYTES // 4          # f32 rows of one element: the switch
    for salt, sizes in ((1, (big, big + 1, 3 * big + 5)), (2, (big - 1, 700, big)),
                        (3, (0, big + 9, 5))):
        # rank i sends rank j sizes[(i + j) % 3] rows: direct and slot pairs mixed
        matrix = [[sizes[(i + j) % 3] for j in range(P)] for i in range(P)]
        x, want = inputs("f32", matrix, me, (), salt, "torch")
        out, got_counts = harmpi.alltoall(x, matrix[me], comm=small_comm)
        assert got_counts == [matrix[i][me] for i in range(P)]
        assert bits(out) == bits(want), salt
        out2 = torch.full_like(want, -1.0)
        harmpi.alltoall(x, matrix[me], comm=small_comm, out=out2,
                        recv_counts=[matrix[i][me] for i in range(P)])
        assert bits(out2) == bits(want), salt
    # rank 0 expects one row more from rank 1 than rank 1 sends (across the switch)
    matrix = [[big - 1 if (i, j) == (1, 0) else big for j in range(P)] for i in range(P)]
    x, _ = inputs("f32", matrix, me, (), 4, "torch")
    expect = [big] * P if me == 0 else [matrix[i][me] for i in range(P)]
    out = torch.full((sum(expect),), -1.0)
    with pytest.raises(harmpi.HarmpiMismatchError):
        harmpi.alltoall(x, matrix[me], comm=small_comm, out=out, recv_counts=expect)
    assert torch.all(out == -1.0), "the output must not be written"
    x, want = inputs("f32", [[big] * P] * P, me, (), 5, "torch")
    assert bits(harmpi.alltoall(x, comm=small_comm)) == bits(want)
