// MetricsHttpServer (metrics_http.hpp has the contract). One Asio acceptor; each connection
// reads its request head into a capped buffer under a deadline, answers once and closes.
#include "ddprun/common/metrics_http.hpp"

#include <spdlog/spdlog.h>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ip/v6_only.hpp>
#include <boost/asio/read_until.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/streambuf.hpp>
#include <boost/asio/write.hpp>
#include <map>
#include <string_view>

#include "ddprun/common/endpoint.hpp"
#include "ddprun/common/error.hpp"

namespace ddprun::metrics {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

namespace {

struct Connection {
  Connection(asio::io_context& io, tcp::socket s, std::size_t max_bytes)
      : socket(std::move(s)), timer(io), in(max_bytes) {}
  tcp::socket socket;
  asio::steady_timer timer;
  asio::streambuf in;
  std::string reply;
  std::uint64_t id = 0;
  bool closed = false;
};

std::string response(int code, std::string_view reason, std::string_view content_type, std::string_view body) {
  std::string out = "HTTP/1.1 " + std::to_string(code) + " " + std::string(reason) + "\r\n";
  out += "Content-Type: " + std::string(content_type) + "\r\n";
  out += "Content-Length: " + std::to_string(body.size()) + "\r\n";
  out += "Connection: close\r\n\r\n";
  out += body;
  return out;
}

std::string plain(int code, std::string_view reason, std::string_view text) {
  return response(code, reason, "text/plain; charset=utf-8", std::string(text) + "\n");
}

}  // namespace

struct MetricsHttpServer::Impl : std::enable_shared_from_this<Impl> {
  Impl(asio::io_context& io_, std::function<std::string()> render_, MetricsHttpLimits limits_)
      : io(io_), acceptor(io_), retry(io_), render(std::move(render_)), limits(limits_) {}

  asio::io_context& io;
  tcp::acceptor acceptor;
  asio::steady_timer retry;  // re-arms accept after a failed one
  std::function<std::string()> render;
  MetricsHttpLimits limits;
  std::map<std::uint64_t, std::shared_ptr<Connection>> connections;
  std::uint64_t next_id = 1;
  std::uint16_t bound_port = 0;
  bool stopped = false;
  MetricsHttpStats stats;

  void bind(const std::string& host, std::uint16_t port) {
    boost::system::error_code ec;
    asio::ip::address addr = asio::ip::make_address(host, ec);
    if (ec) {
      throw NetworkError("cannot listen for metrics on " + bracket_host(host) + ":" + std::to_string(port) + ": '" +
                             host + "' is not an IP address",
                         "pass an IP address with --metrics-host, e.g. 127.0.0.1 or 0.0.0.0");
    }
    const tcp::endpoint ep(addr, port);
    acceptor.open(ep.protocol(), ec);
    if (!ec && addr.is_v6()) acceptor.set_option(asio::ip::v6_only(false), ec);
    if (!ec) acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor.bind(ep, ec);
    if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      throw NetworkError(
          "cannot listen for metrics on " + bracket_host(host) + ":" + std::to_string(port) + ": " + ec.message(),
          "pick another --metrics-port, or 0 for a free one");
    }
    bound_port = acceptor.local_endpoint().port();
  }

  void do_accept() {
    if (stopped) return;
    acceptor.async_accept([self = shared_from_this()](boost::system::error_code ec, tcp::socket socket) {
      if (self->stopped || ec == asio::error::operation_aborted) return;
      if (!ec) {
        self->on_accept(std::move(socket));
        self->do_accept();
        return;
      }
      // Out of descriptors or memory: the pending connection stays queued, so accepting again
      // at once would spin. Retry after a pause; scrapes are not latency-critical.
      spdlog::warn("metrics: accept failed: {}; retrying in 1 s", ec.message());
      self->retry.expires_after(std::chrono::seconds(1));
      self->retry.async_wait([self](boost::system::error_code tec) {
        if (!tec && !self->stopped) self->do_accept();
      });
    });
  }

  void on_accept(tcp::socket socket) {
    boost::system::error_code ec;
    if (connections.size() >= limits.max_connections) {
      ++stats.rejected;
      spdlog::debug("metrics: closing a connection: {} scrapes already open", limits.max_connections);
      socket.close(ec);
      return;
    }
    auto c = std::make_shared<Connection>(io, std::move(socket), limits.max_request_bytes);
    c->id = next_id++;
    connections.emplace(c->id, c);
    c->timer.expires_after(limits.read_timeout);
    c->timer.async_wait([self = shared_from_this(), c](boost::system::error_code tec) {
      if (tec || c->closed) return;
      ++self->stats.rejected;
      spdlog::debug("metrics: closing a connection: no complete request within {} ms",
                    self->limits.read_timeout.count());
      self->close(c);
    });
    asio::async_read_until(
        c->socket, c->in, "\r\n\r\n",
        [self = shared_from_this(), c](boost::system::error_code rec, std::size_t n) { self->on_head(c, rec, n); });
  }

  void on_head(const std::shared_ptr<Connection>& c, boost::system::error_code ec, std::size_t n) {
    if (c->closed || stopped) return;
    c->timer.cancel();
    if (ec == asio::error::not_found) {  // the head filled the capped buffer
      ++stats.rejected;
      answer(c, plain(431, "Request Header Fields Too Large",
                      "request head over " + std::to_string(limits.max_request_bytes) + " bytes"));
      return;
    }
    if (ec) {
      close(c);
      return;
    }
    const std::string head(asio::buffers_begin(c->in.data()), asio::buffers_begin(c->in.data()) + static_cast<long>(n));
    const std::string_view line = std::string_view(head).substr(0, head.find("\r\n"));
    const auto sp1 = line.find(' ');
    const auto sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
    if (sp2 == std::string_view::npos || !line.substr(sp2 + 1).starts_with("HTTP/1.")) {
      ++stats.rejected;
      answer(c, plain(400, "Bad Request", "expected 'GET /metrics HTTP/1.1'"));
      return;
    }
    const std::string_view method = line.substr(0, sp1);
    std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
    target = target.substr(0, target.find('?'));
    if (target != "/metrics") {
      ++stats.rejected;
      answer(c, plain(404, "Not Found", "only /metrics is served here"));
      return;
    }
    if (method != "GET") {
      ++stats.rejected;
      answer(c, plain(405, "Method Not Allowed", "only GET is served here"));
      return;
    }
    ++stats.scrapes;
    answer(c, response(200, "OK", "text/plain; version=0.0.4; charset=utf-8", render()));
  }

  void answer(const std::shared_ptr<Connection>& c, std::string reply) {
    c->reply = std::move(reply);
    // The write is bounded too: a client that never reads is cut off after read_timeout.
    c->timer.expires_after(limits.read_timeout);
    c->timer.async_wait([self = shared_from_this(), c](boost::system::error_code tec) {
      if (!tec) self->close(c);
    });
    asio::async_write(c->socket, asio::buffer(c->reply),
                      [self = shared_from_this(), c](boost::system::error_code, std::size_t) { self->close(c); });
  }

  void close(const std::shared_ptr<Connection>& c) {
    if (c->closed) return;
    c->closed = true;
    boost::system::error_code ec;
    c->timer.cancel();
    c->socket.shutdown(tcp::socket::shutdown_both, ec);
    c->socket.close(ec);
    connections.erase(c->id);
  }

  void stop() {
    if (stopped) return;
    stopped = true;
    boost::system::error_code ec;
    acceptor.close(ec);
    retry.cancel();
    auto open = connections;
    for (auto& [id, c] : open) close(c);
  }
};

MetricsHttpServer::MetricsHttpServer(asio::io_context& io, const std::string& host, std::uint16_t port,
                                     std::function<std::string()> render, MetricsHttpLimits limits)
    : impl_(std::make_shared<Impl>(io, std::move(render), limits)) {
  impl_->bind(host, port);
}

MetricsHttpServer::~MetricsHttpServer() { stop(); }

void MetricsHttpServer::start() { impl_->do_accept(); }
void MetricsHttpServer::stop() { impl_->stop(); }
std::uint16_t MetricsHttpServer::port() const { return impl_->bound_port; }
MetricsHttpStats MetricsHttpServer::stats() const { return impl_->stats; }

}  // namespace ddprun::metrics
