// Python bindings for tagps._core: conversion only; the work lives in csrc/kernels.
#include <pybind11/pybind11.h>

#define TAGPS_STRINGIFY(x) #x
#define TAGPS_MACRO_STRINGIFY(x) TAGPS_STRINGIFY(x)

namespace py = pybind11;

PYBIND11_MODULE(_core, m) {
  m.doc() = R"pbdoc(tagps C++ core: CPU summation and optimizer kernels (use tagps.kernels).)pbdoc";
  m.attr("__version__") = TAGPS_MACRO_STRINGIFY(TAGPS_VERSION_INFO);
}
