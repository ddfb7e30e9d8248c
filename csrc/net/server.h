// The summation server's data plane in C++ (TAGPS_PS_ENGINE=cpp): the same semantics as the Python engine
// in tagps/ps/server.py, with its own ZeroMQ context, I/O thread and engine threads, none of which touches
// Python. Python keeps the control plane (registration, heartbeats, SHUTDOWN/NODE_FAILED) and writes the
// checkpoints this object hands it.
//
// Threads:
//  * the I/O thread owns the data ROUTER socket: it validates each message (wire.h plus the server's
//    checks: sender, key, dtype, sizes, worker set), answers a bad one with ERROR at once, returns a PUSH's
//    credit with PUSH_ACK, and queues the message to the engine that owns the key (keys go to the
//    least-loaded engine, by bytes, when first declared). It forwards the engines' replies, which come
//    over an inproc PUSH/PULL pair, and takes the periodic checkpoints;
//  * each engine thread owns the state of its keys. Sync mode holds a round's pushes as the received
//    messages (zero-copy), sums them in one pass into the first with kernels::sum_into (float16/bfloat16
//    accumulate in float32, rounded once), divides for AVERAGE with kernels::scale, applies the server
//    optimizer, and answers pulls with the result zero-copy (zmq_msg_copy shares the buffer; with an
//    optimizer the message references the weights). Async mode adds each push to the store (or applies
//    it) and answers pulls with a copy, after the slowest worker is within TAGPS_MAX_STALENESS;
//  * with CURVE, a ZAP handler thread admits only the job's client key.
//
// Checkpoints: with checkpoint_every = N the I/O thread, when some key completed N rounds since the last
// checkpoint, parks every engine at a marker in its queue and, at a step boundary (no round in progress,
// every moved key moved by the same count; any moment without a round in progress after 3 N), copies
// the state; take_checkpoint() hands the copies to Python, which writes the file.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "net/buffer.h"
#include "net/server_optimizer.h"
#include "net/wire.h"

namespace tagps::net {

struct ServerOptions {
  std::string host = "127.0.0.1";  // bind here, on a free port
  uint32_t num_workers = 1;
  uint64_t partition_bytes = 4096000;  // largest key (and ZMQ_MAXMSGSIZE, at least 64 KiB)
  int engine_threads = 4;
  int io_threads = 1;  // ZeroMQ I/O threads of the data socket (TAGPS_SERVER_IO_THREADS)
  bool enable_async = false;
  int64_t max_staleness = -1;    // async mode; < 0: unbounded
  int64_t checkpoint_every = 0;  // sync mode; 0: no periodic checkpoints
  OptimizerConfig optimizer;     // name "none": plain summation
  std::optional<CurveKeys> curve;
  int log_level = 30;  // Python logging level; records below it are dropped
};

// One key's saved state (the fields of a checkpoint's meta entry plus its arrays).
struct KeySnapshot {
  uint64_t key = 0;
  uint8_t dtype = 0;
  uint64_t nbytes = 0;
  uint64_t round = 0;
  int64_t step = 0;  // optimizer step
  std::vector<uint32_t> workers;
  std::vector<int64_t> counts;  // pushes per worker of `workers`
  SharedBuffer value;            // the store (async mode or a server optimizer), else null
  std::vector<std::pair<std::string, SharedBuffer>> buffers;  // optimizer state, buffer_names() order
};

struct Snapshot {
  std::vector<KeySnapshot> keys;
  // Periodic checkpoints: the distinct round counts the keys moved since the previous one.
  std::vector<uint64_t> moved;
};

// What the engine threads summed: every sync round folds its workers' pushes into one (`sum_bytes` counts
// each push's bytes, the first one included), every async push is added into the store. The times cover
// the summation kernels (sum_into, and scale for an average) only: wall clock, and the engine thread's CPU
// time, which leaves out the moments the OS gave the core to another thread.
struct ServerStats {
  uint64_t rounds = 0;    // sync rounds completed
  uint64_t messages = 0;  // data messages received
  uint64_t ipc_pushes = 0;  // sync pushes whose bytes came through a worker's shared region
  uint64_t sum_calls = 0;
  uint64_t sum_bytes = 0;
  double sum_seconds = 0;
  double sum_cpu_seconds = 0;
};

struct LogRecord {
  int level;  // Python logging level
  std::string message;
};

class Server {
 public:
  // Binds the data socket (CURVE server when options.curve is set); throws Error when it cannot.
  explicit Server(ServerOptions options);
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;
  ~Server();

  // The TCP port the data socket is bound to.
  int port() const;
  // Adds a key restored from a checkpoint (before start): answered INITs continue at its round.
  void restore_key(KeySnapshot key);
  // Starts the I/O and engine threads as server `rank` (from the scheduler's address book).
  void start(uint32_t rank);
  // Stops and joins every thread and closes the sockets; idempotent.
  void stop();
  // A copy of every declared key's state (engines parked meanwhile when running).
  Snapshot snapshot();
  // The periodic checkpoints taken since the last call, oldest first.
  std::vector<Snapshot> take_checkpoints();
  // Log records since the last call.
  std::vector<LogRecord> drain_log();
  // Why the I/O thread stopped on its own (empty while it runs or after a clean stop).
  std::string failure() const;
  // Rounds completed (sync mode) and messages received, for tests and benchmarks.
  uint64_t rounds_done() const;
  uint64_t messages_received() const;
  // Counters since start, summed over the engine threads (each thread's own are exact; the total is a
  // moment's look while they run).
  ServerStats stats() const;

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tagps::net
