// The agent shell: owns the io_context, the worker store, the workers, their pumps and timers,
// and applies the decisions of WorkerGroupMachine (worker_group.hpp).
//
// Two paths share the worker code:
//  * single node (--standalone, or static with one node): the machine's own restart budget.
//  * elastic (elastic.hpp: uses_elastic_path): the rendezvous decides. Each round the agent gets
//    an Assignment, runs its workers under a machine with no local restarts, reports the first
//    local failure (or success) to the rendezvous and obeys what it pushes: restart (stop the
//    workers, reset the worker store, join again), job failed (stop, print the root cause,
//    exit with its code), job completed (exit 0), refused / unreachable (stop, exit 1).
//    Heartbeats and reconnects are the RendezvousClient's job.
//
// One thread (the caller's) runs the io_context; every callback below runs on it. Nothing
// polls: worker exits arrive through pidfds, output through pipes, signals through a
// signal_set, deadlines through steady_timers.
#include "ddprun/agent/agent.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <algorithm>
#include <array>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string_view>
#include <spdlog/spdlog.h>

#include "ddprun/agent/control_channel.hpp"
#include "ddprun/agent/elastic.hpp"
#include "ddprun/agent/elastic_machine.hpp"
#include "ddprun/agent/failure.hpp"
#include "ddprun/agent/output.hpp"
#include "ddprun/agent/process.hpp"
#include "ddprun/agent/worker_group.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/shell.hpp"
#include "ddprun/common/strings.hpp"
#include "ddprun/rendezvous/rendezvous_client.hpp"
#include "ddprun/rendezvous/rendezvous_server.hpp"
#include "ddprun/rendezvous/store_server.hpp"
#include "ddprun/worker_env/gpus.hpp"
#include "ddprun/worker_env/nccl_id.hpp"
#include "ddprun/worker_env/numa.hpp"
#include "ddprun/worker_env/worker_env.hpp"

namespace asio = boost::asio;
namespace fs = std::filesystem;

namespace ddprun::agent {

namespace {

// How long a worker's pipes may stay open after the worker exited (a grandchild holding them)
// before the agent stops waiting for EOF.
constexpr std::chrono::milliseconds kDrainTimeout{1000};

std::vector<int> handled_signals(const AgentConfig& config) {
  if (!config.signals_to_handle.empty()) {
    return config.signals_to_handle;
  }
  return {SIGTERM, SIGINT, SIGHUP, SIGQUIT};
}

void validate(const AgentConfig& config) {
  if (config.worker_argv.empty()) {
    throw UsageError("no worker command given", "pass the training script or program after the ddprun options");
  }
  if (config.nproc_per_node <= 0) {
    throw UsageError("--nproc-per-node must be > 0, got " + std::to_string(config.nproc_per_node));
  }
  if (config.min_nodes < 1 || config.max_nodes < config.min_nodes) {
    throw UsageError("--nnodes " + std::to_string(config.min_nodes) + ":" + std::to_string(config.max_nodes) +
                     " is not a valid range", "use N or MIN:MAX with 0 < MIN <= MAX");
  }
  if (uses_elastic_path(config)) {
    rendezvous_endpoint(config);  // throws when missing
    const auto problem = job_config(config).validate();
    if (!problem.empty()) {
      throw UsageError("invalid rendezvous settings: " + problem, "check --nnodes, --max-restarts and --rdzv-conf");
    }
  } else if (config.max_nodes > 1) {
    throw UsageError("--standalone runs a single-node job but --nnodes allows " + std::to_string(config.max_nodes) +
                         " nodes",
                     "drop --standalone and use --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT for several nodes");
  } else if (config.node_rank != 0) {
    throw UsageError("--node-rank " + std::to_string(config.node_rank) + " is out of range for a single-node job",
                     "use --node-rank 0 with --nnodes 1");
  }
  if (config.max_restarts < 0) {
    throw UsageError("--max-restarts must be >= 0, got " + std::to_string(config.max_restarts));
  }
}

std::string sanitize(std::string_view s) {
  std::string out;
  for (char c : s) {
    out += (std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '-' || c == '_' || c == '.') ? c : '_';
  }
  return out.empty() ? std::string("none") : out;
}

std::string temp_base() {
  const char* t = std::getenv("TMPDIR");
  return (t != nullptr && *t != '\0') ? std::string(t) : std::string("/tmp");
}

// <log_dir>/<run_id>_<random> or $TMPDIR/ddprun-<run_id>_<random>, created fresh.
std::string make_job_dir(const AgentConfig& config) {
  std::string templ;
  if (config.log_dir) {
    std::error_code ec;
    fs::create_directories(*config.log_dir, ec);
    if (ec) {
      throw Error("cannot create --log-dir " + config.log_dir->string() + ": " + ec.message(),
                  "pick a writable directory");
    }
    templ = config.log_dir->string() + "/" + sanitize(config.run_id) + "_XXXXXX";
  } else {
    templ = temp_base() + "/ddprun-" + sanitize(config.run_id) + "_XXXXXX";
  }
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) {
    throw Error("cannot create the log directory " + templ + ": " + std::strerror(errno),
                config.log_dir ? "pick a writable --log-dir" : "set TMPDIR to a writable directory or pass --log-dir");
  }
  return std::string(buf.data());
}

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

std::string hostname() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) {
    return "localhost";
  }
  return buf;
}

std::vector<std::string> worker_args(const AgentConfig& config, int local_rank) {
  std::vector<std::string> argv = config.worker_argv;
  std::string arg;
  switch (config.local_rank_arg) {
    case AgentConfig::LocalRankArg::dash: arg = "--local-rank=" + std::to_string(local_rank); break;
    case AgentConfig::LocalRankArg::underscore: arg = "--local_rank=" + std::to_string(local_rank); break;
    case AgentConfig::LocalRankArg::none: return argv;
  }
  // Before the script's own arguments, as torch.distributed.launch puts it.
  const std::size_t at = std::min(config.user_args_index, argv.size());
  argv.insert(argv.begin() + static_cast<std::ptrdiff_t>(at), std::move(arg));
  return argv;
}

worker_env::Assignment base_assignment(const AgentConfig& config) {
  worker_env::Assignment a;
  a.role = config.role;
  a.local_world_size = config.nproc_per_node;
  a.group_rank = 0;
  a.group_world_size = 1;
  a.rank_offset = 0;
  a.world_size = config.nproc_per_node;
  a.master_addr = config.master_addr;
  a.master_port = config.master_port;
  a.max_restarts = config.max_restarts;
  a.run_id = config.run_id;
  a.use_agent_store = true;
  return a;
}

// The worker store binds the master address itself when it is numeric, else every interface
// (a name like "localhost" may resolve to several addresses).
std::string bind_host(const std::string& master_addr) {
  boost::system::error_code ec;
  std::string host = master_addr;
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  asio::ip::make_address(host, ec);
  return ec ? std::string("0.0.0.0") : host;
}

std::string read_error_message(const std::string& path) {
  if (path.empty()) {
    return {};
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return {};
  }
  std::stringstream ss;
  ss << in.rdbuf();
  const auto parsed = parse_error_file(ss.str());
  return parsed ? parsed->message : std::string();
}

// --nccl-roots: as given, else 1, or ceil(world_size / 256) above 256 ranks.
int nccl_roots(const AgentConfig& config, int world_size) {
  if (config.nccl_roots > 0) {
    return config.nccl_roots;
  }
  return world_size > 256 ? (world_size + 255) / 256 : 1;
}

// How long the holder may take to print its IDs (it only loads NCCL and asks it for IDs).
constexpr std::chrono::milliseconds kNcclHolderTimeout{30000};

struct WorkerProc {
  int local_rank = 0;
  int rank = 0;
  pid_t pid = -1;
  std::unique_ptr<asio::posix::stream_descriptor> exit_watch;  // owns the pidfd
  std::vector<std::unique_ptr<OutputPump>> pumps;
  int pumps_open = 0;
  bool exited = false;
  bool drained_reported = false;
  bool reaped = false;
  ExitStatus status;
  std::chrono::system_clock::time_point exit_time;
  std::string error_file;
  std::string note;  // spawn error, if any
  std::unique_ptr<asio::steady_timer> drain_timer;
};

class Agent {
 public:
  explicit Agent(const AgentConfig& config)
      : config_(config),
        elastic_(uses_elastic_path(config)),
        machine_(config.nproc_per_node, elastic_ ? 0 : config.max_restarts),
        signals_(io_),
        grace_timer_(io_),
        linger_timer_(io_),
        parent_env_(worker_env::current_environment()) {}

  ~Agent() {
    kill_and_reap_all();
    nccl_holder_.reset();  // its destructor ends the holder process
    client_.reset();
  }
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  int run() {
    const std::string cwd = config_.working_dir ? config_.working_dir->string() : std::string();
    const auto path_it = parent_env_.find("PATH");
    executable_ = resolve_executable(config_.worker_argv.front(),
                                     path_it == parent_env_.end() ? std::string() : path_it->second, cwd);
    if (config_.nproc_per_node > 1 && parent_env_.count("OMP_NUM_THREADS") == 0) {
      spdlog::warn(
          "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system "
          "being overloaded; tune it for optimal performance in your application as needed");
    }
    for (int r = 0; r < config_.nproc_per_node; ++r) {
      any_files_ = any_files_ || plan_routes(config_, r).needs_files();
    }
    job_dir_ = make_job_dir(config_);
    if (config_.log_dir || any_files_) {
      spdlog::info("log directory set to: {}", job_dir_);
    }
    if (!elastic_) {
      start_store();
      assignment_ = base_assignment(config_);
      assignment_.master_port = store_->port();
    }

    for (int sig : handled_signals(config_)) {
      boost::system::error_code ec;
      signals_.add(sig, ec);
      if (ec) {
        throw UsageError("cannot handle signal " + signal_name(sig) + ": " + ec.message(),
                         "remove it from --signals-to-handle");
      }
    }
    wait_signal();
    if (config_.control_fd >= 0) {
      start_control();
    }
    // Console writes to a closed pipe (ddprun ... | head) must not kill the agent: EPIPE is
    // handled where we write. Workers get SIGPIPE back to default in the child.
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;  // NOLINT
    ::sigaction(SIGPIPE, &ign, &old_sigpipe_);
    restore_sigpipe_ = true;

    if (elastic_) {
      start_elastic();
    } else {
      apply(machine_.start());
    }
    if (!finished_) {
      io_.run();
    }
    if (restore_sigpipe_) {
      ::sigaction(SIGPIPE, &old_sigpipe_, nullptr);
    }
    if (!config_.log_dir && !job_dir_.empty()) {
      // The default run directory under $TMPDIR: keep it only when it holds something worth
      // reading (log files, an error file a worker wrote); otherwise leave no litter behind.
      std::error_code ec;
      bool keep = false;
      if (exit_code_ != 0 || any_files_) {
        for (fs::recursive_directory_iterator it(job_dir_, ec), end; !ec && it != end; it.increment(ec)) {
          if (it->is_regular_file(ec)) {
            keep = true;
            break;
          }
        }
      }
      if (!keep) fs::remove_all(job_dir_, ec);
    }
    return exit_code_;
  }

 private:
  void start_store() {
    rendezvous::StoreServerOptions opts;
    opts.host = bind_host(config_.master_addr);
    opts.port = config_.standalone ? 0 : config_.master_port;
    try {
      store_ = std::make_unique<rendezvous::StoreServer>(io_, opts);
    } catch (const Error& e) {
      throw NetworkError("cannot host the worker store on " + opts.host + ":" + std::to_string(opts.port) + ": " +
                             e.message(),
                         "the master port is probably in use by another job: pass --master-port 0 (any free port) "
                         "or --standalone, or pick another --master-port");
    }
    store_->start();
    spdlog::debug("worker store listening on {}:{}", store_->host(), store_->port());
  }

  void wait_signal() {
    signals_.async_wait([this](const boost::system::error_code& ec, int sig) {
      if (ec || finished_) {
        return;
      }
      spdlog::warn("received {}: forwarding it to the workers", signal_name(sig));
      deliver_signal(sig);
      wait_signal();
    });
  }

  void deliver_signal(int sig) {
    if (elastic_) {
      on_elastic_signal(sig);
    } else {
      apply(machine_.on_signal(sig));
    }
  }

  // ---- the launcher's control channel (remote-agent mode; config.hpp) ----

  void start_control() {
    try {
      control_ = std::make_unique<asio::posix::stream_descriptor>(io_, config_.control_fd);
    } catch (const boost::system::system_error& e) {
      // e.g. a regular file (epoll refuses those): nothing to watch.
      ::close(config_.control_fd);
      spdlog::warn("cannot watch the launcher's control channel ({}); the launcher's end will go unnoticed",
                   e.code().message());
      return;
    }
    read_control();
  }

  void read_control() {
    control_->async_read_some(asio::buffer(control_buf_), [this](const boost::system::error_code& ec, std::size_t n) {
      if (finished_) {
        return;
      }
      if (ec) {
        on_launcher_gone(ec == asio::error::eof ? std::string("its connection closed") : ec.message());
        return;
      }
      const auto result = control_reader_.feed(std::string_view(control_buf_.data(), n));
      for (int sig : result.signals) {
        spdlog::warn("the launcher forwarded {}: forwarding it to the workers", signal_name(sig));
        deliver_signal(sig);
        if (finished_) {
          return;
        }
      }
      if (result.error && !control_error_reported_) {
        control_error_reported_ = true;
        // A launcher of another version, or garbage: stop trusting the channel, keep the workers.
        spdlog::error("{}; ignoring the launcher's control channel from now on (its end is still noticed)",
                      *result.error);
      }
      read_control();
    });
  }

  // The launcher (or the ssh connection to it) is gone: nobody would see this node's output or
  // stop it, so stop the workers as on SIGTERM (grace, then SIGKILL) and exit.
  void on_launcher_gone(const std::string& why) {
    spdlog::warn("the launcher is gone ({}): stopping the workers", why);
    deliver_signal(SIGTERM);
  }

  void apply(const Actions& actions) {
    for (const auto& a : actions) {
      switch (a.kind) {
        case Action::Kind::start_attempt: start_attempt(a.value); break;
        case Action::Kind::signal_groups: signal_groups(a.value); break;
        case Action::Kind::arm_grace: arm_grace(); break;
        case Action::Kind::cancel_grace: grace_timer_.cancel(); break;
        case Action::Kind::finish:
          if (elastic_) {
            on_group_done(a.value);
          } else {
            finish(a.value);
          }
          break;
      }
    }
  }

  void start_attempt(int restart_count) {
    if (elastic_) {
      kill_and_reap_all();
      workers_.clear();
      ++generation_;
      attempt_dir_ = job_dir_ + "/round_" + std::to_string(round_);
      make_dir(attempt_dir_);
      workers_.resize(static_cast<std::size_t>(config_.nproc_per_node));
      for (int r = 0; r < config_.nproc_per_node; ++r) {
        spawn_one(r);
      }
      return;
    }
    if (restart_count > 0) {
      const auto root = machine_.failures().back();
      spdlog::warn("restarting worker group (attempt {} of {}): local rank {} ended with {}", restart_count,
                   config_.max_restarts, root.local_rank, describe(root.status));
      store_->reset();  // a fresh, empty key space for the new attempt
    }
    kill_and_reap_all();
    workers_.clear();
    ++generation_;
    start_nccl_holder(nccl_roots(config_, assignment_.world_size));  // ends the previous attempt's holder first
    assignment_.restart_count = restart_count;
    attempt_dir_ = job_dir_ + "/attempt_" + std::to_string(restart_count);
    make_dir(attempt_dir_);
    workers_.resize(static_cast<std::size_t>(config_.nproc_per_node));
    for (int r = 0; r < config_.nproc_per_node; ++r) {
      spawn_one(r);
    }
  }

  void spawn_one(int local_rank) {
    auto& w = workers_[static_cast<std::size_t>(local_rank)];
    w.local_rank = local_rank;
    w.rank = assignment_.rank_offset + local_rank;
    const std::string rank_dir = attempt_dir_ + "/" + std::to_string(local_rank);
    make_dir(rank_dir);

    worker_env::EnvOptions opts;
    opts.python_worker = config_.python_worker;
    opts.error_file_dir = attempt_dir_;
    // The GPU plan implements --virtual-local-rank when there is one (docs/gpus.md).
    opts.virtual_local_rank = config_.virtual_local_rank && config_.gpu_env.empty();
    auto additions = worker_env::build_worker_env(assignment_, local_rank, opts, parent_env_);
    // Appended after build_worker_env's variables so that they win in merge_env.
    if (static_cast<std::size_t>(local_rank) < config_.gpu_env.size()) {
      const auto& gpu = config_.gpu_env[static_cast<std::size_t>(local_rank)];
      additions.insert(additions.end(), gpu.begin(), gpu.end());
    }
    if (elastic_) {
      // The round's IDs come from the group-rank-0 node's holder, through the assignment.
      additions.insert(additions.end(), round_nccl_env_.begin(), round_nccl_env_.end());
    } else if (nccl_holder_) {
      const auto nccl = nccl_holder_->worker_env();
      additions.insert(additions.end(), nccl.begin(), nccl.end());
    } else if (!comm_id_.empty()) {
      additions.emplace_back("NCCL_COMM_ID", comm_id_);  // --nccl-id comm-id, this attempt's port
    }
    for (const auto& [k, v] : additions) {
      if (k == "TORCHELASTIC_ERROR_FILE") {
        w.error_file = v;
      }
    }

    SpawnRequest req;
    req.path = executable_;
    req.argv = worker_args(config_, local_rank);
    req.envp = worker_env::merge_env(parent_env_, additions);
    if (config_.working_dir) {
      req.cwd = config_.working_dir->string();
    }

    // Output plumbing: child ends are closed here after the spawn, pump ends kept.
    // Planned per spawn: --ranks-filter depends on the global rank, known only now.
    const RankRoutes routes = plan_routes(config_, local_rank, w.rank);
    any_files_ = any_files_ || routes.needs_files();
    int child_fds[2] = {-1, -1};
    int pump_fds[2] = {-1, -1};
    int file_fds[2] = {-1, -1};
    const Route route[2] = {routes.out, routes.err};
    const char* names[2] = {"stdout.log", "stderr.log"};
    for (int s = 0; s < 2; ++s) {
      if (route[s] == Route::inherit) {
        continue;
      }
      if (route[s] != Route::prefixed) {
        file_fds[s] = open_log_file(rank_dir + "/" + names[s]);
      }
      if (route[s] == Route::file) {
        child_fds[s] = file_fds[s];
        file_fds[s] = -1;
        continue;
      }
      int p[2];
      if (::pipe2(p, O_CLOEXEC) != 0) {
        throw Error(std::string("pipe2 failed: ") + std::strerror(errno));
      }
      pump_fds[s] = p[0];
      child_fds[s] = p[1];
    }
    req.stdout_fd = child_fds[0];
    req.stderr_fd = child_fds[1];
    if (static_cast<std::size_t>(local_rank) < config_.cpu_binding.size()) {
      req.cpus = config_.cpu_binding[static_cast<std::size_t>(local_rank)];  // --numa-binding
    }

    const SpawnResult res = spawn_worker(req);
    if (res.affinity_error != 0) {
      spdlog::warn("local rank {}: --numa-binding {}: cannot bind to CPUs {}: {}; the worker runs unbound", local_rank,
                   config_.numa_binding, worker_env::format_cpu_list(req.cpus), std::strerror(res.affinity_error));
    }
    for (int fd : child_fds) {
      if (fd >= 0) {
        ::close(fd);
      }
    }
    w.pid = res.pid;
    if (!res.ok()) {
      w.note = "cannot start " + executable_ + ": " + (res.failed_step ? res.failed_step : "spawn") + ": " +
               std::strerror(res.error);
      spdlog::error("local rank {}: {}", local_rank, w.note);
    }
    const std::string prefix = expand_prefix(config_.log_line_prefix_template, config_.role, local_rank, w.rank);
    const unsigned gen = generation_;
    for (int s = 0; s < 2; ++s) {
      if (pump_fds[s] < 0) {
        continue;
      }
      ++w.pumps_open;
      w.pumps.push_back(std::make_unique<OutputPump>(io_, pump_fds[s], file_fds[s], s == 0 ? STDOUT_FILENO : STDERR_FILENO,
                                                     prefix, [this, gen, local_rank] { on_pump_done(gen, local_rank); }));
      w.pumps.back()->start();
    }
    if (res.pid < 0) {
      // Never started: report it as exit 127 (the shell's "cannot execute"), after this spawn loop.
      asio::post(io_, [this, gen, local_rank] {
        if (gen != generation_) {
          return;
        }
        auto& wk = workers_[static_cast<std::size_t>(local_rank)];
        wk.reaped = true;
        on_exit_status(local_rank, ExitStatus::exited(127));
      });
      return;
    }
    w.exit_watch = std::make_unique<asio::posix::stream_descriptor>(io_, res.pidfd);
    watch_exit(gen, local_rank);
  }

  void watch_exit(unsigned gen, int local_rank) {
    auto& w = workers_[static_cast<std::size_t>(local_rank)];
    w.exit_watch->async_wait(asio::posix::stream_descriptor::wait_read,
                             [this, gen, local_rank](const boost::system::error_code& ec) {
                               if (ec || gen != generation_) {
                                 return;
                               }
                               auto& wk = workers_[static_cast<std::size_t>(local_rank)];
                               const auto status = peek_exit(wk.pid);
                               if (!status) {
                                 watch_exit(gen, local_rank);  // spurious wake-up
                                 return;
                               }
                               on_exit_status(local_rank, *status);
                             });
  }

  void on_exit_status(int local_rank, ExitStatus status) {
    auto& w = workers_[static_cast<std::size_t>(local_rank)];
    w.exited = true;
    w.status = status;
    w.exit_time = std::chrono::system_clock::now();
    if (!status.ok()) {
      spdlog::log(machine_.state() == GroupState::healthy ? spdlog::level::err : spdlog::level::debug,
                  "local rank {} (rank {}, pid {}) ended with {}", local_rank, w.rank, w.pid, describe(status));
    }
    const bool was_healthy = machine_.state() == GroupState::healthy;
    apply(machine_.on_exited(local_rank, status));
    if (elastic_ && was_healthy && !status.ok() && !finished_) {
      // The first local failure ends the round for every node: the rendezvous decides whether
      // that is a restart or the end of the job.
      pending_failure_ = make_failure(round_, node_id_, w.rank, local_rank, status, read_error_message(w.error_file));
      apply_elastic(emachine_.on_local_failure());
    }
    if (finished_ || w.drained_reported) {
      return;
    }
    if (w.pumps_open == 0) {
      report_drained(local_rank);
      return;
    }
    // Usually EOF follows right away; a grandchild holding the pipe must not hold the agent.
    const unsigned gen = generation_;
    w.drain_timer = std::make_unique<asio::steady_timer>(io_, kDrainTimeout);
    w.drain_timer->async_wait([this, gen, local_rank](const boost::system::error_code& ec) {
      if (ec || gen != generation_) {
        return;
      }
      auto& wk = workers_[static_cast<std::size_t>(local_rank)];
      spdlog::debug("local rank {}: output still open {} ms after exit; closing it", local_rank,
                    kDrainTimeout.count());
      for (auto& p : wk.pumps) {
        p->finish_now();
      }
    });
  }

  void on_pump_done(unsigned gen, int local_rank) {
    if (gen != generation_) {
      return;
    }
    auto& w = workers_[static_cast<std::size_t>(local_rank)];
    --w.pumps_open;
    if (w.pumps_open == 0 && w.exited) {
      if (w.drain_timer) {
        w.drain_timer->cancel();
      }
      report_drained(local_rank);
    }
  }

  void report_drained(int local_rank) {
    auto& w = workers_[static_cast<std::size_t>(local_rank)];
    if (w.drained_reported || finished_) {
      return;
    }
    w.drained_reported = true;
    apply(machine_.on_drained(local_rank));
  }

  void signal_groups(int sig) {
    if (sig == SIGKILL && machine_.state() == GroupState::stopping) {
      for (const auto& w : workers_) {
        if (w.pid > 0 && !w.exited) {
          spdlog::warn("local rank {} (pid {}) did not stop within {} ms: sending SIGKILL", w.local_rank, w.pid,
                       config_.shutdown_timeout.count());
        }
      }
    }
    for (const auto& w : workers_) {
      // Exited workers are zombies until reaped, so their process-group id cannot have been
      // reused: signalling it reaches only what is left of that worker's group.
      if (w.pid > 0 && !w.reaped) {
        signal_group(w.pid, sig);
      }
    }
  }

  void arm_grace() {
    grace_timer_.expires_after(config_.shutdown_timeout);
    grace_timer_.async_wait([this](const boost::system::error_code& ec) {
      if (ec || finished_) {
        return;
      }
      apply(machine_.on_grace_expired());
    });
  }

  void finish(int code) {
    if (finished_) {
      return;
    }
    finished_ = true;
    exit_code_ = code;
    nccl_holder_.reset();  // the attempt is over: end its NCCL bootstrap roots
    if (elastic_) {
      // Print nothing here: the rendezvous' result (job failed) was printed when it arrived.
    } else if (machine_.state() == GroupState::failed) {
      print_summary();
    } else if (machine_.state() == GroupState::interrupted) {
      spdlog::warn("workers stopped after a signal; exiting with {}", code);
    }
    kill_and_reap_all();
    boost::system::error_code ignored;
    signals_.cancel(ignored);
    signals_.clear(ignored);
    grace_timer_.cancel();
    if (store_) {
      store_->stop();
    }
    if (client_) {
      client_->stop();
    }
    if (host_server_) {
      linger_host();
      return;
    }
    io_.stop();
  }

  // ---- elastic path ----

  // An agent that hosts the rendezvous keeps serving for a moment after its own result so the
  // pushes to the other agents are written and they can disconnect; bounded by kHostLinger.
  // The store server reports when its last connection closed (on_drained); kHostLinger bounds
  // the wait for peers that do not disconnect.
  static constexpr std::chrono::milliseconds kHostLinger{3000};

  void linger_host() {
    linger_timer_.expires_after(kHostLinger);
    linger_timer_.async_wait([this](const boost::system::error_code& ec) {
      if (ec) {
        return;  // cancelled: the peers are gone
      }
      spdlog::debug("rendezvous peers still connected {} ms after the job ended; stopping anyway",
                    kHostLinger.count());
      stop_host();
    });
    host_server_->on_drained([this] {
      linger_timer_.cancel();
      stop_host();
    });
  }

  void stop_host() {
    if (host_stopped_) {
      return;
    }
    host_stopped_ = true;
    host_server_->stop();
    io_.stop();
  }

  // One holder per attempt (single node) or per join (elastic): stops the previous one (its
  // bootstrap roots belong to workers that are gone), then starts a fresh one with `roots` IDs
  // unless --nccl-id off or NCCL was found missing before.
  void start_nccl_holder(int roots) {
    if (nccl_holder_) {
      nccl_holder_->stop();
      nccl_holder_.reset();
    }
    if (config_.nccl_id == AgentConfig::NcclIdMode::comm_id) {
      // No holder: rank 0's ncclCommInitRank hosts the root on this address (elastic: this
      // node's advertised address, used only when it gets group rank 0). A new port each time.
      comm_id_ = worker_env::pick_nccl_comm_id(elastic_ ? node_id_.addr : assignment_.master_addr, comm_id_);
      spdlog::debug("--nccl-id comm-id: NCCL_COMM_ID={}", comm_id_);
      return;
    }
    if (config_.nccl_id == AgentConfig::NcclIdMode::off || nccl_unavailable_) {
      return;
    }
    const bool required = config_.nccl_id == AgentConfig::NcclIdMode::env;
    if (!required) {
      // auto: an ID is only worth its ~5 ms (holder start) when a worker could use NCCL.
      std::string why;
      if (!worker_env::nvidia_gpu_visible(worker_env::current_environment(), "", &why)) {
        nccl_unavailable_ = true;
        spdlog::info("--nccl-id auto: not exporting DDPRUN_NCCL_UNIQUE_ID: {} (--nccl-id env forces it)", why);
        return;
      }
    }
    const std::string binary =
        config_.nccl_id_holder.empty() ? worker_env::default_nccl_id_holder_path() : config_.nccl_id_holder;
    try {
      if (binary.empty() || ::access(binary.c_str(), X_OK) != 0) {
        throw worker_env::NcclUnavailable("the holder program ddprun-nccl-id was not found next to ddprun" +
                                          (binary.empty() ? std::string() : " (" + binary + ")"));
      }
      nccl_holder_ = worker_env::NcclIdHolder::start(binary, roots, kNcclHolderTimeout);
      spdlog::debug("NCCL unique ID holder running (pid {}, {} root(s))", nccl_holder_->pid(),
                    nccl_holder_->ids().size());
    } catch (const worker_env::NcclUnavailable& e) {
      if (required) {
        throw Error("--nccl-id env: cannot create an NCCL unique ID: " + e.message(),
                    "install NCCL (libnccl.so.2) or set DDPRUN_NCCL_LIBRARY, or use --nccl-id auto/off");
      }
      nccl_unavailable_ = true;
      spdlog::info("--nccl-id auto: not exporting DDPRUN_NCCL_UNIQUE_ID: {}", e.message());
    }
  }

  // Elastic jobs: every node starts a holder before each join and offers its IDs in NodeInfo;
  // the rendezvous hands the group-rank-0 node's IDs to every node in the assignment, and the
  // other nodes stop their holders (begin_round). The world size is unknown before the round
  // closes, so a node offers roots for the largest world the job allows (nccl_roots_to_offer)
  // and each round's workers use as many as its world needs (set_round_nccl).
  int elastic_nccl_roots() const { return nccl_roots_to_offer(config_); }

  std::vector<std::uint8_t> nccl_holder_bytes() const {
    std::vector<std::uint8_t> out;
    if (config_.nccl_id == AgentConfig::NcclIdMode::comm_id) {
      return worker_env::encode_comm_id_offer(comm_id_);  // "addr:port" offered in place of unique IDs
    }
    if (nccl_holder_) {
      for (const auto& id : nccl_holder_->ids()) out.insert(out.end(), id.begin(), id.end());
    }
    return out;
  }

  void start_elastic() {
    const Endpoint endpoint = rendezvous_endpoint(config_);
    const std::string addr = advertised_address(config_, endpoint);
    node_id_ = rendezvous::NodeId{addr, static_cast<std::int64_t>(::getpid()), random_instance_id()};

    // This node's worker store: MASTER_ADDR/PORT for every worker when this node gets group rank 0.
    rendezvous::StoreServerOptions store_opts;
    store_opts.host = bind_host(addr);
    store_opts.port = 0;
    try {
      store_ = std::make_unique<rendezvous::StoreServer>(io_, store_opts);
    } catch (const Error& e) {
      throw NetworkError("cannot host the worker store on " + store_opts.host + ": " + e.message(),
                         "pass --local-addr with an address of this machine");
    }
    store_->start();

    if (is_static_multi_node(config_)) {
      if (may_host(config_, endpoint, addr)) {
        try_host(endpoint);
      }
    } else if (may_host(config_, endpoint, addr) && !tcp_connects(endpoint, kProbeTimeout)) {
      try_host(endpoint);
    }

    rendezvous::RendezvousClientOptions opts;
    opts.server = endpoint;
    opts.run_id = config_.run_id;
    opts.token = config_.rdzv.token;
    opts.node.id = node_id_;
    opts.node.addr = addr;
    opts.node.local_world_size = config_.nproc_per_node;
    opts.node.store_host = addr;
    opts.node.store_port = store_->port();
    start_nccl_holder(elastic_nccl_roots());
    opts.node.nccl_ids = nccl_holder_bytes();
    opts.config = job_config(config_);
    // static: the other nodes may start long before node rank 0 serves (torchrun waits as long).
    opts.give_up_after = is_static_multi_node(config_) ? std::max(config_.rdzv.read_timeout, config_.rdzv.join_timeout)
                                                       : config_.rdzv.read_timeout;

    rendezvous::RendezvousEvents ev;
    ev.on_assignment = [this](const rendezvous::Assignment& a) { on_assignment(a); };
    ev.on_restart = [this](const rendezvous::SendRestart& r) { on_restart(r); };
    ev.on_job_failed = [this](const rendezvous::SendJobFailed& f) { on_job_failed(f); };
    ev.on_job_completed = [this] { on_job_completed(); };
    ev.on_refused = [this, endpoint](const std::string& reason) {
      write_all(STDERR_FILENO, "ddprun: error: the rendezvous at " + endpoint.to_string() + " refused this node: " +
                                   reason + "\n");
      exit_elastic(1);
    };
    ev.on_progress = [this](const std::string& text) {
      if (text != last_progress_) {
        last_progress_ = text;
        spdlog::info("{}", text);
      }
    };
    ev.on_unreachable = [this](const std::string& error) {
      write_all(STDERR_FILENO, "ddprun: error: " + error + "\n");
      exit_elastic(1);
    };
    spdlog::info("node {} joining rendezvous '{}' at {} ({} worker(s), nnodes {}:{})", addr, config_.run_id,
                 endpoint.to_string(), config_.nproc_per_node, config_.min_nodes, config_.max_nodes);
    client_ = std::make_unique<rendezvous::RendezvousClient>(io_, std::move(opts), std::move(ev));
    client_->join();
  }

  // How long to wait for an answer before deciding that nobody serves the endpoint yet.
  static constexpr std::chrono::milliseconds kProbeTimeout{500};

  void try_host(const Endpoint& endpoint) {
    rendezvous::RendezvousServerOptions opts;
    opts.host = bind_host(endpoint.host);
    opts.port = endpoint.port;
    opts.token = config_.rdzv.token;
    try {
      host_server_ = std::make_unique<rendezvous::RendezvousServer>(io_, opts);
    } catch (const Error& e) {
      // Another agent on this machine may have just bound it: join that one.
      spdlog::info("not hosting the rendezvous at {} ({}); joining it as a client", endpoint.to_string(), e.message());
      return;
    }
    host_server_->start();
    spdlog::info("no rendezvous server answered at {}: this agent hosts it", endpoint.to_string());
  }

  void on_assignment(const rendezvous::Assignment& a) {
    if (finished_ || emachine_.state() == ElasticState::done) {
      return;
    }
    if (is_static_multi_node(config_)) {
      // torchrun's static backend: the group rank is --node-rank and every node runs nproc workers.
      const int expected = config_.max_nodes * config_.nproc_per_node;
      if (a.world_size != expected || a.group_world_size != config_.max_nodes) {
        write_all(STDERR_FILENO, "ddprun: error: static rendezvous: the nodes disagree on the world size (" +
                                     std::to_string(a.world_size) + " workers on " + std::to_string(a.group_world_size) +
                                     " nodes, this node expects " + std::to_string(expected) +
                                     "); use the same --nproc-per-node and --nnodes on every node\n");
        apply_elastic(emachine_.on_result(1));
        return;
      }
    }
    latest_assignment_ = a;
    apply_elastic(emachine_.on_assignment());
  }

  // Applies the elastic machine's decisions (elastic_machine.hpp).
  void apply_elastic(const ElasticActions& actions) {
    for (const auto& a : actions) {
      switch (a.kind) {
        case ElasticAction::Kind::start_workers: begin_round(*latest_assignment_); break;
        case ElasticAction::Kind::stop_workers: stop_group(); break;
        case ElasticAction::Kind::forward_signal: apply(machine_.on_signal(a.value)); break;
        case ElasticAction::Kind::report_failure:
          if (pending_failure_) {
            client_->report_failure(*pending_failure_);
          }
          break;
        case ElasticAction::Kind::report_success:
          spdlog::info("all {} local worker(s) succeeded; waiting for the other nodes (exit barrier, at most {} s)",
                       config_.nproc_per_node,
                       std::chrono::duration<double>(config_.rdzv.exit_barrier_timeout).count());
          client_->report_success(round_);
          break;
        case ElasticAction::Kind::rejoin:
          store_->reset();  // a fresh key space for the next round's workers
          round_nccl_env_.clear();
          start_nccl_holder(elastic_nccl_roots());  // fresh IDs for the next round
          client_->set_nccl_ids(nccl_holder_bytes());
          client_->join();
          break;
        case ElasticAction::Kind::leave:
          spdlog::warn("workers stopped after a signal; leaving the rendezvous");
          client_->leave();
          break;
        case ElasticAction::Kind::exit: finish(a.value); break;
      }
    }
  }

  void begin_round(const rendezvous::Assignment& a) {
    round_ = a.round;
    assignment_ = base_assignment(config_);
    assignment_.local_world_size = a.local_world_size;
    assignment_.group_rank = a.group_rank;
    assignment_.group_world_size = a.group_world_size;
    assignment_.rank_offset = a.rank_offset;
    assignment_.world_size = a.world_size;
    assignment_.master_addr = a.master_addr;
    assignment_.master_port = a.master_port;
    assignment_.restart_count = a.restart_count;
    assignment_.max_restarts = a.max_restarts;
    if (is_static_multi_node(config_)) {
      assignment_.group_rank = config_.node_rank;
      assignment_.rank_offset = config_.node_rank * config_.nproc_per_node;
    }
    assignment_.nccl_unique_id_hex.reset();
    set_round_nccl(a);
    spdlog::info("round {}: group rank {} of {} nodes, ranks {}..{} of {}, master {}:{}, restart count {}/{}", a.round,
                 assignment_.group_rank, a.group_world_size, assignment_.rank_offset,
                 assignment_.rank_offset + a.local_world_size - 1, a.world_size, a.master_addr, a.master_port,
                 a.restart_count, a.max_restarts);
    last_progress_.clear();
    pending_failure_.reset();
    machine_ = WorkerGroupMachine(config_.nproc_per_node, 0);
    apply(machine_.start());
  }

  // The round's NCCL IDs are the group-rank-0 node's (rendezvous_state.hpp). Only that node's
  // holder serves the bootstrap root; the others stop theirs now. Rank 0 keeps its holder until
  // the round ends (next rejoin, or the end of the job).
  void set_round_nccl(const rendezvous::Assignment& a) {
    round_nccl_env_.clear();
    if (nccl_holder_ && (a.group_rank != 0 || a.nccl_id != nccl_holder_bytes())) {
      nccl_holder_->stop();
      nccl_holder_.reset();
      client_->set_nccl_ids({});
    }
    if (a.nccl_id.empty()) {
      return;
    }
    if (config_.nccl_id == AgentConfig::NcclIdMode::comm_id) {
      if (const auto value = worker_env::decode_comm_id_offer(a.nccl_id)) {
        round_nccl_env_.emplace_back("NCCL_COMM_ID", *value);
      } else {
        spdlog::warn("round {}: --nccl-id comm-id, but the group-rank-0 node offered NCCL unique IDs, not an "
                     "address; NCCL_COMM_ID is not set (use the same --nccl-id on every node)",
                     a.round);
      }
      return;
    }
    if (a.nccl_id.size() % worker_env::nccl_unique_id_bytes != 0) {
      spdlog::warn("round {}: the assignment's NCCL ID has {} bytes, not a multiple of {}; DDPRUN_NCCL_UNIQUE_ID is "
                   "not set",
                   a.round, a.nccl_id.size(), worker_env::nccl_unique_id_bytes);
      return;
    }
    std::vector<std::string> hex;
    for (std::size_t at = 0; at < a.nccl_id.size(); at += worker_env::nccl_unique_id_bytes) {
      worker_env::NcclUniqueId id{};
      std::copy_n(a.nccl_id.begin() + static_cast<std::ptrdiff_t>(at), id.size(), id.begin());
      hex.push_back(worker_env::encode_nccl_id(id));
    }
    const std::size_t wanted =
        config_.nccl_roots > 0 ? hex.size() : static_cast<std::size_t>(nccl_roots(config_, a.world_size));
    hex.resize(nccl_roots_for_round(config_, a.world_size, hex.size()));
    if (hex.size() < wanted) {
      spdlog::warn("round {}: {} ranks would use {} NCCL roots but the group-rank-0 node offered {}", a.round,
                   a.world_size, wanted, hex.size());
    }
    round_nccl_env_.emplace_back("DDPRUN_NCCL_UNIQUE_ID", hex.front());
    if (hex.size() > 1) {
      std::string all;
      for (const auto& h : hex) all += (all.empty() ? "" : ",") + h;
      round_nccl_env_.emplace_back("DDPRUN_NCCL_UNIQUE_IDS", std::move(all));
    }
  }

  void on_restart(const rendezvous::SendRestart& r) {
    if (finished_ || emachine_.state() == ElasticState::done) {
      return;
    }
    spdlog::warn("round {} ended ({}): {}; all nodes restart together (restarts used {}/{})", r.ended_round,
                 r.kind == rendezvous::RoundEnd::worker_failure ? "worker failure" : "membership change", r.reason,
                 r.restart_count, config_.max_restarts);
    apply_elastic(emachine_.on_restart());
  }

  void on_job_failed(const rendezvous::SendJobFailed& f) {
    if (finished_ || emachine_.state() == ElasticState::done) {
      return;
    }
    if (config_.node_label.empty() || !f.root_cause || f.root_cause->failure.node == node_id_) {
      write_all(STDERR_FILENO, format_job_failed(f, config_.worker_argv.front()));
    } else {
      // A fan-out launch shows every host's output in one terminal: one summary is enough, the
      // failing worker's node prints it.
      spdlog::error("job '{}' failed: {}", config_.run_id, f.root_cause->describe());
    }
    apply_elastic(emachine_.on_result(f.exit_code));
  }

  void on_job_completed() {
    if (finished_ || emachine_.state() == ElasticState::done) {
      return;
    }
    spdlog::info("job '{}' completed on every node", config_.run_id);
    apply_elastic(emachine_.on_result(0));
  }

  void on_elastic_signal(int sig) { apply_elastic(emachine_.on_signal(sig)); }

  // Refused / unreachable: stop the workers (if any) and exit 1 once they are gone.
  void exit_elastic(int code) {
    if (finished_ || emachine_.state() == ElasticState::done) {
      return;
    }
    apply_elastic(emachine_.on_result(code));
  }

  void stop_group() {
    if (machine_.state() == GroupState::healthy) {
      apply(machine_.on_signal(SIGTERM));
    }
  }

  // The worker group machine reached a terminal state: every local worker is done.
  void on_group_done(int code) {
    kill_and_reap_all();
    const bool ok = machine_.state() == GroupState::succeeded;
    if (!ok && emachine_.state() == ElasticState::running) {
      spdlog::info("local workers stopped after a failure (exit {}); waiting for the rendezvous' decision", code);
    }
    apply_elastic(emachine_.on_group_done(ok));
  }

  void print_summary() {
    const auto root = machine_.root_cause();
    if (!root) {
      return;
    }
    const auto& w = workers_[static_cast<std::size_t>(root->local_rank)];
    FailureReport report;
    report.local_rank = w.local_rank;
    report.rank = w.rank;
    report.pid = w.pid;
    report.status = root->status;
    report.time = w.exit_time;
    report.error_file = w.error_file;
    report.note = w.note;
    if (!w.error_file.empty()) {
      std::ifstream in(w.error_file, std::ios::binary);
      if (in) {
        std::stringstream ss;
        ss << in.rdbuf();
        std::string problem;
        report.error = parse_error_file(ss.str(), &problem);
        if (!report.error) {
          report.note += (report.note.empty() ? "" : "; ") + std::string("error file ") + w.error_file +
                         " could not be used: " + problem;
        }
      }
    }
    const std::string text = format_failure_summary(config_.worker_argv.front(), hostname(), report, {});
    write_all(STDERR_FILENO, text);
  }

  void kill_and_reap_all() {
    for (auto& w : workers_) {
      if (w.pid <= 0 || w.reaped) {
        continue;
      }
      if (!w.exited) {
        // Only on an exception path or an unexpected end: never leave a worker behind.
        signal_group(w.pid, SIGKILL);
      }
      reap(w.pid, -1);  // the pidfd belongs to exit_watch
      w.reaped = true;
    }
  }

  const AgentConfig& config_;
  const bool elastic_;
  asio::io_context io_{1};
  WorkerGroupMachine machine_;
  asio::signal_set signals_;
  asio::steady_timer grace_timer_;
  asio::steady_timer linger_timer_;
  bool host_stopped_ = false;
  worker_env::EnvMap parent_env_;
  worker_env::Assignment assignment_;
  std::unique_ptr<rendezvous::StoreServer> store_;
  std::string executable_;
  std::string job_dir_;
  std::string attempt_dir_;
  bool any_files_ = false;
  std::vector<WorkerProc> workers_;
  unsigned generation_ = 0;
  bool finished_ = false;
  int exit_code_ = 1;
  // elastic path
  rendezvous::NodeId node_id_;
  std::unique_ptr<rendezvous::RendezvousServer> host_server_;
  std::unique_ptr<rendezvous::RendezvousClient> client_;
  std::uint64_t round_ = 0;
  ElasticMachine emachine_;
  std::optional<rendezvous::Assignment> latest_assignment_;
  std::optional<rendezvous::WorkerFailure> pending_failure_;
  std::string last_progress_;
  // remote-agent mode: the launcher's control channel
  std::unique_ptr<asio::posix::stream_descriptor> control_;
  std::array<char, 256> control_buf_{};
  ControlReader control_reader_;
  bool control_error_reported_ = false;
  struct sigaction old_sigpipe_ {};
  bool restore_sigpipe_ = false;
  std::optional<worker_env::NcclIdHolder> nccl_holder_;  // this attempt's NCCL bootstrap roots
  bool nccl_unavailable_ = false;                        // --nccl-id auto: said once, skip after
  worker_env::EnvList round_nccl_env_;                   // elastic: the round's NCCL ID variables
  std::string comm_id_;                                  // --nccl-id comm-id: this attempt's/join's host:port
};

}  // namespace

int run_agent(const AgentConfig& config) {
  validate(config);
  Agent agent(config);
  return agent.run();
}

void print_dry_run(const AgentConfig& config, std::ostream& out) {
  validate(config);
  const auto parent = worker_env::current_environment();
  auto assignment = base_assignment(config);
  const bool port_at_launch = config.standalone || config.master_port == 0;
  const std::string job_dir = config.log_dir ? config.log_dir->string() + "/" + sanitize(config.run_id) + "_<random>"
                                             : temp_base() + "/ddprun-" + sanitize(config.run_id) + "_<random>";
  worker_env::EnvOptions opts;
  opts.python_worker = config.python_worker;
  opts.error_file_dir = job_dir + "/attempt_0";
  opts.virtual_local_rank = config.virtual_local_rank && config.gpu_env.empty();
  const std::string cwd = config.working_dir ? config.working_dir->string() : fs::current_path().string();
  out << "ddprun dry run: " << config.nproc_per_node << " worker(s) on this node; nothing is started\n";
  if (!config.gpu_summary.empty()) {
    out << "gpus: " << config.gpu_summary << '\n';
  }
  if (uses_elastic_path(config)) {
    out << "elastic job '" << config.run_id << "': rendezvous at " << config.rdzv_endpoint << ", nnodes "
        << config.min_nodes << ":" << config.max_nodes
        << "; RANK, WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT below are placeholders assigned per round\n";
  }
  for (int r = 0; r < config.nproc_per_node; ++r) {
    out << "local rank " << r << ":\n  argv:";
    for (const auto& a : worker_args(config, r)) {
      out << ' ' << shell_quote(a);
    }
    out << "\n  cwd: " << cwd << '\n';
    if (static_cast<std::size_t>(r) < config.gpu_devices.size()) {
      out << "  device: " << config.gpu_devices[static_cast<std::size_t>(r)] << '\n';
    }
    if (static_cast<std::size_t>(r) < config.cpu_binding.size()) {
      out << "  cpus: " << worker_env::format_cpu_list(config.cpu_binding[static_cast<std::size_t>(r)])
          << " (--numa-binding " << config.numa_binding << ")\n";
    }
    out << "  env:\n";
    auto env = worker_env::build_worker_env(assignment, r, opts, parent);
    if (static_cast<std::size_t>(r) < config.gpu_env.size()) {
      // The plan's variables win (as in merge_env): replace or add them, keep the order sorted.
      for (const auto& [k, v] : config.gpu_env[static_cast<std::size_t>(r)]) {
        auto it = std::find_if(env.begin(), env.end(), [&](const auto& kv) { return kv.first == k; });
        if (it != env.end()) {
          it->second = v;
        } else {
          env.emplace_back(k, v);
        }
      }
      std::sort(env.begin(), env.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
    }
    if (config.nccl_id == AgentConfig::NcclIdMode::comm_id) {
      env.emplace_back("NCCL_COMM_ID", (uses_elastic_path(config) ? std::string("<group-rank-0 node's address>")
                                                                   : config.master_addr) +
                                           ":<port chosen per attempt>");
      std::sort(env.begin(), env.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
    }
    for (const auto& [k, v] : env) {
      out << "    " << k << '=' << ((k == "MASTER_PORT" && port_at_launch) ? std::string("<chosen at launch>") : v)
          << '\n';
    }
    const auto routes = plan_routes(config, r, config.ranks_filter ? std::optional<int>(r) : std::nullopt);
    auto describe_route = [](Route route) {
      switch (route) {
        case Route::inherit: return "console";
        case Route::file: return "file only";
        case Route::tee: return "file and console (prefixed)";
        case Route::prefixed: return "console (prefixed)";
      }
      return "?";
    };
    out << "  stdout: " << describe_route(routes.out) << "\n  stderr: " << describe_route(routes.err) << '\n';
  }
}

}  // namespace ddprun::agent
