// The agent's HTTP health endpoint; see health_endpoint.hpp. The bind (every interface, IPv4
// when there is no IPv6) is ours; connections are served by the common http::Server.
#include "ddprun/agent/health_endpoint.hpp"

#include <unistd.h>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ip/v6_only.hpp>
#include <boost/json.hpp>
#include <memory>
#include <spdlog/spdlog.h>
#include <utility>

#include "ddprun/common/error.hpp"

namespace asio = boost::asio;
using asio::ip::tcp;

namespace ddprun::agent {

namespace {

std::int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Every interface: dual-stack IPv6, or IPv4 only where the host has no IPv6.
tcp::acceptor listen_on(asio::io_context& io, std::uint16_t port) {
  tcp::acceptor acceptor(io);
  boost::system::error_code ec;
  const tcp::endpoint ep(tcp::v6(), port);
  acceptor.open(ep.protocol(), ec);
  // Each step checked: a socket left IPv6-only (dual stack refused) would not answer the IPv4
  // probes of a kubelet; it falls back to IPv4 as where there is no IPv6.
  if (!ec) acceptor.set_option(asio::ip::v6_only(false), ec);
  if (!ec) acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor.bind(ep, ec);
  if (ec) {  // no IPv6 (or no dual stack): IPv4 only
    boost::system::error_code ignored;
    acceptor.close(ignored);
    ec.clear();
    const tcp::endpoint ep4(tcp::v4(), port);
    acceptor.open(ep4.protocol(), ec);
    if (!ec) acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor.bind(ep4, ec);
  }
  if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    throw NetworkError("cannot serve the health endpoint on port " + std::to_string(port) +
                           " (TORCHELASTIC_HEALTH_CHECK_PORT): " + ec.message(),
                       "pick a free port, or unset TORCHELASTIC_HEALTH_CHECK_PORT");
  }
  return acceptor;
}

std::string body_of(bool alive, std::int64_t last_progress_time, pid_t pid, std::uint64_t round,
                    const std::string& state) {
  boost::json::object o;
  o["status"] = alive ? "alive" : "stale";
  o["last_progress_time"] = last_progress_time;
  o["pid"] = static_cast<std::int64_t>(pid);
  o["round"] = round;
  o["state"] = state;
  return boost::json::serialize(o) + "\n";
}

}  // namespace

HealthEndpoint::HealthEndpoint(asio::io_context& io, std::uint16_t port, std::chrono::seconds timeout)
    : ticker_(io), timeout_(timeout) {
  http::Options options;
  options.name = "health endpoint";
  options.limits = http::Limits{8192, std::chrono::seconds(5), kMaxConnections};
  // Whatever came (a full head of any method and path, a bare "GET /\n" then EOF, an oversized
  // head): answer it.
  options.fallback = [this](const http::Request&) { return answer(); };
  server_ = std::make_unique<http::Server>(listen_on(io, port), std::move(options));
  last_progress_ = std::chrono::steady_clock::now();
  last_progress_unix_ = unix_seconds();
}

HealthEndpoint::~HealthEndpoint() { stop(); }

void HealthEndpoint::start() {
  spdlog::info("health endpoint: http://0.0.0.0:{}/ (TORCHELASTIC_HEALTH_CHECK_PORT)", port());
  server_->start();
  tick();
}

void HealthEndpoint::stop() {
  if (stopped_) return;
  stopped_ = true;
  ticker_.cancel();
  server_->stop();
}

void HealthEndpoint::set_state(std::string state, std::uint64_t round) {
  state_ = std::move(state);
  round_ = round;
}

void HealthEndpoint::tick() {
  last_progress_ = std::chrono::steady_clock::now();
  last_progress_unix_ = unix_seconds();
  ticker_.expires_after(std::chrono::seconds(1));
  ticker_.async_wait([this](const boost::system::error_code& ec) {
    if (!ec && !stopped_) tick();
  });
}

http::Response HealthEndpoint::answer() const {
  const bool alive = std::chrono::steady_clock::now() - last_progress_ <= timeout_;
  return http::Response{alive ? 200 : 503, "application/json",
                        body_of(alive, last_progress_unix_, ::getpid(), round_, state_)};
}

std::string HealthEndpoint::response(bool alive, std::int64_t last_progress_time, pid_t pid, std::uint64_t round,
                                     const std::string& state) {
  return http::format_response(
      http::Response{alive ? 200 : 503, "application/json", body_of(alive, last_progress_time, pid, round, state)});
}

}  // namespace ddprun::agent
