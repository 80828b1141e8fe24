#pragma once
// The per-node agent: hosts the worker store (when this node holds group rank 0), spawns the
// workers with their environment, watches them, forwards signals, restarts the group on
// failure while the restart budget lasts, and reports the root cause.
//
// Every job mode (config.hpp JobMode) runs the same rounds through a rendezvous backend
// (rendezvous_backend.hpp): on a single node the local restart budget decides; with several
// nodes the agent joins the rendezvous (a ddprun-rdzvd, or one it hosts itself), runs each
// round's assignment and obeys what the rendezvous pushes (elastic_machine.hpp): all nodes
// restart together on any failure or membership change, and every node exits with the job's
// result.
#include <iosfwd>

#include "ddprun/agent/config.hpp"

namespace ddprun::agent {

// Runs the job on this node until it ends. Returns the process exit code for ddprun:
// 0 on success; the first failing worker's exit code (128+signal for a signal death) when the
// restart budget is spent (multi-node: the first failing rank of the whole job); 128+signal when
// ddprun itself was stopped by a handled signal; 1 for a rendezvous failure (refused,
// unreachable, join or exit-barrier timeout).
// Throws ddprun::Error for configuration problems found before anything starts.
int run_agent(const AgentConfig& config);

// `config` with job_mode set (decide_job_mode) when it was not; run_agent and print_dry_run
// call it on entry.
AgentConfig with_job_mode(const AgentConfig& config);

// --dry-run: writes each local rank's argv, environment additions and working directory to
// `out` without starting anything.
void print_dry_run(const AgentConfig& config, std::ostream& out);

}  // namespace ddprun::agent
