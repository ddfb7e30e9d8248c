// Python bindings for tagps._core: conversion only; the work lives in csrc/kernels. tagps.kernels checks
// the arguments first and gives friendlier errors; the checks here keep a direct caller from crashing.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "common/cpu.h"
#include "common/dtype.h"
#include "common/error.h"
#include "kernels/sum.h"

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

void sum_into(py::array dst, const std::vector<py::array>& srcs, int dtype_code) {
  tagps::kernels::SumOptions o;
  o.dtype = tagps::dtype_from_code(dtype_code);
  o.dst = writable(dst, o.dtype, "dst");
  o.count = static_cast<size_t>(dst.size());
  o.srcs.reserve(srcs.size());
  for (const py::array& s : srcs) o.srcs.push_back(readable(s, o.dtype, o.count, "src"));
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

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = R"pbdoc(tagps C++ core: CPU summation and optimizer kernels (use tagps.kernels).)pbdoc";
  m.attr("__version__") = TAGPS_MACRO_STRINGIFY(TAGPS_VERSION_INFO);

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

  m.def("sum_into", &sum_into, py::arg("dst"), py::arg("srcs"), py::arg("dtype"),
        R"pbdoc(dst += srcs[0] + srcs[1] + ... in one pass; dtype is a DType code.)pbdoc");
  m.def("scale", &scale, py::arg("buf"), py::arg("factor"), py::arg("dtype"),
        R"pbdoc(buf *= factor in place; dtype is a DType code.)pbdoc");

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
