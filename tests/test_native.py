"""harmpi.native without MPI: the build, what the C++ entry point declines,
and that it hands the entry the control block and the tensor's address,
length and format (the format ids it is given, from harmpi.dtypes)."""

import shutil

import numba
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from harmpi import control, dtypes, native, node  # noqa: E402
from harmpi.torch import FORMAT_IDS  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and native.load() is None,
                                reason="no C++ compiler: harmpi keeps its Python path")

_GATE = control.offset("gate")
_FORMATS = tuple(FORMAT_IDS.items())


@pytest.fixture(scope="module")
def mod():
    native.build()
    m = native.load()
    assert m is not None, native.status()
    yield m
    m.attach(0, 0, 0, ())


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


def _ctl(gate=1):
    ctl = control.new()
    ctl[0]["gate"] = gate
    ctl[0]["err_peer"] = -1
    return ctl


def _seen(ctl):
    c = ctl[0]
    return [int(c["err_peer"]), int(c["err_a"]), int(c["err_b"])]


def test_the_build_is_tagged_by_source_and_torch(mod):
    path = native.build()  # already built: returns at once
    assert path.exists() and path.parent.parent == native.BUILD_ROOT
    assert native.status() == "loaded"


def test_formats_come_from_the_one_dtype_table():
    assert {str(dt).removeprefix("torch.") for dt in FORMAT_IDS} == \
        {f.torch_name for f in dtypes.FORMATS}
    assert all(dtypes.FORMATS[i].torch_name == str(dt).removeprefix("torch.")
               for dt, i in FORMAT_IDS.items())


def test_nothing_attached_declines_everything(mod):
    mod.attach(0, 0, 0, ())
    assert mod.allreduce(torch.ones(4)) == -1


def test_hands_the_entry_address_length_and_format(mod, entries):
    ctl = _ctl()
    mod.attach(ctl.ctypes.data, _GATE, entries[0].address, _FORMATS)
    for f in dtypes.FORMATS:
        t = torch.zeros(2, 3, 5, dtype=getattr(torch, f.torch_name))[1]  # offset view
        assert mod.allreduce(t) == 0
        assert _seen(ctl) == [f.id, t.data_ptr(), 15]
    assert mod.allreduce(torch.zeros(0)) == 0 and _seen(ctl)[2] == 0
    mod.attach(ctl.ctypes.data, _GATE, entries[1].address, _FORMATS)
    assert mod.allreduce(torch.ones(3)) == 7  # the entry's failure status comes back


def test_only_the_formats_it_was_given(mod, entries):
    ctl = _ctl()
    given = ((torch.float32, 5),)                 # any id: it is passed through
    mod.attach(ctl.ctypes.data, _GATE, entries[0].address, given)
    assert mod.allreduce(torch.ones(2, dtype=torch.float64)) == -1
    assert mod.allreduce(torch.ones(2)) == 0 and _seen(ctl)[0] == 5
    with pytest.raises(ValueError, match="torch.dtype"):
        mod.attach(ctl.ctypes.data, _GATE, entries[0].address, (("float32", 2),))


def test_declines_what_the_python_path_must_judge(mod, entries):
    ctl = _ctl()
    mod.attach(ctl.ctypes.data, _GATE, entries[0].address, _FORMATS)
    declined = [
        np.ones(4, np.float32),                                   # not a tensor
        "text",
        torch.ones(4, dtype=torch.int32),                         # dtype
        torch.ones(4, dtype=torch.complex64),
        torch.ones(4, 4)[:, 0],                                   # not contiguous
        torch.ones(4, requires_grad=True),                        # autograd
        torch.ones(4).to_sparse(),                                # layout
    ]
    for x in declined:
        assert mod.allreduce(x) == -1, x
    assert _seen(ctl)[0] == -1, "no entry ran"
    ctl[0]["gate"] = 0  # the gate: a broken or freed context
    assert mod.allreduce(torch.ones(4)) == -1
