#pragma once
// AgentMetrics: what one agent reports to Prometheus (docs/cli.md, "--metrics-port"): the
// build, the current attempt (its restart count), restarts and rounds so far, this node's
// workers by state and the time spent waiting in rendezvous. The agent shell tells it about
// rounds (rendezvous_started when it asks the backend for a round, round_assigned when one
// arrives, restarted when the backend ends one); worker states are read from the WorkerRun at
// scrape time.
//
// When config.metrics_port >= 0 the constructor binds a MetricsHttpServer on
// config.metrics_host at that port (0 = a free one), starts it and logs
// `metrics on http://HOST:PORT/metrics` at info
// level (the readiness line a caller reads the port from); it throws ddprun::NetworkError when
// the port cannot be bound. With metrics_port < 0 it only counts. Not thread-safe: the agent's
// io_context thread; destroy it before that io_context.
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>

#include "ddprun/agent/config.hpp"
#include "ddprun/agent/rendezvous_backend.hpp"
#include "ddprun/agent/worker_run.hpp"
#include "ddprun/common/metrics_http.hpp"

namespace boost::asio {
class io_context;
}

namespace ddprun::agent {

class AgentMetrics {
 public:
  AgentMetrics(boost::asio::io_context& io, const AgentConfig& config, const WorkerRun& run);

  void rendezvous_started();
  void round_assigned(const RoundAssignment& assignment);
  void restarted();

  // The exposition text a scrape gets.
  std::string render() const;
  std::optional<std::uint16_t> port() const;

 private:
  const WorkerRun& run_;
  int attempt_ = 0;
  std::uint64_t rounds_ = 0;
  std::uint64_t restarts_ = 0;
  std::chrono::steady_clock::duration in_rendezvous_{};
  std::optional<std::chrono::steady_clock::time_point> waiting_since_;
  std::unique_ptr<metrics::MetricsHttpServer> server_;
};

}  // namespace ddprun::agent
