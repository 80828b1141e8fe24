#pragma once
// MetricsHttpServer: the smallest HTTP/1.x listener that answers Prometheus scrapes.
// `GET /metrics` (a query string is ignored) gets 200 with the text `render()` returns and
// `Content-Type: text/plain; version=0.0.4; charset=utf-8`; any other path gets 404, any other
// method 405 (HEAD included), a request line it cannot read 400, and a request head larger
// than limits.max_request_bytes 431. The port is reachable by anyone who can reach the host,
// so every request is treated as hostile: one request per connection (the reply carries
// `Connection: close` and the socket is closed after it), the head must arrive within
// limits.read_timeout, and at most limits.max_connections are served at once (a connection
// beyond that takes the place of the oldest without a complete request, or is closed at accept
// when all are being answered). Request bodies are never read.
// It is the one route of the common http::Server (http_server.hpp), which the agent's health
// endpoint shares.
//
// Lifetime: the constructor binds host:port (0 = a free port; port() reads it back) and throws
// ddprun::NetworkError naming host:port when it cannot; start() begins accepting on the
// io_context; stop() closes the acceptor and every connection, idempotent; the destructor
// stops. Must be destroyed before its io_context. Not thread-safe: every call on the
// io_context's thread. render() runs on that thread too, so it may read the owner's state
// without locks.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace boost::asio {
class io_context;
}

namespace ddprun::metrics {

struct MetricsHttpLimits {
  std::size_t max_request_bytes = 8 * 1024;
  std::chrono::milliseconds read_timeout{5000};
  std::size_t max_connections = 16;
};

struct MetricsHttpStats {
  std::uint64_t scrapes = 0;   // 200 answers
  std::uint64_t rejected = 0;  // 4xx answers, timeouts and connections over the limit
};

class MetricsHttpServer {
 public:
  MetricsHttpServer(boost::asio::io_context& io, const std::string& host, std::uint16_t port,
                    std::function<std::string()> render, MetricsHttpLimits limits = {});
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  void start();
  void stop();
  std::uint16_t port() const;
  MetricsHttpStats stats() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace ddprun::metrics
