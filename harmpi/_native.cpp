// harmpi._C: the native part of harmpi, built at install by setup.py with
// torch's extension tooling (harmpi/runtime/native.py loads it).
//
// It serves the world communicator's context when its entry is compiled (one
// node, or one rank; harmpi.context), three ways:
//   allreduce(t) -> int               the hot path of harmpi.allreduce(t)
//   torch.ops.harmpi.all_reduce_(t, group="")  in place, returns t (CPU, Meta and
//                                     Functionalize kernels)
//   torch.ops.harmpi.all_reduce(x, group="")   out of place, returns a new tensor
//                                     (CPU and Meta kernels)
//   allgather(t), alltoall(t) -> tensor or int   the hot paths of harmpi.allgather(t)
//                                     (dim 0) and harmpi.alltoall(t) (an even split)
// group "" is the world; another name is a communicator bound to it on the
// Python side (harmpi.native.name_group), which the fallback serves.
// Both check the tensor on torch's C++ side and call that entry (a numba
// cfunc f(ctl_addr, x_addr, n, fmt) -> status, see harmpi/node.py) through a
// plain function pointer: ~0.05 us instead of ~1 us of Python per call.
//
// It holds no table of its own: attach() receives the control block's
// address, the byte offset of its gate field, the entry, the torch dtype ->
// format id pairs of harmpi.dtypes, and the Python fallback. A tensor is
// "not mine" (-1) unless it is a dense, contiguous CPU tensor of an attached
// format that does not require grad, and a context is attached with its gate
// open (Context closes it when the context breaks or is freed); otherwise
// the entry's status comes back (0 = done, > 0 = the failure the Python side
// reports). allreduce(t) returns that number and never raises; the
// operator's CPU kernel hands anything but 0 to fallback(t, rc, group), which runs
// the Python path (rc == -1; it also makes the world context on first use)
// or raises the HarmpiError (rc > 0), so the operator behaves exactly like
// harmpi.allreduce(t).

#include <torch/extension.h>
#include <ATen/EmptyTensor.h>
#include <ATen/FunctionalTensorWrapper.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifndef HARMPI_TORCH_VERSION
#error "HARMPI_TORCH_VERSION (torch.__version__ at build time) is undefined: build with setup.py"
#endif

// harmpi.native reads this from the file before loading it and refuses a
// module built against another torch.
extern "C" __attribute__((used)) const char harmpi_built_against_torch[] =
    "harmpi-built-against-torch=" HARMPI_TORCH_VERSION;

namespace {

namespace py = pybind11;

using entry_t = int64_t (*)(int64_t ctl_addr, int64_t x_addr, int64_t n, int64_t fmt);

constexpr int64_t kNotMine = -1;
constexpr size_t kScalarTypes = static_cast<size_t>(at::ScalarType::NumOptions);

// The attached context (ctl == nullptr: none).
struct Served {
  const char* ctl = nullptr;   // its control block (harmpi/base/control.py)
  int64_t gate_offset = 0;     // byte offset of the control block's gate field
  entry_t entry = nullptr;     // its compiled entry
  std::array<int8_t, kScalarTypes> format = [] {  // format id per scalar type (-1: not served)
    std::array<int8_t, kScalarTypes> a{};
    a.fill(-1);
    return a;
  }();
};

Served g_served;

// The attached context's all-to-all (one node): its compiled step
// f(ctl, x, out, row_nbytes, plan, code) -> status (harmpi/algorithms/alltoall/),
// the plan array it fills, the number of ranks, and how the kind word is
// made (harmpi/base/kind.py: format | collective | digest of the row shape).
using a2a_entry_t = int64_t (*)(int64_t ctl_addr, int64_t x_addr, int64_t out_addr,
                                int64_t row_nbytes, int64_t plan_addr, int64_t code);
struct ServedAlltoall {
  a2a_entry_t entry = nullptr;
  int64_t nranks = 0;
  int64_t coll_bits = 0;     // the collective field, in place
  int64_t digest_shift = 0;
  int64_t digest_mask = 0;
};
ServedAlltoall g_a2a;

// The attached context's allgather (one node): its compiled step
// f(ctl, x, out, n, fmt, digest) -> status (harmpi/node/entries.py: gather_step),
// the number of ranks and the digest field's width (harmpi/kind.py).
using gather_entry_t = int64_t (*)(int64_t ctl_addr, int64_t x_addr, int64_t out_addr,
                                   int64_t n, int64_t fmt, int64_t digest);
struct ServedAllgather {
  gather_entry_t entry = nullptr;
  int64_t nranks = 0;
  int64_t digest_mask = 0;
};
ServedAllgather g_gather;
// fallback(t, rc), an owned reference (nullptr: none). Never released at
// process exit: the interpreter may be gone by then.
PyObject* g_fallback = nullptr;

// the format id to reduce t with, or kNotMine
int format_of(const at::Tensor& t) {
  const Served& s = g_served;
  if (s.ctl == nullptr ||
      *reinterpret_cast<const volatile int64_t*>(s.ctl + s.gate_offset) == 0) {
    return kNotMine;
  }
  const int fmt = s.format[static_cast<size_t>(t.scalar_type())];
  if (fmt < 0 || t.layout() != at::kStrided || !t.is_cpu() || !t.is_contiguous() ||
      t.requires_grad()) {
    return kNotMine;
  }
  return fmt;
}

// the entry's status; it may wait for other ranks, so callers drop the GIL.
// kNotMine where the context's all-reduce is not compiled (several nodes:
// the context is attached for its all-to-all alone)
int64_t run_entry(const at::Tensor& t, int fmt) {
  const Served& s = g_served;
  if (s.entry == nullptr) {
    return kNotMine;
  }
  return s.entry(reinterpret_cast<int64_t>(s.ctl), reinterpret_cast<int64_t>(t.data_ptr()),
                 t.numel(), fmt);
}

// harmpi.allreduce(t)'s hot path: kNotMine or the entry's status; never raises
int64_t allreduce(py::handle obj) {
  py::detail::make_caster<at::Tensor> tensor;
  if (!tensor.load(obj, false)) {
    return kNotMine;
  }
  const at::Tensor& t = py::detail::cast_op<const at::Tensor&>(tensor);
  const int fmt = format_of(t);
  if (fmt < 0) {
    return kNotMine;
  }
  py::gil_scoped_release unlocked;  // other Python threads run while ranks wait
  return run_entry(t, fmt);
}

// torch.distributed's hot path (harmpi.distributed: ProcessGroupHarmpi.allreduce
// on the default group): ([t], opts) -> kNotSum unless opts ask for a
// synchronous SUM, else what allreduce(t) returns. Reading opts.reduceOp
// from Python costs ~0.35 us (a ReduceOp object is made per read); here it
// is a field load.
constexpr int64_t kNotSum = -2;

// AllreduceOptions::asyncOp where this torch has it (2.8 on; 2.6 and 2.7
// lack it), found by the struct's members as the tag below is: without it
// the options say nothing of async_op, which Python's dist.all_reduce then
// honours by waiting on the Work, so the call is synchronous here.
template <typename O, typename = void>
struct HasAsyncOp : std::false_type {};
template <typename O>
struct HasAsyncOp<O, std::void_t<decltype(std::declval<O>().asyncOp)>> : std::true_type {};

template <typename O>
bool async_op(const O& o) {
  if constexpr (HasAsyncOp<O>::value) {
    return o.asyncOp;
  } else {
    return false;
  }
}

int64_t allreduce_sum(py::handle tensors, py::handle opts) {
  py::detail::make_caster<c10d::AllreduceOptions> options;
  if (!options.load(opts, false)) {
    return kNotSum;
  }
  const auto& o = py::detail::cast_op<const c10d::AllreduceOptions&>(options);
  if (async_op(o) || o.reduceOp.op_ != c10d::ReduceOp::SUM) {
    return kNotSum;
  }
  if (!PyList_Check(tensors.ptr()) || PyList_GET_SIZE(tensors.ptr()) != 1) {
    return kNotMine;
  }
  return allreduce(py::handle(PyList_GET_ITEM(tensors.ptr(), 0)));
}

void attach(int64_t ctl_addr, int64_t gate_offset, int64_t entry_addr,
            const std::vector<std::pair<at::ScalarType, int>>& formats, py::object fallback) {
  Served s;
  for (const auto& [type, id] : formats) {
    if (id < 0 || id > 127) {
      throw py::value_error("each format must be (torch.dtype, id in 0..127)");
    }
    s.format[static_cast<size_t>(type)] = static_cast<int8_t>(id);
  }
  if (ctl_addr != 0) {
    s.ctl = reinterpret_cast<const char*>(ctl_addr);
    s.gate_offset = gate_offset;
    s.entry = reinterpret_cast<entry_t>(entry_addr);
  }
  PyObject* old = g_fallback;
  g_fallback = fallback.is_none() ? nullptr : fallback.release().ptr();
  Py_XDECREF(old);
  g_served = s;
  g_a2a = ServedAlltoall();  // attach_alltoall, after attach, serves it again
  g_gather = ServedAllgather();  // and attach_allgather
}

// all-to-all ---------------------------------------------------------------

// alltoall(t) returns kBadPairBase - (sender * nranks + receiver) when a
// rank split unevenly (an even split expects the same rows from everyone)
constexpr int64_t kBadPairBase = -4;

// zlib's crc32 (what Python's zlib.crc32 computes), of a short string
uint32_t crc32_of(const std::string& text) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char ch : text) {
    crc ^= ch;
    for (int k = 0; k < 8; ++k) {
      crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
    }
  }
  return crc ^ 0xFFFFFFFFu;
}

// crc32 of repr(tuple(t.shape[first:])), as kind.shape_digest computes it
uint32_t shape_crc(const at::Tensor& t, size_t first) {
  std::string text = "(";
  const auto sizes = t.sizes();
  for (size_t d = first; d < sizes.size(); ++d) {
    if (d > first) {
      text += ", ";
    }
    text += std::to_string(sizes[d]);
  }
  text += sizes.size() == first + 1 ? ",)" : ")";
  return crc32_of(text);
}

// kind.shape_digest(t.shape[1:]): the all-to-all's row shape
int64_t row_shape_digest(const at::Tensor& t) {
  return static_cast<int64_t>(shape_crc(t, 1)) & g_a2a.digest_mask;
}

// harmpi.alltoall(t)'s hot path, an even split of a tensor on the served
// context: the result tensor, or an int: kNotMine (the Python path takes it),
// the step's failure status (> 0), or kBadPairBase - the first bad pair.
// The plan (the step's per-call scratch, harmpi/algorithms/alltoall/) is
// this thread's: a call from a thread that does not own the context is
// refused by the step, and must not write into the owner's plan meanwhile.
py::object alltoall(py::handle obj) {
  py::detail::make_caster<at::Tensor> tensor;
  if (g_a2a.entry == nullptr || !tensor.load(obj, false)) {
    return py::int_(kNotMine);
  }
  const at::Tensor& t = py::detail::cast_op<const at::Tensor&>(tensor);
  const int fmt = format_of(t);
  const int64_t n = g_a2a.nranks;
  if (fmt < 0 || t.dim() < 1 || t.size(0) == 0 || t.size(0) % n != 0) {
    return py::int_(kNotMine);  // (the Python path explains what it refuses)
  }
  const int64_t row_nbytes = t.numel() / t.size(0) * static_cast<int64_t>(t.element_size());
  const int64_t code = fmt | g_a2a.coll_bits | (row_shape_digest(t) << g_a2a.digest_shift);
  at::Tensor out = at::empty_like(t);
  thread_local std::vector<int64_t> scratch;
  scratch.resize(static_cast<size_t>(5 * n + 3));
  int64_t* plan = scratch.data();
  plan[5 * n + 2] = t.size(0) / n;  // the even split's rows per rank
  int64_t rc;
  {
    py::gil_scoped_release unlocked;
    rc = g_a2a.entry(reinterpret_cast<int64_t>(g_served.ctl),
                     reinterpret_cast<int64_t>(t.data_ptr()),
                     reinterpret_cast<int64_t>(out.data_ptr()), row_nbytes,
                     reinterpret_cast<int64_t>(plan), code);
  }
  if (rc != 0) {
    return py::int_(rc);
  }
  if (plan[5 * n + 1] >= 0) {
    return py::int_(kBadPairBase - plan[5 * n + 1]);
  }
  return py::cast(out);
}

void attach_alltoall(int64_t entry_addr, int64_t nranks, int64_t coll_bits,
                     int64_t digest_shift, int64_t digest_mask) {
  ServedAlltoall a;
  if (entry_addr != 0 && g_served.ctl != nullptr) {
    a.entry = reinterpret_cast<a2a_entry_t>(entry_addr);
    a.nranks = nranks;
    a.coll_bits = coll_bits;
    a.digest_shift = digest_shift;
    a.digest_mask = digest_mask;
  }
  g_a2a = a;
}

// allgather ----------------------------------------------------------------

// harmpi.allgather(t[, out])'s hot path (dim 0 on the served context): every
// rank's t along dimension 0, in rank order, in a new tensor or in ``out``
// (a tensor of t's dtype, contiguous, with nranks times t's elements, as
// torch's all_gather_into_tensor), or an int: kNotMine (the Python path
// takes it; it explains what it refuses) or the step's failure status
// (> 0). The kind word's digest is kind.shape_digest(t.shape), so ranks
// that gather different shapes fail alike, as on the Python path.
py::object allgather(py::handle obj, py::handle out_obj) {
  py::detail::make_caster<at::Tensor> tensor;
  if (g_gather.entry == nullptr || !tensor.load(obj, false)) {
    return py::int_(kNotMine);
  }
  const at::Tensor& t = py::detail::cast_op<const at::Tensor&>(tensor);
  const int fmt = format_of(t);
  if (fmt < 0 || t.dim() < 1) {
    return py::int_(kNotMine);
  }
  at::Tensor out;
  if (out_obj.is_none()) {
    std::vector<int64_t> sizes = t.sizes().vec();
    sizes[0] *= g_gather.nranks;
    out = at::empty(sizes, t.options());
  } else {
    py::detail::make_caster<at::Tensor> given;
    if (!given.load(out_obj, false)) {
      return py::int_(kNotMine);
    }
    out = py::detail::cast_op<const at::Tensor&>(given);
    if (format_of(out) != fmt || out.numel() != t.numel() * g_gather.nranks) {
      return py::int_(kNotMine);
    }
  }
  const int64_t digest = static_cast<int64_t>(shape_crc(t, 0)) & g_gather.digest_mask;
  int64_t rc;
  {
    py::gil_scoped_release unlocked;
    rc = g_gather.entry(reinterpret_cast<int64_t>(g_served.ctl),
                        reinterpret_cast<int64_t>(t.data_ptr()),
                        reinterpret_cast<int64_t>(out.data_ptr()), t.numel(), fmt, digest);
  }
  if (rc != 0) {
    return py::int_(rc);
  }
  return py::cast(out);
}

void attach_allgather(int64_t entry_addr, int64_t nranks, int64_t digest_mask) {
  ServedAllgather g;
  if (entry_addr != 0 && g_served.ctl != nullptr) {
    g.entry = reinterpret_cast<gather_entry_t>(entry_addr);
    g.nranks = nranks;
    g.digest_mask = digest_mask;
  }
  g_gather = g;
}

// the operator's kernels -------------------------------------------------

// the Python path for a tensor the entry did not complete (rc != 0), or for
// a named group (the entry serves the world only)
void fall_back(const at::Tensor& t, int64_t rc, c10::string_view group) {
  py::gil_scoped_acquire gil;
  TORCH_CHECK(g_fallback != nullptr,
              "harmpi.all_reduce: harmpi._C has no fallback attached (harmpi.native.load() "
              "attaches it)");
  const py::handle fallback(g_fallback);
  // raises py::error_already_set, which torch passes on
  fallback(t, rc, py::str(group.data(), group.size()));
}

at::Tensor& all_reduce_cpu(at::Tensor& t, c10::string_view group) {
  if (!group.empty()) {
    fall_back(t, kNotMine, group);
    return t;
  }
  const int fmt = format_of(t);
  int64_t rc = kNotMine;
  if (fmt >= 0) {
    if (PyGILState_Check()) {  // called from C++ with the GIL held: drop it while ranks wait
      py::gil_scoped_release unlocked;
      rc = run_entry(t, fmt);
    } else {
      rc = run_entry(t, fmt);
    }
  }
  if (rc != 0) {
    fall_back(t, rc, group);
  }
  return t;
}

// out of place: a contiguous copy of x, reduced in place. x is only read, so
// x may be a view, non-contiguous, or used again by the caller. The output
// comes from CPU's allocator directly and a contiguous x (what vLLM's
// compiled graph passes) is copied with memcpy: dispatching empty and copy_
// cost 0.8 us more per call (issue 38, 2 ranks, 2.5 KB, vLLM's process:
// 3.80 us before, 3.00 after; in place 2.44, vLLM's shm op 2.80).
at::Tensor all_reduce_out_of_place_cpu(const at::Tensor& x, c10::string_view group) {
  at::Tensor out(at::detail::empty_cpu(x.sizes(), x.scalar_type(), /*pin_memory=*/false,
                                       at::MemoryFormat::Contiguous));
  if (x.is_contiguous() && !x.is_conj() && !x.is_neg()) {
    if (x.nbytes() > 0) {
      std::memcpy(out.data_ptr(), x.data_ptr(), x.nbytes());
    }
  } else {
    out.copy_(x);
  }
  all_reduce_cpu(out, group);
  return out;
}

// in place, returning nothing: the form a compiled graph wants for a
// mutation (vLLM's own shm_allreduce is written so). torch.compile's
// generic functionalization (auto_functionalized) takes it, and inductor's
// reinplacing pass then sums the graph's buffer where it lies: no output
// to allocate, no copy in, and none of the size/stride/alignment checks
// inductor puts after an extern kernel's returned tensor (0.7 us a call
// measured alone, issue 38). With no returned alias, the lost-alias
// trouble of all_reduce_ (below) cannot arise.
void all_reduce_inplace_cpu(at::Tensor& t, c10::string_view group) { all_reduce_cpu(t, group); }

void all_reduce_inplace_meta(at::Tensor& /*t*/, c10::string_view /*group*/) {}

// shapes only (FakeTensor, torch.compile): in place, the result is the input
at::Tensor& all_reduce_meta(at::Tensor& t, c10::string_view /*group*/) { return t; }

// shapes only: a new contiguous tensor of x's shape and dtype (as the CPU kernel).
// sym_sizes, not sizes: under torch.compile with dynamic shapes (vLLM marks
// the token count dynamic) reading sizes() would pin each symbolic size to
// the value seen while tracing, and dynamo refuses the graph
// (ConstraintViolationError: "marked ... as dynamic but your code
// specialized it").
at::Tensor all_reduce_out_of_place_meta(const at::Tensor& x, c10::string_view /*group*/) {
  return at::empty_symint(x.sym_sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
}

// Functionalization of the in-place operator (what torch.compile and
// AOTAutograd trace): the functional operator on the unwrapped value, then
// the result becomes the new value of `self`, and `self` itself is returned.
// Why not torch's generic route (auto_functionalized_v2 for ops tagged
// inplace): torch 2.13 returns the op's result there as a tensor of its own,
// no longer an alias of `self`, so an in-place update made after the call
// through one of them (y = all_reduce_(x); y.mul_(2)) was not seen through
// the other, and compiled code read stale values where eager code did not.
// This is the pattern torch's own in-place aten ops are functionalized with.
at::Tensor& all_reduce_functionalize(at::Tensor& self, c10::string_view group) {
  static const auto functional = c10::Dispatcher::singleton()
      .findSchemaOrThrow("harmpi::all_reduce", "")
      .typed<at::Tensor(const at::Tensor&, c10::string_view)>();
  static const auto in_place = c10::Dispatcher::singleton()
      .findSchemaOrThrow("harmpi::all_reduce_", "")
      .typed<at::Tensor&(at::Tensor&, c10::string_view)>();
  namespace impl = at::functionalization::impl;
  if (!impl::isFunctionalTensor(self)) {  // nothing to functionalize: the next kernel runs it
    c10::impl::ExcludeDispatchKeyGuard skip(c10::DispatchKey::Functionalize);
    return in_place.call(self, group);
  }
  impl::sync(self);
  const at::Tensor value = impl::from_functional_tensor(self);
  at::Tensor reduced;
  {
    c10::impl::ExcludeDispatchKeyGuard skip(c10::DispatchKey::Functionalize);
    reduced = functional.call(value, group);
  }
  impl::replace_(self, reduced);
  impl::commit_update(self);
  impl::sync(self);
  return self;
}

}  // namespace

// at::Tag::inplace where this torch has it (newer releases; torch 2.11
// lacks it), found by the enum's members rather than a version guess: the
// schema's Tensor(a!) and trailing underscore say "in place" to older ones.
template <typename T, typename = void>
struct HasInplaceTag : std::false_type {};
template <typename T>
struct HasInplaceTag<T, std::void_t<decltype(T::inplace)>> : std::true_type {};

template <typename T = at::Tag>
std::vector<at::Tag> inplace_tags() {
  if constexpr (HasInplaceTag<T>::value) {
    return {T::inplace};
  } else {
    return {};
  }
}

// all_reduce_: in place, returning its input (tagged inplace where torch
// has the tag; its functional variant is all_reduce). all_reduce: out of
// place, for graphs that want a value rather than a mutation.
// all_reduce_inplace: in place, returning nothing, for graphs that mutate
// (vLLM's compiled model: its own communicator sums in place too).
TORCH_LIBRARY(harmpi, m) {
  // (a named const vector: an rvalue would pick def's (schema, function) overload)
  const std::vector<at::Tag> tags = inplace_tags();
  m.def("all_reduce_(Tensor(a!) self, str group=\"\") -> Tensor(a!)", tags);
  m.def("all_reduce(Tensor x, str group=\"\") -> Tensor");
  m.def("all_reduce_inplace(Tensor(a!) x, str group=\"\") -> ()");
}

TORCH_LIBRARY_IMPL(harmpi, CPU, m) {
  m.impl("all_reduce_", &all_reduce_cpu);
  m.impl("all_reduce", &all_reduce_out_of_place_cpu);
  m.impl("all_reduce_inplace", &all_reduce_inplace_cpu);
}

TORCH_LIBRARY_IMPL(harmpi, Meta, m) {
  m.impl("all_reduce_", &all_reduce_meta);
  m.impl("all_reduce", &all_reduce_out_of_place_meta);
  m.impl("all_reduce_inplace", &all_reduce_inplace_meta);
}

TORCH_LIBRARY_IMPL(harmpi, Functionalize, m) {
  m.impl("all_reduce_", &all_reduce_functionalize);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "harmpi's native part (harmpi/_native.cpp); harmpi.native loads it";
  m.attr("TORCH_VERSION") = HARMPI_TORCH_VERSION;
  m.def("allreduce", &allreduce, py::arg("t"),
        "allreduce(t) -> -1 (not handled here) or the entry's status (0: done)");
  m.def("allreduce_sum", &allreduce_sum, py::arg("tensors"), py::arg("opts"),
        "allreduce_sum([t], AllreduceOptions) -> -2 (not a synchronous SUM), -1 (not handled "
        "here) or the entry's status (0: done)");
  m.def("alltoall", &alltoall, py::arg("t"),
        "alltoall(t) -> the result of an even all-to-all of t, or -1 (not handled here), "
        "-4 - the first bad (sender * n + receiver) pair, or the step's failure status");
  m.def("attach_alltoall", &attach_alltoall, py::arg("entry_addr"), py::arg("nranks"), py::arg("coll_bits"), py::arg("digest_shift"),
        py::arg("digest_mask"),
        "attach_alltoall(...): the attached context's all-to-all step (after attach)");
  m.def("allgather", &allgather, py::arg("t"), py::arg("out") = py::none(),
        "allgather(t) -> every rank's t concatenated along dimension 0, or -1 (not handled "
        "here) or the step's failure status");
  m.def("attach_allgather", &attach_allgather, py::arg("entry_addr"), py::arg("nranks"),
        py::arg("digest_mask"),
        "attach_allgather(entry_addr, nranks, digest_mask): the attached context's "
        "allgather step (after attach)");
  m.def("attach", &attach, py::arg("ctl_addr"), py::arg("gate_offset"), py::arg("entry_addr"),
        py::arg("formats"), py::arg("fallback"),
        "attach(ctl_addr, gate_offset, entry_addr, ((torch.dtype, id), ...), fallback): the "
        "context to serve (ctl_addr 0: none) and fallback(t, rc) for the operator");
}
