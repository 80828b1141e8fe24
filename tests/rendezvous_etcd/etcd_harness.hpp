#pragma once
// Test harness: real etcd members (Debian's /usr/bin/etcd) on 127.0.0.1 with ports picked free,
// data under a temp dir, output captured to <dir>/<name>.log. A member is ready when it logs
// "serving client traffic" (read from its stderr pipe, no sleeping). Members die with
// the test process (PR_SET_PDEATHSIG) and are SIGKILLed by the destructor.
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace ddprun::test {

// A port for etcd, which must be told its ports up front (it cannot bind port 0 and say which it
// got). Not from bind(0): two calls in a row could get the same port back (the first probe's
// socket is closed by then), and a member's client and peer URLs then collided ("bind: address
// already in use"). Taken at random below the kernel's ephemeral range, where no bind(0) or
// connect() of another socket takes it meanwhile, away from torch's 29400 and 29500, never one
// this process handed out before, and bindable on 127.0.0.1 now.
inline std::uint16_t free_port() {
  static std::set<std::uint16_t> given;
  static std::mt19937 rng{std::random_device{}()};
  int low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low;
  std::uniform_int_distribution<int> pick(std::max(2048, low - 12000), std::max(2049, low - 1));
  // Where the ephemeral range starts low (some hosts tune it to "1024 65535") nothing is below
  // it: bind(0), still never a port handed out before.
  const bool below = low > 4096;
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const auto port = static_cast<std::uint16_t>(below ? pick(rng) : 0);
    if ((port >= 29300 && port <= 29600) || given.count(port) != 0) continue;
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw std::runtime_error("socket");
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    socklen_t len = sizeof a;
    const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
    ::close(fd);
    const auto got = ntohs(a.sin_port);
    if (!free || given.count(got) != 0) continue;
    given.insert(got);
    return got;
  }
  throw std::runtime_error("no free port below " + std::to_string(low));
}

inline std::filesystem::path make_temp_dir(const std::string& tag) {
  std::string templ = (std::filesystem::temp_directory_path() / ("ddprun-etcd-" + tag + "-XXXXXX")).string();
  if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp");
  return templ;
}

// Runs a command with /bin/sh; returns its exit status and captures stdout+stderr.
inline int run_shell(const std::string& cmd, std::string* output = nullptr) {
  std::string full = "( " + cmd + " ) 2>&1";
  FILE* p = ::popen(full.c_str(), "r");
  if (p == nullptr) return -1;
  std::string out;
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int st = ::pclose(p);
  if (output != nullptr) *output = out;
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

struct EtcdMember {
  std::string name;
  std::uint16_t client_port = 0;
  std::uint16_t peer_port = 0;
  std::filesystem::path data_dir;
  std::filesystem::path log_file;
  pid_t pid = -1;
  std::thread reader;
  std::mutex mu;
  std::condition_variable cv;
  bool ready = false;
  bool exited = false;

  std::string client_url(bool tls) const {
    return (tls ? "https://127.0.0.1:" : "http://127.0.0.1:") + std::to_string(client_port);
  }
  std::string peer_url() const { return "http://127.0.0.1:" + std::to_string(peer_port); }
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(client_port); }

  void start(const std::vector<std::string>& args) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
    ready = exited = false;
    pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::dup2(fds[1], 1);
      ::dup2(fds[1], 2);
      std::vector<char*> argv;
      argv.push_back(const_cast<char*>("/usr/bin/etcd"));
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv("/usr/bin/etcd", argv.data());
      ::_exit(127);
    }
    ::close(fds[1]);
    if (reader.joinable()) reader.join();
    reader = std::thread([this, fd = fds[0]] {
      std::ofstream out(log_file, std::ios::app);
      std::string line;
      char buf[4096];
      ssize_t n;
      while ((n = ::read(fd, buf, sizeof buf)) > 0) {
        out.write(buf, n);
        out.flush();
        line.append(buf, static_cast<std::size_t>(n));
        if (line.find("serving client traffic") != std::string::npos) {
          std::lock_guard<std::mutex> lk(mu);
          ready = true;
          cv.notify_all();
        }
        if (line.size() > 8192) line.erase(0, line.size() - 100);
      }
      ::close(fd);
      std::lock_guard<std::mutex> lk(mu);
      exited = true;
      cv.notify_all();
    });
  }

  bool wait_ready(std::chrono::seconds timeout) {
    std::unique_lock<std::mutex> lk(mu);
    return cv.wait_for(lk, timeout, [&] { return ready || exited; }) && ready;
  }

  void kill_now() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      pid = -1;
    }
    if (reader.joinable()) reader.join();
  }

  ~EtcdMember() { kill_now(); }
};

struct TlsFiles {
  std::string ca, server_cert, server_key, client_cert, client_key, other_ca;
};

// A CA, a server certificate for 127.0.0.1 (server and client auth: etcd's gateway dials its own
// port with it) and a client certificate, all made with the openssl CLI.
inline TlsFiles make_tls_files(const std::filesystem::path& dir) {
  const std::string d = dir.string();
  const std::string script =
      "set -e; cd '" + d +
      "'; "
      "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=ddprun-test-ca -keyout ca.key -out ca.pem; "
      "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=other-ca -keyout other.key -out other.pem; "
      "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\nextendedKeyUsage=serverAuth,clientAuth\\n' > srv.ext; "
      "openssl req -newkey rsa:2048 -nodes -subj /CN=127.0.0.1 -keyout server.key -out server.csr; "
      "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile srv.ext -out "
      "server.pem; "
      "printf 'extendedKeyUsage=clientAuth\\n' > cli.ext; "
      "openssl req -newkey rsa:2048 -nodes -subj /CN=root -keyout client.key -out client.csr; "
      "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile cli.ext -out "
      "client.pem";
  std::string out;
  if (run_shell(script, &out) != 0) throw std::runtime_error("openssl failed: " + out);
  return {d + "/ca.pem", d + "/server.pem", d + "/server.key", d + "/client.pem", d + "/client.key", d + "/other.pem"};
}

// One etcd cluster of `n` members on loopback.
class EtcdCluster {
 public:
  explicit EtcdCluster(int n, const std::string& tag, std::vector<std::string> extra = {}, bool tls = false)
      : dir_(make_temp_dir(tag)), tls_(tls), extra_(std::move(extra)) {
    for (int i = 0; i < n; ++i) {
      auto m = std::make_unique<EtcdMember>();
      m->name = "m" + std::to_string(i);
      m->client_port = free_port();
      m->peer_port = free_port();
      m->data_dir = dir_ / (m->name + ".etcd");
      m->log_file = dir_ / (m->name + ".log");
      members_.push_back(std::move(m));
    }
    for (int i = 0; i < n; ++i) start(i, "new");
    for (auto& m : members_) {
      if (!m->wait_ready(std::chrono::seconds(30)))
        throw std::runtime_error("etcd member " + m->name + " did not get ready; see " + m->log_file.string());
    }
  }
  ~EtcdCluster() {
    members_.clear();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  const std::filesystem::path& dir() const { return dir_; }
  EtcdMember& member(int i) { return *members_[static_cast<std::size_t>(i)]; }
  int size() const { return static_cast<int>(members_.size()); }

  // "127.0.0.1:a,127.0.0.1:b,..."
  std::string endpoints() const {
    std::string s;
    for (const auto& m : members_) s += (s.empty() ? "" : ",") + m->endpoint();
    return s;
  }

  void restart(int i) {
    start(i, "existing");
    if (!member(i).wait_ready(std::chrono::seconds(30)))
      throw std::runtime_error("etcd member did not get ready after restart");
  }

  // Index of the current leader according to etcdctl, or -1.
  int leader(const std::string& ctl_flags = "") const {
    for (std::size_t i = 0; i < members_.size(); ++i) {
      if (members_[i]->pid <= 0) continue;
      std::string out;
      if (run_shell("ETCDCTL_API=3 etcdctl --dial-timeout=1s --command-timeout=2s " + ctl_flags +
                        " --endpoints=" + members_[i]->client_url(tls_) + " endpoint status -w fields",
                    &out) != 0)
        continue;
      // "MemberID" : 123 ... "Leader" : 123
      auto field = [&](const std::string& name) {
        const auto p = out.find("\"" + name + "\" : ");
        if (p == std::string::npos) return std::string();
        const auto s = p + name.size() + 5;
        return out.substr(s, out.find('\n', s) - s);
      };
      if (!field("MemberID").empty() && field("MemberID") == field("Leader")) return static_cast<int>(i);
    }
    return -1;
  }

 private:
  void start(int i, const std::string& state) {
    EtcdMember& m = member(i);
    std::string cluster;
    for (const auto& x : members_) cluster += (cluster.empty() ? "" : ",") + x->name + "=" + x->peer_url();
    std::vector<std::string> args = {"--name",
                                     m.name,
                                     "--data-dir",
                                     m.data_dir.string(),
                                     "--listen-client-urls",
                                     m.client_url(tls_),
                                     "--advertise-client-urls",
                                     m.client_url(tls_),
                                     "--listen-peer-urls",
                                     m.peer_url(),
                                     "--initial-advertise-peer-urls",
                                     m.peer_url(),
                                     "--initial-cluster",
                                     cluster,
                                     "--initial-cluster-state",
                                     state,
                                     "--initial-cluster-token",
                                     "ddprun-test",
                                     "--heartbeat-interval",
                                     "50",
                                     "--election-timeout",
                                     "500",
                                     "--logger",
                                     "zap",
                                     "--log-outputs",
                                     "stderr"};
    args.insert(args.end(), extra_.begin(), extra_.end());
    m.start(args);
  }

  std::filesystem::path dir_;
  bool tls_;
  std::vector<std::string> extra_;
  std::vector<std::unique_ptr<EtcdMember>> members_;
};

// Runs `io` until `done()` or the timeout; true when done() held.
inline bool run_until(boost::asio::io_context& io, const std::function<bool()>& done,
                      std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    io.restart();
    io.run_one_for(std::chrono::milliseconds(20));
  }
  return true;
}

}  // namespace ddprun::test
