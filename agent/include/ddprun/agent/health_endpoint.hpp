#pragma once
// The agent's health endpoint (TORCHELASTIC_HEALTH_CHECK_PORT): plain HTTP on that port, on
// every interface, served by the agent's own io_context. Any request (GET /, GET /health, ...)
// is answered with one JSON object and the connection is closed:
//   200 {"status": "alive", "last_progress_time": <unix s>, "pid": <agent pid>, "round": <n>,
//        "state": "<what the agent is doing>"}
//   503 the same with "status": "stale" when the agent's loop has not turned for `timeout`
//       (torch's agent uses 60 s).
// The loop marks progress every second with a steady_timer; because the answer comes from that
// same loop, an agent whose loop is stuck does not answer at all, which a probe counts as dead.
// torch's open-source agent starts no server on this port (its HealthCheckServer is a no-op).
// The port is reachable by anyone who can reach the host, so every connection is treated as
// hostile by the common http::Server that serves it (the one behind the metrics endpoint): at
// most 16 are served at once (a new one beyond that takes the place of the oldest that has not sent
// a complete request, or is closed at accept when all are being answered), each gets 5 s to send its
// request head (8 KiB at most) and 5 s to read the answer, and a failed accept (EMFILE) is
// retried after 1 s instead of ending the endpoint. Unlike the metrics endpoint it answers every
// request the same way (any path, any method, a head cut off or too large).
#include <sys/types.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "ddprun/common/http_server.hpp"

namespace ddprun::agent {

class HealthEndpoint {
 public:
  // Binds `port` (0 = any free port, read back with port()); throws ddprun::NetworkError naming
  // the port when it is taken.
  HealthEndpoint(boost::asio::io_context& io, std::uint16_t port,
                 std::chrono::seconds timeout = std::chrono::seconds(60));
  ~HealthEndpoint();
  HealthEndpoint(const HealthEndpoint&) = delete;
  HealthEndpoint& operator=(const HealthEndpoint&) = delete;

  void start();
  void stop();
  std::uint16_t port() const { return server_->port(); }
  // What the agent does now, e.g. "running round 2"; shown in the answer.
  void set_state(std::string state, std::uint64_t round);
  // Connections open now, and those closed (at accept, or the oldest idle one) because
  // kMaxConnections were open.
  std::size_t open_connections() const { return server_->stats().open; }
  std::uint64_t rejected() const { return server_->stats().over_limit; }
  static constexpr std::size_t kMaxConnections = 16;

  // The answer for a given age of the last progress mark (pure; for tests and the server).
  static std::string response(bool alive, std::int64_t last_progress_time, pid_t pid, std::uint64_t round,
                              const std::string& state);

 private:
  http::Response answer() const;
  void tick();

  boost::asio::steady_timer ticker_;
  std::unique_ptr<http::Server> server_;
  std::chrono::seconds timeout_;
  std::chrono::steady_clock::time_point last_progress_;
  std::int64_t last_progress_unix_ = 0;
  std::string state_ = "starting";
  std::uint64_t round_ = 0;
  bool stopped_ = false;
};

}  // namespace ddprun::agent
