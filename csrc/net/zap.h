// A ZAP handler (ZeroMQ RFC 27) for one context: it admits exactly the job's CURVE client key on the
// tagps domain, like tagps/ps/transport.py's _OnlyJobClients behind pyzmq's ThreadAuthenticator. Every
// CURVE server socket of that context (zap domain "tagps") asks it during each handshake.
#pragma once

#include <atomic>
#include <functional>
#include <string>
#include <thread>

#include <zmq.hpp>

namespace tagps::net {

class ZapHandler {
 public:
  // Receives a log record: a Python logging level and the message.
  using Log = std::function<void(int, const std::string&)>;

  // Binds inproc://zeromq.zap.01 on `context` (before any CURVE server socket of it accepts) and starts
  // the handler thread. `client_public` is the admitted key, 32 raw bytes.
  ZapHandler(zmq::context_t& context, std::string client_public, Log log);
  ZapHandler(const ZapHandler&) = delete;
  ZapHandler& operator=(const ZapHandler&) = delete;
  // Stops the thread and closes its socket (the context stays open).
  ~ZapHandler();

 private:
  void run();
  void handle();

  zmq::socket_t socket_;
  std::string client_public_;
  Log log_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace tagps::net
