#pragma once
// WorkerRun: the workers of one attempt (one round) on this node. It spawns them from their
// WorkerSpecs (worker_spec.hpp) as ChildProcesses, feeds their exits and drains to a
// WorkerGroupMachine (worker_group.hpp, no local restarts: restarts are the rendezvous
// backend's decision) and applies its actions: signal every worker group, arm/cancel the
// shutdown grace, and report the end of the group.
//
// Diagnosis (set_diagnostics): every worker joins its rank's containment cgroup; on the first
// failure the stacks of the ranks still running are collected before the group is signalled,
// and the failure report carries the cause of death and a diagnosis block (culprit of a
// collective timeout, one line per rank). With a hang timeout, a timer samples the ranks'
// process trees (CPU ticks, bytes written) and ends a group that made no progress.
//
// One WorkerRun serves every attempt of a job (start() replaces the previous attempt's workers,
// which must be done). Not thread-safe: the io_context thread only.
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ddprun/agent/child_process.hpp"
#include "ddprun/agent/config.hpp"
#include "ddprun/agent/containment.hpp"
#include "ddprun/agent/diagnosis.hpp"
#include "ddprun/agent/failure.hpp"
#include "ddprun/agent/worker_group.hpp"
#include "ddprun/agent/worker_spec.hpp"

namespace ddprun::agent {

class WorkerRun {
 public:
  struct Hooks {
    // A worker failed while the group was healthy: the attempt's first failure, once. Called
    // before the survivors' stacks are taken (the report's diagnosis is empty then, unless a hang
    // made one): the other nodes hear of it first, not of their ranks that fail because of it.
    std::function<void(const FailureReport&)> on_first_failure;
    // The diagnosis of that failure (the survivors' stacks, the culprit), once taken.
    std::function<void(const std::string& block)> on_diagnosis;
    // Every worker exited and its output drained: ok, and the group's exit code.
    std::function<void(bool ok, int code)> on_done;
    // A worker of the current attempt exited (its pid, before it is reaped).
    std::function<void(pid_t pid)> on_worker_exit;
    // A worker stayed in uninterruptible sleep for config.uninterruptible_state_timeout, or did
    // not end within config.kill_timeout of its SIGKILL: the group is unhealthy (what and why,
    // for the user), and no restart can help it. The second comes before the group's on_done.
    std::function<void(const std::string& why)> on_unhealthy;
  };

  WorkerRun(boost::asio::io_context& io, const AgentConfig& config, Hooks hooks);
  ~WorkerRun();
  WorkerRun(const WorkerRun&) = delete;
  WorkerRun& operator=(const WorkerRun&) = delete;

  // Starts the attempt: a log directory per local rank under `attempt_dir`, one worker per spec,
  // `executable` (already resolved) run with each spec's argv.
  void start(const std::string& attempt_dir, const std::string& executable, std::vector<WorkerSpec> specs,
             const worker_env::EnvMap& parent_env);
  // A handled signal: forwarded to every worker group (a second one escalates to SIGKILL).
  void signal(int sig);
  // Stops a healthy group as on SIGTERM (grace, then SIGKILL).
  void stop();
  // A rank of another node failed first: the diagnosis block of this node's ranks, taken before
  // they are stopped (a rank here may be the culprit, e.g. one that never entered the collective
  // the failed rank timed out in); "" when a local rank failed too, or with --stacks off.
  std::string diagnose_remote(const std::string& failure);
  // Ends everything at once: SIGKILL to workers still running, reap all. No hooks after this.
  void kill_and_reap_all();
  // Containment (may be null) and the directory of the Python stacks hook ("" = none). Call
  // before start().
  void set_diagnostics(Containment* containment, std::string python_hook_dir);
  // Flat layout under `job_dir` (job_dir.hpp): the attempt and rank directories are not made
  // at start, only when ddprun itself writes there (the native stacks of a diagnosis). Call
  // before start().
  void set_lazy_dirs(std::string job_dir) { lazy_job_dir_ = std::move(job_dir); }
  // Whether `pid` is a live process of the current attempt: a worker not yet exited, a process
  // in the job's containment cgroup(s) (also one a rank that already exited left behind, until
  // the attempt's sweep), or in a running worker's process tree. The file timer signals nothing
  // else; the hang detector samples the same set.
  bool owns_live_pid(pid_t pid) const;
  // The shell sent `sig` to `pid` itself (the file timer). When `pid` is a live worker's own
  // process its cause of death will read "killed by ddprun's <what>", and after a SIGKILL it has
  // --kill-timeout to end before the group gives up on it (stuck in the kernel).
  void note_kill(pid_t pid, int sig, const std::string& what);
  // Whether a log file was written for any worker so far.
  bool wrote_files() const { return wrote_files_; }
  // The current attempt's workers by state, for the metrics endpoint.
  struct WorkerCounts {
    int running = 0;
    int succeeded = 0;
    int failed = 0;
  };
  WorkerCounts worker_counts() const;
  // The failing worker of the attempt, as a report (nullopt when no worker failed).
  std::optional<FailureReport> root_cause() const;
  // This attempt's diagnosis block (empty: none), amended as ranks end after the first failure.
  const std::string& diagnosis() const { return diagnosis_; }
  // The attempt's other failed ranks, in exit order, with their error files read: every worker
  // that ended unsuccessfully on its own. Ranks ended by ddprun (its teardown signals after the
  // first failure, the hang detector) are consequences and are left out, as torchrun lists only
  // the workers that had failed when it noticed the first failure.
  std::vector<FailureReport> other_failures() const;

 private:
  struct Worker;
  void apply(const GroupActions& actions);
  void spawn(Worker& w, const std::string& executable, const worker_env::EnvMap& parent_env);
  void on_exit(int local_rank, const ExitStatus& status);
  void on_done(int local_rank);
  void signal_groups(int sig);
  void arm_grace();
  void arm_kill_wait();
  void cancel_kill_wait();
  // Stops waiting for a worker that outlived its SIGKILL; its description for on_unhealthy.
  std::string abandon(int local_rank);
  FailureReport report_of(const Worker& w) const;
  std::string cause_of(Worker& w, const ExitStatus& status);
  // Whether `status` is a kill by a signal ddprun sent to the group this attempt.
  bool by_teardown(const ExitStatus& status) const;
  std::string diagnose(const Worker* failed, const std::string& headline);  // never throws
  std::string build_diagnosis(const Worker* failed, const std::string& headline);
  void arm_hang_check();
  void on_hang_check();
  void arm_dstate_check();
  void on_dstate_check();
  std::vector<pid_t> job_pids() const;

  boost::asio::io_context& io_;
  const AgentConfig& config_;
  Hooks hooks_;
  WorkerGroupMachine machine_;
  boost::asio::steady_timer grace_timer_;
  boost::asio::steady_timer kill_wait_timer_;
  std::uint64_t kill_wait_generation_ = 0;  // arm_kill_wait: an expiry of an earlier arming is stale
  boost::asio::steady_timer hang_timer_;
  boost::asio::steady_timer dstate_timer_;
  // Since when each worker pid has been seen in uninterruptible sleep (state D), this attempt.
  std::map<pid_t, std::chrono::steady_clock::time_point> dstate_since_;
  Containment* containment_ = nullptr;
  std::string python_hook_dir_;
  Progress last_progress_;
  std::chrono::steady_clock::time_point last_change_;
  bool hang_fired_ = false;
  int insisted_ = 0;       // the signal that came while a stop was under way (its SIGKILL is not the grace's)
  std::string diagnosis_;  // this attempt's diagnosis block
  // Its parts, kept so a rank that ends on its own after the first failure (it was on its way
  // out when its stack was taken) gets its line amended: render_diagnosis().
  struct DiagnosisParts {
    std::string host;
    std::string headline;
    std::vector<std::string> culprits;
    std::vector<std::string> ranks;
    std::vector<int> local_rank_of_line;  // -1: the first failure's line
    std::vector<std::string> files;
  };
  DiagnosisParts diagnosis_parts_;
  void render_diagnosis();
  std::vector<int> teardown_signals_;  // what signal_groups() sent this attempt
  std::string attempt_dir_;
  std::vector<int> reset_signals_;  // signals_to_reset(), once per round (start)
  std::string lazy_job_dir_;        // set_lazy_dirs; empty: the directories are made at start
  std::vector<std::unique_ptr<Worker>> workers_;
  bool wrote_files_ = false;
  bool ended_ = false;  // the machine is terminal or kill_and_reap_all ran
};

}  // namespace ddprun::agent
