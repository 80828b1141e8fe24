// AgentMetrics (agent_metrics.hpp has the contract).
#include "ddprun/agent/agent_metrics.hpp"

#include <spdlog/spdlog.h>

#include "ddprun/common/endpoint.hpp"
#include "ddprun/common/metrics.hpp"
#include "ddprun/common/version.hpp"

namespace ddprun::agent {

AgentMetrics::AgentMetrics(boost::asio::io_context& io, const AgentConfig& config, const WorkerRun& run) : run_(run) {
  if (config.metrics_port < 0) return;
  server_ = std::make_unique<metrics::MetricsHttpServer>(
      io, config.metrics_host, static_cast<std::uint16_t>(config.metrics_port), [this] { return render(); });
  server_->start();
  spdlog::info("metrics on http://{}:{}/metrics", bracket_host(config.metrics_host), server_->port());
}

void AgentMetrics::rendezvous_started() {
  if (!waiting_since_) waiting_since_ = std::chrono::steady_clock::now();
}

void AgentMetrics::round_assigned(const RoundAssignment& assignment) {
  ++rounds_;
  attempt_ = assignment.placement.restart_count;
  if (waiting_since_) {
    in_rendezvous_ += std::chrono::steady_clock::now() - *waiting_since_;
    waiting_since_.reset();
  }
}

void AgentMetrics::restarted() { ++restarts_; }

std::optional<std::uint16_t> AgentMetrics::port() const {
  if (!server_) return std::nullopt;
  return server_->port();
}

std::string AgentMetrics::render() const {
  using metrics::Sample;
  metrics::Exposition out;
  out.gauge("ddprun_build_info", "Always 1; the version label names the ddprun build.",
            {Sample{{{"version", version_string}}, 1}});
  out.gauge("ddprun_agent_attempt", "Restart count of the current attempt (0 for the first).", attempt_);
  out.counter("ddprun_agent_restarts_total", "Rounds this agent was told to restart (failure or membership change).",
              static_cast<double>(restarts_));
  out.counter("ddprun_agent_rounds_total", "Rendezvous rounds this agent was assigned to.",
              static_cast<double>(rounds_));
  const WorkerRun::WorkerCounts w = run_.worker_counts();
  out.gauge("ddprun_agent_workers", "Workers of the current attempt on this node, by state.",
            {Sample{{{"state", "running"}}, static_cast<double>(w.running)},
             Sample{{{"state", "succeeded"}}, static_cast<double>(w.succeeded)},
             Sample{{{"state", "failed"}}, static_cast<double>(w.failed)}});
  auto total = in_rendezvous_;
  if (waiting_since_) total += std::chrono::steady_clock::now() - *waiting_since_;
  out.counter("ddprun_agent_rendezvous_seconds_total", "Seconds spent waiting for a rendezvous round to close.",
              std::chrono::duration<double>(total).count());
  out.gauge("ddprun_agent_in_rendezvous", "1 while this agent waits for a round, else 0.", waiting_since_ ? 1 : 0);
  return out.text();
}

}  // namespace ddprun::agent
