#pragma once
// The job's log directory: <log_dir>/<run_id>_<random>, or $TMPDIR/ddprun-<run_id>_<random>
// when no --log-dir was given (removed at the end unless it holds a file worth reading). Each
// round gets a subdirectory, each local rank one below it (worker_run.cpp).
//
// Without --log-dir, a job none of whose ranks writes a file there (native programs, no log
// files, no Python hook: job_dir_needed is false) only reserves the name: nothing is created
// until something must be written (ensure_dir), because on a disk file system each directory
// costs a block allocation and, at removal, a block free (with `discard`, milliseconds).
#include <string>

#include "ddprun/agent/config.hpp"

namespace ddprun::agent {

// Creates the directory fresh. Throws ddprun::Error naming it when that fails.
std::string make_job_dir(const AgentConfig& config);
// A fresh name for the directory without creating it ($TMPDIR/ddprun-<run_id>_<random>, 12
// random characters from getrandom: not guessable, so nobody else can hold it in advance).
std::string reserve_job_dir(const AgentConfig& config);
// Whether the directory must exist before the first worker starts: --log-dir, log files or
// output filters, or a rank that may run Python (torch's error handler writes
// TORCHELASTIC_ERROR_FILE there; the faulthandler hook lives there).
bool job_dir_needed(const AgentConfig& config, bool any_files, bool may_run_python);
// Creates `dir` and its missing parents up to and including `job_dir` (the job directory 0700,
// the others 0755). False with errno set when that fails, or when `job_dir` exists but is not a
// directory of this user (a reserved name must not be someone else's).
bool ensure_dir(const std::string& job_dir, const std::string& dir);
// The directory make_job_dir would create, with "<random>" for its random part (--dry-run).
std::string job_dir_pattern(const AgentConfig& config);
// Without --log-dir: removes `dir` unless `may_hold_files` and a regular file is in it.
void remove_job_dir_unless_useful(const AgentConfig& config, const std::string& dir, bool may_hold_files);

}  // namespace ddprun::agent
