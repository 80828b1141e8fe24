#include "ddprun/agent/elastic.hpp"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>

#include "ddprun/agent/failure.hpp"
#include "ddprun/agent/worker_spec.hpp"
#include "ddprun/common/error.hpp"

namespace ddprun::agent {
namespace {

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

std::string numeric_host(const sockaddr* sa, socklen_t len) {
  char host[NI_MAXHOST] = {};
  if (::getnameinfo(sa, len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0) return {};
  std::string h(host);
  if (const auto pct = h.find('%'); pct != std::string::npos) h.resize(pct);  // drop a scope id
  return h;
}

// Numeric addresses for `host`, without reverse lookups.
std::vector<std::string> resolve_numeric(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  std::vector<std::string> out;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return out;
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    out.push_back(numeric_host(ai->ai_addr, ai->ai_addrlen));
  }
  ::freeaddrinfo(res);
  return out;
}

}  // namespace

bool uses_elastic_path(const AgentConfig& config) { return job_mode(config) != JobMode::single_node; }

bool is_static_multi_node(const AgentConfig& config) { return job_mode(config) == JobMode::static_multi_node; }

Endpoint rendezvous_endpoint(const AgentConfig& config) { return rendezvous_endpoints(config).front(); }

std::vector<Endpoint> rendezvous_endpoints(const AgentConfig& config) {
  if (is_static_multi_node(config)) {
    // A static --rdzv-endpoint is already here: the launcher folds it into master_addr and
    // master_port (torchrun's rule), so the dry run, the host and the joiners read one value.
    if (config.master_port == 0) {
      throw UsageError("a static multi-node job needs a fixed --master-port (got 0)",
                       "pass the same --master-addr and --master-port on every node (node rank 0 serves there)");
    }
    return {Endpoint{config.master_addr, config.master_port}};
  }
  // etcd: the first member stands for the cluster (the address this node advertises).
  if (!config.etcd.endpoints.empty()) return {config.etcd.endpoints.front()};
  if (config.rdzv_endpoint.empty()) {
    throw UsageError("an elastic job needs --rdzv-endpoint",
                     "pass --rdzv-endpoint=HOST[:PORT], the same on every node");
  }
  return parse_endpoint_list(config.rdzv_endpoint, 29400, "--rdzv-endpoint");
}

worker_env::Placement placement_of(const AgentConfig& config, const rendezvous::Assignment& a) {
  worker_env::Placement p = local_placement(config);
  p.local_world_size = a.local_world_size;
  p.group_rank = a.group_rank;
  p.group_world_size = a.group_world_size;
  p.rank_offset = a.rank_offset;
  p.world_size = a.world_size;
  p.master_addr = a.master_addr;
  p.master_port = a.master_port;
  p.restart_count = a.restart_count;
  p.max_restarts = a.max_restarts;
  if (job_mode(config) == JobMode::static_multi_node) {
    p.group_rank = config.node_rank;
    p.rank_offset = config.node_rank * config.nproc_per_node;
  }
  return p;
}

rendezvous::JobConfig job_config(const AgentConfig& config) {
  rendezvous::JobConfig c;
  // static: the world is always max nodes (torchrun's static rendezvous), nothing elastic.
  c.min_nodes = is_static_multi_node(config) ? config.max_nodes : config.min_nodes;
  c.max_nodes = config.max_nodes;
  c.max_restarts = config.max_restarts;
  c.join_timeout = config.rdzv.join_timeout;
  c.last_call_timeout = config.rdzv.last_call_timeout;
  c.close_timeout = config.rdzv.close_timeout;
  c.heartbeat_interval = config.rdzv.heartbeat_interval;
  c.missed_heartbeats = config.rdzv.missed_heartbeats;
  c.exit_barrier_timeout = config.rdzv.exit_barrier_timeout;
  return c;
}

std::string advertised_address(const AgentConfig& config, const Endpoint& peer) {
  if (config.local_addr) return *config.local_addr;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(peer.port == 0 ? 9 : peer.port);
  if (const int rc = ::getaddrinfo(peer.host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    throw NetworkError("cannot resolve the rendezvous host '" + peer.host + "': " + ::gai_strerror(rc),
                       "check --rdzv-endpoint, or pass --local-addr with this node's address");
  }
  std::string found;
  std::string last_error = "no address";
  for (addrinfo* ai = res; ai != nullptr && found.empty(); ai = ai->ai_next) {
    Fd s{::socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0)};
    if (s.fd < 0) continue;
    // connect() on a UDP socket only picks the route and source address; nothing is sent.
    if (::connect(s.fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      last_error = std::strerror(errno);
      continue;
    }
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (::getsockname(s.fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {  // NOLINT
      found = numeric_host(reinterpret_cast<sockaddr*>(&local), len);           // NOLINT
    }
  }
  ::freeaddrinfo(res);
  if (found.empty()) {
    throw NetworkError("no local address routes to the rendezvous host " + peer.to_string() + ": " + last_error,
                       "pass --local-addr with the address the other nodes should use for this node");
  }
  return found;
}

std::string advertised_address(const AgentConfig& config, const std::vector<Endpoint>& peers) {
  if (config.local_addr) return *config.local_addr;
  if (peers.size() == 1) return advertised_address(config, peers.front());
  std::string errors;
  for (const Endpoint& peer : peers) {
    try {
      return advertised_address(config, peer);
    } catch (const NetworkError& e) {
      errors += (errors.empty() ? "" : "; ") + e.message();
    }
  }
  throw NetworkError("cannot pick this node's address: no rendezvous endpoint resolves or has a route: " + errors,
                     "check --rdzv-endpoint, or pass --local-addr with this node's address");
}

bool is_local_address(const std::string& host) {
  const auto addrs = resolve_numeric(host);
  if (addrs.empty()) return false;
  std::vector<std::string> mine;
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) == 0) {
    for (ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
      if (i->ifa_addr == nullptr) continue;
      const int fam = i->ifa_addr->sa_family;
      if (fam != AF_INET && fam != AF_INET6) continue;
      const socklen_t len = fam == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
      mine.push_back(numeric_host(i->ifa_addr, len));
    }
    ::freeifaddrs(ifs);
  }
  for (const auto& a : addrs) {
    if (a.rfind("127.", 0) == 0 || a == "::1") return true;  // the whole of 127/8 is loopback
    for (const auto& m : mine) {
      if (a == m) return true;
    }
  }
  return false;
}

bool may_host(const AgentConfig& config, const Endpoint& endpoint, const std::string& advertised) {
  if (is_static_multi_node(config)) return config.node_rank == 0;  // node 0 serves, as in torchrun
  if (config.rdzv.is_host) return *config.rdzv.is_host;
  if (config.local_addr) {
    if (endpoint.host == advertised) return true;
    const auto a = resolve_numeric(endpoint.host);
    const auto b = resolve_numeric(advertised);
    for (const auto& x : a) {
      for (const auto& y : b) {
        if (x == y) return true;
      }
    }
  }
  // As torch (_matches_machine_hostname): an endpoint naming this machine may be hosted here,
  // whatever --local-addr says: a multi-NIC head node advertises its fabric address while the
  // endpoint names it by its host name. Several agents on one machine: the first to bind hosts,
  // the others join it (host_embedded).
  return is_local_address(endpoint.host);
}

bool tcp_connects(const Endpoint& endpoint, std::chrono::milliseconds timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(endpoint.port);
  if (::getaddrinfo(endpoint.host.c_str(), port.c_str(), &hints, &res) != 0) return false;
  bool ok = false;
  for (addrinfo* ai = res; ai != nullptr && !ok; ai = ai->ai_next) {
    Fd s{::socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)};
    if (s.fd < 0) continue;
    if (::connect(s.fd, ai->ai_addr, ai->ai_addrlen) == 0) {
      ok = true;
      break;
    }
    if (errno != EINPROGRESS) continue;
    pollfd p{s.fd, POLLOUT, 0};
    if (::poll(&p, 1, static_cast<int>(timeout.count())) == 1) {
      int err = 0;
      socklen_t len = sizeof(err);
      ok = ::getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
    }
  }
  ::freeaddrinfo(res);
  return ok;
}

std::string random_instance_id() {
  std::random_device rd;
  std::mt19937_64 gen((static_cast<std::uint64_t>(rd()) << 32) ^ rd());
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  std::uint64_t v = gen();
  for (int i = 0; i < 12; ++i) {
    out += kHex[v & 0xF];
    v >>= 4;
  }
  return out;
}

rendezvous::WorkerFailure make_failure(std::uint64_t round, const rendezvous::NodeId& node, int rank, int local_rank,
                                       const ExitStatus& status, const std::string& message) {
  rendezvous::WorkerFailure f;
  f.round = round;
  f.node = node;
  f.global_rank = rank;
  f.local_rank = local_rank;
  if (status.signal != 0) {
    f.signal = status.signal;
  } else {
    f.exit_code = status.exit_code;
  }
  f.message = message;
  return f;
}

std::string format_job_failed(const rendezvous::SendJobFailed& failed, const std::string& command,
                              const std::vector<FailureReport>& local_others, const FailureReport* local_root) {
  std::string out = "ddprun: job '" + failed.run_id + "' failed: " + failed.reason + "\n";
  if (!failed.root_cause) return out;
  const auto& rc = *failed.root_cause;
  const std::string where = "group rank " + std::to_string(rc.group_rank) + ", node " + rc.failure.node.to_string();
  if (local_root != nullptr) {
    FailureReport report = *local_root;
    report.host.clear();  // the summary's host: this node's address
    report.note = report.note.empty() ? where : report.note + "; " + where;
    out += format_failure_summary(command, rc.node_addr, report, local_others);
    return out;
  }
  FailureReport report;
  report.rank = rc.failure.global_rank;
  report.local_rank = rc.failure.local_rank;
  report.pid = 0;
  report.status =
      rc.failure.signal ? ExitStatus::killed(*rc.failure.signal) : ExitStatus::exited(rc.failure.exit_code.value_or(1));
  report.time = std::chrono::system_clock::now();
  if (!rc.failure.message.empty()) {
    ErrorFileContents e;
    e.message = rc.failure.message;
    report.error = e;
  }
  report.note = where;
  out += format_failure_summary(command, rc.node_addr, report, local_others);
  return out;
}

}  // namespace ddprun::agent
