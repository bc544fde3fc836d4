// harmpi's native entry point for the hottest call: harmpi.allreduce(t) on a
// CPU torch tensor with every other argument at its default.
//
// Python spends ~0.7 us per call getting there (a dozen torch attribute
// calls and numba's argument unboxing); this module does the same checks on
// the C++ tensor in ~0.05 us and calls the world context's compiled entry
// (a numba cfunc f(ctl_addr, x_addr, n, fmt) -> status, see harmpi/node.py)
// through a plain function pointer.
//
// It holds no table of its own: attach() receives the control block's
// address, the byte offset of its gate field, the entry, and the torch
// dtype -> format id pairs of harmpi.dtypes. It never raises and never
// decides anything the Python path would decide differently: allreduce(t)
// returns -1 ("not mine, take the Python path") for anything but a dense,
// contiguous CPU tensor of an attached format that does not require grad,
// or when no context is attached or its gate is 0 (broken or freed); else
// it returns the entry's status (0 = done, > 0 = the failure the Python
// side reports).

#include <Python.h>

#include <array>
#include <cstdint>

#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {

using entry_t = int64_t (*)(int64_t ctl_addr, int64_t x_addr, int64_t n, int64_t fmt);

constexpr size_t kScalarTypes = 256;

// the attached context: its control block, the gate field's offset, the
// entry, and the format id of each torch scalar type (-1: not served)
const char* g_ctl = nullptr;
int64_t g_gate_offset = 0;
entry_t g_entry = nullptr;
std::array<int8_t, kScalarTypes> g_format = [] {
  std::array<int8_t, kScalarTypes> a{};
  a.fill(-1);
  return a;
}();

bool gate_open() {
  return *reinterpret_cast<const volatile int64_t*>(g_ctl + g_gate_offset) != 0;
}

PyObject* allreduce(PyObject*, PyObject* obj) {
  if (g_ctl == nullptr || g_entry == nullptr || !gate_open() || !THPVariable_Check(obj)) {
    return PyLong_FromLong(-1);
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  const auto type = static_cast<size_t>(t.scalar_type());
  const int fmt = type < kScalarTypes ? g_format[type] : -1;
  if (fmt < 0 || t.layout() != at::kStrided || !t.is_cpu() || !t.is_contiguous() ||
      t.requires_grad()) {
    return PyLong_FromLong(-1);
  }
  const int64_t x_addr = reinterpret_cast<int64_t>(t.data_ptr());
  const int64_t n = t.numel();
  const entry_t entry = g_entry;
  const int64_t ctl_addr = reinterpret_cast<int64_t>(g_ctl);
  int64_t rc;
  // the entry may wait for other ranks: other Python threads keep running
  Py_BEGIN_ALLOW_THREADS
  rc = entry(ctl_addr, x_addr, n, fmt);
  Py_END_ALLOW_THREADS
  return PyLong_FromLongLong(rc);
}

// attach(ctl_addr, gate_offset, entry_addr, ((torch.dtype, fmt), ...));
// attach(0, 0, 0, ()) detaches
PyObject* attach(PyObject*, PyObject* args) {
  long long ctl = 0, gate = 0, entry = 0;
  PyObject* formats = nullptr;
  if (!PyArg_ParseTuple(args, "LLLO", &ctl, &gate, &entry, &formats)) {
    return nullptr;
  }
  PyObject* seq = PySequence_Fast(formats, "formats must be a sequence of (dtype, id) pairs");
  if (seq == nullptr) {
    return nullptr;
  }
  std::array<int8_t, kScalarTypes> table{};
  table.fill(-1);
  const Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* dtype = nullptr;
    int id = -1;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "Oi", &dtype, &id)) {
      Py_DECREF(seq);
      return nullptr;
    }
    if (!THPDtype_Check(dtype) || id < 0 || id > 127) {
      Py_DECREF(seq);
      PyErr_SetString(PyExc_ValueError, "each format must be (torch.dtype, id in 0..127)");
      return nullptr;
    }
    table[static_cast<size_t>(reinterpret_cast<THPDtype*>(dtype)->scalar_type)] =
        static_cast<int8_t>(id);
  }
  Py_DECREF(seq);
  g_ctl = reinterpret_cast<const char*>(ctl);
  g_gate_offset = gate;
  g_entry = reinterpret_cast<entry_t>(entry);
  g_format = table;
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"allreduce", allreduce, METH_O,
     "allreduce(t) -> -1 (not handled here) or the entry's status (0: done)"},
    {"attach", attach, METH_VARARGS,
     "attach(ctl_addr, gate_offset, entry_addr, formats): the context to serve (0: none)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_harmpi_native", nullptr, -1, methods,
                      nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__harmpi_native(void) { return PyModule_Create(&module); }
