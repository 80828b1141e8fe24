#pragma once
// The job's log directory: <log_dir>/<run_id>_<random>, or $TMPDIR/ddprun-<run_id>_<random>
// when no --log-dir was given (removed at the end unless it holds a file worth reading). Each
// round gets a subdirectory, each local rank one below it (worker_run.cpp).
//
// Flat layout (rank_dirs_needed is false: no --log-dir, no log files or output filters, and
// no rank that may run Python): the job directory alone is made, each rank's
// TORCHELASTIC_ERROR_FILE is <job_dir>/<attempt>.<local_rank>.error.json in it, and attempt
// and rank directories are made only when ddprun writes there (ensure_dir: the native stacks
// of a diagnosis). On a disk file system every directory costs a block allocation and, at
// removal, a block free (with `discard`, up to milliseconds each): N + 2 of them per job
// otherwise.
#include <functional>
#include <string>

#include "ddprun/agent/config.hpp"

namespace ddprun::agent {

// Creates the directory fresh; returns its absolute path. Throws ddprun::Error naming it when that
// fails.
std::string make_job_dir(const AgentConfig& config);
// Whether each attempt and rank gets its directory before the workers start (torchrun's
// layout): with --log-dir, log files or output filters, or when a rank may run Python (the
// faulthandler hook's stacks files go there).
bool rank_dirs_needed(const AgentConfig& config, bool any_files, bool may_run_python);
// Creates `dir` below the existing `job_dir` with its missing parents (0755). False with errno
// set when that fails or `dir` is not below `job_dir`.
bool ensure_dir(const std::string& job_dir, const std::string& dir);
// The directory make_job_dir would create, with "<random>" for its random part (--dry-run).
std::string job_dir_pattern(const AgentConfig& config);
// Whether `dir` holds a regular file with data, ddprun's Python hook (.ddprun-python) aside.
bool run_dir_holds_data(const std::string& dir);
// ddprun's own leftovers in a run directory that stays (a --log-dir's): the Python hook
// (.ddprun-python) and the stack files no dump was written to (the hook opens one per Python
// rank at its start: attempt_N/R/stacks.txt, attempt_N.K/R/stacks.txt). Never follows a symbolic
// link. Call at the end of the job.
void tidy_job_dir(const std::string& dir);
// Without --log-dir: removes `dir` unless `may_hold_files` and run_dir_holds_data(dir). The
// removal goes to `remove_later` (given `dir`, absolute from make_job_dir;
// Containment::remove_when_gone) when that takes it.
void remove_job_dir_unless_useful(const AgentConfig& config, const std::string& dir, bool may_hold_files,
                                  const std::function<bool(const std::string&)>& remove_later = {});

}  // namespace ddprun::agent
