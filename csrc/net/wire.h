// The PS wire format in C++ (mirror of tagps/ps/protocol.py and docs/protocol.md), plus the CURVE socket
// settings every node applies (mirror of tagps/ps/transport.py's Security).
//
// Every message is a ZeroMQ multipart message: a fixed 36-byte little-endian header, then at most one
// payload frame (an INIT: the worker set frame with kFlagWorkers, the shared-memory descriptor frame with
// kFlagIpc, then at most one payload frame):
//
//   offset size field    meaning
//   0      2    magic    "TP"
//   2      1    version  kProtocolVersion
//   3      1    op       an Op
//   4      1    dtype    a WireDType code (0 for control messages)
//   5      1    flags    bit set of kFlag*
//   6      2    reserved must be 0
//   8      4    sender   node id of the sender (see worker_node_id)
//   12     8    key      tensor chunk key, (declared_index << 16) + chunk
//   20     8    round    synchronous round of the key (barrier sequence on the control plane)
//   28     8    nbytes   byte length of the payload frame
//
// unpack_header checks every field and throws ProtocolError with the same text as protocol.py, which the
// receiver sends back in an Op::kError reply. This header is stable: later changes only add to it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/error.h"

namespace tagps::net {

inline constexpr uint8_t kProtocolVersion = 1;
inline constexpr char kMagic0 = 'T';
inline constexpr char kMagic1 = 'P';
inline constexpr size_t kHeaderSize = 36;
inline constexpr uint64_t kMaxChunks = uint64_t{1} << 16;
// Largest JSON document accepted on the control plane.
inline constexpr size_t kMaxJsonBytes = size_t{1} << 20;

// INIT_ACK flag: the server applies an optimizer, so pulls return weights, not sums.
inline constexpr uint8_t kFlagServerOptimizer = 1;
// INIT_ACK flag: the server runs in asynchronous mode.
inline constexpr uint8_t kFlagAsync = 2;
// PUSH flag: the worker wants the mean (the server divides the round's sum by the number of workers).
inline constexpr uint8_t kFlagAverage = 4;
// INIT flag: the first payload frame names the workers that push the key (default: every worker).
inline constexpr uint8_t kFlagWorkers = 8;
// Shared memory (net/shared_segment.h). INIT: a descriptor frame (kIpcDescriptorSize bytes) follows the
// worker set: the worker offers the chunk's bytes in a segment on this host. INIT_ACK: the server mapped
// it. PUSH and PULL_REPLY: the bytes are in the worker's segment, the message carries none (nbytes 0).
inline constexpr uint8_t kFlagIpc = 16;
inline constexpr uint8_t kFlagsMask = kFlagServerOptimizer | kFlagAsync | kFlagAverage | kFlagWorkers | kFlagIpc;

inline constexpr uint32_t kSchedulerNodeId = 1;

// Message types. Data plane (worker <-> server) first, then the control plane (node <-> scheduler).
enum class Op : uint8_t {
  kInit = 1,        // worker -> server: declare a key (dtype, nbytes); payload: initial value (optional)
  kInitAck = 2,     // server -> worker: every worker declared the key; flags say the server's mode
  kPush = 3,        // worker -> server: this worker's contribution to `round` of `key`
  kPull = 4,        // worker -> server: ask for the result of `round` of `key`
  kPullReply = 5,   // server -> worker: the result (sum, or weights with a server optimizer)
  kError = 6,       // any -> sender of a bad message; payload: UTF-8 reason
  kPushAck = 7,     // server -> worker: the push was accepted (returns the worker's credit)
  kRegister = 10,   // node -> scheduler; payload: JSON
  kAddressBook = 11,
  kBarrier = 12,
  kBarrierDone = 13,
  kHeartbeat = 14,
  kNodeFailed = 15,
  kFinalize = 16,
  kShutdown = 17,
};

// Element types on the wire (codes of protocol.DType). bfloat16 travels as uint16 in numpy.
enum class WireDType : uint8_t {
  kNone = 0,
  kFloat32 = 1,
  kFloat64 = 2,
  kFloat16 = 3,
  kBFloat16 = 4,
  kInt32 = 5,
  kInt64 = 6,
};

// A message does not follow the wire format (the receiver answers with Op::kError). what() is the bare
// reason, exactly as protocol.py words it.
class ProtocolError : public Error {
 public:
  using Error::Error;
};

// A decoded message header (the fields of protocol.Header; magic, version and reserved are implied).
struct Header {
  uint8_t op = 0;
  uint8_t dtype = 0;
  uint8_t flags = 0;
  uint32_t sender = 0;
  uint64_t key = 0;
  uint64_t round = 0;
  uint64_t nbytes = 0;
};

using HeaderBytes = std::array<uint8_t, kHeaderSize>;

// Encodes `header` (magic, version and reserved filled in) into `out` (kHeaderSize bytes).
void pack_header(const Header& header, void* out);
HeaderBytes pack_header(const Header& header);
// Same, field by field, like protocol.pack_header.
HeaderBytes pack_header(Op op, uint32_t sender, uint64_t key = 0, uint64_t round = 0, uint64_t nbytes = 0,
                        uint8_t dtype = 0, uint8_t flags = 0);

// Decodes and validates a header frame: length, magic, version, op, dtype, flags and reserved bits.
// Throws ProtocolError.
Header unpack_header(const void* data, size_t size);

// True when `op` is one of the Op values.
bool is_known_op(unsigned op);
// Op name as Python's Op(op).name says it ("PUSH", "PULL_REPLY"); "OP_<n>" for unknown values.
std::string op_name(unsigned op);

// True for the codes 1..6.
bool is_known_dtype(unsigned code);
// Bytes per element of a wire dtype code (1..6); throws ProtocolError for others.
size_t wire_dtype_size(unsigned code);
// The kernels' DType of a wire dtype code (1..6); throws ProtocolError for others.
DType kernel_dtype(unsigned code);
// The wire code of a kernels' DType.
WireDType wire_dtype(DType dtype);
// True for the floating wire dtypes (AVERAGE is allowed on them only).
bool is_float_dtype(unsigned code);

// Encodes a worker set: ids as little-endian uint32 (the caller keeps them ascending).
std::string pack_workers(const std::vector<uint32_t>& workers);
// Decodes and validates a worker set frame (check_workers); throws ProtocolError.
std::vector<uint32_t> unpack_workers(const void* data, size_t size, uint32_t num_workers);
// Returns `workers` if it is non-empty, strictly ascending, with every id below num_workers; throws
// ProtocolError otherwise.
const std::vector<uint32_t>& check_workers(const std::vector<uint32_t>& workers, uint32_t num_workers);

// Node id of server `rank` (ps-lite numbering: 8, 10, 12, ...).
constexpr uint32_t server_node_id(uint32_t rank) { return 8 + 2 * rank; }
// Node id of worker machine `worker_id` (ps-lite numbering: 9, 11, 13, ...).
constexpr uint32_t worker_node_id(uint32_t worker_id) { return 9 + 2 * worker_id; }
// ZeroMQ routing id a node uses on its data connections ("tagps-node-<id>"); servers check it against
// the header's sender.
std::string routing_id(uint32_t node_id);
// "scheduler", "server 1", "worker 0", "unregistered node 3".
std::string describe_node(uint32_t node_id);

// Python's repr of a bytes object (b'tagps-node-9', b'\x00\x01'), for error text that mirrors Python.
std::string py_bytes_repr(const void* data, size_t size);
// Python's repr of a list of ints ("[0, 2]").
std::string py_list_repr(const std::vector<uint32_t>& values);

// -- CURVE ------------------------------------------------------------------------------------------

// ZAP domain of every CURVE server socket of a job.
inline constexpr const char* kZapDomain = "tagps";

// The two CURVE key pairs of a job, each key as 32 raw bytes. Python derives them (CurveKeys.from_secret)
// and passes them down Z85-encoded (40 characters) or raw.
struct CurveKeys {
  std::string server_public, server_secret, client_public, client_secret;

  // Accepts each key as 40 Z85 characters or 32 raw bytes; throws InvalidArgument otherwise.
  static CurveKeys from_keys(const std::string& server_public, const std::string& server_secret,
                             const std::string& client_public, const std::string& client_secret);
};

// Returns the 32 raw bytes of a key given as 40 Z85 characters or 32 raw bytes (InvalidArgument else).
std::string curve_key_raw(const std::string& key);
// The 40-character Z85 text of a raw 32-byte key.
std::string curve_key_z85(const std::string& raw);

// Makes `socket` (a libzmq socket handle, before it binds) a CURVE server with the job's server key pair
// that checks clients through ZAP (domain kZapDomain). Throws Error when libzmq refuses.
void curve_server(void* socket, const CurveKeys& keys);
// Makes `socket` (before it connects) a CURVE client of the job's servers.
void curve_client(void* socket, const CurveKeys& keys);

}  // namespace tagps::net
