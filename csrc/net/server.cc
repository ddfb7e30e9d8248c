#include "net/server.h"

#include <zmq.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <zmq.hpp>

#include "common/error.h"
#include "kernels/sum.h"
#include "net/shared_segment.h"
#include "net/zap.h"

namespace tagps::net {

namespace {

// Python logging levels.
constexpr int kInfo = 20;
constexpr int kWarning = 30;
constexpr int kError = 40;

// Messages the I/O thread dispatches per socket before it looks at the other one.
constexpr int kBatch = 256;
// Frames of a data message the I/O thread keeps (identity, header, worker set, shared-memory descriptor,
// payload); the rest of an oversized message is counted and dropped (it is refused anyway).
constexpr size_t kMaxFrames = 5;
constexpr size_t kMaxLogRecords = 10000;

// A well-formed message that is not acceptable now (answered with ERROR), like server.py's _Reject.
class Reject : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A pull waiting for its round (sync) or for the slowest worker (async).
struct Pending {
  std::string identity;
  uint32_t worker;
  uint64_t round;
};

// Per-key state. key/dtype/nbytes/engine/workers/slot are fixed at declaration; the engine owns the rest,
// except cut_round (the I/O thread's) and the pub_* mirrors, which the engine publishes for the I/O
// thread's look before it parks the engines.
struct KeyState {
  KeyState(uint64_t key_, uint8_t dtype_, uint64_t nbytes_, int engine_, std::vector<uint32_t> workers_,
           uint32_t num_workers)
      : key(key_), dtype(dtype_), nbytes(nbytes_), engine(engine_), workers(std::move(workers_)),
        slot(num_workers, -1), regions(workers.size(), nullptr) {
    for (size_t i = 0; i < workers.size(); ++i) slot[workers[i]] = static_cast<int>(i);
  }

  size_t count() const { return nbytes / wire_dtype_size(dtype); }
  size_t num_workers() const { return workers.size(); }
  bool busy() const { return !frames.empty() || !pulls.empty(); }

  const uint64_t key;
  const uint8_t dtype;
  const uint64_t nbytes;
  const int engine;
  const std::vector<uint32_t> workers;  // ascending
  std::vector<int> slot;                // slot[worker]: index into workers, or -1
  std::vector<char*> regions;           // by slot: the worker's shared region of this key (engine's), or null

  SharedBuffer value;         // the store: async mode or a server optimizer
  zmq::message_t result;      // sync summation: what pulls of the last completed round get
  bool has_result = false;
  bool average = false;       // sync: the pushes of the current round ask for the mean
  uint8_t result_flags = 0;   // flags of the PULL_REPLY of `result`
  std::optional<OptimizerState> opt;
  bool restored = false;
  bool ready = false;
  uint64_t round = 0;
  std::vector<zmq::message_t> frames;  // sync: the pushes of the current round, as received
  std::vector<bool> frame_shared;      // by frame: it is a worker's shared region, not a received buffer
  std::vector<uint8_t> pushed;
  std::vector<Pending> pulls;
  std::map<uint32_t, std::optional<zmq::message_t>> inits;  // by worker: the INIT's initial value, if any
  std::vector<std::pair<std::string, uint32_t>> init_waiters;
  std::vector<int64_t> counts;  // pushes per worker slot
  bool has_counts = false;

  uint64_t cut_round = 0;  // I/O thread: `round` at the last checkpoint (or when declared or restored)
  std::atomic<uint64_t> pub_round{0};
  std::atomic<bool> pub_busy{false};
  std::atomic<bool> pub_ready{false};

  void publish() {
    pub_round.store(round, std::memory_order_relaxed);
    pub_busy.store(busy(), std::memory_order_relaxed);
    pub_ready.store(ready, std::memory_order_relaxed);
  }
};

struct Work {
  enum class Kind { kMessage, kPark, kStop };
  Kind kind = Kind::kMessage;
  Header header;
  std::string identity;
  uint32_t worker = 0;
  KeyState* st = nullptr;
  bool has_payload = false;
  zmq::message_t payload;
  char* region = nullptr;  // INIT: the worker's shared region of the key, mapped by the I/O thread
};

class WorkQueue {
 public:
  void put(Work&& work) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      items_.push_back(std::move(work));
    }
    cv_.notify_one();
  }

  Work get() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !items_.empty(); });
    Work work = std::move(items_.front());
    items_.pop_front();
    return work;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Work> items_;
};

// A moment on the wall clock and on the calling thread's CPU clock, in nanoseconds.
struct Stamp {
  uint64_t wall_ns;
  uint64_t cpu_ns;

  static Stamp now() {
    timespec cpu{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu);
    const auto wall = std::chrono::steady_clock::now().time_since_epoch();
    return {static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(wall).count()),
            static_cast<uint64_t>(cpu.tv_sec) * 1000000000u + static_cast<uint64_t>(cpu.tv_nsec)};
  }
};

// One engine thread's summation counters (ServerStats); only that thread writes them. A cache line each,
// so that engines do not share one.
struct alignas(64) SumCounters {
  std::atomic<uint64_t> calls{0};
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint64_t> wall_ns{0};
  std::atomic<uint64_t> cpu_ns{0};

  // Counts one summation of `nbytes` gradient bytes that started at `since`.
  void add(uint64_t nbytes, const Stamp& since) {
    const Stamp end = Stamp::now();
    calls.fetch_add(1, std::memory_order_relaxed);
    bytes.fetch_add(nbytes, std::memory_order_relaxed);
    wall_ns.fetch_add(end.wall_ns - since.wall_ns, std::memory_order_relaxed);
    cpu_ns.fetch_add(end.cpu_ns - since.cpu_ns, std::memory_order_relaxed);
  }
};

// `threads` once checked: the context is built before the constructor's body runs its checks.
int checked_io_threads(int threads) {
  TAGPS_ENFORCE_GE(threads, 1, "TAGPS_SERVER_IO_THREADS");
  return threads;
}

void free_shared_buffer(void* /*data*/, void* hint) { delete static_cast<SharedBuffer*>(hint); }

// A message whose payload is `buffer`'s bytes, sent without a copy; the message keeps the buffer alive.
zmq::message_t buffer_message(const SharedBuffer& buffer) {
  auto holder = std::make_unique<SharedBuffer>(buffer);
  zmq::message_t msg(buffer->data(), buffer->size(), &free_shared_buffer, holder.get());
  holder.release();
  return msg;
}

void send_reply(zmq::socket_t& sock, const std::string& identity, const HeaderBytes& head,
                zmq::message_t* payload) {
  sock.send(zmq::buffer(identity), zmq::send_flags::sndmore);
  sock.send(zmq::buffer(head.data(), head.size()),
            payload != nullptr ? zmq::send_flags::sndmore : zmq::send_flags::none);
  if (payload != nullptr) sock.send(*payload, zmq::send_flags::none);
}

std::string list_repr(const std::set<uint64_t>& values) {
  std::string out = "[";
  for (auto it = values.begin(); it != values.end(); ++it) {
    if (it != values.begin()) out += ", ";
    out += std::to_string(*it);
  }
  return out + "]";
}

}  // namespace

class Server::Impl {
 public:
  explicit Impl(ServerOptions options);
  ~Impl() { stop(); }

  int port() const { return port_; }
  void restore_key(KeySnapshot key);
  void start(uint32_t rank);
  void stop();
  Snapshot snapshot();
  std::vector<Snapshot> take_checkpoints();
  std::vector<LogRecord> drain_log();
  std::string failure() const;
  uint64_t rounds_done() const;
  uint64_t messages_received() const { return received_.load(); }
  ServerStats stats() const;

 private:
  bool keeps_store() const { return opt_.enable_async || optimizer_.has_value(); }
  void log(int level, std::string message);

  // I/O thread
  void io_loop();
  void forward_replies();
  void receive_data();
  void dispatch(std::vector<zmq::message_t>& frames, size_t total);
  uint32_t worker_index(const std::string& identity, uint32_t sender) const;
  KeyState* declare(const Header& header, size_t payload_size, uint32_t worker,
                    const std::vector<uint32_t>& workers);
  KeyState* add_key(uint64_t key, uint8_t dtype, uint64_t nbytes, std::vector<uint32_t> workers);
  void maybe_checkpoint();
  std::optional<std::set<uint64_t>> cut_moved(bool look) const;

  // engine threads
  void engine_loop(int index);
  void init(zmq::socket_t& out, KeyState& st, Work& work);
  void push(zmq::socket_t& out, KeyState& st, Work& work);
  void pull(zmq::socket_t& out, KeyState& st, const Work& work);
  void answer_ready_pulls(zmq::socket_t& out, KeyState& st);
  void send_value(zmq::socket_t& out, KeyState& st, const std::string& identity, uint32_t worker,
                  uint64_t round);
  void reply_error(zmq::socket_t& sock, const std::string& identity, const Header* header,
                   const std::string& reason);

  // parking (callers hold parker_mu_)
  void park();
  void unpark();
  void park_here();
  Snapshot copy_state();

  ServerOptions opt_;
  std::optional<ServerOptimizer> optimizer_;
  uint8_t flags_ = 0;
  zmq::context_t ctx_;
  std::unique_ptr<ZapHandler> zap_;
  zmq::socket_t router_;
  zmq::socket_t replies_;
  std::string replies_endpoint_;
  int port_ = 0;
  uint32_t rank_ = 0;
  uint32_t node_id_ = 0;

  // Inserted by the I/O thread (or restore_key before start) under keys_mu_; other threads read under it.
  mutable std::mutex keys_mu_;
  std::unordered_map<uint64_t, std::unique_ptr<KeyState>> keys_;
  std::vector<KeyState*> order_;
  std::vector<uint64_t> loads_;

  std::vector<std::unique_ptr<WorkQueue>> queues_;
  std::vector<std::thread> engines_;
  std::thread io_;
  std::atomic<bool> stopping_{false};
  bool started_ = false;
  bool stopped_ = false;
  std::unique_ptr<std::atomic<uint64_t>[]> done_;  // rounds completed per engine
  std::unique_ptr<SumCounters[]> sums_;            // per engine
  uint64_t done_tried_ = 0;

  std::mutex parker_mu_;  // one parker at a time (the I/O thread's checkpoints, snapshot())
  std::mutex park_mu_;
  std::condition_variable park_cv_;
  int parked_ = 0;
  uint64_t park_gen_ = 0;

  mutable std::mutex out_mu_;
  std::vector<Snapshot> checkpoints_;
  std::vector<LogRecord> log_;
  size_t log_dropped_ = 0;
  std::string failure_;
  std::atomic<uint64_t> received_{0};
  std::atomic<uint64_t> ipc_pushes_{0};
  SegmentMap segments_;  // the workers' shared segments (TAGPS_PS_IPC), mapped at their INITs
};

Server::Impl::Impl(ServerOptions options)
    : opt_(std::move(options)), ctx_(checked_io_threads(opt_.io_threads)) {
  TAGPS_ENFORCE_GE(opt_.engine_threads, 1, "BYTEPS_SERVER_ENGINE_THREAD");
  TAGPS_ENFORCE_GE(opt_.num_workers, 1u, "DMLC_NUM_WORKER");
  TAGPS_ENFORCE_GE(opt_.checkpoint_every, 0, "checkpoint_every");
  TAGPS_ENFORCE(!(opt_.checkpoint_every > 0 && opt_.enable_async), "periodic checkpoints need sync mode");
  if (opt_.optimizer.name != "none") optimizer_.emplace(opt_.optimizer);
  flags_ = static_cast<uint8_t>((optimizer_ ? kFlagServerOptimizer : 0) | (opt_.enable_async ? kFlagAsync : 0));
  const auto engines = static_cast<size_t>(opt_.engine_threads);
  loads_.assign(engines, 0);
  done_ = std::make_unique<std::atomic<uint64_t>[]>(engines);
  for (size_t i = 0; i < engines; ++i) done_[i] = 0;
  sums_ = std::make_unique<SumCounters[]>(engines);
  for (size_t i = 0; i < engines; ++i) queues_.push_back(std::make_unique<WorkQueue>());

  if (opt_.curve) {
    zap_ = std::make_unique<ZapHandler>(ctx_, curve_key_raw(opt_.curve->client_public),
                                        [this](int level, const std::string& m) { log(level, m); });
  }
  router_ = zmq::socket_t(ctx_, zmq::socket_type::router);
  if (opt_.curve) curve_server(router_.handle(), *opt_.curve);
  router_.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(std::max<uint64_t>(opt_.partition_bytes, 1 << 16)));
  router_.set(zmq::sockopt::linger, 0);
  try {
    router_.bind("tcp://" + opt_.host + ":*");
  } catch (const zmq::error_t& exc) {
    throw Error("cannot bind to DMLC_NODE_HOST=" + opt_.host + ": " + exc.what());
  }
  const std::string endpoint = router_.get(zmq::sockopt::last_endpoint);
  port_ = std::stoi(endpoint.substr(endpoint.rfind(':') + 1));
  // No high-water mark on the engines' replies: what is queued is bounded by the workers' requests, and
  // an engine must never block in send.
  replies_ = zmq::socket_t(ctx_, zmq::socket_type::pull);
  replies_.set(zmq::sockopt::rcvhwm, 0);
  replies_.set(zmq::sockopt::linger, 0);
  replies_endpoint_ = "inproc://tagps-server-replies";
  replies_.bind(replies_endpoint_);
}

void Server::Impl::log(int level, std::string message) {
  if (level < opt_.log_level) return;
  std::lock_guard<std::mutex> lock(out_mu_);
  if (log_.size() >= kMaxLogRecords) {
    ++log_dropped_;
    return;
  }
  log_.push_back({level, std::move(message)});
}

std::vector<LogRecord> Server::Impl::drain_log() {
  std::lock_guard<std::mutex> lock(out_mu_);
  std::vector<LogRecord> out;
  out.swap(log_);
  if (log_dropped_) {
    out.push_back({kWarning, detail::concat(log_dropped_, " more log records of the C++ engine were dropped")});
    log_dropped_ = 0;
  }
  return out;
}

std::string Server::Impl::failure() const {
  std::lock_guard<std::mutex> lock(out_mu_);
  return failure_;
}

uint64_t Server::Impl::rounds_done() const {
  uint64_t total = 0;
  for (size_t i = 0; i < queues_.size(); ++i) total += done_[i].load(std::memory_order_acquire);
  return total;
}

ServerStats Server::Impl::stats() const {
  ServerStats out;
  out.rounds = rounds_done();
  out.messages = messages_received();
  out.ipc_pushes = ipc_pushes_.load(std::memory_order_relaxed);
  uint64_t wall_ns = 0, cpu_ns = 0;
  for (size_t i = 0; i < queues_.size(); ++i) {
    out.sum_calls += sums_[i].calls.load(std::memory_order_relaxed);
    out.sum_bytes += sums_[i].bytes.load(std::memory_order_relaxed);
    wall_ns += sums_[i].wall_ns.load(std::memory_order_relaxed);
    cpu_ns += sums_[i].cpu_ns.load(std::memory_order_relaxed);
  }
  out.sum_seconds = static_cast<double>(wall_ns) * 1e-9;
  out.sum_cpu_seconds = static_cast<double>(cpu_ns) * 1e-9;
  return out;
}

KeyState* Server::Impl::add_key(uint64_t key, uint8_t dtype, uint64_t nbytes, std::vector<uint32_t> workers) {
  const size_t engine = static_cast<size_t>(std::min_element(loads_.begin(), loads_.end()) - loads_.begin());
  loads_[engine] += nbytes;
  auto state = std::make_unique<KeyState>(key, dtype, nbytes, static_cast<int>(engine), std::move(workers),
                                          opt_.num_workers);
  KeyState* st = state.get();
  std::lock_guard<std::mutex> lock(keys_mu_);
  keys_.emplace(key, std::move(state));
  order_.push_back(st);
  return st;
}

void Server::Impl::restore_key(KeySnapshot k) {
  TAGPS_ENFORCE(!started_, "restore_key before start");
  TAGPS_ENFORCE(keys_.find(k.key) == keys_.end(), "key ", k.key, " restored twice");
  TAGPS_ENFORCE(is_known_dtype(k.dtype), "key ", k.key, ": unknown dtype code ", int{k.dtype});
  TAGPS_ENFORCE(k.nbytes > 0 && k.nbytes % wire_dtype_size(k.dtype) == 0, "key ", k.key, ": ", k.nbytes,
                " bytes is not a positive number of elements");
  try {
    check_workers(k.workers, opt_.num_workers);
  } catch (const ProtocolError& exc) {
    throw InvalidArgument(exc.what());
  }
  if (k.counts.size() != k.workers.size()) {
    throw InvalidArgument(detail::concat("key ", k.key, " has push counts of ", k.counts.size(),
                                         " workers, expected ", k.workers.size(), " (DMLC_NUM_WORKER differs)"));
  }
  if (keeps_store()) {
    TAGPS_ENFORCE(k.value && k.value->size() == k.nbytes, "key ", k.key, ": the restored value must have ",
                  k.nbytes, " bytes");
  }
  std::optional<OptimizerState> opt;
  if (optimizer_) {
    TAGPS_ENFORCE_EQ(k.buffers.size(), optimizer_->buffer_names().size(), "optimizer buffers of key ", k.key);
    opt.emplace();
    opt->step = k.step;
    for (size_t i = 0; i < k.buffers.size(); ++i) {
      TAGPS_ENFORCE(k.buffers[i].first == optimizer_->buffer_names()[i], "key ", k.key, ": optimizer buffer ",
                    k.buffers[i].first, " where ", optimizer_->buffer_names()[i], " was expected");
      TAGPS_ENFORCE(k.buffers[i].second && k.buffers[i].second->size() == k.nbytes, "optimizer buffer ",
                    k.buffers[i].first, " of key ", k.key, " must have ", k.nbytes, " bytes");
      opt->buffers.push_back(k.buffers[i].second);
    }
  }
  KeyState* st = add_key(k.key, k.dtype, k.nbytes, k.workers);
  if (keeps_store()) st->value = k.value;
  st->opt = std::move(opt);
  st->round = k.round;
  st->counts = k.counts;
  st->has_counts = true;
  st->restored = true;
  st->cut_round = k.round;
  st->publish();
}

void Server::Impl::start(uint32_t rank) {
  TAGPS_ENFORCE(!started_, "the server engine is already started");
  rank_ = rank;
  node_id_ = server_node_id(rank);
  started_ = true;
  for (size_t i = 0; i < queues_.size(); ++i) {
    engines_.emplace_back([this, i] { engine_loop(static_cast<int>(i)); });
  }
  io_ = std::thread([this] { io_loop(); });
}

void Server::Impl::stop() {
  if (stopped_) return;
  stopped_ = true;
  stopping_ = true;
  if (io_.joinable()) io_.join();
  for (auto& queue : queues_) {
    Work work;
    work.kind = Work::Kind::kStop;
    queue->put(std::move(work));
  }
  for (auto& thread : engines_) thread.join();
  engines_.clear();
  router_.close();
  replies_.close();
  zap_.reset();
  ctx_.shutdown();
  ctx_.close();
}

// -- I/O thread ----------------------------------------------------------------------------------------

void Server::Impl::io_loop() {
  try {
    zmq_pollitem_t items[2] = {{router_.handle(), 0, ZMQ_POLLIN, 0}, {replies_.handle(), 0, ZMQ_POLLIN, 0}};
    while (!stopping_.load(std::memory_order_relaxed)) {
      if (zmq_poll(items, 2, 50) < 0) {
        if (zmq_errno() == EINTR) continue;
        throw zmq::error_t();
      }
      // Before dispatching anything new: a round that just completed is then seen at its boundary.
      maybe_checkpoint();
      if (items[1].revents & ZMQ_POLLIN) forward_replies();
      maybe_checkpoint();
      if (items[0].revents & ZMQ_POLLIN) receive_data();
    }
  } catch (const std::exception& exc) {
    std::lock_guard<std::mutex> lock(out_mu_);
    failure_ = std::string("the C++ server engine's I/O thread failed: ") + exc.what();
  }
}

void Server::Impl::forward_replies() {
  for (int n = 0; n < kBatch; ++n) {
    zmq::message_t part;
    if (!replies_.recv(part, zmq::recv_flags::dontwait)) return;
    bool more = part.more();
    // ROUTER without ROUTER_MANDATORY never blocks: a reply to a peer that left is dropped.
    router_.send(part, more ? zmq::send_flags::sndmore : zmq::send_flags::none);
    while (more) {
      (void)replies_.recv(part, zmq::recv_flags::none);
      more = part.more();
      router_.send(part, more ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
  }
}

void Server::Impl::receive_data() {
  std::vector<zmq::message_t> frames;
  frames.reserve(kMaxFrames);
  for (int n = 0; n < kBatch; ++n) {
    zmq::message_t first;
    if (!router_.recv(first, zmq::recv_flags::dontwait)) return;
    frames.clear();
    bool more = first.more();
    frames.push_back(std::move(first));
    size_t total = 1;
    while (more) {
      zmq::message_t part;
      (void)router_.recv(part, zmq::recv_flags::none);
      more = part.more();
      ++total;
      if (frames.size() < kMaxFrames) frames.push_back(std::move(part));
    }
    received_.fetch_add(1, std::memory_order_relaxed);
    dispatch(frames, total);
  }
}

uint32_t Server::Impl::worker_index(const std::string& identity, uint32_t sender) const {
  if (sender < 9 || sender % 2 == 0 || (sender - 9) / 2 >= opt_.num_workers) {
    throw ProtocolError(detail::concat("sender ", sender, " is not a worker node id of this job"));
  }
  if (identity != routing_id(sender)) {
    throw ProtocolError(detail::concat("sender ", sender, " does not match the connection's identity ",
                                       py_bytes_repr(identity.data(), identity.size())));
  }
  return (sender - 9) / 2;
}

void Server::Impl::dispatch(std::vector<zmq::message_t>& frames, size_t total) {
  const std::string identity = frames[0].to_string();
  std::optional<Header> header;
  try {
    if (total < 2) throw ProtocolError("expected a header frame, got none");
    header = unpack_header(frames[1].data(), frames[1].size());
    const Header& h = *header;
    const Op op = static_cast<Op>(h.op);
    const bool subset = h.flags & kFlagWorkers;
    const bool shared = h.flags & kFlagIpc;
    if (subset && op != Op::kInit) {
      throw ProtocolError("FLAG_WORKERS on " + op_name(h.op) + "; only INIT carries a worker set");
    }
    if (shared && op != Op::kInit && op != Op::kPush) {
      throw ProtocolError("FLAG_IPC on " + op_name(h.op) + "; only INIT and PUSH carry it");
    }
    const bool descriptor = shared && op == Op::kInit;
    const size_t low = 2 + (subset ? 1 : 0) + (descriptor ? 1 : 0), high = low + 1;
    if (total < low || total > high) {
      throw ProtocolError(detail::concat("expected header, ", subset ? "worker set, " : "",
                                         descriptor ? "shared-memory descriptor, " : "",
                                         "and at most one payload frame, got ", total - 1, " frames"));
    }
    const uint32_t worker = worker_index(identity, h.sender);
    const bool has_payload = total == high;
    const size_t size = has_payload ? frames.back().size() : 0;
    KeyState* st = nullptr;
    char* region = nullptr;
    if (op == Op::kInit) {
      std::vector<uint32_t> declared;
      if (subset) {
        declared = unpack_workers(frames[2].data(), frames[2].size(), opt_.num_workers);
      } else {
        for (uint32_t w = 0; w < opt_.num_workers; ++w) declared.push_back(w);
      }
      std::optional<IpcDescriptor> offer;
      if (descriptor) offer = unpack_ipc(frames[low - 1].data(), frames[low - 1].size());
      st = declare(h, size, worker, declared);
      // A server that keeps a store answers pulls from it, not from sums: it takes no shared memory.
      if (offer && !keeps_store()) {
        std::string why;
        region = segments_.map(*offer, h.nbytes, why);
        if (region == nullptr) {
          log(kInfo, detail::concat("worker ", worker, "'s key ", h.key, " goes over TCP: ", why));
        }
      }
    } else if (op == Op::kPush || op == Op::kPull) {
      auto it = keys_.find(h.key);  // the I/O thread is the only writer: no lock to read
      if (it == keys_.end()) {
        throw ProtocolError(detail::concat("key ", h.key, " was never declared (send INIT first)"));
      }
      st = it->second.get();
      if (st->slot[worker] < 0) {
        throw ProtocolError(detail::concat("worker ", worker, " is not among the workers ",
                                           py_list_repr(st->workers), " of key ", h.key));
      }
      if (h.dtype != st->dtype) {
        throw ProtocolError(detail::concat("dtype code ", int{h.dtype}, " but key ", h.key, " holds ",
                                           int{st->dtype}));
      }
      if ((h.flags & kFlagAverage) && !is_float_dtype(st->dtype)) {
        throw ProtocolError(detail::concat("AVERAGE of integer key ", h.key));
      }
      const uint64_t expected = op == Op::kPush && !shared ? st->nbytes : 0;
      if (size != expected || h.nbytes != expected) {
        throw ProtocolError(detail::concat(op_name(h.op), " of key ", h.key, " carries ", size,
                                           " bytes (header: ", h.nbytes, "), expected ", expected));
      }
    } else {
      throw ProtocolError("a server does not handle " + op_name(h.op));
    }
    Work work;
    work.header = h;
    work.identity = identity;
    work.worker = worker;
    work.st = st;
    work.has_payload = has_payload;
    work.region = region;
    if (has_payload) work.payload = std::move(frames.back());
    queues_[static_cast<size_t>(st->engine)]->put(std::move(work));
    if (op == Op::kPush) {
      // The worker's credit comes back as soon as the bytes are here, whatever the other workers do (so
      // workers that order chunks differently cannot deadlock); a push the engine then rejects still
      // gets its ERROR.
      send_reply(router_, identity, pack_header(Op::kPushAck, node_id_, h.key, h.round, 0, h.dtype), nullptr);
    }
  } catch (const ProtocolError& exc) {
    reply_error(router_, identity, header ? &*header : nullptr, exc.what());
  }
}

KeyState* Server::Impl::declare(const Header& h, size_t payload_size, uint32_t worker,
                                const std::vector<uint32_t>& workers) {
  if (!std::binary_search(workers.begin(), workers.end(), worker)) {
    throw ProtocolError(detail::concat("worker ", worker, " sent INIT of key ", h.key, " for the workers ",
                                       py_list_repr(workers), ", which exclude it"));
  }
  if (h.dtype == 0) throw ProtocolError("INIT needs a dtype");
  const size_t itemsize = wire_dtype_size(h.dtype);
  const uint64_t limit = opt_.partition_bytes;
  if (h.nbytes == 0 || h.nbytes > limit || h.nbytes % itemsize) {
    throw ProtocolError(detail::concat("INIT of key ", h.key, " declares ", h.nbytes,
                                       " bytes; needs a multiple of ", itemsize,
                                       " in [1, BYTEPS_PARTITION_BYTES=", limit, "]"));
  }
  if (payload_size != 0 && payload_size != h.nbytes) {
    throw ProtocolError(
        detail::concat("INIT payload of ", payload_size, " bytes for a ", h.nbytes, "-byte key"));
  }
  if (optimizer_ && h.dtype != static_cast<uint8_t>(WireDType::kFloat32) &&
      h.dtype != static_cast<uint8_t>(WireDType::kFloat64)) {
    throw ProtocolError("TAGPS_SERVER_OPTIMIZER=" + optimizer_->config().name + " needs float32 or float64 keys");
  }
  auto it = keys_.find(h.key);
  if (it == keys_.end()) return add_key(h.key, h.dtype, h.nbytes, workers);
  KeyState* st = it->second.get();
  if (st->dtype != h.dtype || st->nbytes != h.nbytes) {
    throw ProtocolError(detail::concat("key ", h.key, " is declared as ", st->nbytes, " bytes of dtype ",
                                       int{st->dtype}, "; this INIT says ", h.nbytes, " bytes of dtype ",
                                       int{h.dtype}));
  }
  if (st->workers != workers) {
    throw ProtocolError(detail::concat("key ", h.key, " is declared for the workers ", py_list_repr(st->workers),
                                       "; this INIT from worker ", worker, " says ", py_list_repr(workers)));
  }
  return st;
}

std::optional<std::set<uint64_t>> Server::Impl::cut_moved(bool look) const {
  std::set<uint64_t> moved;
  for (const KeyState* st : order_) {
    if (!(look ? st->pub_ready.load(std::memory_order_relaxed) : st->ready)) continue;
    if (look ? st->pub_busy.load(std::memory_order_relaxed) : st->busy()) return std::nullopt;  // mid-round
    const uint64_t round = look ? st->pub_round.load(std::memory_order_relaxed) : st->round;
    if (round != st->cut_round) moved.insert(round - st->cut_round);
  }
  const auto every = static_cast<uint64_t>(opt_.checkpoint_every);
  if (moved.empty() || *moved.rbegin() < every || (moved.size() > 1 && *moved.rbegin() < 3 * every)) {
    return std::nullopt;
  }
  return moved;
}

void Server::Impl::maybe_checkpoint() {
  if (opt_.checkpoint_every <= 0) return;
  // A first look without parking (at what the engines published) spares the engines a stop at nearly
  // every round; the decision is taken again while they are parked.
  const uint64_t done = rounds_done();
  if (done == done_tried_) return;
  done_tried_ = done;
  if (!cut_moved(true)) return;
  std::lock_guard<std::mutex> parker(parker_mu_);
  park();
  try {
    if (auto moved = cut_moved(false)) {
      if (moved->size() > 1) {
        log(kWarning, "checkpoint with keys at different steps: they moved " + list_repr(*moved) + " rounds");
      }
      Snapshot snap = copy_state();
      snap.moved.assign(moved->begin(), moved->end());
      for (KeyState* st : order_) st->cut_round = st->round;
      std::lock_guard<std::mutex> lock(out_mu_);
      checkpoints_.push_back(std::move(snap));
    }
  } catch (...) {
    unpark();
    throw;
  }
  unpark();
}

// -- parking ------------------------------------------------------------------------------------------

void Server::Impl::park() {
  std::unique_lock<std::mutex> lock(park_mu_);
  parked_ = 0;
  for (auto& queue : queues_) {
    Work work;
    work.kind = Work::Kind::kPark;
    queue->put(std::move(work));
  }
  const int engines = static_cast<int>(queues_.size());
  park_cv_.wait(lock, [&] { return parked_ == engines; });
}

void Server::Impl::unpark() {
  {
    std::lock_guard<std::mutex> lock(park_mu_);
    ++park_gen_;
  }
  park_cv_.notify_all();
}

void Server::Impl::park_here() {
  std::unique_lock<std::mutex> lock(park_mu_);
  const uint64_t gen = park_gen_;
  ++parked_;
  park_cv_.notify_all();
  park_cv_.wait(lock, [&] { return park_gen_ != gen; });
}

Snapshot Server::Impl::copy_state() {
  Snapshot snap;
  std::lock_guard<std::mutex> lock(keys_mu_);
  for (const KeyState* st : order_) {
    if (!st->has_counts) continue;
    KeySnapshot k;
    k.key = st->key;
    k.dtype = st->dtype;
    k.nbytes = st->nbytes;
    k.round = st->round;
    k.step = st->opt ? st->opt->step : 0;
    k.workers = st->workers;
    k.counts = st->counts;
    if (st->value) k.value = st->value->clone();
    if (st->opt) {
      for (size_t i = 0; i < st->opt->buffers.size(); ++i) {
        k.buffers.emplace_back(optimizer_->buffer_names()[i], st->opt->buffers[i]->clone());
      }
    }
    snap.keys.push_back(std::move(k));
  }
  return snap;
}

Snapshot Server::Impl::snapshot() {
  std::lock_guard<std::mutex> parker(parker_mu_);
  const bool running = started_ && !stopped_;
  if (running) park();
  Snapshot snap;
  try {
    snap = copy_state();
  } catch (...) {
    if (running) unpark();
    throw;
  }
  if (running) unpark();
  return snap;
}

std::vector<Snapshot> Server::Impl::take_checkpoints() {
  std::lock_guard<std::mutex> lock(out_mu_);
  std::vector<Snapshot> out;
  out.swap(checkpoints_);
  return out;
}

// -- engine threads -----------------------------------------------------------------------------------

void Server::Impl::engine_loop(int index) {
  zmq::socket_t out(ctx_, zmq::socket_type::push);
  out.set(zmq::sockopt::linger, 0);
  out.set(zmq::sockopt::sndhwm, 0);
  out.connect(replies_endpoint_);
  WorkQueue& queue = *queues_[static_cast<size_t>(index)];
  for (;;) {
    Work work = queue.get();
    if (work.kind == Work::Kind::kStop) break;
    if (work.kind == Work::Kind::kPark) {
      park_here();  // parked: a checkpoint reads every key now
      continue;
    }
    KeyState& st = *work.st;
    try {
      switch (static_cast<Op>(work.header.op)) {
        case Op::kInit:
          init(out, st, work);
          break;
        case Op::kPush:
          push(out, st, work);
          break;
        default:
          pull(out, st, work);
          break;
      }
    } catch (const Reject& exc) {
      reply_error(out, work.identity, &work.header, exc.what());
    } catch (const std::exception& exc) {  // a kernel or allocation failure must not kill the engine
      log(kError, detail::concat("engine ", index, " failed on ", op_name(work.header.op), ": ", exc.what()));
      try {
        reply_error(out, work.identity, &work.header, exc.what());
      } catch (const std::exception&) {
      }
    }
    st.publish();
  }
  out.close();
}

void Server::Impl::init(zmq::socket_t& out, KeyState& st, Work& work) {
  if (st.ready) throw Reject(detail::concat("key ", st.key, " is already declared by every worker"));
  if (st.inits.count(work.worker)) {
    throw Reject(detail::concat("worker ", work.worker, " declared key ", st.key, " twice"));
  }
  if (work.has_payload) {
    st.inits[work.worker] = std::move(work.payload);
  } else {
    st.inits[work.worker] = std::nullopt;
  }
  st.regions[static_cast<size_t>(st.slot[work.worker])] = work.region;
  st.init_waiters.emplace_back(work.identity, work.worker);
  if (st.inits.size() < st.num_workers()) return;
  if (!st.restored) {
    if (keeps_store()) {
      st.value = std::make_shared<AlignedBuffer>(st.nbytes);
      for (auto& [w, payload] : st.inits) {  // the lowest worker's initial value
        if (payload) {
          std::memcpy(st.value->data(), payload->data(), st.nbytes);
          break;
        }
      }
      if (optimizer_) st.opt = optimizer_->new_state(st.nbytes);
    }
    st.counts.assign(st.num_workers(), 0);
    st.has_counts = true;
  }
  st.pushed.assign(st.num_workers(), 0);
  st.inits.clear();
  st.ready = true;
  for (const auto& [identity, w] : st.init_waiters) {
    const uint64_t round =
        opt_.enable_async ? static_cast<uint64_t>(st.counts[static_cast<size_t>(st.slot[w])]) : st.round;
    const bool shared = st.regions[static_cast<size_t>(st.slot[w])] != nullptr;
    send_reply(out, identity,
               pack_header(Op::kInitAck, node_id_, st.key, round, 0, st.dtype, flags_ | (shared ? kFlagIpc : 0)),
               nullptr);
  }
  st.init_waiters.clear();
}

void Server::Impl::push(zmq::socket_t& out, KeyState& st, Work& work) {
  const uint64_t round = work.header.round;
  const bool average = work.header.flags & kFlagAverage;
  const auto slot = static_cast<size_t>(st.slot[work.worker]);
  if (!st.ready || !st.has_counts) {
    throw Reject(detail::concat("PUSH of key ", st.key, " before every worker declared it"));
  }
  if (opt_.enable_async) {
    if (round != static_cast<uint64_t>(st.counts[slot])) {
      throw Reject(detail::concat("PUSH of key ", st.key, " round ", round, "; worker ", work.worker, " is at ",
                                  st.counts[slot]));
    }
  } else if (round != st.round) {
    throw Reject(
        detail::concat("PUSH of key ", st.key, " for round ", round, " while the key is at round ", st.round));
  } else if (st.pushed[slot]) {
    throw Reject(detail::concat("worker ", work.worker, " pushed key ", st.key, " twice in round ", round));
  } else if (!st.frames.empty() && average != st.average) {
    throw Reject(detail::concat("workers disagree on average= for key ", st.key, " round ", round));
  }
  const bool shared = work.header.flags & kFlagIpc;
  if (shared && st.regions[slot] == nullptr) {
    throw Reject(detail::concat("PUSH with FLAG_IPC of key ", st.key, " from worker ", work.worker,
                                ", whose shared memory this server did not take"));
  }
  const DType dtype = kernel_dtype(st.dtype);
  const size_t count = st.count();
  if (opt_.enable_async) {
    if (optimizer_ && st.opt) {
      optimizer_->step(dtype, st.value->data(), work.payload.data(), count, *st.opt);
    } else {
      kernels::SumOptions o;
      o.dtype = dtype;
      o.dst = st.value->data();
      o.srcs = {work.payload.data()};
      o.count = count;
      const Stamp start = Stamp::now();
      kernels::sum_into(o);
      sums_[static_cast<size_t>(st.engine)].add(st.nbytes, start);
    }
    st.counts[slot] += 1;
    answer_ready_pulls(out, st);
    return;
  }
  st.pushed[slot] = 1;
  st.average = average;
  if (shared) {
    // The worker's region itself (no free function: the segment outlives the round).
    work.payload = zmq::message_t(st.regions[slot], st.nbytes, nullptr, nullptr);
    ipc_pushes_.fetch_add(1, std::memory_order_relaxed);
  }
  st.frames.push_back(std::move(work.payload));
  st.frame_shared.push_back(shared);
  if (st.frames.size() < st.num_workers()) return;
  // Sum in place into the first received message (ZeroMQ's own buffer): one pass, no extra copy, and
  // that message is then sent zero-copy to every TCP puller. A shared region is the destination only when
  // every push came through one: its owner rewrites it once answered, while a TCP reply may still be
  // sending.
  const auto received = std::find(st.frame_shared.begin(), st.frame_shared.end(), false);
  if (received != st.frame_shared.end()) {
    const auto first = static_cast<size_t>(received - st.frame_shared.begin());
    std::swap(st.frames[0], st.frames[first]);
  }
  kernels::SumOptions o;
  o.dtype = dtype;
  o.dst = st.frames[0].data();
  for (size_t i = 1; i < st.frames.size(); ++i) o.srcs.push_back(st.frames[i].data());
  o.count = count;
  // One worker: its push is the sum (no kernel runs, nothing is counted).
  const bool summing = !o.srcs.empty();
  const Stamp start = Stamp::now();
  if (summing) kernels::sum_into(o);
  if (optimizer_ && st.opt && st.value) {
    if (summing) sums_[static_cast<size_t>(st.engine)].add(st.nbytes * st.frames.size(), start);
    optimizer_->step(dtype, st.value->data(), st.frames[0].data(), count, *st.opt);
    st.has_result = false;  // pulls get the weights
  } else {
    if (st.average && summing) {
      kernels::ScaleOptions s;
      s.dtype = dtype;
      s.buf = st.frames[0].data();
      s.count = count;
      s.factor = 1.0 / static_cast<double>(st.num_workers());
      kernels::scale(s);
    }
    if (summing) sums_[static_cast<size_t>(st.engine)].add(st.nbytes * st.frames.size(), start);
    // Every sharing worker's region gets the result now, while all of them wait for it: a late pull
    // must not copy from a region whose owner, already answered, rewrites it.
    for (char* region : st.regions) {
      if (region != nullptr && region != st.frames[0].data()) std::memcpy(region, st.frames[0].data(), st.nbytes);
    }
    st.result = std::move(st.frames[0]);
    st.has_result = true;
  }
  st.result_flags = static_cast<uint8_t>(flags_ | (st.average && !optimizer_ ? kFlagAverage : 0));
  st.frames.clear();
  st.frame_shared.clear();
  st.pushed.assign(st.num_workers(), 0);
  st.round += 1;
  for (const Pending& p : st.pulls) send_value(out, st, p.identity, p.worker, p.round);
  st.pulls.clear();
  st.publish();
  // Last: when the I/O thread sees it, this key is between rounds (and has published so).
  done_[static_cast<size_t>(st.engine)].fetch_add(1, std::memory_order_release);
}

void Server::Impl::pull(zmq::socket_t& out, KeyState& st, const Work& work) {
  const uint64_t round = work.header.round;
  if (!st.ready || !st.has_counts) {
    throw Reject(detail::concat("PULL of key ", st.key, " before every worker declared it"));
  }
  if (opt_.enable_async) {
    const int64_t pushed = st.counts[static_cast<size_t>(st.slot[work.worker])];
    if (pushed < 1 || round != static_cast<uint64_t>(pushed - 1)) {
      throw Reject(detail::concat("PULL of key ", st.key, " round ", round, " before worker ", work.worker,
                                  "'s push of that round"));
    }
    st.pulls.push_back({work.identity, work.worker, round});
    answer_ready_pulls(out, st);
  } else if (st.round > 0 && round == st.round - 1) {
    send_value(out, st, work.identity, work.worker, round);
  } else if (round == st.round) {
    st.pulls.push_back({work.identity, work.worker, round});
  } else {
    throw Reject(
        detail::concat("PULL of key ", st.key, " round ", round, " while the key is at round ", st.round));
  }
}

void Server::Impl::answer_ready_pulls(zmq::socket_t& out, KeyState& st) {
  if (st.pulls.empty() || !st.has_counts) return;
  const int64_t slowest = *std::min_element(st.counts.begin(), st.counts.end());
  std::vector<Pending> waiting;
  for (Pending& p : st.pulls) {
    if (opt_.max_staleness < 0 || slowest >= static_cast<int64_t>(p.round) + 1 - opt_.max_staleness) {
      send_value(out, st, p.identity, p.worker, p.round);
    } else {
      waiting.push_back(std::move(p));
    }
  }
  st.pulls = std::move(waiting);
}

void Server::Impl::send_value(zmq::socket_t& out, KeyState& st, const std::string& identity, uint32_t worker,
                              uint64_t round) {
  if (st.has_result && st.regions[static_cast<size_t>(st.slot[worker])] != nullptr) {
    // The result is already in the worker's region (copied when the round completed).
    send_reply(out, identity,
               pack_header(Op::kPullReply, node_id_, st.key, round, 0, st.dtype, st.result_flags | kFlagIpc),
               nullptr);
    return;
  }
  const HeaderBytes head = pack_header(Op::kPullReply, node_id_, st.key, round, st.nbytes, st.dtype,
                                       opt_.enable_async ? flags_ : st.result_flags);
  zmq::message_t payload;
  if (opt_.enable_async) {
    payload = zmq::message_t(st.value->data(), st.nbytes);  // a copy: later pushes change the store
  } else if (optimizer_ && st.value) {
    // The weights, zero-copy: round r + 1 cannot complete (and change them) before every worker received
    // round r.
    payload = buffer_message(st.value);
  } else if (st.has_result) {
    payload.copy(st.result);  // shares the buffer (reference count)
  } else {
    throw Reject(detail::concat("PULL of key ", st.key, " round ", round, ": the server has no result of it",
                                " (restored at round ", st.round, ")"));
  }
  send_reply(out, identity, head, &payload);
}

void Server::Impl::reply_error(zmq::socket_t& sock, const std::string& identity, const Header* header,
                               const std::string& reason) {
  const uint64_t key = header != nullptr ? header->key : 0;
  const uint64_t round = header != nullptr ? header->round : 0;
  log(kWarning, detail::concat("rejected a message from ", py_bytes_repr(identity.data(), identity.size()),
                               " (key ", key, " round ", round, "): ", reason));
  const std::string text = detail::concat("server ", rank_, ": ", reason);
  zmq::message_t payload(text.data(), text.size());
  send_reply(sock, identity, pack_header(Op::kError, node_id_, key, round, text.size()), &payload);
}

// -- Server ---------------------------------------------------------------------------------------------

Server::Server(ServerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
Server::~Server() = default;
int Server::port() const { return impl_->port(); }
void Server::restore_key(KeySnapshot key) { impl_->restore_key(std::move(key)); }
void Server::start(uint32_t rank) { impl_->start(rank); }
void Server::stop() { impl_->stop(); }
Snapshot Server::snapshot() { return impl_->snapshot(); }
std::vector<Snapshot> Server::take_checkpoints() { return impl_->take_checkpoints(); }
std::vector<LogRecord> Server::drain_log() { return impl_->drain_log(); }
std::string Server::failure() const { return impl_->failure(); }
uint64_t Server::rounds_done() const { return impl_->rounds_done(); }
uint64_t Server::messages_received() const { return impl_->messages_received(); }
ServerStats Server::stats() const { return impl_->stats(); }

}  // namespace tagps::net
