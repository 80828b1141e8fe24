#pragma once
// The job's log directory: <log_dir>/<run_id>_<random>, or $TMPDIR/ddprun-<run_id>_<random>
// when no --log-dir was given (removed at the end unless it holds a file worth reading). Each
// round gets a subdirectory, each local rank one below it (worker_run.cpp).
#include <string>

#include "ddprun/agent/config.hpp"

namespace ddprun::agent {

// Creates the directory fresh. Throws ddprun::Error naming it when that fails.
std::string make_job_dir(const AgentConfig& config);
// The directory make_job_dir would create, with "<random>" for its random part (--dry-run).
std::string job_dir_pattern(const AgentConfig& config);
// Without --log-dir: removes `dir` unless `may_hold_files` and a regular file is in it.
void remove_job_dir_unless_useful(const AgentConfig& config, const std::string& dir, bool may_hold_files);

}  // namespace ddprun::agent
