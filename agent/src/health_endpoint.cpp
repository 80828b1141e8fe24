// The agent's HTTP health endpoint; see health_endpoint.hpp.
#include "ddprun/agent/health_endpoint.hpp"

#include <unistd.h>

#include <boost/asio/ip/v6_only.hpp>
#include <boost/asio/read_until.hpp>
#include <boost/asio/streambuf.hpp>
#include <boost/asio/write.hpp>
#include <boost/json.hpp>
#include <memory>
#include <spdlog/spdlog.h>

#include "ddprun/common/error.hpp"

namespace asio = boost::asio;
using asio::ip::tcp;

namespace ddprun::agent {

namespace {

std::int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

constexpr std::size_t kMaxRequestBytes = 8192;
constexpr auto kIoTimeout = std::chrono::seconds(5);

}  // namespace

// One connection: read the request head (bounded in size and time), answer, close.
struct HealthEndpoint::Connection {
  Connection(tcp::socket s, asio::io_context& io) : socket(std::move(s)), deadline(io), request(kMaxRequestBytes) {}
  tcp::socket socket;
  asio::steady_timer deadline;
  asio::streambuf request;
  std::string answer;
  std::uint64_t id = 0;
  bool closed = false;
};

HealthEndpoint::HealthEndpoint(asio::io_context& io, std::uint16_t port, std::chrono::seconds timeout)
    : io_(io), acceptor_(io), ticker_(io), retry_(io), timeout_(timeout) {
  boost::system::error_code ec;
  const tcp::endpoint ep(tcp::v6(), port);
  acceptor_.open(ep.protocol(), ec);
  if (!ec) {
    acceptor_.set_option(asio::ip::v6_only(false), ec);
    acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    acceptor_.bind(ep, ec);
  }
  if (ec) {  // no IPv6: IPv4 only
    boost::system::error_code ignored;
    acceptor_.close(ignored);
    ec.clear();
    const tcp::endpoint ep4(tcp::v4(), port);
    acceptor_.open(ep4.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(ep4, ec);
  }
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    throw NetworkError("cannot serve the health endpoint on port " + std::to_string(port) +
                           " (TORCHELASTIC_HEALTH_CHECK_PORT): " + ec.message(),
                       "pick a free port, or unset TORCHELASTIC_HEALTH_CHECK_PORT");
  }
  port_ = acceptor_.local_endpoint().port();
  last_progress_ = std::chrono::steady_clock::now();
  last_progress_unix_ = unix_seconds();
}

HealthEndpoint::~HealthEndpoint() { stop(); }

void HealthEndpoint::start() {
  spdlog::info("health endpoint: http://0.0.0.0:{}/ (TORCHELASTIC_HEALTH_CHECK_PORT)", port_);
  accept();
  tick();
}

void HealthEndpoint::stop() {
  if (stopped_) return;
  stopped_ = true;
  boost::system::error_code ignored;
  acceptor_.close(ignored);
  ticker_.cancel();
  retry_.cancel();
  auto open = connections_;
  for (auto& [id, c] : open) close(c);
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

std::string HealthEndpoint::response(bool alive, std::int64_t last_progress_time, pid_t pid, std::uint64_t round,
                                     const std::string& state) {
  boost::json::object o;
  o["status"] = alive ? "alive" : "stale";
  o["last_progress_time"] = last_progress_time;
  o["pid"] = static_cast<std::int64_t>(pid);
  o["round"] = round;
  o["state"] = state;
  const std::string body = boost::json::serialize(o) + "\n";
  return std::string(alive ? "HTTP/1.1 200 OK\r\n" : "HTTP/1.1 503 Service Unavailable\r\n") +
         "Content-Type: application/json\r\nConnection: close\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\n\r\n" + body;
}

void HealthEndpoint::accept() {
  acceptor_.async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || stopped_) return;
    if (ec) {
      // Out of descriptors (EMFILE) or memory: the connection stays queued, so accepting again at
      // once would spin, and giving up would leave the port dead. Retry after a pause.
      spdlog::warn("health endpoint: accept failed on port {}: {}; retrying in 1 s", port_, ec.message());
      retry_.expires_after(std::chrono::seconds(1));
      retry_.async_wait([this](const boost::system::error_code& tec) {
        if (!tec && !stopped_) accept();
      });
      return;
    }
    serve(std::move(socket));
    accept();
  });
}

void HealthEndpoint::serve(tcp::socket socket) {
  if (connections_.size() >= kMaxConnections) {
    // Idle connections must not pin the agent's descriptors: one beyond the limit is closed at
    // once (a probe retries; each held one is cut off after 5 s).
    ++rejected_;
    boost::system::error_code ignored;
    socket.close(ignored);
    return;
  }
  auto c = std::make_shared<Connection>(std::move(socket), io_);
  c->id = next_id_++;
  connections_.emplace(c->id, c);
  c->deadline.expires_after(kIoTimeout);  // a client that never sends its request or never reads
  c->deadline.async_wait([this, c](const boost::system::error_code& ec) {
    if (!ec && !c->closed) close(c);
  });
  asio::async_read_until(c->socket, c->request, "\r\n\r\n", [this, c](const boost::system::error_code&, std::size_t) {
    if (c->closed) return;
    // Whatever came (a full head, a bare "GET /\n" then EOF, an oversized head): answer it.
    const bool alive = std::chrono::steady_clock::now() - last_progress_ <= timeout_;
    c->answer = response(alive, last_progress_unix_, ::getpid(), round_, state_);
    asio::async_write(c->socket, asio::buffer(c->answer), [this, c](const boost::system::error_code&, std::size_t) {
      if (!c->closed) close(c);
    });
  });
}

void HealthEndpoint::close(const std::shared_ptr<Connection>& c) {
  if (c->closed) return;
  c->closed = true;
  boost::system::error_code ignored;
  c->deadline.cancel();
  c->socket.shutdown(tcp::socket::shutdown_both, ignored);
  c->socket.close(ignored);
  connections_.erase(c->id);
}

}  // namespace ddprun::agent
