// Python names of the worker engine (csrc/net), registered into tagps._core; tagps.ps.client drives them.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bind_modules.h"
#include "net/client.h"

namespace py = pybind11;

namespace tagps {
namespace {

using net::ClientEngine;
using net::PushPull;

// Buffers whose last reference went away on a thread without the GIL (libzmq's, the engine's); they are
// released on the next call from Python, so no network thread ever waits for the GIL.
std::mutex g_orphans_mu;
std::vector<PyObject*> g_orphans;

void drop_owner(void* owner) {
  if (PyGILState_Check()) {
    Py_DECREF(static_cast<PyObject*>(owner));
    return;
  }
  std::lock_guard<std::mutex> lock(g_orphans_mu);
  g_orphans.push_back(static_cast<PyObject*>(owner));
}

void release_orphans() {
  std::vector<PyObject*> orphans;
  {
    std::lock_guard<std::mutex> lock(g_orphans_mu);
    orphans.swap(g_orphans);
  }
  for (PyObject* owner : orphans) Py_DECREF(owner);
}

// Server text may be any bytes: decode like Python's errors="replace".
py::object text_or_none(const std::string& text) {
  if (text.empty()) return py::none();
  PyObject* s = PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "replace");
  if (s == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(s);
}

using ChunkTuple = std::tuple<uint64_t, uint32_t, size_t, size_t>;
using TensorTuple = std::tuple<uint64_t, int, std::vector<uint32_t>, py::bytes, std::vector<ChunkTuple>>;

std::vector<net::TensorSpec> tensor_specs(const std::vector<TensorTuple>& tensors) {
  std::vector<net::TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const auto& [index, dtype, workers, init, chunks] : tensors) {
    TAGPS_ENFORCE(net::is_known_dtype(static_cast<unsigned>(dtype)), "unknown dtype code ", dtype);
    net::TensorSpec t;
    t.index = index;
    t.dtype = static_cast<uint8_t>(dtype);
    t.workers = workers;
    t.init = std::string(init);  // copied: an INIT may still be queued when a failure ends the wait
    for (const auto& [key, server, offset, nbytes] : chunks) t.chunks.push_back({key, server, offset, nbytes});
    specs.push_back(std::move(t));
  }
  return specs;
}

}  // namespace

void bind_net_client(py::module_& m) {
  py::class_<PushPull, std::shared_ptr<PushPull>>(m, "PushPullOp", R"pbdoc(
A push_pull queued on a PSClientEngine (tagps.ps.client.Handle wraps it).
)pbdoc")
      .def(
          "wait",
          [](PushPull& op, std::optional<double> timeout) {
            const double limit = timeout ? std::max(0.0, *timeout) : -1.0;
            py::gil_scoped_release release;
            return op.wait(limit);
          },
          py::arg("timeout") = py::none(),
          R"pbdoc(Block (without the GIL) until done or timeout seconds passed; return whether done.)pbdoc")
      .def("done", &PushPull::done, R"pbdoc(Whether it finished, successfully or not.)pbdoc")
      .def("notify", &PushPull::notify, py::arg("fd"), py::arg("tag"),
           R"pbdoc(Once finished (at once if it is), write the 8 bytes of tag (native order) into fd.)pbdoc")
      .def_property_readonly(
          "error", [](const PushPull& op) { return text_or_none(op.error()); },
          R"pbdoc(The failure reason, or None.)pbdoc")
      .def_property_readonly("finished_at", &PushPull::finished_at,
                             R"pbdoc(time.perf_counter() when it finished (0 while pending).)pbdoc");

  py::class_<ClientEngine>(m, "PSClientEngine", R"pbdoc(
The worker's data plane: one DEALER per server, declarations and push_pull (use tagps.ps.PSClient).
)pbdoc")
      .def(py::init([](uint32_t node_id, std::vector<std::string> endpoints, size_t credit, double send_timeout_s,
                       std::optional<std::tuple<std::string, std::string, std::string>> curve,
                       std::vector<bool> colocated) {
             net::ClientOptions o;
             o.node_id = node_id;
             o.endpoints = std::move(endpoints);
             o.credit = credit;
             o.send_timeout_s = send_timeout_s;
             o.colocated = std::move(colocated);
             if (curve) {
               const auto& [server_public, client_public, client_secret] = *curve;
               o.keys = net::CurveKeys{net::curve_key_raw(server_public), std::string(),
                                       net::curve_key_raw(client_public), net::curve_key_raw(client_secret)};
             }
             return std::make_unique<ClientEngine>(std::move(o));
           }),
           py::arg("node_id"), py::arg("endpoints"), py::arg("credit"), py::arg("send_timeout_s"),
           py::arg("curve") = py::none(), py::arg("colocated") = std::vector<bool>(),
           R"pbdoc(Connect to the servers (endpoints by rank); curve: (server public, client public, client
secret) Z85 keys, or None for plain TCP; colocated: by rank, whether the server is on this host, so that
chunks are offered to it in shared memory (empty: none is).)pbdoc")
      .def(
          "declare",
          [](ClientEngine& engine, const std::vector<TensorTuple>& tensors) {
            std::vector<net::TensorSpec> specs = tensor_specs(tensors);
            py::gil_scoped_release release;
            return engine.declare(std::move(specs));
          },
          py::arg("tensors"), R"pbdoc(
INIT every chunk of tensors [(index, dtype code, worker ids or [], initial value bytes or b"",
[(key, server, byte offset, nbytes), ...]), ...] and block until all are acknowledged; return the chunks'
rounds in order. Raises RuntimeError with the reason when the engine fails meanwhile.)pbdoc")
      .def(
          "push_pull",
          [](ClientEngine& engine, uint64_t index, py::array buffer, bool average, int64_t priority) {
            release_orphans();
            TAGPS_ENFORCE(buffer.flags() & py::array::c_style, "push_pull buffer must be C-contiguous");
            char* data = static_cast<char*>(buffer.mutable_data());  // throws when read-only
            Py_INCREF(buffer.ptr());
            std::shared_ptr<void> keep(buffer.ptr(), drop_owner);
            return engine.push_pull(index, data, static_cast<size_t>(buffer.nbytes()), average, priority,
                                    std::move(keep));
          },
          py::arg("index"), py::arg("buffer").noconvert(), py::arg("average"), py::arg("priority"),
          R"pbdoc(Queue a push_pull of declared tensor index, summed in place into buffer; returns a PushPullOp.)pbdoc")
      .def("fail", &ClientEngine::fail, py::arg("reason"),
           R"pbdoc(Fail every pending and later operation with reason (the first reason sticks).)pbdoc")
      .def_property_readonly(
          "fatal", [](const ClientEngine& engine) { return text_or_none(engine.fatal()); },
          R"pbdoc(Why the engine failed, or None.)pbdoc")
      .def_property_readonly("ipc_chunks", &ClientEngine::ipc_chunks,
                             R"pbdoc(Declared chunks whose server takes them from shared memory.)pbdoc")
      .def_property_readonly(
          "ipc_error", [](const ClientEngine& engine) { return text_or_none(engine.ipc_error()); },
          R"pbdoc(Why shared memory could not be set up for some chunk (they go over TCP), or None.)pbdoc")
      .def(
          "close",
          [](ClientEngine& engine) {
            {
              py::gil_scoped_release release;
              engine.close();
            }
            release_orphans();
          },
          R"pbdoc(Stop the I/O thread and close the sockets; pending operations fail. Idempotent.)pbdoc");
}

}  // namespace tagps
