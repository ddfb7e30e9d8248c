#include "net/zap.h"

#include <zmq.h>

#include <utility>
#include <vector>

#include "net/wire.h"

namespace tagps::net {

namespace {

constexpr const char* kZapEndpoint = "inproc://zeromq.zap.01";
constexpr int kWarning = 30;

// Compares without an early exit, so the time taken says nothing about where a guessed key differs.
bool same_key(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

ZapHandler::ZapHandler(zmq::context_t& context, std::string client_public, Log log)
    : socket_(context, zmq::socket_type::rep), client_public_(std::move(client_public)), log_(std::move(log)) {
  socket_.set(zmq::sockopt::linger, 0);
  socket_.bind(kZapEndpoint);
  thread_ = std::thread([this] { run(); });
}

ZapHandler::~ZapHandler() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  socket_.close();
}

void ZapHandler::run() {
  zmq_pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
  while (!stop_) {
    try {
      if (zmq_poll(&item, 1, 100) > 0 && (item.revents & ZMQ_POLLIN)) handle();
    } catch (const zmq::error_t& exc) {
      if (exc.num() == ETERM) return;
      log_(kWarning, std::string("ZAP handler: ") + exc.what());
    }
  }
}

void ZapHandler::handle() {
  // Request: version, request id, domain, address, routing id, mechanism, credentials...
  std::vector<zmq::message_t> frames;
  do {
    frames.emplace_back();
    if (!socket_.recv(frames.back(), zmq::recv_flags::none)) return;
  } while (frames.back().more());
  const auto text = [&](size_t i) { return i < frames.size() ? frames[i].to_string() : std::string(); };
  const bool curve = text(5) == "CURVE" && frames.size() >= 7;
  const bool admitted = text(0) == "1.0" && text(2) == kZapDomain && curve && same_key(text(6), client_public_);
  if (!admitted) log_(kWarning, "rejected a CURVE client with an unknown key");
  const std::string status = admitted ? "200" : "400";
  const std::string reason = admitted ? "OK" : "unknown client key";
  const std::vector<std::string> reply = {"1.0", text(1), status, reason, "", ""};
  for (size_t i = 0; i < reply.size(); ++i) {
    socket_.send(zmq::buffer(reply[i]), i + 1 < reply.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  }
}

}  // namespace tagps::net
