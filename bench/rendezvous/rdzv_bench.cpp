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
// Agents are split over --threads threads (one epoll loop each). At most --window agents are
// between connect() and their JOINED at any time (shared between threads), below the listen
// backlog (net.core.somaxconn): a real cluster's agents arrive spread over seconds; a burst
// beyond the backlog only measures SYN retransmission timers.
//
// Phases: setup = every connection made and authenticated and N-1 agents JOINED (the daemon has
// answered each: it is idle); then the last agent sends its JOIN and the close is measured until
// every agent holds its ASSIGNMENT. total = setup + close. The daemon's VmRSS / VmHWM and CPU
// time (utime + stime from /proc/PID/stat) and the bench's own CPU time are read at each phase
// boundary, so the JSON says how the time splits between daemon and bench.
//
//   rdzv_bench --nodes N (--daemon PATH | --endpoint HOST:PORT [--daemon-pid PID])
//              [--threads T] [--window W] [--agents-per-address K] [--no-token] [--timeout S]
//
// With --endpoint the daemon is someone else's: --no-token unless DDPRUN_RDZV_TOKEN holds its
// token. Prints one JSON object on stdout. Exit 0 on success, 1 on failure (message on stderr),
// 3 when N does not fit the open-files limit or the addresses (the JSON says "skipped").
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
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

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "rdzv_bench: error: %s\n", what.c_str());
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

struct Options {
  int nodes = 16;
  std::string daemon;
  std::string host = "127.0.0.1";
  int port = 0;
  pid_t daemon_pid = 0;
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
      const std::string e = value();
      const auto colon = e.rfind(':');
      if (colon == std::string::npos) die("--endpoint wants HOST:PORT, got '" + e + "'");
      o.host = e.substr(0, colon);
      o.port = to_int(a, e.substr(colon + 1));
    } else if (a == "--daemon-pid") {
      o.daemon_pid = static_cast<pid_t>(to_int(a, value()));
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
  if (o.daemon.empty() && o.port == 0) die("give --daemon PATH or --endpoint HOST:PORT");
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
  sockaddr_in server{};
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
    const int r = connect(a.fd, reinterpret_cast<const sockaddr*>(&s_.server), sizeof s_.server);
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

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  Options o = parse(argc, argv);
  const auto n = static_cast<std::size_t>(o.nodes);
  // Our N sockets plus slack; the daemon inherits the limits and needs as many on its side.
  // Our own daemon inherits the limit and keeps up to 1,024 descriptors in reserve beyond its
  // connections (store_server.hpp).
  const rlim_t need = static_cast<rlim_t>(o.nodes) + 64 + (o.daemon.empty() ? 0 : 1024);
  const rlim_t limit = raise_fd_limit(need + 1024);
  if (need > limit) {
    std::printf(
        "{\"nodes\": %d, \"skipped\": \"open-files limit %llu is below the %llu this size needs (raise the hard "
        "limit: ulimit -Hn or prlimit with CAP_SYS_RESOURCE)\"}\n",
        o.nodes, static_cast<unsigned long long>(limit), static_cast<unsigned long long>(need));
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
  int port = o.port;
  pid_t daemon = o.daemon_pid;
  bool own_daemon = false;
  if (!o.daemon.empty()) {
    std::string token_file;
    if (o.token) token_file = token_file_to_remove = write_token_file(shared.token);
    daemon = start_daemon(o, token_file, port);
    own_daemon = true;
  }
  shared.server.sin_family = AF_INET;
  shared.server.sin_port = htons(static_cast<std::uint16_t>(port));
  if (inet_pton(AF_INET, o.host.c_str(), &shared.server.sin_addr) != 1) die("--endpoint host must be an IPv4 address");
  shared.deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.timeout_s));
  shared.window_left = o.window;

  const std::optional<long> rss_idle = daemon ? proc_status_kib(daemon, "VmRSS") : std::nullopt;
  const std::optional<double> dcpu0 = daemon ? proc_cpu_s(daemon) : std::nullopt;
  const double bcpu0 = self_cpu_s();

  const auto threads = static_cast<std::size_t>(std::min(o.threads, o.nodes));
  std::vector<std::unique_ptr<Worker>> workers;
  for (std::size_t t = 0; t < threads; ++t) {
    const std::size_t first = n * t / threads;
    const std::size_t end = n * (t + 1) / threads;
    workers.push_back(std::make_unique<Worker>(shared, first, end - first, n));
  }
  auto run_all = [&](auto phase) {
    std::vector<std::thread> pool;
    for (std::size_t t = 1; t < threads; ++t) pool.emplace_back([&, t] { phase(*workers[t]); });
    phase(*workers[0]);
    for (auto& th : pool) th.join();
  };

  const auto setup_start = Clock::now();
  run_all([](Worker& w) { w.run_setup(); });
  const auto setup_end = Clock::now();
  const std::optional<long> rss_joined = daemon ? proc_status_kib(daemon, "VmRSS") : std::nullopt;
  const std::optional<double> dcpu1 = daemon ? proc_cpu_s(daemon) : std::nullopt;
  const double bcpu1 = self_cpu_s();

  const auto t0 = Clock::now();
  workers.back()->send_last_join();
  run_all([](Worker& w) { w.run_close(); });
  const auto t1 = Clock::now();
  const std::optional<double> dcpu2 = daemon ? proc_cpu_s(daemon) : std::nullopt;
  const double bcpu2 = self_cpu_s();

  // Validates the assignments: ranks 0..N-1 once each, offsets = 8 * rank, same round.
  std::vector<char> seen(n, 0);
  for (const auto& w : workers) {
    for (const Agent& a : w->agents()) {
      rdzv::ServerMessage m;
      const auto r = rdzv::decode_server(a.assignment_frame, {}, m);
      if (r.status != rdzv::DecodeStatus::ok) die("bad ASSIGNMENT frame: " + r.reason);
      const auto& as = std::get<rdzv::SendAssignment>(m).assignment;
      if (as.group_world_size != o.nodes || as.group_rank < 0 || as.group_rank >= o.nodes ||
          seen[static_cast<std::size_t>(as.group_rank)] || as.rank_offset != 8 * as.group_rank ||
          as.world_size != 8 * o.nodes) {
        die("inconsistent assignment: group rank " + std::to_string(as.group_rank) + " of " +
            std::to_string(as.group_world_size));
      }
      seen[static_cast<std::size_t>(as.group_rank)] = 1;
    }
  }

  const std::optional<long> rss = daemon ? proc_status_kib(daemon, "VmRSS") : std::nullopt;
  const std::optional<long> hwm = daemon ? proc_status_kib(daemon, "VmHWM") : std::nullopt;
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
      "{\"nodes\": %d, \"token\": %s, \"threads\": %zu, \"window\": %d, \"source_addresses\": %zu, "
      "\"agents_per_address\": %d, \"last_join_to_all_assigned_ms\": %.3f, \"setup_s\": %.3f, \"total_s\": %.3f, "
      "\"daemon_cpu_setup_s\": %s, \"daemon_cpu_close_s\": %s, \"bench_cpu_setup_s\": %.3f, "
      "\"bench_cpu_close_s\": %.3f, \"daemon_rss_idle_kib\": %s, \"daemon_rss_joined_kib\": %s, "
      "\"daemon_rss_kib\": %s, \"daemon_hwm_kib\": %s}\n",
      o.nodes, o.token ? "true" : "false", threads, o.window, addresses, o.agents_per_address, ms, setup_s,
      setup_s + ms / 1e3, dnum(dcpu0, dcpu1).c_str(), dnum(dcpu1, dcpu2).c_str(), bcpu1 - bcpu0, bcpu2 - bcpu1,
      num(rss_idle).c_str(), num(rss_joined).c_str(), num(rss).c_str(), num(hwm).c_str());
  std::fflush(stdout);
  for (const auto& w : workers) {
    for (const Agent& a : w->agents()) close(a.fd);
  }
  if (own_daemon) {
    kill(daemon, SIGTERM);
    int status = 0;
    waitpid(daemon, &status, 0);
  }
  if (!token_file_to_remove.empty()) ::unlink(token_file_to_remove.c_str());
  return 0;
}
