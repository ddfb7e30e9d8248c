// Python names of the server engine (csrc/net), registered into tagps._core, plus the C++ wire format's
// pack/unpack (wire_*), which tests compare with tagps/ps/protocol.py.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "bind_modules.h"
#include "net/server.h"
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

// A uint8 numpy array over `buffer` that keeps it alive (no copy).
py::object as_array(const net::SharedBuffer& buffer) {
  if (!buffer) return py::none();
  auto* holder = new net::SharedBuffer(buffer);
  py::capsule owner(holder, [](void* p) { delete static_cast<net::SharedBuffer*>(p); });
  return py::array_t<uint8_t>({static_cast<py::ssize_t>(buffer->size())}, {py::ssize_t{1}},
                              static_cast<const uint8_t*>(buffer->data()), owner);
}

// A copy of a C-contiguous numpy array's bytes.
net::SharedBuffer from_array(const py::array& array, const char* what) {
  if (!(array.flags() & py::array::c_style)) throw py::value_error(std::string(what) + " must be C-contiguous");
  auto buffer = std::make_shared<net::AlignedBuffer>(static_cast<size_t>(array.nbytes()), false);
  std::memcpy(buffer->data(), array.data(), buffer->size());
  return buffer;
}

py::dict key_dict(const net::KeySnapshot& k) {
  py::dict d;
  d["key"] = k.key;
  d["dtype"] = int{k.dtype};
  d["nbytes"] = k.nbytes;
  d["round"] = k.round;
  d["step"] = k.step;
  d["workers"] = k.workers;
  d["counts"] = k.counts;
  d["value"] = as_array(k.value);
  py::dict buffers;
  for (const auto& [name, buffer] : k.buffers) buffers[py::str(name)] = as_array(buffer);
  d["buffers"] = buffers;
  return d;
}

py::list keys_list(const net::Snapshot& snap) {
  py::list out;
  for (const auto& k : snap.keys) out.append(key_dict(k));
  return out;
}

net::OptimizerConfig optimizer_config(const py::dict& d) {
  net::OptimizerConfig c;
  const auto get = [&](const char* name) { return d[py::str(name)]; };
  c.name = get("name").cast<std::string>();
  c.lr = get("lr").cast<double>();
  const auto betas = get("betas").cast<std::pair<double, double>>();
  c.beta1 = betas.first;
  c.beta2 = betas.second;
  c.eps = get("eps").cast<double>();
  c.weight_decay = get("weight_decay").cast<double>();
  c.momentum = get("momentum").cast<double>();
  c.dampening = get("dampening").cast<double>();
  c.nesterov = get("nesterov").cast<bool>();
  c.alpha = get("alpha").cast<double>();
  c.centered = get("centered").cast<bool>();
  c.amsgrad = get("amsgrad").cast<bool>();
  c.maximize = get("maximize").cast<bool>();
  return c;
}

}  // namespace

void bind_net_server(pybind11::module_& m) {
  py::class_<net::Server>(m, "PSServer", R"pbdoc(The summation server's data plane in C++ (TAGPS_PS_ENGINE=cpp).

Binds the data ROUTER socket on `host` (a free port: `port`); `start(rank)` runs the I/O and engine threads
without the GIL. tagps.ps.server.SummationServer drives it (see csrc/net/server.h).)pbdoc")
      .def(py::init([](const std::string& host, uint32_t num_workers, uint64_t partition_bytes, int engine_threads,
                       bool enable_async, std::optional<int64_t> max_staleness,
                       std::optional<int64_t> checkpoint_every, std::optional<py::dict> optimizer,
                       std::optional<std::tuple<py::bytes, py::bytes, py::bytes, py::bytes>> curve_keys,
                       int log_level, int io_threads) {
             net::ServerOptions o;
             o.host = host;
             o.num_workers = num_workers;
             o.partition_bytes = partition_bytes;
             o.engine_threads = engine_threads;
             o.enable_async = enable_async;
             o.max_staleness = max_staleness.value_or(-1);
             o.checkpoint_every = checkpoint_every.value_or(0);
             if (optimizer) o.optimizer = optimizer_config(*optimizer);
             if (curve_keys) {
               const auto& [sp, ss, cp, cs] = *curve_keys;
               o.curve = net::CurveKeys::from_keys(sp, ss, cp, cs);
             }
             o.log_level = log_level;
             o.io_threads = io_threads;
             return std::make_unique<net::Server>(std::move(o));
           }),
           py::arg("host"), py::arg("num_workers"), py::arg("partition_bytes"), py::arg("engine_threads"),
           py::arg("enable_async"), py::arg("max_staleness") = py::none(), py::arg("checkpoint_every") = py::none(),
           py::arg("optimizer") = py::none(), py::arg("curve_keys") = py::none(), py::arg("log_level") = 30,
           py::arg("io_threads") = 1)
      .def_property_readonly("port", &net::Server::port, R"pbdoc(The bound TCP port.)pbdoc")
      .def(
          "restore_key",
          [](net::Server& self, uint64_t key, int dtype, uint64_t nbytes, std::vector<uint32_t> workers,
             uint64_t round, std::vector<int64_t> counts, int64_t step, std::optional<py::array> value,
             const std::vector<std::pair<std::string, py::array>>& buffers) {
            net::KeySnapshot k;
            k.key = key;
            k.dtype = static_cast<uint8_t>(dtype);
            k.nbytes = nbytes;
            k.workers = std::move(workers);
            k.round = round;
            k.counts = std::move(counts);
            k.step = step;
            if (value) k.value = from_array(*value, "value");
            for (const auto& [name, array] : buffers) k.buffers.emplace_back(name, from_array(array, name.c_str()));
            self.restore_key(std::move(k));
          },
          py::arg("key"), py::arg("dtype"), py::arg("nbytes"), py::arg("workers"), py::arg("round"),
          py::arg("counts"), py::arg("step"), py::arg("value"), py::arg("buffers"),
          R"pbdoc(Add a key restored from a checkpoint (before start); buffers: [(name, array)] in the
optimizer's buffer order.)pbdoc")
      .def("start", &net::Server::start, py::arg("rank"), R"pbdoc(Start serving as server `rank`.)pbdoc")
      .def("stop", &net::Server::stop, py::call_guard<py::gil_scoped_release>(),
           R"pbdoc(Stop and join every thread; idempotent.)pbdoc")
      .def(
          "snapshot",
          [](net::Server& self) {
            net::Snapshot snap;
            {
              py::gil_scoped_release release;
              snap = self.snapshot();
            }
            return keys_list(snap);
          },
          R"pbdoc(Copies of every declared key's state: dicts of key, dtype, nbytes, round, step, workers,
counts, value (uint8 array or None) and buffers ({name: uint8 array}).)pbdoc")
      .def(
          "take_checkpoints",
          [](net::Server& self) {
            py::list out;
            for (const auto& snap : self.take_checkpoints()) out.append(py::make_tuple(snap.moved, keys_list(snap)));
            return out;
          },
          R"pbdoc(The periodic checkpoints taken since the last call: [(moved rounds, keys)].)pbdoc")
      .def(
          "drain_log",
          [](net::Server& self) {
            py::list out;
            for (const auto& r : self.drain_log()) out.append(py::make_tuple(r.level, r.message));
            return out;
          },
          R"pbdoc(Log records since the last call: [(logging level, message)].)pbdoc")
      .def("failure", &net::Server::failure,
           R"pbdoc(Why the I/O thread stopped on its own ("" while it runs).)pbdoc")
      .def_property_readonly("rounds_done", &net::Server::rounds_done)
      .def_property_readonly("messages_received", &net::Server::messages_received)
      .def(
          "stats",
          [](const net::Server& self) {
            const net::ServerStats s = self.stats();
            py::dict out;
            out["rounds"] = s.rounds;
            out["messages"] = s.messages;
            out["ipc_pushes"] = s.ipc_pushes;
            out["sum_calls"] = s.sum_calls;
            out["sum_bytes"] = s.sum_bytes;
            out["sum_seconds"] = s.sum_seconds;
            out["sum_cpu_seconds"] = s.sum_cpu_seconds;
            return out;
          },
          R"pbdoc(Counters since start: rounds, messages, ipc_pushes (through shared memory), and the
summation's sum_calls, sum_bytes (every push folded into a sum), sum_seconds (wall) and sum_cpu_seconds
(the engine threads' CPU time).)pbdoc");

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
