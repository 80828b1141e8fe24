// The single-node rendezvous backend: this node is the whole job. Each round is local; after a
// failure the local restart budget (--max-restarts) decides between a restart and the end of
// the job, whose root-cause summary this backend prints.
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/ip/address.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ip/v6_only.hpp>
#include <boost/asio/post.hpp>
#include <spdlog/spdlog.h>

#include "ddprun/common/console.hpp"
#include "ddprun/agent/elastic.hpp"
#include "ddprun/agent/entrypoint.hpp"
#include "ddprun/agent/output.hpp"
#include "ddprun/agent/rendezvous_backend.hpp"
#include "ddprun/agent/worker_spec.hpp"
#include "ddprun/common/error.hpp"

namespace asio = boost::asio;

namespace ddprun::agent {

namespace {

std::string hostname() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) {
    return "localhost";
  }
  return buf;
}

class SingleNodeBackend final : public RendezvousBackend {
 public:
  SingleNodeBackend(asio::io_context& io, const AgentConfig& config, BackendEvents events)
      : io_(io), config_(config), events_(std::move(events)) {}

  void start() override {
    store_ = open_worker_store(io_, config_.master_addr, config_.standalone ? 0 : config_.master_port,
                               config_.share_worker_store, true,
                               "the master port is probably in use by another job: pass --master-port 0 (any free "
                               "port) or --standalone, or pick another --master-port");
  }

  std::string comm_id_host() const override { return config_.master_addr; }
  void set_nccl_offer(std::vector<std::uint8_t> offer) override { offer_ = std::move(offer); }

  void next_round() override {
    if (restarts_ > 0) {
      spdlog::warn("restarting worker group (attempt {} of {}): local rank {} ended with {}", restarts_,
                   config_.max_restarts, failure_.local_rank, describe(failure_.status));
      store_->reset();  // a fresh, empty key space for the new attempt
    }
    RoundAssignment a;
    a.round = static_cast<std::uint64_t>(restarts_);
    a.placement = local_placement(config_);
    a.placement.master_port = store_->port();
    a.placement.restart_count = restarts_;
    a.nccl_id = offer_;
    a.dir_name = "attempt_" + std::to_string(restarts_);
    post([this, a] { events_.on_assignment(a); });
  }

  void report_failure(std::uint64_t /*round*/, const FailureReport& failure) override {
    failure_ = failure;
    failed_ = true;
  }

  void report_success(std::uint64_t /*round*/) override {
    post([this] { events_.on_job_completed(); });
  }

  std::optional<FailureReport> local_root_cause() const override { return root_cause_; }

  void update_diagnosis(const std::string& block) override {
    if (failed_) failure_.diagnosis = block;
  }

  void await_verdict(int exit_code, std::vector<FailureReport> others) override {
    if (restarts_ < config_.max_restarts) {
      ++restarts_;
      failed_ = false;  // the next attempt starts clean
      post([this] { events_.on_restart(); });
      return;
    }
    failed_ = false;
    FailureReport report = failure_;
    load_error_file(report);
    console::write(STDERR_FILENO, format_failure_summary(entrypoint_name(config_), hostname(), report, others));
    root_cause_ = report;
    post([this, exit_code] { events_.on_job_failed(exit_code); });
  }

  void leave(int exit_code, const std::string& why) override {
    if (failed_) {
      // A rank had failed before the signal came (a Ctrl-C during the teardown's grace): what
      // failed is still the news, with its diagnosis.
      FailureReport report = failure_;
      load_error_file(report);
      console::write(STDERR_FILENO, format_failure_summary(entrypoint_name(config_), hostname(), report, {}));
      root_cause_ = report;
    }
    spdlog::warn("workers stopped {}; exiting with {}", why, exit_code);
  }

  void stop(std::function<void()> stopped) override {
    stopped_ = true;
    if (store_) store_->stop();
    stopped();
  }

 private:
  template <typename F>
  void post(F f) {
    asio::post(io_, [this, f = std::move(f)] {
      if (!stopped_) f();
    });
  }

  asio::io_context& io_;
  const AgentConfig& config_;
  BackendEvents events_;
  std::unique_ptr<WorkerStore> store_;
  std::vector<std::uint8_t> offer_;
  FailureReport failure_;
  std::optional<FailureReport> root_cause_;  // the job's failure, as summarised (local_root_cause)
  bool failed_ = false;                      // this attempt reported a failure
  int restarts_ = 0;
  bool stopped_ = false;
};

}  // namespace

// The worker store binds the master address itself when it is numeric, else every interface,
// IPv6 and IPv4 (a name like "localhost" may resolve to several addresses, of either family: the
// workers connect to whichever their resolver gives first, as torch's own TCPStore server, which
// listens on :: too). The store server falls back to 0.0.0.0 where IPv6 is missing.
std::string bind_host(const std::string& addr) {
  boost::system::error_code ec;
  std::string host = addr;
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  asio::ip::make_address(host, ec);
  return ec ? std::string("::") : host;
}

namespace {

// The error for a worker store (or its reserved port) that cannot be bound: `hint` is for a port
// in use; an address that is not this machine's (EADDRNOTAVAIL) needs another one, and other
// errors keep the bind's own hint. `what`: "host the worker store" or "reserve ...".
NetworkError worker_store_error(const std::string& what, const std::string& addr, const std::string& host,
                                std::uint16_t port, bool name_port, const std::string& hint, const std::string& message,
                                const std::string& bind_hint) {
  std::string why = hint;
  if (bind_hint.find("not one of this machine's") != std::string::npos) {
    why = "--master-addr " + addr +
          " is not an address of this machine, and the worker store is hosted here: give one of its addresses or "
          "its host name (or leave --master-addr out)";
  } else if (bind_hint.find("port in use") == std::string::npos) {
    why = bind_hint;
  }
  return NetworkError("cannot " + what + " on " + host + (name_port ? ":" + std::to_string(port) : "") + ": " + message,
                      why);
}

// Binds (never listens) `ep` with SO_REUSEADDR (and dual-stack for "::"). Returns the descriptor
// (close-on-exec from the start) and the port bound, or -1 with `ec`.
std::pair<int, std::uint16_t> bind_reserved(asio::io_context& io, const asio::ip::tcp::endpoint& ep,
                                            boost::system::error_code& ec) {
  using asio::ip::tcp;
  const int raw = ::socket(ep.protocol().family(), SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (raw < 0) {
    ec.assign(errno, boost::system::system_category());
    return {-1, 0};
  }
  tcp::acceptor a(io);
  a.assign(ep.protocol(), raw, ec);
  if (ec) {
    ::close(raw);
    return {-1, 0};
  }
  if (ep.address().is_v6()) a.set_option(asio::ip::v6_only(false), ec);
  if (!ec) a.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) a.bind(ep, ec);
  if (ec) return {-1, 0};
  const std::uint16_t bound = a.local_endpoint(ec).port();
  if (ec) return {-1, 0};
  return {a.release(ec), bound};
}

// The reservation for the workers' rank 0, whose TCPStore server binds every address ("::",
// dual-stack, or 0.0.0.0): the same, so that no plain bind on any address of the machine takes
// the port. A numeric `host` (the master or advertised address) is checked to be this
// machine's first, as the hosted store would be bound to it.
std::pair<int, std::uint16_t> reserve_port(asio::io_context& io, const std::string& host, std::uint16_t port,
                                           boost::system::error_code& ec) {
  using asio::ip::tcp;
  const asio::ip::address addr = asio::ip::make_address(host, ec);
  if (ec) return {-1, 0};
  if (!addr.is_unspecified()) {
    tcp::acceptor probe(io);
    probe.open(tcp::endpoint(addr, 0).protocol(), ec);
    if (!ec) probe.bind(tcp::endpoint(addr, 0), ec);
    if (ec) return {-1, 0};
  }
  auto r = bind_reserved(io, tcp::endpoint(asio::ip::address_v6::any(), port), ec);
  if (ec && (ec == asio::error::address_family_not_supported || ec == boost::system::errc::address_not_available)) {
    r = bind_reserved(io, tcp::endpoint(asio::ip::address_v4::any(), port), ec);
  }
  return r;
}

std::string reserve_hint(const boost::system::error_code& ec) {
  if (ec == asio::error::address_in_use) return "port in use";
  if (ec == boost::system::errc::address_not_available) return "the address is not one of this machine's";
  if (ec == asio::error::access_denied) return "ports below 1024 need privileges: pick a port >= 1024 or use 0";
  return "check the address and the port";
}

}  // namespace

std::unique_ptr<rendezvous::StoreServer> host_worker_store(asio::io_context& io, const std::string& addr,
                                                           std::uint16_t port, bool name_port,
                                                           const std::string& hint) {
  rendezvous::StoreServerOptions opts;
  opts.host = bind_host(addr);
  opts.port = port;
  std::unique_ptr<rendezvous::StoreServer> store;
  try {
    store = std::make_unique<rendezvous::StoreServer>(io, opts);
  } catch (const Error& e) {
    throw worker_store_error("host the worker store", addr, opts.host, port, name_port, hint, e.message(), e.hint());
  }
  store->start();
  spdlog::debug("worker store listening on {}:{}", store->host(), store->port());
  return store;
}

WorkerStore::WorkerStore(std::unique_ptr<rendezvous::StoreServer> server)
    : server_(std::move(server)), port_(server_->port()) {}

WorkerStore::WorkerStore(int reserved_fd, std::uint16_t port) : reserved_fd_(reserved_fd), port_(port) {}

WorkerStore::~WorkerStore() { stop(); }

void WorkerStore::reset() {
  if (server_) server_->reset();
}

void WorkerStore::stop() {
  if (server_) server_->stop();
  if (reserved_fd_ >= 0) {
    ::close(reserved_fd_);
    reserved_fd_ = -1;
  }
}

std::unique_ptr<WorkerStore> open_worker_store(asio::io_context& io, const std::string& addr, std::uint16_t port,
                                               bool hosted, bool name_port, const std::string& hint) {
  if (hosted) return std::make_unique<WorkerStore>(host_worker_store(io, addr, port, name_port, hint));
  const std::string host = bind_host(addr);
  boost::system::error_code ec;
  const auto [fd, bound] = reserve_port(io, host, port, ec);
  if (fd < 0) {
    throw worker_store_error("reserve the port of the workers' store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)", addr,
                             host, port, name_port, hint, ec.message(), reserve_hint(ec));
  }
  spdlog::debug("workers' store: rank 0 hosts it on port {} (reserved by the agent on every address)", bound);
  return std::make_unique<WorkerStore>(fd, bound);
}

std::unique_ptr<RendezvousBackend> make_single_node_backend(asio::io_context& io, const AgentConfig& config,
                                                            BackendEvents events) {
  return std::make_unique<SingleNodeBackend>(io, config, std::move(events));
}

}  // namespace ddprun::agent
