// store_barrier_bench: N simulated torch ranks doing init_process_group's store barrier against
// a c10d TCPStore server, all released at once, in a few epoll threads (not one thread per rank:
// the client side must not be what is measured).
//
//   store_barrier_bench --port P [--host 127.0.0.1] --clients N [--pattern wait|poll]
//       [--generation modern|legacy] [--threads T] [--ranks-per-address R] [--callback-conn 0|1]
//       [--tag T] [--timeout-s S] [--server-pid PID] [--world N]
//
// Each rank replays the store traffic of one torch rank, byte for byte on the wire
// (docs/protocol.md):
//   pattern wait (torch 2.6: TCPStore client + _store_based_barrier with TORCH_DIST_INIT_BARRIER=1;
//     torch.distributed.elastic.utils.store.barrier is the same minus the ADD 0):
//     connect; [modern: VALIDATE + PING, wait for the echo]; ADD(init/, 1) (TCPStore's
//     waitForWorkers); ADD(K, 1); ADD(K, 0); the rank that reads N sets K:last_worker;
//     WAIT([K:last_worker]).
//   pattern poll (torch 1.13 _store_based_barrier): connect; [--callback-conn 1: a second
//     connection, the 1.13 client's watch-callback socket, held open]; ADD(init/, 1); ADD(K, 1);
//     ADD(K, 0) every 10 ms until it reads N.
// Ranks connect from 127.0.0.1, each from a port the bench picks (see bind_port), or with
// --ranks-per-address R > 0 from 127.1.0.0 + rank / R (R ranks per simulated node), as ranks of
// many nodes do. (torch's servers resolve each peer's address by name: an address missing from
// /etc/hosts stalls them for the resolver's timeout, so the comparison runs from 127.0.0.1.)
//
// Prints one JSON object: release -> last rank done (ms), release -> last connection up (ms),
// errors, connect retries and, with --server-pid, the server's resident memory before the
// storm and with every rank connected and done (before any disconnects).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

using Steady = std::chrono::steady_clock;

struct Args {
  std::string host = "127.0.0.1";
  std::uint16_t port = 0;
  int clients = 1024;
  int world = 0;  // the N the barrier waits for; 0 = --clients (more: the barrier never completes)
  bool modern = true;
  bool poll = false;
  bool callback_conn = false;
  int threads = 1;
  int ranks_per_address = 0;  // 0: no bind, every rank from the kernel's choice (127.0.0.1)
  std::string tag = "1";      // the group: barrier key /store_based_barrier_key:TAG
  double timeout_s = 60;
  long server_pid = 0;
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "store_barrier_bench: " << why
            << "\nusage: store_barrier_bench --port P [--host H] --clients N [--pattern wait|poll] "
               "[--generation modern|legacy] [--threads T] [--ranks-per-address R] [--callback-conn 0|1] "
               "[--tag T] [--timeout-s S] [--server-pid PID] [--world N]\n";
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 >= argc) usage(std::string("option ") + argv[i] + " needs a value");
    const std::string k = argv[i];
    const std::string v = argv[i + 1];
    try {
      if (k == "--host") {
        a.host = v;
      } else if (k == "--port") {
        a.port = static_cast<std::uint16_t>(std::stoul(v));
      } else if (k == "--clients") {
        a.clients = std::stoi(v);
      } else if (k == "--world") {
        a.world = std::stoi(v);
      } else if (k == "--pattern") {
        if (v != "wait" && v != "poll") usage("--pattern wait|poll");
        a.poll = v == "poll";
      } else if (k == "--generation") {
        if (v != "legacy" && v != "modern") usage("--generation legacy|modern");
        a.modern = v == "modern";
      } else if (k == "--threads") {
        a.threads = std::stoi(v);
      } else if (k == "--ranks-per-address") {
        a.ranks_per_address = std::stoi(v);
      } else if (k == "--callback-conn") {
        a.callback_conn = v == "1";
      } else if (k == "--tag") {
        a.tag = v;
      } else if (k == "--timeout-s") {
        a.timeout_s = std::stod(v);
      } else if (k == "--server-pid") {
        a.server_pid = std::stol(v);
      } else {
        usage("unknown option " + k);
      }
    } catch (const std::logic_error&) {
      usage("bad value '" + v + "' for " + k);
    }
  }
  if (a.port == 0) usage("--port is required");
  if (a.clients < 1 || a.threads < 1 || a.ranks_per_address < 0)
    usage("--clients, --threads >= 1, --ranks-per-address >= 0");
  a.threads = std::min(a.threads, a.clients);
  if (a.world == 0) a.world = a.clients;
  return a;
}

// Wire encoding (little-endian u64 lengths; docs/protocol.md §2).
void put_u64(std::string& s, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
void put_str(std::string& s, const std::string& v) {
  put_u64(s, v.size());
  s += v;
}

struct Frames {
  std::string hello;      // VALIDATE + PING (modern only)
  std::string add_init;   // ADD(init/, 1)
  std::string add_one;    // ADD(K, 1)
  std::string add_zero;   // ADD(K, 0)
  std::string set_last;   // SET(K:last_worker, "1")
  std::string wait_last;  // WAIT([K:last_worker])
};

Frames make_frames(const Args& a) {
  const char op_set = a.modern ? 1 : 0;
  const char op_add = a.modern ? 4 : 3;
  const char op_wait = a.modern ? 6 : 5;
  // torch's client puts "/" before every user key; TCPStore's own init/ goes out bare.
  const std::string key = "/store_based_barrier_key:" + a.tag;
  const std::string last = key + ":last_worker";
  Frames f;
  if (a.modern) f.hello = std::string{0, '\xce', '\xf7', '\x85', '\x3c', 13, 1, 2, 3, 4};
  auto add = [&](const std::string& k, std::int64_t d) {
    std::string s(1, op_add);
    put_str(s, k);
    put_u64(s, static_cast<std::uint64_t>(d));
    return s;
  };
  f.add_init = add("init/", 1);
  f.add_one = add(key, 1);
  f.add_zero = add(key, 0);
  f.set_last = std::string(1, op_set);
  put_str(f.set_last, last);
  put_str(f.set_last, "1");
  f.wait_last = std::string(1, op_wait);
  put_u64(f.wait_last, 1);
  put_str(f.wait_last, last);
  return f;
}

// Where a rank is in its script. Each step sends one frame and reads a reply of known size.
enum class Step : std::uint8_t { connecting, hello, add_init, add_one, add_zero, wait_last, poll_sleep, done };

struct Rank {
  int fd = -1;
  int cb_fd = -1;  // 1.13 callback connection (held open, never used)
  Step step = Step::connecting;
  bool cb_connecting = false;
  bool active = false;   // counted in Worker::left_ until done
  std::uint8_t got = 0;  // reply bytes received for the current step
  char reply[8]{};
  std::uint32_t retries = 0;
  Steady::time_point connected{};
  Steady::time_point done{};
};

struct Shared {
  const Args* args = nullptr;
  Frames frames;
  std::atomic<long> errors{0};
  std::atomic<std::uint32_t> next_port{0};
  std::uint32_t port_low = 32768;
  std::uint32_t port_high = 60999;
  std::mutex mu;
  std::string first_error;
  // A rank that failed never reaches the barrier: the others would wait until the deadline.
  std::atomic<bool> abort{false};
  void error(const std::string& what) {
    ++errors;
    abort = true;
    std::lock_guard<std::mutex> lock(mu);
    if (first_error.empty()) first_error = what;
  }
};

sockaddr_in server_addr(const Args& a) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(a.port);
  if (::inet_pton(AF_INET, a.host.c_str(), &addr.sin_addr) != 1) usage("--host must be an IPv4 address");
  return addr;
}

// One epoll loop driving ranks [first, last).
class Worker {
 public:
  Worker(Shared& sh, int first, int last)
      : sh_(sh), a_(*sh.args), first_(first), ranks_(static_cast<std::size_t>(last - first)) {
    ep_ = ::epoll_create1(EPOLL_CLOEXEC);
  }
  ~Worker() {
    // Abortive close (RST): no TIME_WAIT entries left to hold the next run's source ports.
    const linger abort{1, 0};
    for (auto& r : ranks_) {
      for (int fd : {r.fd, r.cb_fd}) {
        if (fd < 0) continue;
        ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &abort, sizeof abort);
        ::close(fd);
      }
    }
    ::close(ep_);
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Connects every rank (in batches, serving events between them) and runs until all are done
  // or the deadline passes.
  void run(Steady::time_point deadline) {
    const sockaddr_in srv = server_addr(a_);
    std::size_t next = 0;
    std::vector<epoll_event> events(1024);
    while ((left_ > 0 || next < ranks_.size()) && !sh_.abort.load(std::memory_order_relaxed)) {
      const auto now = Steady::now();
      if (now > deadline) {
        sh_.error("timed out with " + std::to_string(left_ + (ranks_.size() - next)) + " rank(s) not done");
        return;
      }
      for (std::size_t end = std::min(ranks_.size(), next + 64); next < end; ++next) {
        ++left_;
        ranks_[next].active = true;
        start_connect(next, srv, false);
        if (a_.callback_conn && ranks_[next].step != Step::done) start_connect(next, srv, true);
      }
      int timeout = next < ranks_.size() ? 0 : 10;
      if (!sleepers_.empty()) timeout = 1;
      const int n = ::epoll_wait(ep_, events.data(), static_cast<int>(events.size()), timeout);
      for (int e = 0; e < n; ++e) {
        const std::uint64_t tag = events[static_cast<std::size_t>(e)].data.u64;
        on_event(static_cast<std::size_t>(tag >> 1), (tag & 1) != 0, events[static_cast<std::size_t>(e)].events, srv);
      }
      if (!sleepers_.empty()) wake_pollers();
    }
  }

  Steady::time_point last_done() const {
    Steady::time_point t{};
    for (const auto& r : ranks_) t = std::max(t, r.done);
    return t;
  }
  Steady::time_point last_connected() const {
    Steady::time_point t{};
    for (const auto& r : ranks_) t = std::max(t, r.connected);
    return t;
  }
  std::uint64_t retries() const {
    std::uint64_t n = 0;
    for (const auto& r : ranks_) n += r.retries;
    return n;
  }

 private:
  void start_connect(std::size_t i, const sockaddr_in& srv, bool cb) {
    Rank& r = ranks_[i];
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      fail(i, std::string("socket: ") + std::strerror(errno) + " (raise the open-files limit)");
      return;
    }
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (!(a_.ranks_per_address > 0 ? bind_source(i, fd) : bind_port(i, fd))) return;
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&srv), sizeof srv) != 0 && errno != EINPROGRESS) {
      const int err = errno;
      ::close(fd);
      fail(i, std::string("connect: ") + std::strerror(err));
      return;
    }
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLOUT;
    ev.data.u64 = (static_cast<std::uint64_t>(i) << 1) | (cb ? 1 : 0);
    ::epoll_ctl(ep_, EPOLL_CTL_ADD, fd, &ev);
    if (cb) {
      r.cb_fd = fd;
      r.cb_connecting = true;
    } else {
      r.fd = fd;
      r.step = Step::connecting;
    }
  }

  // Binds rank i's socket to 127.1.0.0 + i / ranks_per_address (port chosen at connect).
  bool bind_source(std::size_t i, int fd) {
    const int one = 1;
    ::setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof one);
    sockaddr_in src{};
    src.sin_family = AF_INET;
    const auto node = static_cast<std::uint32_t>((static_cast<int>(i) + first_) / a_.ranks_per_address);
    src.sin_addr.s_addr = htonl((127u << 24 | 1u << 16) + node);
    if (::bind(fd, reinterpret_cast<const sockaddr*>(&src), sizeof src) == 0) return true;
    const int err = errno;
    ::close(fd);
    fail(i, std::string("bind to a 127.1.x.x source address: ") + std::strerror(err));
    return false;
  }

  // Binds 127.0.0.1 with a port taken from a shared counter over the ephemeral range: letting
  // connect() pick costs the kernel a scan of the ports in use per connection
  // (__inet_check_established), quadratic at 16k connections from one address, which would
  // measure the client's kernel instead of the server.
  bool bind_port(std::size_t i, int fd) {
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in src{};
    src.sin_family = AF_INET;
    src.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (int tries = 0; tries < 65536; ++tries) {
      const std::uint32_t p = sh_.next_port.fetch_add(1);
      src.sin_port = htons(static_cast<std::uint16_t>(sh_.port_low + p % (sh_.port_high - sh_.port_low + 1)));
      if (::bind(fd, reinterpret_cast<const sockaddr*>(&src), sizeof src) == 0) return true;
      if (errno != EADDRINUSE) break;
    }
    const int err = errno;
    ::close(fd);
    fail(i, std::string("bind to a 127.0.0.1 source port: ") + std::strerror(err));
    return false;
  }

  void fail(std::size_t i, const std::string& why) {
    sh_.error("rank " + std::to_string(static_cast<int>(i) + first_) + ": " + why);
    Rank& r = ranks_[i];
    if (r.fd >= 0) ::epoll_ctl(ep_, EPOLL_CTL_DEL, r.fd, nullptr);  // level-triggered: would spin
    if (r.step != Step::done) {
      r.step = Step::done;
      r.done = Steady::now();
      if (r.active) --left_;
    }
  }

  void send_frame(std::size_t i, const std::string& f) {
    Rank& r = ranks_[i];
    // Frames are tiny and the socket's send buffer empty at each step: a short write is an error.
    if (::send(r.fd, f.data(), f.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(f.size())) {
      fail(i, std::string("send: ") + std::strerror(errno));
    }
  }

  void enter(std::size_t i, Step s) {
    Rank& r = ranks_[i];
    r.step = s;
    r.got = 0;
    const Frames& f = sh_.frames;
    switch (s) {
      case Step::hello:  // two writes, as torch's client does them
        send_frame(i, f.hello.substr(0, 5));
        send_frame(i, f.hello.substr(5));
        break;
      case Step::add_init:
        send_frame(i, f.add_init);
        break;
      case Step::add_one:
        send_frame(i, f.add_one);
        break;
      case Step::add_zero:
        send_frame(i, f.add_zero);
        break;
      case Step::wait_last:
        send_frame(i, f.wait_last);
        break;
      case Step::poll_sleep:
        sleepers_.emplace_back(Steady::now() + std::chrono::milliseconds(10), i);
        break;
      case Step::done:
        r.done = Steady::now();
        --left_;
        break;
      case Step::connecting:
        break;
    }
  }

  static std::size_t reply_size(Step s) {
    switch (s) {
      case Step::hello:
        return 4;
      case Step::add_init:
      case Step::add_one:
      case Step::add_zero:
        return 8;
      case Step::wait_last:
        return 1;
      default:
        return 0;
    }
  }

  void on_event(std::size_t i, bool cb, std::uint32_t events, const sockaddr_in& srv) {
    Rank& r = ranks_[i];
    if (cb) {
      if (!r.cb_connecting) return;
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(r.cb_fd, SOL_SOCKET, SO_ERROR, &err, &len);
      r.cb_connecting = false;
      ::epoll_ctl(ep_, EPOLL_CTL_DEL, r.cb_fd, nullptr);  // held open, never read
      if (err != 0) fail(i, std::string("callback connection: ") + std::strerror(err));
      return;
    }
    if (r.step == Step::done) return;
    if (r.step == Step::connecting) {
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(r.fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (err == ECONNREFUSED || err == ETIMEDOUT || err == ECONNRESET) {
        // torch's clients retry a refused connect until their timeout: do the same.
        ::close(r.fd);
        r.fd = -1;
        ++r.retries;
        start_connect(i, srv, false);
        return;
      }
      if (err != 0) {
        fail(i, std::string("connect: ") + std::strerror(err));
        return;
      }
      if ((events & EPOLLOUT) == 0) return;
      r.connected = Steady::now();
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u64 = static_cast<std::uint64_t>(i) << 1;
      ::epoll_ctl(ep_, EPOLL_CTL_MOD, r.fd, &ev);
      enter(i, a_.modern ? Step::hello : Step::add_init);
      return;
    }
    if (r.step == Step::poll_sleep) return;
    const std::size_t want = reply_size(r.step);
    const ssize_t n = ::recv(r.fd, r.reply + r.got, want - r.got, 0);
    if (n <= 0) {
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
      fail(i, n == 0 ? std::string("server closed the connection") : std::string("recv: ") + std::strerror(errno));
      return;
    }
    r.got = static_cast<std::uint8_t>(r.got + n);
    if (r.got < want) return;
    std::int64_t value = 0;
    if (want == 8) std::memcpy(&value, r.reply, 8);  // little-endian hosts only, like torch
    switch (r.step) {
      case Step::hello:
        if (std::memcmp(r.reply, "\x01\x02\x03\x04", 4) != 0) {
          fail(i, "PING echo does not match");
          return;
        }
        enter(i, Step::add_init);
        break;
      case Step::add_init:
        enter(i, Step::add_one);
        break;
      case Step::add_one:
        enter(i, Step::add_zero);
        break;
      case Step::add_zero:
        if (a_.poll) {
          enter(i, value == a_.world ? Step::done : Step::poll_sleep);
        } else {
          if (value == a_.world) send_frame(i, sh_.frames.set_last);
          enter(i, Step::wait_last);
        }
        break;
      case Step::wait_last:
        if (r.reply[0] != 0) {
          fail(i, "WAIT answered something other than STOP_WAITING");
          return;
        }
        enter(i, Step::done);
        break;
      default:
        break;
    }
  }

  // Every sleep is 10 ms, so the queue is in deadline order.
  void wake_pollers() {
    const auto now = Steady::now();
    while (!sleepers_.empty() && sleepers_.front().first <= now) {
      const std::size_t i = sleepers_.front().second;
      sleepers_.pop_front();
      if (ranks_[i].step == Step::poll_sleep) enter(i, Step::add_zero);
    }
  }

  Shared& sh_;
  const Args& a_;
  int first_;
  int ep_ = -1;
  std::vector<Rank> ranks_;
  std::size_t left_ = 0;
  std::deque<std::pair<Steady::time_point, std::size_t>> sleepers_;  // ranks in poll_sleep
};

long rss_kib(long pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atol(line.c_str() + 6);
  }
  return -1;
}

void raise_nofile(std::size_t want) {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
  if (rl.rlim_cur >= want) return;
  rlimit raised = rl;
  raised.rlim_cur = std::max<rlim_t>(rl.rlim_cur, want);
  if (raised.rlim_max < raised.rlim_cur) raised.rlim_max = raised.rlim_cur;  // root only
  if (::setrlimit(RLIMIT_NOFILE, &raised) != 0) {
    rl.rlim_cur = rl.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &rl);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  raise_nofile(static_cast<std::size_t>(a.clients) * (a.callback_conn ? 2 : 1) + 256);
  Shared sh;
  sh.args = &a;
  sh.frames = make_frames(a);
  if (std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range"); range) range >> sh.port_low >> sh.port_high;
  sh.next_port = static_cast<std::uint32_t>(Steady::now().time_since_epoch().count() % 65536);
  const long rss_before = a.server_pid ? rss_kib(a.server_pid) : -1;

  std::vector<std::unique_ptr<Worker>> workers;
  for (int t = 0; t < a.threads; ++t) {
    const int first = static_cast<int>(static_cast<long>(a.clients) * t / a.threads);
    const int last = static_cast<int>(static_cast<long>(a.clients) * (t + 1) / a.threads);
    workers.push_back(std::make_unique<Worker>(sh, first, last));
  }
  std::barrier start(a.threads + 1);
  std::barrier finish(a.threads + 1);
  Steady::time_point t0;
  std::vector<std::thread> threads;
  for (auto& w : workers) {
    threads.emplace_back([&, wp = w.get()] {
      start.arrive_and_wait();
      wp->run(t0 + std::chrono::duration_cast<Steady::duration>(std::chrono::duration<double>(a.timeout_s)));
      finish.arrive_and_wait();  // every rank done: hold the connections until main has read the RSS
      finish.arrive_and_wait();
    });
  }
  t0 = Steady::now();
  start.arrive_and_wait();
  finish.arrive_and_wait();
  const long rss_peak = a.server_pid ? rss_kib(a.server_pid) : -1;
  finish.arrive_and_wait();
  for (auto& t : threads) t.join();

  Steady::time_point last{};
  Steady::time_point connected{};
  std::uint64_t retries = 0;
  for (auto& w : workers) {
    last = std::max(last, w->last_done());
    connected = std::max(connected, w->last_connected());
    retries += w->retries();
  }
  auto ms = [&](Steady::time_point t) {
    return t == Steady::time_point{} ? -1.0 : std::chrono::duration<double, std::milli>(t - t0).count();
  };
  std::string esc;
  for (char ch : sh.first_error) esc += (ch == '"' || ch == '\\') ? std::string("\\") + ch : std::string(1, ch);
  std::printf(
      "{\"mode\":\"barrier-storm\",\"clients\":%d,\"pattern\":\"%s\",\"generation\":\"%s\",\"threads\":%d,"
      "\"release_to_last_ms\":%.2f,\"release_to_connected_ms\":%.2f,\"errors\":%ld,\"connect_retries\":%llu,"
      "\"server_rss_before_kib\":%ld,\"server_rss_peak_kib\":%ld,\"first_error\":\"%s\"}\n",
      a.clients, a.poll ? "poll" : "wait", a.modern ? "modern" : "legacy", a.threads, ms(last), ms(connected),
      sh.errors.load(), static_cast<unsigned long long>(retries), rss_before, rss_peak, esc.c_str());
  return sh.errors.load() == 0 ? 0 : 1;
}
