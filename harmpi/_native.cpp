// harmpi's native entry point for the hottest call: harmpi.allreduce(t) on a
// CPU torch tensor, on one node, with everything else at its default.
//
// Python spends ~0.7 us per call getting there (a dozen torch attribute
// calls and numba's argument unboxing); this module does the same checks on
// the C++ tensor in ~0.05 us and calls the numba-compiled kernel (a cfunc,
// see harmpi/native.py) through a plain function pointer.
//
// It never raises and never decides anything the Python path would decide
// differently: allreduce(t) returns -1 ("not mine, take the Python path")
// for anything but a dense, contiguous CPU tensor of a supported dtype that
// does not require grad, or when no context is attached or the attached
// context's gate word is 0 (broken or finalized); else it returns the
// kernel's status (0 = done, > 0 = the failure the Python side reports).

#include <Python.h>

#include <cstdint>

#include <torch/csrc/autograd/python_variable.h>

namespace {

using kernel_t = int64_t (*)(int64_t ctl_addr, int64_t x_addr, int64_t n, int64_t fmt);

// the attached context: its control array, the index of its gate word, and
// the kernel (it takes the storage format: 0 bf16, 1 f16, 2 f32, 3 f64)
const int64_t* g_ctl = nullptr;
int64_t g_gate = 0;
kernel_t g_kernel = nullptr;

int format_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return 0;
    case at::kHalf: return 1;
    case at::kFloat: return 2;
    case at::kDouble: return 3;
    default: return -1;
  }
}

PyObject* allreduce(PyObject*, PyObject* obj) {
  if (g_ctl == nullptr || g_kernel == nullptr || g_ctl[g_gate] == 0 || !THPVariable_Check(obj)) {
    return PyLong_FromLong(-1);
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  const int fmt = format_of(t);
  if (fmt < 0 || t.layout() != at::kStrided || !t.is_cpu() || !t.is_contiguous() ||
      t.requires_grad()) {
    return PyLong_FromLong(-1);
  }
  const int64_t x_addr = reinterpret_cast<int64_t>(t.data_ptr());
  const int64_t n = t.numel();
  const kernel_t kernel = g_kernel;
  const int64_t ctl_addr = reinterpret_cast<int64_t>(g_ctl);
  int64_t rc;
  // the kernel may wait for other ranks: other Python threads keep running
  Py_BEGIN_ALLOW_THREADS
  rc = kernel(ctl_addr, x_addr, n, fmt);
  Py_END_ALLOW_THREADS
  return PyLong_FromLongLong(rc);
}

// attach(ctl_addr, gate_index, kernel_addr); attach(0, 0, 0) detaches
PyObject* attach(PyObject*, PyObject* args) {
  long long ctl = 0, gate = 0, kernel = 0;
  if (!PyArg_ParseTuple(args, "LLL", &ctl, &gate, &kernel)) {
    return nullptr;
  }
  g_ctl = reinterpret_cast<const int64_t*>(ctl);
  g_gate = gate;
  g_kernel = reinterpret_cast<kernel_t>(kernel);
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"allreduce", allreduce, METH_O,
     "allreduce(t) -> -1 (not handled here) or the kernel's status (0: done)"},
    {"attach", attach, METH_VARARGS,
     "attach(ctl_addr, gate_index, kernel_addr): the context to serve (0: none)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_harmpi_native", nullptr, -1, methods,
                      nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__harmpi_native(void) { return PyModule_Create(&module); }
