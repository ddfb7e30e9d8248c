#include "net/wire.h"

#include <zmq.h>

#include <cstdio>
#include <cstring>

namespace tagps::net {

namespace {

template <typename T>
void put_le(uint8_t* out, T value) {
  for (size_t i = 0; i < sizeof(T); ++i) out[i] = static_cast<uint8_t>(value >> (8 * i));
}

template <typename T>
T get_le(const uint8_t* in) {
  T value = 0;
  for (size_t i = 0; i < sizeof(T); ++i) value |= static_cast<T>(in[i]) << (8 * i);
  return value;
}

std::string hex(unsigned value) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%#x", value);
  return value == 0 ? std::string("0x0") : std::string(buf);  // printf's # leaves 0 bare; Python says 0x0
}

}  // namespace

void pack_header(const Header& header, void* out) {
  auto* p = static_cast<uint8_t*>(out);
  p[0] = static_cast<uint8_t>(kMagic0);
  p[1] = static_cast<uint8_t>(kMagic1);
  p[2] = kProtocolVersion;
  p[3] = header.op;
  p[4] = header.dtype;
  p[5] = header.flags;
  p[6] = 0;
  p[7] = 0;
  put_le<uint32_t>(p + 8, header.sender);
  put_le<uint64_t>(p + 12, header.key);
  put_le<uint64_t>(p + 20, header.round);
  put_le<uint64_t>(p + 28, header.nbytes);
}

HeaderBytes pack_header(const Header& header) {
  HeaderBytes out;
  pack_header(header, out.data());
  return out;
}

HeaderBytes pack_header(Op op, uint32_t sender, uint64_t key, uint64_t round, uint64_t nbytes, uint8_t dtype,
                        uint8_t flags) {
  Header h;
  h.op = static_cast<uint8_t>(op);
  h.sender = sender;
  h.key = key;
  h.round = round;
  h.nbytes = nbytes;
  h.dtype = dtype;
  h.flags = flags;
  return pack_header(h);
}

Header unpack_header(const void* data, size_t size) {
  if (size != kHeaderSize) {
    throw ProtocolError(detail::concat("header has ", size, " bytes, expected ", kHeaderSize));
  }
  const auto* p = static_cast<const uint8_t*>(data);
  if (p[0] != static_cast<uint8_t>(kMagic0) || p[1] != static_cast<uint8_t>(kMagic1)) {
    throw ProtocolError("bad magic " + py_bytes_repr(p, 2) + ", expected b'TP'");
  }
  if (p[2] != kProtocolVersion) {
    throw ProtocolError(detail::concat("protocol version ", static_cast<unsigned>(p[2]), ", this node speaks ",
                                       static_cast<unsigned>(kProtocolVersion)));
  }
  Header h;
  h.op = p[3];
  h.dtype = p[4];
  h.flags = p[5];
  const unsigned reserved = get_le<uint16_t>(p + 6);
  h.sender = get_le<uint32_t>(p + 8);
  h.key = get_le<uint64_t>(p + 12);
  h.round = get_le<uint64_t>(p + 20);
  h.nbytes = get_le<uint64_t>(p + 28);
  if (!is_known_op(h.op)) throw ProtocolError(detail::concat("unknown op ", static_cast<unsigned>(h.op)));
  if (h.dtype != 0 && !is_known_dtype(h.dtype)) {
    throw ProtocolError(detail::concat("unknown dtype code ", static_cast<unsigned>(h.dtype)));
  }
  if ((h.flags & ~kFlagsMask) || reserved) {
    throw ProtocolError("unknown flags " + hex(h.flags) + " or reserved bits " + hex(reserved));
  }
  return h;
}

bool is_known_op(unsigned op) { return (op >= 1 && op <= 7) || (op >= 10 && op <= 17); }

std::string op_name(unsigned op) {
  switch (op) {
    case 1: return "INIT";
    case 2: return "INIT_ACK";
    case 3: return "PUSH";
    case 4: return "PULL";
    case 5: return "PULL_REPLY";
    case 6: return "ERROR";
    case 7: return "PUSH_ACK";
    case 10: return "REGISTER";
    case 11: return "ADDRESS_BOOK";
    case 12: return "BARRIER";
    case 13: return "BARRIER_DONE";
    case 14: return "HEARTBEAT";
    case 15: return "NODE_FAILED";
    case 16: return "FINALIZE";
    case 17: return "SHUTDOWN";
    default: return detail::concat("OP_", op);
  }
}

bool is_known_dtype(unsigned code) { return code >= 1 && code <= 6; }

DType kernel_dtype(unsigned code) {
  if (!is_known_dtype(code)) throw ProtocolError(detail::concat("unknown dtype code ", code));
  return static_cast<DType>(code - 1);  // the kernels number the same types from 0
}

size_t wire_dtype_size(unsigned code) { return dtype_size(kernel_dtype(code)); }

WireDType wire_dtype(DType dtype) { return static_cast<WireDType>(static_cast<int>(dtype) + 1); }

bool is_float_dtype(unsigned code) { return code >= 1 && code <= 4; }

std::string pack_workers(const std::vector<uint32_t>& workers) {
  std::string out(4 * workers.size(), '\0');
  for (size_t i = 0; i < workers.size(); ++i) put_le<uint32_t>(reinterpret_cast<uint8_t*>(&out[4 * i]), workers[i]);
  return out;
}

std::vector<uint32_t> unpack_workers(const void* data, size_t size, uint32_t num_workers) {
  if (size % 4) {
    throw ProtocolError(detail::concat("worker set frame has ", size, " bytes, expected a multiple of 4"));
  }
  const auto* p = static_cast<const uint8_t*>(data);
  std::vector<uint32_t> workers(size / 4);
  for (size_t i = 0; i < workers.size(); ++i) workers[i] = get_le<uint32_t>(p + 4 * i);
  check_workers(workers, num_workers);
  return workers;
}

const std::vector<uint32_t>& check_workers(const std::vector<uint32_t>& workers, uint32_t num_workers) {
  bool ok = !workers.empty() && workers.back() < num_workers;
  for (size_t i = 1; ok && i < workers.size(); ++i) ok = workers[i - 1] < workers[i];
  if (!ok) {
    throw ProtocolError(detail::concat("worker set ", py_list_repr(workers),
                                       " must be non-empty, ascending, in [0, DMLC_NUM_WORKER=", num_workers,
                                       ")"));
  }
  return workers;
}

std::string routing_id(uint32_t node_id) { return detail::concat("tagps-node-", node_id); }

std::string describe_node(uint32_t node_id) {
  if (node_id == kSchedulerNodeId) return "scheduler";
  if (node_id >= 8) return detail::concat(node_id % 2 == 0 ? "server " : "worker ", (node_id - 8) / 2);
  return detail::concat("unregistered node ", node_id);
}

std::string py_bytes_repr(const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  bool single = false, dbl = false;
  for (size_t i = 0; i < size; ++i) {
    single = single || p[i] == '\'';
    dbl = dbl || p[i] == '"';
  }
  const char quote = single && !dbl ? '"' : '\'';
  std::string out = "b";
  out += quote;
  for (size_t i = 0; i < size; ++i) {
    const uint8_t c = p[i];
    if (c == quote || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c < 0x20 || c >= 0x7f) {
      char buf[5];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += quote;
  return out;
}

std::string py_list_repr(const std::vector<uint32_t>& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(values[i]);
  }
  return out + "]";
}

// -- CURVE --------------------------------------------------------------------------------------------

std::string curve_key_raw(const std::string& key) {
  if (key.size() == 32) return key;
  if (key.size() == 40) {
    std::string raw(32, '\0');
    const std::string text(key);  // zmq_z85_decode reads a NUL-terminated string
    if (zmq_z85_decode(reinterpret_cast<uint8_t*>(&raw[0]), text.c_str()) != nullptr) return raw;
  }
  throw InvalidArgument(detail::concat("a CURVE key is 40 Z85 characters or 32 raw bytes, got ", key.size(),
                                       " bytes that are neither"));
}

std::string curve_key_z85(const std::string& raw) {
  TAGPS_ENFORCE_EQ(raw.size(), size_t{32}, "raw CURVE key");
  char text[41];
  if (zmq_z85_encode(text, reinterpret_cast<const uint8_t*>(raw.data()), raw.size()) == nullptr) {
    throw Error("zmq_z85_encode failed");
  }
  return std::string(text, 40);
}

CurveKeys CurveKeys::from_keys(const std::string& server_public, const std::string& server_secret,
                               const std::string& client_public, const std::string& client_secret) {
  return CurveKeys{curve_key_raw(server_public), curve_key_raw(server_secret), curve_key_raw(client_public),
                   curve_key_raw(client_secret)};
}

namespace {

void set_option(void* socket, int option, const void* value, size_t size, const char* what) {
  if (zmq_setsockopt(socket, option, value, size) != 0) {
    throw Error(detail::concat("cannot set ", what, " on a ZeroMQ socket: ", zmq_strerror(zmq_errno()),
                               " (does this libzmq have CURVE?)"));
  }
}

void set_key(void* socket, int option, const std::string& key, const char* what) {
  const std::string raw = curve_key_raw(key);
  set_option(socket, option, raw.data(), raw.size(), what);
}

}  // namespace

void curve_server(void* socket, const CurveKeys& keys) {
  const int on = 1;
  set_option(socket, ZMQ_CURVE_SERVER, &on, sizeof on, "ZMQ_CURVE_SERVER");
  set_key(socket, ZMQ_CURVE_SECRETKEY, keys.server_secret, "ZMQ_CURVE_SECRETKEY");
  set_key(socket, ZMQ_CURVE_PUBLICKEY, keys.server_public, "ZMQ_CURVE_PUBLICKEY");
  set_option(socket, ZMQ_ZAP_DOMAIN, kZapDomain, std::strlen(kZapDomain), "ZMQ_ZAP_DOMAIN");
}

void curve_client(void* socket, const CurveKeys& keys) {
  set_key(socket, ZMQ_CURVE_SERVERKEY, keys.server_public, "ZMQ_CURVE_SERVERKEY");
  set_key(socket, ZMQ_CURVE_PUBLICKEY, keys.client_public, "ZMQ_CURVE_PUBLICKEY");
  set_key(socket, ZMQ_CURVE_SECRETKEY, keys.client_secret, "ZMQ_CURVE_SECRETKEY");
}

}  // namespace tagps::net
