#pragma once
// The per-node agent: hosts the worker store (when this node holds group rank 0), spawns the
// workers with their environment, watches them, forwards signals, restarts the group on
// failure while the restart budget lasts, and reports the root cause.
#include <iosfwd>

#include "ddprun/agent/config.hpp"

namespace ddprun::agent {

// Runs the job on this node until it ends. Returns the process exit code for ddprun:
// 0 on success; the first failing worker's exit code (128+signal for a signal death) when the
// restart budget is spent; 128+signal when ddprun itself was stopped by a handled signal.
// Throws ddprun::Error for configuration problems found before anything starts.
int run_agent(const AgentConfig& config);

// --dry-run: writes each local rank's argv, environment additions and working directory to
// `out` without starting anything.
void print_dry_run(const AgentConfig& config, std::ostream& out);

}  // namespace ddprun::agent
