#include "net/client.h"

#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string_view>
#include <utility>

namespace tagps::net {

namespace {

// A condition that fails the whole client; what() is the reason PSClient reports.
class Failure : public Error {
 public:
  using Error::Error;
};

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string zmq_error(const char* what) { return detail::concat(what, ": ", zmq_strerror(zmq_errno())); }

// Finishes a push_pull and drops its hold on the buffer (the frames libzmq still has keep their own).
void finish_op(PushPull& op, const std::string& error = {}) {
  op.keep.reset();
  op.finish(error);
}

// One notification: 8 bytes, written whole (at most PIPE_BUF) into a non-blocking pipe, so that a writer
// holding a Completion's lock never waits for the reader; a full pipe (thousands of notifications unread)
// or a reader that is gone loses it.
void write_tag(int fd, uint64_t tag) {
  while (::write(fd, &tag, sizeof tag) < 0 && errno == EINTR) {
  }
}

// libzmq is done with a PUSH frame: drop the frame's reference to the buffer's owner.
void release_frame(void* /*data*/, void* hint) { delete static_cast<std::shared_ptr<void>*>(hint); }

}  // namespace

// An initialised zmq_msg_t, closed on destruction.
struct Frame {
  zmq_msg_t msg;
  Frame() { zmq_msg_init(&msg); }
  ~Frame() { zmq_msg_close(&msg); }
  Frame(const Frame&) = delete;
  Frame& operator=(const Frame&) = delete;
  const char* data() { return static_cast<const char*>(zmq_msg_data(&msg)); }
  size_t size() { return zmq_msg_size(&msg); }
};

struct ClientEngine::Message {
  static constexpr size_t kKept = 3;
  Frame frames[kKept];  // the first frames
  Frame extra;          // frames past kKept land here, each replacing the last
  size_t count = 0;     // frames in all
};

// -- Completion ---------------------------------------------------------------------------------------

bool Completion::wait(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  if (timeout_s < 0 || timeout_s > 1e8) {  // beyond ~3 years the clock arithmetic could overflow
    cv_.wait(lock, [this] { return done_; });
    return true;
  }
  return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [this] { return done_; });
}

bool Completion::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

std::string Completion::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

double Completion::finished_at() const {
  std::lock_guard<std::mutex> lock(mu_);
  return finished_at_;
}

void Completion::finish(const std::string& error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    done_ = true;
    error_ = error;
    finished_at_ = now_s();
    // Under the lock, so that once notify(-1, ...) returns no write reaches the fd it replaced.
    if (notify_fd_ >= 0) write_tag(notify_fd_, notify_tag_);
  }
  cv_.notify_all();
}

void Completion::notify(int fd, uint64_t tag) {
  std::lock_guard<std::mutex> lock(mu_);
  notify_fd_ = fd;
  notify_tag_ = tag;
  if (done_ && fd >= 0) write_tag(fd, tag);
}

// -- ClientEngine ---------------------------------------------------------------------------------------

ClientEngine::ClientEngine(ClientOptions options) : options_(std::move(options)) {
  TAGPS_ENFORCE(!options_.endpoints.empty(), "a PS client needs at least one server");
  TAGPS_ENFORCE_GE(options_.credit, size_t{1}, "BYTEPS_SCHEDULING_CREDIT");
  TAGPS_ENFORCE_GT(options_.send_timeout_s, 0.0, "send timeout");
  TAGPS_ENFORCE(options_.colocated.empty() || options_.colocated.size() == options_.endpoints.size(),
                "colocated names ", options_.colocated.size(), " servers of ", options_.endpoints.size());
  context_ = zmq_ctx_new();
  if (context_ == nullptr) throw Error(zmq_error("zmq_ctx_new"));
  try {
    const std::string identity = routing_id(options_.node_id);
    const int linger = 0;
    const int timeout_ms = static_cast<int>(options_.send_timeout_s * 1000);
    for (const std::string& endpoint : options_.endpoints) {
      void* socket = zmq_socket(context_, ZMQ_DEALER);
      if (socket == nullptr) throw Error(zmq_error("cannot create a DEALER socket"));
      sockets_.push_back(socket);
      // A send that cannot be queued for this long means the server is unreachable: fail, never hang.
      if (zmq_setsockopt(socket, ZMQ_ROUTING_ID, identity.data(), identity.size()) != 0 ||
          zmq_setsockopt(socket, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
          zmq_setsockopt(socket, ZMQ_SNDTIMEO, &timeout_ms, sizeof timeout_ms) != 0) {
        throw Error(zmq_error("cannot configure a DEALER socket"));
      }
      if (options_.keys) curve_client(socket, *options_.keys);
      if (zmq_connect(socket, endpoint.c_str()) != 0) {
        throw InvalidArgument(detail::concat("cannot connect to ", endpoint, ": ", zmq_strerror(zmq_errno())));
      }
    }
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) throw Error(detail::concat("eventfd: ", std::strerror(errno)));
    thread_ = std::thread(&ClientEngine::run, this);
  } catch (...) {
    close_sockets();
    throw;
  }
}

ClientEngine::~ClientEngine() { close(); }

std::vector<uint64_t> ClientEngine::declare(std::vector<TensorSpec> tensors) {
  auto declaration = std::make_shared<Declaration>();
  for (const TensorSpec& t : tensors) {
    TAGPS_ENFORCE(is_known_dtype(t.dtype), "tensor ", t.index, ": unknown dtype code ", int{t.dtype});
    size_t end = 0;
    for (const ChunkSpec& c : t.chunks) {
      TAGPS_ENFORCE(c.server < sockets_.size(), "key ", c.key, " goes to server ", c.server, " of ",
                    sockets_.size());
      TAGPS_ENFORCE(c.nbytes > 0 && c.offset == end, "chunks of tensor ", t.index, " must be consecutive");
      end = c.offset + c.nbytes;
    }
    TAGPS_ENFORCE(t.init.empty() || t.init.size() == end, "init of tensor ", t.index, " must hold ", end,
                  " bytes");
    declaration->left += t.chunks.size();
  }
  if (declaration->left == 0) return {};
  declaration->rounds.resize(declaration->left);
  declaration->tensors = std::move(tensors);
  submit({declaration, nullptr});
  declaration->wait(-1);
  const std::string error = declaration->error();
  if (!error.empty()) throw Error(error);
  return declaration->rounds;
}

std::shared_ptr<PushPull> ClientEngine::push_pull(uint64_t index, char* data, size_t nbytes, bool average,
                                                  int64_t priority, std::shared_ptr<void> keep) {
  auto op = std::make_shared<PushPull>();
  op->index = index;
  op->data = data;
  op->nbytes = nbytes;
  op->average = average;
  op->priority = priority;
  op->keep = std::move(keep);
  submit({nullptr, op});
  return op;
}

void ClientEngine::fail(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  if (fatal_.empty()) fatal_ = reason;
  if (!stopping_) wake();  // once stopping, the I/O thread fails everything anyway
}

std::string ClientEngine::fatal() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fatal_;
}

void ClientEngine::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = stopping_ = true;
    if (thread_.joinable()) wake();
  }
  if (thread_.joinable()) thread_.join();
  close_sockets();
}

void ClientEngine::close_sockets() {
  for (void* socket : sockets_) zmq_close(socket);
  sockets_.clear();
  if (context_ != nullptr) {
    // Linger 0: queued frames are dropped (their buffers released) and this returns at once.
    while (zmq_ctx_term(context_) != 0 && zmq_errno() == EINTR) {
    }
    context_ = nullptr;
  }
  std::lock_guard<std::mutex> lock(mu_);  // nobody wakes the thread after this
  if (wake_fd_ >= 0) ::close(wake_fd_);
  wake_fd_ = -1;
}

void ClientEngine::submit(Command command) {
  std::string stopped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      stopped = fatal_.empty() ? "the PS client stopped" : fatal_;
    } else {
      commands_.push_back(std::move(command));
      wake();
    }
  }
  if (!stopped.empty()) finish(command, stopped);
}

void ClientEngine::wake() {
  const uint64_t one = 1;
  // Cannot fail: the counter would have to reach 2^64 - 1 between two reads by the I/O thread.
  [[maybe_unused]] const ssize_t n = ::write(wake_fd_, &one, sizeof one);
}

void ClientEngine::finish(const Command& command, const std::string& error) {
  if (command.declaration) command.declaration->finish(error);
  if (command.push_pull) finish_op(*command.push_pull, error);
}

// -- I/O thread ---------------------------------------------------------------------------------------

void ClientEngine::run() {
  // Signals belong to Python's main thread; this one must never see EINTR.
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);
  std::vector<zmq_pollitem_t> items(sockets_.size() + 1);
  items[0].fd = wake_fd_;
  items[0].events = ZMQ_POLLIN;
  for (size_t i = 0; i < sockets_.size(); ++i) {
    items[i + 1].socket = sockets_[i];
    items[i + 1].events = ZMQ_POLLIN;
  }
  for (;;) {
    if (zmq_poll(items.data(), static_cast<int>(items.size()), -1) < 0 && !failed_) {
      fail_all(zmq_error("zmq_poll"));
    }
    if (items[0].revents & ZMQ_POLLIN) {
      uint64_t count;
      [[maybe_unused]] const ssize_t n = ::read(wake_fd_, &count, sizeof count);
      if (!run_commands()) return;
    }
    try {
      for (size_t i = 0; i < sockets_.size(); ++i) {
        if (items[i + 1].revents & ZMQ_POLLIN) drain(static_cast<uint32_t>(i));
      }
      pump();
    } catch (const Failure& f) {
      fail_all(f.what());
    } catch (const std::exception& e) {  // never leave a waiter hanging on a bug
      fail_all(detail::concat("internal error in the PS client engine: ", e.what()));
    }
  }
}

bool ClientEngine::receive(void* socket, Message& m) {
  int flags = ZMQ_DONTWAIT;
  for (;;) {
    Frame& f = m.count < Message::kKept ? m.frames[m.count] : m.extra;
    if (zmq_msg_recv(&f.msg, socket, flags) < 0) {
      if (m.count == 0 && zmq_errno() == EAGAIN) return false;
      throw Failure(zmq_error("cannot receive from a server"));
    }
    ++m.count;
    if (!zmq_msg_more(&f.msg)) return true;
    flags = 0;  // the rest of a multipart message is already queued
  }
}

bool ClientEngine::run_commands() {
  std::string fatal;
  bool stopping;
  std::deque<Command> commands;
  {
    std::lock_guard<std::mutex> lock(mu_);
    commands.swap(commands_);
    fatal = fatal_;
    stopping = stopping_;
  }
  if (!fatal.empty() && !failed_) fail_all(fatal);
  for (Command& command : commands) {
    if (failed_) {
      finish(command, this->fatal());
      continue;
    }
    try {
      if (command.declaration) {
        send_inits(command.declaration);
      } else {
        start(command.push_pull);
      }
    } catch (const Failure& f) {
      fail_all(f.what());
      finish(command, this->fatal());
    }
  }
  if (stopping) {
    fail_pending(fatal.empty() ? "the PS client stopped" : fatal);
    return false;
  }
  return true;
}

void ClientEngine::send_inits(const std::shared_ptr<Declaration>& declaration) {
  size_t slot = 0;
  for (const TensorSpec& t : declaration->tensors) {
    Tensor& state = tensors_[t.index];
    state.dtype = t.dtype;
    state.chunks.clear();
    for (const ChunkSpec& c : t.chunks) {
      chunk_of_[c.key] = {t.index, state.chunks.size()};
      state.chunks.push_back({c, 0});
      inits_[c.key] = {declaration, slot++};
    }
  }
  share_chunks(declaration->tensors);
  for (const TensorSpec& t : declaration->tensors) {
    // The declared size travels in nbytes; the worker set, the shared-memory descriptor and the initial
    // value, each when given, as payload frames in that order.
    const std::string workers = pack_workers(t.workers);
    const Tensor& state = tensors_.at(t.index);
    for (size_t i = 0; i < t.chunks.size(); ++i) {
      const ChunkSpec& c = t.chunks[i];
      const Chunk& chunk = state.chunks[i];
      std::vector<std::string_view> frames;
      uint8_t flags = 0;
      if (!workers.empty()) {
        flags |= kFlagWorkers;
        frames.emplace_back(workers);
      }
      std::string descriptor;
      if (chunk.segment != nullptr) {
        flags |= kFlagIpc;
        descriptor = pack_ipc(chunk.segment->describe(chunk.region_offset));
        frames.emplace_back(descriptor);
      }
      if (!t.init.empty()) frames.emplace_back(t.init.data() + c.offset, c.nbytes);
      const HeaderBytes head = pack_header(Op::kInit, options_.node_id, c.key, 0, c.nbytes, t.dtype, flags);
      send(c.server, head.data(), head.size(), frames.empty() ? 0 : ZMQ_SNDMORE);
      for (size_t f = 0; f < frames.size(); ++f) {
        send(c.server, frames[f].data(), frames[f].size(), f + 1 < frames.size() ? ZMQ_SNDMORE : 0);
      }
    }
  }
}

void ClientEngine::share_chunks(const std::vector<TensorSpec>& tensors) {
  for (uint32_t server = 0; server < options_.colocated.size(); ++server) {
    if (!options_.colocated[server]) continue;
    std::vector<Chunk*> chunks;
    size_t end = kSegmentHeaderBytes;
    for (const TensorSpec& t : tensors) {
      for (Chunk& chunk : tensors_.at(t.index).chunks) {
        if (chunk.spec.server != server) continue;
        chunk.region_offset = end;
        end += (chunk.spec.nbytes + kSegmentAlign - 1) / kSegmentAlign * kSegmentAlign;
        chunks.push_back(&chunk);
      }
    }
    if (chunks.empty()) continue;
    try {
      segments_.push_back(std::make_unique<SharedSegment>(end - kSegmentHeaderBytes));
    } catch (const Error& e) {  // the chunks go over TCP; Python reports why
      std::lock_guard<std::mutex> lock(mu_);
      if (ipc_error_.empty()) ipc_error_ = e.what();
      continue;
    }
    for (Chunk* chunk : chunks) chunk->segment = segments_.back().get();
  }
}

size_t ClientEngine::ipc_chunks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ipc_chunks_;
}

std::string ClientEngine::ipc_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ipc_error_;
}

void ClientEngine::start(const std::shared_ptr<PushPull>& op) {
  const auto it = tensors_.find(op->index);
  size_t nbytes = 0;
  if (it != tensors_.end()) {
    for (const Chunk& c : it->second.chunks) nbytes += c.spec.nbytes;
  }
  if (it == tensors_.end() || nbytes != op->nbytes || nbytes == 0) {
    finish_op(*op, detail::concat("push_pull of ", op->nbytes, " bytes to tensor ", op->index, ", which has ",
                              nbytes, " declared bytes"));
    return;
  }
  op->remaining = it->second.chunks.size();
  for (size_t i = 0; i < it->second.chunks.size(); ++i) queue_.push({op->priority, seq_++, op, i});
}

void ClientEngine::pump() {
  while (!queue_.empty() && unacked_ < options_.credit) {
    const Queued next = queue_.top();
    queue_.pop();
    const Tensor& tensor = tensors_.at(next.op->index);
    const Chunk& chunk = tensor.chunks[next.chunk];
    const ChunkSpec& c = chunk.spec;
    const uint8_t flags = next.op->average ? kFlagAverage : 0;
    if (chunk.ipc) {
      // The server reads the bytes from the shared region; until this chunk's PULL_REPLY it owns them.
      std::memcpy(chunk.region(), next.op->data + c.offset, c.nbytes);
      const HeaderBytes push = pack_header(Op::kPush, options_.node_id, c.key, chunk.round, 0, tensor.dtype,
                                           flags | kFlagIpc);
      send(c.server, push.data(), push.size(), 0);
    } else {
      const HeaderBytes push = pack_header(Op::kPush, options_.node_id, c.key, chunk.round, c.nbytes,
                                           tensor.dtype, flags);
      send(c.server, push.data(), push.size(), ZMQ_SNDMORE);
      // Zero-copy: the frame points into the caller's buffer and keeps its owner alive until libzmq frees
      // it.
      zmq_msg_t payload;
      auto* hint = new std::shared_ptr<void>(next.op->keep);
      if (zmq_msg_init_data(&payload, next.op->data + c.offset, c.nbytes, release_frame, hint) != 0) {
        delete hint;
        throw Failure(zmq_error("cannot create a PUSH frame"));
      }
      send_msg(c.server, payload, 0);
    }
    const HeaderBytes pull = pack_header(Op::kPull, options_.node_id, c.key, chunk.round, 0, tensor.dtype);
    send(c.server, pull.data(), pull.size(), 0);
    in_flight_[c.key] = {next.op, next.chunk};
    ++unacked_;
  }
}

void ClientEngine::drain(uint32_t rank) {
  for (;;) {
    Message m;
    if (!receive(sockets_[rank], m)) return;
    if (!failed_) on_message(rank, m);  // after a failure, replies only need to leave the socket
  }
}

void ClientEngine::on_message(uint32_t rank, Message& m) {
  Header h;
  try {
    h = unpack_header(m.frames[0].data(), m.frames[0].size());
  } catch (const ProtocolError& e) {
    throw Failure(detail::concat("bad message from server ", rank, ": ", e.what()));
  }
  switch (static_cast<Op>(h.op)) {
    case Op::kPullReply:
      on_pull_reply(h, m);
      return;
    case Op::kPushAck:
      if (unacked_ > 0) --unacked_;
      return;
    case Op::kInitAck:
      on_init_ack(h);
      return;
    case Op::kError: {
      // A rejected request leaves its key out of step with the other workers: fail the whole client.
      const std::string reason =
          m.count > 1 ? std::string(m.frames[1].data(), m.frames[1].size()) : std::string("no reason given");
      throw Failure(detail::concat("server ", rank, " rejected a request for key ", h.key, " round ", h.round,
                                   ": ", reason));
    }
    default:
      throw Failure(detail::concat("unexpected ", op_name(h.op), " from server ", rank));
  }
}

void ClientEngine::on_pull_reply(const Header& h, Message& m) {
  const auto it = in_flight_.find(h.key);
  if (it == in_flight_.end()) {
    throw Failure(detail::concat("PULL_REPLY for key ", h.key, ", which has no pull in flight"));
  }
  const std::shared_ptr<PushPull> op = std::move(it->second.first);
  Chunk& chunk = tensors_.at(op->index).chunks[it->second.second];
  in_flight_.erase(it);
  const bool shared = h.flags & kFlagIpc;
  if (h.round != chunk.round || shared != chunk.ipc || m.count != (shared ? 1u : 2u) ||
      (!shared && m.frames[1].size() != chunk.spec.nbytes)) {
    throw Failure(detail::concat("malformed PULL_REPLY for key ", h.key, " round ", h.round));
  }
  std::memcpy(op->data + chunk.spec.offset, shared ? chunk.region() : m.frames[1].data(), chunk.spec.nbytes);
  ++chunk.round;
  if (--op->remaining == 0) finish_op(*op);
}

void ClientEngine::on_init_ack(const Header& h) {
  const auto it = inits_.find(h.key);
  if (it == inits_.end()) {
    throw Failure(detail::concat("INIT_ACK for key ", h.key, ", which was not declared"));
  }
  const std::shared_ptr<Declaration> declaration = std::move(it->second.first);
  declaration->rounds[it->second.second] = h.round;
  inits_.erase(it);
  const auto [index, slot] = chunk_of_.at(h.key);
  Chunk& chunk = tensors_.at(index).chunks[slot];
  chunk.round = h.round;  // non-zero after a server restored a checkpoint
  if (h.flags & kFlagIpc) {
    if (chunk.segment == nullptr) {
      throw Failure(detail::concat("INIT_ACK with FLAG_IPC for key ", h.key, ", which was not offered shared memory"));
    }
    chunk.ipc = true;
    std::lock_guard<std::mutex> lock(mu_);
    ++ipc_chunks_;
  }
  if (--declaration->left == 0) declaration->finish();
}

void ClientEngine::send(uint32_t rank, const void* data, size_t size, int flags) {
  if (zmq_send(sockets_[rank], data, size, flags) < 0) throw_send_failure();
}

void ClientEngine::send_msg(uint32_t rank, zmq_msg_t& msg, int flags) {
  if (zmq_msg_send(&msg, sockets_[rank], flags) < 0) {
    zmq_msg_close(&msg);
    throw_send_failure();
  }
}

void ClientEngine::throw_send_failure() const {
  if (zmq_errno() != EAGAIN) throw Failure(zmq_error("cannot send to a server"));
  char timeout[32];
  std::snprintf(timeout, sizeof timeout, "%g", options_.send_timeout_s);
  throw Failure(detail::concat("a send blocked for PS_HEARTBEAT_TIMEOUT=", timeout,
                                " s: a server or the scheduler is unreachable"));
}

void ClientEngine::fail_all(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (fatal_.empty()) fatal_ = reason;
  }
  failed_ = true;
  fail_pending(fatal());
}

void ClientEngine::fail_pending(const std::string& reason) {
  std::deque<Command> commands;
  {
    std::lock_guard<std::mutex> lock(mu_);
    commands.swap(commands_);
  }
  for (const Command& command : commands) finish(command, reason);
  for (auto& entry : in_flight_) finish_op(*entry.second.first, reason);
  in_flight_.clear();
  for (; !queue_.empty(); queue_.pop()) finish_op(*queue_.top().op, reason);
  for (auto& entry : inits_) entry.second.first->finish(reason);
  inits_.clear();
  unacked_ = 0;
}

}  // namespace tagps::net
