// The fan-out launcher; see fanout.hpp. One io_context thread owns every host's state: ssh exits
// arrive through pidfds, output through pipes, signals through a signal_set, the give-up
// deadline through a steady_timer. Nothing polls.
#include "ddprun/launcher/fanout.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <algorithm>
#include <array>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <deque>
#include <unordered_set>
#include <memory>
#include <optional>
#include <spdlog/spdlog.h>

#include "ddprun/common/console.hpp"
#include "ddprun/agent/child_process.hpp"
#include "ddprun/agent/output.hpp"
#include "ddprun/agent/process.hpp"
#include "ddprun/agent/remote_protocol.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/shell.hpp"
#include "ddprun/common/strings.hpp"
#include "ddprun/launcher/remote_env.hpp"
#include "ddprun/launcher/values.hpp"
#include "ddprun/rendezvous/rendezvous_server.hpp"
#include "ddprun/worker_env/worker_env.hpp"

namespace asio = boost::asio;

namespace ddprun::launcher {

namespace {

// How long a host's ssh pipes may stay open after ssh exited before the launcher stops waiting.
constexpr std::chrono::milliseconds kDrainTimeout{2000};
// After the grace the remote agents were given (their --shutdown-timeout) and the wait for their
// workers' SIGKILL (--kill-timeout), how long the launcher waits for the ssh clients to report
// before it kills them (the remote agents then see EOF).
constexpr std::chrono::milliseconds kKillMargin{5000};
// How many of a host's own lines (not a worker's, not the agent's log) are kept for messages.
constexpr std::size_t kTailLines = 6;
// After one host's setup failure, how long hosts still connecting may take to fail by themselves
// (and be named) before they are cut: ssh's default ConnectTimeout (the plan's).
constexpr std::chrono::seconds kSetupGrace{10};

std::string destination(const FanoutHost& h) { return h.user.empty() ? h.host : h.user + "@" + h.host; }

std::string with_brackets(const std::string& addr) {
  return addr.find(':') != std::string::npos ? "[" + addr + "]" : addr;
}

// Runs argv to completion and returns its stdout (stdin and stderr: /dev/null). Used for `ssh -G`.
std::string capture(const std::vector<std::string>& argv) {
  int out_pipe[2] = {-1, -1};
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) {
    throw Error(std::string("pipe2 failed: ") + std::strerror(errno), "raise the open-files limit (ulimit -n)");
  }
  const int devnull = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  agent::SpawnRequest req;
  req.path = argv.front();
  req.argv = argv;
  req.envp = worker_env::merge_env(worker_env::current_environment(), {});
  req.stdin_fd = devnull;
  req.stdout_fd = out_pipe[1];
  req.stderr_fd = devnull;
  const auto res = agent::spawn_worker(req);
  ::close(out_pipe[1]);
  if (devnull >= 0) ::close(devnull);
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(out_pipe[0], buf, sizeof(buf));
    if (n > 0) {
      out.append(buf, static_cast<std::size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      break;
    }
  }
  ::close(out_pipe[0]);
  if (res.pid > 0) agent::reap(res.pid, res.pidfd);
  if (!res.ok()) {
    throw Error("cannot run " + argv.front() + ": " + (res.failed_step ? res.failed_step : "spawn") + ": " +
                    std::strerror(res.error),
                "install the OpenSSH client (Debian: openssh-client)");
  }
  return out;
}

// The address of this machine that traffic to `host` leaves from: ssh -G resolves the host
// through the ssh config (aliases, HostName, Port), then a connected UDP socket asks the kernel's
// routing table. Nothing is sent. Empty when the host cannot be routed; `why` says why. A host that
// does not resolve throws the error a host that ssh cannot resolve gives, with its check command.
std::string source_address_towards(const FanoutPlan& plan, const FanoutHost& target, std::string& why) {
  std::vector<std::string> argv = plan.ssh_command;
  argv.emplace_back("-G");
  argv.push_back(destination(target));
  const std::string config = capture(argv);
  std::string host = target.host;
  std::string port = "22";
  bool proxied = false;  // ssh reaches it through another host: it may resolve only there
  for (const auto& line : split(config, '\n')) {
    if (starts_with(line, "hostname ")) host = std::string(trim(line.substr(9)));
    if (starts_with(line, "port ")) port = std::string(trim(line.substr(5)));
    if ((starts_with(line, "proxyjump ") || starts_with(line, "proxycommand ")) &&
        to_lower(trim(line.substr(line.find(' ') + 1))) != "none") {
      proxied = true;
    }
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
  if ((rc != 0 || found == nullptr) && proxied) {
    why = "cannot resolve " + target.host + " (" + host +
          ") here, and ssh reaches it through a proxy: " + ::gai_strerror(rc);
    return {};
  }
  if (rc != 0 || found == nullptr) {
    // The host list's mistake, not the launcher's address: say it as ssh would for any host.
    throw NetworkError("cannot reach host " + destination(target) + " over ssh: cannot resolve " +
                           (host == target.host ? host : target.host + " (ssh's HostName " + host + ")") + ": " +
                           ::gai_strerror(rc),
                       "check that this works from this machine (host name, --ssh-port, keys in ssh-agent or the "
                       "ssh config): " +
                           ssh_check_command(plan, target));
  }
  std::string chosen;
  for (addrinfo* ai = found; ai != nullptr && chosen.empty(); ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {  // NOLINT: sockets API
      char text[NI_MAXHOST] = {};
      if (::getnameinfo(reinterpret_cast<sockaddr*>(&local), len, text, sizeof(text), nullptr, 0,  // NOLINT
                        NI_NUMERICHOST) == 0) {
        chosen = text;
      }
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  if (chosen.empty()) why = "no route from this machine to " + target.host + " (" + host + ")";
  return chosen;
}

bool is_loopback(const std::string& addr) { return starts_with(addr, "127.") || addr == "::1"; }

// Where the hosts reach the launcher: the source address towards the first host that is not this
// machine's loopback (a hostfile may list localhost first); loopback only when every host is local.
std::string pick_launcher_addr(const FanoutPlan& plan) {
  std::string loopback;
  std::string why;
  for (const auto& h : plan.hosts) {
    const std::string addr = source_address_towards(plan, h, why);
    if (addr.empty()) break;  // say why below rather than guess from the other hosts
    if (!is_loopback(addr)) return addr;
    if (loopback.empty()) loopback = addr;
  }
  if (why.empty() && !loopback.empty()) return loopback;
  throw NetworkError("cannot tell which address of this machine the hosts reach: " + why,
                     "pass --launcher-addr with an address of this machine that every host can reach");
}

struct HostRun {
  FanoutHost spec;
  // Launch tree: the hosts this one starts (its subtree, hostfile order; empty = a leaf or a
  // flat launch) and the labels of the whole subtree (whose prefixed lines pass unchanged).
  std::vector<FanoutHost> below;
  std::unordered_set<std::string> labels;
  bool local = false;  // a tree node's own agent: started directly, not over ssh
  std::string command;
  // ssh: its stdin carries the environment block, then control lines; its output is relayed.
  std::unique_ptr<agent::ChildProcess> child;
  bool started = false;
  bool ready = false;
  bool done = false;             // counted as done (exited and drained, or never started)
  bool ssh_missing = false;      // the ssh client itself could not be started
  int spawn_error = 0;           // errno of that failed start
  std::deque<std::string> tail;  // the host's own lines (ssh's messages, shell errors)
  bool holds_slot = false;       // counted in inflight_: started, neither ready nor done yet
  bool reported = false;         // its own setup failure was printed (then no list at the end)
  bool cut_off = false;          // its ssh was ended by the launcher before it was ready
  std::chrono::steady_clock::time_point started_at;
  std::chrono::steady_clock::time_point ended_at;
  // Armed at the start for plan.ready_timeout: the agent must say it is ready by then.
  std::unique_ptr<asio::steady_timer> ready_timer;
  // Per stream (0 stderr, 1 stdout): a line longer than a read was cut at the read's end; the
  // rest of it goes out under this prefix, the one that named the line's source. nullopt at the
  // start of a line.
  std::array<std::optional<std::string>, 2> cut;
  // Per stream: a partial line shown open on the console (on_open; console.hpp, "Open lines"),
  // with the prefix its rest gets when another writer took the console since. nullopt: none.
  std::array<std::optional<std::string>, 2> open;
  std::array<std::uint64_t, 2> owner{console::new_owner(), console::new_owner()};
  // The text of an open line without a source prefix (ssh's own), for remember() once it ends.
  std::array<std::optional<std::string>, 2> open_text;
};

// A host's line kept for an error message is cut here: a host that prints 64 KiB lines (a banner,
// a chatty login script) would make it megabytes, times every host that fails.
constexpr std::size_t kTailLineBytes = 512;

// Ignores SIGPIPE for its lifetime (EPIPE is handled where we write), restores it after.
class SigpipeIgnored {
 public:
  SigpipeIgnored() {
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;  // NOLINT
    ::sigaction(SIGPIPE, &ign, &old_);
  }
  ~SigpipeIgnored() { ::sigaction(SIGPIPE, &old_, nullptr); }
  SigpipeIgnored(const SigpipeIgnored&) = delete;
  SigpipeIgnored& operator=(const SigpipeIgnored&) = delete;

 private:
  struct sigaction old_ {};
};

// Every host started here holds ~4 descriptors for the whole job (ssh's three pipes, its pidfd),
// and every agent of the job one rendezvous connection to the launcher, whoever started it
// (`agents`: 0 on a tree node): raise the soft limit to the hard one, and refuse clearly when
// even that is too small.
void ensure_open_files(std::size_t hosts, std::size_t agents) {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return;
  if (lim.rlim_cur < lim.rlim_max) {
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) lim = raised;
  }
  const rlim_t need = static_cast<rlim_t>(hosts) * 4 + static_cast<rlim_t>(agents) + 64;
  if (lim.rlim_cur != RLIM_INFINITY && need > lim.rlim_cur) {
    throw Error(std::to_string(std::max(hosts, agents)) + " hosts need about " + std::to_string(need) +
                    " open files (pipes, process descriptors and rendezvous connections per host); the limit is " +
                    std::to_string(lim.rlim_cur),
                "raise it (ulimit -n, /etc/security/limits.conf) or launch fewer hosts from one machine");
  }
}

class Fanout {
 public:
  // node: null for the launcher; a tree node's own description otherwise (then agent_argv starts
  // its own agent, env is the block it read, control_fd its parent's control channel).
  Fanout(const FanoutPlan& plan, const TreeNodePlan* node = nullptr, std::vector<std::string> agent_argv = {},
         std::vector<std::pair<std::string, std::string>> env = {}, int control_fd = -1)
      : plan_(plan),
        node_(node),
        agent_argv_(std::move(agent_argv)),
        env_(std::move(env)),
        control_fd_(control_fd),
        signals_(io_),
        kill_timer_(io_),
        setup_grace_timer_(io_) {
    if (node_ != nullptr) {
      path_ = node_->path;
      hosts_.emplace_back();
      hosts_.back().spec.host = node_->self_label;
      hosts_.back().local = true;
    }
    if (node_ != nullptr || uses_tree(plan)) {
      for (const auto& [b, e] : split_subtrees(0, plan.hosts.size(), plan.tree_fanout)) {
        hosts_.emplace_back();
        HostRun& h = hosts_.back();
        h.spec = plan.hosts[b];
        h.below.assign(plan.hosts.begin() + static_cast<std::ptrdiff_t>(b) + 1,
                       plan.hosts.begin() + static_cast<std::ptrdiff_t>(e));
        h.labels.insert(h.spec.label());
        for (const auto& x : h.below) h.labels.insert(x.label());
      }
    } else {
      for (const auto& h : plan.hosts) {
        hosts_.emplace_back();
        hosts_.back().spec = h;
      }
    }
  }

  ~Fanout() {
    for (auto& h : hosts_) h.child.reset();  // closes stdin, kills and reaps what is left
  }
  Fanout(const Fanout&) = delete;
  Fanout& operator=(const Fanout&) = delete;

  int run() {
    ensure_open_files(hosts_.size(), node_ != nullptr ? 0 : plan_.hosts.size());
    if (node_ != nullptr) return run_node();
    const std::string addr = plan_.launcher_addr.empty() ? pick_launcher_addr(plan_) : plan_.launcher_addr;
    run_id_ = plan_.run_id.empty() ? "fanout-" + random_uuid4() : plan_.run_id;
    const std::string token = plan_.rdzv_token.empty() ? random_uuid4() : plan_.rdzv_token;

    rendezvous::RendezvousServerOptions opts;
    opts.host = addr;
    opts.port = 0;
    opts.token = token;
    try {
      server_ = std::make_unique<rendezvous::RendezvousServer>(io_, opts);
    } catch (const Error& e) {
      throw NetworkError("cannot host the rendezvous on " + addr + ": " + e.message(),
                         "pass --launcher-addr with an address of this machine that every host can reach");
    }
    server_->start();
    endpoint_ = with_brackets(addr) + ":" + std::to_string(server_->port());

    env_ = with_token(plan_.env, token);
    env_block_ = encode_env_block(env_);
    path_ = "launcher";
    check_env_block();
    check_subtree_blocks();
    check_remote_commands(plan_, endpoint_, run_id_);
    if (uses_tree(plan_)) {
      spdlog::info(
          "fan-out job '{}': {} host(s) through a launch tree (fan-out {}, depth {}), rendezvous at {}, at most {} ssh "
          "connection(s) in flight per node",
          run_id_, plan_.hosts.size(), plan_.tree_fanout, tree_depth(plan_.hosts.size(), plan_.tree_fanout), endpoint_,
          plan_.max_inflight);
    } else {
      spdlog::info("fan-out job '{}': {} host(s), rendezvous at {}, at most {} ssh connection(s) in flight", run_id_,
                   hosts_.size(), endpoint_, plan_.max_inflight);
    }

    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT}) signals_.add(sig);
    wait_signal();
    const SigpipeIgnored sigpipe;  // writes to a dead ssh's stdin must not kill the launcher

    start_ = std::chrono::steady_clock::now();
    launch_more();
    if (done_count_ < hosts_.size()) io_.run();
    return exit_code_;
  }

 private:
  static std::vector<std::pair<std::string, std::string>> with_token(
      std::vector<std::pair<std::string, std::string>> env, const std::string& token) {
    std::erase_if(env, [](const auto& kv) { return kv.first == "DDPRUN_RDZV_TOKEN" || kv.first == kTreeEnvName; });
    env.emplace_back("DDPRUN_RDZV_TOKEN", token);
    return env;
  }

  void wait_signal() {
    signals_.async_wait([this](const boost::system::error_code& ec, int sig) {
      if (ec) return;
      // The run ends for it: its exit does not wait long on a console that does not read.
      console::limit_exit_wait(console::kConsoleExitWaitAfterSignal);
      if (node_ != nullptr) {
        // A tree node is signalled by hand or by its session: act as if the parent forwarded it.
        spdlog::warn("received {}: forwarding it to this host's agent and the hosts below it", agent::signal_name(sig));
        stop_all(sig);
      } else if (interrupted_) {
        spdlog::warn("received {} again: killing the ssh connections now (remote agents stop their workers)",
                     agent::signal_name(sig));
        kill_all();
      } else {
        interrupted_ = true;
        if (!failed_) exit_code_ = 128 + sig;  // a failure that already began the stop keeps its code
        spdlog::warn("received {}: forwarding it to every host", agent::signal_name(sig));
        stop_all(sig);
      }
      wait_signal();
    });
  }

  // A tree node: no rendezvous of its own (every agent joins the launcher's); its parent's
  // control channel drives the stop.
  int run_node() {
    endpoint_ = node_->endpoint;
    run_id_ = node_->run_id;
    env_block_ = encode_env_block(env_);
    spdlog::debug("launch tree node {}: starting its agent and {} subtree(s) of {} host(s)", path_, hosts_.size() - 1,
                  plan_.hosts.size());
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT}) signals_.add(sig);
    wait_signal();
    const SigpipeIgnored sigpipe;  // the parent's end of stdout may be gone
    start_control();
    start_ = std::chrono::steady_clock::now();
    launch_more();
    if (done_count_ < hosts_.size()) io_.run();
    return exit_code_;
  }

  void start_control() {
    try {
      control_ = std::make_unique<asio::posix::stream_descriptor>(io_, control_fd_);
    } catch (const boost::system::system_error& e) {
      ::close(control_fd_);
      spdlog::warn("cannot watch the parent's control channel ({}); its end will go unnoticed", e.code().message());
      return;
    }
    read_control();
  }

  void read_control() {
    control_->async_read_some(asio::buffer(control_buf_), [this](const boost::system::error_code& ec, std::size_t n) {
      if (finished_) return;
      if (ec) {
        parent_gone(ec == asio::error::eof ? std::string("its connection closed") : ec.message());
        return;
      }
      const auto result = control_reader_.feed(std::string_view(control_buf_.data(), n));
      for (int sig : result.signals) {
        spdlog::debug("the parent forwarded {}: forwarding it to the subtree", agent::signal_name(sig));
        stop_all(sig);
        if (finished_) return;
      }
      if (result.error) {
        spdlog::error("{}; ignoring the parent's control channel from now on (its end is still noticed)",
                      *result.error);
        control_reader_ = agent::ControlReader();
        control_ignoring_ = true;
      }
      read_control_rest();
    });
  }

  // After a malformed control line only the channel's end matters.
  void read_control_rest() {
    if (!control_ignoring_) {
      read_control();
      return;
    }
    control_->async_read_some(asio::buffer(control_buf_), [this](const boost::system::error_code& ec, std::size_t) {
      if (finished_) return;
      if (ec) {
        parent_gone(ec == asio::error::eof ? std::string("its connection closed") : ec.message());
        return;
      }
      read_control_rest();
    });
  }

  // The launcher (or the ssh connection to this node) is gone: pass the EOF down, so every agent
  // of the subtree stops its workers and every node below does the same; kill what is left after
  // the grace.
  void parent_gone(const std::string& why) {
    spdlog::warn("the launcher is gone ({}): stopping this host's agent and the {} host(s) below it", why,
                 plan_.hosts.size());
    parent_gone_ = true;
    begin_stop(SIGTERM);
    setup_grace_timer_.cancel();
    for (auto& h : hosts_) {
      if (!h.started || h.child->exited()) continue;
      if (h.ready) {
        h.child->close_stdin();
      } else {
        cut(h);
      }
    }
    count_unstarted_done();
  }

  void launch_more() {
    while (!stopping_ && inflight_ < plan_.max_inflight && next_ < hosts_.size()) {
      start_host(hosts_[next_++]);
    }
  }

  void start_host(HostRun& h) {
    std::vector<std::string> argv;
    if (h.local) {
      argv = agent_argv_;
      h.command = shell_join(argv);
    } else {
      h.command = remote_command(plan_, h.spec, endpoint_, run_id_);
      argv = plan_.ssh_command;
      argv.push_back(destination(h.spec));
      argv.push_back(h.command);
    }
    agent::SpawnRequest req;
    // A tree node's own agent runs the image this node runs, through /proc/self/exe: it names
    // the running binary even when the file was replaced or removed since (a package upgrade
    // during the job), where its path would run another version or nothing. argv[0] keeps the
    // readable name for ps and for error messages.
    req.path = h.local ? std::string("/proc/self/exe") : argv.front();
    req.argv = argv;
    req.envp = worker_env::merge_env(worker_env::current_environment(), {});
    const std::size_t index = static_cast<std::size_t>(&h - hosts_.data());
    // Whole lines of each stream, or a piece of a line longer than one read (on_lines carries
    // its prefix over to the rest).
    auto relay = [this, index](bool is_stdout) {
      agent::ChildStream st;
      st.kind = agent::ChildStream::Kind::sink;
      st.console_fd = is_stdout ? STDOUT_FILENO : STDERR_FILENO;  // on_lines writes there; the pump paces on it
      st.sink = [this, index, is_stdout](std::string_view block, bool whole) {
        on_lines(hosts_[index], is_stdout, block, whole);
      };
      st.open_sink = [this, index, is_stdout](std::string_view piece) {
        return on_open(hosts_[index], is_stdout, piece);
      };
      return st;
    };
    agent::ChildProcess::Callbacks cb;
    cb.on_exit = [this, index](const agent::ExitStatus&) { hosts_[index].child->close_stdin(); };
    cb.on_done = [this, index] { maybe_done(hosts_[index]); };
    h.child = std::make_unique<agent::ChildProcess>(io_, kDrainTimeout);
    h.started_at = std::chrono::steady_clock::now();
    const auto res = h.child->start(std::move(req), relay(true), relay(false), true, std::move(cb));
    h.started = true;
    h.holds_slot = true;
    ++inflight_;
    h.child->write_stdin(h.below.empty() ? env_block_ : subtree_env_block(h));
    if (!res.ok()) {
      // ssh never ran: it reports exit 127, and this says why.
      remember(h, "cannot run " + argv.front() + ": " + (res.failed_step ? res.failed_step : "spawn") + ": " +
                      std::strerror(res.error));
      h.ssh_missing = true;
      h.spawn_error = res.error;
      return;
    }
    h.ready_timer = std::make_unique<asio::steady_timer>(io_, plan_.ready_timeout);
    h.ready_timer->async_wait([this, index](const boost::system::error_code& ec) {
      if (!ec) on_ready_deadline(hosts_[index]);
    });
    spdlog::debug("{}: {}", h.spec.label(), h.command);
  }

  // A host that counts as being set up no longer does (ready, done, or given up on): its place
  // among the --ssh-max-inflight connections goes to the next host.
  void release_slot(HostRun& h) {
    if (h.ready_timer) h.ready_timer->cancel();
    if (!h.holds_slot) return;
    h.holds_slot = false;
    --inflight_;
  }

  // The host's ssh still runs plan.ready_timeout after it started, past its ConnectTimeout, and
  // its agent never said it was ready: something on the host holds the session (a login script,
  // a PAM session module, a stalled NFS mount). The rendezvous would wait for it until its join
  // timeout, without saying whom it waits for: fail the launch naming it.
  void on_ready_deadline(HostRun& h) {
    if (h.ready || h.done || finished_) return;
    if (console::over(STDOUT_FILENO) || console::over(STDERR_FILENO)) {
      // This console is not reading: the host's pumps wait for it, its ready line may be among
      // what they have not read yet. Not the host's fault: ask again later.
      const auto index = static_cast<std::size_t>(&h - hosts_.data());
      h.ready_timer->expires_after(std::chrono::seconds(10));
      h.ready_timer->async_wait([this, index](const boost::system::error_code& ec) {
        if (!ec) on_ready_deadline(hosts_[index]);
      });
      return;
    }
    release_slot(h);
    if (stopping_) return;  // named with the others that never started, at the end
    h.reported = true;
    std::string why;
    for (const auto& line : h.tail) why += (why.empty() ? "" : "; ") + line;
    const std::string within = " did not start within " + seconds_text(plan_.ready_timeout);
    const std::string text = "host " + destination(h.spec) + tree_path(h) + ": " +
                             (h.local ? "its agent" + within : "ssh connected but ddprun's agent" + within) +
                             (why.empty() ? "" : ": " + why);
    const std::string hint =
        h.local ? std::string("check that the file system holding ddprun is responsive on that host")
                : ssh_check_hint(h) +
                      "; then that no login script, PAM session module or stalled file system (NFS) holds the "
                      "session there. The wait is ssh's ConnectTimeout plus the rendezvous join timeout "
                      "(--rdzv-conf join_timeout=SECONDS)";
    write_error(text, hint);
    set_failure(1);
    spdlog::warn("stopping the other hosts");
    stop_all(SIGTERM);
  }

  static std::string seconds_text(std::chrono::milliseconds ms) {
    return fmt::format("{:g} s", static_cast<double>(ms.count()) / 1000.0);
  }

  // "check that this works from this machine (...): ssh ... HOST true", as a host's errors say.
  std::string ssh_check_hint(const HostRun& h) const {
    return "check that this works from " +
           (node_ != nullptr ? "host " + node_->self_label : std::string("this machine")) +
           " (host name, --ssh-port, keys in ssh-agent or the ssh config" +
           (node_ != nullptr ? ", which every host of a launch tree uses too" : "") +
           "): " + ssh_check_command(plan_, h.spec);
  }

  // "ddprun: error: TEXT" and "ddprun: HINT" on stderr; a tree node names itself, as the
  // launcher would name a host's own lines.
  void write_error(const std::string& text, const std::string& hint) const {
    const std::string own = node_ != nullptr ? "[" + node_->self_label + "] " : "";
    console::write(STDERR_FILENO, own + "ddprun: error: " + text + "\n" + own + "ddprun: " + hint + "\n");
  }

  // When the job stopped (an agent's failure, a signal, the parent gone): the hosts whose agent
  // never said it was ready. One of them may be what the rendezvous waited for; the longest
  // waiting first. Not after a host's own setup error, which said why the job stopped (the
  // hosts still connecting then are no news).
  void report_never_ready() const {
    if (std::any_of(hosts_.begin(), hosts_.end(), [](const HostRun& h) { return h.reported; })) return;
    std::vector<const HostRun*> waiting;
    for (const auto& h : hosts_) {
      if (h.started && !h.ready && !h.ssh_missing) waiting.push_back(&h);
    }
    if (waiting.empty()) return;
    auto waited = [](const HostRun* h) { return h->ended_at - h->started_at; };
    std::stable_sort(waiting.begin(), waiting.end(),
                     [&waited](const HostRun* a, const HostRun* b) { return waited(a) > waited(b); });
    auto secs = [&waited](const HostRun* h) {
      return fmt::format("{:.1f} s", std::chrono::duration<double>(waited(h)).count());
    };
    const std::string own = node_ != nullptr ? "[" + node_->self_label + "] " : "";
    std::string text;
    if (waiting.size() == 1) {
      text = "host " + destination(waiting[0]->spec) + tree_path(*waiting[0]) +
             ": ddprun's agent had not started there when the job stopped, " + secs(waiting[0]) + " after " +
             (waiting[0]->local ? std::string("it was started") : std::string("ssh began connecting"));
    } else {
      constexpr std::size_t kNamed = 8;
      text = std::to_string(waiting.size()) + " hosts had not started ddprun's agent when the job stopped: ";
      for (std::size_t i = 0; i < waiting.size() && i < kNamed; ++i) {
        text += (i == 0 ? "" : ", ") + destination(waiting[i]->spec) + " (" + secs(waiting[i]) +
                (i == 0 ? " after ssh began connecting)" : ")");
      }
      if (waiting.size() > kNamed) text += " and " + std::to_string(waiting.size() - kNamed) + " more";
    }
    const HostRun& first = *waiting[0];
    const std::string hint = first.local ? std::string("check that the file system holding ddprun is responsive there")
                                         : ssh_check_hint(first) +
                                               "; then that no login script, PAM session module or stalled file "
                                               "system (NFS) holds the session there";
    console::write(STDERR_FILENO, own + "ddprun: " + text + "\n" + own + "ddprun: " + hint + "\n");
  }

  // Every host reads the environment on stdin, at most agent::kDefaultEnvBlockMax bytes: refuse
  // before contacting any host rather than have every agent fail to start.
  void check_env_block() const {
    // Linux starts no process with an environment string (NAME=VALUE) of more than
    // MAX_ARG_STRLEN bytes, its NUL included: every worker on every host would fail with E2BIG.
    constexpr std::size_t kMaxEnvString = 128 * 1024;
    for (const auto& [name, value] : env_) {
      if (name.size() + 1 + value.size() + 1 > kMaxEnvString) {
        throw UsageError(name + " (" + std::to_string(value.size()) +
                             " bytes) is too large to carry to the hosts: Linux "
                             "starts no process with an environment variable over " +
                             std::to_string(kMaxEnvString) + " bytes (MAX_ARG_STRLEN), so no worker could start",
                         "pass a path to a file with the value instead");
      }
    }
    if (env_block_.size() <= agent::kDefaultEnvBlockMax) return;
    std::string largest;
    std::size_t largest_size = 0;
    for (const auto& [name, value] : env_) {
      if (value.size() > largest_size) {
        largest = name;
        largest_size = value.size();
      }
    }
    throw UsageError("the environment carried to every host (" + std::to_string(env_.size()) + " variables, " +
                         largest + " the largest at " + std::to_string(largest_size) + " bytes) is " +
                         std::to_string(env_block_.size()) + " bytes, over the " +
                         std::to_string(agent::kDefaultEnvBlockMax) + " a host reads on stdin",
                     "carry less: check --env, --env-file and the launcher's variables carried by default; "
                     "--dry-run names them all");
  }

  // A subtree root reads its plan with the environment, at most agent::kDefaultEnvBlockMax bytes:
  // refuse before contacting any host rather than have every root fail to start.
  void check_subtree_blocks() const {
    for (const auto& h : hosts_) {
      if (h.below.empty()) continue;
      const std::size_t size = subtree_env_block(h).size();
      if (size > agent::kDefaultEnvBlockMax) {
        throw UsageError("the launch tree's plan for " + h.spec.label() + " (" + std::to_string(h.below.size()) +
                             " hosts below it, with the carried environment) is " + std::to_string(size) +
                             " bytes, over the " + std::to_string(agent::kDefaultEnvBlockMax) +
                             " a host reads on stdin",
                         "raise --ssh-tree-fanout so each subtree holds fewer hosts, or carry less environment");
      }
    }
  }

  // The env block of a subtree root: the job's environment plus its subtree's plan.
  std::string subtree_env_block(const HostRun& h) const {
    TreeNodePlan child;
    child.plan = plan_;
    child.plan.env.clear();
    child.plan.hosts = h.below;
    child.plan.nnodes = plan_.nnodes == 0 ? plan_.hosts.size() : plan_.nnodes;
    child.self_label = h.spec.label();
    child.endpoint = endpoint_;
    child.run_id = run_id_;
    child.path = path_ + " -> " + h.spec.label();
    auto env = env_;
    env.emplace_back(kTreeEnvName, encode_tree_node(child));
    return encode_env_block(env);
  }

  // How many bytes at the start of `line` name its source when that is a host of h's subtree
  // (0: none, the line is the host's own): "[LABEL:RANK]:" (a worker), "[ddprun@LABEL level] "
  // (an agent's log) and, from a tree node, "[LABEL] " (the node's own lines and those it
  // relays for a host it started).
  static std::size_t source_prefix(const HostRun& h, std::string_view line) {
    if (line.empty() || line.front() != '[') return 0;
    const bool node = !h.below.empty();
    auto ours = [&h, node](std::string_view label) {
      return node ? h.labels.count(std::string(label)) != 0 : label == h.spec.label();
    };
    constexpr std::string_view agent_open = "[ddprun@";
    if (starts_with(line, agent_open)) {
      const auto sp = line.find(' ', agent_open.size());
      if (sp == std::string_view::npos || !ours(line.substr(agent_open.size(), sp - agent_open.size()))) return 0;
      const auto close = line.find("] ", sp);
      return close == std::string_view::npos ? sp + 1 : close + 2;
    }
    if (node) {
      const auto bracket = line.find("] ");
      if (bracket != std::string_view::npos && ours(line.substr(1, bracket - 1))) return bracket + 2;
    }
    const auto close = line.find("]:");
    if (close == std::string_view::npos) return 0;
    const auto colon = line.rfind(':', close);
    return colon != std::string_view::npos && colon > 1 && ours(line.substr(1, colon - 1)) ? close + 2 : 0;
  }

  // Relays a block from one host: whole lines, or (`complete` false) one piece of a line that
  // filled a whole read, or the stream's last bytes. The agent's log lines ("[ddprun@host
  // level]") and the workers' lines ("[host:rank]:") already name the host; anything else (ssh's
  // own messages, the remote shell's) gets "[host] " and is remembered for error messages. A
  // piece goes out as a line of its own, so hosts never share a line, and the rest of its line
  // gets the piece's prefix: a worker's long line stays the worker's, however often it is cut.
  void on_lines(HostRun& h, bool is_stdout, std::string_view block, bool complete) {
    const std::string& label = h.spec.label();
    std::optional<std::string>& cut = h.cut[is_stdout ? 1 : 0];
    const int fd = is_stdout ? STDOUT_FILENO : STDERR_FILENO;
    if (auto& open = h.open[is_stdout ? 1 : 0]; open && !block.empty()) {
      // The rest of a line shown open: on it, or under its prefix when the console was taken.
      const auto nl = block.find('\n');
      const std::string_view rest = block.substr(0, nl == std::string_view::npos ? block.size() : nl + 1);
      block.remove_prefix(rest.size());
      const bool ends = nl != std::string_view::npos;
      console::write_prefixed(fd, *open, rest, ends, /*paced=*/true, h.owner[is_stdout ? 1 : 0], !ends);
      auto& text = h.open_text[is_stdout ? 1 : 0];
      if (text && text->size() < kTailLineBytes) text->append(rest.substr(0, ends ? rest.size() - 1 : rest.size()));
      if (ends) {
        open.reset();
        if (text) remember(h, std::move(*text));
        text.reset();
      }
    }
    std::string out;
    out.reserve(block.size() + 64);
    while (!block.empty()) {
      const auto nl = block.find('\n');
      const std::string_view line = block.substr(0, nl);
      block.remove_prefix(nl == std::string_view::npos ? block.size() : nl + 1);
      // Without a newline the piece ends the block: its line goes on in the next one.
      const bool cut_here = nl == std::string_view::npos && !complete;
      if (cut) {
        // An empty rest: the line ended exactly where it was cut, and already has its newline.
        if (!line.empty()) out.append(*cut).append(line).push_back('\n');
        if (!cut_here) cut.reset();
        continue;
      }
      if (is_stdout && !h.ready) {
        // The agent writes "\n<token>\n": the token may follow text of the remote login's rc
        // files that had no newline of its own; the empty line before it is not relayed.
        if (line.empty()) continue;
        if (line.size() >= kRemoteAgentReadyLine.size() &&
            line.substr(line.size() - kRemoteAgentReadyLine.size()) == kRemoteAgentReadyLine) {
          const std::string_view before = line.substr(0, line.size() - kRemoteAgentReadyLine.size());
          if (!before.empty()) out.append("[").append(label).append("] ").append(before).push_back('\n');
          on_ready(h);
          continue;
        }
      }
      const std::size_t named = source_prefix(h, line);
      if (named > 0) {
        out.append(line);
        if (cut_here) cut = std::string(line.substr(0, named));
      } else {
        remember(h, std::string(line));
        out.append("[").append(label).append("] ").append(line);
        if (cut_here) cut = "[" + label + "] ";
      }
      out.push_back('\n');
    }
    // Paced: the host's pump stops reading while this stream's queue is full (OutputPump).
    if (!out.empty()) console::write(is_stdout ? STDOUT_FILENO : STDERR_FILENO, out, /*paced=*/true);
  }

  // A partial line of a host's stream held for agent::kOpenLineDelay (a prompt, a progress bar):
  // shown now, left open; its rest follows on it (on_lines) unless another writer took the
  // console, which ends it first.
  // False: not taken (the pump keeps it for on_lines).
  bool on_open(HostRun& h, bool is_stdout, std::string_view piece) {
    // Before the agent's ready line, stdout is the remote login's (or that line itself): whole
    // lines, read for the token and remembered for errors.
    if (is_stdout && !h.ready) return false;
    const int s = is_stdout ? 1 : 0;
    const int fd = is_stdout ? STDOUT_FILENO : STDERR_FILENO;
    if (!h.open[s]) {
      if (h.cut[s]) {
        h.open[s] = std::move(*h.cut[s]);  // the rest of a cut line, under the cut's prefix
        h.cut[s].reset();
      } else if (const std::size_t named = source_prefix(h, piece); named > 0) {
        h.open[s] = std::string(piece.substr(0, named));
        console::write_prefixed(fd, {}, piece, false, /*paced=*/true, h.owner[s], /*leave_open=*/true);
        return true;
      } else {
        h.open[s] = "[" + h.spec.label() + "] ";
        h.open_text[s].emplace();  // ssh's or the shell's own words: remembered when the line ends
      }
    }
    if (h.open_text[s] && h.open_text[s]->size() < kTailLineBytes) h.open_text[s]->append(piece);
    console::write_prefixed(fd, *h.open[s], piece, false, /*paced=*/true, h.owner[s], /*leave_open=*/true);
    return true;
  }

  // A host's streams ended: a line of theirs still open on the console is ended.
  static void end_open_lines(HostRun& h) {
    for (int s = 0; s < 2; ++s) {
      if (!h.open[s]) continue;
      h.open[s].reset();
      if (h.open_text[s]) remember(h, std::move(*h.open_text[s]));
      h.open_text[s].reset();
      console::write_prefixed(s == 1 ? STDOUT_FILENO : STDERR_FILENO, {}, {}, false, /*paced=*/true, h.owner[s]);
    }
  }

  static void remember(HostRun& h, std::string line) {
    if (trim(line).empty()) return;
    if (line.size() > kTailLineBytes) {
      line.resize(kTailLineBytes);
      line += "...";
    }
    h.tail.push_back(std::move(line));
    if (h.tail.size() > kTailLines) h.tail.pop_front();
  }

  void on_ready(HostRun& h) {
    h.ready = true;
    release_slot(h);
    ++ready_count_;
    const auto ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count();
    spdlog::debug("{}: agent started ({:.1f} ms after the launch began)", h.spec.label(), ms);
    if (ready_count_ == hosts_.size()) {
      if (node_ != nullptr) {
        spdlog::debug("launch tree node {}: its agent and {} subtree root(s) started in {:.1f} ms", path_,
                      hosts_.size() - 1, ms);
      } else if (uses_tree(plan_)) {
        spdlog::info("the {} subtree root(s) of the launch tree started in {:.1f} ms", hosts_.size(), ms);
      } else {
        spdlog::info("agents started on all {} host(s) in {:.1f} ms", hosts_.size(), ms);
      }
    }
    if (parent_gone_) {
      h.child->close_stdin();
    } else if (stopping_) {
      // Stopped while this host was connecting: its agent read the environment, so it reads the
      // signal too.
      send_signal(h, stop_signal_);
    }
    launch_more();
  }

  void maybe_done(HostRun& h) {
    if (h.done || !h.child->done()) return;
    h.done = true;
    end_open_lines(h);
    h.ended_at = std::chrono::steady_clock::now();
    h.child->kill_and_reap();  // it exited: this only reaps
    release_slot(h);
    ++done_count_;
    on_host_done(h);
    if (done_count_ == hosts_.size()) {
      finish();
      return;
    }
    launch_more();
  }

  void on_host_done(HostRun& h) {
    const int code = h.child->status().shell_code();
    if (code == 0 && h.ready) {
      spdlog::debug("{}: agent finished", h.spec.label());
      return;
    }
    if (!h.ready) {
      // Stopped before it connected: expected, unless it failed by itself while the others
      // were given time after a host's setup failure (another unreachable host: named too).
      if (stopping_ && (!setup_failed_ || h.cut_off)) return;
      const std::string dest = destination(h.spec);
      std::string why;
      for (const auto& line : h.tail) why += (why.empty() ? "" : "; ") + line;
      std::string text;
      std::string hint;
      if (h.ssh_missing && h.spawn_error == E2BIG) {
        // Past the up-front check of the remote command: the whole exec (every argument and this
        // process's environment, which ssh inherits) is over the kernel's limit.
        text = "host " + dest + tree_path(h) + ": cannot start " + (h.local ? "its agent" : std::string("ssh")) +
               ": its command line (" + std::to_string(h.command.size()) +
               " bytes) and this process's environment are too long for one exec: " + why;
        hint =
            "shorten the program's arguments (pass long ones in a file) or this shell's environment; values for "
            "the workers can go with --env / --env-file, over ssh's stdin";
      } else if (h.ssh_missing) {
        text = "host " + dest + tree_path(h) + ": " + why;
        hint = "install the OpenSSH client (Debian: openssh-client)";
      } else if (code == 255) {
        text = "cannot reach host " + dest + " over ssh" + tree_path(h) + ": " +
               (why.empty() ? "ssh exited with 255" : why);
        hint = ssh_check_hint(h);
      } else if (code == 0) {
        // Something ended the session cleanly without running ddprun's agent: nothing of the job
        // runs there, and the rendezvous would wait for that host until its timeout.
        text = "host " + dest + tree_path(h) + ": " +
               (h.local ? std::string("its agent") : std::string("the ssh session")) +
               " ended (exit 0) before ddprun's agent started there" + (why.empty() ? "" : ": " + why);
        hint = h.local ? std::string("install the same ddprun version on every host")
                       : "check --remote-ddprun (" + plan_.remote_ddprun +
                             ") and any ForceCommand or login script on that host";
      } else if (code == 127) {
        text = "host " + dest + tree_path(h) + ": cannot run " + (h.local ? agent_argv_.front() : plan_.remote_ddprun) +
               (why.empty() ? "" : ": " + why);
        hint = "install ddprun at the same path on every host, or pass --remote-ddprun PATH";
      } else {
        text = "host " + dest + tree_path(h) + ": the remote agent did not start (exit code " + std::to_string(code) +
               ")" + (why.empty() ? "" : ": " + why);
        hint = "check --remote-cwd and that the same ddprun version is installed on every host";
      }
      h.reported = true;
      write_error(text, hint);
      set_failure(1);
      if (!stopping_) stop_after_setup_failure();
      return;
    }
    if (!stopping_) {
      // 255 is also ssh's own "connection lost" (a worker exit code 255 looks the same).
      spdlog::warn("host {}: agent ended with exit code {}{}; stopping the other hosts", h.spec.label(), code,
                   code == 255 ? " (or the ssh connection to it was lost)" : "");
    }
    set_failure(code);
    if (!stopping_) stop_all(SIGTERM);
  }

  // " (launch tree: launcher -> h0 -> h3)" for a host started by a tree node or with a subtree.
  std::string tree_path(const HostRun& h) const {
    if (node_ == nullptr && h.below.empty()) return "";
    return " (launch tree: " + path_ + (h.local ? "" : " -> " + h.spec.label()) + ")";
  }

  void set_failure(int code) {
    if (!failed_ && !interrupted_) {
      failed_ = true;
      exit_code_ = code;
    }
  }

  static void send_signal(HostRun& h, int sig) { h.child->write_stdin(agent::encode_control_signal(sig)); }

  // Stops every host: connected agents get the signal over their control channel (they stop
  // their workers with their own grace); hosts still connecting are cut off. Hosts not started
  // yet never start. After the agents' grace plus a margin, whatever is left is killed.
  void stop_all(int sig) {
    begin_stop(sig);
    setup_grace_timer_.cancel();
    for (auto& h : hosts_) {
      if (!h.started || h.child->exited()) continue;
      if (h.ready) {
        send_signal(h, sig);
      } else {
        cut(h);
      }
    }
    count_unstarted_done();
  }

  void cut(HostRun& h) {
    h.cut_off = true;
    h.child->close_stdin();
    h.child->signal_group(SIGTERM);
  }

  // A host could not be set up (unreachable, no ddprun there): the job cannot run. The connected
  // agents stop now, hosts not started never start, and those still connecting get kSetupGrace
  // (ssh's default ConnectTimeout) to connect, then stop, or fail by themselves and be named
  // too: five unreachable hosts are five errors of one launch, not one per launch. A signal
  // meanwhile cuts them at once (stop_all).
  void stop_after_setup_failure() {
    spdlog::warn("stopping the other hosts");
    setup_failed_ = true;
    begin_stop(SIGTERM);
    bool connecting = false;
    for (auto& h : hosts_) {
      if (!h.started || h.child->exited()) continue;
      if (h.ready) {
        send_signal(h, SIGTERM);
      } else {
        connecting = true;
      }
    }
    count_unstarted_done();
    if (!connecting || finished_) return;
    setup_grace_timer_.expires_after(kSetupGrace);
    setup_grace_timer_.async_wait([this](const boost::system::error_code& ec) {
      if (ec || finished_) return;
      for (auto& h : hosts_) {
        if (h.started && !h.ready && !h.child->exited()) cut(h);
      }
    });
  }

  // The first stop arms the kill timer: after the agents' grace and kill wait plus a margin, what
  // is left is killed (a tree node's ssh children then see their stdin close, and so on down).
  void begin_stop(int sig) {
    if (stopping_) return;
    stopping_ = true;
    stop_signal_ = sig;
    const auto limit = plan_.shutdown_timeout + plan_.kill_timeout + kKillMargin;
    kill_timer_.expires_after(limit);
    kill_timer_.async_wait([this, limit](const boost::system::error_code& ec) {
      if (ec) return;
      spdlog::warn("hosts still running {} ms after the stop: closing their ssh connections", limit.count());
      kill_all();
    });
  }

  // Hosts never started count as done.
  void count_unstarted_done() {
    while (next_ < hosts_.size()) {
      hosts_[next_++].done = true;
      ++done_count_;
    }
    if (done_count_ == hosts_.size()) finish();
  }

  void kill_all() {
    for (auto& h : hosts_) {
      if (!h.started || h.child->exited()) continue;
      h.child->close_stdin();
      h.child->signal_group(SIGKILL);
    }
  }

  void finish() {
    if (finished_) return;
    finished_ = true;
    if (stopping_) report_never_ready();
    kill_timer_.cancel();
    setup_grace_timer_.cancel();
    boost::system::error_code ignored;
    signals_.cancel(ignored);
    if (server_) server_->stop();
    if (control_) {
      boost::system::error_code ec;
      control_->close(ec);
    }
    io_.stop();
  }

  const FanoutPlan& plan_;
  const TreeNodePlan* node_ = nullptr;
  std::vector<std::string> agent_argv_;
  std::vector<std::pair<std::string, std::string>> env_;
  int control_fd_ = -1;
  std::string path_;  // hosts from the launcher to this process, for messages
  asio::io_context io_{1};
  asio::signal_set signals_;
  asio::steady_timer kill_timer_;
  // After a host's setup failure, the hosts still connecting may fail too: they are given
  // kSetupGrace to say so (each is named) before they are cut.
  asio::steady_timer setup_grace_timer_;
  bool setup_failed_ = false;
  std::unique_ptr<rendezvous::RendezvousServer> server_;  // after io_, so destroyed before it
  std::unique_ptr<asio::posix::stream_descriptor> control_;
  std::array<char, 256> control_buf_{};
  agent::ControlReader control_reader_;
  bool control_ignoring_ = false;
  bool parent_gone_ = false;
  std::vector<HostRun> hosts_;
  std::string run_id_;
  std::string endpoint_;
  std::string env_block_;
  std::chrono::steady_clock::time_point start_;
  std::size_t next_ = 0;
  int inflight_ = 0;
  std::size_t ready_count_ = 0;
  std::size_t done_count_ = 0;
  bool stopping_ = false;
  int stop_signal_ = SIGTERM;
  bool interrupted_ = false;
  bool failed_ = false;
  bool finished_ = false;
  int exit_code_ = 0;
};

}  // namespace

std::string remote_dir_word(const std::string& dir) {
  // A leading ~ or ~user is left unquoted so the host's shell expands it to that home directory
  // (a quoted ~ is a directory named "~"); the rest is quoted as ever.
  if (!dir.empty() && dir[0] == '~') {
    const std::size_t slash = dir.find('/');
    const std::string_view user =
        std::string_view(dir).substr(1, slash == std::string::npos ? std::string::npos : slash - 1);
    const bool plain_user = std::all_of(user.begin(), user.end(),
                                        [](char c) {
                                          return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                                                 (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-';
                                        }) &&
                            (user.empty() || user[0] != '-');
    if (plain_user) {
      if (slash == std::string::npos) return dir;
      const std::string rest = dir.substr(slash + 1);
      return dir.substr(0, slash + 1) + (rest.empty() ? "" : shell_quote(rest));
    }
  }
  return shell_quote(dir);
}

namespace {

// remote_command in three parts: the shell's "cd ... && exec ", the words that differ between
// hosts, and those every host of the job shares (the program among them), so that checking the
// commands of 10,000 hosts does not build 10,000 copies of a long program line.
std::string remote_command_head(const FanoutPlan& plan) {
  return "cd -- " + remote_dir_word(plan.remote_cwd) + " && exec ";
}

std::vector<std::string> remote_command_host_words(const FanoutPlan& plan, const FanoutHost& host,
                                                   const std::string& rdzv_endpoint, const std::string& run_id) {
  std::vector<std::string> words = {plan.remote_ddprun,
                                    "--remote-agent",
                                    "--node-label=" + host.label(),
                                    "--node-order=" + std::to_string(host.index),
                                    "--rdzv-backend=c10d",
                                    "--rdzv-endpoint=" + rdzv_endpoint,
                                    "--rdzv-id=" + run_id,
                                    "--nnodes=" + std::to_string(plan.nnodes == 0 ? plan.hosts.size() : plan.nnodes),
                                    "--nproc-per-node=" + host.nproc,
                                    "--prefix-output",
                                    "--log-line-prefix-template=[" + host.label() + ":${rank}]:"};
  if (!host.gpus.empty()) words.push_back("--gpus=" + host.gpus);
  return words;
}

std::vector<std::string> remote_command_shared_words(const FanoutPlan& plan) {
  std::vector<std::string> words;
  if (!plan.ranks_filter.empty()) words.push_back("--ranks-filter=" + plan.ranks_filter);
  words.insert(words.end(), plan.agent_args.begin(), plan.agent_args.end());
  words.emplace_back("--");
  words.insert(words.end(), plan.program.begin(), plan.program.end());
  return words;
}

}  // namespace

std::string remote_command(const FanoutPlan& plan, const FanoutHost& host, const std::string& rdzv_endpoint,
                           const std::string& run_id) {
  return remote_command_head(plan) + shell_join(remote_command_host_words(plan, host, rdzv_endpoint, run_id)) + " " +
         shell_join(remote_command_shared_words(plan));
}

void check_remote_commands(const FanoutPlan& plan, const std::string& rdzv_endpoint, const std::string& run_id) {
  const std::size_t head = remote_command_head(plan).size();
  const std::size_t shared = shell_join(remote_command_shared_words(plan)).size();
  for (const auto& host : plan.hosts) {
    const std::size_t size =
        head + shell_join(remote_command_host_words(plan, host, rdzv_endpoint, run_id)).size() + 1 + shared;
    if (size <= kMaxRemoteCommand) continue;
    const std::size_t program = shell_join(plan.program).size();
    const std::size_t flags = shell_join(plan.agent_args).size();
    throw UsageError("the command ssh runs on host " + host.label() + " is " + std::to_string(size) +
                         " bytes (program and arguments: " + std::to_string(program) + " bytes; forwarded flags: " +
                         std::to_string(flags) + " bytes), over the " + std::to_string(kMaxRemoteCommand) +
                         " that fit in one argument of a Linux exec: ssh takes it as one argument, and so does "
                         "the host's login shell",
                     "pass long arguments in a file the program reads, or as variables with --env / --env-file, "
                     "which travel over ssh's stdin");
  }
}

std::string ssh_check_command(const FanoutPlan& plan, const FanoutHost& host) {
  std::vector<std::string> argv = plan.ssh_command;
  argv.push_back(destination(host));
  argv.emplace_back("true");
  return shell_join(argv);
}

int run_fanout(const FanoutPlan& plan) {
  if (plan.hosts.empty()) {
    throw UsageError("no hosts to launch on", "list hosts with --hostfile FILE or --hosts h1,h2");
  }
  Fanout fanout(plan);
  return fanout.run();
}

int run_tree_node(const TreeNodePlan& node, const std::vector<std::string>& agent_argv,
                  const std::vector<std::pair<std::string, std::string>>& env, int control_fd) {
  Fanout fanout(node.plan, &node, agent_argv, env, control_fd);
  return fanout.run();
}

void print_fanout_dry_run(const FanoutPlan& plan, std::ostream& out) {
  out << "ddprun dry run: " << plan.hosts.size() << " host(s) over ssh; nothing is started\n";
  out << "rendezvous: hosted by this ddprun on "
      << (plan.launcher_addr.empty() ? std::string("<the address that routes to the first host>") : plan.launcher_addr)
      << ":<any free port>\n";
  out << "environment carried to every host (over ssh's stdin, not on a command line):";
  for (const auto& kv : plan.env) out << ' ' << kv.first;
  out << (plan.env.empty() ? " (none)\n" : "\n");
  const bool tree = uses_tree(plan);
  const auto parent = tree ? tree_parents(plan.hosts.size(), plan.tree_fanout) : std::vector<long>();
  if (tree) {
    out << "launch tree: " << plan.hosts.size() << " hosts > --ssh-tree-threshold " << plan.tree_threshold
        << ", fan-out " << plan.tree_fanout << ", depth " << tree_depth(plan.hosts.size(), plan.tree_fanout)
        << "; each host below is started by the one named, with the same ssh options\n";
  }
  for (std::size_t i = 0; i < plan.hosts.size(); ++i) {
    const auto& h = plan.hosts[i];
    if (tree) {
      out << "host " << h.label() << " is started by "
          << (parent[i] < 0 ? std::string("the launcher") : plan.hosts[static_cast<std::size_t>(parent[i])].label())
          << '\n';
    }
    std::vector<std::string> argv = plan.ssh_command;
    argv.push_back(destination(h));
    argv.push_back(remote_command(plan, h, "<launcher>:<port>", plan.run_id.empty() ? "<run id>" : plan.run_id));
    out << "host " << h.label() << " (" << h.nproc << " worker(s)" << (h.gpus.empty() ? "" : ", gpus " + h.gpus)
        << "):\n  " << shell_join(argv) << '\n';
  }
}

}  // namespace ddprun::launcher
