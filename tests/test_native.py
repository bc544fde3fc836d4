"""harmpi.native without MPI: the build, what the C++ entry point declines,
and that it hands the kernel the tensor's address, length and format."""

import shutil

import numba
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from harmpi import native, node  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and native.load() is None,
                                reason="no C++ compiler: harmpi keeps its Python path")


@pytest.fixture(scope="module")
def mod():
    native.build()
    m = native.load()
    assert m is not None, native.status()
    yield m
    m.attach(0, 0, 0)


def _recorder(rc):
    """A stand-in kernel: ctl[0..2] = (fmt, x_addr, n); returns rc."""
    @numba.cfunc(native.KERNEL_SIG, nogil=True)
    def kernel(ctl_addr, x_addr, n, fmt):
        ctl = numba.carray(node._voidptr(ctl_addr), (node.C_LEN,), np.int64)
        ctl[0] = fmt
        ctl[1] = x_addr
        ctl[2] = n
        return rc
    return kernel


@pytest.fixture(scope="module")
def kernels():
    return _recorder(0), _recorder(7)


def test_the_build_is_tagged_by_source_and_torch(mod):
    path = native.build()  # already built: returns at once
    assert path.exists() and path.parent.parent == native.BUILD_ROOT
    assert native.status() == "loaded"


def test_nothing_attached_declines_everything(mod):
    mod.attach(0, 0, 0)
    assert mod.allreduce(torch.ones(4)) == -1


def test_hands_the_kernel_address_length_and_format(mod, kernels):
    ctl = np.zeros(node.C_LEN, np.int64)
    ctl[node.C_NATIVE] = 1
    mod.attach(ctl.ctypes.data, node.C_NATIVE, kernels[0].address)
    for fmt, dt in enumerate((torch.bfloat16, torch.float16, torch.float32, torch.float64)):
        t = torch.zeros(2, 3, 5, dtype=dt)[1]  # a contiguous view with an offset
        assert mod.allreduce(t) == 0
        assert list(ctl[:3]) == [fmt, t.data_ptr(), 15]
    empty = torch.zeros(0)
    assert mod.allreduce(empty) == 0 and ctl[2] == 0
    mod.attach(ctl.ctypes.data, node.C_NATIVE, kernels[1].address)
    assert mod.allreduce(torch.ones(3)) == 7  # the kernel's failure status comes back


def test_declines_what_the_python_path_must_judge(mod, kernels):
    ctl = np.zeros(node.C_LEN, np.int64)
    ctl[node.C_NATIVE] = 1
    mod.attach(ctl.ctypes.data, node.C_NATIVE, kernels[0].address)
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
    assert ctl[0] == 0 and ctl[1] == 0, "no kernel ran"
    ctl[node.C_NATIVE] = 0  # the gate: a broken or freed context
    assert mod.allreduce(torch.ones(4)) == -1
