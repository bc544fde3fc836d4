"""harmpi.native without MPI: the built module and its torch version check,
what the hot path declines, that it hands the entry the control block and
the tensor's address, length and format (the ids it is given, from
harmpi.base.dtypes), and the operators torch.ops.harmpi.all_reduce_ (in place),
all_reduce (out of place) and all_reduce_inplace (in place, no result):
their CPU kernels (the entry, or the fallback with the status and group),
their Meta/fake kernels, and torch.compile against eager code where the
reduced tensor is aliased, viewed, an input of the graph or the output of a
fused op; and that inductor sums a graph's buffer in place with the third."""

import os
import shutil

import numba
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from harmpi import HarmpiError, native, node  # noqa: E402
from harmpi.base import control, dtypes  # noqa: E402
from harmpi.runtime.registry import STATE  # noqa: E402
from harmpi.runtime.torchbuf import FORMAT_IDS  # noqa: E402

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None and native.load() is None,
    reason="no C++ compiler: harmpi._C is not built and harmpi keeps its Python path")

_GATE = control.offset("gate")
_FORMATS = tuple(FORMAT_IDS.items())


@pytest.fixture(scope="module")
def mod():
    m = native.load()
    assert m is not None, native.status()
    yield m
    native.detach()
    STATE.attach_native()  # back to the world context, if a test module made one


@pytest.fixture
def op(mod):
    return torch.ops.harmpi.all_reduce_


def _recorder(rc):
    """A stand-in entry: records (fmt, x_addr, n) in the control block's
    err_* fields and returns rc."""
    @numba.cfunc(node.CFUNC_SIG, nogil=True)
    def entry(ctl_addr, x_addr, n, fmt):
        c = control.control_at(ctl_addr)[0]
        c.err_peer = fmt
        c.err_a = x_addr
        c.err_b = n
        return rc
    return entry


@pytest.fixture(scope="module")
def entries():
    return _recorder(0), _recorder(7)


_F32 = FORMAT_IDS[torch.float32]


@pytest.fixture(scope="module")
def doubling():
    """A stand-in entry that changes the data, as a sum over two ranks that
    hold the same tensor does: float32 x *= 2 (other formats as they are).
    Against an entry that leaves x alone, a compiled graph that reads the
    buffer at the wrong moment would go unseen."""
    @numba.cfunc(node.CFUNC_SIG, nogil=True)
    def entry(ctl_addr, x_addr, n, fmt):
        c = control.control_at(ctl_addr)[0]
        c.err_peer = fmt
        c.err_a = x_addr
        c.err_b = n
        if fmt == _F32:
            x = numba.carray(control.voidptr(x_addr), (n,), numba.float32)
            for i in range(n):
                x[i] *= 2
        return 0
    return entry


def _ctl(gate=1):
    ctl = control.new()
    ctl[0]["gate"] = gate
    ctl[0]["err_peer"] = -1
    return ctl


def _seen(ctl):
    c = ctl[0]
    return [int(c["err_peer"]), int(c["err_a"]), int(c["err_b"])]


class Fallback:
    """A stand-in for native._fallback: records (tensor, rc); raises ``exc``."""

    def __init__(self, exc=None):
        self.calls = []
        self.exc = exc

    def __call__(self, t, rc, group=""):
        self.calls.append((t, rc, group) if group else (t, rc))
        if self.exc is not None:
            raise self.exc


def _attached(mod, entry, fallback=...):
    """A fresh control block with ``entry`` attached (and ``fallback``: a new
    Fallback unless given): (ctl, fallback)."""
    ctl = _ctl()
    if fallback is ...:
        fallback = Fallback()
    mod.attach(ctl.ctypes.data, _GATE, entry.address, _FORMATS, fallback)
    return ctl, fallback


def test_built_against_this_torch(mod):
    assert native.built_against(native._module_file()) == torch.__version__ == mod.TORCH_VERSION
    assert native.status() == "loaded"
    assert native.load() is mod  # idempotent


def _fresh_load(monkeypatch, module_file):
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_status", "not loaded yet")
    monkeypatch.setattr(native, "_module_file", lambda: module_file)
    return native.load()


def test_refuses_a_module_built_against_another_torch(monkeypatch, tmp_path):
    other = tmp_path / "_C.so"
    other.write_bytes(b"\x7fELF..." + native.VERSION_MARKER + b"1.13.1+cu117\0...")
    assert native.built_against(other) == "1.13.1+cu117"
    assert _fresh_load(monkeypatch, str(other)) is None
    assert "built against torch 1.13.1+cu117" in native.status()
    assert f"this is torch {torch.__version__}" in native.status()
    other.write_bytes(b"\x7fELF no marker")
    assert _fresh_load(monkeypatch, str(other)) is None
    assert "built against torch (unknown)" in native.status()


def test_not_built(monkeypatch):
    assert _fresh_load(monkeypatch, None) is None
    assert native.status().startswith("not built")


def test_formats_come_from_the_one_dtype_table():
    assert {str(dt).removeprefix("torch.") for dt in FORMAT_IDS} == \
        {f.torch_name for f in dtypes.FORMATS}
    assert all(dtypes.FORMATS[i].torch_name == str(dt).removeprefix("torch.")
               for dt, i in FORMAT_IDS.items())


def test_nothing_attached_declines_everything(mod):
    mod.attach(0, 0, 0, (), None)
    assert mod.allreduce(torch.ones(4)) == -1


def test_hands_the_entry_address_length_and_format(mod, entries):
    ctl, _ = _attached(mod, entries[0], None)
    for f in dtypes.FORMATS:
        t = torch.zeros(2, 3, 5, dtype=getattr(torch, f.torch_name))[1]  # offset view
        assert mod.allreduce(t) == 0
        assert _seen(ctl) == [f.id, t.data_ptr(), 15]
    assert mod.allreduce(torch.zeros(0)) == 0 and _seen(ctl)[2] == 0
    mod.attach(ctl.ctypes.data, _GATE, entries[1].address, _FORMATS, None)
    assert mod.allreduce(torch.ones(3)) == 7  # the entry's failure status comes back


def test_the_torch_distributed_path_serves_only_a_synchronous_sum(mod, entries):
    """allreduce_sum([t], opts): harmpi.distributed's default-group hot path."""
    import torch.distributed as dist

    ctl, _ = _attached(mod, entries[0], None)
    t = torch.ones(6)
    for op, async_op, rc in ((dist.ReduceOp.SUM, False, 0), (dist.ReduceOp.SUM, True, -2),
                             (dist.ReduceOp.AVG, False, -2), (dist.ReduceOp.MAX, False, -2)):
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        opts.asyncOp = async_op
        ctl[0]["err_b"] = -1
        assert mod.allreduce_sum([t], opts) == rc
        assert _seen(ctl)[2] == (6 if rc == 0 else -1)  # the entry ran only for the sum
    sync = dist.AllreduceOptions()
    sync.asyncOp = False
    assert mod.allreduce_sum([t, t], sync) == -1          # two tensors: the Python path
    assert mod.allreduce_sum([torch.ones(2, 2).t()], sync) == -1  # declined like allreduce(t)
    assert mod.allreduce_sum([t], None) == -2             # not an options object


def test_only_the_formats_it_was_given(mod, entries):
    ctl = _ctl()
    given = ((torch.float32, 5),)                 # any id: it is passed through
    mod.attach(ctl.ctypes.data, _GATE, entries[0].address, given, None)
    assert mod.allreduce(torch.ones(2, dtype=torch.float64)) == -1
    assert mod.allreduce(torch.ones(2)) == 0 and _seen(ctl)[0] == 5
    with pytest.raises(TypeError, match="torch.dtype"):
        mod.attach(ctl.ctypes.data, _GATE, entries[0].address, (("float32", 2),), None)
    with pytest.raises(ValueError, match="0..127"):
        mod.attach(ctl.ctypes.data, _GATE, entries[0].address, ((torch.float32, 128),), None)


def _declined():
    return [
        torch.ones(4, dtype=torch.int32),                         # dtype
        torch.ones(4, dtype=torch.complex64),
        torch.ones(4, 4)[:, 0],                                   # not contiguous
        torch.ones(4, requires_grad=True),                        # autograd
        torch.ones(4).to_sparse(),                                # layout
    ]


def test_declines_what_the_python_path_must_judge(mod, entries):
    ctl, _ = _attached(mod, entries[0], None)
    for x in [np.ones(4, np.float32), "text", *_declined()]:   # not a tensor, then tensors
        assert mod.allreduce(x) == -1, x
    assert _seen(ctl)[0] == -1, "no entry ran"
    ctl[0]["gate"] = 0  # the gate: a broken or freed context
    assert mod.allreduce(torch.ones(4)) == -1


def test_the_operator_calls_the_entry_in_place(mod, op, entries):
    ctl, fallback = _attached(mod, entries[0])
    t = torch.zeros(2, 3, 5, dtype=torch.bfloat16)[1]
    assert op(t) is t
    assert _seen(ctl) == [FORMAT_IDS[torch.bfloat16], t.data_ptr(), 15]
    assert op.default(t) is t and not fallback.calls


def test_the_operator_hands_the_rest_to_the_fallback(mod, op, entries):
    ctl, fallback = _attached(mod, entries[1])
    t = torch.ones(3)
    assert op(t) is t
    assert fallback.calls == [(t, 7)]  # the entry's failure: the fallback raises it
    mod.attach(ctl.ctypes.data, _GATE, entries[0].address, _FORMATS, fallback)
    for x in _declined()[:-1]:      # (a sparse tensor has no CPU kernel to reach)
        fallback.calls.clear()
        assert op(x) is x
        assert len(fallback.calls) == 1 and fallback.calls[0][0] is x, x
        assert fallback.calls[0][1] == -1
    fallback.calls.clear()
    ctl[0]["err_peer"] = -1
    mod.attach(0, 0, 0, (), fallback)  # nothing attached: the Python path makes the context
    assert op(t) is t and fallback.calls == [(t, -1)]
    assert _seen(ctl)[0] == -1, "no entry ran"


def test_a_fallback_error_reaches_the_caller_unchanged(mod, op, entries):
    error = HarmpiError("rank 1: allreduce: test failure")
    ctl, _ = _attached(mod, entries[1], Fallback(error))
    with pytest.raises(HarmpiError, match="rank 1: allreduce: test failure") as info:
        op(torch.ones(3))
    assert info.value is error
    mod.attach(0, 0, 0, (), None)
    with pytest.raises(RuntimeError, match="no fallback attached"):
        op(torch.ones(3))


def test_the_meta_kernel_gives_the_input_back(op):
    m = torch.empty(4, 6, dtype=torch.bfloat16, device="meta")
    assert op(m) is m
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.ones(3, 5))
        y = op(x)
    assert y is x and y.shape == (3, 5) and y.dtype == torch.float32


def test_opcheck_schema_fake_and_functionalization(mod, op, entries):
    """torch.library.opcheck: the schema's mutation claim, the fake kernel
    against the real one, autograd registration, and AOT dispatch."""
    ctl, _ = _attached(mod, entries[0])
    for dtype in (torch.float32, torch.bfloat16):
        torch.library.opcheck(op.default, (torch.ones(2, 3, dtype=dtype),))


def test_torch_compile_fullgraph(mod, op, entries):
    ctl, fallback = _attached(mod, entries[0])

    def f(x):
        y = x * 2
        op(y)
        return y + 1

    x = torch.arange(6, dtype=torch.float32)
    out = torch.compile(f, fullgraph=True)(x)
    assert torch.equal(out, x * 2 + 1)  # the stand-in entry leaves y as it is
    assert _seen(ctl)[0] == FORMAT_IDS[torch.float32] and _seen(ctl)[2] == 6
    assert not fallback.calls


@pytest.fixture
def op_out(mod):
    return torch.ops.harmpi.all_reduce


def test_the_out_of_place_operator_leaves_its_input(mod, op_out, entries):
    ctl, fallback = _attached(mod, entries[0])
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    # contiguous (memcpy; from an offset too), or not (copy_): it copies first
    for src in (x, x[1:], x[:, 1:], x.t(), x[:0]):
        y = op_out(src)
        assert y is not src and y.is_contiguous() and torch.equal(y, src)
        if src.numel():
            assert y.data_ptr() != src.data_ptr()
            assert _seen(ctl) == [FORMAT_IDS[torch.float32], y.data_ptr(), src.numel()]
    assert torch.equal(x, torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert not fallback.calls


def test_a_named_group_takes_the_fallback(mod, op, op_out, entries):
    """The entry serves the world only; a group name goes to the Python side."""
    ctl, fallback = _attached(mod, entries[0])
    t = torch.ones(5)
    assert op(t, "tp0") is t
    y = op_out(t, group="tp0")
    assert [c[1:] for c in fallback.calls] == [(-1, "tp0"), (-1, "tp0")]
    assert fallback.calls[0][0] is t and fallback.calls[1][0].data_ptr() == y.data_ptr()
    assert _seen(ctl)[0] == -1, "no entry ran"


def test_an_unknown_group_name_is_refused(mod, monkeypatch):
    monkeypatch.setattr(native, "_groups", {})
    mod.attach(0, 0, 0, (), native._fallback)
    try:
        with pytest.raises(HarmpiError, match="no communicator is named 'nope'"):
            torch.ops.harmpi.all_reduce(torch.ones(2), "nope")
        with pytest.raises(HarmpiError, match="non-empty str"):
            native.name_group("", object())
    finally:
        mod.attach(0, 0, 0, (), native._fallback)


def test_the_out_of_place_meta_kernel(op_out):
    m = torch.empty(6, 4, dtype=torch.bfloat16, device="meta").t()
    y = op_out(m)
    assert y.device.type == "meta" and y.shape == (4, 6) and y.is_contiguous()
    assert y.dtype == torch.bfloat16


def test_opcheck_of_the_out_of_place_operator(mod, op_out, entries):
    ctl, _ = _attached(mod, entries[0])
    for dtype in (torch.float32, torch.bfloat16):
        torch.library.opcheck(op_out.default, (torch.ones(2, 3, dtype=dtype),))
        torch.library.opcheck(op_out.default, (torch.ones(3, 2, dtype=dtype).t(), "g"))


# Functions in which compiled code used to differ from eager code: the
# in-place operator's result is an alias of its input, and torch's generic
# functionalization of ops tagged inplace lost that alias (see harmpi.native);
# and functions where a graph must order a no-result sum against reads of
# the same buffer. With the doubling stand-in entry eager and compiled code
# must agree exactly.

def _mutate_the_result(x):
    y = torch.ops.harmpi.all_reduce_(x)
    y.mul_(2)
    return x + y


def _mutate_the_input(x):
    y = torch.ops.harmpi.all_reduce_(x)
    x.add_(1)
    return y * 3


def _a_view_of_a_fused_result(x):
    h = x * 3 + 1
    torch.ops.harmpi.all_reduce_(h[1:])
    return h


def _no_result_on_a_fused_buffer(x):
    h = x * 3 + 1
    torch.ops.harmpi.all_reduce_inplace(h)
    return h + x


def _no_result_on_the_input_and_a_view(x):
    torch.ops.harmpi.all_reduce_inplace(x)
    v = x[1:3]
    torch.ops.harmpi.all_reduce_inplace(v)
    v.add_(1)
    return x * 2


def _no_result_then_reused_before(x):
    h = x + 1
    keep = h * 1  # a value of h taken before the sum must not see it
    torch.ops.harmpi.all_reduce_inplace(h)
    return keep, h


def _out_of_place_then_mutate(x):
    y = torch.ops.harmpi.all_reduce(x[:, 1:] * 2 + 1)
    y.add_(x[:, :-1])
    x.mul_(2)
    return y, x


@pytest.mark.parametrize("f", [_mutate_the_result, _mutate_the_input, _a_view_of_a_fused_result,
                               _out_of_place_then_mutate, _no_result_on_a_fused_buffer,
                               _no_result_on_the_input_and_a_view, _no_result_then_reused_before])
def test_compiled_equals_eager(mod, doubling, f):
    ctl, fallback = _attached(mod, doubling)
    torch._dynamo.reset()
    x0 = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    eager_x = x0.clone()
    eager = f(eager_x)
    compiled_x = x0.clone()
    compiled = torch.compile(f, fullgraph=True)(compiled_x)
    for e, c in zip(eager if isinstance(eager, tuple) else (eager,),
                    compiled if isinstance(compiled, tuple) else (compiled,)):
        assert torch.equal(e, c), (f.__name__, e, c)
    assert torch.equal(eager_x, compiled_x), "the graph input's mutation differs"
    assert not fallback.calls


@pytest.mark.parametrize("inplace", [False, True, "none"])
def test_dynamic_shapes_stay_symbolic(mod, entries, inplace):
    """vLLM compiles its model with the token count marked dynamic: the
    operators' Meta kernels must keep a symbolic size symbolic (reading
    concrete sizes pinned it, and dynamo raised ConstraintViolationError)."""
    ctl, _ = _attached(mod, entries[0])
    torch._dynamo.reset()

    def f(x):
        h = x * 2
        if inplace == "none":
            torch.ops.harmpi.all_reduce_inplace(h)
            return h + 1
        if inplace:
            torch.ops.harmpi.all_reduce_(h)
            return h + 1
        return torch.ops.harmpi.all_reduce(h) + 1

    compiled = torch.compile(f, fullgraph=True)
    for rows in (5, 7, 64):
        x = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
        torch._dynamo.mark_dynamic(x, 0)
        assert torch.equal(compiled(x), x * 2 + 1)


# all_reduce_inplace: in place, no result (vLLM's plug-in; vLLM's graph)

@pytest.fixture
def op_none(mod):
    return torch.ops.harmpi.all_reduce_inplace


def test_the_no_result_operator_sums_in_place(mod, op_none, entries):
    ctl, fallback = _attached(mod, entries[0])
    t = torch.zeros(2, 3, 5, dtype=torch.bfloat16)[1]
    assert op_none(t) is None
    assert _seen(ctl) == [FORMAT_IDS[torch.bfloat16], t.data_ptr(), 15]
    assert not fallback.calls
    # what the entry declines, a failure and a named group: the fallback, given t itself
    mod.attach(ctl.ctypes.data, _GATE, entries[1].address, _FORMATS, fallback)
    op_none(t)
    mod.attach(ctl.ctypes.data, _GATE, entries[0].address, _FORMATS, fallback)
    x = torch.ones(4, 6)[:, 1:]
    op_none(x)
    op_none(t, "tp0")
    assert [(c[0] is want, c[1:]) for c, want in zip(fallback.calls, (t, x, t))] == [
        (True, (7,)), (True, (-1,)), (True, (-1, "tp0"))]


def test_opcheck_of_the_no_result_operator(mod, op_none, entries):
    ctl, _ = _attached(mod, entries[0])
    m = torch.empty(4, 6, dtype=torch.bfloat16, device="meta")
    assert op_none(m) is None
    for dtype in (torch.float32, torch.bfloat16):
        torch.library.opcheck(op_none.default, (torch.ones(2, 3, dtype=dtype),))


def test_inductor_sums_the_graph_buffer_where_it_lies(mod, op_none, doubling):
    """The point of the operator: in a compiled graph whose buffer is not
    read again (vLLM's matmul output), inductor calls it on that buffer:
    no clone, no output of its own, no check of a returned tensor."""
    from torch._inductor.utils import run_and_get_code
    ctl, _ = _attached(mod, doubling)
    torch._dynamo.reset()

    def f(x, w):
        h = x @ w
        op_none(h)
        return h + 1

    x, w = torch.randn(3, 8), torch.randn(8, 8)
    out, (code, *_) = run_and_get_code(torch.compile(f, fullgraph=True), x, w)
    assert torch.allclose(out, 2 * (x @ w) + 1)
    calls = [line for line in code.splitlines() if "harmpi.all_reduce_inplace.default(" in line]
    assert len(calls) == 1, code
    assert "clone" not in code and "auto_functionalized" not in code, code
    assert _seen(ctl)[0] == FORMAT_IDS[torch.float32] and _seen(ctl)[2] == 24
