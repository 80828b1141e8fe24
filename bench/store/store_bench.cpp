// store_bench: load generator for c10d TCPStore servers, using ddprun's StoreClient.
//
//   store_bench serial     --port P [--host H] [--generation legacy|modern] --op get|add [--n N]
//   store_bench throughput --port P ... --op get|add [--clients 50] [--seconds S]
//   store_bench barrier    --port P ... [--clients N] [--tag T]
//   store_bench throughput-epoll --port P ... [--clients 50] [--seconds S]
//     (ADD only; ONE thread multiplexes the C connections with epoll, one request in flight
//      per connection, like redis-benchmark: measures the server, not thread switching)
//   (all modes: [--pipelined-get 1] = StoreClientOptions::pipelined_get)
//
// Prints one JSON object on stdout. serial: per-op latency (p50/p99/mean, µs) of N ops on
// one connection. throughput: C client threads, each its own connection, one request in
// flight each, for S seconds: completed ops/s. barrier: N client threads released at once;
// each connects, add(barrier_T, 1), the one that reaches N sets done_T, all wait(done_T);
// reports release -> last client done (ms) and the errors (resets/timeouts) seen.
// run.py (same folder) runs these side by side against ddprun-rdzvd and torch's server.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ddprun/common/error.hpp"
#include "ddprun/rendezvous/store_client.hpp"

namespace {

using ddprun::rendezvous::Generation;
using ddprun::rendezvous::StoreClient;
using ddprun::rendezvous::StoreClientOptions;
using Steady = std::chrono::steady_clock;

struct Args {
  std::string mode;
  StoreClientOptions opt;
  std::string op = "add";
  long n = 20000;
  int clients = 50;
  double seconds = 2.0;
  std::string tag = "0";
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "store_bench: " << why
            << "\nusage: store_bench serial|throughput|barrier --port P [--host H] "
               "[--generation legacy|modern] [--op get|add] [--n N] [--clients C] "
               "[--seconds S] [--tag T] [--pipelined-get 0|1]\n";
  std::exit(2);
}

Args parse(int argc, char** argv) {
  if (argc < 2) usage("missing mode");
  Args a;
  a.mode = argv[1];
  a.opt.port = 0;
  a.opt.connect_timeout = std::chrono::seconds(30);
  a.opt.timeout = std::chrono::seconds(60);
  for (int i = 2; i < argc; i += 2) {
    if (i + 1 >= argc) usage(std::string("option ") + argv[i] + " needs a value");
    const std::string k = argv[i];
    const std::string v = argv[i + 1];
    if (k == "--host")
      a.opt.host = v;
    else if (k == "--port")
      a.opt.port = static_cast<std::uint16_t>(std::stoul(v));
    else if (k == "--generation") {
      if (v != "legacy" && v != "modern") usage("--generation legacy|modern");
      a.opt.generation = v == "legacy" ? Generation::legacy : Generation::modern;
    } else if (k == "--op")
      a.op = v;
    else if (k == "--n")
      a.n = std::stol(v);
    else if (k == "--clients")
      a.clients = std::stoi(v);
    else if (k == "--seconds")
      a.seconds = std::stod(v);
    else if (k == "--tag")
      a.tag = v;
    else if (k == "--pipelined-get")
      a.opt.pipelined_get = v == "1";
    else
      usage("unknown option " + k);
  }
  if (a.opt.port == 0) usage("--port is required");
  if (a.op != "get" && a.op != "add") usage("--op get|add");
  return a;
}

double us(Steady::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

// One store op of the requested kind.
// `key` is read by get; add counts on key + "_ctr" (ADD needs a decimal value).
void do_op(StoreClient& c, const std::string& op, const std::string& key) {
  if (op == "add") {
    c.add(key + "_ctr", 1);
  } else {
    c.get(key);
  }
}

int serial(const Args& a) {
  StoreClient c(a.opt);
  const std::string key = "bench_key";
  c.set(key, std::string(16, 'v'));
  for (int i = 0; i < 1000; ++i) do_op(c, a.op, key);  // warm-up
  std::vector<double> lat(static_cast<std::size_t>(a.n));
  const auto t0 = Steady::now();
  for (auto& l : lat) {
    const auto s = Steady::now();
    do_op(c, a.op, key);
    l = us(Steady::now() - s);
  }
  const double total = us(Steady::now() - t0);
  std::sort(lat.begin(), lat.end());
  auto pct = [&](double p) { return lat[static_cast<std::size_t>(p * static_cast<double>(lat.size() - 1))]; };
  std::printf(
      "{\"mode\":\"serial\",\"op\":\"%s\",\"n\":%ld,\"p50_us\":%.2f,\"p99_us\":%.2f,"
      "\"mean_us\":%.2f}\n",
      a.op.c_str(), a.n, pct(0.5), pct(0.99), total / static_cast<double>(a.n));
  return 0;
}

int throughput(const Args& a) {
  std::vector<std::unique_ptr<StoreClient>> clients;
  for (int i = 0; i < a.clients; ++i) clients.push_back(std::make_unique<StoreClient>(a.opt));
  clients[0]->set("tp_key", std::string(16, 'v'));
  std::atomic<bool> go{false};
  std::atomic<bool> stop{false};
  std::atomic<long> errors{0};
  std::vector<long> counts(static_cast<std::size_t>(a.clients), 0);
  std::vector<std::thread> threads;
  for (int i = 0; i < a.clients; ++i) {
    threads.emplace_back([&, i] {
      auto& c = *clients[static_cast<std::size_t>(i)];
      const std::string key = "tp_key";
      go.wait(false);
      long n = 0;
      try {
        while (!stop.load(std::memory_order_relaxed)) {
          do_op(c, a.op, key);
          ++n;
        }
      } catch (const std::exception& e) {
        ++errors;
        std::cerr << "client " << i << ": " << e.what() << "\n";
      }
      counts[static_cast<std::size_t>(i)] = n;
    });
  }
  const auto t0 = Steady::now();
  go = true;
  go.notify_all();
  std::this_thread::sleep_for(std::chrono::duration<double>(a.seconds));
  stop = true;
  for (auto& t : threads) t.join();
  const double secs = std::chrono::duration<double>(Steady::now() - t0).count();
  long total = 0;
  for (long n : counts) total += n;
  std::printf(
      "{\"mode\":\"throughput\",\"op\":\"%s\",\"clients\":%d,\"seconds\":%.3f,"
      "\"ops\":%ld,\"ops_per_s\":%.0f,\"errors\":%ld}\n",
      a.op.c_str(), a.clients, secs, total, static_cast<double>(total) / secs, errors.load());
  return errors.load() == 0 ? 0 : 1;
}

int barrier(const Args& a) {
  const std::string bkey = "barrier_" + a.tag;
  const std::string dkey = "done_" + a.tag;
  std::atomic<bool> go{false};
  std::atomic<int> ready{0};
  std::atomic<long> errors{0};
  std::atomic<unsigned long> extra_attempts{0};
  std::vector<Steady::time_point> done(static_cast<std::size_t>(a.clients));
  std::mutex err_mu;
  std::string first_error;
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(a.clients));
  for (int i = 0; i < a.clients; ++i) {
    threads.emplace_back([&, i] {
      ++ready;
      go.wait(false);
      try {
        StoreClient c(a.opt);
        if (c.add(bkey, 1) == a.clients) c.set(dkey, "1");
        c.wait({dkey});
        done[static_cast<std::size_t>(i)] = Steady::now();
        extra_attempts += c.connect_attempts() - 1;
      } catch (const std::exception& e) {
        ++errors;
        done[static_cast<std::size_t>(i)] = Steady::now();
        std::lock_guard<std::mutex> lock(err_mu);
        if (first_error.empty()) first_error = e.what();
      }
    });
  }
  while (ready.load() < a.clients) std::this_thread::yield();
  const auto t0 = Steady::now();
  go = true;
  go.notify_all();
  for (auto& t : threads) t.join();
  const auto last = *std::max_element(done.begin(), done.end());
  std::string esc;
  for (char ch : first_error) esc += (ch == '"' || ch == '\\') ? std::string("\\") + ch : std::string(1, ch);
  std::printf(
      "{\"mode\":\"barrier\",\"clients\":%d,\"release_to_last_ms\":%.2f,\"errors\":%ld,"
      "\"connect_retries\":%lu,\"first_error\":\"%s\"}\n",
      a.clients, us(last - t0) / 1000.0, errors.load(), extra_attempts.load(), esc.c_str());
  return errors.load() == 0 ? 0 : 1;
}

// Raw-protocol ADD load from one thread over `clients` connections (IPv4 host only).
int throughput_epoll(const Args& a) {
  const bool modern = a.opt.generation == Generation::modern;
  const std::uint8_t add_code = modern ? 4 : 3;
  std::string req;
  req.push_back(static_cast<char>(add_code));
  const std::string key = a.opt.key_prefix + "tpe_ctr";
  auto put_le = [&req](std::uint64_t v) {
    for (int i = 0; i < 8; ++i) req.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
  };
  put_le(key.size());
  req += key;
  put_le(1);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(a.opt.port);
  if (::inet_pton(AF_INET, a.opt.host.c_str(), &addr.sin_addr) != 1) usage("throughput-epoll needs an IPv4 --host");
  const int ep = ::epoll_create1(EPOLL_CLOEXEC);
  std::vector<int> fds;
  std::vector<int> got(static_cast<std::size_t>(a.clients), 0);
  for (int i = 0; i < a.clients; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      std::cerr << "store_bench: connect: " << std::strerror(errno) << "\n";
      return 1;
    }
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (modern) {  // VALIDATE + PING, wait for the echo
      const char hello[] = {0, '\xce', '\xf7', '\x85', '\x3c', 13, 1, 2, 3, 4};
      char echo[4];
      if (::send(fd, hello, sizeof hello, MSG_NOSIGNAL) != sizeof hello || ::recv(fd, echo, 4, MSG_WAITALL) != 4) {
        std::cerr << "store_bench: handshake failed\n";
        return 1;
      }
    }
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u32 = static_cast<std::uint32_t>(i);
    ::epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
    fds.push_back(fd);
  }
  long ops = 0;
  long errors = 0;
  const auto t0 = Steady::now();
  const auto end = t0 + std::chrono::duration_cast<Steady::duration>(std::chrono::duration<double>(a.seconds));
  for (int fd : fds) ::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  std::vector<epoll_event> events(static_cast<std::size_t>(a.clients));
  char buf[256];
  while (Steady::now() < end) {
    const int n = ::epoll_wait(ep, events.data(), a.clients, 100);
    for (int e = 0; e < n; ++e) {
      const std::uint32_t i = events[static_cast<std::size_t>(e)].data.u32;
      const ssize_t r = ::recv(fds[i], buf, sizeof buf, 0);
      if (r <= 0) {
        ++errors;
        continue;
      }
      got[i] += static_cast<int>(r);
      while (got[i] >= 8) {  // one i64 reply per ADD
        got[i] -= 8;
        ++ops;
        ::send(fds[i], req.data(), req.size(), MSG_NOSIGNAL);
      }
    }
  }
  const double secs = std::chrono::duration<double>(Steady::now() - t0).count();
  for (int fd : fds) ::close(fd);
  ::close(ep);
  std::printf(
      "{\"mode\":\"throughput-epoll\",\"op\":\"add\",\"clients\":%d,\"seconds\":%.3f,"
      "\"ops\":%ld,\"ops_per_s\":%.0f,\"errors\":%ld}\n",
      a.clients, secs, ops, static_cast<double>(ops) / secs, errors);
  return errors == 0 ? 0 : 1;
}

void raise_nofile() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &rl);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  raise_nofile();
  try {
    if (a.mode == "serial") return serial(a);
    if (a.mode == "throughput") return throughput(a);
    if (a.mode == "barrier") return barrier(a);
    if (a.mode == "throughput-epoll") return throughput_epoll(a);
    usage("unknown mode " + a.mode);
  } catch (const ddprun::Error& e) {
    std::cerr << "store_bench: " << e.what() << "\n";
    return 1;
  }
}
