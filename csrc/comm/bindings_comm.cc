// Python names of the intra-machine reduction arena (csrc/comm), registered into tagps._core.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bind_modules.h"
#include "comm/arena.h"

namespace py = pybind11;

namespace tagps {
namespace {

// The bytes of a C-contiguous array (tagps.comm.arena passes uint8 views of tensors).
size_t contiguous_bytes(const py::array& a, const char* what) {
  TAGPS_ENFORCE(a.flags() & py::array::c_style, what, " must be C-contiguous");
  return static_cast<size_t>(a.nbytes());
}

}  // namespace

void bind_comm(py::module_& m) {
  using comm::Arena;
  // Module-local translators are tried before the global ones, so this one wins over tagps::Error's
  // (which bindings.cc registers after this call, and which would otherwise catch it as its base).
  py::register_local_exception<comm::ArenaFull>(m, "ArenaFull", PyExc_OSError);

  py::class_<Arena>(m, "Arena", py::buffer_protocol(), R"pbdoc(
A shared-memory reduction arena: slots + 1 rows of count elements in one mapped file (use
tagps.comm.arena.ShmArena). Its buffer is the whole mapping as bytes; it stays mapped while a view lives.
)pbdoc")
      .def(py::init([](std::string path, int dtype_code, size_t slots, size_t count) {
             comm::ArenaOptions o{std::move(path), dtype_from_code(dtype_code), slots, count};
             py::gil_scoped_release release;  // posix_fallocate zeroes every page of the file
             return std::make_unique<Arena>(std::move(o));
           }),
           py::arg("path"), py::arg("dtype"), py::arg("slots"), py::arg("count"),
           R"pbdoc(Open or create the file at path, reserve its full size (ArenaFull when there is no
room; the file is then removed) and map it.)pbdoc")
      .def_property_readonly("row_bytes", &Arena::row_bytes)
      .def_property_readonly("header_bytes", &Arena::header_bytes,
                             "Bytes of the control block before the rows (the result row starts at "
                             "header_bytes + slots * row_bytes).")
      .def("mark_ready", &Arena::mark_ready, py::arg("slot"), py::arg("seq"),
           "Mark slot `slot` written for round `seq` (after the write: a release store).")
      .def(
          "all_ready", [](const Arena& a, uint32_t seq) { return static_cast<int>(a.all_ready(seq)); },
          py::arg("seq"),
          "0: some slot is not ready for round `seq` yet; 1: all are; 2: all are but mapped other dtypes or "
          "counts.")
      .def("publish", &Arena::publish, py::arg("seq"), "The result row holds round `seq`: wake the waiters.")
      .def("fail", &Arena::fail, "Fail the reduction: every wait_done() returns 1 from now on.")
      .def("done", &Arena::done, py::arg("seq"), "Whether round `seq` was published.")
      .def(
          "wait_done",
          [](const Arena& a, uint32_t seq, double timeout_s) {
            return static_cast<int>(a.wait_done(seq, timeout_s));
          },
          py::arg("seq"), py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>(),
          "Wait for round `seq` to be published (0), the arena to fail (1) or timeout_s to pass (2).")
      .def_buffer([](Arena& a) {
        return py::buffer_info(a.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(a.bytes())}, {py::ssize_t{1}}, /*readonly=*/false);
      })
      .def(
          "copy_in",
          [](Arena& a, size_t slot, const py::array& src) {
            const size_t nbytes = contiguous_bytes(src, "src");
            const void* data = src.data();
            py::gil_scoped_release release;
            a.copy_in(slot, data, nbytes);
          },
          py::arg("slot"), py::arg("src").noconvert(), R"pbdoc(Copy src's bytes into slot `slot`.)pbdoc")
      .def(
          "copy_out",
          [](const Arena& a, py::array dst) {
            const size_t nbytes = contiguous_bytes(dst, "dst");
            TAGPS_ENFORCE(dst.writeable(), "dst is read-only");
            void* data = dst.mutable_data();
            py::gil_scoped_release release;
            a.copy_out(data, nbytes);
          },
          py::arg("dst").noconvert(), R"pbdoc(Copy the result row into dst's bytes.)pbdoc")
      .def("reduce_shard", &Arena::reduce_shard, py::arg("groups"), py::arg("begin"), py::arg("end"),
           py::call_guard<py::gil_scoped_release>(),
           R"pbdoc(Sum the elements [begin, end): each group into its first slot, then slot 0 and the
other groups' first slots into the result row.)pbdoc");
}

}  // namespace tagps
