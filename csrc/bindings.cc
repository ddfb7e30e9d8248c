// Python bindings for tagps._core: conversion only; the work lives in csrc/kernels. tagps.kernels checks
// the arguments first and gives friendlier errors; the checks here keep a direct caller from crashing.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/cpu.h"
#include "common/dtype.h"
#include "common/error.h"
#include "kernels/adam.h"
#include "kernels/cast.h"
#include "kernels/rmsprop.h"
#include "kernels/sgd.h"
#include "kernels/sum.h"

#include "bind_modules.h"

#define TAGPS_STRINGIFY(x) #x
#define TAGPS_MACRO_STRINGIFY(x) TAGPS_STRINGIFY(x)

namespace py = pybind11;

namespace {

using tagps::DType;

// A C-contiguous buffer of `dtype`'s element size; `what` names it in errors.
void check_buffer(const py::array& a, DType dtype, const char* what) {
  TAGPS_ENFORCE(a.flags() & py::array::c_style, what, " must be C-contiguous");
  TAGPS_ENFORCE_EQ(static_cast<size_t>(a.itemsize()), tagps::dtype_size(dtype), what, " element size");
}

void* writable(py::array& a, DType dtype, const char* what) {
  check_buffer(a, dtype, what);
  TAGPS_ENFORCE(a.writeable(), what, " is read-only");
  return a.mutable_data();
}

const void* readable(const py::array& a, DType dtype, size_t count, const char* what) {
  check_buffer(a, dtype, what);
  TAGPS_ENFORCE_EQ(static_cast<size_t>(a.size()), count, what, " size");
  return a.data();
}

// The bytes [begin, end) an array covers (it is C-contiguous).
struct Region {
  std::string name;
  uintptr_t begin, end;
};

Region region(const py::array& a, std::string name) {
  const auto begin = reinterpret_cast<uintptr_t>(a.data());
  return {std::move(name), begin, begin + static_cast<uintptr_t>(a.nbytes())};
}

bool overlap(const Region& a, const Region& b) { return a.begin < b.end && b.begin < a.end; }

// Throws InvalidArgument when two of `regions` share a byte.
void check_disjoint(const std::vector<Region>& regions) {
  for (size_t i = 0; i < regions.size(); ++i) {
    for (size_t j = i + 1; j < regions.size(); ++j) {
      if (overlap(regions[i], regions[j])) {
        throw tagps::InvalidArgument(regions[i].name + " and " + regions[j].name +
                                     " share memory; they must be distinct buffers");
      }
    }
  }
}

void sum_into(py::array dst, const std::vector<py::array>& srcs, int dtype_code) {
  tagps::kernels::SumOptions o;
  o.dtype = tagps::dtype_from_code(dtype_code);
  o.dst = writable(dst, o.dtype, "dst");
  o.count = static_cast<size_t>(dst.size());
  o.srcs.reserve(srcs.size());
  const Region out = region(dst, "dst");
  for (size_t i = 0; i < srcs.size(); ++i) {
    o.srcs.push_back(readable(srcs[i], o.dtype, o.count, "src"));
    // Element-wise in place: a source may be dst itself, but not shifted against it.
    const Region in = region(srcs[i], "srcs[" + std::to_string(i) + "]");
    if (overlap(in, out) && in.begin != out.begin) {
      throw tagps::InvalidArgument(
          in.name + " partly overlaps dst; an in-place sum needs it disjoint or identical to dst");
    }
  }
  py::gil_scoped_release release;
  tagps::kernels::sum_into(o);
}

void scale(py::array buf, double factor, int dtype_code) {
  tagps::kernels::ScaleOptions o;
  o.dtype = tagps::dtype_from_code(dtype_code);
  o.buf = writable(buf, o.dtype, "buf");
  o.count = static_cast<size_t>(buf.size());
  o.factor = factor;
  py::gil_scoped_release release;
  tagps::kernels::scale(o);
}

void cast(py::array dst, const py::array& src, int dst_code, int src_code) {
  tagps::kernels::CastOptions o;
  o.dst_dtype = tagps::dtype_from_code(dst_code);
  o.src_dtype = tagps::dtype_from_code(src_code);
  o.dst = writable(dst, o.dst_dtype, "dst");
  o.count = static_cast<size_t>(dst.size());
  o.src = readable(src, o.src_dtype, o.count, "src");
  check_disjoint({region(dst, "dst"), region(src, "src")});
  py::gil_scoped_release release;
  tagps::kernels::cast(o);
}

// Calls fn(T{}) with T = float or double for an optimizer step's dtype code.
template <typename Fn>
void visit_float(int dtype_code, Fn&& fn) {
  const DType dtype = tagps::dtype_from_code(dtype_code);
  if (dtype == DType::kFloat32) return fn(float{});
  if (dtype == DType::kFloat64) return fn(double{});
  throw tagps::InvalidType(std::string("the optimizer steps take float32 or float64, got ") +
                           tagps::dtype_name(dtype));
}

template <typename T>
constexpr DType dtype_of() {
  return std::is_same_v<T, float> ? DType::kFloat32 : DType::kFloat64;
}

// State buffer of `count` elements of T (nullptr when absent); its region joins `regions`.
template <typename T>
T* state_buffer(std::optional<py::array>& a, size_t count, const char* what, std::vector<Region>& regions) {
  if (!a) return nullptr;
  TAGPS_ENFORCE_EQ(static_cast<size_t>(a->size()), count, what, " size");
  regions.push_back(region(*a, what));
  return static_cast<T*>(writable(*a, dtype_of<T>(), what));
}

// param (written) and grad (read) of an optimizer step; their regions start `regions`.
template <typename Options>
void param_grad(py::array& param, const py::array& grad, Options& o, std::vector<Region>& regions) {
  using T = std::remove_pointer_t<decltype(o.param)>;
  o.count = static_cast<size_t>(param.size());
  o.param = static_cast<T*>(writable(param, dtype_of<T>(), "param"));
  o.grad = static_cast<const T*>(readable(grad, dtype_of<T>(), o.count, "grad"));
  regions = {region(param, "param"), region(grad, "grad")};
}

void adam_step(py::array param, const py::array& grad, py::array exp_avg, py::array exp_avg_sq,
               std::optional<py::array> max_exp_avg_sq, int dtype_code, int64_t step, double lr, double beta1,
               double beta2, double eps, double weight_decay, bool amsgrad, bool maximize,
               bool decoupled_weight_decay) {
  visit_float(dtype_code, [&](auto tag) {
    using T = decltype(tag);
    tagps::kernels::AdamOptions<T> o;
    std::vector<Region> regions;
    param_grad(param, grad, o, regions);
    std::optional<py::array> m(exp_avg), v(exp_avg_sq);
    o.exp_avg = state_buffer<T>(m, o.count, "exp_avg", regions);
    o.exp_avg_sq = state_buffer<T>(v, o.count, "exp_avg_sq", regions);
    o.max_exp_avg_sq = state_buffer<T>(max_exp_avg_sq, o.count, "max_exp_avg_sq", regions);
    check_disjoint(regions);
    o.step = step;
    o.lr = lr;
    o.beta1 = beta1;
    o.beta2 = beta2;
    o.eps = eps;
    o.weight_decay = weight_decay;
    o.amsgrad = amsgrad;
    o.maximize = maximize;
    o.decoupled_weight_decay = decoupled_weight_decay;
    py::gil_scoped_release release;
    tagps::kernels::adam_step(o);
  });
}

void rmsprop_step(py::array param, const py::array& grad, py::array square_avg,
                  std::optional<py::array> momentum_buffer, std::optional<py::array> grad_avg, int dtype_code,
                  double lr, double alpha, double eps, double weight_decay, double momentum, bool centered,
                  bool maximize) {
  visit_float(dtype_code, [&](auto tag) {
    using T = decltype(tag);
    tagps::kernels::RmspropOptions<T> o;
    std::vector<Region> regions;
    param_grad(param, grad, o, regions);
    std::optional<py::array> sq(square_avg);
    o.square_avg = state_buffer<T>(sq, o.count, "square_avg", regions);
    o.momentum_buffer = state_buffer<T>(momentum_buffer, o.count, "momentum_buffer", regions);
    o.grad_avg = state_buffer<T>(grad_avg, o.count, "grad_avg", regions);
    check_disjoint(regions);
    o.lr = lr;
    o.alpha = alpha;
    o.eps = eps;
    o.weight_decay = weight_decay;
    o.momentum = momentum;
    o.centered = centered;
    o.maximize = maximize;
    py::gil_scoped_release release;
    tagps::kernels::rmsprop_step(o);
  });
}

void sgd_step(py::array param, const py::array& grad, std::optional<py::array> momentum_buffer,
              int dtype_code, double lr, double momentum, double dampening, double weight_decay,
              bool nesterov, bool maximize, bool first_step) {
  visit_float(dtype_code, [&](auto tag) {
    using T = decltype(tag);
    tagps::kernels::SgdOptions<T> o;
    std::vector<Region> regions;
    param_grad(param, grad, o, regions);
    o.momentum_buffer = state_buffer<T>(momentum_buffer, o.count, "momentum_buffer", regions);
    check_disjoint(regions);
    o.lr = lr;
    o.momentum = momentum;
    o.dampening = dampening;
    o.weight_decay = weight_decay;
    o.nesterov = nesterov;
    o.maximize = maximize;
    o.first_step = first_step;
    py::gil_scoped_release release;
    tagps::kernels::sgd_step(o);
  });
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = R"pbdoc(tagps C++ core: CPU summation and optimizer kernels (use tagps.kernels), the PS
communication engine and the simulator's list scheduler.)pbdoc";
  m.attr("__version__") = TAGPS_MACRO_STRINGIFY(TAGPS_VERSION_INFO);
  tagps::bind_comm(m);
  tagps::bind_sim(m);
#ifdef TAGPS_HAVE_NET
  m.attr("HAVE_NET") = true;
  tagps::bind_net_server(m);
  tagps::bind_net_client(m);
#else
  m.attr("HAVE_NET") = false;
#endif

  // Base first: pybind11 tries the most recently registered translator first.
  py::register_exception<tagps::Error>(m, "Error", PyExc_RuntimeError);
  py::register_exception<tagps::InvalidArgument>(m, "InvalidArgument", PyExc_ValueError);
  py::register_exception<tagps::InvalidType>(m, "InvalidType", PyExc_TypeError);
  py::register_exception<tagps::Unsupported>(m, "Unsupported", PyExc_RuntimeError);

  py::enum_<DType>(m, "DType", "Element types of the kernels (float16/bfloat16 stored as uint16).")
      .value("float32", DType::kFloat32)
      .value("float64", DType::kFloat64)
      .value("float16", DType::kFloat16)
      .value("bfloat16", DType::kBFloat16)
      .value("int32", DType::kInt32)
      .value("int64", DType::kInt64);

  // Buffers must already be numpy arrays: no silent conversion of a list into a temporary.
  const auto buffer = [](const char* name) { return py::arg(name).noconvert(); };
  const auto optional_buffer = [](const char* name) { return py::arg(name).noconvert().none(true); };
  m.def("sum_into", &sum_into, buffer("dst"), buffer("srcs"), py::arg("dtype"),
        R"pbdoc(dst += srcs[0] + srcs[1] + ... in one pass; dtype is a DType code.)pbdoc");
  m.def("scale", &scale, buffer("buf"), py::arg("factor"), py::arg("dtype"),
        R"pbdoc(buf *= factor in place; dtype is a DType code.)pbdoc");
  m.def("cast", &cast, buffer("dst"), buffer("src"), py::arg("dst_dtype"), py::arg("src_dtype"),
        R"pbdoc(dst = src converted between float32 and float16/bfloat16 (round-to-nearest-even).)pbdoc");
  m.def("adam_step", &adam_step, buffer("param"), buffer("grad"), buffer("exp_avg"), buffer("exp_avg_sq"),
        optional_buffer("max_exp_avg_sq"), py::arg("dtype"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("amsgrad"), py::arg("maximize"),
        py::arg("decoupled_weight_decay"), R"pbdoc(Fused Adam/AdamW step on float32/float64 buffers.)pbdoc");
  m.def("rmsprop_step", &rmsprop_step, buffer("param"), buffer("grad"), buffer("square_avg"),
        optional_buffer("momentum_buffer"), optional_buffer("grad_avg"), py::arg("dtype"), py::arg("lr"),
        py::arg("alpha"), py::arg("eps"), py::arg("weight_decay"), py::arg("momentum"), py::arg("centered"),
        py::arg("maximize"), R"pbdoc(Fused RMSprop step on float32/float64 buffers.)pbdoc");
  m.def("sgd_step", &sgd_step, buffer("param"), buffer("grad"), optional_buffer("momentum_buffer"),
        py::arg("dtype"), py::arg("lr"), py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"),
        py::arg("nesterov"), py::arg("maximize"), py::arg("first_step"),
        R"pbdoc(Fused SGD step on float32/float64 buffers.)pbdoc");

  m.def("cpu_has_avx2", &tagps::cpu_has_avx2,
        R"pbdoc(True when the build has the AVX2 kernels and the CPU has AVX2, FMA and F16C.)pbdoc");
  m.def("simd_mode", [] { return std::string(tagps::simd_name(tagps::active_simd())); },
        R"pbdoc(The SIMD path in use: "avx2" or "scalar".)pbdoc");
  m.def("set_simd_mode", &tagps::set_simd_mode, py::arg("mode"),
        R"pbdoc(Select "auto", "avx2" or "scalar".)pbdoc");
  m.def("set_num_threads", &tagps::set_num_threads, py::arg("n"),
        R"pbdoc(OpenMP threads for large arrays; 0 = all cores.)pbdoc");
  m.def("num_threads", &tagps::num_threads, R"pbdoc(Threads large arrays use.)pbdoc");
}
