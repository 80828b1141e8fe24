// rdzv_bench: load generator for ddprun's native rendezvous (ddprun-rdzvd).
//
// Simulates N agents, each with its own TCP connection speaking the real frames
// (rendezvous_wire.hpp), from one thread with epoll. All N join one job with min = max = N.
// The first N-1 join and the bench waits until the daemon has answered each of them (its
// progress line), so the daemon is idle; then it sends the last JOIN and measures the time
// until every agent has received its ASSIGNMENT frame. It also reads the daemon's memory
// (VmRSS / VmHWM from /proc/PID/status) when it knows the daemon's pid.
//
//   rdzv_bench --nodes N (--daemon PATH | --endpoint HOST:PORT [--daemon-pid PID]) [--timeout S]
//
// Prints one JSON object on stdout. Exit 0 on success, 1 on failure (message on stderr), 3 when
// N does not fit the open-files limit (the JSON says "skipped").
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "ddprun/rendezvous/rendezvous_wire.hpp"

namespace rdzv = ddprun::rendezvous;
using Clock = std::chrono::steady_clock;

namespace {

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "rdzv_bench: error: %s\n", what.c_str());
  std::exit(1);
}

struct Agent {
  int fd = -1;
  bool connected = false;
  std::string out;  // bytes not yet written
  std::string in;   // bytes not yet parsed
  int frames = 0;   // frames received
  bool assigned = false;
  std::string assignment_frame;
  bool refused = false;
};

struct Options {
  int nodes = 16;
  std::string daemon;
  std::string host = "127.0.0.1";
  int port = 0;
  pid_t daemon_pid = 0;
  double timeout_s = 600;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) die("missing value after " + a);
      return argv[++i];
    };
    if (a == "--nodes") {
      o.nodes = std::atoi(value().c_str());
    } else if (a == "--daemon") {
      o.daemon = value();
    } else if (a == "--endpoint") {
      const std::string e = value();
      const auto colon = e.rfind(':');
      if (colon == std::string::npos) die("--endpoint wants HOST:PORT, got '" + e + "'");
      o.host = e.substr(0, colon);
      o.port = std::atoi(e.c_str() + colon + 1);
    } else if (a == "--daemon-pid") {
      o.daemon_pid = static_cast<pid_t>(std::atoi(value().c_str()));
    } else if (a == "--timeout") {
      o.timeout_s = std::atof(value().c_str());
    } else {
      die("unknown argument '" + a + "' (see the header of bench/rendezvous/rdzv_bench.cpp)");
    }
  }
  if (o.nodes < 1) die("--nodes must be at least 1");
  if (o.daemon.empty() && o.port == 0) die("give --daemon PATH or --endpoint HOST:PORT");
  return o;
}

rlim_t raise_fd_limit() {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return 1024;
  rl.rlim_cur = rl.rlim_max;
  setrlimit(RLIMIT_NOFILE, &rl);
  getrlimit(RLIMIT_NOFILE, &rl);
  return rl.rlim_cur;
}

// Starts the daemon on 127.0.0.1 port 0 and reads its readiness line.
pid_t start_daemon(const std::string& path, int& port) {
  int pipefd[2];
  if (pipe(pipefd) != 0) die("pipe failed");
  const pid_t pid = fork();
  if (pid < 0) die("fork failed");
  if (pid == 0) {
    // The daemon dies with the bench, also when the bench stops on an error (die() exits
    // without reaching the teardown): an orphaned daemon holds the caller's stderr pipe open.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    dup2(pipefd[1], STDOUT_FILENO);
    close(pipefd[0]);
    close(pipefd[1]);
    // Every simulated agent connects from 127.0.0.1: lift the per-address connection cap
    // (4,096 by default), which a real cluster's agents, each on its own address, never meet.
    execl(path.c_str(), path.c_str(), "--host", "127.0.0.1", "--port", "0", "--log-level", "warning",
          "--max-connections-per-peer", "0", static_cast<char*>(nullptr));
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

class Bench {
 public:
  explicit Bench(const Options& o) : o_(o), agents_(static_cast<std::size_t>(o.nodes)) {
    ep_ = epoll_create1(0);
    if (ep_ < 0) die("epoll_create1 failed");
    deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.timeout_s));
  }

  void connect_all(int port) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(port));
    if (inet_pton(AF_INET, o_.host.c_str(), &addr.sin_addr) != 1) die("--endpoint host must be an IPv4 address");
    std::size_t next = 0;
    int in_flight = 0;
    std::size_t done = 0;
    std::vector<epoll_event> events(1024);
    while (done < agents_.size()) {
      while (next < agents_.size() && in_flight < 256) {
        Agent& a = agents_[next];
        a.fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        if (a.fd < 0) die(std::string("socket: ") + std::strerror(errno));
        int one = 1;
        setsockopt(a.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        const int r = connect(a.fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
        if (r != 0 && errno != EINPROGRESS) die(std::string("connect: ") + std::strerror(errno));
        epoll_event ev{};
        ev.events = EPOLLOUT;
        ev.data.u64 = next;
        epoll_ctl(ep_, EPOLL_CTL_ADD, a.fd, &ev);
        ++in_flight;
        ++next;
      }
      const int n = epoll_wait(ep_, events.data(), static_cast<int>(events.size()), 1000);
      check_deadline("connecting");
      for (int i = 0; i < n; ++i) {
        Agent& a = agents_[events[static_cast<std::size_t>(i)].data.u64];
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(a.fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err != 0) die(std::string("connect failed: ") + std::strerror(err));
        a.connected = true;
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.u64 = events[static_cast<std::size_t>(i)].data.u64;
        epoll_ctl(ep_, EPOLL_CTL_MOD, a.fd, &ev);
        --in_flight;
        ++done;
      }
    }
  }

  void queue_join(std::size_t i) {
    rdzv::JoinMessage m;
    m.run_id = "bench";
    m.request.node.id = rdzv::NodeId{"127.0.0.1", static_cast<std::int64_t>(100000 + i), "bench-" + std::to_string(i)};
    m.request.node.addr = "127.0.0.1";
    m.request.node.local_world_size = 8;
    m.request.node.store_host = "127.0.0.1";
    m.request.node.store_port = static_cast<std::uint16_t>(20000 + i % 40000);
    m.request.config.min_nodes = o_.nodes;
    m.request.config.max_nodes = o_.nodes;
    m.request.config.join_timeout = std::chrono::seconds(3600);
    m.request.config.last_call_timeout = std::chrono::seconds(3600);
    m.request.config.heartbeat_interval = std::chrono::seconds(600);  // no heartbeats needed here
    rdzv::encode_client(agents_[i].out, m);
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
    epoll_event ev{};
    ev.events = EPOLLIN | (a.out.empty() ? 0u : static_cast<std::uint32_t>(EPOLLOUT));
    ev.data.u64 = i;
    epoll_ctl(ep_, EPOLL_CTL_MOD, a.fd, &ev);
  }

  // Runs the event loop until done() holds.
  template <typename Done>
  void run(const char* phase, Done done) {
    std::vector<epoll_event> events(4096);
    char buf[65536];
    while (!done()) {
      const int n = epoll_wait(ep_, events.data(), static_cast<int>(events.size()), 1000);
      check_deadline(phase);
      for (int k = 0; k < n; ++k) {
        const std::size_t i = events[static_cast<std::size_t>(k)].data.u64;
        Agent& a = agents_[i];
        if (events[static_cast<std::size_t>(k)].events & EPOLLOUT) flush(i);
        if (!(events[static_cast<std::size_t>(k)].events & (EPOLLIN | EPOLLHUP | EPOLLERR))) continue;
        for (;;) {
          const ssize_t r = recv(a.fd, buf, sizeof buf, 0);
          if (r < 0 && errno == EAGAIN) break;
          if (r <= 0) die("the daemon closed agent " + std::to_string(i) + "'s connection during " + phase);
          a.in.append(buf, static_cast<std::size_t>(r));
        }
        // Frame split only (op byte + length): JSON is parsed after the clock stops.
        std::size_t pos = 0;
        while (a.in.size() - pos >= rdzv::native_header_bytes) {
          std::uint32_t len = 0;
          for (int b = 0; b < 4; ++b) {
            len |= static_cast<std::uint32_t>(static_cast<unsigned char>(a.in[pos + 1 + static_cast<std::size_t>(b)]))
                   << (8 * b);
          }
          const std::size_t total = rdzv::native_header_bytes + len;
          if (a.in.size() - pos < total) break;
          const auto op = static_cast<rdzv::NativeOp>(a.in[pos]);
          ++a.frames;
          if (op == rdzv::NativeOp::assignment) {
            a.assigned = true;
            ++assigned_;
            a.assignment_frame = a.in.substr(pos, total);
          } else if (op == rdzv::NativeOp::refused || op == rdzv::NativeOp::job_failed) {
            rdzv::ServerMessage m;
            rdzv::decode_server(std::string_view(a.in).substr(pos, total), {}, m);
            std::string why = std::holds_alternative<rdzv::Refuse>(m) ? std::get<rdzv::Refuse>(m).reason : "job failed";
            die("agent " + std::to_string(i) + " got " + rdzv::native_op_name(static_cast<std::uint8_t>(op)) + ": " +
                why);
          }
          if (a.frames == 1) ++answered_;
          pos += total;
        }
        a.in.erase(0, pos);
      }
    }
  }

  void check_deadline(const char* phase) {
    if (Clock::now() > deadline_) {
      die(std::string("timed out while ") + phase + ": " + std::to_string(answered_) + " agents answered, " +
          std::to_string(assigned_) + " assigned");
    }
  }

  // Validates the assignments: ranks 0..N-1 once each, offsets = 8 * rank, same round.
  void validate() {
    std::vector<char> seen(agents_.size(), 0);
    for (const Agent& a : agents_) {
      rdzv::ServerMessage m;
      const auto r = rdzv::decode_server(a.assignment_frame, {}, m);
      if (r.status != rdzv::DecodeStatus::ok) die("bad ASSIGNMENT frame: " + r.reason);
      const auto& as = std::get<rdzv::SendAssignment>(m).assignment;
      if (as.group_world_size != o_.nodes || as.group_rank < 0 || as.group_rank >= o_.nodes ||
          seen[static_cast<std::size_t>(as.group_rank)] || as.rank_offset != 8 * as.group_rank ||
          as.world_size != 8 * o_.nodes) {
        die("inconsistent assignment: group rank " + std::to_string(as.group_rank) + " of " +
            std::to_string(as.group_world_size));
      }
      seen[static_cast<std::size_t>(as.group_rank)] = 1;
    }
  }

  std::size_t answered() const { return answered_; }
  std::size_t assigned() const { return assigned_; }
  std::vector<Agent>& agents() { return agents_; }

 private:
  const Options& o_;
  std::vector<Agent> agents_;
  int ep_ = -1;
  Clock::time_point deadline_;
  std::size_t answered_ = 0;
  std::size_t assigned_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  Options o = parse(argc, argv);
  const rlim_t limit = raise_fd_limit();
  // Our N sockets plus slack; the daemon needs the same number on its side (its own limit).
  if (static_cast<rlim_t>(o.nodes) + 64 > limit) {
    std::printf("{\"nodes\": %d, \"skipped\": \"open-files limit %llu is below %d + 64\"}\n", o.nodes,
                static_cast<unsigned long long>(limit), o.nodes);
    return 3;
  }
  int port = o.port;
  pid_t daemon = o.daemon_pid;
  bool own_daemon = false;
  if (!o.daemon.empty()) {
    daemon = start_daemon(o.daemon, port);
    own_daemon = true;
  }
  const std::optional<long> rss_idle = daemon ? proc_status_kib(daemon, "VmRSS") : std::nullopt;

  Bench bench(o);
  const auto setup_start = Clock::now();
  bench.connect_all(port);
  const std::size_t n = static_cast<std::size_t>(o.nodes);
  for (std::size_t i = 0; i + 1 < n; ++i) bench.queue_join(i);
  // Every early joiner gets a progress line for its own join: then the daemon has handled it.
  bench.run("waiting for the first N-1 joins", [&] { return bench.answered() >= n - 1; });
  const auto setup_end = Clock::now();
  const std::optional<long> rss_joined = daemon ? proc_status_kib(daemon, "VmRSS") : std::nullopt;

  const auto t0 = Clock::now();
  bench.queue_join(n - 1);
  bench.run("waiting for every assignment", [&] { return bench.assigned() >= n; });
  const auto t1 = Clock::now();
  bench.validate();

  const std::optional<long> rss = daemon ? proc_status_kib(daemon, "VmRSS") : std::nullopt;
  const std::optional<long> hwm = daemon ? proc_status_kib(daemon, "VmHWM") : std::nullopt;
  const double ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
  const double setup_s = std::chrono::duration<double>(setup_end - setup_start).count();
  auto num = [](const std::optional<long>& v) { return v ? std::to_string(*v) : std::string("null"); };
  std::printf(
      "{\"nodes\": %d, \"last_join_to_all_assigned_ms\": %.3f, \"setup_s\": %.3f, \"daemon_rss_idle_kib\": %s, "
      "\"daemon_rss_joined_kib\": %s, \"daemon_rss_kib\": %s, \"daemon_hwm_kib\": %s}\n",
      o.nodes, ms, setup_s, num(rss_idle).c_str(), num(rss_joined).c_str(), num(rss).c_str(), num(hwm).c_str());
  std::fflush(stdout);
  for (auto& a : bench.agents()) close(a.fd);
  if (own_daemon) {
    kill(daemon, SIGTERM);
    int status = 0;
    waitpid(daemon, &status, 0);
  }
  return 0;
}
