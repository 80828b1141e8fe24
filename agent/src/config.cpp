// The job mode decision; see config.hpp.
#include "ddprun/agent/config.hpp"

#include <csignal>
#include <cstring>
#include <string>

#include "ddprun/agent/elastic.hpp"
#include "ddprun/common/error.hpp"

namespace ddprun::agent {

const char* to_string(JobMode mode) {
  switch (mode) {
    case JobMode::single_node:
      return "single-node";
    case JobMode::static_multi_node:
      return "static multi-node";
    case JobMode::elastic:
      return "elastic";
  }
  return "?";
}

JobMode decide_job_mode(const AgentConfig& config) {
  if (config.standalone || (config.max_nodes <= 1 && config.rdzv_backend == "static")) return JobMode::single_node;
  return config.rdzv_backend == "static" ? JobMode::static_multi_node : JobMode::elastic;
}

JobMode job_mode(const AgentConfig& config) { return config.job_mode.value_or(decide_job_mode(config)); }

std::vector<int> handled_signals(const AgentConfig& config) {
  if (!config.signals_to_handle.empty()) return config.signals_to_handle;
  return {SIGTERM, SIGINT, SIGHUP, SIGQUIT};
}

std::string handled_signals_text(const AgentConfig& config) {
  std::string text;
  for (const int sig : handled_signals(config)) {
    const char* abbrev = ::sigabbrev_np(sig);  // "TERM"; null for the real-time signals
    if (!text.empty()) text += ',';
    if (abbrev != nullptr) {
      text += std::string("SIG") + abbrev;
    } else if (sig >= SIGRTMIN && sig <= SIGRTMAX) {
      text += "SIGRTMIN+" + std::to_string(sig - SIGRTMIN);  // the form --signals-to-handle takes
    } else {
      text += std::to_string(sig);
    }
  }
  return text;
}

void validate_config(const AgentConfig& config) {
  if (config.worker_argv.empty()) {
    throw UsageError("no worker command given", "pass the training script or program after the ddprun options");
  }
  if (config.nproc_per_node <= 0) {
    throw UsageError("--nproc-per-node must be > 0, got " + std::to_string(config.nproc_per_node));
  }
  if (config.min_nodes < 1 || config.max_nodes < config.min_nodes) {
    throw UsageError("--nnodes " + std::to_string(config.min_nodes) + ":" + std::to_string(config.max_nodes) +
                         " is not a valid range",
                     "use N or MIN:MAX with 0 < MIN <= MAX");
  }
  if (job_mode(config) != JobMode::single_node) {
    rendezvous_endpoint(config);  // throws when missing
    const auto problem = job_config(config).validate();
    if (!problem.empty()) {
      throw UsageError("invalid rendezvous settings: " + problem, "check --nnodes, --max-restarts and --rdzv-conf");
    }
  } else if (config.max_nodes > 1) {
    throw UsageError(
        "--standalone runs a single-node job but --nnodes allows " + std::to_string(config.max_nodes) + " nodes",
        "drop --standalone and use --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT for several nodes");
  } else if (config.node_rank != 0) {
    throw UsageError("--node-rank " + std::to_string(config.node_rank) + " is out of range for a single-node job",
                     "use --node-rank 0 with --nnodes 1");
  }
  if (config.max_restarts < 0) {
    throw UsageError("--max-restarts must be >= 0, got " + std::to_string(config.max_restarts));
  }
}

}  // namespace ddprun::agent
