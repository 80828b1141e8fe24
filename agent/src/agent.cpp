// The agent shell: owns the io_context, the signal handling, the launcher's control channel
// (remote-agent mode) and the job's log directory, and drives every mode the same way:
//
//   RendezvousBackend (rendezvous_backend.hpp)  --events-->  Agent  --actions-->  WorkerRun
//            ^                                     |  ElasticMachine decides       (worker_run.hpp)
//            +------ next round / report / leave --+  NcclIdOwner prepares IDs
//
// Each round the backend hands out an assignment; the agent starts its workers (WorkerRun, with
// worker_spec() per rank), reports the first local failure (or success) to the backend and obeys
// what the backend pushes: restart (stop the workers, next round), job failed (stop, exit with
// its code), job completed (exit 0), refused / unreachable (stop, exit 1). The round decisions
// are ElasticMachine's (elastic_machine.hpp); which backend answers (single node, c10d, static)
// was decided once from the job mode.
//
// One thread (the caller's) runs the io_context; every callback below runs on it. Nothing
// polls: worker exits arrive through pidfds, output through pipes, signals through a
// signal_set, deadlines through steady_timers.
#include "ddprun/agent/agent.hpp"

#include <sys/syscall.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/signal_set.hpp>
#include <array>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string_view>
#include <spdlog/spdlog.h>

#include "ddprun/common/console.hpp"
#include "ddprun/agent/agent_metrics.hpp"
#include "ddprun/agent/containment.hpp"
#include "ddprun/agent/diagnosis.hpp"
#include "ddprun/agent/elastic.hpp"
#include "ddprun/agent/elastic_machine.hpp"
#include "ddprun/agent/entrypoint.hpp"
#include "ddprun/agent/event_log.hpp"
#include "ddprun/agent/file_timer.hpp"
#include "ddprun/agent/health_endpoint.hpp"
#include "ddprun/agent/job_dir.hpp"
#include "ddprun/agent/nccl_ids.hpp"
#include "ddprun/agent/output.hpp"
#include "ddprun/agent/process.hpp"
#include "ddprun/agent/remote_protocol.hpp"
#include "ddprun/agent/rendezvous_backend.hpp"
#include "ddprun/agent/worker_run.hpp"
#include "ddprun/agent/worker_spec.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/worker_env/worker_env.hpp"

namespace asio = boost::asio;
namespace fs = std::filesystem;

namespace ddprun::agent {

namespace {

// The environment the workers inherit: ours without the rendezvous token (the agent has
// already read it into its config; a worker must not be able to impersonate its node), and
// with the LC_CTYPE a Python launcher such as torchrun would have coerced a "C" locale to.
worker_env::EnvMap workers_parent_env() {
  worker_env::EnvMap env = worker_env::current_environment();
  env.erase("DDPRUN_RDZV_TOKEN");
  if (auto ctype = worker_env::python_coerced_lc_ctype(env, worker_env::ctype_locale_available)) {
    env["LC_CTYPE"] = std::move(*ctype);
  }
  return env;
}

class Agent {
 public:
  explicit Agent(const AgentConfig& config)
      : config_(config),
        signals_(io_),
        parent_env_(workers_parent_env()),
        run_(io_, config, worker_hooks()),
        backend_(make_rendezvous_backend(io_, config, backend_events())),
        event_log_(config.event_log) {}

  ~Agent() {
    run_.kill_and_reap_all();
    if (nccl_) nccl_->stop();  // ends the holder process
    backend_.reset();
    if (!job_dir_settled_) {
      // The run ended by an error (a failed handshake, a bad flag found late): the run directory
      // goes unless it holds something, as at a normal end.
      try {
        remove_job_dir_unless_useful(config_, job_dir_, true);
      } catch (const std::exception&) {  // (allocation): nothing more to do on the way out
      }
    }
  }
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  int run() {
    // The first round's NCCL holder loads NCCL while the agent sets up (docs/gpus.md).
    nccl_.emplace(config_, std::string());
    nccl_->prestart();
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
    const bool python = config_.python_worker || may_run_python(executable_, config_.worker_argv);
    // Native ranks without log files: one directory for the job, not N + 2 (job_dir.hpp).
    flat_dirs_ = !rank_dirs_needed(config_, any_files_, python);
    // Before any thread exists: containment starts its watchdog. Before the run directory, too:
    // should the agent be killed, the watchdog removes that with the job unless it holds
    // something, and the window in which a directory exists but the watchdog does not know it is
    // one system call wide.
    containment_ =
        Containment::create(parse_containment_mode(config_.containment), config_.nproc_per_node, config_.rank_memory);
    job_dir_ = make_job_dir(config_);
    if (!config_.log_dir) containment_->clean_up_when_gone(job_dir_);
    if (config_.log_dir || any_files_) {
      spdlog::info("log directory set to: {}", job_dir_);
    }
    // The faulthandler hook only serves Python ranks: a native worker (/bin/true, a compiled
    // trainer) gets its stacks from eu-stack and is spared the hook's files.
    const bool hook = config_.stacks && python;
    run_.set_diagnostics(containment_.get(), hook ? install_python_hook(job_dir_) : std::string());
    if (flat_dirs_) run_.set_lazy_dirs(job_dir_);

    // Before the backend joins anything: a metrics port that cannot be bound stops the agent
    // before it takes a place in a round.
    metrics_ = std::make_unique<AgentMetrics>(io_, config_, run_);

    for (int sig : handled_signals(config_)) {
      boost::system::error_code ec;
      signals_.add(sig, ec);
      if (ec) {
        throw UsageError("cannot handle signal " + signal_name(sig) + ": " + ec.message(),
                         "remove it from --signals-to-handle");
      }
      note_arrivals_of(sig);  // a Ctrl-C ends the wait for the watchdog's start too
    }
    // torch's agent environment: the worker watchdog FIFO and the health endpoint.
    // A timer request names a pid: only live processes of the current attempt may be signalled,
    // never the agent's neighbours (sshd, ddprun-rdzvd, another job) nor a recycled pid.
    file_timer_ = start_file_timer(io_, config_, parent_env_, [this](pid_t pid, int sig) {
      if (!kill_timer_pid(pid, sig, [this](pid_t p) { return run_.owns_live_pid(p); })) return false;
      // Its SIGKILL is then ddprun's, not a candidate for an OOM kill (cause_of), and bounded
      // by --kill-timeout as any SIGKILL of ddprun's.
      run_.note_kill(pid, sig, "file timer (a FileTimer scope expired)");
      return true;
    });
    if (file_timer_) {  // should the agent be killed, the watchdog removes the FIFO
      std::error_code ec;
      const auto fifo = std::filesystem::absolute(file_timer_->path(), ec);
      if (!ec) containment_->unlink_when_gone(fifo.string(), file_timer_->fifo_dev(), file_timer_->fifo_ino());
    }
    if (config_.health_check_port) {
      health_ = std::make_unique<HealthEndpoint>(io_, *config_.health_check_port);
      health_->start();
    }
    event("ddprun.agent.started", "AGENT", {});
    wait_signal();
    if (config_.control_fd >= 0) {
      start_control();
    }
    // Console writes to a closed pipe (ddprun ... | head) must not kill the agent: EPIPE is
    // handled where we write. Workers get SIGPIPE back to default in the child.
    // Unless SIGPIPE is one of the signals handled (--signals-to-handle): then it is forwarded.
    const auto handled = handled_signals(config_);
    sigpipe_ignored_ = std::find(handled.begin(), handled.end(), SIGPIPE) == handled.end();
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;  // NOLINT
    if (sigpipe_ignored_) ::sigaction(SIGPIPE, &ign, &old_sigpipe_);

    backend_->start();
    nccl_->set_comm_id_host(backend_->comm_id_host());
    next_round();
    if (!finished_) {
      io_.run();
    }
    {
      boost::system::error_code ignored;  // from here on a signal ends ddprun as it would any program
      signals_.clear(ignored);
    }
    if (sigpipe_ignored_) ::sigaction(SIGPIPE, &old_sigpipe_, nullptr);
    // After a successful job the watchdog removes the (empty) run directory once the agent has
    // exited: on a disk file system that takes ~0.3 ms, which the launch need not wait for.
    std::function<bool(const std::string&)> later;
    if (exit_code_ == 0) later = [this](const std::string& dir) { return containment_->remove_when_gone(dir); };
    remove_job_dir_unless_useful(config_, job_dir_, exit_code_ != 0 || any_files_ || run_.wrote_files(), later);
    if (config_.log_dir) tidy_job_dir(job_dir_);  // the user's directory: only what torchrun leaves
    job_dir_settled_ = true;
    if (exit_code_ != 0) {
      // torchrun's main is decorated with @record: the launcher's own error file gets the root
      // cause (a scheduler that set it reads it back).
      if (const auto it = parent_env_.find("TORCHELASTIC_ERROR_FILE"); it != parent_env_.end()) {
        const auto root = backend_->local_root_cause();
        std::string message = fatal_error_.empty() ? backend_->job_failure_reason() : fatal_error_;
        // Stopped by a signal and nothing else (its code is the exit code): torchrun's @record
        // writes its SignalException.
        if (message.empty() && !root && first_signal_ != 0 && exit_code_ == 128 + first_signal_) {
          message = signal_message_;
        }
        write_launcher_error_file(it->second, root ? &*root : nullptr, message);
      }
    }
    return exit_code_;
  }

 private:
  WorkerRun::Hooks worker_hooks() {
    WorkerRun::Hooks h;
    h.on_first_failure = [this](const FailureReport& failure) {
      if (finished_) return;
      // The first local failure ends the round for every node: the backend decides whether that
      // is a restart or the end of the job.
      pending_failure_ = failure;
      event("torchelastic.worker.status.FAILED", "WORKER",
            {{"local_rank", std::int64_t{failure.local_rank}},
             {"global_rank", std::int64_t{failure.rank}},
             {"raw_error", describe(failure.status)}});
      apply(machine_.on_local_failure());
    };
    h.on_diagnosis = [this](const std::string& block) {
      if (finished_) return;
      backend_->print_diagnosis(block);
    };
    h.on_done = [this](bool ok, int code) {
      if (finished_) return;
      if (!ok && machine_.state() == ElasticState::running) {
        backend_->update_diagnosis(run_.diagnosis());
        auto others = run_.other_failures();
        for (const auto& f : others) {
          event("torchelastic.worker.status.FAILED", "WORKER",
                {{"local_rank", std::int64_t{f.local_rank}},
                 {"global_rank", std::int64_t{f.rank}},
                 {"raw_error", describe(f.status)}});
        }
        backend_->await_verdict(code, std::move(others));
      }
      apply(machine_.on_group_done(ok));
    };
    h.on_worker_exit = [this](pid_t pid) {
      if (file_timer_) file_timer_->drop_pid(pid);
    };
    // As current torchrun: no restart (remaining restarts 0), the workers stopped, exit 1; in a
    // multi-node job this node leaves it (the others go on without it, as after its agent's exit).
    h.on_unhealthy = [this](const std::string& why) {
      if (finished_) return;
      console::write(STDERR_FILENO, "ddprun: error: " + why + "\n");
      if (fatal_error_.empty()) fatal_error_ = why;
      if (!signalled_) leave_reason_ = "(the worker group was unhealthy)";
      apply(machine_.on_give_up());
    };
    return h;
  }

  BackendEvents backend_events() {
    BackendEvents ev;
    ev.on_assignment = [this](const RoundAssignment& a) {
      if (finished_) return;
      latest_ = a;
      if (metrics_) metrics_->round_assigned(a);
      apply(machine_.on_assignment());
    };
    ev.on_restart = [this] {
      if (metrics_) metrics_->restarted();
      if (!finished_) event("ddprun.round.restart", "AGENT", {});
      if (!finished_) apply(machine_.on_restart());
    };
    ev.on_job_failed = [this](int code) {
      if (!finished_) apply(machine_.on_result(code));
    };
    ev.on_job_completed = [this] {
      if (!finished_) apply(machine_.on_result(0));
    };
    ev.on_refused = [this](const std::string& message) { exit_with_error(message); };
    ev.on_unreachable = [this](const std::string& message) { exit_with_error(message); };
    ev.on_remote_failure = [this](const std::string& failure) {
      // The culprit may run here while the failure was elsewhere (a rank of this node that never
      // entered the collective a rank of another node timed out in): without this, nobody took
      // its stack, since no rank of this node failed.
      if (finished_) return;
      if (const std::string block = run_.diagnose_remote(failure); !block.empty()) {
        console::write(STDERR_FILENO, block);
      }
    };
    ev.on_progress = [this](const std::string& text) {
      if (text != last_progress_) {
        last_progress_ = text;
        spdlog::info("{}", text);
      }
    };
    return ev;
  }

  // Refused / unreachable: stop the workers (if any) and exit 1 once they are gone.
  void exit_with_error(const std::string& message) {
    console::write(STDERR_FILENO, "ddprun: error: " + message + "\n");
    if (fatal_error_.empty()) fatal_error_ = message;
    if (!finished_) apply(machine_.on_result(1));
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

  // `why`: what the launcher's error file says when the signal sets the exit code (torch's
  // SignalException text by default).
  void deliver_signal(int sig, std::string why = {}) {
    // The run ends for it: its exit does not wait long on a console that does not read.
    console::limit_exit_wait(console::kConsoleExitWaitAfterSignal);
    if (first_signal_ == 0) {
      first_signal_ = sig;
      signal_message_ = why.empty() ? fmt::format("Process {} got signal: {}", ::getpid(), sig) : std::move(why);
    }
    signalled_ = true;
    apply(machine_.on_signal(sig));
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
    deliver_signal(SIGTERM, "the launcher is gone (" + why + "): the workers were stopped");
  }

  // Applies the round machine's decisions (elastic_machine.hpp).
  void apply(const ElasticActions& actions) {
    for (const auto& a : actions) {
      switch (a.kind) {
        case ElasticAction::Kind::start_workers:
          begin_round(*latest_);
          break;
        case ElasticAction::Kind::stop_workers:
          run_.stop();
          break;
        case ElasticAction::Kind::forward_signal:
          run_.signal(a.value);
          break;
        case ElasticAction::Kind::report_failure:
          if (pending_failure_) backend_->report_failure(round_, *pending_failure_);
          break;
        case ElasticAction::Kind::report_success:
          backend_->report_success(round_);
          break;
        case ElasticAction::Kind::rejoin:
          next_round();
          break;
        case ElasticAction::Kind::leave:
          backend_->leave(exit_code_of(actions), leave_reason_);
          break;
        case ElasticAction::Kind::exit:
          finish(a.value);
          break;
      }
    }
  }

  // A leave is always followed by the exit it announces.
  static int exit_code_of(const ElasticActions& actions) {
    for (const auto& a : actions) {
      if (a.kind == ElasticAction::Kind::exit) return a.value;
    }
    return 1;
  }

  // Fresh NCCL IDs for the next round, then ask the backend for it.
  void next_round() {
    backend_->set_nccl_offer(nccl_->prepare_offer());
    if (metrics_) metrics_->rendezvous_started();
    backend_->next_round();
  }

  void begin_round(const RoundAssignment& a) {
    round_ = a.round;
    bool withdrawn = false;
    const RoundNccl nccl = nccl_->begin_round(a.round, a.placement.world_size, a.nccl_id, &withdrawn);
    if (withdrawn) backend_->set_nccl_offer({});
    if (!a.summary.empty()) spdlog::info("{}", a.summary);
    if (health_) health_->set_state("running round " + std::to_string(a.round), a.round);
    event("ddprun.round.started", "AGENT",
          {{"round", static_cast<std::int64_t>(a.round)},
           {"group_rank", std::int64_t{a.placement.group_rank}},
           {"group_world_size", std::int64_t{a.placement.group_world_size}},
           {"world_size", std::int64_t{a.placement.world_size}},
           {"agent_restarts", std::int64_t{a.placement.restart_count}}});
    last_progress_.clear();
    pending_failure_.reset();
    if (file_timer_) file_timer_->reset();  // the previous attempt's timers name its dead workers
    const AttemptContext attempt{job_dir_ + "/" + a.dir_name, nccl.env, flat_dirs_};
    std::vector<WorkerSpec> specs;
    for (int r = 0; r < config_.nproc_per_node; ++r) {
      specs.push_back(worker_spec(config_, a.placement, r, attempt, parent_env_));
    }
    run_.start(attempt.dir, executable_, std::move(specs), parent_env_);
    if (!watchdog_end_) watch_watchdog();
  }

  // A watchdog that ends while the job runs (a ddprun-watchdog of another build refuses to start,
  // exit 2; something killed it) is reported when it ends, not only at the job's end. Armed after
  // the first workers' exec, off the path to it; before Linux 5.3 (no pidfd) only the end looks.
  void watch_watchdog() {
    const pid_t pid = containment_->watchdog_pid();
    const int fd = pid > 0 ? static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)) : -1;
    if (fd < 0) return;
    watchdog_end_ = std::make_unique<asio::posix::stream_descriptor>(io_, fd);
    watchdog_end_->async_wait(asio::posix::stream_descriptor::wait_read, [this](const boost::system::error_code& ec) {
      if (!ec) containment_->check_watchdog();
    });
  }

  void finish(int code) {
    if (finished_) {
      return;
    }
    finished_ = true;
    exit_code_ = code;
    event(code == 0 ? "torchelastic.worker.status.SUCCEEDED" : "torchelastic.worker.status.FAILED", "AGENT",
          {{"exit_code", std::int64_t{code}}});
    if (health_) health_->stop();
    nccl_->stop();  // the round is over: end its NCCL bootstrap roots
    run_.kill_and_reap_all();
    boost::system::error_code ignored;
    signals_.cancel(ignored);
    // Still handled while the backend stops (a node hosting the rendezvous lingers up to 3 s for
    // the others): a signal ends that wait, and ddprun still cleans up and exits with the job's
    // code, rather than being ended by it.
    signals_.async_wait([this](const boost::system::error_code& ec, int sig) {
      if (ec) return;
      console::limit_exit_wait(console::kConsoleExitWaitAfterSignal);
      spdlog::info("{}: not waiting any longer for the rendezvous to finish", signal_name(sig));
      io_.stop();
    });
    backend_->stop([this] { io_.stop(); });
  }

  // One --event-log-handler line with the fields every event carries.
  void event(const std::string& name, const char* source, EventFields fields) {
    if (!event_log_.enabled()) return;
    fields.emplace("run_id", config_.run_id);
    fields.emplace("role", config_.role);
    fields.emplace("entry_point", entrypoint_name(config_));
    fields.emplace("rdzv_backend", config_.rdzv_backend);
    if (config_.node_label.empty()) {
      std::array<char, 256> host{};
      ::gethostname(host.data(), host.size() - 1);
      fields.emplace("hostname", std::string(host.data()));
    } else {
      fields.emplace("hostname", config_.node_label);
    }
    fields.emplace("agent_pid", static_cast<std::int64_t>(::getpid()));
    fields.emplace("local_world_size", std::int64_t{config_.nproc_per_node});
    event_log_.emit(name, source, fields);
  }

  const AgentConfig& config_;
  asio::io_context io_{1};
  asio::signal_set signals_;
  // The containment watchdog's end as an event (its pidfd), watched from the first workers on.
  std::unique_ptr<asio::posix::stream_descriptor> watchdog_end_;
  worker_env::EnvMap parent_env_;
  std::unique_ptr<Containment> containment_;  // outlives run_, whose end sweeps it
  WorkerRun run_;
  std::unique_ptr<RendezvousBackend> backend_;
  EventLog event_log_;
  std::unique_ptr<FileTimerServer> file_timer_;
  std::unique_ptr<HealthEndpoint> health_;
  std::optional<NcclIdOwner> nccl_;
  ElasticMachine machine_;
  std::optional<RoundAssignment> latest_;
  std::optional<FailureReport> pending_failure_;
  std::uint64_t round_ = 0;
  std::string last_progress_;
  std::string executable_;
  std::string job_dir_;
  bool job_dir_settled_ = false;  // removed, kept or handed to the watchdog at the job's end
  bool flat_dirs_ = false;        // job_dir.hpp's flat layout
  bool any_files_ = false;
  bool finished_ = false;
  int exit_code_ = 1;
  int first_signal_ = 0;
  std::string signal_message_;  // the first signal delivered, as torch's SignalException says it
  std::string fatal_error_;     // ddprun's own reason to fail (exit_with_error), for the launcher's error file
  bool signalled_ = false;      // a handled signal was delivered
  std::string leave_reason_ = "after a signal";  // completes "workers stopped ..." when this node leaves
  // remote-agent mode: the launcher's control channel
  std::unique_ptr<asio::posix::stream_descriptor> control_;
  std::array<char, 256> control_buf_{};
  ControlReader control_reader_;
  std::unique_ptr<AgentMetrics> metrics_;  // after run_: reads it at scrape time
  bool control_error_reported_ = false;
  struct sigaction old_sigpipe_ {};
  bool sigpipe_ignored_ = false;
};

}  // namespace

AgentConfig with_job_mode(const AgentConfig& config) {
  AgentConfig c = config;
  if (!c.job_mode) c.job_mode = decide_job_mode(c);
  return c;
}

int run_agent(const AgentConfig& given) {
  const AgentConfig config = with_job_mode(given);
  validate_config(config);
  Agent agent(config);
  return agent.run();
}

}  // namespace ddprun::agent
