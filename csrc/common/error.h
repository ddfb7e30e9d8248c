// Errors of the C++ core, in two tiers (after gloo/common/logging.h and gloo/common/error.h):
//  * TAGPS_ENFORCE* for bad arguments and broken invariants; the message names the check and, for the
//    comparison forms, prints both values;
//  * typed exceptions that the bindings map to Python exceptions with py::register_exception.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace tagps {

// Base of every exception the core throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A bad value (size mismatch, out-of-range hyperparameter, unsafe aliasing): Python ValueError.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A bad type (unsupported dtype): Python TypeError.
class InvalidType : public Error {
 public:
  using Error::Error;
};

// A request the machine cannot honour (AVX2 forced on a CPU without it): Python RuntimeError.
class Unsupported : public Error {
 public:
  using Error::Error;
};

namespace detail {

template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

}  // namespace detail
}  // namespace tagps

#define TAGPS_ENFORCE(cond, ...)                                                                   \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      throw ::tagps::InvalidArgument(::tagps::detail::concat(                                      \
          __FILE__, ":", __LINE__, ": ", ::tagps::detail::concat(__VA_ARGS__), " (check " #cond    \
          " failed)"));                                                                            \
    }                                                                                              \
  } while (0)

#define TAGPS_ENFORCE_OP_(a, b, op, ...)                                                           \
  do {                                                                                             \
    const auto& tagps_a_ = (a);                                                                    \
    const auto& tagps_b_ = (b);                                                                    \
    if (!(tagps_a_ op tagps_b_)) {                                                                 \
      throw ::tagps::InvalidArgument(::tagps::detail::concat(                                      \
          __FILE__, ":", __LINE__, ": ", ::tagps::detail::concat(__VA_ARGS__), ": expected " #a    \
          " " #op " " #b ", got ", tagps_a_, " vs ", tagps_b_));                                  \
    }                                                                                              \
  } while (0)

#define TAGPS_ENFORCE_EQ(a, b, ...) TAGPS_ENFORCE_OP_(a, b, ==, __VA_ARGS__)
#define TAGPS_ENFORCE_NE(a, b, ...) TAGPS_ENFORCE_OP_(a, b, !=, __VA_ARGS__)
#define TAGPS_ENFORCE_GE(a, b, ...) TAGPS_ENFORCE_OP_(a, b, >=, __VA_ARGS__)
#define TAGPS_ENFORCE_GT(a, b, ...) TAGPS_ENFORCE_OP_(a, b, >, __VA_ARGS__)
#define TAGPS_ENFORCE_LE(a, b, ...) TAGPS_ENFORCE_OP_(a, b, <=, __VA_ARGS__)
