// The worker's data plane over libzmq: one DEALER per server, INIT/INIT_ACK declarations, and push_pull of
// chunked tensors under a credit window (mirror of the I/O side of tagps/ps/client.py; docs/protocol.md).
//
// Python keeps the control plane (scheduler link, key numbering, barrier, close) and hands this engine the
// server endpoints once registered. One I/O thread owns every socket; callers queue work and are woken by
// an eventfd. PUSH payloads are the caller's buffer itself (zero-copy): each frame holds a reference to the
// buffer's owner until libzmq frees it, so the buffer outlives the send even when the caller moves on.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <queue>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <zmq.h>

#include "net/shared_segment.h"
#include "net/wire.h"

namespace tagps::net {

// One outstanding operation; any thread may wait on it.
class Completion {
 public:
  // Blocks until finished or `timeout_s` passed (negative: no limit); returns whether it finished.
  bool wait(double timeout_s);
  bool done() const;
  // The failure reason; empty on success or while pending.
  std::string error() const;
  // When it finished, in seconds of the steady clock (CLOCK_MONOTONIC, as Python's time.perf_counter).
  double finished_at() const;
  // Marks it finished (failed when `error` is non-empty); later calls change nothing.
  void finish(const std::string& error = {});
  // Once finished (at once if it already is), writes the 8 bytes of `tag` into the non-blocking pipe `fd`
  // from the thread that finishes it: a service thread polling `fd` learns of it without a thread of its
  // own blocked in wait(). The last call counts; `fd` -1 cancels, and no write reaches the old fd after.
  void notify(int fd, uint64_t tag);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string error_;
  double finished_at_ = 0;
  int notify_fd_ = -1;
  uint64_t notify_tag_ = 0;
};

// A chunk of a declared tensor: bytes [offset, offset + nbytes) of its buffer go to `server` as `key`.
struct ChunkSpec {
  uint64_t key = 0;
  uint32_t server = 0;
  size_t offset = 0;
  size_t nbytes = 0;
};

// A tensor to declare: its chunks are INITed; `workers` (with kFlagWorkers) and `init` (the whole initial
// value, or empty) travel as payload frames.
struct TensorSpec {
  uint64_t index = 0;
  uint8_t dtype = 0;
  std::vector<uint32_t> workers;  // empty: every worker
  std::string init;
  std::vector<ChunkSpec> chunks;
};

// A push_pull in progress. `keep` owns the buffer until it finishes; each PUSH frame holds a copy until sent.
struct PushPull : Completion {
  uint64_t index = 0;
  char* data = nullptr;
  size_t nbytes = 0;
  bool average = false;
  int64_t priority = 0;
  std::shared_ptr<void> keep;
  size_t remaining = 0;  // chunks whose PULL_REPLY is outstanding (I/O thread only)
};

struct ClientOptions {
  uint32_t node_id = 0;
  std::vector<std::string> endpoints;  // "tcp://host:port" of every server, by rank
  std::optional<CurveKeys> keys;       // client side: server_public, client_public, client_secret
  size_t credit = 8;                   // BYTEPS_SCHEDULING_CREDIT
  double send_timeout_s = 10;          // PS_HEARTBEAT_TIMEOUT: a send blocked this long fails the client
  // By server rank: the server is on this host, so offer it the chunks' bytes in shared memory
  // (TAGPS_PS_IPC; net/shared_segment.h). Empty: none is.
  std::vector<bool> colocated;
};

class ClientEngine {
 public:
  // Connects to every server and starts the I/O thread.
  explicit ClientEngine(ClientOptions options);
  ~ClientEngine();
  ClientEngine(const ClientEngine&) = delete;
  ClientEngine& operator=(const ClientEngine&) = delete;

  // INITs every chunk and blocks until each is acknowledged; returns the chunks' rounds (from INIT_ACK)
  // in order. Throws Error with the reason when the engine fails meanwhile.
  std::vector<uint64_t> declare(std::vector<TensorSpec> tensors);
  // Queues a push_pull of a declared tensor (lower priority values first); never blocks.
  std::shared_ptr<PushPull> push_pull(uint64_t index, char* data, size_t nbytes, bool average, int64_t priority,
                                      std::shared_ptr<void> keep);
  // Fails every pending and later operation with `reason` (the first reason sticks).
  void fail(const std::string& reason);
  // The reason the engine failed; empty while healthy.
  std::string fatal() const;
  // Stops the I/O thread and closes the sockets (pending operations fail). Idempotent.
  void close();
  // Chunks whose bytes the servers take from shared memory, and why others could not (empty: no failure).
  size_t ipc_chunks() const;
  std::string ipc_error() const;

 private:
  struct Declaration : Completion {
    std::vector<TensorSpec> tensors;
    std::vector<uint64_t> rounds;
    size_t left = 0;
  };
  struct Chunk {
    ChunkSpec spec;
    uint64_t round = 0;
    const SharedSegment* segment = nullptr;  // offered to a co-located server: its bytes live there,
    size_t region_offset = 0;                 // at this offset
    bool ipc = false;  // the server took the offer: PUSH and PULL_REPLY carry no payload
    char* region() const { return segment->at(region_offset); }
  };
  struct Tensor {
    uint8_t dtype = 0;
    std::vector<Chunk> chunks;
  };
  struct Queued {
    int64_t priority;
    uint64_t seq;
    std::shared_ptr<PushPull> op;
    size_t chunk;
    bool operator>(const Queued& other) const {
      return priority != other.priority ? priority > other.priority : seq > other.seq;
    }
  };
  struct Command {
    std::shared_ptr<Declaration> declaration;
    std::shared_ptr<PushPull> push_pull;
  };

  struct Message;  // a received multipart message (client.cc)

  static bool receive(void* socket, Message& m);
  static void finish(const Command& command, const std::string& error);
  void submit(Command command);
  void wake();  // with mu_ held, so that close_sockets() cannot close the eventfd meanwhile
  void close_sockets();
  void run();
  bool run_commands();  // false once close() asked the thread to stop
  void send_inits(const std::shared_ptr<Declaration>& declaration);
  void share_chunks(const std::vector<TensorSpec>& tensors);  // regions for the co-located servers' chunks
  void start(const std::shared_ptr<PushPull>& op);
  void pump();
  void drain(uint32_t rank);
  void on_message(uint32_t rank, Message& m);
  void on_pull_reply(const Header& h, Message& m);
  void on_init_ack(const Header& h);
  void send(uint32_t rank, const void* data, size_t size, int flags);
  void send_msg(uint32_t rank, zmq_msg_t& msg, int flags);
  [[noreturn]] void throw_send_failure() const;
  void fail_all(const std::string& reason);  // sets fatal_ (first reason wins), fails everything pending
  void fail_pending(const std::string& reason);

  ClientOptions options_;
  void* context_ = nullptr;
  std::vector<void*> sockets_;
  int wake_fd_ = -1;
  std::thread thread_;

  mutable std::mutex mu_;  // guards the fields below
  std::deque<Command> commands_;
  std::string fatal_;
  std::string ipc_error_;
  size_t ipc_chunks_ = 0;
  bool stopping_ = false;
  bool closed_ = false;

  // I/O-thread state.
  std::unordered_map<uint64_t, Tensor> tensors_;
  std::priority_queue<Queued, std::vector<Queued>, std::greater<Queued>> queue_;
  uint64_t seq_ = 0;
  std::unordered_map<uint64_t, std::pair<std::shared_ptr<PushPull>, size_t>> in_flight_;  // by key
  std::unordered_map<uint64_t, std::pair<std::shared_ptr<Declaration>, size_t>> inits_;  // by key
  std::unordered_map<uint64_t, std::pair<uint64_t, size_t>> chunk_of_;  // key -> (tensor index, chunk)
  size_t unacked_ = 0;
  bool failed_ = false;  // fail_all ran: later work fails at once
  std::vector<std::unique_ptr<SharedSegment>> segments_;  // live until close: servers map them
};

}  // namespace tagps::net
