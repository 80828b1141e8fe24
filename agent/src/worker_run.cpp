// WorkerRun; see worker_run.hpp.
#include "ddprun/agent/worker_run.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <spdlog/spdlog.h>

#include "ddprun/common/error.hpp"
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

}  // namespace

struct WorkerRun::Worker {
  Worker(asio::io_context& io, WorkerSpec s) : spec(std::move(s)), child(io, kDrainTimeout) {}
  WorkerSpec spec;
  ChildProcess child;
  std::chrono::system_clock::time_point exit_time;
  std::string note;  // spawn error, if any
};

WorkerRun::WorkerRun(asio::io_context& io, const AgentConfig& config, Hooks hooks)
    : io_(io), config_(config), hooks_(std::move(hooks)), machine_(config.nproc_per_node, 0), grace_timer_(io) {}

WorkerRun::~WorkerRun() { kill_and_reap_all(); }

void WorkerRun::start(const std::string& attempt_dir, const std::string& executable, std::vector<WorkerSpec> specs,
                      const worker_env::EnvMap& parent_env) {
  kill_and_reap_all();
  workers_.clear();
  ended_ = false;
  attempt_dir_ = attempt_dir;
  make_dir(attempt_dir_);
  machine_ = WorkerGroupMachine(static_cast<int>(specs.size()), 0);
  for (auto& s : specs) workers_.push_back(std::make_unique<Worker>(io_, std::move(s)));
  for (const auto& a : machine_.start()) {
    if (a.kind != GroupAction::Kind::start_attempt) continue;
    for (auto& w : workers_) spawn(*w, executable, parent_env);
  }
}

void WorkerRun::spawn(Worker& w, const std::string& executable, const worker_env::EnvMap& parent_env) {
  const int local_rank = w.spec.local_rank;
  const std::string rank_dir = attempt_dir_ + "/" + std::to_string(local_rank);
  make_dir(rank_dir);

  SpawnRequest req;
  req.path = executable;
  req.argv = w.spec.argv;
  req.envp = worker_env::merge_env(parent_env, w.spec.env);
  req.cwd = w.spec.cwd;
  req.cpus = w.spec.cpus;  // --numa-binding

  // Output plumbing: redirected streams go straight to their file, piped ones through a pump.
  wrote_files_ = wrote_files_ || w.spec.routes.needs_files();
  ChildStream streams[2];
  const Route route[2] = {w.spec.routes.out, w.spec.routes.err};
  const char* names[2] = {"stdout.log", "stderr.log"};
  for (int s = 0; s < 2; ++s) {
    ChildStream& st = streams[s];
    if (route[s] == Route::inherit) continue;
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
  const SpawnResult res = w.child.start(std::move(req), std::move(streams[0]), std::move(streams[1]), false, std::move(cb));
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
  const bool was_healthy = machine_.state() == GroupState::healthy;
  if (!status.ok()) {
    spdlog::log(was_healthy ? spdlog::level::err : spdlog::level::debug, "local rank {} (rank {}, pid {}) ended with {}",
                local_rank, w.spec.rank, w.child.pid(), describe(status));
  }
  apply(machine_.on_exited(local_rank, status));
  if (was_healthy && !status.ok() && !ended_ && hooks_.on_first_failure) {
    hooks_.on_first_failure(report_of(w));
  }
}

void WorkerRun::on_done(int local_rank) {
  if (ended_) return;
  apply(machine_.on_drained(local_rank));
}

void WorkerRun::signal(int sig) {
  if (!ended_) apply(machine_.on_signal(sig));
}

void WorkerRun::stop() {
  if (!ended_ && machine_.state() == GroupState::healthy) apply(machine_.on_signal(SIGTERM));
}

void WorkerRun::apply(const GroupActions& actions) {
  for (const auto& a : actions) {
    switch (a.kind) {
      case GroupAction::Kind::start_attempt: break;  // only from start(): restarts are the backend's
      case GroupAction::Kind::signal_groups: signal_groups(a.value); break;
      case GroupAction::Kind::arm_grace: arm_grace(); break;
      case GroupAction::Kind::cancel_grace: grace_timer_.cancel(); break;
      case GroupAction::Kind::finish: {
        ended_ = true;
        grace_timer_.cancel();
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
      if (w->child.pid() > 0 && !w->child.exited()) {
        spdlog::warn("local rank {} (pid {}) did not stop within {} ms: sending SIGKILL", w->spec.local_rank,
                     w->child.pid(), config_.shutdown_timeout.count());
      }
    }
  }
  // Exited workers are zombies until reaped, so their process-group id cannot have been reused:
  // signalling it reaches only what is left of that worker's group.
  for (const auto& w : workers_) w->child.signal_group(sig);
}

void WorkerRun::arm_grace() {
  grace_timer_.expires_after(config_.shutdown_timeout);
  grace_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec || ended_) return;
    apply(machine_.on_grace_expired());
  });
}

void WorkerRun::kill_and_reap_all() {
  for (auto& w : workers_) w->child.kill_and_reap();
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
  return r;
}

std::optional<FailureReport> WorkerRun::root_cause() const {
  const auto root = machine_.root_cause();
  if (!root) return std::nullopt;
  FailureReport r = report_of(*workers_[static_cast<std::size_t>(root->local_rank)]);
  r.status = root->status;
  return r;
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
