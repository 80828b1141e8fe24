// WorkerRun; see worker_run.hpp.
#include "ddprun/agent/worker_run.hpp"

#include "ddprun/agent/duplicate_filter.hpp"
#include "ddprun/agent/job_dir.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <csignal>
#include <cstring>
#include <fstream>
#include <optional>
#include <spdlog/spdlog.h>
#include <sstream>

#include "ddprun/common/error.hpp"
#include "ddprun/common/strings.hpp"
#include "ddprun/worker_env/numa.hpp"

namespace asio = boost::asio;

namespace ddprun::agent {

namespace {

// How long a worker's pipes may stay open after the worker exited (a grandchild holding them)
// before the agent stops waiting for EOF.
constexpr std::chrono::milliseconds kDrainTimeout{1000};

void make_dir(const std::string& path) {
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) {
    throw Error("cannot create directory " + path + ": " + std::strerror(errno));
  }
}

int open_log_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw Error("cannot open log file " + path + ": " + std::strerror(errno));
  }
  return fd;
}

// What a rank recorded as raised: the hook's stacks.txt.exception in `rank_dir` (its last line
// is `what`: "ValueError: boom"), else torch's error file (the first line of its message), at most
// 300 bytes of it and terminal-safe; `when` is when it was written. nullopt when it wrote neither.
struct Raised {
  std::string what;
  std::chrono::system_clock::time_point when;
};

std::optional<Raised> recorded_exception(const std::string& rank_dir, FailureReport report) {
  using namespace std::chrono;
  auto written = [](const std::string& path) -> std::optional<system_clock::time_point> {
    struct stat st {};
    if (path.empty() || ::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_size == 0) return std::nullopt;
    return system_clock::time_point(
        duration_cast<system_clock::duration>(seconds(st.st_mtim.tv_sec) + nanoseconds(st.st_mtim.tv_nsec)));
  };
  Raised r;
  if (auto when = written(rank_dir + "/stacks.txt.exception")) {
    r.when = *when;
    // The last non-empty line ("ValueError: boom"), read whole up to 1 MiB: a message of many
    // KiB on one line kept only its tail from a 4 KiB read, without the exception's type.
    const std::string text = read_tail(rank_dir + "/stacks.txt.exception", std::size_t{1} << 20);
    std::string_view rest(text);
    while (!rest.empty()) {
      const std::size_t nl = rest.rfind('\n');
      const std::string_view line = trim(nl == std::string_view::npos ? rest : rest.substr(nl + 1));
      if (!line.empty()) {
        r.what = terminal_safe_prefix(line, 300, false);
        break;
      }
      if (nl == std::string_view::npos) break;
      rest = rest.substr(0, nl);
    }
  } else if ((when = written(report.error_file))) {
    r.when = *when;
    load_error_file(report);
    if (report.error) {
      const std::string_view message(report.error->message);
      r.what = terminal_safe_prefix(message.substr(0, message.find('\n')), 300, false);
    }
  } else {
    return std::nullopt;
  }
  if (r.what.empty()) r.what = "an exception";
  return r;
}

}  // namespace

struct WorkerRun::Worker {
  Worker(asio::io_context& io, WorkerSpec s) : spec(std::move(s)), child(io, kDrainTimeout) {}
  WorkerSpec spec;
  ChildProcess child;
  std::chrono::system_clock::time_point exit_time;
  std::string note;       // spawn error, if any
  std::string cause;      // why it ended (cause_of)
  std::string killed_by;  // set when ddprun itself ends it: "the hang detector"
  // It had a handler for a signal the teardown sent it (SigCgt then): an exit code that follows
  // may be that handler's (a checkpoint on SIGTERM), a consequence of the teardown.
  bool handled_teardown = false;
};

WorkerRun::WorkerRun(asio::io_context& io, const AgentConfig& config, Hooks hooks)
    : io_(io),
      config_(config),
      hooks_(std::move(hooks)),
      machine_(config.nproc_per_node, 0),
      grace_timer_(io),
      kill_wait_timer_(io),
      hang_timer_(io),
      dstate_timer_(io) {}

void WorkerRun::set_diagnostics(Containment* containment, std::string python_hook_dir) {
  containment_ = containment;
  python_hook_dir_ = std::move(python_hook_dir);
}

WorkerRun::~WorkerRun() { kill_and_reap_all(); }

void WorkerRun::start(const std::string& attempt_dir, const std::string& executable, std::vector<WorkerSpec> specs,
                      const worker_env::EnvMap& parent_env) {
  kill_and_reap_all();
  workers_.clear();
  ended_ = false;
  attempt_dir_ = attempt_dir;
  if (lazy_job_dir_.empty()) make_dir(attempt_dir_);
  machine_ = WorkerGroupMachine(static_cast<int>(specs.size()), 0);
  diagnosis_.clear();
  diagnosis_parts_ = {};
  teardown_signals_.clear();
  hang_fired_ = false;
  if (containment_ != nullptr) containment_->begin_attempt();
  for (auto& s : specs) workers_.push_back(std::make_unique<Worker>(io_, std::move(s)));
  // Asked once for the whole round, not by each worker's child (~64 system calls each while the
  // agent waits for its exec): no handler is installed or removed between here and the spawns.
  reset_signals_ = signals_to_reset();
  for (const auto& a : machine_.start()) {
    if (a.kind != GroupAction::Kind::start_attempt) continue;
    for (auto& w : workers_) spawn(*w, executable, parent_env);
  }
  if (containment_ != nullptr) {
    for (auto& w : workers_) {
      if (w->child.pid() > 0 && !w->child.exited()) containment_->join_memory(w->spec.local_rank, w->child.pid());
    }
  }
  if (config_.hang_timeout.count() > 0) {
    last_progress_ = sample_progress(job_pids());
    last_change_ = std::chrono::steady_clock::now();
    arm_hang_check();
  }
  if (config_.uninterruptible_state_timeout.count() > 0) {
    dstate_since_.clear();
    arm_dstate_check();
  }
}

void WorkerRun::spawn(Worker& w, const std::string& executable, const worker_env::EnvMap& parent_env) {
  const int local_rank = w.spec.local_rank;
  const std::string rank_dir = attempt_dir_ + "/" + std::to_string(local_rank);
  if (lazy_job_dir_.empty()) make_dir(rank_dir);

  SpawnRequest req;
  req.path = executable;
  req.argv = w.spec.argv;
  req.envp = worker_env::merge_env(parent_env, w.spec.env);
  req.cwd = w.spec.cwd;
  req.cpus = w.spec.cpus;  // --numa-binding
  req.reset_signals = &reset_signals_;
  req.new_session = true;  // a worker may read the terminal (process.hpp)
  if (containment_ != nullptr) {
    req.cgroup_procs = containment_->join_files(local_rank);
    req.cgroup_dir_fd = containment_->join_dir_fd(local_rank);
    req.envp.push_back(containment_->token_env());
  }
  if (config_.stacks && !python_hook_dir_.empty()) {
    // The faulthandler hook (diagnosis.hpp): first on PYTHONPATH, told where to write.
    bool had_path = false;
    for (auto& kv : req.envp) {
      if (kv.rfind("PYTHONPATH=", 0) == 0) {
        const std::string rest = kv.substr(11);
        kv = "PYTHONPATH=" + python_hook_dir_ + (rest.empty() ? "" : ":" + rest);
        had_path = true;
      }
    }
    if (!had_path) req.envp.push_back("PYTHONPATH=" + python_hook_dir_);
    req.envp.push_back("DDPRUN_STACKS_FILE=" + rank_dir + "/stacks.txt");
    req.envp.push_back("DDPRUN_STACKS_SIGNAL=" + std::to_string(stacks_signal()));
  }

  // Output plumbing: redirected streams go straight to their file, piped ones through a pump.
  wrote_files_ = wrote_files_ || w.spec.routes.needs_files();
  ChildStream streams[2];
  const Route route[2] = {w.spec.routes.out, w.spec.routes.err};
  const char* names[2] = {"stdout.log", "stderr.log"};
  for (int s = 0; s < 2; ++s) {
    ChildStream& st = streams[s];
    if (const auto& filters = s == 0 ? config_.duplicate_stdout_filters : config_.duplicate_stderr_filters;
        !filters.empty()) {  // duplicate_filter.hpp
      st = duplicating_stream(route[s], rank_dir + "/" + names[s],
                              attempt_dir_ + (s == 0 ? "/filtered_stdout.log" : "/filtered_stderr.log"),
                              s == 0 ? STDOUT_FILENO : STDERR_FILENO, w.spec.prefix, filters);
      wrote_files_ = true;
      continue;
    }
    if (route[s] == Route::inherit) continue;
    if (route[s] == Route::discard) {
      st.kind = ChildStream::Kind::fd;
      st.fd = open_log_file("/dev/null");
      continue;
    }
    if (route[s] == Route::file) {
      st.kind = ChildStream::Kind::fd;
      st.fd = open_log_file(rank_dir + "/" + names[s]);
      continue;
    }
    st.kind = ChildStream::Kind::console;
    if (route[s] != Route::prefixed) st.file_fd = open_log_file(rank_dir + "/" + names[s]);
    st.console_fd = s == 0 ? STDOUT_FILENO : STDERR_FILENO;
    st.prefix = w.spec.prefix;
  }
  ChildProcess::Callbacks cb;
  cb.on_exit = [this, local_rank](const ExitStatus& status) { on_exit(local_rank, status); };
  cb.on_done = [this, local_rank] { on_done(local_rank); };
  const SpawnResult res =
      w.child.start(std::move(req), std::move(streams[0]), std::move(streams[1]), false, std::move(cb));
  if (res.cgroup_error != 0) {
    spdlog::warn("local rank {}: cannot join the job's cgroup ({}): {}; processes it starts may outlive the job",
                 local_rank, containment_ != nullptr ? containment_->mechanism() : "", std::strerror(res.cgroup_error));
  }
  if (res.affinity_error != 0) {
    spdlog::warn("local rank {}: --numa-binding {}: cannot bind to CPUs {}: {}; the worker runs unbound", local_rank,
                 config_.numa_binding, worker_env::format_cpu_list(w.spec.cpus), std::strerror(res.affinity_error));
  }
  if (!res.ok()) {
    w.note = "cannot start " + executable + ": " + (res.failed_step ? res.failed_step : "spawn") + ": " +
             std::strerror(res.error);
    spdlog::error("local rank {}: {}", local_rank, w.note);
  }
}

void WorkerRun::on_exit(int local_rank, const ExitStatus& status) {
  if (ended_) return;
  auto& w = *workers_[static_cast<std::size_t>(local_rank)];
  w.exit_time = std::chrono::system_clock::now();
  if (hooks_.on_worker_exit && w.child.pid() > 0) hooks_.on_worker_exit(w.child.pid());
  const bool was_healthy = machine_.state() == GroupState::healthy;
  w.cause = cause_of(w, status);
  if (!status.ok()) {
    spdlog::log(was_healthy ? spdlog::level::err : spdlog::level::debug,
                "local rank {} (rank {}, pid {}) ended with {}{}", local_rank, w.spec.rank, w.child.pid(),
                describe(status), w.cause.empty() ? "" : ": " + w.cause);
  }
  if (was_healthy && !status.ok() && hooks_.on_first_failure) {
    // Reported before the stacks are taken (up to seconds): a rank on another node that fails
    // because this one did (a connection reset) must not reach the rendezvous first and be named
    // the root cause.
    FailureReport r = report_of(w);
    // Without an error file the other nodes learnt only its exit code: what it raised goes with it.
    const std::string dir = attempt_dir_ + "/" + std::to_string(local_rank);
    if (auto rec = recorded_exception(dir, FailureReport{}); rec && rec->what != "an exception") {
      r.raised = rec->what;  // terminal-safe already
    }
    hooks_.on_first_failure(r);
    if (ended_) return;
  }
  if (was_healthy && !status.ok() && !hang_fired_) {
    // Before the group is signalled: the survivors' stacks show where each one was.
    diagnosis_ = diagnose(&w, "rank " + std::to_string(w.spec.rank) + " failed first (" + describe(status) + ")");
    if (hooks_.on_diagnosis && !diagnosis_.empty()) hooks_.on_diagnosis(diagnosis_);
  } else if (!was_healthy && w.killed_by.empty() && !by_teardown(status) && !diagnosis_.empty()) {
    // Its stack was taken while it was on its way out (raising too, say): it was not stuck.
    auto& d = diagnosis_parts_;
    for (std::size_t i = 0; i < d.ranks.size(); ++i) {
      if (d.local_rank_of_line[i] != local_rank) continue;
      const auto where = d.ranks[i].find("): ");
      const std::string before = where == std::string::npos ? std::string() : d.ranks[i].substr(where + 3);
      const std::string head = "rank " + std::to_string(w.spec.rank) + " (local " + std::to_string(local_rank) +
                               ", pid " + std::to_string(w.child.pid()) + "): ";
      if (w.handled_teardown) {
        // Its own handler may have ended it on the teardown's signal (a checkpoint on SIGTERM,
        // say): where it was at the first failure is still the news.
        d.ranks[i] = head + before + "; it then ended with " + describe(status) +
                     " after ddprun's teardown signal, which it handles";
      } else {
        d.ranks[i] = head + (status.ok() ? "ended" : "failed") + " on its own after the first failure (" +
                     describe(status) + ")" +
                     (before.empty() ? std::string() : "; its stack a moment before: " + before);
      }
      render_diagnosis();
    }
  }
  apply(machine_.on_exited(local_rank, status));
}

void WorkerRun::on_done(int local_rank) {
  if (ended_) return;
  apply(machine_.on_drained(local_rank));
}

void WorkerRun::signal(int sig) {
  if (ended_) return;
  // A signal while a stop is under way ends the grace: say so, not "did not stop within".
  insisted_ = machine_.state() == GroupState::stopping ? sig : 0;
  apply(machine_.on_signal(sig));
  insisted_ = 0;
}

std::string WorkerRun::diagnose_remote(const std::string& failure) {
  if (ended_ || !config_.stacks || machine_.state() != GroupState::healthy) return {};
  diagnosis_ = diagnose(nullptr, failure + "; the stacks of this node's ranks before they stop");
  return diagnosis_;
}

void WorkerRun::stop() {
  if (!ended_) apply(machine_.on_stop_request());
}

void WorkerRun::apply(const GroupActions& actions) {
  // Workers given up on come first; the hook hears of them before the group's end does, so the
  // agent leaves rather than restarts.
  std::string abandoned;
  for (const auto& a : actions) {
    if (a.kind == GroupAction::Kind::abandon) abandoned += (abandoned.empty() ? "" : ", ") + abandon(a.value);
  }
  if (!abandoned.empty() && hooks_.on_unhealthy) {
    const std::string when = insisted_ != 0 ? fmt::format("at a {} after the SIGKILL", signal_name(insisted_))
                                            : fmt::format("after --kill-timeout={} s",
                                                          std::chrono::duration<double>(config_.kill_timeout).count());
    hooks_.on_unhealthy(fmt::format(
        "worker group unhealthy: {} did not end after SIGKILL (stuck in the kernel); ddprun stopped waiting for it "
        "{} and leaves the job without a restart (the process ends when the kernel lets it go: see dmesg, and the "
        "driver or file system it waits on)",
        abandoned, when));
  }
  for (const auto& a : actions) {
    switch (a.kind) {
      case GroupAction::Kind::start_attempt:
      case GroupAction::Kind::abandon:
        break;  // restarts are the backend's; abandon: above
      case GroupAction::Kind::signal_groups:
        signal_groups(a.value);
        break;
      case GroupAction::Kind::arm_grace:
        arm_grace();
        break;
      case GroupAction::Kind::cancel_grace:
        grace_timer_.cancel();
        cancel_kill_wait();
        break;
      case GroupAction::Kind::arm_kill_wait:
        arm_kill_wait();
        break;
      case GroupAction::Kind::finish: {
        ended_ = true;
        grace_timer_.cancel();
        cancel_kill_wait();
        kill_and_reap_all();
        if (hooks_.on_done) hooks_.on_done(machine_.state() == GroupState::succeeded, a.value);
        return;  // the hook may start the next attempt
      }
    }
  }
}

void WorkerRun::signal_groups(int sig) {
  if (sig == SIGKILL && machine_.state() == GroupState::stopping) {
    for (const auto& w : workers_) {
      if (w->child.pid() <= 0 || w->child.exited()) continue;
      if (insisted_ != 0) {
        spdlog::warn("local rank {} (pid {}) still running at a second {} during the stop: sending SIGKILL",
                     w->spec.local_rank, w->child.pid(), signal_name(insisted_));
      } else {
        spdlog::warn("local rank {} (pid {}) did not stop within {} ms: sending SIGKILL", w->spec.local_rank,
                     w->child.pid(), config_.shutdown_timeout.count());
      }
    }
  }
  teardown_signals_.push_back(sig);
  // A stopped process (SIGSTOP, a debugger, SIGTTIN) takes SIGKILL at once, but a signal it
  // handles (Python's SIGINT, a trainer's SIGTERM checkpoint hook) stays pending until it runs
  // again: SIGCONT right after, as a shell's `kill` does for a stopped job, lets it act now
  // rather than at the shutdown timeout. Not after a stop signal itself, which it would undo.
  const bool resume =
      sig != SIGKILL && sig != SIGCONT && sig != SIGSTOP && sig != SIGTSTP && sig != SIGTTIN && sig != SIGTTOU;
  // Exited workers are zombies until reaped, so their process-group id cannot have been reused:
  // signalling it reaches only what is left of that worker's group.
  for (const auto& w : workers_) {
    if (resume && w->child.pid() > 0 && !w->child.exited() && catches_signal(w->child.pid(), sig)) {
      w->handled_teardown = true;
    }
    w->child.signal_group(sig);
    if (resume) w->child.signal_group(SIGCONT);
  }
}

void WorkerRun::arm_grace() {
  grace_timer_.expires_after(config_.shutdown_timeout);
  grace_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec || ended_) return;
    apply(machine_.on_grace_expired());
  });
}

void WorkerRun::arm_kill_wait() {
  // Armed again while an expiry may already be queued (a second worker's SIGKILL, the grace's
  // after the file timer's): that completion cannot be cancelled any more and would give up on
  // workers SIGKILLed a moment ago. Only the latest arming's expiry counts.
  const std::uint64_t generation = ++kill_wait_generation_;
  kill_wait_timer_.expires_after(config_.kill_timeout);
  kill_wait_timer_.async_wait([this, generation](const boost::system::error_code& ec) {
    if (ec || ended_ || generation != kill_wait_generation_) return;
    apply(machine_.on_kill_wait_expired());
  });
}

void WorkerRun::cancel_kill_wait() {
  ++kill_wait_generation_;
  kill_wait_timer_.cancel();
}

std::string WorkerRun::abandon(int local_rank) {
  Worker& w = *workers_.at(static_cast<std::size_t>(local_rank));
  const pid_t pid = w.child.pid();
  // The thread the kernel holds: SIGKILL has ended the others, the main one (a zombie now) too
  // when another thread is the stuck one (a driver call of a CUDA or NCCL thread).
  pid_t tid = pid;
  char state = process_state(pid);
  if (state != 'D') {
    // opendir, not std::filesystem: the process may end while its task list is read.
    if (DIR* d = ::opendir(("/proc/" + std::to_string(pid) + "/task").c_str())) {
      while (const dirent* e = ::readdir(d)) {
        pid_t t = 0;
        const std::string_view name(e->d_name);
        if (std::from_chars(name.data(), name.data() + name.size(), t).ec != std::errc{} || t == pid) continue;
        if (process_state(t) == 'D') {
          tid = t;
          state = 'D';
          break;
        }
      }
      ::closedir(d);
    }
  }
  // Where in the kernel it waits (e.g. "__refrigerator", a driver's function); "0" when hidden.
  std::string where;
  {
    std::ifstream in("/proc/" + std::to_string(pid) + "/task/" + std::to_string(tid) + "/wchan");
    std::getline(in, where);
    if (where == "0") where.clear();
  }
  const std::string what =
      fmt::format("local rank {} (pid {}{}, state {}{}{})", local_rank, pid,
                  tid == pid ? "" : fmt::format(", thread {}", tid), state != 0 ? std::string(1, state) : "gone",
                  where.empty() ? "" : ", waiting in ", terminal_safe(where.substr(0, 80)));
  if (insisted_ != 0) {
    spdlog::error("{} has not ended since its SIGKILL: no longer waited for, at a {}", what, signal_name(insisted_));
  } else {
    spdlog::error("{} did not end within {} ms of SIGKILL: no longer waited for", what, config_.kill_timeout.count());
  }
  w.child.abandon();
  if (containment_ != nullptr) containment_->give_up_on(pid);
  return what;
}

void WorkerRun::kill_and_reap_all() {
  hang_timer_.cancel();
  cancel_kill_wait();
  dstate_timer_.cancel();
  for (auto& w : workers_) w->child.kill_and_reap();
  // What the workers left behind (daemons, double forks) ends with them.
  if (containment_ != nullptr && !workers_.empty()) {
    if (const int n = containment_->sweep(); n > 0) {
      spdlog::info("ended {} process(es) the workers left behind ({})", n, containment_->mechanism());
    }
  }
}

FailureReport WorkerRun::report_of(const Worker& w) const {
  FailureReport r;
  r.local_rank = w.spec.local_rank;
  r.rank = w.spec.rank;
  r.pid = w.child.pid();
  r.status = w.child.status();
  r.time = w.exit_time;
  r.error_file = w.spec.error_file;
  r.note = w.note;
  r.cause = w.cause;
  r.diagnosis = diagnosis_;
  return r;
}

bool WorkerRun::by_teardown(const ExitStatus& status) const {
  return status.signal != 0 &&
         std::find(teardown_signals_.begin(), teardown_signals_.end(), status.signal) != teardown_signals_.end();
}

std::vector<FailureReport> WorkerRun::other_failures() const {
  const auto root = machine_.root_cause();
  std::vector<const Worker*> failed;
  for (const auto& w : workers_) {
    if (root && w->spec.local_rank == root->local_rank) continue;
    if (!w->child.exited() || w->child.status().ok() || !w->killed_by.empty()) continue;
    if (by_teardown(w->child.status())) continue;  // a consequence of the first failure
    if (w->handled_teardown) continue;             // it ended through its handler of that signal: the same
    failed.push_back(w.get());
  }
  std::stable_sort(failed.begin(), failed.end(),
                   [](const Worker* a, const Worker* b) { return a->exit_time < b->exit_time; });
  std::vector<FailureReport> out;
  for (const auto* w : failed) {
    FailureReport r = report_of(*w);
    r.diagnosis.clear();  // the attempt's block goes with the root cause only
    load_error_file(r);
    out.push_back(std::move(r));
  }
  return out;
}

std::optional<FailureReport> WorkerRun::root_cause() const {
  const auto root = machine_.root_cause();
  if (!root) return std::nullopt;
  FailureReport r = report_of(*workers_[static_cast<std::size_t>(root->local_rank)]);
  r.status = root->status;
  return r;
}

// ---- diagnosis (diagnosis.hpp, containment.hpp) ----

std::string WorkerRun::cause_of(Worker& w, const ExitStatus& status) {
  if (status.ok()) return {};
  std::vector<std::string> parts;
  if (!w.killed_by.empty()) {
    parts.push_back("killed by ddprun's " + w.killed_by);
  } else if (machine_.state() != GroupState::healthy) {
    parts.push_back(by_teardown(status)
                        ? "stopped by ddprun's teardown after the first failure (a consequence, not a cause)"
                    : w.handled_teardown
                        ? "ended after ddprun's teardown signal, which it handles (likely a consequence, not a cause)"
                        : "failed on its own after the first failure (not ended by ddprun's teardown)");
  }
  const RankMemory mem = containment_ != nullptr ? containment_->rank_memory(w.spec.local_rank) : RankMemory{};
  const auto detail = peek_exit_detail(w.child.pid());
  const std::string limit = mem.limit ? " (memory limit " + format_bytes(*mem.limit) + ")" : std::string();
  if (mem.oom_kills > 0 && mem.oom_scope.empty()) {
    parts.push_back("out of memory: the kernel's OOM killer ended it" + limit);
  } else if (mem.oom_kills > 0 && status.signal == SIGKILL && w.killed_by.empty() && !by_teardown(status)) {
    // No memory cgroup of its own: the kill was counted for a wider scope (containment.hpp).
    // A cgroup's count is the job's neighbours' at most; the machine's is anyone's.
    parts.push_back(mem.oom_scope_machine
                        ? "out of memory (possibly): the kernel's OOM killer ended " + std::to_string(mem.oom_kills) +
                              " process(es) on this machine during this attempt, and this SIGKILL did not come "
                              "from ddprun"
                        : "out of memory (likely): the kernel's OOM killer ended " + std::to_string(mem.oom_kills) +
                              " process(es) of " + mem.oom_scope + " during this attempt" + limit +
                              ", and this SIGKILL did not come from ddprun");
  }
  if (detail && detail->core_dumped) parts.push_back("core dumped");
  if (mem.peak) {
    parts.push_back("peak memory " + format_bytes(*mem.peak) + " (the rank's processes, cgroup)");
  } else if (detail && detail->max_rss_kb > 0) {
    parts.push_back("peak RSS " + format_bytes(static_cast<std::uint64_t>(detail->max_rss_kb) * 1024) +
                    " (the worker process)");
  }
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : "; ") + p;
  return out;
}

std::string WorkerRun::diagnose(const Worker* failed, const std::string& headline) {
  // What the diagnosis reads is the ranks' to write: whatever goes wrong in it must not cost the
  // failure summary, the restart or the exit code (an exception here used to end the agent).
  try {
    return build_diagnosis(failed, headline);
  } catch (const std::exception& e) {
    spdlog::error("could not build the diagnosis of this failure ({}); the failure summary follows", e.what());
    diagnosis_parts_ = {};
    return {};
  }
}

std::string WorkerRun::build_diagnosis(const Worker* failed, const std::string& headline) {
  char host_buf[256] = {};
  ::gethostname(host_buf, sizeof(host_buf) - 1);
  const std::string host = host_buf;
  std::vector<std::string> culprits;
  std::vector<std::string> ranks;
  std::vector<int> local_rank_of_line;
  std::vector<std::string> files;
  std::vector<StackTarget> targets;
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto& w : workers_) {
    if (w.get() == failed || w->child.pid() <= 0 || w->child.exited()) continue;
    if (!config_.stacks) continue;
    const std::string rank_dir = attempt_dir_ + "/" + std::to_string(w->spec.local_rank);
    // Flat layout: the rank's directory is made now; when that fails, collect_stacks says so.
    if (!lazy_job_dir_.empty()) ensure_dir(lazy_job_dir_, rank_dir);
    targets.push_back({w->child.pid(), w->spec.rank, w->spec.local_rank, rank_dir});
  }
  const std::vector<RankStacks> stacks = collect_stacks(targets);
  const double total_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!stacks.empty()) spdlog::info("collected the stacks of {} rank(s) in {:.1f} ms", stacks.size(), total_ms);

  // The collective the first failure timed out in, from what the rank left behind.
  std::string collective;
  if (failed != nullptr) {
    const std::string dir = attempt_dir_ + "/" + std::to_string(failed->spec.local_rank);
    std::string text = read_tail(dir + "/stacks.txt.exception", 64 * 1024);
    text += read_tail(dir + "/stderr.log", 64 * 1024);
    if (auto rep = report_of(*failed); (load_error_file(rep), rep.error))
      text += rep.error->message + "\n" + rep.error->traceback;
    collective = collective_timeout_in(text);
    const std::string_view how = collective.empty() ? std::string_view() : collective_failure_words(text);
    // What it raised, when that was not a collective failure: its traceback may have scrolled
    // away among its victims' ones.
    const auto own = collective.empty() ? recorded_exception(dir, report_of(*failed)) : std::nullopt;
    // Where a fatal signal hit it, from the dump the hook's faulthandler.enable wrote then.
    // Only for the signals faulthandler dumps on: a SIGKILL (the OOM killer) writes nothing there,
    // and the file's last dump would be older or another process's.
    const int sig = failed->child.status().signal;
    const bool dumps = sig == SIGSEGV || sig == SIGFPE || sig == SIGABRT || sig == SIGBUS || sig == SIGILL;
    const std::string crashed = dumps ? fatal_where(dir + "/stacks.txt") : std::string();
    ranks.push_back("rank " + std::to_string(failed->spec.rank) + " (local " + std::to_string(failed->spec.local_rank) +
                    ", pid " + std::to_string(failed->child.pid()) + "): " + describe(failed->child.status()) +
                    (failed->cause.empty() ? "" : ": " + failed->cause) +
                    (collective.empty() ? "" : "; " + std::string(how) + " " + collective) +
                    (own ? "; raised " + own->what : "") + (crashed.empty() ? "" : "; crashed in " + crashed));
    local_rank_of_line.push_back(-1);
    if (!crashed.empty()) files.push_back(dir + "/stacks.txt");
  }
  // A rank that raised before the failure yet still runs (its cleanup, a non-daemon thread or an
  // atexit handler keeps its process alive) failed first in all but its exit: the hook's
  // stacks.txt.exception or torch's error file, written before the failed rank ended, says so.
  // Unless what it raised is itself a collective failure (a timeout, a peer that closed or reset
  // the connection): that rank is one more victim, waiting on the culprit like the failed rank,
  // neither the culprit nor a rank that never entered the collective. Victims of a rank that
  // raised used to be named first: gloo peers raise "Connection closed by peer" while the rank
  // that raised is still tearing down, before it exits.
  std::vector<int> victims;  // local ranks
  std::vector<int> raised;
  if (failed != nullptr) {
    std::vector<std::pair<std::chrono::system_clock::time_point, std::string>> first;
    for (const auto& w : workers_) {
      if (w.get() == failed || w->child.pid() <= 0 || w->child.exited()) continue;
      const std::string dir = attempt_dir_ + "/" + std::to_string(w->spec.local_rank);
      const auto rec = recorded_exception(dir, report_of(*w));
      if (!rec) continue;
      // The error line only: a traceback's source lines say "timeout" for many other reasons.
      if (!collective_timeout_in(rec->what).empty()) {
        victims.push_back(w->spec.local_rank);
        continue;
      }
      // Written only later: a rank may raise in reaction to the failure too.
      if (rec->when > failed->exit_time - std::chrono::milliseconds(50)) continue;
      char ago[32];
      std::snprintf(ago, sizeof(ago), " %.1f s", std::chrono::duration<double>(failed->exit_time - rec->when).count());
      first.emplace_back(rec->when, "rank " + std::to_string(w->spec.rank) + " raised " + rec->what + ago +
                                        " before rank " + std::to_string(failed->spec.rank) +
                                        " ended, and was still running then (its cleanup, a non-daemon thread or an "
                                        "atexit handler kept it alive)");
      raised.push_back(w->spec.local_rank);
    }
    // The earliest first: it is the likeliest cause of the others.
    std::stable_sort(first.begin(), first.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (auto& [when, line] : first) culprits.push_back(std::move(line));
  }
  auto listed = [](const std::vector<int>& v, int local_rank) {
    return std::find(v.begin(), v.end(), local_rank) != v.end();
  };
  auto inside_collective = [](const RankStacks& s) {
    return in_collective(s.main_thread.empty() ? s.text : s.main_thread);
  };
  const bool any_in = std::any_of(stacks.begin(), stacks.end(), inside_collective);
  for (const auto& s : stacks) {
    const bool inside = inside_collective(s);
    const bool victim = listed(victims, s.local_rank);
    if (!s.method.empty() && !inside && !victim && !listed(raised, s.local_rank) &&
        (!collective.empty() || (failed == nullptr && any_in))) {
      const std::string what = collective.empty() ? std::string("the collective the others wait in") : collective;
      culprits.push_back("rank " + std::to_string(s.rank) + " never entered " + what + ": it was in " + s.where);
    }
    char cost[32];
    std::snprintf(cost, sizeof(cost), "%.1f ms", s.millis);
    ranks.push_back("rank " + std::to_string(s.rank) + " (local " + std::to_string(s.local_rank) + ", pid " +
                    std::to_string(s.pid) + "): " + (inside ? "in a collective, " : "") +
                    (victim ? "had failed in a collective too, " : "") +
                    (s.where.empty() ? std::string("no Python frame") : "in " + s.where) +
                    (s.method.empty() ? "" : " [" + s.method + ", " + cost + "]"));
    local_rank_of_line.push_back(s.local_rank);
    if (!s.file.empty()) files.push_back(s.file);
  }
  if (culprits.empty() && !collective.empty() && !stacks.empty()) {
    culprits.push_back("every other rank was inside a collective too: look for the first rank that timed out");
  }
  diagnosis_parts_ = {
      host, headline, std::move(culprits), std::move(ranks), std::move(local_rank_of_line), std::move(files)};
  render_diagnosis();
  return diagnosis_;
}

void WorkerRun::render_diagnosis() {
  const auto& d = diagnosis_parts_;
  diagnosis_ = format_diagnosis_block(d.host, d.headline, d.culprits, d.ranks, d.files);
  // Next to the stacks it refers to (a run without any keeps no file for it).
  if (const int fd = d.files.empty() ? -1 : create_agent_file(attempt_dir_ + "/diagnosis.txt"); fd >= 0) {
    write_all(fd, diagnosis_);
    ::close(fd);
  }
}

void WorkerRun::note_kill(pid_t pid, int sig, const std::string& what) {
  if (ended_) return;
  for (auto& w : workers_) {
    if (w->child.pid() != pid || w->child.exited()) continue;
    w->killed_by = what;
    if (sig == SIGKILL) apply(machine_.on_worker_kill(w->spec.local_rank));
    return;
  }
}

bool WorkerRun::owns_live_pid(pid_t pid) const {
  if (pid <= 1 || ended_) return false;
  for (const auto& w : workers_) {
    // A worker not reaped yet cannot have its pid reused.
    if (w->child.pid() == pid && !w->child.exited()) return true;
  }
  const auto pids = job_pids();
  return std::find(pids.begin(), pids.end(), pid) != pids.end();
}

std::vector<pid_t> WorkerRun::job_pids() const {
  std::vector<pid_t> out;
  if (containment_ != nullptr) {
    if (auto members = containment_->job_pids()) out = std::move(*members);
  }
  // A worker the containment cgroup does not list (its join failed and it runs outside, which
  // is logged at its start; or no cgroup at all) counts with its process tree.
  for (const auto& w : workers_) {
    if (w->child.pid() <= 0 || w->child.exited()) continue;
    if (std::find(out.begin(), out.end(), w->child.pid()) != out.end()) continue;
    const auto p = process_tree(w->child.pid());
    out.insert(out.end(), p.begin(), p.end());
  }
  return out;
}

namespace {

// How often a detector with `timeout` samples: a few times per timeout, at most once a second.
std::chrono::milliseconds sampling_period(std::chrono::milliseconds timeout) {
  return std::min<std::chrono::milliseconds>(std::chrono::milliseconds(1000),
                                             timeout / 4 + std::chrono::milliseconds(1));
}

}  // namespace

void WorkerRun::arm_hang_check() {
  hang_timer_.expires_after(sampling_period(config_.hang_timeout));
  hang_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (!ec && !ended_) on_hang_check();
  });
}

void WorkerRun::on_hang_check() {
  if (machine_.state() != GroupState::healthy) return;
  const auto now = std::chrono::steady_clock::now();
  const Progress p = sample_progress(job_pids());
  if (!(p == last_progress_)) {
    last_progress_ = p;
    last_change_ = now;
  } else if (now - last_change_ >= config_.hang_timeout) {
    const double secs = std::chrono::duration<double>(config_.hang_timeout).count();
    spdlog::error("no rank wrote anything or used CPU for {} s (--hang-timeout): the job is hung; collecting stacks",
                  secs);
    hang_fired_ = true;
    char what[96];
    std::snprintf(what, sizeof(what), "hang detector (no output and no CPU progress for %g s)", secs);
    diagnosis_ = diagnose(nullptr, std::string("hung: ") + what);
    for (auto& w : workers_) w->killed_by = what;
    // The first exit is then the attempt's failure: restart or fail as --max-restarts allows.
    for (const auto& w : workers_) w->child.signal_group(SIGKILL);
    // Should none end (every rank stuck in the kernel), the kill wait fails the attempt.
    apply(machine_.on_hang_kill());
    return;
  }
  arm_hang_check();
}

void WorkerRun::arm_dstate_check() {
  dstate_timer_.expires_after(sampling_period(config_.uninterruptible_state_timeout));
  dstate_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (!ec && !ended_) on_dstate_check();
  });
}

// Current torchrun's TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT: each worker's own process (not
// its children), sampled while the group is healthy.
void WorkerRun::on_dstate_check() {
  if (machine_.state() != GroupState::healthy) return;
  const auto now = std::chrono::steady_clock::now();
  const double limit = std::chrono::duration<double>(config_.uninterruptible_state_timeout).count();
  std::string stuck;
  for (const auto& w : workers_) {
    const pid_t pid = w->child.pid();
    if (pid <= 0 || w->child.exited()) continue;
    if (process_state(pid) != 'D') {
      dstate_since_.erase(pid);
      continue;
    }
    const auto [it, first] = dstate_since_.emplace(pid, now);
    if (first) {
      spdlog::warn(
          "local rank {} (pid {}) is in uninterruptible sleep (D state); the worker group is unhealthy if it "
          "stays there {} s (TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT)",
          w->spec.local_rank, pid, limit);
    }
    const double secs = std::chrono::duration<double>(now - it->second).count();
    if (now - it->second >= config_.uninterruptible_state_timeout) {
      stuck += fmt::format("{}local rank {} (pid {}) for {:.1f} s", stuck.empty() ? "" : ", ", w->spec.local_rank, pid,
                           secs);
    }
  }
  if (stuck.empty()) {
    arm_dstate_check();
    return;
  }
  if (hooks_.on_unhealthy) {
    hooks_.on_unhealthy(fmt::format(
        "worker group unhealthy: {} in uninterruptible sleep (D state), at least "
        "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT={} s; stopping the workers and leaving the job without a "
        "restart (a process stuck in the kernel holds its GPU or NIC: see dmesg, and the driver or file system it "
        "waits on)",
        stuck, limit));
  }
}

WorkerRun::WorkerCounts WorkerRun::worker_counts() const {
  WorkerCounts counts;
  for (const auto& w : workers_) {
    if (!w->note.empty() || (w->child.exited() && !w->child.status().ok())) {
      ++counts.failed;
    } else if (w->child.exited()) {
      ++counts.succeeded;
    } else {
      ++counts.running;
    }
  }
  return counts;
}

}  // namespace ddprun::agent
