// rdzv_bench: load generator for ddprun's native rendezvous (ddprun-rdzvd).
//
// Simulates N agents, each with its own TCP connection speaking the real frames
// (rendezvous_wire.hpp) on the path a real agent takes: connect, HELLO, CHALLENGE, AUTH (HMAC
// over both nonces, rendezvous_auth.hpp), AUTH_OK (the server's MAC is checked), JOIN, JOINED.
// The token is ON by default (--no-token: the daemon has none and the agents skip AUTH). All N
// join one job with min = max = N. Agents connect from many 127.0.0.0/8 source addresses
// (--agents-per-address each, 127.1.0.1 upwards): one address has only ~28k ephemeral ports,
// and the daemon's per-address connection cap (--max-connections-per-peer, 4,096) stays ON.
//
// The agents are split over --processes forked processes (default: one per 16,000 agents), each
// holding its share's sockets: one process may not hold more descriptors than the open-files
// limit (20,000 on machines where it cannot be raised), so 100,000 agents need several. Within
// a process they are split over --threads threads (one epoll loop each). Agent i connects to the
// endpoint i mod E of the --endpoint list (relays: agents spread over them round-robin). At most
// --window agents are between connect() and their JOINED at any time (split between the
// processes in proportion to their shares), below the listen backlog (net.core.somaxconn): a
// real cluster's agents arrive spread over seconds; a burst beyond the backlog only measures SYN
// retransmission timers.
//
// Phases: setup = every connection made and authenticated and N-1 agents JOINED (the daemon has
// answered each: it is idle); then the last agent sends its JOIN and the close is measured until
// every agent holds its ASSIGNMENT. total = setup + close. The processes report each phase to
// this one over pipes (every process's share done = the phase done). The daemon's and each
// relay's (--relay-pid) VmRSS / VmHWM and CPU time (utime + stime from /proc/PID/stat) and the
// bench processes' own CPU time are read at each phase boundary, so the JSON says how the time
// splits between daemon, relays and bench.
//
//   rdzv_bench --nodes N (--daemon PATH | --endpoint HOST:PORT[,HOST:PORT...] [--daemon-pid PID]
//              [--relay-pid PID]...) [--processes P] [--threads T] [--window W]
//              [--agents-per-address K] [--no-token] [--timeout S]
//
// --endpoint may be repeated. With --endpoint the daemon is someone else's: --no-token unless
// DDPRUN_RDZV_TOKEN holds its token. Prints one JSON object on stdout. Exit 0 on success, 1 on
// failure (message on stderr), 3 when N does not fit the open-files limit or the addresses (the
// JSON says "skipped").
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ddprun/rendezvous/rendezvous_auth.hpp"
#include "ddprun/rendezvous/rendezvous_wire.hpp"

namespace rdzv = ddprun::rendezvous;
using Clock = std::chrono::steady_clock;

namespace {

const std::string run_id = "bench";
std::string token_file_to_remove;
std::string who = "rdzv_bench";  // a bench process names its share of the agents

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "%s: error: %s\n", who.c_str(), what.c_str());
  std::fflush(stderr);
  if (!token_file_to_remove.empty()) ::unlink(token_file_to_remove.c_str());
  // _exit: another thread may be inside the event loop; the daemon dies with us (PDEATHSIG).
  _exit(1);
}

enum class Stage : std::uint8_t { idle, connecting, hello_sent, auth_sent, join_sent, joined, assigned };

struct Agent {
  int fd = -1;
  Stage stage = Stage::idle;
  bool last = false;       // the agent whose JOIN closes the round: it stops after the handshake
  bool epoll_out = false;  // registered for EPOLLOUT
  std::string out;         // bytes not yet written
  std::string in;          // bytes not yet parsed
  std::string client_nonce;
  std::string server_nonce;
  std::string assignment_frame;
};

struct Endpoint {
  std::string host;
  int port = 0;
};

struct Options {
  int nodes = 16;
  std::string daemon;
  std::vector<Endpoint> endpoints;
  pid_t daemon_pid = 0;
  std::vector<pid_t> relay_pids;
  int processes = 0;  // 0: one per agents_per_process_default agents
  double timeout_s = 600;
  int threads = 1;
  int window = 1024;
  int agents_per_address = 1000;
  bool token = true;
};

int to_int(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0' || v < 0 || v > 100000000) {
    die(flag + " wants a non-negative integer, got '" + text + "'");
  }
  return static_cast<int>(v);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) die("missing value after " + a);
      return argv[++i];
    };
    if (a == "--nodes") {
      o.nodes = to_int(a, value());
    } else if (a == "--daemon") {
      o.daemon = value();
    } else if (a == "--endpoint") {
      std::istringstream list(value());
      std::string e;
      while (std::getline(list, e, ',')) {
        const auto colon = e.rfind(':');
        if (colon == std::string::npos || colon == 0) die("--endpoint wants HOST:PORT[,HOST:PORT...], got '" + e + "'");
        const int port = to_int(a, e.substr(colon + 1));
        if (port < 1 || port > 65535) die("--endpoint " + e + ": the port must be 1-65535");
        o.endpoints.push_back({e.substr(0, colon), port});
      }
    } else if (a == "--daemon-pid") {
      o.daemon_pid = static_cast<pid_t>(to_int(a, value()));
    } else if (a == "--relay-pid") {
      o.relay_pids.push_back(static_cast<pid_t>(to_int(a, value())));
    } else if (a == "--processes") {
      o.processes = to_int(a, value());
    } else if (a == "--timeout") {
      o.timeout_s = std::atof(value().c_str());
    } else if (a == "--threads") {
      o.threads = to_int(a, value());
    } else if (a == "--window") {
      o.window = to_int(a, value());
    } else if (a == "--agents-per-address") {
      o.agents_per_address = to_int(a, value());
    } else if (a == "--no-token") {
      o.token = false;
    } else {
      die("unknown argument '" + a + "' (see the header of bench/rendezvous/rdzv_bench.cpp)");
    }
  }
  if (o.nodes < 2) die("--nodes must be at least 2");
  if (o.threads < 1 || o.threads > 64) die("--threads must be between 1 and 64");
  if (o.window < 1) die("--window must be at least 1");
  if (o.agents_per_address < 1) die("--agents-per-address must be at least 1");
  if (o.daemon.empty() && o.endpoints.empty()) die("give --daemon PATH or --endpoint HOST:PORT");
  if (!o.daemon.empty() && !o.endpoints.empty()) die("give --daemon PATH or --endpoint HOST:PORT, not both");
  if (o.processes > 1024) die("--processes must be at most 1024");
  return o;
}

long read_long_file(const char* path) {
  std::ifstream in(path);
  long v = 0;
  in >> v;
  return in ? v : 0;
}

// Raises the open-files limit to `want` when the hard limit allows, and the hard limit itself up
// to fs.nr_open when we are privileged (root, CAP_SYS_RESOURCE). Returns the soft limit now.
rlim_t raise_fd_limit(rlim_t want) {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return 1024;
  if (rl.rlim_max < want) {
    const long nr_open = read_long_file("/proc/sys/fs/nr_open");
    rlimit up{std::min<rlim_t>(want, static_cast<rlim_t>(nr_open > 0 ? nr_open : 1048576)),
              std::min<rlim_t>(want, static_cast<rlim_t>(nr_open > 0 ? nr_open : 1048576))};
    if (up.rlim_max > rl.rlim_max) setrlimit(RLIMIT_NOFILE, &up);  // fails without privileges: fine
    getrlimit(RLIMIT_NOFILE, &rl);
  }
  rl.rlim_cur = std::max(rl.rlim_cur, std::min(rl.rlim_max, want));
  setrlimit(RLIMIT_NOFILE, &rl);
  getrlimit(RLIMIT_NOFILE, &rl);
  return rl.rlim_cur;
}

std::string write_token_file(const std::string& token) {
  char path[] = "/tmp/rdzv_bench_token.XXXXXX";
  const int fd = mkstemp(path);  // mode 0600
  if (fd < 0) die(std::string("cannot create a token file in /tmp: ") + std::strerror(errno));
  const std::string text = token + "\n";
  if (write(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size())) die("cannot write the token file");
  close(fd);
  return path;
}

// Starts the daemon on 127.0.0.1 port 0 and reads its readiness line.
pid_t start_daemon(const Options& o, const std::string& token_file, int& port) {
  int pipefd[2];
  if (pipe(pipefd) != 0) die("pipe failed");
  // Connections beyond the agents: none are made, but the cap must not be the first limit met.
  const std::string max_connections = std::to_string(o.nodes + 64);
  const pid_t pid = fork();
  if (pid < 0) die("fork failed");
  if (pid == 0) {
    // The daemon dies with the bench, also when the bench stops on an error (die() exits
    // without reaching the teardown): an orphaned daemon holds the caller's stderr pipe open.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    dup2(pipefd[1], STDOUT_FILENO);
    close(pipefd[0]);
    close(pipefd[1]);
    // The per-address cap (--max-connections-per-peer) keeps its default: the agents come from
    // --agents-per-address each.
    std::vector<const char*> args{
        o.daemon.c_str(),       "--host", "127.0.0.1", "--port", "0", "--log-level", "warning", "--max-connections",
        max_connections.c_str()};
    if (!token_file.empty()) {
      args.push_back("--token-file");
      args.push_back(token_file.c_str());
    }
    args.push_back(nullptr);
    ::unsetenv("DDPRUN_RDZV_TOKEN");
    execv(o.daemon.c_str(), const_cast<char* const*>(args.data()));
    std::perror("exec ddprun-rdzvd");
    _exit(127);
  }
  close(pipefd[1]);
  std::string line;
  char c = 0;
  while (read(pipefd[0], &c, 1) == 1 && c != '\n') line.push_back(c);
  close(pipefd[0]);
  const std::string prefix = "listening on 127.0.0.1:";
  if (line.rfind(prefix, 0) != 0) die("daemon did not report readiness, got '" + line + "'");
  port = std::atoi(line.c_str() + prefix.size());
  return pid;
}

std::optional<long> proc_status_kib(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::atol(line.c_str() + field.size() + 1);
  }
  return std::nullopt;
}

// utime + stime of a process in seconds (fields 14 and 15 of /proc/PID/stat).
std::optional<double> proc_cpu_s(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto paren = text.rfind(')');
  if (paren == std::string::npos) return std::nullopt;
  std::istringstream fields(text.substr(paren + 2));
  std::string f;
  double ticks = 0;
  for (int i = 3; i <= 15 && fields >> f; ++i) {
    if (i >= 14) ticks += std::atof(f.c_str());
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

double self_cpu_s() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) / 1e6; };
  return s(ru.ru_utime) + s(ru.ru_stime);
}

struct Shared {
  const Options* o = nullptr;
  std::vector<sockaddr_in> servers;  // agent i connects to servers[i % size]
  std::string token;
  Clock::time_point deadline;
  std::atomic<int> window_left{0};
};

// One thread's agents and epoll loop.
class Worker {
 public:
  Worker(Shared& s, std::size_t first, std::size_t count, std::size_t total)
      : s_(s), first_(first), agents_(count), total_(total) {
    ep_ = epoll_create1(EPOLL_CLOEXEC);
    if (ep_ < 0) die(std::string("epoll_create1: ") + std::strerror(errno));
    if (first_ + count == total_) agents_.back().last = true;
  }

  // Phase 1: every agent connected and authenticated, every one but the last JOINED.
  void run_setup() {
    std::vector<epoll_event> events(4096);
    while (ready_ < agents_.size()) {
      while (next_ < agents_.size() && take_window_slot()) start_connect(next_++);
      const int n = epoll_wait(ep_, events.data(), static_cast<int>(events.size()), next_ < agents_.size() ? 1 : 1000);
      check_deadline("connecting, authenticating and joining");
      for (int k = 0; k < n; ++k) on_event(events[static_cast<std::size_t>(k)]);
    }
  }

  // Phase 2: until every agent holds its ASSIGNMENT.
  void run_close() {
    std::vector<epoll_event> events(4096);
    while (assigned_ < agents_.size()) {
      const int n = epoll_wait(ep_, events.data(), static_cast<int>(events.size()), 1000);
      check_deadline("waiting for every assignment");
      for (int k = 0; k < n; ++k) on_event(events[static_cast<std::size_t>(k)]);
    }
  }

  // The JOIN of the last agent (called by the main thread between the phases).
  void send_last_join() {
    const std::size_t i = agents_.size() - 1;
    queue_join(i);
  }

  const std::vector<Agent>& agents() const { return agents_; }
  std::size_t first() const { return first_; }
  std::size_t answered() const { return ready_; }
  std::size_t assigned() const { return assigned_; }

 private:
  bool take_window_slot() {
    int left = s_.window_left.load(std::memory_order_relaxed);
    while (left > 0) {
      if (s_.window_left.compare_exchange_weak(left, left - 1, std::memory_order_relaxed)) return true;
    }
    return false;
  }
  void release_window_slot() { s_.window_left.fetch_add(1, std::memory_order_relaxed); }

  std::size_t global(std::size_t i) const { return first_ + i; }

  in_addr source_address(std::size_t g) const {
    in_addr a{};
    // 127.1.0.1 + g / K: each address carries K agents (127.0.0.0/8 is all loopback).
    a.s_addr = htonl((127u << 24) + (1u << 16) + 1u +
                     static_cast<std::uint32_t>(g / static_cast<std::size_t>(s_.o->agents_per_address)));
    return a;
  }

  void start_connect(std::size_t i) {
    Agent& a = agents_[i];
    a.fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (a.fd < 0) die(std::string("socket: ") + std::strerror(errno) + " (raise the open-files limit)");
    int one = 1;
    setsockopt(a.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    // The port is picked at connect() by the 4-tuple, so each source address has its own range.
    setsockopt(a.fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof one);
    sockaddr_in src{};
    src.sin_family = AF_INET;
    src.sin_addr = source_address(global(i));
    if (bind(a.fd, reinterpret_cast<sockaddr*>(&src), sizeof src) != 0) {
      char text[INET_ADDRSTRLEN] = "";
      inet_ntop(AF_INET, &src.sin_addr, text, sizeof text);
      die(std::string("bind to source address ") + text + ": " + std::strerror(errno));
    }
    const sockaddr_in& server = s_.servers[global(i) % s_.servers.size()];
    const int r = connect(a.fd, reinterpret_cast<const sockaddr*>(&server), sizeof server);
    if (r != 0 && errno != EINPROGRESS) die(std::string("connect: ") + std::strerror(errno));
    a.stage = Stage::connecting;
    epoll_event ev{};
    ev.events = EPOLLOUT;
    ev.data.u64 = i;
    if (epoll_ctl(ep_, EPOLL_CTL_ADD, a.fd, &ev) != 0) die(std::string("epoll_ctl: ") + std::strerror(errno));
  }

  void queue_join(std::size_t i) {
    const std::size_t g = global(i);
    char addr[INET_ADDRSTRLEN] = "";
    const in_addr src = source_address(g);
    inet_ntop(AF_INET, &src, addr, sizeof addr);
    rdzv::JoinMessage m;
    m.run_id = run_id;
    m.request.node.id = rdzv::NodeId{addr, static_cast<std::int64_t>(100000 + g), "bench-" + std::to_string(g)};
    m.request.node.addr = addr;
    m.request.node.local_world_size = 8;
    m.request.node.store_host = addr;
    m.request.node.store_port = static_cast<std::uint16_t>(20000 + g % 40000);
    m.request.config.min_nodes = s_.o->nodes;
    m.request.config.max_nodes = s_.o->nodes;
    m.request.config.join_timeout = std::chrono::seconds(3600);
    m.request.config.last_call_timeout = std::chrono::seconds(3600);
    m.request.config.heartbeat_interval = std::chrono::seconds(600);  // no heartbeats needed here
    rdzv::encode_client(agents_[i].out, m);
    agents_[i].stage = Stage::join_sent;
    flush(i);
  }

  void flush(std::size_t i) {
    Agent& a = agents_[i];
    while (!a.out.empty()) {
      const ssize_t n = send(a.fd, a.out.data(), a.out.size(), MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EAGAIN) break;
        die(std::string("send: ") + std::strerror(errno));
      }
      a.out.erase(0, static_cast<std::size_t>(n));
    }
    const std::uint32_t want = EPOLLIN | (a.out.empty() ? 0u : static_cast<std::uint32_t>(EPOLLOUT));
    if (want != EPOLLIN || a.epoll_out) {
      epoll_event ev{};
      ev.events = want;
      ev.data.u64 = i;
      epoll_ctl(ep_, EPOLL_CTL_MOD, a.fd, &ev);
    }
    a.epoll_out = !a.out.empty();
  }

  void on_event(const epoll_event& ev) {
    const std::size_t i = ev.data.u64;
    Agent& a = agents_[i];
    if (a.stage == Stage::connecting) {
      int err = 0;
      socklen_t len = sizeof err;
      getsockopt(a.fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) die("connect of agent " + std::to_string(global(i)) + " failed: " + std::strerror(err));
      a.client_nonce = rdzv::auth::random_hex(rdzv::auth::nonce_bytes);
      rdzv::encode_client(a.out, rdzv::HelloMessage{1, a.client_nonce});
      a.stage = Stage::hello_sent;
      a.epoll_out = true;  // registered for EPOLLOUT: flush() switches to EPOLLIN
      flush(i);
      return;
    }
    if (ev.events & EPOLLOUT) flush(i);
    if (!(ev.events & (EPOLLIN | EPOLLHUP | EPOLLERR))) return;
    for (;;) {
      const ssize_t r = recv(a.fd, buf_, sizeof buf_, 0);
      if (r < 0 && errno == EAGAIN) break;
      if (r <= 0) die("the daemon closed agent " + std::to_string(global(i)) + "'s connection");
      a.in.append(buf_, static_cast<std::size_t>(r));
    }
    std::size_t pos = 0;
    while (a.in.size() - pos >= rdzv::native_header_bytes) {
      std::uint32_t len = 0;
      for (int b = 0; b < 4; ++b) {
        len |= static_cast<std::uint32_t>(static_cast<unsigned char>(a.in[pos + 1 + static_cast<std::size_t>(b)]))
               << (8 * b);
      }
      const std::size_t total = rdzv::native_header_bytes + len;
      if (a.in.size() - pos < total) break;
      on_frame(i, std::string_view(a.in).substr(pos, total));
      pos += total;
    }
    a.in.erase(0, pos);
  }

  void on_frame(std::size_t i, std::string_view frame) {
    Agent& a = agents_[i];
    const auto op = static_cast<rdzv::NativeOp>(frame[0]);
    switch (op) {
      case rdzv::NativeOp::challenge: {
        rdzv::ServerMessage m;
        decode_or_die(i, frame, m);
        const auto& c = std::get<rdzv::ChallengeMessage>(m);
        if (c.auth != !s_.token.empty()) {
          die(std::string("the daemon ") + (c.auth ? "asks for" : "does not ask for") + " authentication; the bench " +
              (s_.token.empty() ? "has no token" : "has one"));
        }
        if (!c.auth) {
          handshaken(i);
          return;
        }
        a.server_nonce = c.server_nonce;
        rdzv::encode_client(
            a.out, rdzv::AuthMessage{run_id, rdzv::auth::client_mac(s_.token, a.server_nonce, a.client_nonce, run_id)});
        a.stage = Stage::auth_sent;
        flush(i);
        return;
      }
      case rdzv::NativeOp::auth_ok: {
        rdzv::ServerMessage m;
        decode_or_die(i, frame, m);
        if (!rdzv::auth::equal_secret(rdzv::auth::server_mac(s_.token, a.client_nonce, a.server_nonce, run_id),
                                      std::get<rdzv::AuthOkMessage>(m).mac)) {
          die("agent " + std::to_string(global(i)) + ": wrong server MAC in AUTH_OK");
        }
        handshaken(i);
        return;
      }
      case rdzv::NativeOp::joined:
        // Frame split only: the node secret is not needed here.
        if (a.stage == Stage::join_sent) {
          a.stage = Stage::joined;
          ++ready_;
          release_window_slot();
        }
        return;
      case rdzv::NativeOp::assignment:
        if (a.stage != Stage::assigned) {
          a.stage = Stage::assigned;
          ++assigned_;
          a.assignment_frame = std::string(frame);  // decoded after the clock stops
        }
        return;
      case rdzv::NativeOp::refused:
      case rdzv::NativeOp::job_failed: {
        rdzv::ServerMessage m;
        rdzv::decode_server(frame, {}, m);
        const std::string why =
            std::holds_alternative<rdzv::Refuse>(m) ? std::get<rdzv::Refuse>(m).reason : std::string("job failed");
        die("agent " + std::to_string(global(i)) + " got " + rdzv::native_op_name(static_cast<std::uint8_t>(op)) +
            ": " + why);
      }
      default:
        return;  // PROGRESS lines
    }
  }

  void handshaken(std::size_t i) {
    Agent& a = agents_[i];
    a.client_nonce.clear();
    a.client_nonce.shrink_to_fit();
    a.server_nonce.clear();
    a.server_nonce.shrink_to_fit();
    if (a.last) {
      a.stage = Stage::joined;  // ready: its JOIN is the one that closes the round
      ++ready_;
      release_window_slot();
      return;
    }
    queue_join(i);
  }

  void decode_or_die(std::size_t i, std::string_view frame, rdzv::ServerMessage& m) {
    const auto r = rdzv::decode_server(frame, {}, m);
    if (r.status != rdzv::DecodeStatus::ok) {
      die("agent " + std::to_string(global(i)) + ": bad " + rdzv::native_op_name(static_cast<std::uint8_t>(frame[0])) +
          " frame: " + r.reason);
    }
  }

  void check_deadline(const char* phase) {
    if (Clock::now() > s_.deadline) {
      die(std::string("timed out while ") + phase + ": this thread's " + std::to_string(ready_) + " of " +
          std::to_string(agents_.size()) + " agents ready, " + std::to_string(assigned_) + " assigned");
    }
  }

  Shared& s_;
  std::size_t first_;
  std::vector<Agent> agents_;
  std::size_t total_;
  int ep_ = -1;
  std::size_t next_ = 0;
  std::size_t ready_ = 0;
  std::size_t assigned_ = 0;
  char buf_[65536];
};

// The phase handshake between this process and the bench processes: fixed-size messages on
// pipes (below PIPE_BUF, so each write is atomic), then the ranks each process's agents got.
enum class Tag : char {
  ready = 'R',      // process -> parent: agents allocated, waiting for the start
  start = 'S',      // parent -> process: connect your share
  set_up = 'U',     // process -> parent: every agent of the share ready (cpu = setup CPU)
  close = 'C',      // parent -> process: wait for the assignments
  last_join = 'L',  // parent -> the last process: send the last JOIN, then as close
  assigned = 'A',   // process -> parent: every agent of the share holds its ASSIGNMENT (cpu = close CPU)
  validate = 'V',   // parent -> process: decode and check the assignments, send the ranks
  ranks = 'K',      // process -> parent: count = number of int32 ranks that follow
  exit = 'X',       // parent -> process: close the sockets and exit
};

struct Message {
  Tag tag = Tag::ready;
  double cpu = 0;
  std::uint64_t count = 0;
  std::int64_t hwm_kib = 0;  // the process's peak RSS (VmHWM), in the assigned message
};

void write_all(int fd, const void* data, std::size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) die(std::string("write to a phase pipe: ") + std::strerror(errno));
    p += n;
    size -= static_cast<std::size_t>(n);
  }
}

// Reads exactly `size` bytes before `deadline`; false at end of file (the other side exited).
bool read_all(int fd, void* data, std::size_t size, Clock::time_point deadline, const std::string& waiting_for) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) die("timed out " + waiting_for);
    pollfd pfd{fd, POLLIN, 0};
    const int r = poll(&pfd, 1, static_cast<int>(std::min<long long>(left, 1000)));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;
    const ssize_t n = read(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) die(std::string("read from a phase pipe: ") + std::strerror(errno));
    if (n == 0) return false;
    p += n;
    size -= static_cast<std::size_t>(n);
  }
  return true;
}

void send_message(int fd, Tag tag, double cpu = 0, std::uint64_t count = 0, std::int64_t hwm_kib = 0) {
  const Message m{tag, cpu, count, hwm_kib};
  write_all(fd, &m, sizeof m);
}

Message expect(int fd, Tag tag, Clock::time_point deadline, const std::string& peer) {
  Message m;
  const std::string waiting_for = std::string("waiting for ") + peer + " ('" + static_cast<char>(tag) + "')";
  if (!read_all(fd, &m, sizeof m, deadline, waiting_for)) die(peer + " exited early (its error is above)");
  if (m.tag != tag)
    die(peer + " sent '" + static_cast<char>(m.tag) + "' where '" + static_cast<char>(tag) + "' was due");
  return m;
}

struct Share {
  std::size_t first = 0;
  std::size_t end = 0;
  pid_t pid = 0;
  int to = -1;    // parent -> process
  int from = -1;  // process -> parent
  std::string name;
};

// One bench process: its share's agents over --threads epoll loops, driven by the parent's
// phase messages. Never returns.
[[noreturn]] void run_share(Shared& shared, const Share& share, std::size_t n, Clock::time_point pipe_deadline) {
  const Options& o = *shared.o;
  const std::size_t count = share.end - share.first;
  const auto threads = static_cast<std::size_t>(std::min<std::size_t>(static_cast<std::size_t>(o.threads), count));
  std::vector<std::unique_ptr<Worker>> workers;
  for (std::size_t t = 0; t < threads; ++t) {
    const std::size_t first = share.first + count * t / threads;
    const std::size_t end = share.first + count * (t + 1) / threads;
    workers.push_back(std::make_unique<Worker>(shared, first, end - first, n));
  }
  auto run_all = [&](auto phase) {
    std::vector<std::thread> pool;
    for (std::size_t t = 1; t < threads; ++t) pool.emplace_back([&, t] { phase(*workers[t]); });
    phase(*workers[0]);
    for (auto& th : pool) th.join();
  };
  const std::string parent = "the parent rdzv_bench";
  send_message(share.from, Tag::ready);
  expect(share.to, Tag::start, pipe_deadline, parent);
  const double cpu0 = self_cpu_s();
  run_all([](Worker& w) { w.run_setup(); });
  const double cpu1 = self_cpu_s();
  send_message(share.from, Tag::set_up, cpu1 - cpu0, count);

  Message go;
  if (!read_all(share.to, &go, sizeof go, pipe_deadline, "waiting for " + parent)) _exit(1);
  if (go.tag == Tag::last_join) {
    workers.back()->send_last_join();
  } else if (go.tag != Tag::close) {
    die(parent + " sent '" + static_cast<char>(go.tag) + "' where the close was due");
  }
  run_all([](Worker& w) { w.run_close(); });
  send_message(share.from, Tag::assigned, self_cpu_s() - cpu1, count, proc_status_kib(getpid(), "VmHWM").value_or(0));

  // Checks each assignment against N (world sizes, offsets = 8 * rank); the parent checks that
  // every rank 0..N-1 was given once across the processes.
  expect(share.to, Tag::validate, pipe_deadline, parent);
  std::vector<std::int32_t> ranks;
  ranks.reserve(count);
  for (const auto& w : workers) {
    for (const Agent& a : w->agents()) {
      rdzv::ServerMessage m;
      const auto r = rdzv::decode_server(a.assignment_frame, {}, m);
      if (r.status != rdzv::DecodeStatus::ok) die("bad ASSIGNMENT frame: " + r.reason);
      const auto& as = std::get<rdzv::SendAssignment>(m).assignment;
      if (as.group_world_size != o.nodes || as.group_rank < 0 || as.group_rank >= o.nodes ||
          as.rank_offset != 8 * as.group_rank || as.world_size != 8 * o.nodes) {
        die("inconsistent assignment: group rank " + std::to_string(as.group_rank) + " of " +
            std::to_string(as.group_world_size) + ", rank offset " + std::to_string(as.rank_offset));
      }
      ranks.push_back(static_cast<std::int32_t>(as.group_rank));
    }
  }
  send_message(share.from, Tag::ranks, 0, ranks.size());
  write_all(share.from, ranks.data(), ranks.size() * sizeof(std::int32_t));
  expect(share.to, Tag::exit, pipe_deadline, parent);
  for (const auto& w : workers) {
    for (const Agent& a : w->agents()) close(a.fd);
  }
  _exit(0);
}

// Sums a /proc reading over several processes; nullopt when any of them is unreadable.
template <typename T, typename F>
std::optional<T> sum_over(const std::vector<pid_t>& pids, F read) {
  if (pids.empty()) return std::nullopt;
  T total{};
  for (pid_t pid : pids) {
    const auto v = read(pid);
    if (!v) return std::nullopt;
    total += *v;
  }
  return total;
}

struct Readings {
  std::optional<long> daemon_rss;
  std::optional<double> daemon_cpu;
  std::optional<long> relay_rss;
  std::optional<double> relay_cpu;
};

Readings read_servers(pid_t daemon, const std::vector<pid_t>& relays) {
  Readings r;
  if (daemon) {
    r.daemon_rss = proc_status_kib(daemon, "VmRSS");
    r.daemon_cpu = proc_cpu_s(daemon);
  }
  r.relay_rss = sum_over<long>(relays, [](pid_t p) { return proc_status_kib(p, "VmRSS"); });
  r.relay_cpu = sum_over<double>(relays, [](pid_t p) { return proc_cpu_s(p); });
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  Options o = parse(argc, argv);
  const auto n = static_cast<std::size_t>(o.nodes);
  // One process per 16,000 agents by default: each holds its share's sockets, and 20,000
  // descriptors (the hard limit where it cannot be raised) leave room for the daemon's reserve
  // when the daemon is ours and inherits the same limit.
  constexpr std::size_t agents_per_process_default = 16000;
  std::size_t processes = o.processes > 0 ? static_cast<std::size_t>(o.processes)
                                          : (n + agents_per_process_default - 1) / agents_per_process_default;
  processes = std::min(processes, n);
  const std::size_t largest_share = (n + processes - 1) / processes;
  // Our own daemon inherits the limit and needs N sockets plus up to 1,024 descriptors in
  // reserve beyond its connections (store_server.hpp); each bench process needs its share.
  const rlim_t share_need = static_cast<rlim_t>(largest_share) + 64;
  const rlim_t daemon_need = o.daemon.empty() ? 0 : static_cast<rlim_t>(o.nodes) + 64 + 1024;
  const rlim_t limit = raise_fd_limit(std::max(share_need, daemon_need) + 1024);
  if (daemon_need > limit) {
    std::printf(
        "{\"nodes\": %d, \"skipped\": \"open-files limit %llu is below the %llu this size needs (raise the hard "
        "limit: ulimit -Hn or prlimit with CAP_SYS_RESOURCE)\"}\n",
        o.nodes, static_cast<unsigned long long>(limit), static_cast<unsigned long long>(daemon_need));
    return 3;
  }
  if (share_need > limit) {
    std::printf(
        "{\"nodes\": %d, \"skipped\": \"open-files limit %llu is below the %llu descriptors one bench process's "
        "share of %zu agents needs (raise --processes)\"}\n",
        o.nodes, static_cast<unsigned long long>(limit), static_cast<unsigned long long>(share_need), largest_share);
    return 3;
  }
  const std::size_t addresses =
      (n + static_cast<std::size_t>(o.agents_per_address) - 1) / static_cast<std::size_t>(o.agents_per_address);
  if (addresses > 65000) die("--agents-per-address is too small for --nodes: more than 65,000 source addresses");
  if (o.agents_per_address > 28000) {
    die("--agents-per-address above 28,000 runs one address out of ephemeral ports (ip_local_port_range)");
  }
  const long somaxconn = read_long_file("/proc/sys/net/core/somaxconn");
  if (somaxconn > 0 && o.window > somaxconn) {
    std::fprintf(stderr,
                 "rdzv_bench: --window %d lowered to net.core.somaxconn %ld (a burst beyond the listen backlog only "
                 "measures SYN retransmissions)\n",
                 o.window, somaxconn);
    o.window = static_cast<int>(somaxconn);
  }

  Shared shared;
  shared.o = &o;
  if (o.token) {
    if (!o.daemon.empty()) {
      shared.token = rdzv::auth::random_hex(16);
    } else if (const char* env = std::getenv("DDPRUN_RDZV_TOKEN")) {
      shared.token = env;
    } else {
      die("--endpoint with a token: set DDPRUN_RDZV_TOKEN to the daemon's token, or pass --no-token");
    }
  }
  pid_t daemon = o.daemon_pid;
  bool own_daemon = false;
  if (!o.daemon.empty()) {
    std::string token_file;
    if (o.token) token_file = token_file_to_remove = write_token_file(shared.token);
    int port = 0;
    daemon = start_daemon(o, token_file, port);
    own_daemon = true;
    o.endpoints.push_back({"127.0.0.1", port});
  }
  for (const Endpoint& e : o.endpoints) {
    sockaddr_in server{};
    server.sin_family = AF_INET;
    server.sin_port = htons(static_cast<std::uint16_t>(e.port));
    if (inet_pton(AF_INET, e.host.c_str(), &server.sin_addr) != 1) {
      die("--endpoint " + e.host + ":" + std::to_string(e.port) + ": the host must be an IPv4 address");
    }
    shared.servers.push_back(server);
  }
  shared.deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.timeout_s));
  // The parent's waits on the pipes end a little after the processes' own deadline, so that a
  // process that times out reports why before the parent gives up on it.
  const Clock::time_point pipe_deadline = shared.deadline + std::chrono::seconds(30);

  // Forks the bench processes before the clock starts: each allocates its agents, says it is
  // ready and waits for the start.
  std::vector<Share> shares(processes);
  const pid_t parent_pid = getpid();
  std::fflush(stdout);
  std::fflush(stderr);
  for (std::size_t p = 0; p < processes; ++p) {
    Share& sh = shares[p];
    sh.first = n * p / processes;
    sh.end = n * (p + 1) / processes;
    sh.name = "bench process " + std::to_string(p) + " (agents " + std::to_string(sh.first) + "-" +
              std::to_string(sh.end - 1) + ")";
    int down[2];
    int up[2];
    if (pipe2(down, O_CLOEXEC) != 0 || pipe2(up, O_CLOEXEC) != 0) die(std::string("pipe: ") + std::strerror(errno));
    const pid_t pid = fork();
    if (pid < 0) die(std::string("fork: ") + std::strerror(errno));
    if (pid == 0) {
      // Dies with the parent, also when the parent stops on an error (die() exits at once).
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent_pid) _exit(1);
      token_file_to_remove.clear();  // the parent's file
      who = "rdzv_bench: " + sh.name;
      for (std::size_t q = 0; q < p; ++q) {
        close(shares[q].to);
        close(shares[q].from);
      }
      close(down[1]);
      close(up[0]);
      sh.to = down[0];
      sh.from = up[1];
      // Its share of the window, at least one agent.
      shared.window_left =
          std::max(1, static_cast<int>(static_cast<long long>(o.window) * static_cast<long long>(sh.end - sh.first) /
                                       static_cast<long long>(n)));
      run_share(shared, sh, n, pipe_deadline);
    }
    close(down[0]);
    close(up[1]);
    sh.pid = pid;
    sh.to = down[1];
    sh.from = up[0];
  }
  for (const Share& sh : shares) expect(sh.from, Tag::ready, pipe_deadline, sh.name);

  const Readings idle = read_servers(daemon, o.relay_pids);
  const auto setup_start = Clock::now();
  for (const Share& sh : shares) send_message(sh.to, Tag::start);
  double bench_cpu_setup = 0;
  for (const Share& sh : shares) bench_cpu_setup += expect(sh.from, Tag::set_up, pipe_deadline, sh.name).cpu;
  const auto setup_end = Clock::now();
  const Readings joined = read_servers(daemon, o.relay_pids);

  const auto t0 = Clock::now();
  for (std::size_t p = 0; p < processes; ++p)
    send_message(shares[p].to, p + 1 == processes ? Tag::last_join : Tag::close);
  double bench_cpu_close = 0;
  std::int64_t bench_hwm_kib = 0;
  for (const Share& sh : shares) {
    const Message m = expect(sh.from, Tag::assigned, pipe_deadline, sh.name);
    bench_cpu_close += m.cpu;
    bench_hwm_kib += m.hwm_kib;
  }
  const auto t1 = Clock::now();
  const Readings closed = read_servers(daemon, o.relay_pids);

  // Every rank 0..N-1 given once across the processes (each checked its own assignments).
  std::vector<char> seen(n, 0);
  for (const Share& sh : shares) send_message(sh.to, Tag::validate);
  for (const Share& sh : shares) {
    const Message m = expect(sh.from, Tag::ranks, pipe_deadline, sh.name);
    if (m.count != sh.end - sh.first) die(sh.name + " sent " + std::to_string(m.count) + " ranks");
    std::vector<std::int32_t> ranks(m.count);
    if (!read_all(sh.from, ranks.data(), ranks.size() * sizeof(std::int32_t), pipe_deadline, "reading ranks")) {
      die(sh.name + " exited before sending its ranks");
    }
    for (const std::int32_t r : ranks) {
      if (r < 0 || static_cast<std::size_t>(r) >= n || seen[static_cast<std::size_t>(r)]) {
        die("inconsistent assignments: group rank " + std::to_string(r) + " given twice or out of range");
      }
      seen[static_cast<std::size_t>(r)] = 1;
    }
  }

  const std::optional<long> rss = closed.daemon_rss;
  const std::optional<long> hwm = daemon ? proc_status_kib(daemon, "VmHWM") : std::nullopt;
  const std::optional<long> relay_hwm =
      sum_over<long>(o.relay_pids, [](pid_t p) { return proc_status_kib(p, "VmHWM"); });
  const double ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
  const double setup_s = std::chrono::duration<double>(setup_end - setup_start).count();
  auto num = [](const std::optional<long>& v) { return v ? std::to_string(*v) : std::string("null"); };
  auto dnum = [](const std::optional<double>& a, const std::optional<double>& b) {
    if (!a || !b) return std::string("null");
    char text[32];
    std::snprintf(text, sizeof text, "%.3f", *b - *a);
    return std::string(text);
  };
  std::printf(
      "{\"nodes\": %d, \"token\": %s, \"threads\": %d, \"processes\": %zu, \"endpoints\": %zu, \"relays\": %zu, "
      "\"window\": %d, \"source_addresses\": %zu, "
      "\"agents_per_address\": %d, \"last_join_to_all_assigned_ms\": %.3f, \"setup_s\": %.3f, \"total_s\": %.3f, "
      "\"daemon_cpu_setup_s\": %s, \"daemon_cpu_close_s\": %s, \"bench_cpu_setup_s\": %.3f, "
      "\"bench_cpu_close_s\": %.3f, \"daemon_rss_idle_kib\": %s, \"daemon_rss_joined_kib\": %s, "
      "\"daemon_rss_kib\": %s, \"daemon_hwm_kib\": %s, \"relay_cpu_setup_s\": %s, \"relay_cpu_close_s\": %s, "
      "\"relay_rss_idle_kib\": %s, \"relay_rss_joined_kib\": %s, \"relay_rss_kib\": %s, \"relay_hwm_kib\": %s, "
      "\"bench_hwm_kib\": %lld}\n",
      o.nodes, o.token ? "true" : "false", std::min(o.threads, o.nodes), processes, o.endpoints.size(),
      o.relay_pids.size(), o.window, addresses, o.agents_per_address, ms, setup_s, setup_s + ms / 1e3,
      dnum(idle.daemon_cpu, joined.daemon_cpu).c_str(), dnum(joined.daemon_cpu, closed.daemon_cpu).c_str(),
      bench_cpu_setup, bench_cpu_close, num(idle.daemon_rss).c_str(), num(joined.daemon_rss).c_str(), num(rss).c_str(),
      num(hwm).c_str(), dnum(idle.relay_cpu, joined.relay_cpu).c_str(),
      dnum(joined.relay_cpu, closed.relay_cpu).c_str(), num(idle.relay_rss).c_str(), num(joined.relay_rss).c_str(),
      num(closed.relay_rss).c_str(), num(relay_hwm).c_str(), static_cast<long long>(bench_hwm_kib));
  std::fflush(stdout);
  for (const Share& sh : shares) send_message(sh.to, Tag::exit);
  bool failed = false;
  for (const Share& sh : shares) {
    int status = 0;
    waitpid(sh.pid, &status, 0);
    failed = failed || !WIFEXITED(status) || WEXITSTATUS(status) != 0;
  }
  if (own_daemon) {
    kill(daemon, SIGTERM);
    int status = 0;
    waitpid(daemon, &status, 0);
  }
  if (!token_file_to_remove.empty()) ::unlink(token_file_to_remove.c_str());
  return failed ? 1 : 0;
}
