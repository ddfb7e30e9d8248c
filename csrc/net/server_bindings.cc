// Python names of the server engine (csrc/net), registered into tagps._core, plus the C++ wire format's
// pack/unpack (wire_*), which tests compare with tagps/ps/protocol.py.
#include <pybind11/stl.h>

#include <string>
#include <tuple>
#include <vector>

#include "bind_modules.h"
#include "net/wire.h"

namespace py = pybind11;

namespace tagps {

namespace {

// ProtocolError derives from tagps::Error, whose translator (registered later) would make it a
// RuntimeError; the wire functions raise ValueError like protocol.ProtocolError.
template <typename Fn>
auto as_value_error(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const net::ProtocolError& exc) {
    throw py::value_error(exc.what());
  }
}

}  // namespace

void bind_net_server(pybind11::module_& m) {
  m.def(
      "wire_pack_header",
      [](int op, uint32_t sender, uint64_t key, uint64_t round, uint64_t nbytes, int dtype, int flags) {
        net::Header h;
        h.op = static_cast<uint8_t>(op);
        h.sender = sender;
        h.key = key;
        h.round = round;
        h.nbytes = nbytes;
        h.dtype = static_cast<uint8_t>(dtype);
        h.flags = static_cast<uint8_t>(flags);
        const net::HeaderBytes raw = net::pack_header(h);
        return py::bytes(reinterpret_cast<const char*>(raw.data()), raw.size());
      },
      py::arg("op"), py::arg("sender"), py::arg("key") = 0, py::arg("round") = 0, py::arg("nbytes") = 0,
      py::arg("dtype") = 0, py::arg("flags") = 0,
      R"pbdoc(The C++ engine's header encoding (same fields as tagps.ps.protocol.pack_header).)pbdoc");
  m.def(
      "wire_unpack_header",
      [](const py::bytes& frame) {
        const std::string raw = frame;
        return as_value_error([&] {
          const net::Header h = net::unpack_header(raw.data(), raw.size());
          return std::make_tuple(int{h.op}, int{h.dtype}, int{h.flags}, h.sender, h.key, h.round, h.nbytes);
        });
      },
      py::arg("frame"),
      R"pbdoc(The C++ engine's header check: (op, dtype, flags, sender, key, round, nbytes) or ValueError
with protocol.py's reason.)pbdoc");
  m.def(
      "wire_unpack_workers",
      [](const py::bytes& frame, uint32_t num_workers) {
        const std::string raw = frame;
        return as_value_error([&] { return net::unpack_workers(raw.data(), raw.size(), num_workers); });
      },
      py::arg("frame"), py::arg("num_workers"),
      R"pbdoc(The C++ engine's worker set check: the ids, or ValueError with protocol.py's reason.)pbdoc");
}

}  // namespace tagps
